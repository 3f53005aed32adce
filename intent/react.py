"""The one-call guarded ReAct agent, built from :mod:`intent.graph`'s pieces.

Shape of :func:`guard_react_agent`::

    START -> agent -> (tool calls?) -> guard -> (accepted calls?) -> tools -> agent
                   \\-> budget_end -> END     \\-> agent (all rejected: re-plan)

``guard`` is :meth:`BudgetGuard.node`, ``tools`` is :meth:`BudgetGuard.tool_node`. It sits
above both :mod:`intent.guard` and :mod:`intent.graph`, so neither imports the other's module
to build it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from langchain_core.messages import AIMessage, SystemMessage
from langchain_core.runnables import RunnableConfig, RunnableLambda
from langgraph.graph import END, START, StateGraph

from intent.arguments import is_list_arg
from intent.errors import GuardConfigError
from intent.graph import route_after_guard
from intent.guard import BudgetGuard
from intent.ledger import merge_ledger_states
from intent.market import Market
from intent.off_loop import off_loop
from intent.oracle import AcceptAll, Oracle
from intent.state import LEDGER_KEY, GuardState

__all__ = ["guard_react_agent"]


def _route_after_agent(state: Mapping[str, Any]) -> str:
    messages = state.get("messages", [])
    last = messages[-1] if messages else None
    if isinstance(last, AIMessage) and (last.tool_calls or last.invalid_tool_calls):
        return "guard"
    return "budget_end"


def _merge(first: dict[str, Any] | None, second: dict[str, Any]) -> dict[str, Any]:
    """Two updates of one node: the ledger channel merged, the messages concatenated."""
    if not first:
        return second
    out = dict(first)
    for key, value in second.items():
        if key == LEDGER_KEY and key in out:
            out[key] = merge_ledger_states(out[key], value)
        elif key == "messages" and key in out:
            out[key] = [*out[key], *value]
        else:
            out[key] = value
    return out


def guard_react_agent(
    model: Any,
    tools: Sequence[Any],
    *,
    market: Market | None = None,
    budget: float | None = None,
    oracle: Oracle | None = None,
    system_prompt: str | None = None,
    checkpointer: Any = None,
    guard: BudgetGuard | None = None,
    **guard_kwargs: Any,
) -> Any:
    """A compiled ReAct graph with the budget guard between the agent and its tools.

    ``model`` is any LangChain chat model with ``bind_tools``. Pass ``guard=`` to reuse a
    configured guard (then leave out ``market``, ``budget``, ``oracle`` and the guard's other
    arguments, or pass the guard's own: anything else would be silently ignored, so it is refused).
    """
    if guard is not None and not isinstance(guard, BudgetGuard):
        raise GuardConfigError(f"guard_react_agent guard= must be an intent.BudgetGuard, got {type(guard).__name__} "
                               f"{guard!r:.80}; pass guard=BudgetGuard(oracle, market, budget), or market= and budget=")
    if not is_list_arg(tools):
        raise GuardConfigError(f"guard_react_agent tools must be a list of tools, got {type(tools).__name__} "
                               f"{tools!r:.80}; pass [tool, ...]")
    tools = list(tools)
    if not callable(getattr(model, "invoke", None)) or (tools and not callable(getattr(model, "bind_tools", None))):
        raise GuardConfigError(f"guard_react_agent model must be a LangChain chat model with bind_tools, got "
                               f"{type(model).__name__} {model!r:.80}; e.g. init_chat_model('openai:gpt-4o-mini')")
    if guard is not None:
        differs = [name for name, given, its in (("market", market, guard.market), ("budget", budget, guard.budget),
                                                 ("oracle", oracle, guard.oracle))
                   if given is not None and given is not its and given != its] + sorted(guard_kwargs)
        if differs:
            raise GuardConfigError(
                f"guard_react_agent(guard=...) uses that guard's configuration; {', '.join(differs)} would be "
                "ignored: leave them out, or build the guard with them")
    elif market is None or budget is None:
        raise GuardConfigError("guard_react_agent needs market= and budget= (or guard=BudgetGuard(...))")
    else:
        guard = BudgetGuard(oracle or AcceptAll(), market, budget, **guard_kwargs)
    tools = list(tools)

    def _prepare(state: Mapping[str, Any], config: RunnableConfig) -> tuple[Any, list[Any]]:
        visible = guard.visible_tool_names(state, config)
        shown = [t for t in tools if visible is None or t.name in visible]
        notes = guard.system_notes(state, config)
        tail = guard.notes_at == "end"  # per-turn notes after the history keep the prefix cacheable
        system = "\n\n".join(x for x in (system_prompt, None if tail else notes) if x)
        messages = list(state["messages"])
        if system:
            messages = [SystemMessage(system), *messages]
        if tail and notes:
            messages.append(SystemMessage(notes))
        return model.bind_tools(shown) if shown else model, messages

    def agent(state: Mapping[str, Any], config: RunnableConfig) -> dict[str, Any]:
        settled = guard.prepare(state, config)  # unused reservations released, oracle started
        bound, messages = _prepare(state, config)
        return _merge(settled, {"messages": [bound.invoke(messages, config)]})

    async def aagent(state: Mapping[str, Any], config: RunnableConfig) -> dict[str, Any]:
        # (Settling reaches a shared store: then in a thread, not on the event loop; budget_end, a sync
        # RunnableLambda, runs in the executor already.)
        settled = (guard.prepare(state, config) if not guard.reaches_store()
                   else await off_loop(guard.prepare, state, config))
        bound, messages = _prepare(state, config)
        return _merge(settled, {"messages": [await bound.ainvoke(messages, config)]})

    def budget_end(state: Mapping[str, Any], config: RunnableConfig) -> dict[str, Any]:
        return guard.finish(state, config) or {}

    graph = StateGraph(GuardState)
    graph.add_node("agent", RunnableLambda(agent, afunc=aagent, name="agent"))
    graph.add_node("guard", guard.node())
    graph.add_node("tools", guard.tool_node(tools))
    graph.add_node("budget_end", RunnableLambda(budget_end, name="budget_end"))
    graph.add_edge(START, "agent")
    graph.add_conditional_edges("agent", _route_after_agent, ["guard", "budget_end"])
    graph.add_edge("budget_end", END)
    graph.add_conditional_edges("guard", lambda s: route_after_guard(s, end="budget_end"),
                                ["tools", "agent", "budget_end"])
    graph.add_edge("tools", "agent")
    compiled = graph.compile(checkpointer=checkpointer)
    compiled.guard = guard  # so callers can read the ledger: compiled.guard.ledger(state)
    return compiled
