"""A thread paused or stopped in one process and resumed by a fresh guard (another process).

LangGraph keeps the writes of the tasks that finished in a step that did not complete (a sibling
tool call that ran while another asked a human) and applies them when the resumed step completes,
after the fresh guard has loaded the episode from the resumed task's older state. Money is counted
outside the guard: each tool counts its own runs.
"""

from __future__ import annotations

import asyncio

import pytest
from langchain.agents import create_agent
from langchain_core.messages import AIMessage
from langchain_core.tools import StructuredTool
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.types import Command, interrupt

from intent import AcceptAll, BudgetGuard, Market, MemoryLogSink, PricedTool
from intent.testing import ai, assert_each_call_answered_once, call, scripted

PRICES = {"a": 20.0, "h": 10.0}


def _tools(runs: dict[str, int]) -> list[StructuredTool]:
    def a(x: int = 0) -> str:
        runs["a"] += 1
        return f"a {x}"

    def h(x: int = 0) -> str:
        ok = interrupt({"confirm": x})  # asks a human; the run pauses here
        runs["h"] += 1
        return f"h {x} {ok}"

    return [StructuredTool.from_function(a, name="a", description="a"),
            StructuredTool.from_function(h, name="h", description="h")]


def _agent(script: list[AIMessage], runs: dict[str, int], saver: InMemorySaver, budget: float):
    guard = BudgetGuard(AcceptAll(), Market([PricedTool(n, p) for n, p in PRICES.items()]), budget,
                        log_sink=MemoryLogSink())
    return guard, create_agent(scripted(script), _tools(runs), middleware=[guard.middleware()], checkpointer=saver)


@pytest.mark.parametrize("use_async", [False, True], ids=["sync", "async"])
def test_a_sibling_that_finished_before_a_pause_stays_paid_when_another_process_resumes(use_async):
    # a (20) finishes while h (10) waits for a human; a fresh guard resumes the thread. With a
    # budget of 40, a second a (20) does not fit any more: 20 + 10 are spent.
    runs = {"a": 0, "h": 0}
    saver, cfg = InMemorySaver(), {"configurable": {"thread_id": "t"}}

    def go(agent, inp):
        return asyncio.run(agent.ainvoke(inp, cfg)) if use_async else agent.invoke(inp, cfg)

    _, first = _agent([ai(call("a", x=1), call("h", x=1))], runs, saver, 40.0)
    assert "__interrupt__" in go(first, {"messages": [("user", "go")]})
    guard, second = _agent([ai(call("a", x=2)), AIMessage("done")], runs, saver, 40.0)  # another process
    out = go(second, Command(resume="yes"))

    ledger = guard.ledger(out)
    real = sum(runs[n] * p for n, p in PRICES.items())
    assert runs == {"a": 1, "h": 1}  # the second a did not fit
    assert ledger.spent == real == 30.0
    assert ledger.spent <= ledger.budget and ledger.reserved == 0
    assert_each_call_answered_once(out["messages"])
    # The sibling's charge is not logged here as released unused: it was committed in the other process.
    assert [r for r in guard.log_sink.records if r.status == "released"] == []


@pytest.mark.parametrize("same_guard", [False, True], ids=["fresh_guard", "same_guard"])
def test_a_top_up_written_to_a_paused_thread_keeps_the_charge_of_a_call_that_finished(same_guard):
    # update_state on the paused thread drops the paused step's saved writes: on resume a runs again.
    # Both runs are paid (the first was only in the dropped writes: a fresh guard paid one of two).
    runs = {"a": 0, "h": 0}
    saver, cfg = InMemorySaver(), {"configurable": {"thread_id": "t"}}
    guard, agent = _agent([ai(call("a", x=1), call("h", x=1)), AIMessage("done")], runs, saver, 40.0)
    assert "__interrupt__" in agent.invoke({"messages": [("user", "go")]}, cfg)
    assert guard.top_up(cfg, 20.0, graph=agent, reason="more") == 60.0
    if not same_guard:
        guard, agent = _agent([AIMessage("done")], runs, saver, 40.0)  # another process
    out = agent.invoke(Command(resume="yes"), cfg)
    ledger = guard.ledger(out)
    real = sum(runs[n] * p for n, p in PRICES.items())
    assert ledger.spent == real and ledger.spent <= ledger.budget == 60.0 and ledger.reserved == 0
    assert_each_call_answered_once(out["messages"])


