"""Conformance checks every world model and intention predictor must pass.

Like langgraph-checkpoint's conformance suite: a backend author calls
``check_world_model(my_model)`` / ``check_predictor(my_predictor)`` in their tests, and this
project runs them against every backend it ships (``tests/test_conformance.py``).
"""

from __future__ import annotations

from typing import Any

from worldmodel.protocols import IntentionPredictor, WorldModel, predict_many, simulate_counted

__all__ = ["check_predictor", "check_world_model"]

_CALLS = [("get_weather", {"city": "Oslo"}), ("finance_quote", {"symbol": "ACME", "n": 3}), ("no_args", {})]


def check_world_model(model: Any) -> None:
    assert isinstance(model, WorldModel), f"{type(model).__name__} lacks simulate(tool, args, *, satisfied)"
    for tool, args in _CALLS:
        for satisfied in (None, True, False):
            text = model.simulate(tool, args, satisfied=satisfied)
            assert isinstance(text, str), f"simulate must return str, got {type(text).__name__}"
            text2, tokens = simulate_counted(model, tool, args, satisfied=satisfied)
            assert isinstance(text2, str) and isinstance(tokens, int) and tokens >= 0


def check_predictor(predictor: Any) -> None:
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
