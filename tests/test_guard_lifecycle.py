"""Episode lifecycle: bounded memory, cancellation, a light import, the exception tree."""

import asyncio
import itertools
import subprocess
import sys
import tracemalloc

import pytest
from langchain.agents import create_agent
from langchain_core.messages import AIMessage
from langchain_core.tools import StructuredTool

from intent import AcceptAll, BudgetGuard, GuardConfigError, IntentError, Market, MemoryLogSink, PricedTool
from intent.testing import GuardDriver, ScriptedToolModel, ai, call, scripted


def _memory_growth(episodes, *, warm_up: int, measured: int) -> int:
    """Bytes allocated and still held after ``measured`` more episodes, caches warmed up first."""
    episodes(warm_up, 0)
    tracemalloc.start()
    before = tracemalloc.take_snapshot()
    episodes(measured, warm_up)
    after = tracemalloc.take_snapshot()
    tracemalloc.stop()
    return sum(s.size_diff for s in after.compare_to(before, "filename"))


@pytest.mark.slow
def test_ten_thousand_episodes_keep_memory_flat():
    guard = BudgetGuard(AcceptAll(), Market([PricedTool("echo", 1.0)]), 5.0)

    def episodes(n, offset):
        for i in range(n):
            driver = GuardDriver(guard, thread_id=f"ep-{offset + i}")
            driver.step(ai(call("echo", x=i)))
            driver.finish()
            assert driver.ledger.spent == 1.0 and driver.ledger.reserved == 0

    grown = _memory_growth(episodes, warm_up=1000, measured=9000)
    assert len(guard.episodes) == 0, "every finished episode's working state is dropped"
    assert grown < 2_000_000, f"memory grew by {grown} bytes over 9,000 episodes"


@pytest.mark.slow
def test_episodes_through_create_agent_keep_memory_flat():
    # The way users run it: one compiled agent, a new thread per episode. after_agent drops each
    # episode's working state, whatever the gate's position.
    guard = BudgetGuard(AcceptAll(), Market([PricedTool("echo", 1.0)]), 5.0)
    echo = StructuredTool.from_function(lambda x=0: str(x), name="echo", description="echo")
    model = ScriptedToolModel(messages=itertools.cycle([ai(call("echo", x=1)), AIMessage("done")]), bound=[])
    agent = create_agent(model, [echo], middleware=[guard.middleware()])

    def episodes(n, offset):
        for i in range(n):
            out = agent.invoke({"messages": [("user", "go")]}, {"configurable": {"thread_id": f"ca-{offset + i}"}})
            ledger = guard.ledger(out)
            assert ledger.spent == 1.0 and ledger.reserved == 0
        model.bound.clear()  # the test double's own record of bind_tools calls

    grown = _memory_growth(episodes, warm_up=300, measured=1500)
    assert len(guard.episodes) == 0, "every finished episode's working state is dropped"
    assert grown < 1_000_000, f"memory grew by {grown} bytes over 1,500 episodes"


def test_unfinished_episodes_are_bounded_by_max_episodes():
    guard = BudgetGuard(AcceptAll(), Market([PricedTool("echo", 1.0)]), 5.0, max_episodes=50)
    for i in range(500):
        GuardDriver(guard, thread_id=f"open-{i}").step(ai(call("echo")))
    assert len(guard.episodes) == 50


def test_a_tool_cancelled_mid_run_is_charged_and_logged():
    started = asyncio.Event()

    async def slow(x: int = 0) -> str:
        started.set()
        await asyncio.sleep(10)
        return "never"

    tool = StructuredTool.from_function(coroutine=slow, name="slow", description="slow")
    sink = MemoryLogSink()
    guard = BudgetGuard(AcceptAll(), Market([PricedTool("slow", 7.0)]), 50, log_sink=sink)
    agent = create_agent(scripted([ai(call("slow")), AIMessage("done")]), [tool], middleware=[guard.middleware()])

    async def main():
        task = asyncio.create_task(agent.ainvoke({"messages": [("user", "go")]},
                                                 {"configurable": {"thread_id": "cancel"}}))
        await started.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    runs = [r for r in sink.records if r.execution > 0]
    assert [(r.charged, r.reason, r.status) for r in runs] == [(7.0, "cancelled", "error")]
    assert guard.episodes.peek("cancel").ledger.spent == 7.0  # money spent is spent


