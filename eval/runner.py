"""Run methods over a market's tasks: every episode goes through ``create_agent`` + ``BudgetGuard``.

``run_benchmark(config)`` runs the methods one after another (each over all tasks, with a
thread pool of ``workers``), appends one :class:`EpisodeResult` per episode to
``episodes.jsonl`` (so an interrupted run resumes where it stopped), writes the guard's
interaction logs to ``logs.jsonl`` (``intent.logs`` schema, for training), and finally
``results.json`` and ``results.md``.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from langchain.agents import create_agent
from langchain.agents.middleware import AgentMiddleware
from langchain_core.messages import AIMessage, ToolMessage

from eval.code_version import code_version
from eval.episode_log import ATTEMPT_FIELD, AttemptLogSink, attempt_of
from eval.episode_log import episode_id as logged_episode_id
from eval.markets import BenchMarket, EnvironmentUnavailableError, EpisodeEnv, follow_market_events
from eval.method_spec import (DEFAULT_DELTA, DEFAULT_GAMMA, DEFAULT_MAX_DEPTH, SYSTEM_PROMPT, MethodContext,
                              MethodSpec, positive_int_option, rollout_depth)
from eval.methods import get_method
from eval.results import EpisodeResult, ResultStore
from intent.errors import GuardConfigError, UsageError
from intent.feedback import SHORT_FEEDBACK_CHARS, check_feedback_chars
from intent.guard import LEDGER_KEY, BudgetGuard
from intent.logs import FanoutLogSink, JsonlLogSink, LogSink, MemoryLogSink

__all__ = ["SYSTEM_PROMPT", "BenchConfig", "HarnessError", "run_benchmark", "run_episode"]

AgentFactory = Callable[[EpisodeEnv, int], Any]


class HarnessError(RuntimeError):
    """The benchmark itself went wrong (e.g. a proposed tool call got no answer): the run stops,
    because every number it would print is suspect."""


TURN_LIMIT_TEXT = "Model call limits exceeded"  # ModelCallLimitMiddleware's final message
DEFAULT_MAX_TURNS = 30


def _max_turns(options: dict[str, Any] | None) -> int:
    return positive_int_option(options, "max_turns", DEFAULT_MAX_TURNS, flag="--max-turns",
                               meaning="model calls per episode of a real-LLM agent")


def _is_simulated(model: Any) -> bool:
    from eval.agents.simulated import SimulatedAgent

    return isinstance(model, SimulatedAgent)


@dataclass
class BenchConfig:
    market: str = "synthetic"
    methods: Sequence[str] = ("raw", "prompt")
    agent: str = "sim"
    tasks: int = 100
    workers: int = 2
    seed: int = 0
    out: str = "runs/bench"
    reference: str | None = None  # None: prompt when it is among the methods, else the first method
    event_rate: float = 0.0
    budget: float | None = None
    budget_scale: float = 1.0
    relevant_price_scale: float = 1.0
    options: dict[str, Any] = field(default_factory=dict)


class _MarketEvents(AgentMiddleware):
    """Applies CostBench-style market events to the guard's view of this episode."""

    def __init__(self, guard: BudgetGuard, episode_id: str, market_now: Callable[[], Any]) -> None:
        super().__init__()
        self.guard, self.episode_id, self.market_now = guard, episode_id, market_now

    def before_model(self, state: Any, runtime: Any) -> None:
        follow_market_events(self.guard, self.episode_id, self.market_now)
        return None


def _count_records(result: EpisodeResult, records: list[Any]) -> None:
    """The episode's calls, refusals and decision times from its log records (also for a crash)."""
    # Tool runs only: a charge for the oracle's own tokens (--charge-oracle, kind "oracle") is money the episode
    # spent (in ``cost``, so in AC) but no call of a tool, so it is neither in the calls nor in AP's prices.
    executed = [r for r in records if r.kind == "tool"
                and (r.charged > 0 or (r.decision == "accept" and r.status in ("ok", "error")))]
    result.n_calls = len(executed)
    result.price_sum = sum(r.charged for r in executed)
    result.n_rejected = sum(r.decision == "reject" for r in records)
    result.n_invalid = sum(r.decision == "invalid" for r in records)
    result.oracle_errors = sum(r.reason == "oracle_error" for r in records)
    result.decision_ms = [round(r.decision_ms, 4) for r in records if r.is_gate_decision]


