"""Per-episode results on disk: appended one JSON line at a time, so a run resumes.

A crash can at worst tear the last line; :meth:`ResultStore.load` drops only a torn
*final* line, one without its newline (and says so), and refuses a bad line anywhere else, a
complete last line included, so partial results are
never silently corrupted. A resuming run cuts the torn line from the file; a reader that only
analyses a run (``load(repair=False)``, e.g. ``intent compare``) skips it with a warning and
leaves the file as it is. A complete last line without its newline is kept; a repairing load adds the
newline, so the next append starts a line of its own.
"""

from __future__ import annotations

import json
import os
import threading
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from intent.errors import UsageError
from intent.jsonl import parse_jsonl
from intent.ledger import BUDGET_EPS

__all__ = ["EpisodeResult", "ResultStore", "ResultsFormatError"]

RESULT_SCHEMA = 2  # 2: proposed_calls, answered_calls; a crashed episode is infeasible


class ResultsFormatError(UsageError):
    """A results file is corrupt in a way that resuming cannot repair."""


@dataclass
class EpisodeResult:
    """What one method did on one task."""

    method: str
    task_id: str
    seed: int
    group: str = ""
    passed: float = 0.0  # judge score in [0, 1] before the budget check (0.5 = Unsure)
    answered: bool = False
    solvable: bool | None = None  # None: the market has no budget-optimal ground truth
    budget: float = 0.0
    cost: float = 0.0
    n_calls: int = 0  # executed (charged) calls
    proposed_calls: int = 0  # tool calls the model proposed (the runner checks each got one answer)
    answered_calls: int = 0
    price_sum: float = 0.0  # sum of the prices of executed calls (for AP)
    n_rejected: int = 0
    n_invalid: int = 0
    oracle_errors: int = 0
    wall_s: float = 0.0
    agent_tokens: int = 0
    oracle_tokens: int = 0
    decision_ms: list[float] = field(default_factory=list)
    error: str = ""
    extra: dict[str, Any] = field(default_factory=dict)
    schema: int = RESULT_SCHEMA

    @property
    def crashed(self) -> bool:
        return bool(self.error)

    @property
    def feasible(self) -> bool:
        # A crashed episode did not finish (its spend so far is in ``cost``): never counted as within budget.
        return not self.crashed and self.cost <= self.budget + BUDGET_EPS

    @property
    def score(self) -> float:
        """The paper's reward: judged quality times 1[total cost <= B]."""
        return self.passed if self.feasible else 0.0


class ResultStore:
    """``episodes.jsonl`` in a run directory: append, load, and what is already done."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self.dropped_torn_tail = False

    def append(self, result: EpisodeResult) -> None:
        line = json.dumps(asdict(result), sort_keys=True) + "\n"
        with self._lock, open(self.path, "a", encoding="utf-8") as fh:
            fh.write(line)
            fh.flush()
            os.fsync(fh.fileno())

    def load(self, *, repair: bool = True) -> list[EpisodeResult]:
        """The saved results, in file order. ``repair=False``: read only (see the module docstring)."""
        if not self.path.exists():
            return []
        raw = self.path.read_text(encoding="utf-8")
        # A torn last line (a crash mid-write) is skipped; a complete bad line anywhere, the last included, is
        # corruption and is never cut away by a repair (intent.jsonl, as a guard log is read).
        parsed = parse_jsonl(raw, bad_line=lambda i, exc: ResultsFormatError(
            f"{self.path}:{i}: corrupt line ({exc.msg}); move the file away to restart"))
        results: list[EpisodeResult] = []
        for i, data in parsed.rows:
            if not isinstance(data, dict) or data.get("schema") != RESULT_SCHEMA:
                found = data.get("schema") if isinstance(data, dict) else type(data).__name__
                raise ResultsFormatError(f"{self.path}:{i}: result schema {found!r} != {RESULT_SCHEMA}")
            results.append(EpisodeResult(**data))
        if parsed.torn is not None:
            self._drop_torn_tail(raw, parsed.torn[1], parsed.torn[0], repair)
        elif repair and parsed.unterminated:
            # A whole last line without its newline (append writes both at once, so not a crash of ours: a file
            # edited or copied by hand): kept, and closed here, or the next append would join a second result
            # onto it and the load after that fail on a line holding two.
            with self._lock, open(self.path, "a", encoding="utf-8") as fh:
                fh.write("\n")
                fh.flush()
                os.fsync(fh.fileno())
        return results

    def _drop_torn_tail(self, raw: str, torn: str, line_no: int, repair: bool) -> None:
        if not repair:
            # A reader of someone else's run must not write to it: the run may still be appending, and a
            # resumed run makes the repair itself.
            warnings.warn(f"{self.path}:{line_no}: torn last line skipped (a crash or a running writer mid-line); "
                          "the file is left as it is, and resuming the run cuts the line", stacklevel=3)
            return
        # Remove the torn final line so that the next append starts on a clean line.
        keep = raw[: raw.rfind(torn)]
        with self._lock:
            self.path.write_text(keep, encoding="utf-8")
        self.dropped_torn_tail = True

    def done(self) -> set[tuple[str, str, int]]:
        return {(r.method, r.task_id, r.seed) for r in self.load() if not r.error}
