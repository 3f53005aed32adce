"""Judging helpers.

* :func:`proxy_pass` is a deterministic **proxy** pass criterion for runs without an LLM judge.
  It is NOT StableToolBench's SoPR and must never be reported under that name.
* :func:`sopr_aggregate` is SoPR's aggregation (``eval_pass_rate.py``) for labels produced by an
  LLM judge: Solved = 1, Unsure = 0.5, Unsolved = 0; per run the average over queries, reported
  as the mean over runs x 100 with ``np.std`` over runs x 100.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence

import numpy as np

from intent.errors import UsageError

__all__ = ["PROXY_LABEL", "SOPR_SCORES", "answer_given", "proxy_pass", "sopr_aggregate"]

PROXY_LABEL = "proxy pass rate (deterministic; not SoPR)"
SOPR_SCORES: dict[str, float] = {"solved": 1.0, "unsure": 0.5, "unsolved": 0.0}
_GIVE_UP = "give_up_and_restart"


def answer_given(answer: str | None) -> bool:
    """A non-empty final answer that is not a give-up. Accepts either the answer text or the raw
    ``Finish`` argument string (``{"return_type": ..., "final_answer": ...}``)."""
    if answer is None or not answer.strip():
        return False
    if _GIVE_UP in answer:
        return False
    try:
        data = json.loads(answer)
    except ValueError:
        return True
    if isinstance(data, dict) and ("return_type" in data or "final_answer" in data):
        if data.get("return_type", "give_answer") != "give_answer":
            return False
        final = data.get("final_answer")
        return isinstance(final, str) and bool(final.strip())
    return True


def proxy_pass(
    answer: str | None, relevant_function_names: Iterable[str], successful_function_names: Iterable[str]
) -> bool:
    """PROXY pass: an answer was given (non-empty, not give-up) AND every relevant API was called
    at least once with a successful result. Not SoPR."""
    if not answer_given(answer):
        return False
    return set(relevant_function_names) <= set(successful_function_names)


def _score(label: str) -> float:
    key = str(label).strip()
    if key.startswith("AnswerStatus."):
        key = key[len("AnswerStatus.") :]
    try:
        return SOPR_SCORES[key.lower()]
    except KeyError:
        raise UsageError(f"unknown SoPR label {label!r}; expected Solved, Unsure or Unsolved") from None


def sopr_aggregate(labels_per_run: Sequence[Sequence[str]]) -> tuple[float, float]:
    """``(mean, std)`` in percent over runs; each run is a list of per-query labels."""
    if not labels_per_run:
        raise UsageError("sopr_aggregate needs at least one run (a list of per-query labels); got none")
    per_run = []
    for i, run in enumerate(labels_per_run):
        if not run:
            raise UsageError(f"sopr_aggregate: run {i} has no labels; give each run one label per query")
        per_run.append(sum(_score(x) for x in run) / len(run))
    arr = np.asarray(per_run, dtype=float)
    return float(arr.mean() * 100), float(np.std(arr) * 100)