def run_episode(
    spec: MethodSpec,
    env: EpisodeEnv,
    seed: int,
    agent_factory: AgentFactory,
    *,
    log_sink: LogSink | None = None,
    options: dict[str, Any] | None = None,
    resources: Any = None,
    attempt: int | None = None,
) -> EpisodeResult:
    """One episode. ``attempt``: the run directory's attempt number (eval/episode_log.py), marked on every record
    written to ``log_sink`` and saved in the result's ``extra["attempt"]``, so that readers of the log select
    this attempt's records by it; it changes nothing the episode does."""
    episode_id = logged_episode_id(spec.name, env.task_id, seed)
    if attempt is not None and log_sink is not None:
        log_sink = AttemptLogSink(log_sink, attempt)
    records = MemoryLogSink()
    model = agent_factory(env, seed)
    oracle = spec.build(MethodContext(env=env, seed=seed, options=dict(options or {}), model=model,
                                      simulated_agent=_is_simulated(model), resources=resources))
    audit = None
    if spec.enforce and env.ground_truth is not None:
        # Exact decision regret beside the oracle under test (synthetic market only); the audit
        # reads the ground truth after each decision and never changes one.
        from eval.optimal import DecisionAudit

        oracle = audit = DecisionAudit(oracle, env.ground_truth)
    # The benchmark's agents see a failed tool as an error message (money spent is spent).
    charged: dict[str, Any] = {}
    oracle_price = (options or {}).get("charge_oracle")
    if oracle_price is not None and spec.enforce:
        # The oracle's own tokens paid from the same budget (issue 14): every token at this price
        # per million, in the market's money (an assumption stated in the run's config).
        from intent import ModelPrice

        charged = {"model_prices": {"oracle-model": ModelPrice(oracle_price, oracle_price)},
                   "charge_oracle": True, "oracle_model": "oracle-model", "charge_models": False,
                   "oracle_max_tokens": (options or {}).get("oracle_max_tokens")}
    guard = BudgetGuard(oracle, env.market, env.budget, enforce=spec.enforce, tool_errors="message",
                        log_sink=FanoutLogSink([records, log_sink]) if log_sink else records,
                        feedback_chars=(options or {}).get("feedback_chars"), **charged)
    middleware: list[Any] = [guard.middleware()]
    if not _is_simulated(model):
        from langchain.agents.middleware import ModelCallLimitMiddleware

        from eval.agents.context_full import StopWhenContextFull

        # Outermost: a full context ends the episode, no crash. Then LangChain's own call limit: a
        # real model stuck in a loop (a 0.5B model called "budget status" as a tool for 35 turns)
        # ends without an answer after --max-turns model calls instead of hitting LangGraph's
        # recursion limit (a crash).
        middleware[:0] = [StopWhenContextFull(),
                          ModelCallLimitMiddleware(run_limit=_max_turns(options), exit_behavior="end")]
    if env.market_now is not None:
        middleware.insert(0, _MarketEvents(guard, episode_id, env.market_now))
    result = EpisodeResult(method=spec.name, task_id=env.task_id, seed=seed, group=env.group,
                           solvable=env.solvable, budget=env.budget)
    started = time.perf_counter()
    extra: dict[str, Any] = {}
    try:
        if spec.episode is not None:
            messages, answer, extra = spec.episode(env, model, guard, episode_id)
            ledger = guard.ledger({LEDGER_KEY: extra.pop("ledger_channel", None)})
        else:
            agent = create_agent(model, env.tools, middleware=middleware, system_prompt=SYSTEM_PROMPT)
            out = agent.invoke({"messages": [("user", env.query)]},
                               {"configurable": {"thread_id": episode_id}, "recursion_limit": 200,
                                # One episode's parallel tool calls run one at a time, in the order
                                # the model proposed them: what each call sees (the budget status, the
                                # environment's call counters, the oracle's caches) must not depend
                                # on thread timing. Episodes still run in parallel across workers.
                                "max_concurrency": 1})
            messages = out["messages"]
            last = messages[-1] if messages else None
            answer = str(last.content) if isinstance(last, AIMessage) and not last.tool_calls else None
            ledger = guard.ledger(out)
            extra["proposed_calls"], extra["answered_calls"] = _calls_and_answers(messages)
            from eval.agents.context_full import ended_on_full_context

            if ended_on_full_context(messages):
                extra["context_full"] = True
            if answer is not None and answer.startswith(TURN_LIMIT_TEXT):
                extra["turn_limit"], answer = True, None  # LangChain's limit message is not an answer
        if env.environment_failures:
            # The environment's endpoint failed (see EpisodeEnv.environment_failures): the episode is a
            # crash, listed and re-run on resume, never a feasible or solved one.
            raise EnvironmentUnavailableError.of(env)
    except Exception as exc:  # noqa: BLE001 - a crashed episode is recorded, counted as failed and listed
        result.error = f"{type(exc).__name__}: {exc}"
        result.wall_s = time.perf_counter() - started
        # What it spent before it crashed is known (the guard's working ledger, and its log
        # records, which agree by construction): a crash never hides a charge.
        working = guard.episodes.peek(episode_id)
        result.cost = working.ledger.spent if working is not None else sum(r.charged for r in records.records)
        _count_records(result, records.records)
        if audit is not None and audit.regrets:
            # The decisions it made before the crash were audited: their regret counts (an oracle that
            # crashes on hard tasks must not look better for it). One that crashed before any decision
            # has none; the table says over how many episodes Regret is computed then.
            # The pooled split by kind and reason too, so that it covers the same decisions as Regret.
            result.extra = {"decision_regret": sum(audit.regrets) / len(audit.regrets),
                            "decisions_audited": len(audit.regrets), "regret_up_to_crash": True, **audit.split()}
        if attempt is not None:
            result.extra[ATTEMPT_FIELD] = attempt
        return result
    if "proposed_calls" not in extra or "answered_calls" not in extra:
        raise HarnessError(f"method {spec.name!r}: its episode loop must report proposed_calls and answered_calls")
    result.proposed_calls = int(extra.pop("proposed_calls"))
    result.answered_calls = int(extra.pop("answered_calls"))
    if result.proposed_calls != result.answered_calls:
        raise HarnessError(f"{episode_id}: {result.proposed_calls} tool calls proposed but {result.answered_calls} "
                           "answered; every proposed call must get exactly one ToolMessage (an agent reusing call "
                           "ids, or a middleware dropping answers?)")
    result.wall_s = time.perf_counter() - started
    result.answered = bool(answer)
    # A tree search is judged on the branch it returned (its siblings ran in the same environment).
    judge = env.judge_branch(messages) if spec.episode is not None and env.judge_branch is not None else env.judge
    result.passed = judge(answer)
    judge_runs = list(getattr(judge, "runs", None) or [])
    result.cost = ledger.spent
    _count_records(result, records.records)
    decisions = [r.decision for r in records.records if r.is_gate_decision]
    # Whether the episode's first gate decision was a refusal (BTP's plan must be in force from
    # the first model call, so its first proposal should rarely be refused).
    extra["opened_with_rejection"] = bool(decisions) and decisions[0] == "reject"
    result.agent_tokens = int(extra.pop("agent_tokens", 0)) or sum(
        (m.usage_metadata or {}).get("total_tokens", 0) for m in messages if isinstance(m, AIMessage))
    totals = oracle.episode_usage(episode_id) if hasattr(oracle, "episode_usage") else None
    result.oracle_tokens = int(totals.get("tokens", 0) if totals is not None
                               else sum(r.oracle_usage.get("tokens", 0) for r in records.records))
    usage_sums: dict[str, float] = {}
    for rec in records.records:
        for key, value in rec.oracle_usage.items():
            usage_sums[key] = usage_sums.get(key, 0.0) + float(value)
    if audit is not None:
        extra["decision_regret"] = (sum(audit.regrets) / len(audit.regrets)) if audit.regrets else None
        extra["decisions_audited"] = len(audit.regrets)
        extra.update(audit.split())
    extra["oracle_charged"] = sum(r.charged for r in records.records if r.kind == "oracle")
    result.extra = {"tool_messages": sum(isinstance(m, ToolMessage) for m in messages),
                    "oracle_usage": usage_sums, **({"judge_runs": judge_runs} if judge_runs else {}),
                    "environment": env.environment, **extra}
    if attempt is not None:
        result.extra[ATTEMPT_FIELD] = attempt
    return result


