"""Sub-agents started with a copy of the parent's graph state, as deepagents' ``task`` tool does.

deepagents copies every state key of the parent but a few into the sub-agent's input (the guard's
ledger channel included) and merges the sub-agent's changed keys back into the parent's state. A
child guard (``FromParent``) must still carve its budget from the parent's tool call and spend
only that; the parent's ledger must not be taken over, and nothing may be charged twice or lost.
Runs are counted inside the tools.
"""

from __future__ import annotations

import asyncio
import threading
from collections import Counter
from typing import Annotated, Any

import pytest
from langchain.agents import create_agent
from langchain.tools import InjectedState, InjectedToolCallId
from langchain_core.messages import AIMessage, HumanMessage, ToolMessage
from langchain_core.tools import StructuredTool
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.types import Command

from intent import AcceptAll, BudgetGuard, FromParent, GuardConfigError, Market, PricedTool
from intent.state import LEDGER_KEY
from intent.testing import ai, assert_each_call_answered_once, call, scripted

PRICE_A = 3.0
MARKET = Market([PricedTool("a", PRICE_A), PricedTool("task", 0.0)])
EXCLUDED = ("messages", "todos", "structured_response")  # what deepagents does not copy


class Runs:
    def __init__(self) -> None:
        self.counts: Counter = Counter()
        self._lock = threading.Lock()

    def tool(self) -> StructuredTool:
        def a(x: int = 0) -> str:
            with self._lock:
                self.counts["a"] += 1
            return f"a={x}"

        return StructuredTool.from_function(a, name="a", description="Tool a.")


def task_tool(make_child: Any, use_async: bool, finals: list[Any] | None = None) -> StructuredTool:
    """deepagents' task tool, reduced: the sub-agent gets a copy of the parent's state and a new
    human message; its changed state comes back as the tool's Command update. ``finals`` collects
    the sub-agent's final states."""

    def child_input(state: dict, description: str) -> dict:
        copied = {k: v for k, v in state.items() if k not in EXCLUDED}
        return {**copied, "messages": [HumanMessage(description)]}

    def answer(result: dict, tool_call_id: str) -> Command:
        if finals is not None:
            finals.append(result)
        back = {k: v for k, v in result.items() if k not in EXCLUDED}
        text = str(result["messages"][-1].content)
        return Command(update={**back, "messages": [ToolMessage(text, tool_call_id=tool_call_id, name="task")]})

    def task(description: str, state: Annotated[dict, InjectedState],
             tool_call_id: Annotated[str, InjectedToolCallId]) -> Command:
        return answer(make_child().invoke(child_input(state, description)), tool_call_id)

    async def atask(description: str, state: Annotated[dict, InjectedState],
                    tool_call_id: Annotated[str, InjectedToolCallId]) -> Command:
        return answer(await make_child().ainvoke(child_input(state, description)), tool_call_id)

    return StructuredTool.from_function(task, coroutine=atask if use_async else None, name="task",
                                        description="Delegate to a sub-agent.")


def parent_script() -> list[AIMessage]:
    return [ai(call("task", description="call a three times")), ai(call("a", x=9), call("a", x=10)),
            ai(text="parent done")]


def child_script() -> list[AIMessage]:
    return [ai(call("a", x=1)), ai(call("a", x=2)), ai(call("a", x=3)), ai(text="child done")]


def run(agent: Any, use_async: bool, config: Any) -> Any:
    inp = {"messages": [("user", "go")]}
    return asyncio.run(agent.ainvoke(inp, config)) if use_async else agent.invoke(inp, config)


@pytest.mark.parametrize("use_async", [False, True])
@pytest.mark.parametrize("thread", [True, False])
def test_a_child_guard_on_a_copy_of_the_parents_state_spends_only_its_carve(thread, use_async):
    runs = Runs()
    parent = BudgetGuard(AcceptAll(), MARKET, 10.0)
    child = BudgetGuard(AcceptAll(), MARKET, FromParent(limit=4.0))  # room for one run of a

    def make_child() -> Any:
        return create_agent(scripted(child_script()), [runs.tool()], middleware=[child.middleware()])

    finals: list[Any] = []
    agent = create_agent(scripted(parent_script()), [runs.tool(), task_tool(make_child, use_async, finals)],
                         middleware=[parent.middleware()], checkpointer=InMemorySaver() if thread else None)
    out = run(agent, use_async, {"configurable": {"thread_id": "p"}} if thread else None)
    ledger = parent.ledger(out)
    # The child runs a once (3 of its 4), its second call does not fit; the parent then has 7 left
    # and runs both of its calls: 9 spent, and every run is paid exactly once.
    assert runs.counts["a"] == 3
    assert ledger.spent == pytest.approx(runs.counts["a"] * PRICE_A) and ledger.spent <= 10.0
    (carve,) = [e for e in ledger.entries() if e.kind == "sub_agent"]
    assert carve.status == "committed" and carve.amount == pytest.approx(PRICE_A)
    assert ledger.reserved == 0
    # The parent's state is the parent's: its budget, and its charges only (the child's runs are in
    # the carve, not copied back into the parent's channel by the task tool's update).
    channel = out[LEDGER_KEY]
    assert channel["budget"] == 10.0 and (channel["episode_id"] == "p" if thread else True)
    committed = [e for e in channel["entries"].values() if e["status"] == "committed"]
    assert sum(e["amount"] for e in committed) == pytest.approx(ledger.spent)
    assert sorted(e["kind"] for e in committed) == ["sub_agent", "tool", "tool", "tool"]  # task (0), a, a
    assert_each_call_answered_once(out["messages"])
    assert len(parent.episodes) == 0 and len(child.episodes) == 0
    # The sub-agent's state holds its own ledger: an episode of its own (not the parent's, though it
    # ran with the parent's thread id), the carve as its budget, and each of its charges.
    (final,) = finals
    mine = final[LEDGER_KEY]
    assert mine["episode_id"] != channel["episode_id"] and mine["budget"] == pytest.approx(4.0)
    assert sorted((e["kind"], e["status"], e["amount"]) for e in mine["entries"].values()) == [
        ("tool", "committed", PRICE_A)]
    assert child.ledger(final).spent == pytest.approx(PRICE_A)


@pytest.mark.parametrize("use_async", [False, True])
def test_the_same_guard_in_a_sub_agent_on_a_copy_of_the_state_is_a_configuration_error(use_async):
    runs = Runs()
    guard = BudgetGuard(AcceptAll(), MARKET, 10.0)

    def make_child() -> Any:
        return create_agent(scripted(child_script()), [runs.tool()], middleware=[guard.middleware()])

    agent = create_agent(scripted(parent_script()), [runs.tool(), task_tool(make_child, use_async)],
                         middleware=[guard.middleware()])
    with pytest.raises(GuardConfigError, match="FromParent"):
        run(agent, use_async, None)
    assert runs.counts["a"] == 0  # nothing ran on a ledger that was not the sub-agent's
