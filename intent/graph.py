"""The guard in hand-built LangGraph graphs, and the one-call guarded ReAct agent.

Shape of :func:`guard_react_agent`::

    START -> agent -> (tool calls?) -> guard -> (accepted calls?) -> tools -> agent
                   \\-> END                  \\-> agent (all rejected: re-plan)

``guard`` is :meth:`BudgetGuard.node`, ``tools`` is :meth:`BudgetGuard.tool_node`, and the
edge after ``guard`` sends only the accepted, still-unanswered calls to ``tools`` (with
``Send``, as ``create_agent`` does), so a rejected call never reaches a tool.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from langchain_core.messages import AIMessage, SystemMessage, ToolMessage
from langchain_core.runnables import RunnableConfig, RunnableLambda
from langgraph.graph import END, START, StateGraph
from langgraph.prebuilt import ToolNode
from langgraph.types import Send

from intent.guard import LEDGER_KEY, BudgetGuard, GuardState
from intent.market import Market
from intent.oracle import AcceptAll, Oracle

__all__ = ["guard_node", "guard_react_agent", "guarded_tool_node", "route_after_guard"]


def guard_node(guard: BudgetGuard) -> RunnableLambda:
    def gate(state: Mapping[str, Any], config: RunnableConfig) -> dict[str, Any]:
        return guard.gate(state, config) or {}

    async def agate(state: Mapping[str, Any], config: RunnableConfig) -> dict[str, Any]:
        return await guard.agate(state, config) or {}

    return RunnableLambda(gate, afunc=agate, name="budget_guard")


def guarded_tool_node(guard: BudgetGuard, tools: Sequence[Any], **kwargs: Any) -> ToolNode:
    return ToolNode(tools, wrap_tool_call=guard.wrap_tool_call, awrap_tool_call=guard.awrap_tool_call, **kwargs)


def route_after_guard(state: Mapping[str, Any], *, tools: str = "tools", agent: str = "agent") -> Any:
    messages = state.get("messages", [])
    last_ai = next((m for m in reversed(messages) if isinstance(m, AIMessage)), None)
    if last_ai is None:
        return END
    answered = {m.tool_call_id for m in messages if isinstance(m, ToolMessage)}
    entries = (state.get(LEDGER_KEY) or {}).get("entries", {})
    sends = [
        Send(tools, [call])
        for call in last_ai.tool_calls
        if call["id"] not in answered and entries.get(call["id"], {}).get("status") == "reserved"
    ]
    return sends or agent


def _route_after_agent(state: Mapping[str, Any]) -> str:
    messages = state.get("messages", [])
    last = messages[-1] if messages else None
    if isinstance(last, AIMessage) and (last.tool_calls or last.invalid_tool_calls):
        return "guard"
    return END


def guard_react_agent(
    model: Any,
    tools: Sequence[Any],
    *,
    market: Market,
    budget: float,
    oracle: Oracle | None = None,
    system_prompt: str | None = None,
    checkpointer: Any = None,
    guard: BudgetGuard | None = None,
    **guard_kwargs: Any,
) -> Any:
    """A compiled ReAct graph with the budget guard between the agent and its tools.

    ``model`` is any LangChain chat model with ``bind_tools``. Pass ``guard=`` to reuse a
    configured guard (then ``market``, ``budget`` and ``oracle`` must match it).
    """
    guard = guard or BudgetGuard(oracle or AcceptAll(), market, budget, **guard_kwargs)
    tools = list(tools)

    def _prepare(state: Mapping[str, Any], config: RunnableConfig) -> tuple[Any, list[Any]]:
        visible = guard.visible_tool_names(state, config)
        shown = [t for t in tools if visible is None or t.name in visible]
        notes = guard.system_notes(state, config)
        system = "\n\n".join(x for x in (system_prompt, notes) if x)
        messages = list(state["messages"])
        if system:
            messages = [SystemMessage(system), *messages]
        return model.bind_tools(shown) if shown else model, messages

    def agent(state: Mapping[str, Any], config: RunnableConfig) -> dict[str, Any]:
        bound, messages = _prepare(state, config)
        return {"messages": [bound.invoke(messages, config)]}

    async def aagent(state: Mapping[str, Any], config: RunnableConfig) -> dict[str, Any]:
        bound, messages = _prepare(state, config)
        return {"messages": [await bound.ainvoke(messages, config)]}

    graph = StateGraph(GuardState)
    graph.add_node("agent", RunnableLambda(agent, afunc=aagent, name="agent"))
    graph.add_node("guard", guard.node())
    graph.add_node("tools", guard.tool_node(tools))
    graph.add_edge(START, "agent")
    graph.add_conditional_edges("agent", _route_after_agent, ["guard", END])
    graph.add_conditional_edges("guard", lambda s: route_after_guard(s), ["tools", "agent", END])
    graph.add_edge("tools", "agent")
    compiled = graph.compile(checkpointer=checkpointer)
    compiled.guard = guard  # so callers can read the ledger: compiled.guard.ledger(state)
    return compiled
