"""Conformance checks every world model and intention predictor must pass.

Like langgraph-checkpoint's conformance suite: a backend author calls
``check_world_model(my_model)`` / ``check_predictor(my_predictor)`` in their tests, and this
project runs them against every backend it ships (``tests/test_worldmodels.py``).
"""

from __future__ import annotations

from typing import Any

from intent.errors import UsageError
from worldmodel.protocols import IntentionPredictor, WorldModel, predict_many, simulate_counted

__all__ = ["check_predictor", "check_world_model"]

_CALLS = [("get_weather", {"city": "Oslo"}), ("finance_quote", {"symbol": "ACME", "n": 3}), ("no_args", {})]


def _an_instance(check: str, what: str, obj: Any) -> None:
    if isinstance(obj, type):  # check_oracle takes a factory; these take the object itself
        raise UsageError(f"{check} takes the {what} itself, got the class {obj.__name__}; pass {obj.__name__}(...)")


def check_world_model(model: Any) -> None:
    _an_instance("check_world_model", "world model", model)
    assert isinstance(model, WorldModel), f"{type(model).__name__} lacks simulate(tool, args, *, satisfied)"
    for tool, args in _CALLS:
        for satisfied in (None, True, False):
            text = model.simulate(tool, args, satisfied=satisfied)
            assert isinstance(text, str), f"simulate must return str, got {type(text).__name__}"
            text2, tokens = simulate_counted(model, tool, args, satisfied=satisfied)
            assert isinstance(text2, str) and isinstance(tokens, int) and tokens >= 0


def check_predictor(predictor: Any) -> None:
    _an_instance("check_predictor", "predictor", predictor)
    assert isinstance(predictor, IntentionPredictor), f"{type(predictor).__name__} lacks predict(r, T, u)"
    items = [("I need the weather in Oslo", "get_weather", {"city": "Oslo"}),
             ("quote please", "finance_quote", {"symbol": "ACME"}), ("", "unknown_tool", {})]
    single = [predictor.predict(*it) for it in items]
    for p in single:
        assert 0.0 <= p <= 1.0, f"predict must return a probability in [0, 1], got {p}"
    batch = predict_many(predictor, items)
    assert len(batch) == len(items)
    for a, b in zip(single, batch):
        assert abs(a - b) < 1e-6, "predict_batch must agree with predict"
