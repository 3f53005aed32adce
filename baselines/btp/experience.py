"""BTP's experience: past tool usages, and the value v and frequency cap F of each tool for a query.

Built from ``intent.logs`` JSONL, so the guard's own logs become BTP's experience. A usage is
(query, tool, args, observation, useful 0/1, calls of that tool in that query). Following BTP's
code (``filter.py``), not the paper's plain average:

* ``sim(x, y) = exp((cos(x, y) - 1) / T)`` with T = 1 over query embeddings;
* ``v = (sum sim * useful + 0.1) / (sum sim + 1.0)``: a smoothed average, so an unseen tool has
  v = 0.1;
* ``F``: counts of useless usages are clipped to at most 1; a tool with no usage history gets
  F = 1 (checked **before** tau, so an unseen tool always gets one call); else v < tau (0.15)
  gives F = 0; else ``F = round(sum sim * count / sum sim)`` (Python's round, half to even);
* usages whose query is the current query are dropped (no leakage from the test query).

An empty store still plans: every tool gets v = 0.1, F = 1, and :attr:`Estimates.message` says
that BTP had no experience.
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np

__all__ = ["Embedder", "Estimates", "ExperienceStore", "TfidfEmbedder", "Usage"]


class Embedder(Protocol):
    def encode(self, texts: Sequence[str]) -> np.ndarray: ...  # rows L2-normalised


class TfidfEmbedder:
    """A dependency-free fallback embedder: TF-IDF over word unigrams, L2-normalised."""

    def __init__(self) -> None:
        self.vocab: dict[str, int] = {}
        self.idf: np.ndarray = np.zeros(0)

    @staticmethod
    def _words(text: str) -> list[str]:
        return "".join(c.lower() if c.isalnum() else " " for c in text).split()

    def fit(self, texts: Sequence[str]) -> TfidfEmbedder:
        df: dict[str, int] = defaultdict(int)
        for t in texts:
            for w in set(self._words(t)):
                df[w] += 1
        self.vocab = {w: i for i, w in enumerate(sorted(df))}
        n = max(1, len(texts))
        self.idf = np.array([math.log((1 + n) / (1 + df[w])) + 1 for w in sorted(df)])
        return self

    def encode(self, texts: Sequence[str]) -> np.ndarray:
        out = np.zeros((len(texts), max(1, len(self.vocab))))
        for i, t in enumerate(texts):
            for w in self._words(t):
                j = self.vocab.get(w)
                if j is not None:
                    out[i, j] += self.idf[j]
        norms = np.linalg.norm(out, axis=1, keepdims=True)
        return out / np.where(norms == 0, 1, norms)


@dataclass(frozen=True)
class Usage:
    query: str
    tool: str
    args: Any
    observation: str
    useful: int
    calls_in_query: int


@dataclass(frozen=True)
class Estimates:
    values: dict[str, float]
    caps: dict[str, int]
    seen: dict[str, bool]
    had_experience: bool

    @property
    def message(self) -> str:
        if self.had_experience:
            return ""
        return "BTP had no past experience: every tool is valued 0.1 and gets one call."


class ExperienceStore:
    def __init__(self, usages: Iterable[Usage] = ()) -> None:
        self.usages = list(usages)
        for u in self.usages:
            if u.useful not in (0, 1):
                raise ValueError(f"Usage.useful must be 0 or 1, got {u.useful!r} for tool {u.tool!r}")

    def __len__(self) -> int:
        return len(self.usages)

    @classmethod
    def from_records(cls, records: Iterable[Any], *, labeler: Any = None) -> ExperienceStore:
        """From intent.logs records (StepRecord or dicts) of executed calls with a label z."""
        from worldmodel.replay import label_of

        labeler = labeler or label_of
        rows = []
        for r in records:
            get = r.get if isinstance(r, Mapping) else (lambda k, d=None, r=r: getattr(r, k, d))
            if get("decision") != "accept" or get("status") not in ("ok", "error"):
                continue
            z = labeler(r)
            if z is None:
                continue
            rows.append((get("query") or get("task_id"), get("task_id"), get("tool"), get("args"),
                         get("observation") or "", int(z)))
        counts: dict[tuple[str, str], int] = defaultdict(int)
        for _, task, tool, *_ in rows:
            counts[(task, tool)] += 1
        return cls(Usage(q, tool, args, obs, z, counts[(task, tool)]) for q, task, tool, args, obs, z in rows)

    @classmethod
    def from_jsonl(cls, paths: str | Path | Sequence[str | Path]) -> ExperienceStore:
        paths = [paths] if isinstance(paths, (str, Path)) else list(paths)
        records = []
        for path in paths:
            for i, line in enumerate(Path(path).read_text().splitlines(), start=1):
                if not line.strip():
                    continue
                try:
                    records.append(json.loads(line))
                except json.JSONDecodeError as exc:
                    raise ValueError(f"{path}:{i}: not valid JSON ({exc.msg}); expected intent.logs records") from exc
        return cls.from_records(records)

    def estimate(self, query: str, tools: Sequence[str], embedder: Embedder | None = None, *, tau: float = 0.15,
                 temperature: float = 1.0, exclude_same_query: bool = True) -> Estimates:
        usable = [u for u in self.usages if not (exclude_same_query and u.query == query)]
        if not usable:
            return Estimates({t: 0.1 for t in tools}, {t: 1 for t in tools}, {t: False for t in tools}, False)
        if embedder is None:
            embedder = TfidfEmbedder().fit([u.query for u in usable] + [query])
        queries = sorted({u.query for u in usable})
        emb = embedder.encode([query, *queries])
        cos = emb[1:] @ emb[0]
        sim_of = {q: float(np.exp((c - 1.0) / temperature)) for q, c in zip(queries, cos)}
        by_tool: dict[str, list[Usage]] = defaultdict(list)
        for u in usable:
            by_tool[u.tool].append(u)
        values, caps, seen = {}, {}, {}
        for t in tools:
            us = by_tool.get(t, [])
            sims = [sim_of[u.query] for u in us]
            values[t] = (sum(s * u.useful for s, u in zip(sims, us)) + 0.1) / (sum(sims) + 1.0)
            seen[t] = bool(us)
            if not us:
                caps[t] = 1
            elif values[t] < tau:
                caps[t] = 0
            else:
                counts = [u.calls_in_query if u.useful else min(u.calls_in_query, 1) for u in us]
                caps[t] = int(round(sum(s * c for s, c in zip(sims, counts)) / sum(sims)))
        return Estimates(values, caps, seen, True)
