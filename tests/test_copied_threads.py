"""A thread made by copying another thread's state to a new thread id (LangGraph Platform's "copy thread";
in plain LangGraph ``agent.update_state(new_config, agent.get_state(old_config).values)``): its ledger
channel carries the source's episode id. The copy is a fork with its own money from the copy point on,
whether its runs come after the source's, between them, or at the same time in the same process (both
paused at a reviewer, or both running): neither thread's reservations, charges, top-ups or log records
land in the other's.

Executions are counted inside the tools; each thread's ledger must equal what that thread ran.
"""

from __future__ import annotations

import asyncio
import threading
from collections import Counter
from typing import Annotated, Any

import pytest
from langchain.agents import create_agent
from langchain.agents.middleware import HumanInTheLoopMiddleware
from langchain.tools import InjectedState, InjectedToolCallId
from langchain_core.messages import AIMessage, HumanMessage, ToolMessage
from langchain_core.tools import StructuredTool
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.types import Command

from intent import AcceptAll, BudgetGuard, FromParent, Market, MemoryLogSink, PricedTool
from intent.state import LEDGER_KEY
from intent.testing import ai, assert_each_call_answered_once, call, scripted

PRICES = {"a": 10.0, "b": 7.0}
A = {"configurable": {"thread_id": "A"}}
B = {"configurable": {"thread_id": "B"}}
APPROVE = Command(resume={"decisions": [{"type": "approve"}]})


class Tools:
    """``a`` and ``b``, each counting its runs by thread (the thread is the first letter of ``x``).
    With ``meet`` set, a thread's ``a`` waits (up to 5 s) until the other thread's ``a`` has started too:
    both runs hold their reservations at once."""

    def __init__(self, meet: bool = False) -> None:
        self.runs: Counter[str] = Counter()
        self.meet = meet
        self.started = {t: threading.Event() for t in "AB"}
        self.astarted: dict[str, asyncio.Event] = {}

    def all(self) -> list[Any]:
        def a(x: str = "") -> str:
            if self.meet:
                self.started[x[0]].set()
                self.started["B" if x[0] == "A" else "A"].wait(5)
            self.runs[x[0]] += 10
            return f"RAN a {x}"

        async def a_async(x: str = "") -> str:
            if self.meet:
                self.astarted[x[0]].set()
                try:
                    await asyncio.wait_for(self.astarted["B" if x[0] == "A" else "A"].wait(), 5)
                except asyncio.TimeoutError:
                    pass
            self.runs[x[0]] += 10
            return f"RAN a {x}"

        def b(x: str = "") -> str:
            self.runs[x[0]] += 7
            return f"RAN b {x}"

        return [StructuredTool.from_function(func=a, coroutine=a_async, name="a", description="a"),
                StructuredTool.from_function(b, name="b", description="b")]


def _ran(messages: list[Any]) -> float:
    """What the thread's own history ran, by its tools' answers."""
    return sum(PRICES[str(m.content).split()[1]] for m in messages
               if isinstance(m, ToolMessage) and str(m.content).startswith("RAN "))


def _guard(budget: float) -> BudgetGuard:
    return BudgetGuard(AcceptAll(), Market([PricedTool(n, p) for n, p in PRICES.items()]), budget,
                       log_sink=MemoryLogSink())


def _copied(guard: BudgetGuard, tools: Tools, saver: InMemorySaver, *, hitl: bool = False) -> None:
    """Thread A runs a (10) and ends; its state is copied to thread B."""
    mw = [HumanInTheLoopMiddleware(interrupt_on={"a": True, "b": True}), guard.middleware()] if hitl \
        else [guard.middleware()]
    first = create_agent(scripted([ai(call("a", x="A0")), AIMessage("A0 done")]), tools.all(), middleware=mw,
                         checkpointer=saver)
    first.invoke({"messages": [HumanMessage("go")]}, A)
    if hitl:
        first.invoke(APPROVE, A)
    first.update_state(B, first.get_state(A).values)


def _check(guard: BudgetGuard, out: dict[str, Any], thread: str, tools: Tools, spent: float) -> None:
    ledger = guard.ledger(out, {"configurable": {"thread_id": thread}})
    assert_each_call_answered_once(out["messages"])
    assert _ran(out["messages"]) == spent
    assert (ledger.spent, ledger.reserved) == (spent, 0.0), thread