def _cancelled_run(tools, prices: dict, *, until, callbacks=(), after_cancel=None):
    """Run an agent whose one reply calls each of ``tools``, under asyncio on a loop whose default
    executor has one worker; cancel the run once ``until()`` holds, then call ``after_cancel()`` and
    wait for the executor to go idle. Returns the guard and its log."""
    import concurrent.futures

    sink = MemoryLogSink()
    guard = BudgetGuard(AcceptAll(), Market([PricedTool(n, p) for n, p in prices.items()]), 50, log_sink=sink)
    agent = create_agent(scripted([ai(*(call(t.name) for t in tools)), AIMessage("done")]), tools,
                         middleware=[guard.middleware()])
    executor = concurrent.futures.ThreadPoolExecutor(1)

    async def main():
        asyncio.get_running_loop().set_default_executor(executor)
        task = asyncio.create_task(agent.ainvoke({"messages": [("user", "go")]},
                                                 {"configurable": {"thread_id": "cancel"}, "callbacks": list(callbacks)}))
        for _ in range(500):
            if until():
                break
            await asyncio.sleep(0.01)
        assert until(), "the run never reached the point to cancel it at"
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        if after_cancel is not None:
            after_cancel()

    asyncio.run(main())
    executor.shutdown(wait=True)  # a body still running in its thread has ended, and reported
    return guard, sink


def test_a_sync_tool_still_queued_when_its_run_is_cancelled_never_runs_and_costs_nothing():
    # Two sync tools of one reply, one executor worker: `first` runs (and blocks), `queued` waits for the
    # worker. The run is cancelled then: `first` is charged its quote, `queued` never runs, costs nothing.
    import threading

    running, release, ran = threading.Event(), threading.Event(), []

    def first(x: int = 0) -> str:
        running.set()
        release.wait(10)
        return "first"

    tools = [StructuredTool.from_function(first, name="first", description="blocks"),
             StructuredTool.from_function(lambda x=0: ran.append(x) or "ran", name="queued", description="waits")]
    executors: list = []

    def queued() -> bool:
        loop = asyncio.get_running_loop()
        executors.append(loop._default_executor)
        return running.is_set() and loop._default_executor._work_queue.qsize() > 0

    guard, sink = _cancelled_run(tools, {"first": 7.0, "queued": 5.0}, until=queued, after_cancel=release.set)
    ledger = guard.episodes.peek("cancel").ledger
    assert ran == [], "a body still queued when its run was cancelled must not run"
    assert ledger.spent == 7.0 and ledger.reserved == 0.0
    assert sorted((r.tool, r.reason, r.status, r.charged) for r in sink.records) == [
        ("first", "cancelled", "error", 7.0), ("queued", "cancelled_before_run", "released", 0.0)]


def test_a_sync_tool_that_outlives_its_cancelled_run_has_its_late_bill_charged():
    import threading

    running, release = threading.Event(), threading.Event()

    def billed(x: int = 0):
        running.set()
        release.wait(10)
        return "done", {"intent_billed": 12.0}

    tool = StructuredTool.from_function(billed, name="sync", description="sync", response_format="content_and_artifact")
    guard, sink = _cancelled_run([tool], {"sync": 7.0}, until=running.is_set, after_cancel=release.set)
    ledger = guard.episodes.peek("cancel").ledger
    # 7 at the cancellation (the reservation: the body was running), then the 5 it billed above that
    assert ledger.spent == 12.0 and ledger.overrun == 5.0 and ledger.halted and ledger.reserved == 0.0
    assert [(r.reason, r.charged, r.execution) for r in sink.records] == [("cancelled", 7.0, 1), ("late_bill", 5.0, 0)]
    assert len([r for r in sink.records if r.is_gate_decision]) == 1, "the late bill is not a decision of its own"


