"""The README's hand-built LangGraph graph, as written there, holds the money invariants."""

from __future__ import annotations

from typing import Any

import asyncio

import pytest
from langchain_core.messages import AIMessage
from langchain_core.tools import StructuredTool
from langgraph.graph import END, START, StateGraph

from intent import AcceptAll, BudgetGuard, GuardState, Market, PricedTool
from intent.testing import ai, assert_each_call_answered_once, call, scripted


def _readme_graph(guard: BudgetGuard, model: Any, tools: list[Any]) -> StateGraph:
    """The README's graph (the test below spells it out as written there)."""

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
    return g


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

    g = _readme_graph(guard, model, tools)
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


@pytest.mark.parametrize("use_async", [False, True], ids=["sync", "async"])
def test_the_readme_graph_fanned_out_as_parallel_subgraphs_shares_one_budget(use_async):
    # A parent graph sends three tasks to the guarded agent at once (map-reduce of agents) in one thread:
    # the branches share the thread's episode. One branch's model step released a sibling's reservation while
    # the sibling's tool ran (LedgerError after the tool had run; tools ran for 14 against a budget of 12).
    import threading

    from langchain_core.language_models.fake_chat_models import GenericFakeChatModel
    from langchain_core.messages import HumanMessage
    from langgraph.checkpoint.memory import InMemorySaver
    from langgraph.types import Send

    runs: list[str] = []
    lock = threading.Lock()
    second_turn = threading.Event()  # a branch's model has been called for its second turn
    inside = threading.Semaphore(0)  # a first call of branch 1 or 2 is running

    def body(name: str) -> Any:
        def run(x: int = 0, k: int = 0) -> str:
            # The overlap the bug needs, every time: branches 1 and 2 are inside their first call (its
            # reservation held) when branch 0 settles at its next model step (its model is called right after).
            if x == 0 and k > 0:
                inside.release()
                assert second_turn.wait(timeout=30)
            elif x == 0:
                assert inside.acquire(timeout=30) and inside.acquire(timeout=30)
            with lock:
                runs.append(name)
            return name
        return run

    tools = [StructuredTool.from_function(body(n), name=n, description=n) for n in ("a", "b")]
    prices = {"a": 3.0, "b": 5.0}
    guard = BudgetGuard(AcceptAll(), Market([PricedTool(n, p) for n, p in prices.items()]), 12.0)

    class Branchy(GenericFakeChatModel):
        """a, then b, then a, then b, then done, by the turn of the branch's own history."""

        def _generate(self, messages: Any, stop: Any = None, run_manager: Any = None, **kwargs: Any) -> Any:
            from langchain_core.outputs import ChatGeneration, ChatResult

            turn = sum(1 for m in messages if isinstance(m, AIMessage))
            k = int(str(messages[0].content).split()[-1])  # "task k"
            if turn == 1:
                second_turn.set()
            name = ("a", "b", "a", "b")[turn] if turn < 4 else None
            msg = AIMessage("done") if name is None else AIMessage("", tool_calls=[
                {"name": name, "args": {"x": turn, "k": k}, "id": f"c{turn}-{k}", "type": "tool_call"}])
            return ChatResult(generations=[ChatGeneration(message=msg)])

        def bind_tools(self, tools: Any, **kwargs: Any) -> Any:
            return self

    model = Branchy(messages=iter(()))

    g = _readme_graph(guard, model, tools)
    parent = StateGraph(GuardState)
    parent.add_node("sub", g.compile())
    parent.add_conditional_edges(START, lambda s: [Send("sub", {"messages": [HumanMessage(f"task {k}")]})
                                                   for k in range(3)], ["sub"])
    parent.add_edge("sub", END)
    graph = parent.compile(checkpointer=InMemorySaver())
    config = {"configurable": {"thread_id": f"fan-{use_async}"}}
    inp = {"messages": [("user", "fan out")]}
    out = asyncio.run(graph.ainvoke(inp, config)) if use_async else graph.invoke(inp, config)
    ledger = guard.ledger(out)
    assert ledger.spent == sum(prices[n] for n in runs) <= 12.0 and len(runs) >= 3
    assert ledger.reserved == 0 and len(guard.episodes) == 0
