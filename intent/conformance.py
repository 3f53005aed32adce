"""Conformance checks every oracle must pass (run them in your oracle's tests).

``check_oracle(factory)`` takes a zero-argument factory returning a fresh oracle and checks:
it returns :class:`~intent.Decision` objects; its hooks accept the documented arguments; and
under a :class:`~intent.BudgetGuard` with adversarial proposals (parallel batches of calls
bigger than the budget) the executed spend never exceeds the budget.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from langchain_core.messages import AIMessage, HumanMessage

from intent.guard import BudgetGuard
from intent.market import Market, PricedTool
from intent.oracle import Decision, DecisionContext, EpisodeInfo, Outcome, Proposal

__all__ = ["check_oracle"]


def check_oracle(factory: Callable[[], Any], *, budget: float = 30.0) -> None:
    market = Market([PricedTool("cheap", 4), PricedTool("mid", 11), PricedTool("pricey", 26)])
    oracle = factory()
    ctx = DecisionContext("conf-1", "q", Proposal("c0", "cheap", {"x": 1}, "I need x"), 4.0, budget, 0.0, budget,
                          market, step=0, history=[HumanMessage("q"), AIMessage("I need x", tool_calls=[
                              {"name": "cheap", "args": {"x": 1}, "id": "c0", "type": "tool_call"}])],
                          batch=(Proposal("c0", "cheap", {"x": 1}, "I need x"),))
    if hasattr(oracle, "start"):
        oracle.start(EpisodeInfo("conf-1", "q", budget, market))
    decision = oracle.decide(ctx)
    assert isinstance(decision, Decision), f"decide() returned {type(decision).__name__}, not Decision"
    for hook, args in (("visible_tools", (market, "conf-1")), ("prompt_notes", (market, "conf-1", 0.0, budget, budget)),
                       ("result_note", (Outcome("conf-1", ctx.proposal, 4.0, "ok", "{}", 4.0, budget - 4, budget),)),
                       ("observe", (Outcome("conf-1", ctx.proposal, 4.0, "ok", "{}", 4.0, budget - 4, budget),))):
        fn = getattr(oracle, hook, None)
        if callable(fn):
            fn(*args)

    # Adversarial episode: every turn proposes all three tools in parallel, 8 turns, through the
    # guard's real gate and tool step, as the middleware drives them.
    from intent.testing import GuardDriver

    guard = BudgetGuard(factory(), market, budget)
    driver = GuardDriver(guard, thread_id="conf-2", query="spend it all")
    for turn in range(8):
        calls = [{"name": n, "args": {"x": turn}, "id": f"t{turn}-{n}", "type": "tool_call"} for n in market.names]
        driver.step(AIMessage("buy everything", tool_calls=calls))
        spent = driver.ledger.spent
        assert spent <= budget + 1e-9, f"oracle let the guard overspend: {spent} > {budget}"