def _calls_and_answers(messages: Sequence[Any]) -> tuple[int, int]:
    """Tool calls the model proposed, and those of them answered by exactly one ToolMessage after
    the message that proposed them (an id reused by a later message is a new call)."""
    proposed = answered = 0
    open_calls: set[str] = set()
    for m in messages:
        if isinstance(m, AIMessage):
            open_calls = {c["id"] for c in m.tool_calls}
            proposed += len(m.tool_calls)
        elif isinstance(m, ToolMessage) and m.tool_call_id in open_calls:
            open_calls.discard(m.tool_call_id)  # a second answer to the same call does not count
            answered += 1
    return proposed, answered


def sim_agent_factory(config: dict[str, Any] | None = None) -> AgentFactory:
    from eval.agents.simulated import SimAgentConfig, SimulatedAgent

    cfg = SimAgentConfig(**(config or {}))

    def build(env: EpisodeEnv, seed: int) -> Any:
        return SimulatedAgent(view=env.view, config=cfg, seed=seed)

    return build


def build_market(config: BenchConfig) -> BenchMarket:
    if config.market == "synthetic":
        from eval.markets import SyntheticBenchMarket

        return SyntheticBenchMarket(config.tasks, config.seed, event_rate=config.event_rate,
                                    budget=config.budget,
                                    budget_scale=config.budget_scale,
                                    relevant_price_scale=config.relevant_price_scale)
    if config.market == "synthetic-v2":
        from eval.markets import SyntheticV2BenchMarket

        return SyntheticV2BenchMarket(config.tasks, config.seed, event_rate=config.event_rate,
                                      budget=config.budget, budget_scale=config.budget_scale,
                                      relevant_price_scale=config.relevant_price_scale)
    if config.market == "stabletoolbench":
        from eval.stb_market import StableToolBenchMarket

        return StableToolBenchMarket.from_config(config)
    raise UsageError(f"unknown market {config.market!r}; choose 'synthetic', 'synthetic-v2' or 'stabletoolbench'")


