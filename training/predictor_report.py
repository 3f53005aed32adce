"""How good is an intention predictor? Held-out tasks, honest baselines, calibration metrics.

:func:`predictor_report` splits the labelled calls of a guard log **by task** (no task in two
splits), fits the hashed-logistic predictor on the training tasks (it holds out a share of
them to choose its L2 strength and its temperature), and scores on the test tasks, beside two
counting baselines fitted on the same training tasks:

* ``tool_frequency``: each tool's smoothed success frequency (the paper's "Empirical Mean");
* ``tool_token_frequency``: the mean frequency of the tool name's tokens (tier words).

Metrics (numpy only): AUROC (ties counted half), NLL, Brier, ECE over 15 equal-width bins,
accuracy at 0.5, the share of calls with ``p < delta`` (the blacklist threshold), and the
number of test examples. The verdict checks the issue's targets for the chosen learned predictor
(hashed, or the fine-tuned encoder when asked for and better): AUROC >= best baseline + 0.03,
ECE <= 0.03 after scaling, and scaling not making ECE worse.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from intent.errors import UsageError
from training.data import triples
from worldmodel.calibration import ECE_BINS, auroc, score  # (one AUROC, one ECE: every report of the project)

__all__ = ["ECE_BINS", "auroc", "auroc_by_fraction", "ece_floor", "predictor_report", "score", "split_tasks"]

AUROC_MARGIN = 0.03
ECE_TARGET = 0.03


def ece_floor(probs: Sequence[float], *, seed: int = 0, draws: int = 200) -> float:
    """The ECE a *perfectly calibrated* predictor with these p would show on this many examples
    (labels drawn as Bernoulli(p), mean over ``draws``): the sampling noise of the ECE estimate
    itself, the floor below which no calibration can be measured on this test set."""
    import numpy as np

    from worldmodel.calibration import ece

    p = np.asarray(probs, dtype=float)
    rng = np.random.default_rng(seed)
    return float(np.mean([ece(p, (rng.random(len(p)) < p).astype(int), n_bins=ECE_BINS) for _ in range(draws)]))


def split_tasks(task_ids: Sequence[str], *, seed: int, test_fraction: float = 0.2, min_test_examples: int = 0
                ) -> tuple[set[str], set[str]]:
    """(train tasks, test tasks): a seeded split of the distinct task ids (one id per example).

    The test side gets ``test_fraction`` of the tasks, or more tasks (up to half of them) until
    it holds ``min_test_examples`` examples.
    """
    from collections import Counter

    if not 0 < test_fraction < 1:
        raise UsageError(f"test_fraction must be in (0, 1), got {test_fraction}")
    per_task = Counter(task_ids)
    tasks = sorted(per_task)
    if len(tasks) < 5:
        raise UsageError(f"the logs hold {len(tasks)} task(s); a by-task split needs at least 5 (collect more logs)")
    random.Random(seed).shuffle(tasks)
    n_test = max(1, int(round(len(tasks) * test_fraction)))
    while n_test < len(tasks) // 2 and sum(per_task[t] for t in tasks[:n_test]) < min_test_examples:
        n_test += 1
    return set(tasks[n_test:]), set(tasks[:n_test])


def _tried(model: Any, learned: Sequence[str], scores: Mapping[str, Any], *, train_examples: int) -> list[str]:
    """What this report fitted and calibrated, in words: read beside a missed target."""
    dev = model.split.get("dev_examples", 0)
    isotonic = ("an isotonic map after it (cross-fitted over the held-out training tasks, kept only if it won "
                f"there: {'kept' if model.calibration_kind == 'isotonic' else 'not kept'})"
                if dev >= model.min_isotonic_examples else
                f"no isotonic map ({dev} held-out training calls, below the {model.min_isotonic_examples} it needs)")
    out = [f"hashed logistic model on {train_examples} training calls (word n-grams, tool-name tokens, tool x "
           f"argument value; L2 chosen on held-out training tasks: {model.l2:g})",
           f"temperature scaling (T = {model.temperature:.3f}) and {isotonic}"]
    if "encoder" in learned:
        out.append(f"the fine-tuned encoder predictor (AUROC {scores['encoder']['auroc']:.3f} on the same test tasks)")
    else:
        out.append("not in this report: the fine-tuned encoder predictor (`intent train report --encoder`; the "
                   "study runs it as INTENT's predictor in its intent-minilm row)")
    out.append("more training data: --oracle-tasks (`make predictor-report` fits on 3,000 tasks' logs)")
    return out


def predictor_report(records: Sequence[Any], *, seed: int = 0, delta: float = 0.1, test_fraction: float = 0.2,
                     min_test_examples: int = 500, out: str | Path | None = None, title: str = "Intention predictor",
                     encoder: dict[str, Any] | None = None) -> dict[str, Any]:
    """Fit on the training tasks of ``records`` (guard log records), score on the test tasks
    (``test_fraction`` of the tasks, grown up to half of them to reach ``min_test_examples``).

    With ``out``, writes ``predictor_report.json``, ``split.json``, ``reliability.png`` and
    ``p_histogram.png`` there. ``encoder`` (keyword arguments of
    :func:`training.train_intention.train_predictor`, e.g. ``{"epochs": 3}``; needs ``out``) also
    fine-tunes the encoder predictor (MiniLM by default) on the same training tasks into
    ``out/encoder`` and scores it on the same test tasks; ``chosen`` names the learned predictor
    with the higher test AUROC.
    """
    import json

    import numpy as np

    from worldmodel.calibration import reliability_bins, sigmoid
    from worldmodel.predictors import EmpiricalMeanPredictor, HashedLogisticPredictor, ToolTokenFrequencyPredictor

    from training.common import check_out_directory, check_seed

    if out is not None:
        check_out_directory(out)
    check_seed(seed)
    labelled = triples(records)  # executed calls with a label, in canonical order
    if not labelled:
        raise UsageError("the logs hold no executed calls with a label z; nothing to evaluate")
    train_tasks, test_tasks = split_tasks([t.task_id for t in labelled], seed=seed, test_fraction=test_fraction,
                                          min_test_examples=min_test_examples)
    train = [t for t in labelled if t.task_id in train_tasks]
    test = [t for t in labelled if t.task_id in test_tasks]

    y_test = [t.z for t in test]
    model = HashedLogisticPredictor(seed=seed).fit(_items(train), [t.z for t in train],
                                                    groups=[t.task_id for t in train])
    logits = np.asarray(model.logits(_items(test)))
    raw = [float(p) for p in sigmoid(logits)]
    cal = [float(p) for p in model.calibrate(logits)]
    baselines = {
        "tool_frequency": EmpiricalMeanPredictor(train, labeler=_z).predict_batch(_items(test)),
        "tool_token_frequency": ToolTokenFrequencyPredictor(train, labeler=_z).predict_batch(_items(test)),
    }
    scores = {"hashed_uncalibrated": score(raw, y_test, delta=delta), "hashed": score(cal, y_test, delta=delta)}
    scores |= {name: score(p, y_test, delta=delta) for name, p in baselines.items()}
    learned = ["hashed"]
    encoder_report = None
    if encoder is not None:
        if out is None:
            raise UsageError("predictor_report(encoder=...) needs out= (the encoder is saved in out/encoder)")
        from training.train_intention import train_predictor
        from worldmodel.predictors import EncoderIntentionPredictor

        enc_dir = Path(out) / "encoder"
        encoder_report = train_predictor(labelled, enc_dir, seed=seed, test_tasks=test_tasks,
                                         **encoder)
        from intent.progress import progress

        # One predictor, one forward pass over the test calls, under a reporter (was: two predictors, two silent
        # passes after the trainer's bars).
        enc = EncoderIntentionPredictor(enc_dir)
        with progress(len(test), "encoder scoring the test tasks", enabled=encoder.get("progress", True)) as bar:
            enc_logits = enc.logits(_items(test), on_batch=bar.update)
        enc_cal, enc_raw = enc.probabilities(enc_logits), enc.probabilities(enc_logits, calibrated=False)
        scores["encoder_uncalibrated"] = score(enc_raw, y_test, delta=delta)
        scores["encoder"] = score(enc_cal, y_test, delta=delta)
        learned.append("encoder")
    best_name = max(baselines, key=lambda n: scores[n]["auroc"])
    best = scores[best_name]["auroc"]
    chosen = max(learned, key=lambda n: scores[n]["auroc"])
    mine = scores[chosen]
    checks = {
        f"AUROC >= best baseline ({best_name}) + {AUROC_MARGIN}": mine["auroc"] >= best + AUROC_MARGIN,
        f"ECE ({ECE_BINS} bins) <= {ECE_TARGET} after scaling": mine["ece"] <= ECE_TARGET,
        "scaling does not make ECE worse": mine["ece"] <= scores[f"{chosen}_uncalibrated"]["ece"] + 1e-12,
        "at least 500 test examples": len(y_test) >= 500,
    }
    report = {
        "predictor": "hashed-logistic (numpy): word n-grams, tool-name tokens, tool x argument value"
                     + ("; encoder: fine-tuned MiniLM (or --base-model)" if encoder is not None else ""),
        "split": {"by": "task", "seed": seed, "train_tasks": len(train_tasks), "test_tasks": len(test_tasks),
                  "train_examples": len(train), "test_examples": len(test), "fit": model.split},
        "test_positive_rate": sum(y_test) / max(1, len(y_test)),
        "temperature": model.temperature, "calibration": model.calibration_kind, "delta": delta, "scores": scores,
        "ece_floor": ece_floor(enc_cal if chosen == "encoder" else cal, seed=seed),
        "chosen": chosen, "best_baseline": best_name, "auroc_gain_over_best_baseline": mine["auroc"] - best,
        **({"encoder": {k: encoder_report[k] for k in ("base_model", "examples", "steps", "temperature")}}
           if encoder_report else {}),
        "targets": checks, "targets_met": all(checks.values()),
        "tried": _tried(model, learned, scores, train_examples=len(train)),
        "bins_calibrated": reliability_bins(cal, y_test, ECE_BINS),
    }
    if out is not None:
        out = Path(out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "predictor_report.json").write_text(json.dumps(report, indent=2))
        (out / "split.json").write_text(json.dumps({"by": "task", "seed": seed, "train": sorted(train_tasks),
                                                    "test": sorted(test_tasks)}, indent=2))
        from worldmodel.plots import p_histogram_png, reliability_png

        reliability_png(out / "reliability.png", raw, cal, y_test,
                        f"{title}: held-out tasks (T = {model.temperature:.2f}, {model.calibration_kind})")
        p_histogram_png(out / "p_histogram.png", {"hashed (scaled)": cal, **({"encoder (scaled)": enc_cal}
                                                                             if encoder is not None else {}),
                                                  **baselines}, delta,
                        f"{title}: p on held-out tasks")
    return report


def auroc_by_fraction(records: Sequence[Any], fractions: Sequence[float], *, seed: int = 0,
                      min_test_examples: int = 500) -> dict[str, dict[str, float]]:
    """The data-scaling curve of the hashed predictor: trained on a seeded ``fraction`` of the
    training tasks, scored on one fixed set of test tasks (the same split as :func:`predictor_report`)."""
    from worldmodel.predictors import HashedLogisticPredictor

    labelled = triples(records)
    train_tasks, test_tasks = split_tasks([t.task_id for t in labelled], seed=seed,
                                          min_test_examples=min_test_examples)
    test = [t for t in labelled if t.task_id in test_tasks]

    out: dict[str, dict[str, float]] = {}
    ordered = sorted(train_tasks)
    for fraction in fractions:
        keep = set(random.Random(seed).sample(ordered, max(1, round(len(ordered) * fraction))))
        train = [t for t in labelled if t.task_id in keep]
        key = f"{fraction:.4g}"
        if len({t.z for t in train}) < 2:
            out[key] = {"train_tasks": len(keep), "train_examples": len(train), "auroc": float("nan")}
            continue
        model = HashedLogisticPredictor(seed=seed).fit(_items(train), [t.z for t in train],
                                                        groups=[t.task_id for t in train])
        out[key] = {"train_tasks": len(keep), "train_examples": len(train),
                    "auroc": auroc(model.predict_batch(_items(test)), [t.z for t in test])}
    return out


def _items(rows: Sequence[Any]) -> list[tuple[str, str, dict]]:
    """Predictor inputs (reasoning, tool, arguments) of :class:`training.data.Triple` rows."""
    return [(t.reasoning, t.tool, t.args) for t in rows]


def _z(row: Any) -> int:
    return row.z