@pytest.mark.parametrize("fresh", [False, True], ids=["same_guards", "fresh_guards"])
def test_a_sub_agents_sibling_that_finished_before_a_pause_stays_paid_in_its_carve(fresh):
    # A child (FromParent, limit 40) runs a (20) and h (10) at once; h asks a human; the thread is resumed
    # (by fresh guards: another process). Its next a (20) must not fit the carve: the finished a was
    # released as unused and paid again (50 run against a carve of 40, the parent billed 30).
    from langchain_core.messages import HumanMessage

    from intent import FromParent

    runs = {"a": 0, "h": 0, "delegate": 0}
    saver, cfg = InMemorySaver(), {"configurable": {"thread_id": "t"}}
    child_script = [ai(call("a", x=1), call("h", x=1)), ai(call("a", x=2)), AIMessage("child done")]
    parent_script = [ai(call("delegate", task="x")), AIMessage("done")]

    def build(child_msgs: list[AIMessage], parent_msgs: list[AIMessage]):
        parent = BudgetGuard(AcceptAll(), Market([PricedTool("delegate", 1.0)]), 100.0)
        child_guard = BudgetGuard(AcceptAll(), Market([PricedTool(n, p) for n, p in PRICES.items()]),
                                  FromParent(limit=40.0))
        child = create_agent(scripted(child_msgs), _tools(runs), middleware=[child_guard.middleware()])

        def delegate(task: str) -> str:
            runs["delegate"] += 1
            return str(child.invoke({"messages": [HumanMessage(task)]})["messages"][-1].content)

        return parent, create_agent(scripted(parent_msgs), [StructuredTool.from_function(
            delegate, name="delegate", description="d")], middleware=[parent.middleware()], checkpointer=saver)

    guard, agent = build(child_script, parent_script)
    assert "__interrupt__" in agent.invoke({"messages": [("user", "go")]}, cfg)
    if fresh:
        guard, agent = build(child_script[1:], parent_script[1:])
    out = agent.invoke(Command(resume="yes"), cfg)
    child_real = runs["a"] * 20.0 + runs["h"] * 10.0
    assert runs["a"] == 1 and runs["h"] == 1  # the second a did not fit the carve
    ledger = guard.ledger(out)
    # delegate started twice (the interrupt re-runs it on resume) and is paid once, as one run.
    assert ledger.spent == child_real + 1.0 and ledger.reserved == 0


