"""Intention predictors: the trained encoder, and the ablation baselines of the paper's Table 3."""

from __future__ import annotations

import json
import threading
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from worldmodel.formats import FORMAT_VERSION, predictor_text
from worldmodel.protocols import ModelError, PredictorInput
from worldmodel.replay import label_of

__all__ = ["EmpiricalMeanPredictor", "EncoderIntentionPredictor", "OptimisticPredictor"]


class OptimisticPredictor:
    """Ablation "Optimistic": p = 1 for every call (expected cost = price)."""

    name = "optimistic"

    def predict(self, reasoning: str, tool: str, args: Mapping[str, Any]) -> float:
        return 1.0

    def predict_batch(self, items: Sequence[PredictorInput]) -> list[float]:
        return [1.0] * len(items)


class EmpiricalMeanPredictor:
    """Ablation "Empirical Mean": each tool's observed success frequency, ignoring the reasoning.

    p(tool) = (successes + prior_strength * m) / (calls + prior_strength), where m is the mean
    over all labelled calls (so an unseen tool gets m). Labels come from ``labeler`` (z).
    """

    name = "empirical_mean"

    def __init__(self, records: Iterable[Any] = (), *, labeler: Callable[[Any], int | None] = label_of,
                 prior_strength: float = 2.0, default: float = 0.5) -> None:
        counts: dict[str, list[int]] = defaultdict(lambda: [0, 0])
        for r in records:
            z = labeler(r)
            if z is None:
                continue
            tool = r["tool"] if isinstance(r, Mapping) else r.tool
            counts[tool][0] += z
            counts[tool][1] += 1
        total = sum(c[1] for c in counts.values())
        self.mean = sum(c[0] for c in counts.values()) / total if total else default
        self.prior_strength = prior_strength
        self.table = {t: (s + prior_strength * self.mean) / (n + prior_strength) for t, (s, n) in counts.items()}

    def predict(self, reasoning: str, tool: str, args: Mapping[str, Any]) -> float:
        return self.table.get(tool, self.mean)

    def predict_batch(self, items: Sequence[PredictorInput]) -> list[float]:
        return [self.table.get(tool, self.mean) for _, tool, _ in items]


class EncoderIntentionPredictor:
    """An encoder with a classification head (HF directory) plus its fitted temperature.

    ``calibrated=False`` is the "Uncalibrated" ablation (temperature 1). The directory is what
    ``intent train predictor`` saves: ``config.json``, weights, tokenizer, ``calibration.json``.
    """

    name = "encoder"

    def __init__(self, model_dir: str | Path, *, calibrated: bool = True, device: str = "cpu",
                 batch_size: int = 32, max_length: int = 256) -> None:
        try:
            import torch
            from transformers import AutoModelForSequenceClassification, AutoTokenizer
        except ImportError as exc:  # pragma: no cover - exercised only without the ml extra
            raise ImportError("EncoderIntentionPredictor needs torch and transformers: run `make install` "
                              "or `pip install -e .[ml]`") from exc
        path = Path(model_dir)
        if not (path / "config.json").exists():
            raise FileNotFoundError(f"{path} is not a Hugging Face model directory (no config.json); "
                                    "pass the output directory of `intent train predictor`")
        calibration_file = path / "calibration.json"
        calibration = json.loads(calibration_file.read_text()) if calibration_file.exists() else {}
        if calibration.get("format_version", FORMAT_VERSION) != FORMAT_VERSION:
            raise ValueError(f"{calibration_file}: format_version {calibration.get('format_version')} != "
                             f"{FORMAT_VERSION}; retrain with this version of worldmodel/formats.py")
        self.temperature = float(calibration.get("temperature", 1.0)) if calibrated else 1.0
        self._torch = torch
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.model = AutoModelForSequenceClassification.from_pretrained(path).to(device).eval()
        self.device, self.batch_size, self.max_length = device, batch_size, max_length
        self._lock = threading.Lock()  # one forward pass at a time on a shared model

    def predict(self, reasoning: str, tool: str, args: Mapping[str, Any]) -> float:
        return self.predict_batch([(reasoning, tool, args)])[0]

    def predict_batch(self, items: Sequence[PredictorInput]) -> list[float]:
        torch = self._torch
        texts = [predictor_text(r, t, a) for r, t, a in items]
        out: list[float] = []
        try:
            with self._lock, torch.no_grad():
                for i in range(0, len(texts), self.batch_size):
                    enc = self.tokenizer(texts[i:i + self.batch_size], padding=True, truncation=True,
                                         max_length=self.max_length, return_tensors="pt").to(self.device)
                    logits = self.model(**enc).logits / self.temperature
                    out += torch.softmax(logits, dim=-1)[:, 1].tolist()
        except RuntimeError as exc:
            raise ModelError(f"intention predictor failed: {exc}") from exc
        return out


