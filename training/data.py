"""Datasets from ``intent.logs`` JSONL: predictor triples, world-model pairs, task-disjoint splits."""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import Any

from intent.errors import UsageError
from intent.feedback import without_result_note
from intent.logs import LogFormatError, StepRecord, label_of, read_log

__all__ = ["Pair", "Triple", "load_records", "pairs", "parse_fraction", "split_by_task", "subsample",
           "subsample_training", "triples"]


@dataclass(frozen=True)
class Triple:
    reasoning: str
    tool: str
    args: dict[str, Any]
    z: int
    task_id: str


@dataclass(frozen=True)
class Pair:
    tool: str
    args: dict[str, Any]
    observation: str
    z: int | None
    task_id: str


def load_records(paths: str | Path | Sequence[str | Path]) -> list[StepRecord]:
    """Every record of the given logs; errors name the file and line, empty logs are refused."""
    paths = [paths] if isinstance(paths, (str, Path)) else list(paths)
    if not paths:
        raise UsageError("no log files given; pass --logs with the JSONL written by the guard or the benchmark")
    out: list[StepRecord] = []
    for path in paths:
        records = list(read_log(path, skip_torn_tail=True))
        if not any(_is_tool_run(r) for r in records):
            raise LogFormatError(f"{path}: holds no executed (accepted) calls; nothing to train on")
        out += records
    return out


def _is_tool_run(r: StepRecord) -> bool:
    # Model, oracle and sub-agent charges share the log (schema 3) but are not tool calls.
    return r.decision == "accept" and r.status in ("ok", "error") and getattr(r, "kind", "tool") == "tool"


def _executed(records: Iterable[StepRecord]) -> list[StepRecord]:
    return sorted((r for r in records if _is_tool_run(r)),
                  key=lambda r: (r.task_id, r.step, r.call_id))


def triples(records: Iterable[StepRecord], labeler: Callable[[Any], int | None] = label_of) -> list[Triple]:
    """(r, T, u, z) for the intention predictor: executed calls that carry a label."""
    out = []
    for r in _executed(records):
        z = labeler(r)
        if z is not None:
            out.append(Triple(r.reasoning, r.tool, r.args if isinstance(r.args, dict) else {}, int(z), r.task_id))
    return out


def pairs(records: Iterable[StepRecord], *, only_z: int | None = None,
          labeler: Callable[[Any], int | None] = label_of) -> list[Pair]:
    """(T, u) -> o for the world model; ``only_z=1`` gives the conditional generator's data."""
    out = []
    for r in _executed(records):
        z = labeler(r)
        if only_z is not None and z != only_z:
            continue
        obs = without_result_note(r.observation)
        out.append(Pair(r.tool, r.args if isinstance(r.args, dict) else {}, obs, z, r.task_id))
    return out


def parse_fraction(text: str | float) -> float:
    """'1/32' .. '1' or a float in (0, 1]."""
    try:
        value = float(Fraction(str(text)))
    except (ValueError, ZeroDivisionError) as exc:
        raise UsageError(f"--fraction {text!r} is not a number like 1/32 or 0.25") from exc
    if not 0 < value <= 1:
        raise UsageError(f"--fraction must be in (0, 1], got {text!r}")
    return value


def subsample(items: Sequence[Any], fraction: float, *, seed: int) -> list[Any]:
    """Keep the items of a seeded ``fraction`` of the tasks (the data-scaling study)."""
    if fraction >= 1:
        return list(items)
    tasks = sorted({it.task_id for it in items})
    keep = set(random.Random(seed).sample(tasks, max(1, round(len(tasks) * fraction))))
    return [it for it in items if it.task_id in keep]


def subsample_training(splits: dict[str, list[Any]], manifest: dict[str, Any], fraction: float, *, seed: int) -> None:
    """Keep a seeded ``fraction`` of the *training* tasks (``--fraction``, the data-scaling study), in place; the
    dev and test tasks stay those of all the logs, so runs at several fractions are scored on the same test tasks.
    (Was: the fraction was drawn before the split, so each run had its own smaller dev and test splits, and
    1/32 of 300 tasks left a test split of one task.)"""
    splits["train"] = subsample(splits["train"], fraction, seed=seed)
    manifest["tasks"]["train"] = sorted({it.task_id for it in splits["train"]})
    manifest["sizes"] = {k: len(v) for k, v in splits.items()}
    manifest["fraction"] = fraction


def split_by_task(items: Sequence[Any], *, seed: int, ratios: tuple[float, float, float] = (0.8, 0.1, 0.1)
                  ) -> tuple[dict[str, list[Any]], dict[str, Any]]:
    """Train/dev/test 8:1:1 by task: no task is in two splits. Returns the splits and a manifest."""
    if abs(sum(ratios) - 1) > 1e-9 or min(ratios) < 0:
        raise UsageError(f"split ratios must be >= 0 and sum to 1, got {ratios}")
    tasks = sorted({it.task_id for it in items})
    random.Random(seed).shuffle(tasks)
    n_train = int(round(len(tasks) * ratios[0]))
    n_dev = int(round(len(tasks) * ratios[1]))
    names = {"train": tasks[:n_train], "dev": tasks[n_train:n_train + n_dev], "test": tasks[n_train + n_dev:]}
    where = {t: name for name, ts in names.items() for t in ts}
    splits: dict[str, list[Any]] = {"train": [], "dev": [], "test": []}
    for it in items:
        splits[where[it.task_id]].append(it)
    manifest = {"seed": seed, "ratios": list(ratios), "tasks": names, "sizes": {k: len(v) for k, v in splits.items()}}
    return splits, manifest


def save_manifest(manifest: dict[str, Any], out_dir: str | Path) -> Path:
    path = Path(out_dir) / "split.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(manifest, indent=2))
    return path
