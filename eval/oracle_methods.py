"""MCO, INTENT and INTENT's ablations as benchmark methods, with their models built from logs.

The oracle models are never trained on the evaluation tasks: :class:`OracleResources` first
collects interaction logs by running the Prompt agent on a *separate* task set (seed + 10007),
through the same guarded loop, into ``OUT/oracle_data/logs.jsonl`` (or uses ``--oracle-logs``),
then builds

* the world model: :class:`~worldmodel.replay.ReplayWorldModel` (temperature 1.0 for MCO,
  0 for INTENT's conditional generator, which replays only z = 1 observations);
* the intention predictor: :class:`~worldmodel.predictors.HashedLogisticPredictor`, trained and
  temperature-scaled on those logs (a trained encoder directory can be given with
  ``--predictor-dir``), or the ablations.

Labels z come from the environment (the tool artifact logged by the guard): the synthetic
market's ground truth, or StableToolBench's response status.

StableToolBench has no second task set, so there the logs are collected on the evaluation
queries themselves (another agent seed) and the models are **cross-fitted**: queries are split
into two folds by a hash of their id, and an episode's oracle uses models built only from the
other fold's logs — no query's own logs ever inform the oracle that guards it.
"""

from __future__ import annotations

import json
import threading
import zlib
from pathlib import Path
from typing import Any

from eval.method_spec import DEFAULT_DELTA, DEFAULT_GAMMA, SYSTEM_PROMPT, MethodContext, MethodSpec, rollout_depth
from intent.errors import UsageError
from intent.logs import JsonlLogSink, read_log
from intent.oracle import Oracle
from intent.oracles import IntentOracle, MCOOracle
from intent.policy import AgentPolicy

__all__ = ["METHODS", "OracleResources"]

TRAIN_SEED_OFFSET = 10007


