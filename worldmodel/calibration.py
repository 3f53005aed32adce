"""Post-hoc temperature scaling (Guo et al., 2017), isotonic calibration and calibration metrics, numpy only.

Shared by the light hashed-logistic predictor and the encoder trainer in ``training/``.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from intent.errors import UsageError

__all__ = ["ECE_BINS", "apply_isotonic", "auroc", "brier", "ece", "fit_isotonic", "fit_temperature", "nll", "reliability_bins", "score", "sigmoid"]


def sigmoid(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-np.clip(x, -60, 60)))


def nll(probs: Sequence[float], labels: Sequence[int]) -> float:
    p = np.clip(np.asarray(probs, dtype=float), 1e-12, 1 - 1e-12)
    y = np.asarray(labels, dtype=float)
    return float(-np.mean(y * np.log(p) + (1 - y) * np.log(1 - p)))


# Equal-width bins of every ECE and reliability diagram the project reports: one count, so that `intent train
# predictor`'s report.json, `intent train report` and the predictors' calibration choices measure the same ECE.
ECE_BINS = 15


def brier(probs: Sequence[float], labels: Sequence[int]) -> float:
    p, y = np.asarray(probs, dtype=float), np.asarray(labels, dtype=float)
    return float(np.mean((p - y) ** 2))


def reliability_bins(probs: Sequence[float], labels: Sequence[int], n_bins: int = ECE_BINS
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


def ece(probs: Sequence[float], labels: Sequence[int], n_bins: int = ECE_BINS) -> float:
    """Expected calibration error of the positive-class probability: sum_b n_b/N |acc_b - conf_b|."""
    bins = reliability_bins(probs, labels, n_bins)
    total = sum(n for *_, n in bins)
    return float(sum(n / total * abs(acc - conf) for _, conf, acc, n in bins if n)) if total else 0.0


def fit_temperature(logits: Sequence[float], labels: Sequence[int], *, low: float = 0.05, high: float = 20.0) -> float:
    """The T > 0 minimising the NLL of sigmoid(logit / T) (golden-section search on log T)."""
    z, y = np.asarray(logits, dtype=float), np.asarray(labels, dtype=int)
    if len(set(y.tolist())) < 2:
        raise UsageError("temperature scaling needs both classes in the calibration split; "
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


def fit_isotonic(probs: Sequence[float], labels: Sequence[int], *, min_block: int = 20
                 ) -> tuple[list[float], list[float]]:
    """Isotonic regression of the label on ``probs`` (pool-adjacent-violators), as knots.

    Returns ``(xs, ys)``: each pooled block's mean p and its success rate, increasing in both.
    :func:`apply_isotonic` interpolates between the knots, so the map is continuous and ranks
    are kept within a block. Blocks smaller than ``min_block`` calls are pooled with their
    neighbour first (a block of three calls says nothing about a rate). Temperature scaling can
    only stretch the logits; this fixes a predictor that is too low at one end and too high in
    the middle.
    """
    p, y = np.asarray(probs, dtype=float), np.asarray(labels, dtype=float)
    if len(p) != len(y) or len(p) == 0:
        raise UsageError(f"isotonic calibration needs one label per probability (got {len(p)} and {len(y)})")
    if len(set(y.tolist())) < 2:
        raise UsageError("isotonic calibration needs both classes in the calibration split")
    order = np.argsort(p, kind="mergesort")
    # Start from blocks of min_block consecutive calls, then pool adjacent violators.
    blocks: list[list[float]] = []  # [sum p, sum y, n]
    for start in range(0, len(order), min_block):
        sel = order[start:start + min_block]
        blocks.append([float(p[sel].sum()), float(y[sel].sum()), float(len(sel))])
    if len(blocks) > 1 and blocks[-1][2] < min_block:
        last = blocks.pop()
        blocks[-1] = [a + b for a, b in zip(blocks[-1], last)]
    stack: list[list[float]] = []
    for block in blocks:
        stack.append(block)
        while len(stack) > 1 and stack[-2][1] / stack[-2][2] >= stack[-1][1] / stack[-1][2]:
            top = stack.pop()
            stack[-1] = [a + b for a, b in zip(stack[-1], top)]
    xs = [s / n for s, _, n in stack]
    ys = [min(1 - 1e-3, max(1e-3, k / n)) for _, k, n in stack]
    return xs, ys


def apply_isotonic(probs: Sequence[float], xs: Sequence[float], ys: Sequence[float]) -> np.ndarray:
    """Map ``probs`` through the knots of :func:`fit_isotonic` (linear between knots, flat beyond)."""
    return np.interp(np.asarray(probs, dtype=float), np.asarray(xs, dtype=float), np.asarray(ys, dtype=float))


def auroc(probs: Sequence[float], labels: Sequence[int]) -> float:
    """Area under the ROC curve (Mann-Whitney U with average ranks for ties); NaN with one class."""
    p, y = np.asarray(probs, dtype=float), np.asarray(labels, dtype=int)
    n_pos, n_neg = int(y.sum()), int((1 - y).sum())
    if n_pos == 0 or n_neg == 0:
        return float("nan")
    order = np.argsort(p, kind="mergesort")
    ranks = np.empty(len(p))
    sorted_p = p[order]
    i = 0
    while i < len(p):
        j = i
        while j + 1 < len(p) and sorted_p[j + 1] == sorted_p[i]:
            j += 1
        ranks[order[i:j + 1]] = (i + j) / 2 + 1
        i = j + 1
    return float((ranks[y == 1].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))


def score(probs: Sequence[float], labels: Sequence[int], *, delta: float = 0.1) -> dict[str, float]:
    """What every report of a predictor gives on one split (`intent train predictor`, `intent train report`)."""
    n = max(1, len(labels))
    return {
        "auroc": auroc(probs, labels), "nll": nll(probs, labels), "brier": brier(probs, labels),
        "ece": ece(probs, labels, n_bins=ECE_BINS),
        "accuracy": sum((p >= 0.5) == bool(y) for p, y in zip(probs, labels)) / n,
        "share_below_delta": sum(p < delta for p in probs) / n,
    }
