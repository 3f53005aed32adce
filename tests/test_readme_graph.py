"""The README's hand-built LangGraph graph, as written there, holds the money invariants."""

from __future__ import annotations

import asyncio

import pytest
from langchain_core.messages import AIMessage
from langchain_core.tools import StructuredTool
from langgraph.graph import END, START, StateGraph

from intent import AcceptAll, BudgetGuard, GuardState, Market, PricedTool
from intent.testing import ai, assert_each_call_answered_once, call, scripted


@pytest.mark.parametrize("use_async", [False, True], ids=["sync", "async"])
def test_the_readme_graph_pays_each_run_and_ends_with_nothing_reserved(use_async):
    runs: list[str] = []
    tools = [StructuredTool.from_function(lambda x=0, n=n: runs.append(n) or n, name=n, description=n)
             for n in ("a", "b")]
    guard = BudgetGuard(AcceptAll(), Market([PricedTool("a", 3.0), PricedTool("b", 5.0)]), 12.0)
    model = scripted([ai(call("a", x=1), call("b", x=1), call("a", x=2), call("b", x=2)), AIMessage("done")])

    # ---- as in the README
    def agent_node(state, config):
        settled = guard.prepare(state, config) or {}
        reply = model.bind_tools(tools).invoke(state["messages"], config)
        return {**settled, "messages": [reply]}

    def after_agent(state):
        return "guard" if state["messages"][-1].tool_calls else "end"

    g = StateGraph(GuardState)
    g.add_node("agent", agent_node)
    g.add_node("guard", guard.node())
    g.add_node("tools", guard.tool_node(tools))
    g.add_node("end", lambda state, config: guard.finish(state, config) or {})
    g.add_edge(START, "agent")
    g.add_conditional_edges("agent", after_agent, ["guard", "end"])
    g.add_conditional_edges("guard", lambda s: guard.route(s, end="end"), ["tools", "agent", "end"])
    g.add_edge("tools", "agent")
    g.add_edge("end", END)
    # ----
    graph = g.compile()
    inp = {"messages": [("user", "go")]}
    out = asyncio.run(graph.ainvoke(inp)) if use_async else graph.invoke(inp)
    ledger = guard.ledger(out)
    prices = {"a": 3.0, "b": 5.0}
    assert ledger.spent == sum(prices[n] for n in runs) <= 12.0 and len(runs) == 3  # the fourth does not fit
    assert ledger.reserved == 0 and len(guard.episodes) == 0
    assert_each_call_answered_once(out["messages"])


@pytest.mark.parametrize("use_async", [False, True], ids=["sync", "async"])
def test_a_call_added_while_paused_before_the_tools_is_answered_once_and_not_run(use_async):
    # graph.update_state on a thread paused before the tool node (LangGraph infers as_node="guard"): the gate
    # never saw the added call. It was left unanswered (the model then saw a call without its ToolMessage).
    from langgraph.checkpoint.memory import InMemorySaver

    runs: list[str] = []
    tools = [StructuredTool.from_function(lambda x=0, n=n: runs.append(n) or n, name=n, description=n)
             for n in ("a", "b")]
    guard = BudgetGuard(AcceptAll(), Market([PricedTool("a", 3.0), PricedTool("b", 5.0)]), 20.0)
    model = scripted([ai(call("a", x=1)), AIMessage("done")])

    def agent_node(state, config):
        settled = guard.prepare(state, config) or {}
        return {**settled, "messages": [model.bind_tools(tools).invoke(state["messages"], config)]}

    g = StateGraph(GuardState)
    g.add_node("agent", agent_node)
    g.add_node("guard", guard.node())
    g.add_node("tools", guard.tool_node(tools))
    g.add_node("end", lambda state, config: guard.finish(state, config) or {})
    g.add_edge(START, "agent")
    g.add_conditional_edges("agent", lambda s: "guard" if s["messages"][-1].tool_calls else "end", ["guard", "end"])
    g.add_conditional_edges("guard", lambda s: guard.route(s, end="end"), ["tools", "agent", "end"])
    g.add_edge("tools", "agent")
    g.add_edge("end", END)
    graph = g.compile(checkpointer=InMemorySaver(), interrupt_before=["tools"])
    config = {"configurable": {"thread_id": f"added-{use_async}"}}

    async def arun() -> None:
        await graph.ainvoke({"messages": [("user", "go")]}, config)
        last = (await graph.aget_state(config)).values["messages"][-1]
        added = {"name": "b", "args": {"x": 2}, "id": "added_1", "type": "tool_call"}
        await graph.aupdate_state(config, {"messages": [last.model_copy(update={"tool_calls": [*last.tool_calls, added]})]})
        await graph.ainvoke(None, config)

    if use_async:
        asyncio.run(arun())
    else:
        graph.invoke({"messages": [("user", "go")]}, config)
        last = graph.get_state(config).values["messages"][-1]
        added = {"name": "b", "args": {"x": 2}, "id": "added_1", "type": "tool_call"}
        graph.update_state(config, {"messages": [last.model_copy(update={"tool_calls": [*last.tool_calls, added]})]})
        graph.invoke(None, config)
    out = graph.get_state(config).values
    assert_each_call_answered_once(out["messages"])
    assert runs == ["a"] and guard.ledger(out).spent == 3.0 and guard.ledger(out).reserved == 0
