"""A hand-built graph whose tool node is a plain ``ToolNode`` instead of ``guard.tool_node``: every call the
route sends runs, refused ones too, and nothing is charged. The guard raises GuardConfigError at the next
model boundary (``guard.prepare``, the next gate, ``guard.finish``) instead of going on with a ledger that
says nothing was spent. The legitimate ways a call is answered outside the guard's tool step (another
middleware of ``create_agent``: a cache, a human's reject, a call limit) stay silent.

Executions are counted inside the tools (RunCounter), never read from the guard's bookkeeping.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from test_readme_graph import _readme_graph
from langchain.agents import create_agent
from langchain.agents.middleware import AgentMiddleware, HumanInTheLoopMiddleware, ToolCallLimitMiddleware
from langchain_core.messages import AIMessage, ToolMessage
from langchain_core.tools import StructuredTool
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.graph import END, START, StateGraph
from langgraph.prebuilt import ToolNode
from langgraph.types import Command

from intent import AcceptAll, BudgetGuard, GuardState, Market, MemoryLogSink, PricedTool
from intent.errors import GuardConfigError
from intent.testing import RunCounter, ai, assert_each_call_answered_once, call, scripted

USER = {"messages": [("user", "go")]}


def counted_tool(name: str, runs: RunCounter) -> StructuredTool:
    def fn(x: int = 0) -> str:
        runs.hit(name)
        return f"{name} ran with {x}"

    return StructuredTool.from_function(fn, name=name, description=f"Tool {name}.")


def readme_graph(guard: BudgetGuard, model: Any, tools: list[Any], tool_node: Any, *, checkpointer: Any = None,
                 interrupt_before: list[str] | None = None) -> Any:
    """The README's hand-built graph, with ``tool_node`` as its tools node; checkpointed."""

    return _readme_graph(guard, model, tools, tool_node=tool_node).compile(
        checkpointer=checkpointer or InMemorySaver(), interrupt_before=interrupt_before)


def run(graph: Any, inp: Any, config: dict[str, Any], use_async: bool) -> Any:
    return asyncio.run(graph.ainvoke(inp, config)) if use_async else graph.invoke(inp, config)


MODES = pytest.mark.parametrize("use_async", [False, True], ids=["sync", "async"])


# ====================================================== a plain ToolNode: a configuration error
@MODES
@pytest.mark.parametrize("budget", [30.0, 100.0, 5.0], ids=["one_refused", "all_accepted", "all_refused"])
def test_a_plain_tool_node_after_the_gate_is_a_configuration_error(use_async, budget):
    # Three calls of 12: on 30 the third is refused, on 100 all fit, on 5 none does. A plain ToolNode runs all
    # three (36, unmetered) whatever the gate said; the next model step says so instead of going on.
    runs, sink = RunCounter(), MemoryLogSink()
    tools = [counted_tool("a", runs)]
    guard = BudgetGuard(AcceptAll(), Market([PricedTool("a", 12.0)]), budget, log_sink=sink)
    model = scripted([ai(call("a", x=1), call("a", x=2), call("a", x=3)), AIMessage("done")])
    graph = readme_graph(guard, model, tools, ToolNode(tools))
    config = {"configurable": {"thread_id": f"plain-{use_async}-{budget}"}}
    with pytest.raises(GuardConfigError, match=r"guard\.tool_node\(tools\)") as raised:
        run(graph, USER, config, use_async)
    assert runs["a"] == 3, "the plain ToolNode ran every call, refused ones too"
    assert "3 calls" in str(raised.value) and "ToolNode" in str(raised.value)
    assert len(model.executions) == 1, "raised at the step right after the tools, before the model is asked again"
    # What the ledger says: the runs are not in it (their cost is unknown: unmetered), and no reservation stays
    # held in this process (a shared budget store gets its money back).
    ledger = guard.ledger(graph.get_state(config))
    assert ledger.spent == 0 and ledger.reserved == 0
    released = [r for r in sink.records if r.reason == "ran_outside_guard"]
    assert len(released) == (3 if budget == 100.0 else 2 if budget == 30.0 else 0)
    assert all(r.status == "released" and r.charged == 0 for r in released)


@MODES
def test_the_same_graph_with_guard_tool_node_is_silent_and_pays_each_run(use_async):
    runs, sink = RunCounter(), MemoryLogSink()
    tools = [counted_tool("a", runs)]
    guard = BudgetGuard(AcceptAll(), Market([PricedTool("a", 12.0)]), 30.0, log_sink=sink)
    model = scripted([ai(call("a", x=1), call("a", x=2), call("a", x=3)), AIMessage("done")])
    graph = readme_graph(guard, model, tools, guard.tool_node(tools))
    config = {"configurable": {"thread_id": f"guarded-{use_async}"}}
    out = run(graph, USER, config, use_async)
    assert runs["a"] == 2 and out["messages"][-1].content == "done"
    ledger = guard.ledger(out)
    assert ledger.spent == 24 and ledger.reserved == 0
    assert_each_call_answered_once(out["messages"])