def validate(config: BenchConfig) -> list[MethodSpec]:
    from training.common import check_seed

    check_seed(config.seed)
    if config.tasks < 1:
        raise UsageError(f"--tasks must be >= 1, got {config.tasks}")
    if config.workers < 1:
        raise UsageError(f"--workers must be >= 1, got {config.workers}")
    if config.budget is not None and not (isinstance(config.budget, (int, float)) and 0 < config.budget < float("inf")):
        raise UsageError(f"--budget must be a finite number > 0, got {config.budget!r}; leave it out to use each task's "
                         "own budget")
    if not config.methods:
        raise UsageError("--methods is empty; name at least one method, e.g. --methods raw,prompt")
    repeated = sorted({m for m in config.methods if list(config.methods).count(m) > 1})
    if repeated:
        raise UsageError(f"--methods names {', '.join(repeated)} more than once; list each method once (a method runs "
                         "every task once, and a second listing would run and time it twice)")
    runs = config.options.get("judge_runs")
    if runs is not None and (isinstance(runs, bool) or not isinstance(runs, int) or runs < 1):
        raise UsageError(f"--judge-runs is {runs!r}; give the SoPR judge's runs per answer, 1 or more (StableToolBench "
                         "uses 3)")
    # Checked before any episode (or the oracle logs' collection, hours with a real model) runs, and before
    # run_config.json claims the directory for this configuration.
    if not (isinstance(config.event_rate, (int, float)) and not isinstance(config.event_rate, bool)
            and 0 <= config.event_rate <= 1):
        raise UsageError(f"--event-rate must be a share of the tasks in [0, 1], got {config.event_rate!r}; "
                         "e.g. --event-rate 0.3, or leave it out for no market events")
    cap = config.options.get("feedback_chars")
    try:
        check_feedback_chars(cap)  # (the guard's own check, named here as the flag the user typed)
    except GuardConfigError:
        raise UsageError(f"--feedback-chars must be an integer >= {SHORT_FEEDBACK_CHARS} (characters of refusal "
                         f"notes per turn), got {cap!r}; leave it out for no cap") from None
    charge = config.options.get("charge_oracle")
    if charge is not None and (isinstance(charge, bool) or not isinstance(charge, (int, float))
                               or not 0 < charge < math.inf):
        raise UsageError(f"--charge-oracle is {charge!r}; give the oracle's price per million tokens, a finite "
                         "number > 0")
    if config.options.get("oracle_max_tokens") is not None:
        positive_int_option(config.options, "oracle_max_tokens", 0, flag="--oracle-max-tokens",
                            meaning="tokens held before each charged decision")
    from eval.agents.chat import check_rollout_max_tokens

    check_rollout_max_tokens(config.options.get("rollout_max_tokens"))
    _max_turns(config.options)
    rollout_depth(config.options)
    if config.options.get("rollout_max_tokens") is not None and config.agent in ("sim", "sim-llm"):
        raise UsageError(f"--rollout-max-tokens caps a chat model's rollout replies; the {config.agent!r} agent "
                         "writes no tokens. Use it with --agent openai:NAME, or leave it out")
    specs = [get_method(m) for m in config.methods]
    if _uses_oracle_models(specs):
        _check_oracle_options(config)
    if config.options.get("world_model") == "schema" and config.market.startswith("synthetic"):
        # Checked here, before run_config.json locks the directory (the oracle would refuse it at its first episode).
        raise UsageError(f"--world-model schema: the {config.market} market's environment has no simulator to use as "
                         "a world model (only StableToolBench's schema environment has one); drop --world-model or "
                         "use --world-model replay")
    if config.reference and config.reference not in config.methods:
        raise UsageError(f"--reference {config.reference!r} is not among --methods {list(config.methods)}; "
                         "leave it out to use prompt (when listed) or the first method")
    return specs


def _uses_oracle_models(specs: Sequence[MethodSpec]) -> bool:
    """Whether a method of the run needs the oracle models (their logs, a world model, a predictor)."""
    return any(s.needs_oracle_logs for s in specs)


def _check_oracle_options(config: BenchConfig) -> None:
    """The oracle methods' options, checked before the oracle logs' collection (hours with a real model)."""
    opts = config.options
    gamma, delta = opts.get("gamma", DEFAULT_GAMMA), opts.get("delta", DEFAULT_DELTA)
    if not (isinstance(gamma, (int, float)) and gamma > 0 and math.isfinite(gamma)):
        raise UsageError(f"--gamma is {gamma!r}; INTENT's risk factor is a number > 0 (the paper uses 0.5)")
    if not (isinstance(delta, (int, float)) and 0 <= delta < 1):
        raise UsageError(f"--delta is {delta!r}; INTENT's blacklist threshold is in [0, 1) (the paper uses 0.1)")
    directory = opts.get("predictor_dir")
    if directory and not Path(directory).is_dir():
        raise UsageError(f"--predictor-dir {directory} is not a directory; give an `intent train predictor` output "
                         "directory, or leave it out to train the predictor on the oracle logs")
    if directory:
        missing = [f for f in ("config.json", "calibration.json") if not (Path(directory) / f).is_file()]
        if missing:
            # A base encoder's directory loads too, with an untrained head (p about 0.5 for every call).
            raise UsageError(f"--predictor-dir {directory} has no {' or '.join(missing)}: it is not an `intent train "
                             "predictor` output; train one (intent train predictor --logs ... --out DIR) and pass DIR")
        if opts.get("predictor", "hashed") != "hashed":
            raise UsageError(f"--predictor {opts['predictor']} trains a predictor on the oracle logs and would ignore "
                             f"--predictor-dir {directory}; give one of the two")
    logs = opts.get("oracle_logs")
    if logs:
        path = Path(logs)
        if path.is_dir():
            raise UsageError(f"--oracle-logs {logs} is a directory; give the log file, e.g. {path / 'logs.jsonl'}")
        if not path.is_file():
            raise UsageError(f"--oracle-logs {logs} does not exist; leave it out to collect the logs in this run")


