"""Time travel on a thread whose episode is still live in this process (paused, or crashed): a fork or
a replay from an older checkpoint runs on that checkpoint's ledger ("the ledger in state wins"), not
on the working copy of the branch it abandoned; a resume of the same branch (after an interrupt or a
crash) keeps what the working copy knows that state does not (money spent is spent).

Executions are counted inside the tools; each branch's ledger must equal what that branch ran.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from typing import Any

import pytest
from langchain.agents import create_agent
from langchain.agents.middleware import AgentMiddleware
from langchain_core.messages import AIMessage, HumanMessage, ToolMessage
from langchain_core.tools import StructuredTool
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.types import Command, interrupt

from intent import AcceptAll, BudgetGuard, Market, PricedTool
from intent.testing import RecordingOracle, ai, assert_each_call_answered_once, call, scripted

PRICES = {"a": 10.0, "b": 7.0, "h": 5.0}


class Tools:
    """``a``, ``b`` (plain), ``h`` (asks a human inside, with ``interrupt``) and ``boom`` (raises while
    ``fail`` is set: an exception out of the graph), each counting its runs."""

    def __init__(self) -> None:
        self.runs: Counter[str] = Counter()
        self.fail = False

    def all(self) -> list[Any]:
        def a(x: int = 0) -> str:
            self.runs["a"] += 1
            return f"RAN a {x}"

        def b(x: int = 0) -> str:
            self.runs["b"] += 1
            return f"RAN b {x}"

        def h(x: int = 0) -> str:
            answer = interrupt({"confirm": x})
            self.runs["h"] += 1
            return f"RAN h {x} {answer}"

        def boom(x: int = 0) -> str:
            self.runs["boom"] += 1
            if self.fail:
                raise RuntimeError("the process died here")
            return f"RAN boom {x}"

        return [StructuredTool.from_function(f, name=f.__name__, description=f.__name__) for f in (a, b, h, boom)]


def _guard(budget: float) -> BudgetGuard:
    return BudgetGuard(AcceptAll(), Market([PricedTool(n, p) for n, p in {**PRICES, "boom": 4.0}.items()]), budget)


def _ran(messages: list[Any]) -> float:
    """What the branch's own history ran, by its tools' answers."""
    prices = {**PRICES, "boom": 4.0}
    return sum(prices[str(m.content).split()[1]] for m in messages
               if isinstance(m, ToolMessage) and str(m.content).startswith("RAN "))


def _go(agent: Any, inp: Any, cfg: Any, use_async: bool) -> Any:
    return asyncio.run(agent.ainvoke(inp, cfg)) if use_async else agent.invoke(inp, cfg)


CFG = {"configurable": {"thread_id": "t1"}}


def _crash(agent: Any, tools: Tools) -> None:
    """The first run on the thread, with ``boom`` raising out of the graph (its step's writes are lost)."""
    tools.fail = True
    with pytest.raises(RuntimeError):
        agent.invoke({"messages": [HumanMessage("go")]}, CFG)
    tools.fail = False


def _to_the_end(agent: Any) -> dict[str, Any]:
    """The thread's state once every pause of its latest branch is resumed."""
    while agent.get_state(CFG).next:
        agent.invoke(None, CFG)
    return agent.get_state(CFG).values


@pytest.mark.parametrize("use_async", [False, True])
def test_a_fork_that_never_runs_a_call_of_the_abandoned_branch_is_not_charged_for_it(use_async: bool) -> None:
    # Paused before a's tool step; a ran (10); paused again. A fork from before a's tool step replaces the
    # model's message by a final answer: that branch ran nothing (was: spent 10 with no run).
    tools, guard, saver = Tools(), _guard(100.0), InMemorySaver()
    agent = create_agent(scripted([ai(call("a", x=1)), ai(call("b", x=2)), AIMessage("d")]), tools.all(),
                         middleware=[guard.middleware()], checkpointer=saver, interrupt_before=["tools"])
    _go(agent, {"messages": [HumanMessage("go")]}, CFG, use_async)
    before_a = agent.get_state(CFG)
    _go(agent, None, CFG, use_async)
    assert tools.runs["a"] == 1
    old = before_a.values["messages"][-1]
    fork = agent.update_state(before_a.config, {"messages": [AIMessage("never mind", id=old.id)]}, as_node="model")
    out = _go(agent, None, fork, use_async)
    ledger = guard.ledger(out)
    assert _ran(out["messages"]) == 0.0
    assert (ledger.spent, ledger.reserved) == (0.0, 0.0)


@pytest.mark.parametrize("use_async", [False, True])
def test_a_fork_from_before_a_top_up_keeps_its_own_budget(use_async: bool) -> None:
    # a ran (10), b reserved (7), paused; a top-up of 50 is written to the latest checkpoint. A fork from
    # before the top-up proposes a again: 27 > 20 on that branch (was: accepted on the abandoned top-up).
    tools, guard, saver = Tools(), _guard(20.0), InMemorySaver()
    script = [ai(call("a", x=1)), ai(call("b", x=2)), ai(call("a", x=3)), AIMessage("d")]
    agent = create_agent(scripted(script), tools.all(), middleware=[guard.middleware()], checkpointer=saver,
                         interrupt_before=["tools"])
    _go(agent, {"messages": [HumanMessage("go")]}, CFG, use_async)
    _go(agent, None, CFG, use_async)
    before_top_up = agent.get_state(CFG)
    assert guard.top_up(CFG, 50.0, graph=agent) == 70.0
    _go(agent, None, before_top_up.config, use_async)  # b runs; a is proposed, refused: 10 more than 3 left
    while agent.get_state(CFG).next:  # the fork is the thread's latest branch now
        _go(agent, None, CFG, use_async)
    out = agent.get_state(CFG).values
    ledger = guard.ledger(out)
    assert ledger.budget == 20.0
    assert ledger.spent == _ran(out["messages"]) == 17.0 and ledger.reserved == 0.0
    assert_each_call_answered_once(out["messages"])


@pytest.mark.parametrize("use_async", [False, True])
def test_a_replay_of_the_last_tool_step_charges_the_branch_once(use_async: bool) -> None:
    # b's tool step ran; the thread paused before the next model step. A replay from before b's tool step
    # runs b once on that branch (was: charged twice, as a retry of the abandoned branch's run).
    tools, guard, saver = Tools(), _guard(17.0), InMemorySaver()
    agent = create_agent(scripted([ai(call("a", x=1)), ai(call("b", x=2)), AIMessage("d"), AIMessage("d2")]),
                         tools.all(), middleware=[guard.middleware()], checkpointer=saver,
                         interrupt_before=["tools", "model"])
    _go(agent, {"messages": [HumanMessage("go")]}, CFG, use_async)  # paused before the model
    for expected in [("tools",), ("model",), ("tools",)]:  # a proposed; a ran; b proposed
        _go(agent, None, CFG, use_async)
        assert agent.get_state(CFG).next == expected
    before_b = agent.get_state(CFG)
    _go(agent, None, CFG, use_async)  # b ran; paused before the model
    assert tools.runs["b"] == 1
    _go(agent, None, before_b.config, use_async)  # the replay: b's tool step again, on a branch of its own
    assert agent.get_state(CFG).next == ("model",)
    _go(agent, None, CFG, use_async)
    out = agent.get_state(CFG).values
    ledger = guard.ledger(out)
    assert tools.runs["b"] == 2  # once on each branch
    assert ledger.spent == _ran(out["messages"]) == 17.0 and ledger.reserved == 0.0


@pytest.mark.parametrize("use_async", [False, True])
def test_resuming_an_older_interrupt_again_charges_the_branch_once(use_async: bool) -> None:
    # h asks a human inside. Resumed, h ran and the next h paused; then the first pause is resumed again
    # (time travel): that branch ran h once (was: counted twice).
    tools, guard, saver = Tools(), _guard(100.0), InMemorySaver()
    agent = create_agent(scripted([ai(call("h", x=1)), ai(call("h", x=2)), AIMessage("d1"), AIMessage("d2")]),
                         tools.all(), middleware=[guard.middleware()], checkpointer=saver)
    _go(agent, {"messages": [HumanMessage("go")]}, CFG, use_async)
    first_pause = agent.get_state(CFG)
    _go(agent, Command(resume="yes"), CFG, use_async)
    assert tools.runs["h"] == 1
    _go(agent, Command(resume="again"), first_pause.config, use_async)  # h runs again, on this branch
    while agent.get_state(CFG).next:
        _go(agent, Command(resume="ok"), CFG, use_async)
    values = agent.get_state(CFG).values
    ledger = guard.ledger(values)
    assert tools.runs["h"] >= 2
    assert ledger.spent == _ran(values["messages"]) == 5.0 * (tools.runs["h"] - 1) and ledger.reserved == 0.0


# ------------------------------------------------------- the same branch resumed: nothing forgotten
@pytest.mark.parametrize("then", ["resume", "top_up_then_resume", "new_message"])
def test_a_crashed_tool_run_is_still_paid_when_its_thread_goes_on_in_the_same_process(then: str) -> None:
    # boom ran (4) and raised out of the graph: the step's writes are lost, the working copy keeps the run.
    tools, guard, saver = Tools(), _guard(30.0), InMemorySaver()
    agent = create_agent(scripted([ai(call("boom", x=1)), AIMessage("done"), AIMessage("done again")]),
                         tools.all(), middleware=[guard.middleware()], checkpointer=saver)
    _crash(agent, tools)
    if then == "top_up_then_resume":
        guard.top_up(CFG, 5.0, graph=agent)
    if then == "new_message":
        out = agent.invoke({"messages": [HumanMessage("next")]}, CFG)
        runs_paid = tools.runs["boom"]  # the crashed run: the new turn does not run boom again
    else:
        out = agent.invoke(None, CFG)
        runs_paid = tools.runs["boom"]  # the crashed run and its re-run
    ledger = guard.ledger(out)
    assert ledger.spent == pytest.approx(runs_paid * 4.0) and ledger.reserved == 0.0


def test_reading_another_branchs_ledger_leaves_the_live_episode_alone() -> None:
    # guard.ledger(state) of a state holding a charge this branch never made (another branch's checkpoint)
    # merged it into the live working copy, and the paused branch then wrote it into its own state.
    tools, guard, saver = Tools(), _guard(100.0), InMemorySaver()
    agent = create_agent(scripted([ai(call("a", x=1)), ai(call("b", x=2)), AIMessage("d")]), tools.all(),
                         middleware=[guard.middleware()], checkpointer=saver, interrupt_before=["tools"])
    agent.invoke({"messages": [HumanMessage("go")]}, CFG)
    agent.invoke(None, CFG)  # a ran; paused before b's tool step
    channel = agent.get_state(CFG).values["intent_ledger"]
    other = {**channel, "entries": {**channel["entries"], "elsewhere": {
        "call_id": "elsewhere", "tool": "b", "amount": 7.0, "status": "committed", "seq": 99, "market_version": 0,
        "tool_call_id": "x", "execution": 1, "overrun": 0.0, "kind": "tool"}}}
    assert guard.ledger({"intent_ledger": other}).spent == 17.0  # that state's own spending, read
    out = agent.invoke(None, CFG)
    ledger = guard.ledger(out)
    assert ledger.spent == _ran(out["messages"]) == 17.0 and ledger.reserved == 0.0


def test_a_ledger_read_is_a_snapshot_the_run_goes_on_without() -> None:
    # guard.ledger(state) returned the live working copy when state agreed with it: a ledger read at a pause
    # showed the resumed run's spending later, and a reservation made on it was the guard's own.
    tools, guard, saver = Tools(), _guard(100.0), InMemorySaver()
    agent = create_agent(scripted([ai(call("a", x=1)), ai(call("b", x=2)), AIMessage("d")]), tools.all(),
                         middleware=[guard.middleware()], checkpointer=saver, interrupt_before=["tools"])
    paused = agent.invoke({"messages": [HumanMessage("go")]}, CFG)
    at_pause = guard.ledger(paused)
    assert (at_pause.spent, at_pause.reserved) == (0.0, 10.0)
    at_pause.commit(next(iter(at_pause)).call_id)  # changing the copy read changes nothing of the guard's
    assert guard.ledger(paused).spent == 0.0
    out = agent.invoke(None, CFG)
    out = agent.invoke(None, CFG)
    assert (at_pause.spent, at_pause.reserved) == (10.0, 0.0), "what was read at the pause, as changed by hand"
    ledger = guard.ledger(out)
    assert ledger.spent == _ran(out["messages"]) == 17.0 and ledger.reserved == 0.0


def test_the_checkpointer_key_is_langgraphs() -> None:
    # intent.lineage reads the running step's checkpointer with a LangGraph-internal config key: a LangGraph
    # that renames it would silently turn fork detection off. Fail here instead.
    from langgraph._internal._constants import CONFIG_KEY_CHECKPOINTER

    import intent.lineage as lineage

    assert lineage._CHECKPOINTER == CONFIG_KEY_CHECKPOINTER


# ------------------------------------------- a new message after a run that never ended
def seen(oracle: RecordingOracle) -> list[tuple[str, str]]:
    """The oracle's starts and decisions in order, each with its task."""
    return [(hook, arg.query) for hook, arg in oracle.calls]


class Reminder(AgentMiddleware):
    """Adds a human message inside the run before each model call after a tool step (no new input)."""

    def before_model(self, state: Any, runtime: Any) -> dict[str, Any] | None:
        if isinstance(state["messages"][-1], ToolMessage):
            return {"messages": [HumanMessage("reminder: be brief")]}
        return None


@pytest.mark.parametrize("then", ["new_message", "resume", "reminder_middleware"])
def test_a_new_message_after_a_run_stopped_by_the_recursion_limit_starts_the_next_run(then: str) -> None:
    # The run stopped at GraphRecursionError (it never ended); the user's next message is the next run: the
    # oracle starts it with its own task (was: decided under the first run's task, never started). Resuming
    # the stopped run with invoke(None), or a middleware adding a human message inside the run, is no new run.
    from langgraph.errors import GraphRecursionError

    oracle, tools, saver = RecordingOracle(), Tools(), InMemorySaver()
    guard = BudgetGuard(oracle, Market([PricedTool(n, p) for n, p in PRICES.items()]), 100.0)
    script = [ai(call("a", x=1)), ai(call("a", x=2)), ai(call("b", x=3)), AIMessage("done")]
    middleware = [guard.middleware(), *([Reminder()] if then == "reminder_middleware" else [])]
    agent = create_agent(scripted(script), tools.all(), middleware=middleware, checkpointer=saver)
    with pytest.raises(GraphRecursionError):
        agent.invoke({"messages": [HumanMessage("task ONE")]}, {**CFG, "recursion_limit": 4})
    assert seen(oracle)[:2] == [("start", "task ONE"), ("decide", "task ONE")]
    before = len(seen(oracle))
    out = agent.invoke({"messages": [HumanMessage("task TWO")]} if then == "new_message" else None, CFG)
    later = seen(oracle)[before:]
    if then == "new_message":
        assert later[0] == ("start", "task TWO") and all(q == "task TWO" for _, q in later)
        assert (out["intent_ledger"]["query"], out["intent_ledger"]["query_run"]) == ("task TWO", 2)
    else:
        assert later and all(step == ("decide", "task ONE") for step in later)
        assert out["intent_ledger"]["query_run"] == 1
    assert guard.ledger(out).reserved == 0.0


# ------------------------- the same branch going on by a checkpoint of its own: never a fork
class RaisesAfterTheGuard(AgentMiddleware):
    """Listed before the guard: the guard's tool step returns (the tool ran), then this raises out of the graph."""

    def __init__(self) -> None:
        super().__init__()
        self.armed = True

    def wrap_tool_call(self, request: Any, handler: Any) -> Any:
        answer = handler(request)
        if self.armed:
            self.armed = False
            raise RuntimeError("the process died after the tool ran")
        return answer


@pytest.mark.parametrize("then", ["update_state", "head_config", "top_up"])
@pytest.mark.parametrize("crash", ["sibling_call", "outer_middleware"])
def test_a_crashed_step_whose_thread_goes_on_by_an_edit_or_an_addressed_resume_is_still_paid(
        crash: str, then: str) -> None:
    # A step whose result was never saved (a sibling call raised out of the graph; a middleware raised after the
    # guard's tool step returned) left nothing on another branch: update_state on it, invoke(None, with its own
    # checkpoint's config) (LangGraph saves a "fork" checkpoint for it) or a top-up go on with the same branch,
    # and what the crashed step ran is still paid (a first version of fork detection forgot it: 14 of 28).
    tools, guard, saver = Tools(), _guard(100.0), InMemorySaver()
    first = ai(call("a", x=1), call("boom", x=2)) if crash == "sibling_call" else ai(call("a", x=1))
    middleware = [guard.middleware()] if crash == "sibling_call" else [RaisesAfterTheGuard(), guard.middleware()]
    agent = create_agent(scripted([first, AIMessage("done"), AIMessage("done again")]), tools.all(),
                         middleware=middleware, checkpointer=saver)
    _crash(agent, tools)
    if then == "update_state":
        agent.update_state(CFG, {"messages": [HumanMessage("note: fixed now")]})
        agent.invoke(None, CFG)
    elif then == "top_up":
        guard.top_up(CFG, 5.0, graph=agent)
        agent.invoke(None, CFG)
    else:
        agent.invoke(None, agent.get_state(CFG).config)
    ledger = guard.ledger(_to_the_end(agent))
    really_ran = tools.runs["a"] * 10.0 + tools.runs["boom"] * 4.0
    assert ledger.spent == pytest.approx(really_ran) and ledger.reserved == 0.0


def test_a_replay_of_the_checkpoint_a_top_up_landed_in_charges_the_branch_once() -> None:
    # Paused before b's tool step, topped up (with graph=: a checkpoint of its own), b ran from it; a replay of
    # that checkpoint runs b once on its branch (a first version of fork detection charged it twice: 24).
    tools, guard, saver = Tools(), _guard(30.0), InMemorySaver()
    agent = create_agent(scripted([ai(call("a", x=1)), ai(call("b", x=2)), AIMessage("d"), AIMessage("d2")]),
                         tools.all(), middleware=[guard.middleware()], checkpointer=saver,
                         interrupt_before=["tools", "model"])
    agent.invoke({"messages": [HumanMessage("go")]}, CFG)
    for _ in range(3):  # a proposed; a ran; b proposed
        agent.invoke(None, CFG)
    guard.top_up(CFG, 10.0, graph=agent)
    before_b = agent.get_state(CFG)
    agent.invoke(None, CFG)  # b ran; paused before the model
    agent.invoke(None, before_b.config)  # the replay
    while agent.get_state(CFG).next:
        agent.invoke(None, CFG)
    out = agent.get_state(CFG).values
    ledger = guard.ledger(out)
    assert tools.runs["b"] == 2
    assert ledger.spent == _ran(out["messages"]) == 17.0 and ledger.reserved == 0.0


def test_a_crashed_step_resumed_by_its_own_config_after_a_top_up_keeps_what_it_spent_and_the_top_up() -> None:
    # boom ran (4) and raised; a top-up (graph=) makes a checkpoint after the crashed one; the thread goes on with
    # the crashed checkpoint's own config saved before the top-up. The crashed run is this branch's (a first
    # version rebuilt the episode from state: 21 counted of 25 run, over a budget of 22).
    tools, guard, saver = Tools(), _guard(22.0), InMemorySaver()
    agent = create_agent(scripted([ai(call("a", x=0)), ai(call("boom", x=2)), ai(call("a", x=3)), AIMessage("d")]),
                         tools.all(), middleware=[guard.middleware()], checkpointer=saver)
    _crash(agent, tools)
    crashed = agent.get_state(CFG)
    guard.top_up(CFG, 5.0, graph=agent)
    agent.invoke(None, crashed.config)
    ledger = guard.ledger(_to_the_end(agent))
    really_ran = tools.runs["a"] * 10.0 + tools.runs["boom"] * 4.0
    assert ledger.spent == pytest.approx(really_ran) and ledger.reserved == 0.0
    assert ledger.spent <= ledger.budget == 27.0


def test_a_parallel_task_noting_its_checkpoint_meanwhile_is_no_evidence_of_a_fork() -> None:
    # Two calls of one message resumed from a new checkpoint F run as parallel tasks: the first notes F while the
    # second is still walking up from it; the second must not take F for a step of another branch (it did, at
    # random: 1 run in 25 of this file forgot what a crashed sibling spent).
    from intent.lineage import Lineage, forked

    lineage = Lineage()
    lineage.ran("X")  # the crashed step's checkpoint

    class Reader:
        def parent(self, checkpoint_id: str, *, wait: bool = False) -> tuple[str | None, str | None]:
            lineage.ran("F")  # the sibling task, meanwhile
            return {"F": ("fork", "X")}[checkpoint_id]

        def result_saved(self, checkpoint_id: str) -> bool:
            return False  # X's step crashed: no result

    assert forked(lineage, "F", Reader()) is False  # type: ignore[arg-type]


def _hooks(n: int) -> list[Any]:
    """``n`` middlewares with a before_model hook each: a graph step each between the input and the model."""
    def before_model(self: Any, state: Any, runtime: Any) -> None:
        return None

    return [type(f"Hook{i}", (AgentMiddleware,), {"before_model": before_model})() for i in range(n)]


def test_a_new_message_after_a_stopped_run_starts_the_next_run_behind_several_hooks() -> None:
    # Each before_model hook is a step between the user's input and the model step (looked for within 4 steps
    # at first: with 3 hooks the next run was decided under the stopped run's task).
    from langgraph.errors import GraphRecursionError

    oracle, tools, saver = RecordingOracle(), Tools(), InMemorySaver()
    guard = BudgetGuard(oracle, Market([PricedTool(n, p) for n, p in PRICES.items()]), 100.0)
    script = [ai(call("a", x=1)), ai(call("a", x=2)), ai(call("b", x=3)), AIMessage("done")]
    agent = create_agent(scripted(script), tools.all(), middleware=[*_hooks(3), guard.middleware()],
                         checkpointer=saver)
    with pytest.raises(GraphRecursionError):
        agent.invoke({"messages": [HumanMessage("task ONE")]}, {**CFG, "recursion_limit": 6})
    before = len(seen(oracle))
    out = agent.invoke({"messages": [HumanMessage("task TWO")]}, CFG)
    assert seen(oracle)[before] == ("start", "task TWO")
    assert out["intent_ledger"]["query_run"] == 2 and guard.ledger(out).reserved == 0.0


def test_a_crashed_step_resumed_from_a_top_ups_checkpoint_after_another_top_up_keeps_what_it_spent() -> None:
    # boom ran (4) and raised; a top-up makes T1 (its state: the charges state had, not the crashed run); a second
    # top-up T2 follows; the thread goes on from T1's config. The crashed run is still this branch's (T1 was taken
    # for the deciding checkpoint and the episode rebuilt from its state: 14 counted of 18 run).
    tools, guard, saver = Tools(), _guard(100.0), InMemorySaver()
    agent = create_agent(scripted([ai(call("a", x=0)), ai(call("boom", x=2)), AIMessage("d")]), tools.all(),
                         middleware=[guard.middleware()], checkpointer=saver)
    _crash(agent, tools)
    guard.top_up(CFG, 5.0, graph=agent)
    t1 = agent.get_state(CFG)
    guard.top_up(CFG, 5.0, graph=agent)
    agent.invoke(None, t1.config)
    ledger = guard.ledger(_to_the_end(agent))
    assert ledger.spent == pytest.approx(tools.runs["a"] * 10.0 + tools.runs["boom"] * 4.0) == 18.0
    assert ledger.reserved == 0.0
