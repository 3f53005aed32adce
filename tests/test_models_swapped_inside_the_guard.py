"""Models that a middleware listed after the guard runs instead of the agent's own (ModelFallbackMiddleware's
fallback, a router's pick, any custom swap) are priced and charged as what they are, once per execution.

Money is counted outside the guard: each fake model counts its executions and reports fixed usage.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import langchain.agents.middleware as langchain_middleware
import pytest
from langchain.agents import create_agent
from langchain.agents.middleware import ModelFallbackMiddleware

from intent import AcceptAll, BudgetGuard, Market, MemoryLogSink, ModelPrice, PricedTool
from intent.testing import BilledChatModel, ModelRuns, SwapModel

# 200 tokens: 0.2 on the primary, 1.0 on the fallback; a worst case of 100 output tokens on a short
# prompt is a little more.
PRICES = {"primary": ModelPrice(1000, 1000), "fallback": ModelPrice(5000, 5000)}


def Model(*, model_name: str, runs: ModelRuns, fail: bool = False,  # noqa: N802 - reads as a model
          refuse: bool = False) -> BilledChatModel:
    return BilledChatModel(model_name=model_name, runs=runs, fail=fail, refuse=refuse, tokens=(100, 100))




def _run(stack: Any, primary: BilledChatModel, budget: float, use_async: bool, *, prices: Any = None) -> tuple[BudgetGuard, Any]:
    sink = MemoryLogSink()
    guard = BudgetGuard(AcceptAll(), Market([PricedTool("a", 1.0)]), budget, model_prices=prices or PRICES,
                        max_output_tokens=100, log_sink=sink)
    agent = create_agent(primary, [], middleware=stack(guard))
    inp = {"messages": [("user", "hi")]}
    return guard, (asyncio.run(agent.ainvoke(inp)) if use_async else agent.invoke(inp))


def _real(runs: ModelRuns) -> float:
    return runs.cost(PRICES)


@pytest.mark.parametrize("use_async", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("metered", [False, True], ids=["raw", "metered_model"])
@pytest.mark.parametrize("how", ["fallback", "custom"])
def test_a_model_swapped_in_after_the_guard_is_charged_once_at_its_own_price(how, metered, use_async):
    runs = ModelRuns()

    def stack(guard: BudgetGuard) -> list[Any]:
        other = Model(model_name="fallback", runs=runs)
        other = guard.metered_model(other) if metered else other
        return [guard.middleware(), ModelFallbackMiddleware(other) if how == "fallback" else SwapModel(other)]

    guard, out = _run(stack, Model(model_name="primary", runs=runs, fail=how == "fallback"), 10.0, use_async)
    ledger = guard.ledger(out)
    assert runs.names() == ["fallback"] and out["messages"][-1].content == "done"
    assert ledger.spent == pytest.approx(_real(runs)) and ledger.reserved == 0
    assert [(r.tool, r.charged) for r in guard.log_sink.records if r.kind == "model" and r.charged] == [("fallback", 1.0)]


@pytest.mark.parametrize("use_async", [False, True], ids=["sync", "async"])
def test_a_swapped_in_model_whose_worst_case_does_not_fit_is_not_called(use_async, caplog):
    # The primary's worst case fits a budget of 0.5, the fallback's (about 1.05) does not: it must not
    # run (it ran, and the ledger went over the budget).
    runs = ModelRuns()
    with caplog.at_level(logging.WARNING):
        guard, out = _run(lambda g: [g.middleware(), ModelFallbackMiddleware(Model(model_name="fallback", runs=runs))],
                          Model(model_name="primary", runs=runs, fail=True), 0.5, use_async)
    ledger = guard.ledger(out)
    assert runs.names() == [] and ledger.spent == 0 and ledger.reserved == 0
    assert "budget" in str(out["messages"][-1].content)  # the guard's final message says why
    assert not [r for r in caplog.records if "callback" in r.getMessage()]  # a refusal is not a callback error


@pytest.mark.parametrize("use_async", [False, True], ids=["sync", "async"])
def test_an_unpriced_swapped_in_model_is_refused_before_it_runs(use_async):
    runs = ModelRuns()
    guard, out = _run(lambda g: [g.middleware(), ModelFallbackMiddleware(Model(model_name="unlisted", runs=runs))],
                      Model(model_name="primary", runs=runs, fail=True), 10.0, use_async)
    assert runs.names() == []  # it ran (billed), then the guard crashed on its price
    assert guard.ledger(out).spent == 0 and "unlisted" in str(out["messages"][-1].content)


# ModelRefusalMiddleware is new in langchain 1.4.9; the declared floor (1.4.4) has none to compose with.
@pytest.mark.skipif(not hasattr(langchain_middleware, "ModelRefusalMiddleware"),
                    reason="langchain<1.4.9: no ModelRefusalMiddleware")
@pytest.mark.parametrize("use_async", [False, True], ids=["sync", "async"])
def test_a_fallback_after_a_refused_answer_is_paid_too(use_async):
    # LangChain's order: the refusal middleware after the fallback, so the fallback catches its error.
    # Both models ran: both are paid (the fallback's execution went unpaid).
    runs = ModelRuns()
    guard, out = _run(lambda g: [g.middleware(), ModelFallbackMiddleware(Model(model_name="fallback", runs=runs)),
                                 langchain_middleware.ModelRefusalMiddleware()],
                      Model(model_name="primary", runs=runs, refuse=True), 10.0, use_async)
    assert runs.names() == ["primary", "fallback"] and out["messages"][-1].content == "done"
    assert guard.ledger(out).spent == pytest.approx(_real(runs)) == 1.2
