"""What the simulated agent needs on a StableToolBench query, inferred from the query text alone.

The agent must not read the judge's answer key (``relevant APIs``). It reads the query the
way a retrieval-minded model would: the query is cut into clauses (sentences, then at
"and", "also", "additionally", ...), every clause is scored against the documents of the
query's retrieved APIs with the benchmark's retrieval embedder, and a clause whose best API
scores at least ``min_score`` becomes one need served by that API. Clauses with no good match
("I'm planning a trip") are context, not needs. A query in which no clause matches gets one
need: the API that best matches the whole query.

Score of API ``a`` for clause ``c`` of query ``q``: ``cos(c, a) + query_weight * cos(q, a)``
(the whole query says which tool the clauses are about); ``min_score`` applies to
``cos(c, a)``. The defaults (0.2 and 0.5) are round values; with TF-IDF they give a need
recall of about 0.58 of the answer key at a precision of about 0.45 (``OUT/retrieval.json``
reports the run's figures). They were looked at once on the full query set, never per query.

:meth:`NeedInference.infer` takes the query *text* and the retrieved APIs, never a query
record, so it cannot see ``relevant APIs``.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from baselines.embeddings import Embedder
from intent.errors import UsageError

from .loader import StbApi
from .retrieval import api_document

__all__ = ["InferredNeed", "NeedInference", "need_recall", "query_clauses", "summarize"]

_SENTENCE = re.compile(r"(?<=[.?!])\s+")
# Where one request ends and the next begins inside a sentence.
_CLAUSE = re.compile(r"\b(?:additionally|also|furthermore|moreover|as well as)\b|;|\band\b", re.I)
_TRIM = " ,.?!:"


def query_clauses(query: str) -> list[str]:
    """The query's sentences, each cut at "and", "also", "additionally", ... (empty parts dropped)."""
    out: list[str] = []
    for sentence in _SENTENCE.split(query.strip()):
        out += [p.strip(_TRIM) for p in _CLAUSE.split(sentence) if p and p.strip(_TRIM)]
    return out


@dataclass(frozen=True)
class InferredNeed:
    """One need: the clause that asks for it, the API the agent will call, and the match score."""

    clause: str
    api: StbApi
    score: float


class NeedInference:
    """Infers needs with one embedder (the retrieval's, fitted on the API pool); API document
    vectors are cached by API, since the same APIs recur across queries."""

    def __init__(self, embedder: Embedder, *, min_score: float = 0.2, query_weight: float = 0.5) -> None:
        if not 0.0 <= min_score <= 1.0:
            raise UsageError(f"min_score is a cosine threshold in [0, 1], got {min_score}")
        if query_weight < 0:
            raise UsageError(f"query_weight must be >= 0, got {query_weight}")
        self.embedder, self.min_score, self.query_weight = embedder, min_score, query_weight
        self._doc_vectors: dict[tuple[str, str, str], np.ndarray] = {}

    def _docs(self, apis: Sequence[StbApi]) -> np.ndarray:
        keys = [(a.function_name, *a.key) for a in apis]
        missing = list({k: a for k, a in zip(keys, apis) if k not in self._doc_vectors}.items())
        if missing:
            vectors = np.asarray(self.embedder.encode([api_document(a) for _, a in missing]))
            for (k, _), v in zip(missing, vectors):
                self._doc_vectors[k] = v
        return np.stack([self._doc_vectors[k] for k in keys])

    def infer(self, query: str, apis: Sequence[StbApi]) -> tuple[InferredNeed, ...]:
        """The needs of ``query`` among ``apis`` (the query's retrieved APIs), in clause order."""
        return self.infer_many([(query, apis)])[0]

    def infer_many(self, items: Sequence[tuple[str, Sequence[StbApi]]]) -> list[tuple[InferredNeed, ...]]:
        """:meth:`infer` for many (query text, retrieved APIs) pairs, with one encoder pass over
        all their texts (what makes MiniLM affordable over 765 queries)."""
        prepared = []
        for query, apis in items:
            apis = list({a.function_name: a for a in apis}.values())  # one need per callable name
            if not apis:
                raise UsageError(f"NeedInference.infer needs the query's retrieved APIs; got none for {query[:60]!r}")
            prepared.append((query, apis, query_clauses(query) or [query]))
        self._docs([a for _, apis, _ in prepared for a in apis])  # encode every new API document at once
        texts = [t for query, _, clauses in prepared for t in (query, *clauses)]
        vectors = np.asarray(self.embedder.encode(texts)) if texts else np.zeros((0, 0))
        out, row = [], 0
        for query, apis, clauses in prepared:
            block = vectors[row: row + 1 + len(clauses)]
            row += 1 + len(clauses)
            out.append(self._pick(query, apis, clauses, block[0], block[1:]))
        return out

    def _pick(self, query: str, apis: list[StbApi], clauses: list[str], query_vector: np.ndarray,
              clause_vectors: np.ndarray) -> tuple[InferredNeed, ...]:
        docs = self._docs(apis)
        whole = query_vector @ docs.T
        needs: list[InferredNeed] = []
        taken: set[str] = set()
        for clause, cos in zip(clauses, clause_vectors @ docs.T):
            score = cos + self.query_weight * whole
            j = int(np.argmax(score))  # ties: the retrieval order
            if cos[j] < self.min_score or apis[j].function_name in taken:
                continue
            taken.add(apis[j].function_name)
            needs.append(InferredNeed(clause, apis[j], float(score[j])))
        if not needs:
            j = int(np.argmax(whole))
            needs.append(InferredNeed(query, apis[j], float(whole[j])))
        return tuple(needs)


def need_recall(inferred: Iterable[str], relevant: Iterable[str]) -> tuple[float, float]:
    """(recall, precision) of inferred function names against the answer key (reporting only)."""
    got, key = set(inferred), set(relevant)
    hit = len(got & key)
    return (hit / len(key) if key else 1.0), (hit / len(got) if got else 0.0)


def summarize(per_query: dict[str, tuple[float, float]], groups: dict[str, str]) -> dict[str, Any]:
    """Mean need recall / precision overall and per group, for ``OUT/retrieval.json``."""
    by_group: dict[str, list[float]] = {}
    for qid, (recall, _) in per_query.items():
        by_group.setdefault(groups[qid], []).append(recall)
    rows = list(per_query.values())
    return {"need_recall": _mean(r for r, _ in rows), "need_precision": _mean(p for _, p in rows),
            "need_recall_per_group": {g: _mean(v) for g, v in sorted(by_group.items())}}


def _mean(values: Iterable[float]) -> float:
    values = list(values)
    return float(np.mean(values)) if values else 0.0