class OracleResources:
    """Lazily collects the training logs and builds the oracle models, once per run."""

    def __init__(self, config: Any, *, agent_factory: Any, collect: Any = None) -> None:
        # ``collect(config, out_dir, agent_seed, sink)`` runs the Prompt agent over a market built
        # from ``config`` and writes its guard logs to ``sink``: the runner passes its own episode
        # loop, so that this module does not import the runner (imports point down).
        self.config = config
        self.agent_factory = agent_factory
        self.collect = collect
        self._lock = threading.RLock()  # held while building, so each model is built once
        self._records: list[Any] | None = None
        self._cache: dict[Any, Any] = {}
        self.notes: list[str] = []
        self.cross_fit = bool(config.options.get("cross_fit", config.market == "stabletoolbench"))

    def fold_for(self, task_id: str) -> int | None:
        """The fold of a task under cross-fitting (None when the logs come from other tasks)."""
        return zlib.crc32(task_id.encode()) % 2 if self.cross_fit else None

    def records(self) -> list[Any]:
        with self._lock:
            if self._records is None:
                # Parallel tool calls are logged in completion order; a canonical order makes every
                # model built from the logs independent of thread interleaving (reproducible runs).
                records = sorted(self._load_or_collect(), key=lambda r: (r.task_id, r.step, r.call_id))
                fraction = float(self.config.options.get("oracle_fraction", 1.0))
                self._records = subsample_tasks(records, fraction, seed=self.config.seed)
            return self._records

    def _load_or_collect(self) -> list[Any]:
        given = self.config.options.get("oracle_logs")
        if given:
            return list(read_log(given))
        out = Path(self.config.out) / "oracle_data"
        logs, done = out / "logs.jsonl", out / "COMPLETE"
        if not done.exists():
            if self.collect is None:
                raise UsageError("OracleResources needs oracle logs: pass options['oracle_logs'] (a guard log "
                                 "JSONL) or collect= (eval.runner passes its episode loop)")
            out.mkdir(parents=True, exist_ok=True)
            logs.unlink(missing_ok=True)  # an interrupted collection restarts cleanly
            agent_seed = self.config.seed + TRAIN_SEED_OFFSET
            if self.cross_fit:  # the evaluation tasks themselves, another agent seed (see the module doc)
                train_cfg = _replace(self.config, out=str(out))
            else:
                n_train = int(self.config.options.get("oracle_train_tasks", max(50, self.config.tasks)))
                train_cfg = _replace(self.config, tasks=n_train, seed=agent_seed, out=str(out))
            self.collect(train_cfg, agent_seed, JsonlLogSink(logs))
            # What the logs are of, for a later run given them with --oracle-logs (logs_market).
            done.write_text(json.dumps({"market": self.config.market, "seed": train_cfg.seed,
                                        "tasks": train_cfg.tasks}) + "\n")
        return list(read_log(logs))

    def records_for(self, fold: int | None) -> list[Any]:
        """The logs an oracle for ``fold`` may use: all of them, or the other fold's."""
        records = self.records()
        if fold is None:
            return records
        other = [r for r in records if self.fold_for(_inner_task_id(r.task_id)) != fold]
        if not other:
            # Few tasks (--tasks 1, 2, ...): the other fold has no logs and this fold's oracles learn from
            # nothing. Said in results.json, which otherwise read "replay of logged observations from other
            # queries" with only a cryptic "z=?" note.
            logged = len({_inner_task_id(r.task_id) for r in records})
            note = (f"fold {fold}: no logs of the other fold (all {logged} logged task(s) are in fold {fold}); its "
                    "oracles were built from no experience: run more --tasks")
            with self._lock:
                if note not in self.notes:
                    self.notes.append(note)
        return other

    def get_or_build(self, key: str, build: Any, fold: int | None = None) -> Any:
        with self._lock:
            if (key, fold) not in self._cache:
                self._cache[(key, fold)] = build(self.records_for(fold))
            return self._cache[(key, fold)]

    def get(self, key: str, fold: int | None = None) -> Any:
        with self._lock:
            if (key, fold) not in self._cache:
                self._cache[(key, fold)] = self._build(key, self.records_for(fold), fold)
            return self._cache[(key, fold)]

    def _build(self, key: str, records: list[Any], fold: int | None = None) -> Any:
        from worldmodel.predictors import EmpiricalMeanPredictor, HashedLogisticPredictor, OptimisticPredictor
        from worldmodel.replay import ReplayWorldModel, label_of

        if key == "world_model":
            return ReplayWorldModel(records, temperature=1.0, seed=self.config.seed)
        if key == "generator":
            return ReplayWorldModel(records, temperature=0.0)
        learned = key == "predictor_encoder" or (key == "predictor"
                                                 and self.config.options.get("predictor", "hashed") != "hashed")
        if learned and len({label_of(r) for r in records if r.decision == "accept"} - {None}) < 2:
            key = "predictor_hashed"  # one label class: no classifier can be fitted (the fallback below says so)
        elif key == "predictor" and learned:
            return self._learned_predictor(records, fold)
        if key == "predictor_encoder":
            from worldmodel.predictors import EncoderIntentionPredictor

            return EncoderIntentionPredictor(self._train_encoder(records, fold))
        if key in ("predictor", "predictor_hashed", "predictor_uncalibrated"):
            directory = self.config.options.get("predictor_dir") if key != "predictor_hashed" else None
            if directory:
                from worldmodel.predictors import EncoderIntentionPredictor

                return EncoderIntentionPredictor(directory, calibrated=key == "predictor")
            labelled = [(r, label_of(r)) for r in records if r.decision == "accept" and label_of(r) is not None]
            items = [(r.reasoning, r.tool, r.args if isinstance(r.args, dict) else {}) for r, _ in labelled]
            labels = [z for _, z in labelled]
            if len(set(labels)) < 2:
                # A classifier cannot be fitted on one class (e.g. every logged call succeeded);
                # fall back to the per-tool frequency and say so in results.json.
                self.notes.append(f"{key}: the oracle logs hold only z={labels[0]} labels; used the empirical-mean "
                                  "predictor instead of the trained one" if labels else
                                  f"{key}: the oracle logs hold no labelled accepted call; used the empirical-mean "
                                  "predictor (no data) instead of the trained one")
                return EmpiricalMeanPredictor(records)
            # Held-out split by task (the predictor chooses its L2 and temperature on unseen tasks).
            model = HashedLogisticPredictor(seed=self.config.seed).fit(
                items, labels, groups=[_inner_task_id(r.task_id) for r, _ in labelled])
            if key == "predictor_uncalibrated":
                model.calibrated = False
            return model
        if key == "empirical":
            return EmpiricalMeanPredictor(records)
        if key == "optimistic":
            return OptimisticPredictor()
        raise KeyError(key)


    def _oracle_dir(self, name: str, fold: int | None) -> Path:
        return Path(self.config.out) / "oracle_data" / (name if fold is None else f"{name}-fold{fold}")

    def _encoder_kwargs(self) -> dict[str, Any]:
        opts = self.config.options
        return {"epochs": int(opts.get("encoder_epochs", 3)), "max_steps": opts.get("encoder_max_steps"),
                **({"base_model": opts["encoder_base"]} if opts.get("encoder_base") else {})}

    def _train_encoder(self, records: list[Any], fold: int | None) -> Path:
        """The encoder predictor (MiniLM by default) fine-tuned on these logs, once per run directory
        (an interrupted training resumes from its last epoch; a finished one is reused)."""
        from training.data import triples
        from training.train_intention import train_predictor

        directory = self._oracle_dir("encoder", fold)
        if not (directory / "calibration.json").exists():
            train_predictor(triples(records), directory, seed=self.config.seed, **self._encoder_kwargs())
        return directory

    def _learned_predictor(self, records: list[Any], fold: int | None) -> Any:
        """``options['predictor']``: 'encoder' (always the fine-tuned encoder) or 'auto' (the one of the
        hashed and the encoder predictors with the higher AUROC on held-out tasks of these logs)."""
        from training.predictor_report import predictor_report
        from worldmodel.predictors import EncoderIntentionPredictor

        choice = self.config.options.get("predictor")
        if choice == "encoder":
            return EncoderIntentionPredictor(self._train_encoder(records, fold))
        if choice != "auto":
            raise UsageError(f"options['predictor'] (--predictor) is {choice!r}; choose 'hashed' (default), "
                             "'encoder' (fine-tuned MiniLM) or 'auto' (the better of the two on held-out tasks)")
        out = self._oracle_dir("predictor_report", fold)
        report = predictor_report(records, seed=self.config.seed, out=out, encoder=self._encoder_kwargs())
        auc = {k: report["scores"][k]["auroc"] for k in ("hashed", "encoder")}
        self.notes.append(f"predictor (auto, fold {fold}): {report['chosen']} (held-out AUROC hashed "
                          f"{auc['hashed']:.3f}, encoder {auc['encoder']:.3f}; {out}/predictor_report.json)")
        if report["chosen"] == "encoder":
            return EncoderIntentionPredictor(out / "encoder")
        return self._build("predictor_hashed", records, fold)