def _check_oracle_logs(config: BenchConfig, market: BenchMarket, specs: Sequence[MethodSpec]) -> None:
    """Given oracle logs must hold records, of this market's tools: the replay world model and the
    predictor of another market's logs know none of the calls they are asked about."""
    logs = config.options.get("oracle_logs")
    if not logs or not _uses_oracle_models(specs):
        return
    from eval.oracle_methods import _inner_task_id, logs_market
    from intent.logs import read_log

    collected_on = logs_market(logs)
    if collected_on is not None and collected_on != config.market:
        raise UsageError(f"--oracle-logs {logs} were collected on --market {collected_on}, not {config.market}: the "
                         f"oracle models would know another market's tools; collect them on --market {config.market} "
                         "(leave --oracle-logs out) or give that market's logs")
    cross_fit = bool(config.options.get("cross_fit", config.market == "stabletoolbench"))
    evaluated = set() if cross_fit else {market.task_id(t) for t in market.tasks()}
    tools: set[str] = set()
    # (The synthetic markets only: a StableToolBench episode may start an environment server.)
    for task in list(market.tasks())[:20] if config.market.startswith("synthetic") else ():
        tools |= {getattr(t, "name", "") for t in market.episode(task, config.seed).tools}
    logged: set[str] = set()
    known = False
    for record in read_log(logs):
        if evaluated and _inner_task_id(record.task_id) in evaluated:
            # Without cross-fitting every oracle model is built from all the logs: an evaluated task's own
            # episodes would inform the oracle that guards it.
            raise UsageError(f"--oracle-logs {logs} hold episodes of the evaluated task {_inner_task_id(record.task_id)}"
                             f" (seed {config.seed}): the oracle models must be built from other tasks; collect logs "
                             "on another --seed, or leave --oracle-logs out (the run collects them on a separate "
                             "task set)")
        if record.tool:
            logged.add(record.tool)
            known = known or not tools or record.tool in tools
    if known:
        return
    if not logged:
        raise UsageError(f"--oracle-logs {logs} holds no tool calls; collect logs on this market (leave the flag "
                         "out) or give a guard log of it")
    raise UsageError(f"--oracle-logs {logs} logs calls of tools this market does not have ({sorted(logged)[:3]}"
                     f"...; this market's are {sorted(tools)[:3]}...): logs of another market; collect them on "
                     f"--market {config.market} (leave --oracle-logs out) or give that market's logs")


def _check_predictor_dir(config: BenchConfig, market: BenchMarket, specs: Sequence[MethodSpec]) -> None:
    """A predictor given with --predictor-dir is used for every episode as it is (not folded): it must not
    have been trained or calibrated on an evaluated task. Its ``split.json`` (written by ``intent train
    predictor`` and by ``intent train report --encoder``) names the tasks of its training and dev splits.
    (Was: a predictor trained on this run's own tasks was used, and results.json said "built from other
    tasks".)"""
    directory = config.options.get("predictor_dir")
    if not directory or not _uses_oracle_models(specs):
        return
    split = Path(directory) / "split.json"
    if not split.is_file():
        return  # nothing says what it was trained on (results.json says "trained elsewhere, not folded")
    from eval.oracle_methods import _inner_task_id

    try:
        tasks = json.loads(split.read_text()).get("tasks") or {}
        seen = {_inner_task_id(str(t)) for name in ("train", "dev") for t in tasks.get(name) or ()}
    except (ValueError, AttributeError, TypeError) as exc:
        raise UsageError(f"--predictor-dir {directory}: {split} is not the split an `intent train predictor` "
                         f"writes ({exc}); retrain the predictor or restore the file") from exc
    leaked = sorted(seen & {market.task_id(t) for t in market.tasks()})
    if leaked:
        raise UsageError(f"--predictor-dir {directory} was trained on {len(leaked)} of the evaluated tasks (e.g. "
                         f"{leaked[0]}, seed {config.seed}; its split.json): the oracle's predictor must never have "
                         "seen the task it guards; train it on logs of other tasks (another --seed, or the run's "
                         "oracle_data/logs.jsonl), or leave --predictor-dir out")


def _oracle_models_label(config: BenchConfig, cross_fit: bool) -> str:
    label = "cross-fitted (2 folds)" if cross_fit else "built from other tasks"
    if config.options.get("predictor_dir"):
        label += f"; the predictor from --predictor-dir {config.options['predictor_dir']} (trained elsewhere, not folded)"
    return label


def default_reference(methods: Sequence[str]) -> str:
    """WR's reference when none is named: Prompt when it runs, else the first method."""
    return "prompt" if "prompt" in methods else methods[0]


