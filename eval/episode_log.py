"""A benchmark episode's records in the guard log (``logs.jsonl``), as the runner writes them.

The runner logs an episode under the id ``method:task:seed`` (:func:`episode_id`). A resumed run re-runs a
crashed episode under the same id, so the log may hold several attempts of it one after the other; the
result kept in ``episodes.jsonl`` is the last attempt's, so its readers (``intent compare``, ``make
bench-llm``'s call statistics) keep only the last attempt's records (:func:`last_attempts`).
"""

from __future__ import annotations

from collections.abc import Collection, Iterable

from intent.logs import StepRecord

__all__ = ["episode_id", "last_attempts", "split_attempts"]


def episode_id(method: str, task_id: str, seed: int) -> str:
    """The id the guard logs an episode's records under. Compare ids whole, never split them at ':': a
    method (openai:gpt-x) or a task may hold one, and a method may be another's prefix."""
    return f"{method}:{task_id}:{seed}"


def split_attempts(records: Iterable[StepRecord], episode_ids: Collection[str]) -> dict[str, list[list[StepRecord]]]:
    """The tool-call records (``kind="tool"``) of each episode in ``episode_ids`` that has any, split into its
    attempts (oldest first), each in log order (the guard writes an episode's records in order)."""
    attempts: dict[str, list[list[StepRecord]]] = {}
    last_step: dict[str, int] = {}
    seen: dict[str, set[tuple[int, str, str, int]]] = {}  # per episode id: (step, call id, decision, execution)
    for rec in records:
        if rec.task_id not in episode_ids or rec.kind != "tool":
            continue
        mark = (rec.step, rec.call_id, rec.decision, rec.execution)
        marks = seen.setdefault(rec.task_id, set())
        mine = attempts.setdefault(rec.task_id, [[]])
        if rec.step < last_step.get(rec.task_id, rec.step) or mark in marks:
            # A new attempt from its first turn again. It shows as a step that falls back, or, when both
            # attempts stopped at the same step (a crash at step 0), as a call logged again: the guard writes
            # one record per decision and per execution. A call proposed again at a later step (DFSDT's
            # backtracking) has a new step, so it is not taken for a new attempt.
            mine.append([])
            marks.clear()
        marks.add(mark)
        last_step[rec.task_id] = rec.step
        mine[-1].append(rec)
    return attempts


def last_attempts(records: Iterable[StepRecord], episode_ids: Collection[str]) -> dict[str, list[StepRecord]]:
    """The tool-call records of each episode in ``episode_ids`` that has any, of its last attempt only."""
    return {eid: tries[-1] for eid, tries in split_attempts(records, episode_ids).items()}
