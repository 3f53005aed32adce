"""The two model interfaces the oracles use, and helpers that tolerate minimal implementations."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

__all__ = ["IntentionPredictor", "ModelError", "PredictorInput", "WorldModel", "predict_many", "simulate_counted"]


class ModelError(RuntimeError):
    """A world model or predictor failed (server down, timeout, malformed reply).

    Oracles catch it and fall back (documented in each oracle); it is never swallowed silently.
    """


@runtime_checkable
class WorldModel(Protocol):
    """Simulates a tool's output.

    ``satisfied=None``: unconditional, W_phi(o | T, u) (MCO). ``satisfied=True``: the
    conditional generator W_psi(o | T, u, z=1) (INTENT's ideal trajectory).

    Optional: ``simulate_with_usage(...) -> tuple[str, int]`` also returns the tokens spent.
    """

    def simulate(self, tool: str, args: Mapping[str, Any], *, satisfied: bool | None = None) -> str: ...


PredictorInput = tuple[str, str, Mapping[str, Any]]  # (reasoning, tool, args)


@runtime_checkable
class IntentionPredictor(Protocol):
    """p = P(z = 1 | r, T, u): will this call satisfy the intention stated in the reasoning?

    Outputs are calibrated probabilities in [0, 1]. Optional: ``predict_batch(items)``.
    """

    def predict(self, reasoning: str, tool: str, args: Mapping[str, Any]) -> float: ...


def simulate_counted(model: Any, tool: str, args: Mapping[str, Any], *, satisfied: bool | None) -> tuple[str, int]:
    fn = getattr(model, "simulate_with_usage", None)
    if callable(fn):
        text, tokens = fn(tool, args, satisfied=satisfied)
        return str(text), int(tokens)
    return str(model.simulate(tool, args, satisfied=satisfied)), 0


def predict_many(predictor: Any, items: Sequence[PredictorInput]) -> list[float]:
    """One batched call when the predictor has ``predict_batch``, else one call per item."""
    if not items:
        return []
    batch = getattr(predictor, "predict_batch", None)
    values = list(batch(list(items))) if callable(batch) else [predictor.predict(*item) for item in items]
    if len(values) != len(items):
        raise ModelError(f"{type(predictor).__name__}.predict_batch returned {len(values)} values for {len(items)} inputs")
    out = []
    for v in values:
        v = float(v)
        if not 0.0 <= v <= 1.0 or v != v:
            raise ModelError(f"{type(predictor).__name__} returned p={v}; a probability in [0, 1] was expected")
        out.append(v)
    return out