def run_benchmark(config: BenchConfig, *, agent_factory: AgentFactory | None = None,
                  progress: bool = True, run_missing: bool = True) -> dict[str, Any]:
    """Run every (method, task) episode the run directory lacks (a crashed one again), then
    write and return the summary. ``run_missing=False`` only summarizes what is stored."""
    from eval.progress import progress as progress_bar

    from eval.metrics import compute_metrics, group_pass_rates, paired_pr_differences, paired_regret_differences
    from eval.report import write_reports

    specs = validate(config)
    if not config.reference:
        from dataclasses import replace

        config = replace(config, reference=default_reference(list(config.methods)))
    if agent_factory is None:
        if config.agent == "sim-llm":  # the pre-registered LLM-like simulated agent (issue 16)
            from eval.agents.llm_like import llm_agent_factory

            agent_factory = llm_agent_factory(config.options.get("sim_llm_agent"))
        elif config.agent != "sim":
            from eval.agents.chat import chat_agent_factory

            agent_factory = chat_agent_factory(config.agent, config.options)
            if config.options.get("rollout_max_tokens") is not None:
                from eval.agents.chat import with_reply_cap

                # Here, not when the first oracle is built: that comes after the oracle logs'
                # collection, hours with a real model.
                with_reply_cap(agent_factory(None, config.seed), config.options["rollout_max_tokens"])
        else:
            agent_factory = sim_agent_factory(config.options.get("sim_agent"))
    market = build_market(config)
    _check_oracle_logs(config, market, specs)
    _check_predictor_dir(config, market, specs)
    out = Path(config.out)
    if out.exists() and not out.is_dir():
        raise UsageError(f"--out {out} is a file; give a directory for the run's results")
    out.mkdir(parents=True, exist_ok=True)
    _check_config(out, config)
    if config.market == "stabletoolbench" and config.options.get("solvability", True):
        # OR's denominator, the paper's procedure: an exhaustive DFSDT search per query (cached in
        # OUT/solvability.json); it must exist before any episode records its ``solvable``.
        from eval.stabletoolbench.solvability import ensure_solvability

        ensure_solvability(market, agent_factory, seed=config.seed, agent_label=_agent_label(config.agent),
                           workers=config.workers, progress=progress)
    from eval.oracle_methods import OracleResources

    def collect(train_cfg: BenchConfig, agent_seed: int, sink: LogSink) -> None:
        import sys

        from eval.progress import progress as progress_bar

        train_market = build_market(train_cfg)
        prompt = get_method("prompt")
        tasks_ = list(train_market.tasks())
        if progress:
            # With a real model this is the long part of a first run: say what it is and how to skip it.
            print(f"Collecting the oracle models' training logs: the Prompt agent on {len(tasks_)} tasks "
                  f"({'the evaluation tasks, another agent seed; cross-fitted' if train_cfg.tasks == config.tasks and train_cfg.seed == config.seed else 'a separate task set'}) "
                  f"into {train_cfg.out}/logs.jsonl; reuse them later with --oracle-logs {train_cfg.out}/logs.jsonl",
                  file=sys.stderr, flush=True)
        with progress_bar(len(tasks_), "oracle logs", enabled=progress) as bar:
            for task in tasks_:
                run_episode(prompt, train_market.episode(task, agent_seed), agent_seed, agent_factory, log_sink=sink,
                            options=train_cfg.options)
                bar.update(1)

    resources = OracleResources(config, agent_factory=agent_factory, collect=collect)
    store = ResultStore(out / "episodes.jsonl")
    done = store.done()
    logs = JsonlLogSink(out / "logs.jsonl")
    timing_path = out / "timing.json"
    timing: dict[str, float] = json.loads(timing_path.read_text()) if timing_path.exists() else {}
    tasks = list(market.tasks())
    todos = {spec.name: [t for t in tasks if (spec.name, market.task_id(t), config.seed) not in done] if run_missing
             else [] for spec in specs}
    # One discarded episode first, so that import and first-call costs do not land on
    # whichever method happens to run first (the time ratios compare methods). Always Raw's, and
    # without the oracle resources, whatever the order of --methods: the warm-up never collects logs
    # or builds a model (that would be setup time lost from every table). Only for the simulated
    # agent: with a real endpoint a warm-up episode would cost real tokens.
    if config.agent in ("sim", "sim-llm") and any(todos.values()):
        run_episode(get_method("raw"), market.episode(tasks[0], config.seed), config.seed, agent_factory,
                    options=config.options, resources=None)
    # This process's attempt number, marked on its episodes' log records and results (eval/episode_log.py):
    # taken before any of them runs, so that one whose process dies unsaved keeps a number of its own.
    attempt = _next_attempt(out, store) if any(todos.values()) else None
    oracle_specs = [s for s in specs if s.needs_oracle_logs and todos[s.name]]
    if oracle_specs:
        _prepare_oracles(oracle_specs, todos, market, config, agent_factory, resources, timing, timing_path,
                         out, progress)
    for spec in specs:
        todo = todos[spec.name]
        if not todo:
            continue
        started = time.perf_counter()
        def job(task: Any, spec: MethodSpec = spec) -> None:
            # Each episode is saved the moment it ends, by its own worker: a crash elsewhere
            # never loses a finished episode.
            store.append(run_episode(spec, market.episode(task, config.seed), config.seed, agent_factory,
                                     log_sink=logs, options=config.options, resources=resources,
                                     attempt=attempt))

        with progress_bar(len(todo), f"{spec.name:>8}", enabled=progress) as bar:
            pool = ThreadPoolExecutor(max_workers=config.workers)
            try:
                futures = [pool.submit(job, t) for t in todo]
                for fut in as_completed(futures):
                    fut.result()
                    bar.update(1)
            except BaseException:
                # Ctrl-C (or a crashed episode): the queued episodes are dropped, not run to the end; the
                # running ones finish and are saved (the interpreter would wait for them anyway), and the same
                # command resumes from there. The time spent so far is the saved episodes' and is kept, so a
                # resumed run's Time× covers every process, not the last one only.
                pool.shutdown(wait=True, cancel_futures=True)
                timing[spec.name] = timing.get(spec.name, 0.0) + (time.perf_counter() - started)
                _atomic_write(timing_path, json.dumps(timing, indent=2))
                raise
            pool.shutdown(wait=True)
        timing[spec.name] = timing.get(spec.name, 0.0) + (time.perf_counter() - started)
        _atomic_write(timing_path, json.dumps(timing, indent=2))
    latest: dict[tuple[str, str], EpisodeResult] = {}
    for r in store.load():  # a crashed episode re-run on resume: its latest result counts
        if r.seed == config.seed and r.method in config.methods:
            latest[(r.method, r.task_id)] = r
    results = list(latest.values())
    metrics = compute_metrics(results, reference=config.reference, e2e_seconds=timing)
    world_model, notes = _oracle_context(out, config, specs, resources)
    summary = {
        "config": {**asdict(config), "methods": list(config.methods), "market_label": market.label,
                   "agent_label": _agent_label(config.agent), "judge": _judge_label(config),
                   "workers": config.workers, "oracle_notes": notes,
                   "oracle_models": _oracle_models_label(config, resources.cross_fit),
                   "world_model": world_model,
                   "rollout_depth": rollout_depth(config.options),
                   "oracle_data_collection_s": round(timing.get("oracle_data_collection", 0.0), 3),
                   "oracle_models_s": round(timing.get("oracle_models", 0.0), 3),
                   "upper_bounds": [s.name for s in specs if s.upper_bound],
                   **({"agent_needs": market.need_inference_label,
                       "agent_need_recall": getattr(market, "need_recall", None)}
                      if getattr(market, "need_inference_label", None) else {})},
        "methods": {m: metrics[m] for m in config.methods if m in metrics},
        "groups": group_pass_rates(results),
        "paired": {base: paired_pr_differences(results, base, seed=config.seed)
                   for base in _paired_bases(config)},
        "paired_regret": {base: paired_regret_differences(results, base, seed=config.seed)
                          for base in _regret_bases(config)},
    }
    _atomic_write(out / "results.json", json.dumps(summary, indent=2, sort_keys=False))
    write_reports(summary, out)
    return summary