@pytest.mark.parametrize("use_async", [False, True], ids=["sync", "async"])
def test_a_copy_running_beside_its_source_spends_only_its_own_budget(use_async: bool) -> None:
    # Budget 25; A spent 10 and was copied to B. A and B each propose a (10) at the same time, both runs
    # in progress together: each thread has 15 left, so both fit (was: the copy shared the source's working
    # copy, so the second gate counted the first thread's reservation too: 10 + 10 + 10 > 25, refused).
    tools, guard, saver = Tools(meet=True), _guard(25.0), InMemorySaver()
    _copied(guard, tools, saver)
    tools.runs.clear()
    agents = {t: create_agent(scripted([ai(call("a", x=f"{t}1")), AIMessage(f"{t} done")]), tools.all(),
                              middleware=[guard.middleware()], checkpointer=saver) for t in "AB"}
    cfgs = {"A": A, "B": B}
    outs: dict[str, Any] = {}
    if use_async:
        async def both() -> None:
            tools.astarted = {t: asyncio.Event() for t in "AB"}
            done = await asyncio.gather(*(agents[t].ainvoke({"messages": [HumanMessage(t)]}, cfgs[t]) for t in "AB"))
            outs.update(zip("AB", done))
        asyncio.run(both())
    else:
        def run(t: str) -> None:
            outs[t] = agents[t].invoke({"messages": [HumanMessage(t)]}, cfgs[t])
        workers = [threading.Thread(target=run, args=(t,)) for t in "AB"]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
    assert dict(tools.runs) == {"A": 10, "B": 10}
    for t in "AB":
        _check(guard, outs[t], t, tools, 20.0)
    # Each thread's new charge is logged under its own thread, not the source's.
    charged = {r.observation.split()[-1]: r.task_id for r in guard.log_sink.records if r.execution == 1}
    assert charged == {"A0": "A", "A1": "A", "B1": "B"}


@pytest.mark.parametrize("order", ["AB", "BA"])
def test_a_copy_and_its_source_both_paused_at_a_reviewer_keep_their_own_money(order: str) -> None:
    # Budget 30. A ran a (10) and was copied to B. B proposes a (10), A proposes b (7); both pause at the
    # reviewer at the same time (both episodes live here), B's budget is topped up by 5 without a graph,
    # and they are resumed in either order. While paused each thread's ledger holds only its own
    # reservation; at the end A spent 17, B 20, with B's budget 35 and A's 30; nothing reserved.
    tools, guard, saver = Tools(), _guard(30.0), InMemorySaver()
    _copied(guard, tools, saver, hitl=True)
    tools.runs.clear()
    mw = [HumanInTheLoopMiddleware(interrupt_on={"a": True, "b": True}), guard.middleware()]
    agents = {"A": create_agent(scripted([ai(call("b", x="A1")), AIMessage("A done")]), tools.all(),
                                middleware=mw, checkpointer=saver),
              "B": create_agent(scripted([ai(call("a", x="B1")), AIMessage("B done")]), tools.all(),
                                middleware=mw, checkpointer=saver)}
    cfgs = {"A": A, "B": B}
    for t in "BA":
        assert "__interrupt__" in agents[t].invoke({"messages": [HumanMessage(t)]}, cfgs[t])
    for t, held in (("A", 7.0), ("B", 10.0)):
        ledger = guard.ledger(agents[t].get_state(cfgs[t]))
        assert (ledger.spent, ledger.reserved) == (10.0, held), t
    assert guard.top_up(B, 5.0) == 35.0
    outs = {t: agents[t].invoke(APPROVE, cfgs[t]) for t in order}
    assert dict(tools.runs) == {"A": 7, "B": 10}
    _check(guard, outs["A"], "A", tools, 17.0)
    _check(guard, outs["B"], "B", tools, 20.0)
    assert guard.ledger(outs["A"], A).budget == 30.0
    assert guard.ledger(outs["B"], B).budget == 35.0