@MODES
def test_a_plain_tool_node_is_caught_by_finish_and_by_the_next_gate_too(use_async):
    # A graph whose agent node does not call prepare: the next gate settles (a second message with calls),
    # and a graph that ends right after the tools settles in finish.
    runs = RunCounter()
    tools = [counted_tool("a", runs)]
    for shape in ("next_gate", "finish"):
        guard = BudgetGuard(AcceptAll(), Market([PricedTool("a", 1.0)]), 10.0)
        model = scripted([ai(call("a", x=1)), ai(call("a", x=2)), AIMessage("done")])
        g = StateGraph(GuardState)
        g.add_node("agent", lambda state, config, model=model: {"messages": [model.invoke(state["messages"], config)]})
        g.add_node("guard", guard.node())
        g.add_node("tools", ToolNode(tools))
        g.add_node("end", lambda state, config, guard=guard: guard.finish(state, config) or {})
        g.add_edge(START, "agent")
        g.add_conditional_edges("agent", lambda s: "guard" if s["messages"][-1].tool_calls else "end",
                                ["guard", "end"])
        g.add_conditional_edges("guard", lambda s, guard=guard: guard.route(s, end="end"), ["tools", "agent", "end"])
        g.add_edge("tools", "agent" if shape == "next_gate" else "end")
        g.add_edge("end", END)
        graph = g.compile(checkpointer=InMemorySaver())
        with pytest.raises(GuardConfigError, match=r"guard\.tool_node"):
            run(graph, USER, {"configurable": {"thread_id": f"{shape}-{use_async}"}}, use_async)
        assert len(model.executions) == (2 if shape == "next_gate" else 1)
    assert runs["a"] == 2


@MODES
def test_a_thread_run_with_a_plain_tool_node_goes_on_with_the_fixed_graph(use_async):
    # The error is raised once for the calls it names: the same thread, run again with guard.tool_node in its
    # place, goes on (the unmetered runs stay out of the ledger, their reservations released).
    runs = RunCounter()
    tools = [counted_tool("a", runs)]
    guard = BudgetGuard(AcceptAll(), Market([PricedTool("a", 12.0)]), 30.0)
    model = scripted([ai(call("a", x=1), call("a", x=2), call("a", x=3)), ai(call("a", x=4)), AIMessage("done")])
    saver = InMemorySaver()
    config = {"configurable": {"thread_id": f"fixed-{use_async}"}}
    with pytest.raises(GuardConfigError):
        run(readme_graph(guard, model, tools, ToolNode(tools), checkpointer=saver), USER, config, use_async)
    fixed = readme_graph(guard, model, tools, guard.tool_node(tools), checkpointer=saver)
    out = run(fixed, None, config, use_async)
    assert runs["a"] == 4 and out["messages"][-1].content == "done"
    ledger = guard.ledger(out)
    assert ledger.spent == 12 and ledger.reserved == 0


def _paused_before_the_tools(tool_node: str, use_async: bool, answered: list[int]) -> tuple[Any, ...]:
    """The README graph paused before its tools (three calls of 12 on 30: the third refused), then a human
    answers the calls at ``answered`` with ``graph.update_state`` (LangGraph's "review tool calls")."""
    runs = RunCounter()
    tools = [counted_tool("a", runs)]
    guard = BudgetGuard(AcceptAll(), Market([PricedTool("a", 12.0)]), 30.0)
    calls = [call("a", x=1), call("a", x=2), call("a", x=3)]
    model = scripted([ai(*calls), AIMessage("done")])
    node = guard.tool_node(tools) if tool_node == "guarded" else ToolNode(tools)
    graph = readme_graph(guard, model, tools, node, interrupt_before=["tools"])
    config = {"configurable": {"thread_id": f"review-{tool_node}-{use_async}-{answered}"}}
    run(graph, USER, config, use_async)
    assert runs["a"] == 0 and graph.get_state(config).next == ("tools",) * 3
    graph.update_state(config, {"messages": [ToolMessage("rejected by a human", tool_call_id=calls[i]["id"])
                                             for i in answered]})
    return guard, runs, graph, config