ATTEMPTS_FILE = "attempts.json"


def _next_attempt(out: Path, store: ResultStore) -> int:
    """The next attempt number of the run directory (``OUT/attempts.json``), saved before it is used: each
    process that runs episodes in the directory takes its own, and runs an episode at most once, so the number
    names one attempt of each episode it runs (also one whose process died before saving it). Never below a
    number a saved result holds (a counter lost or deleted)."""
    path = out / ATTEMPTS_FILE
    last = max((attempt_of(r) or 0 for r in store.load()), default=0)
    if path.exists():
        try:
            last = max(last, int(json.loads(path.read_text())["last_attempt"]))
        except (ValueError, KeyError, TypeError) as exc:
            raise UsageError(f"{path}: not the run directory's attempt counter ({type(exc).__name__}: {exc}); it "
                             'reads {"last_attempt": N}, N the last attempt number a bench process took here: fix '
                             "it, or delete it (the count then resumes after the highest number in episodes.jsonl)"
                             ) from exc
    _atomic_write(path, json.dumps({"last_attempt": last + 1}))
    return last + 1


def _prepare_oracles(specs: list[MethodSpec], todos: dict[str, list[Any]], market: BenchMarket, config: BenchConfig,
                     agent_factory: AgentFactory, resources: Any, timing: dict[str, float], timing_path: Path,
                     out: Path, progress: bool) -> None:
    """Collect (or load) the oracle logs and build every oracle model the run's oracle methods need, before
    the method phases, each timed on its own (reported apart, in no method's Time×): whichever oracle
    method is listed first, none pays for a model another one shares, and none hides it."""
    from eval.progress import progress as progress_bar

    collecting = not config.options.get("oracle_logs") and not (out / "oracle_data" / "COMPLETE").exists()
    started = time.perf_counter()
    # The collection has its own progress bar; loading logs already collected gets one too (no silent gap).
    with progress_bar(1, "loading oracle logs", enabled=progress and not collecting) as bar:
        resources.records()
        bar.update(1)
    if "oracle_data_collection" not in timing:
        timing["oracle_data_collection"] = time.perf_counter() - started
    # One oracle per method and per fold of its remaining tasks builds (and caches) the models its episodes use.
    builds: list[tuple[MethodSpec, Any]] = []
    for spec in specs:
        folds: dict[Any, Any] = {}
        for task in todos[spec.name]:
            folds.setdefault(resources.fold_for(market.task_id(task)), task)
        builds += [(spec, task) for task in folds.values()]
    started = time.perf_counter()
    with progress_bar(len(builds), "oracle models", enabled=progress) as bar:
        for spec, task in builds:
            env = market.episode(task, config.seed)
            model = agent_factory(env, config.seed)
            spec.build(MethodContext(env=env, seed=config.seed, options=dict(config.options), model=model,
                                     simulated_agent=_is_simulated(model), resources=resources))
            bar.update(1)
    timing["oracle_models"] = timing.get("oracle_models", 0.0) + (time.perf_counter() - started)
    _atomic_write(timing_path, json.dumps(timing, indent=2))
    _save_oracle_context(out, resources)  # now, not when the run completes: a resumed run keeps the label


def _save_oracle_context(out: Path, resources: Any) -> tuple[str | None, list[str]]:
    """The world model's label and the building notes, merged into ``oracle_context.json``."""
    path = out / "oracle_context.json"
    saved = json.loads(path.read_text()) if path.exists() else {}
    label = getattr(resources, "world_model_label", None) or saved.get("world_model")
    notes = sorted(set(resources.notes) | set(saved.get("notes") or []))
    if label or notes:
        _atomic_write(path, json.dumps({"world_model": label, "notes": notes}, indent=2))
    return label, notes


def _oracle_context(out: Path, config: BenchConfig, specs: list[Any], resources: Any) -> tuple[str, list[str]]:
    """The world model's label and the notes building the oracle models left, kept in the run directory
    (``oracle_context.json``, written as soon as the models are built): a resumed run whose oracle episodes
    are all done builds no model, and must not relabel an upper bound that read the environment's simulator
    as the replay world model."""
    label, notes = _save_oracle_context(out, resources)
    if label is None:
        if not _uses_oracle_models(specs):
            label = "none (no method here uses one)"
        elif config.options.get("world_model") == "schema":
            label = "the environment's own simulator (upper bound, leaks)"
        else:
            label = "replay of the oracle logs"
    return label, notes


