"""PNG figures of an intention predictor: the reliability diagram and the histogram of p."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

__all__ = ["p_histogram_png", "reliability_png"]


def reliability_png(path: Path, probs_before: list[float], probs_after: list[float], labels: list[int],
                    title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from worldmodel.calibration import reliability_bins

    fig, (ax, hx) = plt.subplots(2, 1, figsize=(5, 6), sharex=True, gridspec_kw={"height_ratios": [3, 1]})
    ax.plot([0, 1], [0, 1], "k--", lw=1, label="perfect calibration")
    for probs, style, name in ((probs_before, "o-", "uncalibrated"), (probs_after, "s-", "calibrated")):
        pts = [(c, a) for _, c, a, n in reliability_bins(probs, labels) if n]
        ax.plot([p[0] for p in pts], [p[1] for p in pts], style, label=name)
    ax.set_ylabel("observed z = 1 rate")
    ax.set_title(title)
    ax.legend()
    hx.hist(probs_after, bins=20, range=(0, 1), color="gray")
    hx.set_xlabel("predicted p")
    hx.set_ylabel("count")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def p_histogram_png(path: Path, probs: Mapping[str, Sequence[float]], delta: float, title: str) -> None:
    """Histogram of predicted p per predictor, with the blacklist threshold delta marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    for name, values in probs.items():
        ax.hist(list(values), bins=30, range=(0, 1), histtype="step", lw=1.5, label=name)
    ax.axvline(delta, color="k", ls="--", lw=1, label=f"delta = {delta:g} (blacklist)")
    ax.set_xlabel("predicted p (z = 1)")
    ax.set_ylabel("calls")
    ax.set_title(title)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