def logs_market(logs: str | Path) -> str | None:
    """The market a benchmark's collected oracle logs are of (its ``oracle_data/COMPLETE`` marker, or the
    run's ``run_config.json`` for runs before the marker said), or None for any other guard log."""
    path = Path(logs)
    marker, run_config = path.parent / "COMPLETE", path.parent.parent / "run_config.json"
    if path.parent.name != "oracle_data" or not marker.is_file():
        return None
    try:
        return str(json.loads(marker.read_text())["market"])
    except (ValueError, KeyError, TypeError):  # an older marker ("ok"): the run that collected them says
        try:
            return str(json.loads(run_config.read_text())["market"]) if run_config.is_file() else None
        except (ValueError, KeyError, TypeError):
            return None


def _inner_task_id(episode_id: str) -> str:
    """``method:task:seed`` (the runner's episode ids) -> ``task``; task ids may contain ':'."""
    parts = episode_id.split(":")
    return ":".join(parts[1:-1]) if len(parts) >= 3 else episode_id


def subsample_tasks(records: list[Any], fraction: float, *, seed: int) -> list[Any]:
    """Keep the records of a seeded ``fraction`` of the tasks (the data-scaling study)."""
    import random

    if not 0 < fraction <= 1:
        raise UsageError(f"oracle_fraction must be in (0, 1], got {fraction}")
    if fraction == 1:
        return records
    tasks = sorted({r.task_id for r in records})
    keep = set(random.Random(seed).sample(tasks, max(1, round(len(tasks) * fraction))))
    return [r for r in records if r.task_id in keep]


