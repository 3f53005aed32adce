"""The hand-built graph (gate node, guarded ToolNode, routing edge) with every state schema LangGraph
accepts: a TypedDict (``GuardState``), a Pydantic model and a dataclass. The guard reads the messages
and the ledger channel of a state object by attribute, as LangGraph hands them to nodes, edges and
``ToolCallRequest.state``."""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Annotated, Any

import pytest
from langchain_core.messages import AIMessage, AnyMessage, HumanMessage
from langchain_core.runnables import RunnableLambda
from langchain_core.tools import tool
from langgraph.graph import END, START, StateGraph
from langgraph.graph.message import add_messages
from langgraph.types import RetryPolicy
from pydantic import BaseModel

from intent import AcceptAll, BudgetGuard, GuardState, Market, PricedTool
from intent.ledger import merge_ledger_states
from intent.messages import messages_of
from intent.testing import ai, assert_each_call_answered_once, call, scripted


class PydanticState(BaseModel):
    messages: Annotated[list[AnyMessage], add_messages] = []
    intent_ledger: Annotated[dict[str, Any] | None, merge_ledger_states] = None


@dataclasses.dataclass
class DataclassState:
    messages: Annotated[list[AnyMessage], add_messages] = dataclasses.field(default_factory=list)
    intent_ledger: Annotated[dict[str, Any] | None, merge_ledger_states] = None


SCHEMAS = {"typeddict": GuardState, "pydantic": PydanticState, "dataclass": DataclassState}


def _graph(schema: Any, guard: BudgetGuard, model: Any, tools: list[Any]) -> Any:
    def agent_node(state: Any, config: Any) -> dict[str, Any]:
        settled = guard.prepare(state, config) or {}
        return {**settled, "messages": [model.invoke(messages_of(state), config)]}

    async def aagent_node(state: Any, config: Any) -> dict[str, Any]:
        settled = guard.prepare(state, config) or {}
        return {**settled, "messages": [await model.ainvoke(messages_of(state), config)]}

    def after_agent(state: Any) -> str:
        return "guard" if messages_of(state)[-1].tool_calls else "end"

    g = StateGraph(schema)
    g.add_node("agent", RunnableLambda(agent_node, afunc=aagent_node))
    g.add_node("guard", guard.node())
    # Each failed run of a call is retried by the graph: every run paid.
    g.add_node("tools", guard.tool_node(tools), retry_policy=RetryPolicy(max_attempts=2, initial_interval=0.0,
                                                                          jitter=False, retry_on=RuntimeError))
    g.add_node("end", lambda state, config: guard.finish(state, config) or {})
    g.add_edge(START, "agent")
    g.add_conditional_edges("agent", after_agent, ["guard", "end"])
    g.add_conditional_edges("guard", lambda s: guard.route(s, end="end"), ["tools", "agent", "end"])
    g.add_edge("tools", "agent")
    g.add_edge("end", END)
    return g.compile()


@pytest.mark.parametrize("run", ["sync", "async"])
@pytest.mark.parametrize("schema", list(SCHEMAS))
def test_hand_built_graph_with_any_state_schema_pays_every_run(schema: str, run: str) -> None:
    runs: list[str] = []
    failed_once: set[int] = set()

    @tool
    def quote(x: int) -> str:
        """A quote; its first run for x=2 fails (the graph's RetryPolicy runs it again)."""
        runs.append("quote")
        if x == 2 and x not in failed_once:
            failed_once.add(x)
            raise RuntimeError("flaky")
        return f"q{x}"

    guard = BudgetGuard(AcceptAll(), Market([PricedTool("quote", 4.0)]), 15.0)
    model = scripted([
        ai(call("quote", x=1), call("quote", x=2)),  # x=2 runs twice: 3 runs, 12 spent
        ai(call("quote", x=3)),  # 4 more does not fit in the 3 left: refused, never run
        AIMessage("done"),
    ])
    graph = _graph(SCHEMAS[schema], guard, model, [quote])
    inp = {"messages": [HumanMessage("go")]}
    out = graph.invoke(inp) if run == "sync" else asyncio.run(graph.ainvoke(inp))

    ledger = guard.ledger(out)
    assert len(runs) == 3
    assert ledger.spent == pytest.approx(3 * 4.0)
    assert ledger.reserved == 0.0
    assert ledger.spent <= ledger.budget
    assert_each_call_answered_once(out["messages"])
    refusal = out["messages"][-2]
    assert refusal.tool_call_id == model_calls(out)[-1] and refusal.status == "error"


def model_calls(out: dict[str, Any]) -> list[str]:
    return [c["id"] for m in out["messages"] if isinstance(m, AIMessage) for c in m.tool_calls]