def _paired_bases(config: BenchConfig) -> list[str]:
    """Methods every other one is compared with, task by task: ``options['paired_with']`` or the
    myopic enforcer (tracker) and the WR reference, when they ran."""
    given = config.options.get("paired_with")
    bases = list(given) if given else ["tracker", config.reference]
    return [b for b in dict.fromkeys(bases) if b and b in config.methods]


def _regret_bases(config: BenchConfig) -> list[str]:
    """Methods every other one's decision regret is compared with, task by task: the myopic
    enforcer (tracker) and MCO, the oracle INTENT must beat on regret (issue #16), when they ran."""
    return [b for b in ("tracker", "mco") if b in config.methods]


def _agent_label(agent: str) -> str:
    from eval.agents.llm_like import LLM_AGENT_LABEL
    from eval.agents.simulated import SIMULATED_AGENT_LABEL

    return {"sim": SIMULATED_AGENT_LABEL, "sim-llm": LLM_AGENT_LABEL}.get(agent, f"LangChain chat model {agent}")


def _judge_label(config: BenchConfig) -> str:
    if config.market in ("synthetic", "synthetic-v2"):
        return "exact (synthetic ground truth)"
    if config.options.get("judge") == "sopr":
        return (f"SoPR (StableToolBench rules) by {config.options.get('judge_model')} at "
                f"{config.options.get('judge_url')}, {config.options.get('judge_runs', 3)} runs")
    return "proxy pass rate (not SoPR)"


# Options that change what an episode is, with their defaults: a value equal to its default is
# the same configuration as the option left out (a directory written either way stays usable).
_EPISODE_OPTIONS: dict[str, Any] = {"feedback_chars": None, "rollout_max_tokens": None,
                                    "max_turns": DEFAULT_MAX_TURNS, "max_depth": DEFAULT_MAX_DEPTH}


# Every other option shapes some method's results (gamma, the predictor, the world model, the judge, the
# oracle logs...), so a run directory refuses results made with another value; these do not. An option
# given at its default counts as not given.
_RUN_CONFIG_VERSION = 2  # run_config.json records every option that shapes a result
# Reports, secrets, connections, and the permission to add episodes of other code (recorded as ``code``).
_NOT_RESULTS = frozenset({"paired_with", "api_key", "timeout", "base_url", "allow_code_change"})
_OPTION_DEFAULTS: dict[str, Any] = {**_EPISODE_OPTIONS, "gamma": DEFAULT_GAMMA, "delta": DEFAULT_DELTA, "predictor": "hashed",
                                    "world_model": "replay", "solvability": True, "judge_runs": 3,
                                    "stb_env": "schema", "retriever": "tfidf", "oracle_fraction": 1.0}


def _without_defaults(key: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in key.items() if not (k in _OPTION_DEFAULTS and v == _OPTION_DEFAULTS[k])}


def _option_value(value: Any) -> Any:
    """An option as run_config.json keeps it: JSON as is, anything else by its type (an agent object)."""
    try:
        return json.loads(json.dumps(value, sort_keys=True))
    except (TypeError, ValueError):
        return f"<{type(value).__module__}.{type(value).__qualname__}>"


def _check_config(out: Path, config: BenchConfig) -> None:
    """A run directory holds one task set and one configuration: refuse to mix results from another."""
    path = out / "run_config.json"
    key = {k: getattr(config, k) for k in ("market", "agent", "tasks", "seed", "event_rate", "budget", "budget_scale",
                                           "relevant_price_scale")}
    options = {k: _option_value(v) for k, v in config.options.items() if k not in _NOT_RESULTS}
    logs = options.get("oracle_logs")
    if isinstance(logs, str) and Path(logs).resolve() == (out / "oracle_data" / "logs.jsonl").resolve():
        del options["oracle_logs"]  # the logs this directory collected itself (a resumed study passes them)
    key = _without_defaults(key | {k: config.options.get(k, default) for k, default in _EPISODE_OPTIONS.items()}
                            | options)
    key["run_config"] = _RUN_CONFIG_VERSION
    code = code_version()
    if path.exists():
        old = _without_defaults(json.loads(path.read_text()))
        made_by = old.pop("code", None)  # the code that wrote the directory's episodes, oldest first
        legacy = "run_config" not in old
        # Written before every option was recorded (an older version): what it recorded must agree, and then the
        # whole configuration is recorded from here on.
        expected = {k: v for k, v in key.items() if k in old or k in _EPISODE_OPTIONS} if legacy else key
        if old != expected:
            diff = {k: (old.get(k), expected.get(k)) for k in sorted(old.keys() | expected.keys())
                    if old.get(k) != expected.get(k)}
            raise UsageError(f"{out} holds results of another configuration {diff}; pass a new --out to start fresh")
        same_code = bool(made_by) and made_by[-1] == code
        if same_code and not legacy:
            return
        if not same_code and not config.options.get("allow_code_change"):
            written = made_by[-1] if made_by else "code older than this check, not recorded"
            raise UsageError(
                f"{out} holds episodes made by other code ({written}; this is {code}), which a resumed run would "
                "report beside this code's as one table: pass a new --out to start fresh, or --allow-code-change "
                "to add this code's episodes to it (run_config.json then lists each code that wrote it)")
        codes = made_by if same_code else [*(made_by or ["unrecorded"]), code]
        _atomic_write(path, json.dumps(key | {"code": codes}, indent=2))
    else:
        _atomic_write(path, json.dumps(key | {"code": [code]}, indent=2))


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