def _replace(config: Any, **changes: Any) -> Any:
    from dataclasses import replace

    return replace(config, **changes)


def _policy(ctx: MethodContext) -> AgentPolicy:
    # An agent that offers a rollout copy (eval.agents.llm_like) gets its rollouts from that copy,
    # seeded on another stream: a rollout must never replay the episode agent's own future draws.
    # Other models (the old 'sim' agent, real LLMs) are used as they are.
    for_rollout = getattr(ctx.model, "for_rollout", None)
    model = for_rollout() if callable(for_rollout) else ctx.model
    cap = ctx.options.get("rollout_max_tokens")
    own = getattr(model, "max_tokens", None)
    if cap is not None:
        from eval.agents.chat import with_reply_cap

        model = with_reply_cap(model, cap)
    # A cap at or above the agent's own leaves its replies as they are: a cut one is an answer then.
    capped = cap is not None and not (isinstance(own, int) and cap >= own)
    return AgentPolicy(model, ctx.env.tools, system_prompt=SYSTEM_PROMPT, replies_capped=capped)


def _world_model(ctx: MethodContext, key: str, fold: int | None) -> Any:
    """The oracle's world model: by default the replay model built from other tasks' logs
    (on StableToolBench, the other query fold's); ``options["world_model"] == "schema"`` asks for
    the environment's own simulator instead, an upper bound that leaks the environment.

    The choice is recorded as ``ctx.resources.world_model_label`` for results.json.
    """
    choice = ctx.options.get("world_model", "replay")
    if choice not in ("replay", "schema"):
        raise UsageError(f"options['world_model'] (--world-model) is {choice!r}; choose 'replay' (default: built "
                         "from other tasks' logs) or 'schema' (the environment's simulator, an upper bound)")
    res = ctx.resources
    if choice == "schema":
        schema = getattr(ctx.env, "schema_world_model", None)
        if schema is None:
            raise UsageError(f"--world-model schema: the {ctx.env.environment!r} environment has no simulator to "
                             "use as a world model (only StableToolBench's schema environment has one); drop "
                             "--world-model or use --world-model replay")
        res.world_model_label = schema.label
        return schema
    res.world_model_label = ("world model = replay of logged observations from other queries (cross-fitted by "
                             "query fold)" if res.cross_fit else
                             "world model = replay of logged observations from a separate task set")
    model = res.get(key, fold)
    fork = getattr(model, "fork", None)  # one random stream per episode: runs reproduce exactly
    return fork(zlib.crc32(f"{ctx.seed}:{ctx.env.task_id}".encode())) if callable(fork) else model


def _mco(ctx: MethodContext) -> Oracle:
    res = ctx.resources
    fold = res.fold_for(ctx.env.task_id)
    return MCOOracle(_policy(ctx), _world_model(ctx, "world_model", fold), max_depth=rollout_depth(ctx.options))


def _trained_world_model(ctx: MethodContext, temperature: float) -> Any:
    """The world model trained by ``intent train worldmodel`` / ``intent loop``: in process from
    ``options['trained_world_model_dir']``, or served (vLLM) at ``options['trained_world_model_url']``."""
    res = ctx.resources
    url, directory = ctx.options.get("trained_world_model_url"), ctx.options.get("trained_world_model_dir")
    if not url and not directory:
        raise UsageError("this method needs a trained world model: pass options['trained_world_model_dir'] (an "
                         "`intent train worldmodel` output) or options['trained_world_model_url'] (its server)")
    key = f"trained_wm:{url or directory}:{temperature}"
    with res._lock:
        note = f"intent-trained-wm: world model = trained generator {url or directory} (not the replay model)"
        if note not in res.notes:
            res.notes.append(note)
    if url:
        from eval.agents.chat import check_model
        from worldmodel.openai_compat import OpenAICompatibleWorldModel

        name = ctx.options.get("trained_world_model_name") or directory

        def served(_records: Any) -> Any:
            # A wrong URL or model name stops the run here; at decision time it would be a recoverable
            # model error, and every gate would quietly fall back (a table of fallbacks, not of INTENT).
            check_model(url, str(name), flag="--world-model-name ", url_flag="--world-model-url")
            # The in-process generator's reply cap (below), so both paths simulate the same observations.
            return OpenAICompatibleWorldModel(url, str(name), temperature=temperature, max_tokens=96)

        return res.get_or_build(key, served)
    from worldmodel.transformers_lm import TransformersWorldModel

    model = res.get_or_build(key, lambda _records: TransformersWorldModel(directory, temperature=temperature,
                                                                          max_new_tokens=96, seed=ctx.seed))
    fork = getattr(model, "fork", None)
    return fork(zlib.crc32(f"{ctx.seed}:{ctx.env.task_id}".encode())) if callable(fork) else model


