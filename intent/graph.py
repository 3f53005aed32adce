"""The guard's pieces for hand-built LangGraph graphs: the gate node, the guarded ToolNode and
the routing edge after the gate (the one-call ReAct agent built from them is :mod:`intent.react`).

The edge after the gate sends only the accepted, still-unanswered calls to the tools (with
``Send``, as ``create_agent`` does), so a rejected call never reaches a tool. This module
knows the guard only through its methods: it does not import :mod:`intent.guard`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from langchain_core.runnables import RunnableConfig, RunnableLambda
from langgraph.graph import END
from langgraph.prebuilt import ToolNode
from langgraph.types import Send

from intent.messages import answered_after, last_ai, messages_of
from intent.state import channel_of, missing_channel_error

if TYPE_CHECKING:
    from intent.guard import BudgetGuard

__all__ = ["guard_node", "guarded_tool_node", "route_after_guard"]


def guard_node(guard: BudgetGuard) -> RunnableLambda:
    def gate(state: Mapping[str, Any], config: RunnableConfig) -> dict[str, Any]:
        return guard.gate(state, config) or {}

    async def agate(state: Mapping[str, Any], config: RunnableConfig) -> dict[str, Any]:
        return await guard.agate(state, config) or {}

    return RunnableLambda(gate, afunc=agate, name="budget_guard")


def guarded_tool_node(guard: BudgetGuard, tools: Sequence[Any], **kwargs: Any) -> ToolNode:
    return ToolNode(tools, wrap_tool_call=guard.wrap_tool_call, awrap_tool_call=guard.awrap_tool_call, **kwargs)


def route_after_guard(state: Mapping[str, Any], *, tools: str = "tools", agent: str = "agent", end: str = END) -> Any:
    messages = messages_of(state)  # a dict, or a Pydantic model / dataclass state
    index, ai = last_ai(messages)
    if ai is None:
        return end
    answered = answered_after(messages, index)
    # Every call not answered yet goes to the tool step, which gives it its one answer: accepted calls
    # run, refused ones get their refusal, and one the gate never saw (added or re-id'd by
    # graph.update_state while paused before the tools) is refused as not approved, not left unanswered.
    # (An empty id is a call too: some OpenAI-compatible servers send "", and create_agent runs it.)
    sends = [Send(tools, [call]) for call in ai.tool_calls
             if call.get("id") is not None and call["id"] not in answered]
    if sends and channel_of(state) is None:
        # The gate has just written its decisions to the ledger channel: a state without one is a schema
        # without the channel (LangGraph drops the keys a schema lacks), and every call would be refused as
        # never approved.
        raise missing_channel_error()
    return sends or agent
