"""Conformance checks every oracle must pass (run them in your oracle's tests).

``check_oracle(factory)`` takes a zero-argument factory returning a fresh oracle and checks:

1. it returns :class:`~intent.Decision` objects and its hooks accept the documented arguments;
2. under a :class:`~intent.BudgetGuard`, through the guard's real gate and tool step, with
   adversarial proposals (every turn proposes every tool in parallel, more than the budget):

   * the money of the tool runs **counted inside the tools themselves** (runs x price, never
     read back from the guard) never exceeds the budget;
   * the ledger charged exactly that money (nothing unpaid, nothing paid twice), also on the
     turns where another middleware answers a call without running it (a cache, a limit);
   * after the episode nothing is still reserved;
   * every proposed call got exactly one ToolMessage.

The facts are observed independently of the guard's bookkeeping, so a guard that charged
nothing, charged twice, let a call through unpaid or dropped an answer fails the check.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable
from typing import Any

from langchain_core.messages import AIMessage, HumanMessage, ToolMessage

from intent.guard import BudgetGuard
from intent.market import Market, PricedTool
from intent.oracle import Decision, DecisionContext, EpisodeInfo, Outcome, Proposal

__all__ = ["CountingTool", "check_oracle"]

_EPS = 1e-9


class CountingTool:
    """A stand-in tool that counts its real executions by name (what the guard cannot fake)."""

    def __init__(self, name: str, runs: Counter[str], lock: threading.Lock | None = None) -> None:
        self.name = name
        self.runs = runs
        self._lock = lock or threading.Lock()

    def invoke(self, tool_input: Any, config: Any = None, **_: Any) -> ToolMessage:
        with self._lock:
            self.runs[self.name] += 1
        call_id = tool_input["id"] if isinstance(tool_input, dict) and "id" in tool_input else ""
        return ToolMessage(f"{self.name} ran", tool_call_id=call_id, name=self.name)


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

    # Adversarial episode: every turn proposes all three tools in parallel (41 > budget when
    # budget = 30), 8 turns, through the guard's real gate and tool step, as the middleware
    # drives them. The tools count their own runs.
    from intent.testing import GuardDriver, assert_each_call_answered_once

    runs: Counter[str] = Counter()
    lock = threading.Lock()
    tools = {name: CountingTool(name, runs, lock) for name in market.names}
    guard = BudgetGuard(factory(), market, budget)
    driver = GuardDriver(guard, thread_id="conf-2", query="spend it all", tools=tools)

    def answered_elsewhere(request: Any) -> ToolMessage:
        # Stands for a middleware inside the guard that answers without running the tool:
        # the guard must not charge it and must give its reservation back.
        c = request.tool_call
        if c["name"] == "cheap":
            return ToolMessage("served from a cache", tool_call_id=c["id"], name=c["name"])
        return GuardDriver._run(request)

    for turn in range(8):
        calls = [{"name": n, "args": {"x": turn}, "id": f"t{turn}-{n}", "type": "tool_call"} for n in market.names]
        driver.step(AIMessage("buy everything", tool_calls=calls), run_tool=answered_elsewhere if turn % 2 else None)
        ran = sum(runs[n] * market.price(n) for n in market.names)  # the market never changes here
        assert ran <= budget + _EPS, (
            f"turn {turn}: the tools ran for {ran:g} ({dict(runs)}) but the budget is {budget:g}: overspent")
        spent = driver.ledger.spent
        assert abs(spent - ran) <= _EPS, (
            f"turn {turn}: the tools ran for {ran:g} ({dict(runs)}) but the ledger charged {spent:g}")
    driver.finish()
    ledger = driver.ledger
    assert ledger.reserved <= _EPS, f"{ledger.reserved:g} still reserved after the episode ended"
    assert_each_call_answered_once(driver.state["messages"])
