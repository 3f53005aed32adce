"""A thread copied from a paused thread (LangGraph Platform's "copy thread") when the guard draws on a shared
budget store (SQLite, and a real PostgreSQL from the ``postgres_dsn`` fixture).

Thread A proposes a priced call and pauses holding its reservation: at a HumanInTheLoopMiddleware review
(the store holds A's money while the human decides), or inside the tool, at an ``interrupt()`` (the store
hold is given back while it waits, and the re-run holds again). Its state is copied to thread B, both ways:

* ``values``: ``agent.update_state(B, agent.get_state(A).values, as_node="model")``: B is at the same point
  (its next node is the review, or the tools) and pauses there itself when invoked;
* ``checkpoint``: A's checkpoint and its pending writes (the interrupt) put under B, as a copy of the whole
  thread does: B is paused at A's interrupt and is resumed directly.

The copy carries A's reservation in its ledger channel but not A's hold in the store: the hold stays A's,
and B holds money of its own in the store when its call runs (refused there when the shared budget has no
room for it). Then B and A are resumed, in either order, with each decision. After everything ends:

* the store's spent == Σ real executions x price (counted inside the tools, by thread);
* each thread's committed store charges are its own (run id), and sum to what that thread ran;
* nothing is reserved (or expired) in the store, and spent <= the shared budget;
* each proposed call is answered exactly once in each thread's messages, and each thread's ledger spent
  what that thread ran.

While the first thread to be resumed runs, the other one's hold is checked too: a copy never takes,
moves or gives back the source's hold.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from typing import Any

import pytest
from langchain.agents import create_agent
from langchain.agents.middleware import HumanInTheLoopMiddleware
from langchain_core.messages import AIMessage, HumanMessage, ToolMessage
from langchain_core.runnables import RunnableConfig
from langchain_core.tools import StructuredTool
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.types import Command, interrupt

from intent import AcceptAll, BudgetGuard, Market, PricedTool
from intent.stores import PostgresBudgetStore, SqliteBudgetStore
from intent.testing import ai, assert_each_call_answered_once, call, scripted

PRICE = 10.0
ROOMY, TIGHT = 100.0, 15.0  # TIGHT: room for one run only (10), once A's 10 is held
CFG = {t: {"configurable": {"thread_id": t}} for t in "AB"}


@pytest.fixture(params=["sqlite", "postgres"])
def store(request, tmp_path):
    if request.param == "sqlite":
        s = SqliteBudgetStore(tmp_path / "budgets.db")
    else:
        s = PostgresBudgetStore(request.getfixturevalue("postgres_dsn"))
    yield s
    s.close()


class Tools:
    """``a`` (runs when called) and ``h`` (asks a human inside its run with ``interrupt()``, then runs), both
    priced 10; each counts its real executions by the thread they ran in (a copy's proposed call is the
    source's, arguments included)."""

    def __init__(self) -> None:
        self.runs: Counter[str] = Counter()

    def all(self) -> list[Any]:
        def a(config: RunnableConfig, x: str = "") -> str:
            self.runs[config["configurable"]["thread_id"]] += 1
            return f"RAN a {x}"

        async def a_async(config: RunnableConfig, x: str = "") -> str:
            return a(config, x)

        def h(config: RunnableConfig, x: str = "") -> str:
            interrupt({"confirm": x})
            self.runs[config["configurable"]["thread_id"]] += 1
            return f"RAN h {x}"

        async def h_async(config: RunnableConfig, x: str = "") -> str:
            interrupt({"confirm": x})
            self.runs[config["configurable"]["thread_id"]] += 1
            return f"RAN h {x}"

        return [StructuredTool.from_function(func=a, coroutine=a_async, name="a", description="a"),
                StructuredTool.from_function(func=h, coroutine=h_async, name="h", description="h")]


def _run(agent: Any, inp: Any, thread: str, use_async: bool) -> dict[str, Any]:
    cfg = CFG[thread]
    return asyncio.run(agent.ainvoke(inp, cfg)) if use_async else agent.invoke(inp, cfg)


def _copy(agent: Any, saver: InMemorySaver, how: str) -> None:
    """Copy paused thread A to thread B (see the module's docstring)."""
    if how == "values":
        agent.update_state(CFG["B"], agent.get_state(CFG["A"]).values, as_node="model")
        return
    tup = saver.get_tuple(CFG["A"])
    new = saver.put({"configurable": {"thread_id": "B", "checkpoint_ns": ""}}, tup.checkpoint, tup.metadata,
                    tup.checkpoint["channel_versions"])
    writes: dict[str, list[tuple[str, Any]]] = {}
    for task_id, channel, value in tup.pending_writes or ():
        writes.setdefault(task_id, []).append((channel, value))
    for task_id, w in writes.items():
        saver.put_writes(new, w, task_id)


def _held(store: Any, key: str, run: str) -> float:
    return sum(c.amount for c in store.charges(key) if c.status == "reserved" and c.run_id == run)


def _check(store: Any, key: str, cap: float, guard: BudgetGuard, tools: Tools, outs: dict[str, Any],
           carried: float = 0.0) -> None:
    """``carried``: what B's ledger holds of A's spending from before the copy (A's history, copied)."""
    ran = {t: n for t, n in tools.runs.items() if n}
    spent = store.spent(key)
    assert spent == pytest.approx(PRICE * sum(ran.values()))  # no charge lost, none counted twice
    assert store.reserved(key) == 0.0  # no hold leaked
    assert spent <= cap + 1e-9
    charges = store.charges(key)
    assert not [c for c in charges if c.status in ("reserved", "expired")], charges
    by_run: Counter[str] = Counter()
    for c in charges:
        if c.status == "committed":
            by_run[c.run_id] += c.amount
    assert dict(by_run) == {t: PRICE * n for t, n in ran.items()}  # each thread's charges are its own
    for t, out in outs.items():
        assert_each_call_answered_once(out["messages"])
        ledger = guard.ledger(out, CFG[t])
        mine = PRICE * tools.runs[t] + (carried if t == "B" else 0.0)
        assert (ledger.spent, ledger.reserved) == (mine, 0.0), t
        ran_here = [m for m in out["messages"] if isinstance(m, ToolMessage) and str(m.content).startswith("RAN ")]
        assert PRICE * len(ran_here) == mine, t


def _setup(store: Any, key: str, cap: float, tool: str | tuple[str, ...], hitl: bool
           ) -> tuple[BudgetGuard, Tools, Any, Any]:
    store.create_budget(key, cap)
    guard = BudgetGuard(AcceptAll(), Market([PricedTool("a", PRICE), PricedTool("h", PRICE)]), 100.0,
                        store=store, budget_key=key)
    tools, saver = Tools(), InMemorySaver()
    mw = [HumanInTheLoopMiddleware(interrupt_on={"a": True}), guard.middleware()] if hitl else [guard.middleware()]
    calls = [call(name, x=f"A{i}") for i, name in enumerate((tool,) if isinstance(tool, str) else tool, 1)]
    agents = {"A": create_agent(scripted([ai(*calls), AIMessage("A done")]), tools.all(),
                                middleware=mw, checkpointer=saver),
              "B": create_agent(scripted([AIMessage("B done")]), tools.all(), middleware=mw, checkpointer=saver)}
    return guard, tools, saver, agents


def _decision(kind: str) -> Command:
    if kind == "approve":
        return Command(resume={"decisions": [{"type": "approve"}]})
    return Command(resume={"decisions": [{"type": "reject", "message": "no"}]})


@pytest.mark.parametrize("use_async", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("how", ["values", "checkpoint"])
@pytest.mark.parametrize("first", ["copy_first", "source_first"])
@pytest.mark.parametrize("copy_says,source_says", [("approve", "approve"), ("reject", "approve"),
                                                     ("approve", "reject")])
def test_a_copy_of_a_thread_paused_at_a_review_holding_shared_money(store, budget_key, use_async, how, first,
                                                                       copy_says, source_says):
    # A's call a (10) was gated (10 held in the store for A) and waits at the review; B is a copy of A.
    guard, tools, saver, agents = _setup(store, budget_key, ROOMY, "a", hitl=True)
    assert "__interrupt__" in _run(agents["A"], {"messages": [HumanMessage("go")]}, "A", use_async)
    assert _held(store, budget_key, "A") == PRICE
    _copy(agents["A"], saver, how)
    if how == "values":  # B reaches the review itself
        assert "__interrupt__" in _run(agents["B"], None, "B", use_async)
    assert store.reserved(budget_key) == PRICE and _held(store, budget_key, "B") == 0.0  # the hold stays A's
    says = {"A": source_says, "B": copy_says}
    order = "BA" if first == "copy_first" else "AB"
    outs = {order[0]: _run(agents[order[0]], _decision(says[order[0]]), order[0], use_async)}
    # The first thread has ended: the other's hold is as it was (A's 10 still held, B held nothing).
    assert _held(store, budget_key, order[1]) == (PRICE if order[1] == "A" else 0.0)
    outs[order[1]] = _run(agents[order[1]], _decision(says[order[1]]), order[1], use_async)
    assert dict(+tools.runs) == {t: 1 for t in "AB" if says[t] == "approve"}
    _check(store, budget_key, ROOMY, guard, tools, outs)


@pytest.mark.parametrize("use_async", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("first", ["copy_first", "source_first"])
def test_a_copy_approved_when_the_shared_budget_has_room_for_one_run_never_takes_the_sources_hold(
        store, budget_key, use_async, first):
    # Shared budget 15: A's approved-at-the-gate call holds 10 of it. B's copy of the call is approved too,
    # before or after A's: B must hold money of its own, and 5 is left, so B's run is refused (answered as
    # over budget, not run) and A's runs on the hold it kept.
    guard, tools, saver, agents = _setup(store, budget_key, TIGHT, "a", hitl=True)
    _run(agents["A"], {"messages": [HumanMessage("go")]}, "A", use_async)
    _copy(agents["A"], saver, "values")
    _run(agents["B"], None, "B", use_async)
    order = "BA" if first == "copy_first" else "AB"
    outs = {t: _run(agents[t], _decision("approve"), t, use_async) for t in order}
    assert dict(+tools.runs) == {"A": 1}
    refused = [m for m in outs["B"]["messages"] if isinstance(m, ToolMessage) and m.status == "error"]
    assert len(refused) == 1 and "not executed" in str(refused[0].content)
    _check(store, budget_key, TIGHT, guard, tools, outs)


@pytest.mark.parametrize("use_async", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("how", ["values", "checkpoint"])
@pytest.mark.parametrize("first", ["copy_first", "source_first"])
@pytest.mark.parametrize("cap", [ROOMY, TIGHT], ids=["roomy", "tight"])
def test_a_copy_of_a_thread_paused_inside_its_priced_tool(store, budget_key, use_async, how, first, cap):
    # A's call h (10) asks a human inside its run: A's hold is given back while it waits. B is a copy of A,
    # paused inside h too. Both are resumed, in either order: each re-run holds money of its own. With room
    # for one run only (tight), the first resumed runs and the other is refused.
    guard, tools, saver, agents = _setup(store, budget_key, cap, "h", hitl=False)
    assert "__interrupt__" in _run(agents["A"], {"messages": [HumanMessage("go")]}, "A", use_async)
    _copy(agents["A"], saver, how)
    if how == "values":  # B runs into the interrupt itself
        assert "__interrupt__" in _run(agents["B"], None, "B", use_async)
    assert store.reserved(budget_key) == 0.0  # neither holds shared money while a human decides
    order = "BA" if first == "copy_first" else "AB"
    outs = {order[0]: _run(agents[order[0]], Command(resume="yes"), order[0], use_async)}
    assert store.reserved(budget_key) == 0.0 and store.spent(budget_key) == PRICE
    outs[order[1]] = _run(agents[order[1]], Command(resume="yes"), order[1], use_async)
    assert dict(+tools.runs) == ({"A": 1, "B": 1} if cap == ROOMY else {order[0]: 1})
    _check(store, budget_key, cap, guard, tools, outs)


@pytest.mark.parametrize("use_async", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("how", ["values", "checkpoint"])
@pytest.mark.parametrize("first", ["copy_first", "source_first"])
def test_a_copy_of_a_thread_paused_inside_one_call_of_a_batch_whose_other_call_has_finished(
        store, budget_key, use_async, how, first):
    # A proposes a and h (10 each) in one message: a runs (committed in the store for A), h asks a human. The
    # copy carries a's answer and charge (A's history: a does not run again in B) and h's reservation, whose
    # store charge, if the copy names one, is A's first run's, given back at A's interrupt: B's re-run of h
    # holds money of its own, and A's re-run too.
    guard, tools, saver, agents = _setup(store, budget_key, ROOMY, ("a", "h"), hitl=False)
    assert "__interrupt__" in _run(agents["A"], {"messages": [HumanMessage("go")]}, "A", use_async)
    assert (store.spent(budget_key), store.reserved(budget_key)) == (PRICE, 0.0)
    _copy(agents["A"], saver, how)
    if how == "values":
        assert "__interrupt__" in _run(agents["B"], None, "B", use_async)
    order = "BA" if first == "copy_first" else "AB"
    outs = {t: _run(agents[t], Command(resume="yes"), t, use_async) for t in order}
    assert dict(+tools.runs) == {"A": 2, "B": 1}
    _check(store, budget_key, ROOMY, guard, tools, outs, carried=PRICE)
