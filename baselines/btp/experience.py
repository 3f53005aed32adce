"""BTP's experience: past tool usages, and from them each tool's value v and frequency cap F for a query.

A :class:`Usage` is one past call: (query, tool, args, observation, useful 0/1, and how many
times that tool was called while answering that query). An :class:`ExperienceStore` holds usages,
built from :class:`Usage` objects, from log records, or from interaction-log JSONL files (see
:meth:`ExperienceStore.from_jsonl`). So the guard's own logs become BTP's experience.

The rules (following BTP's ``filter.py``, described in ``shared/notes`` section 5)
-------------------------------------------------------------------------------------
For the current query ``q_u`` and each past query ``q``, with L2-normalised embeddings::

    sim(q_u, q) = exp((cos(q_u, q) - 1) / T)                  T = temperature = 1

* **Value**, over the tool's past usages U (one per past call)::

      v = (sum_U sim * useful + 0.1) / (sum_U sim + 1.0)

  A tool that was never used gets ``v = 0.1 / 1.0 = 0.1``.
* **Cap F**, over the tool's count history, with one entry per past query that used it (the
  paper's Eq. 4 sums over queries q). The entry's count is the number of calls of the tool in
  that query. Its label is useful when any of those calls was useful. An entry labelled useless
  has its count clipped to at most 1. Then:

  1. no count history: ``F = 1``. This is checked **before** tau, so an unseen tool always
     gets one call;
  2. else ``v < tau`` (0.15): ``F = 0``, the tool is filtered out as useless;
  3. else ``F = int(round(sum_q sim * count / sum_q sim))``. Python's ``round`` rounds half to
     even, so 2.5 gives 2.
* Past usages whose query text equals the current query are dropped when
  ``exclude_same_query`` (BTP drops past usages of test queries). This prevents leakage.
* An empty store, or one where every usage was dropped: every tool gets v = 0.1 and F = 1,
  ``had_experience`` is False, and :attr:`Estimates.message` says that BTP had no experience.

Where this differs from the paper, and why we follow the code
---------------------------------------------------------------
The paper (Eq. 3) defines ``v`` as the plain similarity-weighted average
``sum exp(sim) * score / sum exp(sim)``. Its similarity is a retrieval score inside ``exp``.
BTP's released code adds smoothing, +0.1 in the numerator and +1.0 in the denominator. This
acts like a pseudo-usage of weight 1 with score 0.1, which pulls sparse evidence towards 0.1.
With the plain average, a tool seen once in a distant query with one lucky success would get
v = 1. Its v would also be undefined (0/0) for unseen tools. The code also fixes details the
paper leaves open: ``sim = exp((cos - 1) / T)`` (the paper's ``exp(sim)`` up to a constant
factor), F = 1 for unseen tools instead of an undefined average, the clipping of useless counts,
and the rounding of F. The baseline has to reproduce BTP's reported behaviour, which came from
the code. So we follow the code, and the differences are listed here.
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from intent.errors import UsageError
from intent.logs import label_of, read_log_rows

# The embedders are shared with StableToolBench retrieval; their names stay importable from here.
from baselines.embeddings import Embedder, MiniLMEmbedder, TfidfEmbedder, l2_normalize

__all__ = [
    "Embedder",
    "Estimates",
    "ExperienceStore",
    "MiniLMEmbedder",
    "NO_EXPERIENCE_MESSAGE",
    "TfidfEmbedder",
    "Usage",
]

NO_EXPERIENCE_MESSAGE = ("BTP had no past experience for this query: every tool is valued 0.1 and gets one call "
                         "(the planner only sees prices).")

#: ``decision`` values that mean "the call was accepted" (a record without ``decision`` is taken as accepted).
ACCEPTED_DECISIONS = frozenset({"accept", "accepted"})
#: ``status`` values that mean "the tool actually ran" (a record without ``status`` is taken as executed).
#: ``intent.logs`` writes ``ok`` / ``error`` for executed calls and ``rejected`` / ``invalid`` / ``released`` else.
EXECUTED_STATUSES = frozenset({"ok", "error", "executed", "success"})


# --------------------------------------------------------------------------------------------- data
@dataclass(frozen=True)
class Usage:
    """One past call of ``tool`` while answering ``query``.

    ``useful`` is 0 or 1. ``calls_in_query`` is how many times ``tool`` was called for that query
    in total, counting this call.
    """

    query: str
    tool: str
    args: dict[str, Any] | str
    observation: str
    useful: int
    calls_in_query: int

    def __post_init__(self) -> None:
        if self.useful not in (0, 1) or isinstance(self.useful, float):
            raise UsageError(f"Usage.useful={self.useful!r} for tool {self.tool!r}: must be 0 or 1")
        if isinstance(self.calls_in_query, bool) or not isinstance(self.calls_in_query, int) or self.calls_in_query < 1:
            raise UsageError(f"Usage.calls_in_query={self.calls_in_query!r} for tool {self.tool!r}: must be an "
                             "integer >= 1 (this usage is itself a call)")


@dataclass(frozen=True)
class Estimates:
    """BTP's per-tool estimates for one query: the values and caps to hand to :func:`plan_quotas`.

    ``seen[t]`` says whether ``t`` had any usage history. ``had_experience`` is False when no
    usable past usage existed, and then :attr:`message` says so.
    """

    values: dict[str, float]
    caps: dict[str, int]
    seen: dict[str, bool]
    had_experience: bool
    message: str = field(default="")

    def __post_init__(self) -> None:
        if not self.had_experience and not self.message:
            object.__setattr__(self, "message", NO_EXPERIENCE_MESSAGE)


def _getter(record: Any) -> Callable[..., Any]:
    if isinstance(record, Mapping):
        return record.get
    return lambda key, default=None: getattr(record, key, default)


# --------------------------------------------------------------------------------------------- store
class ExperienceStore:
    """Past usages, and the BTP estimates derived from them (see the module docstring)."""

    def __init__(self, usages: Iterable[Usage] = ()) -> None:
        self.usages: list[Usage] = list(usages)
        for u in self.usages:
            if not isinstance(u, Usage):
                raise TypeError(f"ExperienceStore holds Usage objects, got {type(u).__name__}")
        self.skipped: Counter[str] = Counter()  # records from_records/from_jsonl ignored, by reason
        self._tfidf: TfidfEmbedder | None = None

    def __len__(self) -> int:
        return len(self.usages)

    def __repr__(self) -> str:
        return f"ExperienceStore({len(self.usages)} usages, {len({u.query for u in self.usages})} queries)"

    # ----------------------------------------------------------------------------------------- building
    @classmethod
    def from_usages(cls, usages: Iterable[Usage]) -> ExperienceStore:
        return cls(usages)

    @classmethod
    def from_records(cls, records: Iterable[Any], *,
                     labeler: Callable[[Any], int | None] | None = None) -> ExperienceStore:
        """Build from interaction-log records: dicts, or objects with attributes such as ``intent.logs.StepRecord``.

        The keys read are:

        * ``task_id``: groups the calls of one query. Required unless ``query`` is given.
        * ``query``: the query text. When it is missing or empty, ``task_id`` stands in for it.
        * ``tool``: required. A record without it is skipped.
        * ``args`` and ``observation``: optional; the defaults are ``{}`` and ``""``.
        * the label: ``useful``, else ``z``, else ``artifact["z"]``, read by
          :func:`intent.logs.label_of` (the project's one label extraction). It may be 0/1, a
          bool or ``"0"``/``"1"``; an unreadable label raises. ``labeler(record)`` replaces this
          lookup when given.
        * ``decision``: the record is kept only if it is absent or ``accept``.
        * ``status``: the record is kept only if it is absent or one of ``ok``, ``error``,
          ``executed`` or ``success``, meaning the tool actually ran.

        ``calls_in_query`` counts every accepted and executed call per ``(task_id, tool)``,
        labelled or not. Only labelled calls become usages. Skipped records are counted by reason
        in ``store.skipped``.
        """
        label = labeler or label_of
        skipped: Counter[str] = Counter()
        rows: list[tuple[str, str, str, Any, str, int | None]] = []
        for r in records:
            get = _getter(r)
            decision, status = get("decision"), get("status")
            if decision is not None and str(decision).lower() not in ACCEPTED_DECISIONS:
                skipped["not accepted"] += 1
                continue
            if status is not None and str(status).lower() not in EXECUTED_STATUSES:
                skipped["not executed"] += 1
                continue
            tool, task, query = get("tool"), get("task_id"), get("query")
            if not tool:
                skipped["no tool"] += 1
                continue
            if not query and task is None:
                skipped["no query or task_id"] += 1
                continue
            task_key = str(task) if task is not None else str(query)
            args = get("args")
            obs = get("observation")
            rows.append((task_key, str(query) if query else task_key, str(tool), {} if args is None else args,
                         "" if obs is None else str(obs), label(r)))
        counts: Counter[tuple[str, str]] = Counter((task, tool) for task, _, tool, *_ in rows)
        usages = []
        for task, query, tool, args, obs, z in rows:
            if z is None:
                skipped["unlabelled"] += 1
                continue
            usages.append(Usage(query, tool, args, obs, int(z), counts[(task, tool)]))
        store = cls(usages)
        store.skipped = skipped
        return store

    @classmethod
    def from_jsonl(cls, paths: str | Path | Iterable[str | Path], *,
                   labeler: Callable[[Any], int | None] | None = None) -> ExperienceStore:
        """Build from one or more interaction-log JSONL files, one JSON object per line.

        Blank lines are ignored. The keys read are listed in :meth:`from_records`. Calls are
        counted per ``(task_id, tool)`` across all the files together. The files are read by
        :func:`intent.logs.read_log_rows`, the guard logs' one reader: a line that is not valid
        JSON (a torn last line included: experience is not built from a half-written log), not
        a JSON object, or a guard record whose ``schema_version`` this version of intent does
        not read raises :class:`~intent.logs.LogFormatError` (a ValueError) naming ``file:line``.
        Hand-made records without ``schema_version`` are accepted.
        """
        paths = [paths] if isinstance(paths, (str, Path)) else list(paths)
        records: list[dict[str, Any]] = []
        for path in paths:
            records += read_log_rows(path, skip_torn_tail=False, require_version=False)
        return cls.from_records(records, labeler=labeler)

    # ----------------------------------------------------------------------------------------- estimating
    def default_embedder(self) -> TfidfEmbedder:
        """A :class:`TfidfEmbedder` fitted on the store's queries. It is built once and cached."""
        if self._tfidf is None:
            self._tfidf = TfidfEmbedder().fit(sorted({u.query for u in self.usages}))
        return self._tfidf

    def estimate(self, query: str, tools: Sequence[str], embedder: Embedder | None = None, *, tau: float = 0.15,
                 temperature: float = 1.0, exclude_same_query: bool = True) -> Estimates:
        """BTP's value v and cap F of every tool in ``tools`` for ``query`` (rules in the module docstring).

        ``embedder`` defaults to :meth:`default_embedder`, a TF-IDF fitted on the store's queries.
        """
        if not temperature > 0:
            raise UsageError(f"temperature={temperature!r} must be > 0 (BTP uses T = 1)")
        tools = list(dict.fromkeys(tools))
        usable = [u for u in self.usages if not (exclude_same_query and u.query == query)]
        if not usable:
            return Estimates({t: 0.1 for t in tools}, {t: 1 for t in tools}, {t: False for t in tools}, False)
        wanted = set(tools)
        relevant = [u for u in usable if u.tool in wanted]
        past = sorted({u.query for u in relevant})
        sim_of: dict[str, float] = {}
        if past:
            emb = l2_normalize((embedder or self.default_embedder()).encode([query, *past]))
            if emb.shape[0] != len(past) + 1:
                raise ValueError(f"the embedder returned {emb.shape[0]} rows for {len(past) + 1} texts")
            cos = np.clip(emb[1:] @ emb[0], -1.0, 1.0)
            sim_of = {q: math.exp((float(c) - 1.0) / temperature) for q, c in zip(past, cos)}

        by_tool: dict[str, list[Usage]] = defaultdict(list)
        for u in relevant:
            by_tool[u.tool].append(u)
        values: dict[str, float] = {}
        caps: dict[str, int] = {}
        seen: dict[str, bool] = {}
        for t in tools:
            us = by_tool.get(t, [])
            sims = [sim_of[u.query] for u in us]
            values[t] = (sum(s * u.useful for s, u in zip(sims, us)) + 0.1) / (sum(sims) + 1.0)
            # count history: one entry per past query, useful if any of its calls was
            history: dict[str, tuple[int, int]] = {}
            for u in us:
                count, useful = history.get(u.query, (0, 0))
                history[u.query] = (max(count, u.calls_in_query), max(useful, u.useful))
            seen[t] = bool(history)
            if not history:
                caps[t] = 1  # no count history: one call, checked before tau
            elif values[t] < tau:
                caps[t] = 0
            else:
                num = sum(sim_of[q] * (count if useful else min(count, 1)) for q, (count, useful) in history.items())
                den = sum(sim_of[q] for q in history)
                caps[t] = int(round(num / den))
        return Estimates(values, caps, seen, True)