def test_a_late_bill_that_comes_after_its_run_ended_reaches_the_threads_next_run():
    # A timeout around the guard gives up on a sync tool (quote 5) and the run ends; the tool's thread then
    # bills 12. The thread's next run takes the 7 above the quote in as an overrun: no further call runs, and
    # state says 12 (was: 5, and the next run's call ran: 24 billed of 20).
    import threading

    from langchain.agents.middleware import AgentMiddleware
    from langchain_core.messages import ToolMessage
    from langgraph.checkpoint.memory import InMemorySaver

    running, release = threading.Event(), threading.Event()

    def slow(x: int = 0):
        running.set()
        release.wait(10)
        return "ok", {"intent_billed": 12.0}

    class GiveUp(AgentMiddleware):
        async def awrap_tool_call(self, request, handler):
            task = asyncio.ensure_future(handler(request))
            while not running.is_set() and not task.done():
                await asyncio.sleep(0.01)
            if task.done():  # answered without running the body (the guard refused it)
                return task.result()
            task.cancel()  # a timeout: the body is running in its thread
            try:
                await task
            except asyncio.CancelledError:
                pass
            return ToolMessage("timed out", tool_call_id=request.tool_call["id"], status="error")

    tool = StructuredTool.from_function(slow, name="slow", description="slow", response_format="content_and_artifact")
    sink = MemoryLogSink()
    guard = BudgetGuard(AcceptAll(), Market([PricedTool("slow", 5.0)]), 20.0, log_sink=sink)
    agent = create_agent(scripted([ai(call("slow", x=1)), AIMessage("done"), ai(call("slow", x=2)), AIMessage("done")]),
                         [tool], middleware=[GiveUp(), guard.middleware()], checkpointer=InMemorySaver())
    config = {"configurable": {"thread_id": "late"}}

    async def main():
        out = await agent.ainvoke({"messages": [("user", "go")]}, config)
        assert guard.ledger(out).spent == 5.0 and len(guard.episodes) == 0  # the run has ended
        release.set()
        for _ in range(500):  # the thread reports its bill
            if any(r.reason == "late_bill" for r in sink.records):
                break
            await asyncio.sleep(0.01)
        assert any(r.reason == "late_bill" for r in sink.records), "the tool's thread never reported its bill"
        running.clear()
        return await agent.ainvoke({"messages": [("user", "again")]}, config)

    out = asyncio.run(main())
    ledger = guard.ledger(out)
    assert ledger.spent == 12.0 and ledger.overrun == 7.0 and ledger.reserved == 0.0
    assert [r.reason for r in sink.records if r.kind == "tool" and r.status != "released"][:2] == ["cancelled", "late_bill"]
    # The second call is refused because of the overrun (not for a lack of money: 8 of 20 is left).
    assert "billed 7 above its quoted price" in [m.content for m in out["messages"] if m.type == "tool"][-1]


def test_a_tool_cancelled_in_langchains_callbacks_is_charged_by_what_its_body_did():
    # Before the body (on_tool_start still running): it never runs, nothing is charged. After the body
    # (on_tool_end still running): charged what it billed (3), not the quote (7).
    from langchain_core.callbacks import AsyncCallbackHandler

    for hook in ("on_tool_start", "on_tool_end"):
        ran: list = []
        reached: list = []

        class Stall(AsyncCallbackHandler):
            async def _stall(self, *args, **kwargs):
                reached.append(True)
                await asyncio.sleep(10)

        setattr(Stall, hook, Stall._stall)

        async def body(x: int = 0):
            ran.append(x)
            return "done", {"intent_billed": 3.0}

        tool = StructuredTool.from_function(coroutine=body, name="atool", description="async",
                                            response_format="content_and_artifact")
        guard, sink = _cancelled_run([tool], {"atool": 7.0}, until=lambda: bool(reached), callbacks=[Stall()])
        ledger = guard.episodes.peek("cancel").ledger
        if hook == "on_tool_start":
            assert ran == [] and ledger.spent == 0.0 and ledger.reserved == 0.0
            assert [r.reason for r in sink.records] == ["cancelled_before_run"]
        else:
            assert ran == [0] and ledger.spent == 3.0 and ledger.reserved == 0.0
            assert [(r.reason, r.charged) for r in sink.records] == [("cancelled", 3.0)]


def test_import_intent_market_stays_light():
    code = "import sys, intent.market; print(any(m.split('.')[0] in ('langgraph', 'langchain', 'torch') for m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_one_exception_tree():
    with pytest.raises(IntentError):
        BudgetGuard(AcceptAll(), Market([]), 1.0, tool_errors="swallow")
    with pytest.raises(GuardConfigError, match="tool_errors"):
        BudgetGuard(AcceptAll(), Market([]), 1.0, tool_errors="swallow")
    with pytest.raises(IntentError):
        Market([PricedTool("a", -1.0)])


def test_gate_at_is_checked_and_auto_picks_the_hook_a_human_top_up_needs():
    from intent.middleware import BudgetGuardAfterModelMiddleware, BudgetGuardMiddleware

    market = Market([PricedTool("a", 1.0)])
    with pytest.raises(GuardConfigError, match="gate_at must be"):
        BudgetGuard(AcceptAll(), market, 1.0, gate_at="before_model")
    with pytest.raises(GuardConfigError, match="on_over_budget='ask' needs gate_at='after_model'"):
        BudgetGuard(AcceptAll(), market, 1.0, gate_at="model_call", on_over_budget="ask")
    assert type(BudgetGuard(AcceptAll(), market, 1.0).middleware()) is BudgetGuardMiddleware
    assert type(BudgetGuard(AcceptAll(), market, 1.0, on_over_budget="ask").middleware()) is \
        BudgetGuardAfterModelMiddleware
    assert type(BudgetGuard(AcceptAll(), market, 1.0, gate_at="after_model").middleware()) is \
        BudgetGuardAfterModelMiddleware