class HashedLogisticPredictor:
    """A light trained predictor: logistic regression on hashed word n-grams of
    :func:`worldmodel.formats.predictor_text`, temperature-scaled on a dev split. numpy only.

    It is the fast stand-in for the encoder predictor when torch is not wanted (the benchmark's
    quick option); ``calibrated=False`` gives the "Uncalibrated" ablation.
    """

    name = "hashed_logistic"

    def __init__(self, *, n_features: int = 2**12, l2: float = 1e-3, epochs: int = 60, lr: float = 0.5,
                 seed: int = 0) -> None:
        self.n_features, self.l2, self.epochs, self.lr, self.seed = n_features, l2, epochs, lr, seed
        self.weights: Any = None
        self.bias = 0.0
        self.temperature = 1.0
        self.calibrated = True

    def _features(self, texts: Sequence[str]) -> Any:
        import zlib

        import numpy as np

        rows, cols = [], []
        for i, text in enumerate(texts):
            words = [w for w in "".join(c.lower() if c.isalnum() else " " for c in text).split() if w]
            grams = words + [a + "_" + b for a, b in zip(words, words[1:])]
            for g in set(grams):
                rows.append(i)
                cols.append(zlib.crc32(g.encode()) % self.n_features)
        x = np.zeros((len(texts), self.n_features), dtype=np.float32)
        x[rows, cols] = 1.0
        norms = np.sqrt(x.sum(axis=1, keepdims=True))
        return x / np.maximum(norms, 1.0)

    def fit(self, items: Sequence[PredictorInput], labels: Sequence[int], *, dev_fraction: float = 0.2
            ) -> HashedLogisticPredictor:
        import numpy as np

        from worldmodel.calibration import fit_temperature, sigmoid

        y = np.asarray(labels, dtype=float)
        if len(set(y.tolist())) < 2:
            raise ValueError("the intention labels are all one class; a predictor needs both z=0 and z=1 examples")
        rng = np.random.default_rng(self.seed)
        order = rng.permutation(len(items))
        n_dev = max(1, int(len(items) * dev_fraction)) if len(items) >= 10 else 0
        dev, train = order[:n_dev], order[n_dev:]
        x = self._features([predictor_text(*items[i]) for i in range(len(items))])
        w = np.zeros(self.n_features)
        b = 0.0
        xt, yt = x[train], y[train]
        for _ in range(self.epochs):  # full-batch gradient descent: a few thousand rows at most here
            p = sigmoid(xt @ w + b)
            grad = p - yt
            w -= self.lr * (xt.T @ grad / len(train) + self.l2 * w)
            b -= self.lr * float(grad.mean())
        self.weights, self.bias = w, b
        if n_dev and len(set(y[dev].tolist())) == 2:
            self.temperature = fit_temperature(x[dev] @ w + b, y[dev].astype(int))
        return self

    def logits(self, items: Sequence[PredictorInput]) -> Any:
        if self.weights is None:
            raise ValueError("HashedLogisticPredictor is not fitted; call fit(items, labels) first")
        return self._features([predictor_text(*it) for it in items]) @ self.weights + self.bias

    def predict(self, reasoning: str, tool: str, args: Mapping[str, Any]) -> float:
        return self.predict_batch([(reasoning, tool, args)])[0]

    def predict_batch(self, items: Sequence[PredictorInput]) -> list[float]:
        from worldmodel.calibration import sigmoid

        t = self.temperature if self.calibrated else 1.0
        return [float(v) for v in sigmoid(self.logits(items) / t)]
