"""Post-hoc temperature scaling (Guo et al., 2017) and calibration metrics, numpy only.

Shared by the light hashed-logistic predictor and the encoder trainer in ``training/``.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

__all__ = ["brier", "ece", "fit_temperature", "nll", "reliability_bins", "sigmoid"]


def sigmoid(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-np.clip(x, -60, 60)))


def nll(probs: Sequence[float], labels: Sequence[int]) -> float:
    p = np.clip(np.asarray(probs, dtype=float), 1e-12, 1 - 1e-12)
    y = np.asarray(labels, dtype=float)
    return float(-np.mean(y * np.log(p) + (1 - y) * np.log(1 - p)))


def brier(probs: Sequence[float], labels: Sequence[int]) -> float:
    p, y = np.asarray(probs, dtype=float), np.asarray(labels, dtype=float)
    return float(np.mean((p - y) ** 2))


def reliability_bins(probs: Sequence[float], labels: Sequence[int], n_bins: int = 10
                     ) -> list[tuple[float, float, float, int]]:
    """Equal-width bins over [0, 1]: (bin lower edge, mean confidence, accuracy, count).

    The last bin is closed on the right (p = 1 falls in it).
    """
    p, y = np.asarray(probs, dtype=float), np.asarray(labels, dtype=float)
    edges = np.linspace(0.0, 1.0, n_bins + 1)
    idx = np.minimum(np.digitize(p, edges[1:-1], right=False), n_bins - 1)
    out = []
    for b in range(n_bins):
        mask = idx == b
        n = int(mask.sum())
        out.append((float(edges[b]), float(p[mask].mean()) if n else 0.0, float(y[mask].mean()) if n else 0.0, n))
    return out


def ece(probs: Sequence[float], labels: Sequence[int], n_bins: int = 10) -> float:
    """Expected calibration error of the positive-class probability: sum_b n_b/N |acc_b - conf_b|."""
    bins = reliability_bins(probs, labels, n_bins)
    total = sum(n for *_, n in bins)
    return float(sum(n / total * abs(acc - conf) for _, conf, acc, n in bins if n)) if total else 0.0


def fit_temperature(logits: Sequence[float], labels: Sequence[int], *, low: float = 0.05, high: float = 20.0) -> float:
    """The T > 0 minimising the NLL of sigmoid(logit / T) (golden-section search on log T)."""
    z, y = np.asarray(logits, dtype=float), np.asarray(labels, dtype=int)
    if len(set(y.tolist())) < 2:
        raise ValueError("temperature scaling needs both classes in the calibration split; "
                         "collect more data or use a larger dev split")

    def loss(log_t: float) -> float:
        return nll(sigmoid(z / np.exp(log_t)), y)

    a, b = np.log(low), np.log(high)
    g = (np.sqrt(5) - 1) / 2
    c, d = b - g * (b - a), a + g * (b - a)
    for _ in range(80):
        if loss(c) < loss(d):
            b = d
        else:
            a = c
        c, d = b - g * (b - a), a + g * (b - a)
    return float(np.exp((a + b) / 2))