def _intent(predictor: str = "predictor", world: str = "default", **switches: Any):  # noqa: ANN202
    def build(ctx: MethodContext) -> Oracle:
        res = ctx.resources
        fold = res.fold_for(ctx.env.task_id)
        if world == "trained":
            generator = _trained_world_model(ctx, 1.0 if switches.get("stochastic") else 0.0)
        else:
            generator = _world_model(ctx, "world_model" if switches.get("stochastic") else "generator", fold)
        return IntentOracle(_policy(ctx), generator, res.get(predictor, fold),
                            gamma=float(ctx.options.get("gamma", DEFAULT_GAMMA)),
                            delta=float(ctx.options.get("delta", DEFAULT_DELTA)),
                            max_depth=rollout_depth(ctx.options), **switches)

    return build


_MAIN = (
    MethodSpec("mco", True, _mco, "MCO: one stochastic rollout (replay world model, T=1.0)", needs_oracle_logs=True),
    MethodSpec("intent", True, _intent(), "INTENT: ideal-trajectory rollout, calibrated predictor, gamma 0.5",
               needs_oracle_logs=True),
)
_VARIANTS = (
    MethodSpec("intent-hashed", True, _intent("predictor_hashed"),
               "INTENT with the hashed-logistic predictor (numpy), whatever --predictor says", needs_oracle_logs=True),
    MethodSpec("intent-trained-wm", True, _intent(world="trained"),
               "INTENT with the trained conditional generator (options trained_world_model_dir or _url) and the "
               "run's predictor", needs_oracle_logs=True),
    MethodSpec("intent-minilm", True, _intent("predictor_encoder"),
               "INTENT with the fine-tuned MiniLM predictor (trained on the oracle logs; a few minutes on a CPU)",
               needs_oracle_logs=True),
)
_ABLATIONS = {
    "intent-optimistic": ("optimistic", {}, "predictor Optimistic (p = 1)"),
    "intent-uncalibrated": ("predictor_uncalibrated", {}, "predictor Uncalibrated (no temperature scaling)"),
    "intent-empirical": ("empirical", {}, "predictor Empirical Mean (per-tool success frequency)"),
    "intent-stochastic": ("predictor", {"stochastic": True}, "generator Stochastic (MCO-style sampling)"),
    "intent-norollout": ("predictor", {"lookahead": False}, "generator No Rollout (immediate action only)"),
    "intent-notrace": ("predictor", {"trace_feedback": False}, "generator No Trace (budget signal only)"),
    "intent-no-rollout-cache": ("predictor", {"rollout_cache": False}, "without the rollout cache"),
    "intent-no-last-call-cache": ("predictor", {"last_call_cache": False}, "without the last-call cache"),
    "intent-no-blacklist": ("predictor", {"blacklist": False}, "without the blacklist"),
    "intent-fit": ("predictor", {"ideal_plan_must_fit": True}, "extension: also refuses a plan that costs more than is "
                   "left even if every call works the first time, which gamma < 1 alone lets through"),
    "intent-alt": ("predictor", {"alternatives": 3}, "extension: a rejection also lists the 3 affordable tools "
                   "taking the same arguments with the least predicted expected cost"),
}
METHODS: tuple[MethodSpec, ...] = (*_MAIN, *_VARIANTS, *(
    MethodSpec(name, True, _intent(pred, **switches),
               f"INTENT {desc}" if desc.startswith("extension") else f"INTENT ablation: {desc}", needs_oracle_logs=True)
    for name, (pred, switches, desc) in _ABLATIONS.items()
))
