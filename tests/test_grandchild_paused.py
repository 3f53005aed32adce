"""A grandchild sub-agent paused inside its parent's paused call: a guarded agent whose tool runs a guarded
sub-agent (``FromParent``), whose tool runs a guarded sub-sub-agent; a reviewer's interrupt (or
``langgraph.types.interrupt`` in a tool) inside the grandchild pauses the whole run, which is resumed by the
same guards or by fresh ones (another process). The grandchild's runs are counted once in the top ledger
(through the child's carve), and nothing stays reserved. Executions are counted in the tool bodies."""

from __future__ import annotations

import asyncio
from collections import Counter
from typing import Any

import pytest
from langchain.agents import create_agent
from langchain.agents.middleware import HumanInTheLoopMiddleware
from langchain_core.messages import AIMessage, HumanMessage
from langchain_core.tools import StructuredTool
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.types import Command, interrupt

from intent import AcceptAll, BudgetGuard, FromParent, Market, PricedTool
from intent.testing import ai, call, scripted

PRICES = {"a": 3.0, "b": 2.0, "h": 1.0, "task": 0.0, "task2": 0.0}
CFG = {"configurable": {"thread_id": "p"}}


def _delegate(agent: Any, name: str) -> StructuredTool:
    def run(description: str) -> str:
        return str(agent.invoke({"messages": [HumanMessage(description)]})["messages"][-1].content)

    async def arun(description: str) -> str:
        return str((await agent.ainvoke({"messages": [HumanMessage(description)]}))["messages"][-1].content)

    return StructuredTool.from_function(run, coroutine=arun, name=name, description=name)


@pytest.mark.parametrize("use_async", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("fresh", [False, True], ids=["same_guards", "fresh_guards"])
@pytest.mark.parametrize("pause", ["reviewer", "interrupt"])
def test_a_paused_grandchilds_spending_is_counted_once_at_the_top(pause: str, fresh: bool, use_async: bool) -> None:
    runs: Counter[str] = Counter()

    def a(x: int = 0) -> str:
        runs["a"] += 1
        return f"a {x}"

    def b(x: int = 0) -> str:
        runs["b"] += 1
        return f"b {x}"

    def h(x: int = 0) -> str:
        ok = interrupt({"confirm": x})
        runs["h"] += 1
        return f"h {x} {ok}"

    base = [StructuredTool.from_function(f, name=f.__name__, description=f.__name__) for f in (a, b, h)]
    market = Market([PricedTool(n, p) for n, p in PRICES.items()])
    saver = InMemorySaver()

    def build(grand_script: list[AIMessage], child_script: list[AIMessage], top_script: list[AIMessage]) -> Any:
        top = BudgetGuard(AcceptAll(), market, 50.0)
        child = BudgetGuard(AcceptAll(), market, FromParent(limit=20.0))
        grand = BudgetGuard(AcceptAll(), market, FromParent(limit=10.0))
        reviewer = [HumanInTheLoopMiddleware(interrupt_on={"b": True})] if pause == "reviewer" else []
        grand_agent = create_agent(scripted(grand_script), base, middleware=[*reviewer, grand.middleware()])
        child_agent = create_agent(scripted(child_script), [*base, _delegate(grand_agent, "task2")],
                                   middleware=[child.middleware()])
        return top, (child, grand), create_agent(scripted(top_script), [*base, _delegate(child_agent, "task")],
                                                 middleware=[top.middleware()], checkpointer=saver)

    stop = "b" if pause == "reviewer" else "h"
    grand_script = [ai(call("a", x=1)), ai(call(stop, x=2)), ai(call("a", x=3)), AIMessage("grandchild done")]
    child_script = [ai(call("a", x=10)), ai(call("task2", description="g")), ai(call("a", x=11)), AIMessage("c")]
    top_script = [ai(call("a", x=20)), ai(call("task", description="c")), ai(call("a", x=21)), AIMessage("done")]
    top, subs, agent = build(grand_script, child_script, top_script)

    def go(inp: Any) -> Any:
        return asyncio.run(agent.ainvoke(inp, CFG)) if use_async else agent.invoke(inp, CFG)

    assert "__interrupt__" in go({"messages": [HumanMessage("go")]})
    assert dict(runs) == {"a": 3}  # the top's, the child's and the grandchild's first a
    if fresh:  # another process: each model goes on from where it was
        top, subs, agent = build(grand_script[2:] if pause == "reviewer" else grand_script[1:], child_script[1:],
                                 top_script[1:])
    out = go(Command(resume={"decisions": [{"type": "approve"}]}) if pause == "reviewer" else Command(resume="ok"))
    assert "__interrupt__" not in out
    assert dict(runs) == {"a": 6, stop: 1}
    ledger = top.ledger(out, CFG)
    assert (ledger.spent, ledger.reserved) == (sum(PRICES[k] * n for k, n in runs.items()), 0.0)
    (carve,) = [e for e in ledger.entries() if e.kind == "sub_agent"]
    assert carve.amount == 2 * PRICES["a"] + 2 * PRICES["a"] + PRICES[stop]  # the child's and the grandchild's
    assert len(top.episodes) == 0 and all(len(g.episodes) == 0 for g in subs)