@MODES
@pytest.mark.parametrize("answered", [[0], [2], [0, 1, 2]], ids=["accepted", "refused", "every"])
def test_a_human_answering_calls_with_update_state_before_guard_tool_node_is_silent(use_async, answered):
    guard, runs, graph, config = _paused_before_the_tools("guarded", use_async, answered)
    out = run(graph, None, config, use_async)
    ran = 2 - sum(i < 2 for i in answered)  # the two accepted calls the human left run; the refused one never
    assert runs["a"] == ran and out["messages"][-1].content == "done"
    ledger = guard.ledger(out)
    assert ledger.spent == 12 * ran and ledger.reserved == 0
    assert_each_call_answered_once(out["messages"])


@MODES
def test_a_human_answering_a_call_before_a_plain_tool_node_does_not_hide_it(use_async):
    guard, runs, graph, config = _paused_before_the_tools("plain", use_async, [0])
    with pytest.raises(GuardConfigError, match=r"2 calls .* guard\.tool_node\(tools\)"):
        run(graph, None, config, use_async)
    assert runs["a"] == 2  # the plain ToolNode ran the accepted call and the refused one
    assert guard.ledger(graph.get_state(config)).spent == 0


# ====================================================== create_agent: calls answered elsewhere stay legitimate
def _agent_case(budget: float, middleware: list[Any], checkpointer: Any = None, script: list[AIMessage] | None = None):
    runs = RunCounter()
    guard = BudgetGuard(AcceptAll(), Market([PricedTool("a", 12.0)]), budget)
    model = scripted(script or [ai(call("a", x=1), call("a", x=2), call("a", x=3)), AIMessage("done")])
    agent = create_agent(model, [counted_tool("a", runs)], middleware=[*middleware, guard.middleware()],
                         checkpointer=checkpointer)
    return guard, runs, agent


class AnswerFromCache(AgentMiddleware):
    """Outside the guard: answers the calls whose x is in ``cached`` itself, from a cache, without running
    the tool (on a budget of 30, x=1 and x=2 are accepted, x=3 refused)."""

    def __init__(self, cached: set[int]) -> None:
        super().__init__()
        self.cached = cached

    def wrap_tool_call(self, request: Any, handler: Any) -> Any:
        if request.tool_call["args"].get("x") in self.cached:
            return ToolMessage("cached", tool_call_id=request.tool_call["id"], name=request.tool_call["name"])
        return handler(request)

    async def awrap_tool_call(self, request: Any, handler: Any) -> Any:
        if request.tool_call["args"].get("x") in self.cached:
            return ToolMessage("cached", tool_call_id=request.tool_call["id"], name=request.tool_call["name"])
        return await handler(request)


@MODES
@pytest.mark.parametrize("cached", [{1, 3}, {1, 2, 3}], ids=["some", "every"])
def test_create_agent_with_a_middleware_that_answers_calls_itself_is_silent(use_async, cached):
    guard, runs, agent = _agent_case(30.0, [AnswerFromCache(cached)])
    out = run(agent, USER, {}, use_async)
    ran = 0 if 2 in cached else 1
    assert runs["a"] == ran and out["messages"][-1].content == "done"
    ledger = guard.ledger(out)
    assert ledger.spent == 12 * ran and ledger.reserved == 0  # the cached answers' reservations given back


@MODES
@pytest.mark.parametrize("rejected", [[1], [0, 1, 2]], ids=["one", "every"])
def test_create_agent_with_a_human_reject_is_silent(use_async, rejected):
    guard, runs, agent = _agent_case(30.0, [HumanInTheLoopMiddleware(interrupt_on={"a": True})], InMemorySaver())
    config = {"configurable": {"thread_id": f"hitl-{use_async}-{rejected}"}}
    assert "__interrupt__" in run(agent, USER, config, use_async)
    decisions = [{"type": "reject", "message": "no"} if i in rejected else {"type": "approve"} for i in range(3)]
    out = run(agent, Command(resume={"decisions": decisions}), config, use_async)
    ran = 0 if 0 in rejected else 1
    assert runs["a"] == ran and out["messages"][-1].content == "done"
    ledger = guard.ledger(out)
    assert ledger.spent == 12 * ran and ledger.reserved == 0


@MODES
def test_create_agent_with_a_tool_call_limit_is_silent(use_async):
    # The limit lets the first message's call run and answers every call of the second itself.
    script = [ai(call("a", x=1)), ai(call("a", x=2), call("a", x=3)), AIMessage("done")]
    guard, runs, agent = _agent_case(100.0, [ToolCallLimitMiddleware(run_limit=1, exit_behavior="continue")],
                                     script=script)
    out = run(agent, USER, {}, use_async)
    assert runs["a"] == 1 and out["messages"][-1].content == "done"
    ledger = guard.ledger(out)
    assert ledger.spent == 12 and ledger.reserved == 0