def test_a_copy_run_after_its_source_and_between_its_runs_keeps_its_own_money() -> None:
    # Sequential: A (10) ends, copied to B; B runs a (10), A runs b (7), B runs a again (10).
    tools, guard, saver = Tools(), _guard(100.0), InMemorySaver()
    _copied(guard, tools, saver)
    tools.runs.clear()
    a = create_agent(scripted([ai(call("b", x="A1")), AIMessage("A done")]), tools.all(),
                     middleware=[guard.middleware()], checkpointer=saver)
    b = create_agent(scripted([ai(call("a", x="B1")), AIMessage("B1 done"), ai(call("a", x="B2")),
                               AIMessage("B2 done")]), tools.all(), middleware=[guard.middleware()], checkpointer=saver)
    b.invoke({"messages": [HumanMessage("b1")]}, B)
    out_a = a.invoke({"messages": [HumanMessage("a1")]}, A)
    out_b = b.invoke({"messages": [HumanMessage("b2")]}, B)
    assert dict(tools.runs) == {"A": 7, "B": 20}
    _check(guard, out_a, "A", tools, 17.0)
    _check(guard, out_b, "B", tools, 30.0)


@pytest.mark.parametrize("precreate", [False, True], ids=["plain", "market_set_before_the_run"])
@pytest.mark.parametrize("use_async", [False, True], ids=["sync", "async"])
def test_a_sub_agent_on_a_copy_of_a_copied_threads_state_still_spends_only_its_carve(use_async: bool,
                                                                                      precreate: bool) -> None:
    # Thread B is a copy of A (A spent 10 of 50). On B the agent's task tool starts a sub-agent with a
    # copy of B's state, as deepagents does: the ledger channel it gets names A's episode, yet it is B's
    # running episode's, so the child's first step replaces it with a carve of its own (limit 12): the
    # child runs a once (10), its second a does not fit, and its state holds its carve only.
    # ``precreate``: B's episode made before its first step (update_episode_market(..., create=True), with no
    # channel to read the source's episode id from) must still tell the child so (final review: the child
    # kept the parent's channel, budget 50, spent 20).
    market = Market([*(PricedTool(n, p) for n, p in PRICES.items()), PricedTool("task", 0.0)])
    tools, parent, saver = Tools(), BudgetGuard(AcceptAll(), market, 50.0), InMemorySaver()
    _copied(parent, tools, saver)
    tools.runs.clear()
    if precreate:
        parent.update_episode_market("B", market, create=True)  # B's own market, before its run
    child = BudgetGuard(AcceptAll(), Market([PricedTool(n, p) for n, p in PRICES.items()]), FromParent(limit=12.0))
    finals: list[Any] = []

    def make_child() -> Any:
        return create_agent(scripted([ai(call("a", x="B-child1")), ai(call("a", x="B-child2")), AIMessage("c")]),
                            tools.all(), middleware=[child.middleware()])

    def answer(result: dict, tool_call_id: str) -> Command:
        finals.append(result)
        back = {k: v for k, v in result.items() if k != "messages"}
        return Command(update={**back, "messages": [ToolMessage("done", tool_call_id=tool_call_id, name="task")]})

    def task(description: str, state: Annotated[dict, InjectedState],
             tool_call_id: Annotated[str, InjectedToolCallId]) -> Command:
        return answer(make_child().invoke({**state, "messages": [HumanMessage(description)]}), tool_call_id)

    async def atask(description: str, state: Annotated[dict, InjectedState],
                    tool_call_id: Annotated[str, InjectedToolCallId]) -> Command:
        return answer(await make_child().ainvoke({**state, "messages": [HumanMessage(description)]}), tool_call_id)

    agent = create_agent(scripted([ai(call("task", description="go")), AIMessage("done")]),
                         [*tools.all(), StructuredTool.from_function(task, coroutine=atask, name="task",
                                                                     description="task")],
                         middleware=[parent.middleware()], checkpointer=saver)
    inp = {"messages": [HumanMessage("delegate")]}
    out = asyncio.run(agent.ainvoke(inp, B)) if use_async else agent.invoke(inp, B)
    assert dict(tools.runs) == {"B": 10}
    ledger = parent.ledger(out, B)
    assert (ledger.spent, ledger.reserved) == (20.0, 0.0)
    (final,) = finals
    mine = final[LEDGER_KEY]
    assert mine["episode_id"].startswith("B>") and mine["budget"] == 12.0
    assert child.ledger(final).spent == 10.0
