"""A benchmark episode's records in the guard log (``logs.jsonl``), as the runner writes them.

The runner logs an episode under the id ``method:task:seed`` (:func:`episode_id`). A resumed run re-runs a
crashed episode under the same id, so the log may hold several attempts of it one after the other; the
result kept in ``episodes.jsonl`` is the last one saved.

**Attempt identity.** Each ``intent bench`` process that runs episodes in a run directory takes the next
attempt number (``OUT/attempts.json``; 1 for the first run, 2 for the first resume that runs anything...), marks
every guard-log record of its episodes with it (the field ``attempt``, :class:`AttemptLogSink`) and saves it in
each result (``extra["attempt"]``). A process runs an episode at most once, so the number names one attempt of
it: not contiguous per episode (an episode finished by run 1 is not run by run 2), but increasing, and distinct
also from an attempt whose process died before saving its result. Readers select the records of the attempt
whose result they show by that number (:func:`kept_attempts`): an attempt that logged no tool record (a crash at
the first model call) shows no calls, and a newer attempt with no result (a run still going, or one that died)
is told apart.

**Older logs.** Records and results written before attempts were marked carry no number. Their attempts are
told apart by a heuristic (:func:`_split_unmarked`): a new attempt starts where the step falls back, or where an
identical (step, call id, decision, execution) is logged again. It misses a re-run that starts at the step where
the previous attempt stopped with new call ids (a real model's ``chatcmpl-tool-<uuid>`` ids, an attempt that
crashed after step 0): the two are read as one attempt. Marked logs do not depend on it.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from intent.logs import LogSink, StepRecord

__all__ = ["ATTEMPT_FIELD", "Attempt", "AttemptLogSink", "KeptAttempt", "attempt_of", "episode_id", "kept_attempts",
           "last_attempts", "split_attempts"]

ATTEMPT_FIELD = "attempt"  # on a guard-log record (an extra field) and in EpisodeResult.extra


def episode_id(method: str, task_id: str, seed: int) -> str:
    """The id the guard logs an episode's records under. Compare ids whole, never split them at ':': a
    method (openai:gpt-x) or a task may hold one, and a method may be another's prefix."""
    return f"{method}:{task_id}:{seed}"


def attempt_of(item: Any) -> int | None:
    """The attempt number of a guard-log record or of an :class:`~eval.results.EpisodeResult`; None when it was
    written before attempts were marked."""
    extra = item.model_extra if isinstance(item, StepRecord) else getattr(item, "extra", None)
    value = (extra or {}).get(ATTEMPT_FIELD)
    return None if value is None or isinstance(value, bool) else int(value)


class AttemptLogSink:
    """Writes each record to ``sink`` marked with the attempt number (the field ``attempt``)."""

    def __init__(self, sink: LogSink, attempt: int) -> None:
        self.sink, self.attempt = sink, attempt

    def write(self, record: StepRecord) -> None:
        self.sink.write(record.model_copy(update={ATTEMPT_FIELD: self.attempt}))


@dataclass
class Attempt:
    """One attempt of an episode: its number (None: logged before attempts were marked) and its tool records."""

    number: int | None
    records: list[StepRecord]


def split_attempts(records: Iterable[StepRecord], episode_ids: Collection[str]) -> dict[str, list[Attempt]]:
    """The tool-call records (``kind="tool"``) of each episode in ``episode_ids`` that has any, split into its
    attempts, each in log order (the guard writes an episode's records in order): first the unmarked ones (an
    older log's, split by the heuristic), then the marked ones by number, oldest first."""
    unmarked: dict[str, list[StepRecord]] = {}
    marked: dict[str, dict[int, list[StepRecord]]] = {}
    for rec in records:
        if rec.task_id not in episode_ids or rec.kind != "tool":
            continue
        number = attempt_of(rec)
        if number is None:
            unmarked.setdefault(rec.task_id, []).append(rec)
        else:
            marked.setdefault(rec.task_id, {}).setdefault(number, []).append(rec)
    out: dict[str, list[Attempt]] = {}
    for eid in (*unmarked, *(e for e in marked if e not in unmarked)):
        out[eid] = [Attempt(None, tries) for tries in _split_unmarked(unmarked.get(eid, []))]
        out[eid] += [Attempt(n, recs) for n, recs in sorted(marked.get(eid, {}).items())]
    return out


def _split_unmarked(records: list[StepRecord]) -> list[list[StepRecord]]:
    """One episode's unmarked records (a log written before attempts were marked) split into attempts by the
    heuristic of the module docstring."""
    if not records:
        return []
    attempts: list[list[StepRecord]] = [[]]
    last_step: int | None = None
    marks: set[tuple[int, str, str, int]] = set()  # (step, call id, decision, execution) of this attempt
    for rec in records:
        if rec.step < 0:
            # Not a model turn's call (a top-up is logged at step -1): it neither starts an attempt nor moves
            # the step.
            attempts[-1].append(rec)
            continue
        mark = (rec.step, rec.call_id, rec.decision, rec.execution)
        if (last_step is not None and rec.step < last_step) or mark in marks:
            # A new attempt from its first turn again. It shows as a step that falls back, or, when both
            # attempts stopped at the same step (a crash at step 0), as a call logged again: the guard writes
            # one record per decision and per execution. A call proposed again at a later step (DFSDT's
            # backtracking) has a new step, so it is not taken for a new attempt.
            attempts.append([])
            marks.clear()
        marks.add(mark)
        last_step = rec.step
        attempts[-1].append(rec)
    return attempts


@dataclass
class KeptAttempt:
    """The records of the attempt whose result an episode shows, and whether a newer attempt has no result."""

    records: list[StepRecord]
    unfinished_newer: bool


def kept_attempts(records: Iterable[StepRecord], saved: Mapping[str, Sequence[int | None]]) -> dict[str, KeptAttempt]:
    """Per episode id of ``saved`` (id -> the attempt numbers of its saved results, in file order; the last is
    the result kept): the tool records of the kept result's attempt. A marked result selects its attempt's
    records by number (none when that attempt logged no tool record). An unmarked one (saved before attempts
    were marked) takes the n-th unmarked attempt of the heuristic, n the count of its unmarked results. An
    episode with no tool record at all is left out."""
    out: dict[str, KeptAttempt] = {}
    for eid, tries in split_attempts(records, saved).items():
        numbers = saved[eid]
        kept = numbers[-1] if numbers else None
        if kept is not None:
            mine = [rec for t in tries if t.number == kept for rec in t.records]
            newer = any(t.number is not None and t.number > kept for t in tries)
        else:
            old = [t for t in tries if t.number is None]
            n = sum(x is None for x in numbers)
            mine = old[min(len(old), n) - 1].records if old and n else []
            newer = len(old) > n or any(t.number is not None for t in tries)
        out[eid] = KeptAttempt(mine, newer)
    return out


def last_attempts(records: Iterable[StepRecord], episode_ids: Collection[str]) -> dict[str, list[StepRecord]]:
    """The tool-call records of each episode in ``episode_ids`` that has any, of its last logged attempt only
    (the highest-numbered; for an unmarked log, the heuristic's last)."""
    return {eid: tries[-1].records for eid, tries in split_attempts(records, episode_ids).items()}
