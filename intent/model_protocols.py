"""The two model interfaces the oracles use (world model, intention predictor), their failure, and the
helpers that call minimal implementations of them; also the canonical form of a call's arguments, the key
under which the oracles cache what a model said about a call.

The oracles (:mod:`intent.oracles`, :mod:`intent.rollout`) need only this; the models themselves live in
``worldmodel``, above ``intent``, which re-exports these names from :mod:`worldmodel.protocols` (and
``canonical_args`` from :mod:`worldmodel.formats`, whose prompts show it).
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

from intent.errors import UsageError

__all__ = ["AtTemperature", "IntentionPredictor", "ModelError", "PredictorInput", "WorldModel", "accepts_temperature",
           "canonical_args", "predict_many", "simulate_counted"]


class ModelError(RuntimeError):
    """A world model or predictor failed (server down, timeout, malformed reply).

    Oracles catch it and fall back (documented in each oracle); it is never swallowed silently.
    """


@runtime_checkable
class WorldModel(Protocol):
    """Simulates a tool's output.

    ``satisfied=None``: unconditional, W_phi(o | T, u) (MCO). ``satisfied=True``: the
    conditional generator W_psi(o | T, u, z=1) (INTENT's ideal trajectory).

    Optional: ``simulate_with_usage(...) -> tuple[str, int]`` also returns the tokens spent, and
    a ``temperature: float | None = None`` keyword on both, the sampling temperature of this
    call (None: the model's own setting). MCO samples its rollouts at its own temperature
    through it (:class:`AtTemperature`); a model without the keyword samples as it always does.
    """

    def simulate(self, tool: str, args: Mapping[str, Any], *, satisfied: bool | None = None) -> str: ...


PredictorInput = tuple[str, str, Mapping[str, Any]]  # (reasoning, tool, args)


@runtime_checkable
class IntentionPredictor(Protocol):
    """p = P(z = 1 | r, T, u): will this call satisfy the intention stated in the reasoning?

    Outputs are calibrated probabilities in [0, 1]. Optional: ``predict_batch(items)``.
    """

    def predict(self, reasoning: str, tool: str, args: Mapping[str, Any]) -> float: ...


def canonical_args(args: Mapping[str, Any] | str) -> str:
    """Arguments as canonical JSON (sorted keys, compact), the key for caches and prompts."""
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError:
            return args
    return json.dumps(args, sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=str)


def accepts_temperature(model: Any) -> bool:
    """Whether ``model`` takes a per-call ``temperature`` keyword (on ``simulate`` and, when it
    has one, on ``simulate_with_usage``)."""
    fns = [getattr(model, "simulate", None), getattr(model, "simulate_with_usage", None)]
    fns = [f for f in fns if callable(f)]
    if not fns:
        return False
    for fn in fns:
        try:
            params = inspect.signature(fn).parameters.values()
        except (TypeError, ValueError):  # a builtin or C callable without a signature
            return False
        if not any(p.name == "temperature" or p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
            return False
    return True


def simulate_counted(model: Any, tool: str, args: Mapping[str, Any], *, satisfied: bool | None,
                     temperature: float | None = None) -> tuple[str, int]:
    """``(observation, tokens)`` from any world model; ``temperature`` is passed on when given
    (a TypeError names the fix when the model has no such keyword)."""
    kw: dict[str, Any] = {"satisfied": satisfied}
    if temperature is not None:
        if not accepts_temperature(model):
            raise TypeError(f"{type(model).__name__}.simulate takes no 'temperature' keyword; add "
                            "`temperature: float | None = None` to it (and to simulate_with_usage) to sample at a "
                            "given temperature, or pass temperature=None to use the model's own setting")
        kw["temperature"] = temperature
    fn = getattr(model, "simulate_with_usage", None)
    if callable(fn):
        text, tokens = fn(tool, args, **kw)
        return _observation(model, text), int(tokens)
    return _observation(model, model.simulate(tool, args, **kw)), 0


def _observation(model: Any, text: Any) -> str:
    # A served model's garbage is still text (a ModelError is its adapter's to raise); anything else is a bug
    # in the adapter, which str() would turn into a plausible observation ("None").
    if not isinstance(text, str):
        raise TypeError(f"{type(model).__name__}.simulate returned {type(text).__name__} ({text!r:.80}); a world "
                        "model returns the simulated observation as a str")
    return text


class AtTemperature:
    """``model`` seen at a fixed sampling temperature: every call passes ``temperature`` on.

    An oracle that owns a temperature (MCO samples at 1.0, paper B.2) wraps its world model in
    this, so the setting takes effect whatever temperature the model was built with.
    ``fork(seed)`` forks the inner model's random stream, when it has one.
    """

    def __init__(self, model: Any, temperature: float) -> None:
        if not float(temperature) >= 0:
            raise UsageError(f"temperature must be >= 0, got {temperature!r}")
        if not accepts_temperature(model):
            raise TypeError(f"{type(model).__name__}.simulate takes no 'temperature' keyword; add "
                            "`temperature: float | None = None` to sample at a given temperature")
        self.model, self.temperature = model, float(temperature)
        self.name = f"{getattr(model, 'name', type(model).__name__)}@T={self.temperature:g}"

    def simulate(self, tool: str, args: Mapping[str, Any], *, satisfied: bool | None = None) -> str:
        return self.simulate_with_usage(tool, args, satisfied=satisfied)[0]

    def simulate_with_usage(self, tool: str, args: Mapping[str, Any], *, satisfied: bool | None = None
                            ) -> tuple[str, int]:
        return simulate_counted(self.model, tool, args, satisfied=satisfied, temperature=self.temperature)

    def fork(self, seed: int) -> AtTemperature:
        fork = getattr(self.model, "fork", None)
        return AtTemperature(fork(seed), self.temperature) if callable(fork) else self


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
        if isinstance(v, bool) or not isinstance(v, (int, float)) and not hasattr(v, "__float__"):
            # Not a number at all: the predictor's code is wrong (a bug, not a model's bad output).
            raise TypeError(f"{type(predictor).__name__} returned {type(v).__name__} ({v!r:.80}); a predictor "
                            "returns each probability as a float in [0, 1]")
        v = float(v)
        if not 0.0 <= v <= 1.0 or v != v:
            raise ModelError(f"{type(predictor).__name__} returned p={v}; a probability in [0, 1] was expected")
        out.append(v)
    return out