def test_turns_are_numbered_on_from_the_last_counted_one_never_again_after_a_rewrite():
    # The gate numbers turns on from the AIMessage it counted last (graph state's "turns"), so a
    # history a middleware trimmed or rewrote (a summariser) never numbers a turn twice.
    from langchain_core.messages import AIMessage, HumanMessage, ToolMessage

    from intent.messages import turns_before

    history = [HumanMessage("go")]
    for i in range(5):
        history = [*history, AIMessage(f"a{i}", id=f"m{i}"), ToolMessage("r", tool_call_id=f"c{i}")]
    assert turns_before(history, len(history)) == 5  # nothing counted yet: the history is counted
    assert turns_before(history, 3) == 1
    counted = {"count": 5, "last_id": "m4"}
    assert turns_before(history, 9, counted) == 4  # the last counted turn, gated again
    nxt = [*history, AIMessage("a5", id="m5")]
    assert turns_before(nxt, 11, counted) == 5
    # A summariser kept the last turn only: the next turn is still the sixth.
    trimmed = [HumanMessage("summary of the conversation"), *history[-2:], AIMessage("a5", id="m5")]
    assert turns_before(trimmed, 3, counted) == 5
    # The counted message itself is gone: every AIMessage left is taken as new (a gap, never a repeat).
    rewritten = [HumanMessage("summary"), AIMessage("x", id="x"), AIMessage("y", id="y")]
    assert turns_before(rewritten, 2, counted) == 6
    assert turns_before([], 0, counted) == 5
    assert turns_before(history, len(history), {"count": 3, "last_id": ""}) == 5  # no id: counted afresh
    # With the total kept (every reply counted as it is made), numbering never goes below it: the
    # counted message rebuilt with another id, or removed with replies after it, gives the total.
    rebuilt = [HumanMessage("go"), AIMessage("", id="other"), ToolMessage("r", tool_call_id="k1"),
               AIMessage("next", id="n")]
    assert turns_before(rebuilt, 3, {"total": 9, "count": 7, "last_id": "gone"}) == 9
    assert turns_before(trimmed, 3, {"total": 8, "count": 5, "last_id": "m4"}) == 8  # found, but below the total
    assert turns_before(trimmed, 3, {"total": 6, "count": 5, "last_id": "m4"}) == 6
    assert turns_before(rewritten, 2, {"total": 6}) == 6  # no message decided yet: the total


def test_every_intent_name_the_readme_uses_exists():
    # The README is where users copy names from: each `intent.Name` it shows must resolve (was:
    # intent.BudgetState, the create_agent state schema, missing from the package's exports).
    import re
    from pathlib import Path

    import intent

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    names = set(re.findall(r"\bintent\.([A-Za-z_][A-Za-z0-9_]*)\b(?![./])", readme))
    names = {n for n in names if n[0].isupper() or n in intent.__all__ or n == "budget_report"}
    assert "BudgetState" in names
    missing = sorted(n for n in names if not hasattr(intent, n) and not (Path(intent.__file__).parent / f"{n}.py").exists()
                     and not (Path(intent.__file__).parent / n).is_dir())
    assert missing == []
    assert all(hasattr(intent, n) for n in intent.__all__)


def test_the_guard_driver_keeps_the_state_a_graph_would():
    # GuardDriver (intent.testing) is what users test oracles with: like create_agent, it gives the model's
    # message an id, so identical calls are merged (run and charged once), and the gate's rewritten copy of
    # the message replaces it (it appended it: two versions of the message, the dropped call unanswered).
    from intent.testing import GuardDriver, ai, assert_each_call_answered_once, call

    driver = GuardDriver(BudgetGuard(AcceptAll(), Market([PricedTool("t", 1.0)]), 10.0))
    answers = driver.step(ai(call("t", q=1), call("t", q=1)))
    assert len(answers) == 1 and driver.ledger.spent == 1.0
    turns = [m for m in driver.state["messages"] if isinstance(m, AIMessage)]
    assert len(turns) == 1 and len(turns[0].tool_calls) == 1
    assert_each_call_answered_once(driver.state["messages"])