@pytest.mark.parametrize("use_async", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("fresh", [False, True], ids=["same_guards", "fresh_guards"])
def test_a_sub_agent_resumed_in_another_process_carves_around_a_sibling_that_finished(fresh, use_async):
    # One parent message delegates x and y (1 each) to sub-agents (FromParent, no limit). x's child runs a
    # (20) and finishes; y's child runs h (10), which asks a human. On resume y's carve must leave out x's
    # 20: 45 - 2 - 20 = 23 is left for y, whose second call, a (20), no longer fits. (A guard in another
    # process carved from the resumed task's state, which lacks the finished sibling's carve: y got 43, a
    # ran, and 52 was spent against 45.)
    import threading

    from langchain_core.messages import HumanMessage

    from intent import FromParent

    runs = {"a": 0, "h": 0}
    x_done = threading.Event()  # in the first run y starts after x's child finished: the carves' order is fixed
    saver, cfg = InMemorySaver(), {"configurable": {"thread_id": "t"}}
    child_scripts = {"x": [ai(call("a", x=1)), AIMessage("x done")],
                     "y": [ai(call("h", x=1)), ai(call("a", x=2)), AIMessage("y done")]}

    def build(scripts: dict[str, list[AIMessage]], parent_msgs: list[AIMessage]):
        parent = BudgetGuard(AcceptAll(), Market([PricedTool("delegate", 1.0)]), 45.0)
        children = {}
        for task, msgs in scripts.items():
            child_guard = BudgetGuard(AcceptAll(), Market([PricedTool(n, p) for n, p in PRICES.items()]),
                                      FromParent())
            children[task] = create_agent(scripted(msgs), _tools(runs), middleware=[child_guard.middleware()])

        def delegate(task: str) -> str:
            if task == "y":
                assert x_done.wait(10)
            out = children[task].invoke({"messages": [HumanMessage(task)]})
            if task == "x":
                x_done.set()
            return str(out["messages"][-1].content)

        return parent, create_agent(scripted(parent_msgs), [StructuredTool.from_function(
            delegate, name="delegate", description="d")], middleware=[parent.middleware()], checkpointer=saver)

    def go(agent, inp):
        return asyncio.run(agent.ainvoke(inp, cfg)) if use_async else agent.invoke(inp, cfg)

    parent_script = [ai(call("delegate", task="x"), call("delegate", task="y")), AIMessage("done")]
    guard, agent = build(child_scripts, parent_script)
    assert "__interrupt__" in go(agent, {"messages": [("user", "go")]})
    if fresh:  # another process: the paused children go on from their checkpoints
        guard, agent = build({"x": [], "y": child_scripts["y"][1:]}, parent_script[1:])
    out = go(agent, Command(resume="yes"))
    ledger = guard.ledger(out)
    assert runs == {"a": 1, "h": 1}  # y's a did not fit what x left
    assert ledger.spent == 2.0 + 20.0 + 10.0 and ledger.reserved == 0 and ledger.spent <= ledger.budget
    assert_each_call_answered_once(out["messages"])


@pytest.mark.parametrize("use_async", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("fresh", [False, True], ids=["same_guards", "fresh_guards"])
def test_parallel_sub_agents_all_paused_resumed_in_another_process_stay_within_the_parents_budget(fresh, use_async):
    # Budget 20; delegate x and y (1 each) run sub-agents (FromParent(limit=12)); c1 4, c2 3, ch 2 (asks a human).
    # First run: x carves 12, runs c1 + c2 (7) and pauses in ch (2 held); then y carves the 6 left, runs c1 (c2
    # does not fit) and pauses in ch. On resume y carves again first: x's 9 is in no ledger of a new process
    # (its carve's writes were lost with its task), only in x's own checkpoint. y must leave room for it: 20 - 2
    # - 9 = 9 for y, which holds 6, so its next c1 (4) does not fit. (It carved 12, ran c1: 21 against 20.)
    import threading

    from langchain_core.messages import HumanMessage

    from intent import FromParent

    prices = {"c1": 4.0, "c2": 3.0, "ch": 2.0}
    runs: dict[str, int] = {"c1": 0, "c2": 0, "ch": 0}
    x_paused, y_resumed = threading.Event(), threading.Event()
    entered: dict[str, int] = {"x": 0, "y": 0}
    saver, cfg = InMemorySaver(), {"configurable": {"thread_id": "t"}}

    def child_tools(task: str) -> list[StructuredTool]:
        def c1() -> str:
            runs["c1"] += 1
            return "c1"

        def c2() -> str:
            runs["c2"] += 1
            return "c2"

        def ch() -> str:
            if task == "x":
                x_paused.set()
            elif entered["y"] > 1:
                y_resumed.set()  # y's run again, on resume: its carve is made
            interrupt("ok?")
            runs["ch"] += 1
            return "ch"

        return [StructuredTool.from_function(f, name=f.__name__, description=f.__name__) for f in (c1, c2, ch)]

    first = {"x": [ai(call("c1"), call("c2")), ai(call("ch")), AIMessage("x done")],
             "y": [ai(call("c1"), call("c2")), ai(call("ch")), ai(call("c1")), AIMessage("y done")]}

    def build(scripts: dict[str, list[AIMessage]], parent_msgs: list[AIMessage]):
        parent = BudgetGuard(AcceptAll(), Market([PricedTool("delegate", 1.0)]), 20.0)
        children = {}
        for task, msgs in scripts.items():
            child_guard = BudgetGuard(AcceptAll(), Market([PricedTool(n, p) for n, p in prices.items()]),
                                      FromParent(limit=12.0))
            children[task] = create_agent(scripted(msgs), child_tools(task), middleware=[child_guard.middleware()])

        def delegate(task: str) -> str:
            entered[task] += 1
            if task == "y" and entered["y"] == 1:
                assert x_paused.wait(10)  # first run: x carves first
            if task == "x" and entered["x"] > 1:
                assert y_resumed.wait(10)  # on resume: y carves first
            return str(children[task].invoke({"messages": [HumanMessage(task)]})["messages"][-1].content)

        return parent, create_agent(scripted(parent_msgs),
                                    [StructuredTool.from_function(delegate, name="delegate", description="d")],
                                    middleware=[parent.middleware()], checkpointer=saver)

    def go(agent, inp):
        return asyncio.run(agent.ainvoke(inp, cfg)) if use_async else agent.invoke(inp, cfg)

    parent_script = [ai(call("delegate", task="x"), call("delegate", task="y")), AIMessage("done")]
    guard, agent = build(first, parent_script)
    paused = go(agent, {"messages": [("user", "go")]})
    assert len(paused["__interrupt__"]) == 2 and runs == {"c1": 2, "c2": 1, "ch": 0}
    if fresh:  # another process: the paused children go on from their checkpoints
        guard, agent = build({"x": first["x"][2:], "y": first["y"][2:]}, parent_script[1:])
    interrupts = [i for t in agent.get_state(cfg).tasks for i in t.interrupts]
    out = go(agent, Command(resume={i.id: "yes" for i in interrupts}))
    ledger = guard.ledger(out)
    real = 2.0 + sum(runs[n] * p for n, p in prices.items())
    assert runs == {"c1": 2, "c2": 1, "ch": 2}  # y's second c1 did not fit
    assert ledger.spent == real == 17.0 and ledger.reserved == 0 and ledger.spent <= ledger.budget
