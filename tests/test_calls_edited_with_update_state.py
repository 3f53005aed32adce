"""A call the guard has gated, edited by the developer with ``agent.update_state`` while the run is paused
(before the tool node, or at a reviewer's interrupt) under the same message id and call id: its arguments
or its tool changed, or a sibling call removed from the message. The edited call is re-priced and re-gated
(the oracle decides it again), runs as edited when accepted and is charged once, at its new price; a
refused edit does not run; a removed call's reservation is released; nothing stays reserved. Likewise by
a fresh guard resuming the thread (another process), sync and async.

Executions are counted inside the tools; the ledger must equal what ran.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from typing import Any

import pytest
from langchain.agents import create_agent
from langchain.agents.middleware import HumanInTheLoopMiddleware
from langchain_core.messages import AIMessage, HumanMessage, ToolMessage
from langchain_core.tools import StructuredTool
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.types import Command

from intent import BudgetGuard, Decision, Market, MemoryLogSink, PricedTool
from intent.testing import ai, assert_each_call_answered_once, assert_one_record_per_call, call, scripted

PRICES = {"a": 10.0, "b": 7.0, "c": 30.0}
CFG = {"configurable": {"thread_id": "t"}}


class NotNinetyNine:
    """Refuses a call with ``x=99`` for a reason of its own (not the budget); counts what it decides."""

    def __init__(self) -> None:
        self.decided: list[tuple[str, Any]] = []

    def decide(self, ctx: Any) -> Decision:
        self.decided.append((ctx.tool, ctx.args.get("x")))
        if ctx.args.get("x") == 99:
            return Decision.rejected("x=99 is not wanted", reason="not_wanted")
        return Decision.accepted()


def _tools(runs: Counter[str]) -> list[StructuredTool]:
    def make(name: str) -> StructuredTool:
        def run(x: int = 0) -> str:
            runs[f"{name}{x}"] += 1
            return f"RAN {name} {x}"
        return StructuredTool.from_function(run, name=name, description=name)
    return [make(n) for n in PRICES]


# edit -> (the first call as edited, or None when the second is removed; what runs; the log's refusal reason)
EDITS = {
    "args": ({"name": "a", "args": {"x": 5}}, {"a5": 1, "b2": 1}, None),
    "cheaper_tool": ({"name": "b", "args": {"x": 5}}, {"b5": 1, "b2": 1}, None),
    "pricier_tool": ({"name": "c", "args": {"x": 5}}, {"b2": 1}, "over_budget"),  # 30 > 35 - 7
    "refused_args": ({"name": "a", "args": {"x": 99}}, {"b2": 1}, "not_wanted"),
    "sibling_removed": (None, {"a5": 1}, None),
}


@pytest.mark.parametrize("use_async", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("fresh", [False, True], ids=["same_guard", "fresh_guard"])
@pytest.mark.parametrize("pause", ["before_tools", "reviewer"])
@pytest.mark.parametrize("edit", list(EDITS))
def test_a_gated_call_edited_with_update_state_is_regated_and_charged_once(edit: str, pause: str, fresh: bool,
                                                                             use_async: bool) -> None:
    runs: Counter[str] = Counter()
    saver = InMemorySaver()

    def build(script: list[AIMessage]) -> tuple[BudgetGuard, NotNinetyNine, MemoryLogSink, Any]:
        oracle, sink = NotNinetyNine(), MemoryLogSink()
        guard = BudgetGuard(oracle, Market([PricedTool(n, p) for n, p in PRICES.items()]), 35.0, log_sink=sink)
        if pause == "reviewer":
            agent = create_agent(scripted(script), _tools(runs), checkpointer=saver, middleware=[
                HumanInTheLoopMiddleware(interrupt_on=dict.fromkeys(PRICES, True)), guard.middleware()])
        else:
            agent = create_agent(scripted(script), _tools(runs), middleware=[guard.middleware()],
                                 checkpointer=saver, interrupt_before=["tools"])
        return guard, oracle, sink, agent

    def go(agent: Any, inp: Any) -> Any:
        return asyncio.run(agent.ainvoke(inp, CFG)) if use_async else agent.invoke(inp, CFG)

    script = [ai(call("a", x=1), call("b", x=2)), AIMessage("done")]
    guard, oracle, sink, agent = build(script)
    go(agent, {"messages": [HumanMessage("go")]})
    paused = agent.get_state(CFG)
    assert (guard.ledger(paused).spent, guard.ledger(paused).reserved) == (0.0, 17.0)  # both gated and held
    old = paused.values["messages"][-1]
    first, second = old.tool_calls
    edited, expected_runs, refusal = EDITS[edit]
    calls = [{**first, **edited}, second] if edited is not None else [{**first, "args": {"x": 5}}]
    agent.update_state(CFG, {"messages": [AIMessage(content=old.content, id=old.id, tool_calls=calls)]})
    if fresh:  # another process resumes the thread
        guard, oracle, sink, agent = build(script[1:])
    out = go(agent, Command(resume={"decisions": [{"type": "approve"}] * len(calls)}) if pause == "reviewer"
             else None)

    assert dict(runs) == expected_runs
    ran = sum(PRICES[str(m.content).split()[1]] for m in out["messages"]
              if isinstance(m, ToolMessage) and str(m.content).startswith("RAN "))
    ledger = guard.ledger(out, CFG)
    assert ran == sum(PRICES[k[0]] * n for k, n in runs.items())
    assert (ledger.spent, ledger.reserved) == (ran, 0.0)
    assert_each_call_answered_once(out["messages"])
    assert_one_record_per_call(out["messages"], sink.records)
    # The edited call was decided again as edited (the oracle saw its new tool and arguments); the unedited
    # sibling was not (a fresh guard has no earlier decisions to count).
    edited_tool, edited_x = calls[0]["name"], calls[0]["args"]["x"]
    assert oracle.decided[-1] == (edited_tool, edited_x)
    assert ("b", 2) not in oracle.decided[(0 if fresh else 2):]
    refusals = [r.reason for r in sink.records if r.decision == "reject"]
    assert refusals == ([refusal] if refusal else [])
