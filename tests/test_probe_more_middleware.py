"""The guard composed with LangChain middleware and run shapes the earlier composition tests left out.

Probed (probe3): LLMToolEmulator, SummarizationMiddleware (the real one, a fake summariser),
ContextEditingMiddleware(ClearToolUsesEdit(clear_tool_inputs=True)), FilesystemFileSearchMiddleware,
ShellToolMiddleware (AutoModeMiddleware and ModelRouterMiddleware: test_decision_model_middleware.py); a stream its reader
leaves early, then the thread resumed; ``interrupt()`` inside a priced tool (once and twice, beside
ToolRetry / ToolCallLimit / HumanInTheLoop); tools returning ``Command(update=...)`` without goto and
``Command(goto=END)``; parallel tools that raise (the run crashes, a sibling is cancelled) then resumed;
injected arguments under these middleware. Both list orders, sync and async, with and without a
checkpointer, both gate positions where it matters. No violation was found: each test below keeps a
composition that holds held.

After each run: ``spent == Σ executions × price <= budget`` (executions counted inside the tools),
``reserved == 0`` and ``remaining == budget - spent - reserved``, one ToolMessage per proposed call, one
answering log record per call, one execution record per run, and the log's charges add up to the spend.
"""

from __future__ import annotations

import asyncio
import itertools
import operator
import time
from collections import Counter
from typing import Annotated, Any

import pytest
from langchain.agents import AgentState, create_agent
from langchain.agents.middleware import (
    ClearToolUsesEdit,
    ContextEditingMiddleware,
    FilesystemFileSearchMiddleware,
    HostExecutionPolicy,
    HumanInTheLoopMiddleware,
    LLMToolEmulator,
    ShellToolMiddleware,
    SummarizationMiddleware,
    ToolCallLimitMiddleware,
    ToolRetryMiddleware,
)
from langchain.tools import ToolRuntime
from langchain_core.language_models.fake_chat_models import FakeListChatModel
from langchain_core.messages import AIMessage, ToolMessage
from langchain_core.tools import InjectedToolCallId, StructuredTool, tool
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.graph import END
from langgraph.prebuilt import InjectedState
from langgraph.types import Command, interrupt
from typing_extensions import NotRequired

from intent import AcceptAll, BudgetGuard, Market, PricedTool
from intent.logs import MemoryLogSink
from intent.testing import RunCounter, assert_each_call_answered_once, assert_one_record_per_call, scripted

ORDERS = ["guard_first", "guard_last"]
MODES = ["sync", "async"]
GATES = ["model_call", "after_model"]
USER = {"messages": [("user", "go")]}
_threads = itertools.count()


def make_tool(name: str, runs: RunCounter, *, fail: bool = False, delay: float = 0.0) -> StructuredTool:
    def fn(x: str = "0") -> str:
        runs.hit(name)  # counted when the body starts: a run cancelled mid-way is paid
        if delay:
            time.sleep(delay)
        if fail:
            raise RuntimeError(f"{name} is down")
        return f"{name} ran with {x}"

    return StructuredTool.from_function(fn, name=name, description=f"Tool {name}.")


def tc(name: str, cid: str, **args: Any) -> dict[str, Any]:
    return {"name": name, "args": args, "id": cid, "type": "tool_call"}


def guard_for(prices: dict[str, float], budget: float, **kw: Any) -> tuple[BudgetGuard, MemoryLogSink]:
    sink = MemoryLogSink()
    return BudgetGuard(AcceptAll(), Market([PricedTool(n, p) for n, p in prices.items()]), budget,
                       log_sink=sink, **kw), sink


def stack(guard: BudgetGuard, others: list[Any], order: str) -> list[Any]:
    return [guard.middleware(), *others] if order == "guard_first" else [*others, guard.middleware()]


def config(ckpt: bool) -> dict[str, Any] | None:
    return {"configurable": {"thread_id": f"probe3-{next(_threads)}"}} if ckpt else None


def invoke(agent: Any, inp: Any, mode: str, cfg: Any = None) -> Any:
    return asyncio.run(agent.ainvoke(inp, cfg)) if mode == "async" else agent.invoke(inp, cfg)


def check(guard: BudgetGuard, out: Any, runs: Any, prices: dict[str, float], sink: MemoryLogSink, *,
          history_whole: bool = True, calls: list[AIMessage] | None = None) -> Any:
    """The four promises. ``history_whole=False`` (a summariser rewrote the history): the answering
    records are checked per call id of ``calls`` (the script's replies) instead of per history turn."""
    ledger = guard.ledger(out)
    expected = sum(runs.get(n, 0) * p for n, p in prices.items())
    assert ledger.reserved == 0, f"{ledger.reserved} still reserved"
    assert ledger.spent == pytest.approx(expected), f"spent {ledger.spent}, runs {dict(runs)} cost {expected}"
    assert ledger.spent <= ledger.budget + 1e-9
    assert ledger.remaining == pytest.approx(ledger.budget - ledger.spent - ledger.reserved)
    messages = list(out["messages"])
    assert_each_call_answered_once(messages)
    if history_whole:
        assert_one_record_per_call(messages, sink.records)
    else:
        answers = Counter(r.call_id for r in sink.records if r.kind == "tool" and r.execution in (0, 1)
                          and r.decision != "top_up")
        wrong = {c["id"]: answers[c["id"]] for m in calls or [] for c in m.tool_calls if answers[c["id"]] != 1}
        assert not wrong, f"calls without exactly one answering record: {wrong}"
    executions = [r for r in sink.records if r.kind == "tool" and r.execution > 0]
    assert len(executions) == sum(runs.get(n, 0) for n in prices), f"{len(executions)} records, runs {dict(runs)}"
    assert sum(r.charged for r in sink.records) == pytest.approx(ledger.spent)
    return ledger


# ============================================== LLMToolEmulator
@pytest.mark.parametrize("ckpt", [False, True])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("emulate", [["a"], None])
def test_emulated_calls_never_run_cost_nothing_and_leave_nothing_reserved(emulate, order, mode, ckpt):
    prices = {"a": 10.0, "b": 5.0}
    runs = RunCounter()
    guard, sink = guard_for(prices, 25.0)
    script = [AIMessage("", tool_calls=[tc("a", "c1"), tc("b", "c2"), tc("a", "c3", x="2")]),
              AIMessage("", tool_calls=[tc("a", "c4"), tc("b", "c5")]), AIMessage("done")]
    emulator = LLMToolEmulator(tools=emulate, model=FakeListChatModel(responses=["emulated"] * 20))
    agent = create_agent(scripted(script), [make_tool("a", runs), make_tool("b", runs)],
                         middleware=stack(guard, [emulator], order), checkpointer=InMemorySaver() if ckpt else None)
    out = invoke(agent, USER, mode, config(ckpt))
    ledger = check(guard, out, runs, prices, sink)
    assert runs["a"] == 0 and ledger.spent == 5.0 * runs["b"]
    assert runs["b"] == (2 if emulate else 0)


# ============================================== SummarizationMiddleware (the real one)
@pytest.mark.parametrize("gate_at", GATES)
@pytest.mark.parametrize("ckpt", [False, True])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("order", ORDERS)
def test_real_summariser_over_many_parallel_turns_keeps_the_money(order, mode, ckpt, gate_at):
    prices = {"a": 2.0, "b": 1.0}
    runs = RunCounter()
    guard, sink = guard_for(prices, 16.0, gate_at=gate_at)  # 6 turns of 3 do not all fit: some refused
    script = [AIMessage("", tool_calls=[tc("a", f"s{i}a", x="x" * 200), tc("b", f"s{i}b", x="y" * 200)])
              for i in range(6)] + [AIMessage("done")]
    summariser = SummarizationMiddleware(FakeListChatModel(responses=["summary"] * 50), trigger=("messages", 6),
                                         keep=("messages", 3))
    agent = create_agent(scripted(script), [make_tool("a", runs), make_tool("b", runs)],
                         middleware=stack(guard, [summariser], order), checkpointer=InMemorySaver() if ckpt else None)
    out = invoke(agent, USER, mode, config(ckpt))
    ledger = check(guard, out, runs, prices, sink, history_whole=False, calls=script)
    assert ledger.spent == 16.0 and (runs["a"], runs["b"]) == (5, 6)  # turn 6: a no longer fits, b does


# ============================================== ContextEditing clearing tool inputs
@pytest.mark.parametrize("gate_at", GATES)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("budget", [30.0, 11.0])
def test_cleared_tool_inputs_in_the_models_request_leave_the_money_alone(budget, order, mode, gate_at):
    prices = {"a": 2.0, "b": 3.0}
    runs = RunCounter()
    guard, sink = guard_for(prices, budget, gate_at=gate_at)
    script = [AIMessage("", tool_calls=[tc("a", "e1", x="1"), tc("b", "e2", x="2")]),
              AIMessage("", tool_calls=[tc("a", "e3", x="1"), tc("b", "e4", x="2")]),
              AIMessage("", tool_calls=[tc("a", "e5", x="1"), tc("a", "e6", x="5")]), AIMessage("done")]
    editor = ContextEditingMiddleware(edits=[ClearToolUsesEdit(trigger=0, keep=0, clear_tool_inputs=True)])
    agent = create_agent(scripted(script), [make_tool("a", runs), make_tool("b", runs)],
                         middleware=stack(guard, [editor], order), checkpointer=InMemorySaver())
    out = invoke(agent, USER, mode, config(True))
    ledger = check(guard, out, runs, prices, sink)
    assert ledger.spent == (14.0 if budget == 30.0 else 10.0)


# ============================================== middleware with tools of their own
@pytest.mark.parametrize("ckpt", [False, True])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("order", ORDERS)
def test_file_search_tools_are_paid_and_refused_over_budget(order, mode, ckpt, tmp_path):
    (tmp_path / "f.txt").write_text("hello world\n")
    prices = {"glob_search": 1.0, "grep_search": 2.0}
    guard, sink = guard_for(prices, 3.5)
    script = [AIMessage("", tool_calls=[tc("glob_search", "g1", pattern="*.txt"), tc("grep_search", "g2", pattern="hello"),
                                        tc("glob_search", "g3", pattern="*")]), AIMessage("done")]
    agent = create_agent(scripted(script), [], middleware=stack(guard, [FilesystemFileSearchMiddleware(
        root_path=str(tmp_path))], order), checkpointer=InMemorySaver() if ckpt else None)
    out = invoke(agent, USER, mode, config(ckpt))
    answers = {m.tool_call_id: m.content for m in out["messages"] if isinstance(m, ToolMessage)}
    assert answers["g1"] == "/f.txt" and answers["g2"] == "/f.txt" and "was not executed" in answers["g3"]
    runs = Counter(r.tool for r in sink.records if r.execution > 0)  # the middleware's tools: ran = answered
    assert runs == {"glob_search": 1, "grep_search": 1}
    check(guard, out, runs, prices, sink)


@pytest.mark.parametrize("ckpt", [False, True])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("order", ORDERS)
def test_shell_commands_are_each_paid_and_one_over_budget_never_runs(order, mode, ckpt, tmp_path):
    prices = {"shell": 4.0}
    guard, sink = guard_for(prices, 10.0)
    script = [AIMessage("", tool_calls=[tc("shell", "h1", command="echo one >> log.txt"),
                                        tc("shell", "h2", command="echo two >> log.txt")]),
              AIMessage("", tool_calls=[tc("shell", "h3", command="echo three >> log.txt")]), AIMessage("done")]
    shell = ShellToolMiddleware(workspace_root=str(tmp_path), execution_policy=HostExecutionPolicy())
    agent = create_agent(scripted(script), [], middleware=stack(guard, [shell], order),
                         checkpointer=InMemorySaver() if ckpt else None)
    out = invoke(agent, USER, mode, config(ckpt))
    log = tmp_path / "log.txt"
    lines = log.read_text().split() if log.exists() else []
    assert sorted(lines) == ["one", "two"]  # the third (4 > 10 - 8) never ran
    check(guard, out, {"shell": len(lines)}, prices, sink)


# ============================================== a stream its reader leaves, then the thread resumed
@pytest.mark.parametrize("gate_at", GATES)
@pytest.mark.parametrize("stream_mode", ["updates", "messages"])
@pytest.mark.parametrize("chunks", [1, 2, 3])
@pytest.mark.parametrize("mode", MODES)
def test_a_stream_left_early_then_resumed_pays_every_run_once(mode, chunks, stream_mode, gate_at):
    prices = {"a": 10.0, "b": 5.0, "s": 3.0}
    runs = RunCounter()
    guard, sink = guard_for(prices, 50.0, gate_at=gate_at)
    script = [AIMessage("", tool_calls=[tc("a", "c1"), tc("s", "c2"), tc("b", "c3")]),
              AIMessage("", tool_calls=[tc("a", "c4")]), AIMessage("done")]
    tools = [make_tool("a", runs), make_tool("b", runs), make_tool("s", runs, delay=0.2)]
    agent = create_agent(scripted(script), tools, middleware=[guard.middleware()], checkpointer=InMemorySaver())
    cfg = config(True)

    async def run() -> Any:
        if mode == "sync":
            stream = agent.stream(USER, cfg, stream_mode=stream_mode)
            for n, _ in enumerate(stream, 1):
                if n >= chunks:
                    break
            stream.close()
            await asyncio.sleep(0.4)  # a sync tool's thread the reader left finishes
            return agent.invoke(None, cfg)
        stream = agent.astream(USER, cfg, stream_mode=stream_mode)
        n = 0
        async for _ in stream:
            n += 1
            if n >= chunks:
                break
        await stream.aclose()
        await asyncio.sleep(0.4)
        return await agent.ainvoke(None, cfg)

    out = asyncio.run(run())
    assert out["messages"][-1].content == "done"
    check(guard, out, runs, prices, sink)
    # A task the reader's leaving cancelled runs again on resume, paid again (s: its thread went on, paid twice);
    # left inside the async model step, the scripted model's first reply is lost with the step (the next one is played).
    assert runs["a"] >= 1


# ============================================== interrupt() inside a priced tool
def _asking_tools(runs: RunCounter, starts: RunCounter, *, fail_b: bool = False, twice: bool = False) -> list[Any]:
    def ask(x: str = "0") -> str:
        starts.hit("ask")
        first = interrupt({"q": x})
        second = interrupt({"again": x}) if twice else ""
        runs.hit("ask")
        return f"ask got {first} {second}"

    return [StructuredTool.from_function(ask, name="ask", description="asks a human"), make_tool("b", runs, fail=fail_b)]


def _resume_all(agent: Any, cfg: Any, mode: str) -> Any:
    async def run() -> Any:
        call = (lambda i: agent.ainvoke(i, cfg)) if mode == "async" else (lambda i: asyncio.to_thread(agent.invoke, i, cfg))
        out = await call(USER)
        for _ in range(10):
            if not out.get("__interrupt__"):
                break
            out = await call(Command(resume={i.id: ({"decisions": [{"type": "approve"}] * len(i.value["action_requests"])}
                                                    if isinstance(i.value, dict) and "action_requests" in i.value
                                                    else "yes") for i in out["__interrupt__"]}))
        return out

    return asyncio.run(run())


OTHERS = {
    "none": lambda: [],
    "tool_retry": lambda: [ToolRetryMiddleware(max_retries=2, initial_delay=0, jitter=False)],
    "tool_call_limit": lambda: [ToolCallLimitMiddleware(tool_name="b", run_limit=5, exit_behavior="continue")],
    "hitl": lambda: [HumanInTheLoopMiddleware(interrupt_on={"ask": True})],
}


@pytest.mark.parametrize("gate_at", GATES)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("other", list(OTHERS))
def test_an_interrupt_inside_a_priced_tool_is_charged_once_when_it_ends(other, order, mode, gate_at):
    prices = {"ask": 10.0, "b": 5.0}
    runs, starts = RunCounter(), RunCounter()
    fail_b = other == "tool_retry"
    guard, sink = guard_for(prices, 50.0, gate_at=gate_at)
    script = [AIMessage("", tool_calls=[tc("ask", "q0", x="0"), tc("ask", "q1", x="1"), tc("b", "qb")]),
              AIMessage("", tool_calls=[tc("ask", "q9")]), AIMessage("done")]
    agent = create_agent(scripted(script), _asking_tools(runs, starts, fail_b=fail_b),
                         middleware=stack(guard, OTHERS[other](), order), checkpointer=InMemorySaver())
    out = _resume_all(agent, config(True), mode)
    check(guard, out, runs, prices, sink)  # ask: charged per finished run, not per start
    assert runs["ask"] == 3 and starts["ask"] == 6 and runs["b"] == (3 if fail_b else 1)


@pytest.mark.parametrize("mode", MODES)
def test_two_interrupts_in_one_priced_tool_charge_it_once(mode):
    prices = {"ask": 10.0, "b": 5.0}
    runs, starts = RunCounter(), RunCounter()
    guard, sink = guard_for(prices, 50.0)
    script = [AIMessage("", tool_calls=[tc("ask", "q0"), tc("b", "qb")]), AIMessage("done")]
    agent = create_agent(scripted(script), _asking_tools(runs, starts, twice=True), middleware=[guard.middleware()],
                         checkpointer=InMemorySaver())
    out = _resume_all(agent, config(True), mode)
    ledger = check(guard, out, runs, prices, sink)
    assert starts["ask"] == 3 and runs["ask"] == 1 and ledger.spent == 15.0


# ============================================== tools returning Commands
class _NoteState(AgentState):
    notes: NotRequired[Annotated[list, operator.add]]


@pytest.mark.parametrize("ckpt", [False, True])
@pytest.mark.parametrize("mode", MODES)
def test_parallel_commands_without_goto_keep_their_update_and_answer(mode, ckpt):
    prices = {"c": 7.0, "b": 5.0}
    runs = RunCounter()

    def c(x: str, runtime: ToolRuntime) -> Command:
        runs.hit("c")
        return Command(update={"messages": [ToolMessage(f"c did {x}", tool_call_id=runtime.tool_call_id)],
                               "notes": [x]})

    guard, sink = guard_for(prices, 50.0)
    script = [AIMessage("", tool_calls=[tc("c", "k1", x="1"), tc("b", "k2"), tc("c", "k3", x="2")]), AIMessage("done")]
    agent = create_agent(scripted(script), [StructuredTool.from_function(c, name="c", description="c"),
                                            make_tool("b", runs)],
                         middleware=[guard.middleware()], state_schema=_NoteState,
                         checkpointer=InMemorySaver() if ckpt else None)
    out = invoke(agent, USER, mode, config(ckpt))
    check(guard, out, runs, prices, sink)
    assert sorted(out["notes"]) == ["1", "2"]
    assert {m.tool_call_id: m.content for m in out["messages"] if isinstance(m, ToolMessage)} == {
        "k1": "c did 1", "k2": "b ran with 0", "k3": "c did 2"}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("budget", [50.0, 14.0])
def test_a_goto_end_command_beside_blocked_and_refused_calls_leaves_nothing_reserved(budget, order, mode):
    prices = {"stop": 10.0, "b": 5.0}
    runs = RunCounter()

    def stop(x: str, runtime: ToolRuntime) -> Command:
        runs.hit("stop")
        return Command(goto=END, update={"messages": [ToolMessage("stopping", tool_call_id=runtime.tool_call_id)]})

    guard, sink = guard_for(prices, budget)
    script = [AIMessage("", tool_calls=[tc("stop", "s1", x="1"), tc("b", "s2", x="1"), tc("b", "s3", x="2")]),
              AIMessage("done")]
    limit = ToolCallLimitMiddleware(tool_name="b", run_limit=1, exit_behavior="continue")
    agent = create_agent(scripted(script), [StructuredTool.from_function(stop, name="stop", description="stop"),
                                            make_tool("b", runs)],
                         middleware=stack(guard, [limit], order), checkpointer=InMemorySaver())
    out = invoke(agent, USER, mode, config(True))
    check(guard, out, runs, prices, sink)
    assert runs == ({"stop": 1, "b": 1} if budget == 50.0 else {"stop": 1})


# ============================================== parallel tools that raise: the run crashes, then resumes
@pytest.mark.parametrize("tools_kind", ["sync", "async"])
@pytest.mark.parametrize("mode", MODES)
def test_a_crash_in_a_parallel_batch_then_resume_pays_every_run(mode, tools_kind):
    if mode == "sync" and tools_kind == "async":
        pytest.skip("a sync agent cannot run coroutine-only tools")
    prices = {"f": 4.0, "slow": 3.0, "a": 2.0}
    runs, broken = RunCounter(), {"f": True}

    def f(x: str = "0") -> str:
        runs.hit("f")
        if broken["f"]:
            raise RuntimeError("f is down")
        return "f ok"

    async def af(x: str = "0") -> str:
        return f(x)

    async def aslow(x: str = "0") -> str:
        runs.hit("slow")
        await asyncio.sleep(0.3)
        return "slow ok"

    if tools_kind == "async":
        tools = [StructuredTool.from_function(coroutine=af, name="f", description="f"),
                 StructuredTool.from_function(coroutine=aslow, name="slow", description="slow"), make_tool("a", runs)]
    else:
        tools = [StructuredTool.from_function(f, name="f", description="f"), make_tool("slow", runs, delay=0.3),
                 make_tool("a", runs)]
    guard, sink = guard_for(prices, 50.0)
    script = [AIMessage("", tool_calls=[tc("a", "k1"), tc("slow", "k2"), tc("f", "k3")]), AIMessage("done")]
    agent = create_agent(scripted(script), tools, middleware=[guard.middleware()], checkpointer=InMemorySaver())
    cfg = config(True)

    async def run() -> Any:
        call = (lambda i: agent.ainvoke(i, cfg)) if mode == "async" else (lambda i: asyncio.to_thread(agent.invoke, i, cfg))
        with pytest.raises(RuntimeError, match="f is down"):
            await call(USER)
        await asyncio.sleep(0.5)
        mid = guard.ledger(agent.get_state(cfg))
        assert mid.reserved == 0 and mid.spent == pytest.approx(sum(runs[n] * p for n, p in prices.items()))
        broken["f"] = False
        return await call(None)

    out = asyncio.run(run())
    check(guard, out, runs, prices, sink)
    assert runs["f"] == 2 and runs["a"] >= 1  # a sibling the crash cancelled mid-run is paid, and paid again on resume


# ============================================== injected arguments under the probed middleware
def _injected_tools(runs: RunCounter) -> list[Any]:
    @tool
    def inj(x: str, state: Annotated[dict, InjectedState], call_id: Annotated[str, InjectedToolCallId]) -> Command:
        """A tool with injected state and call id that answers with a Command."""
        runs.hit("inj")
        return Command(update={"messages": [ToolMessage(f"inj {x} saw {len(state['messages'])}", tool_call_id=call_id)]})

    @tool
    def rt(x: str, runtime: ToolRuntime) -> str:
        """A tool with a ToolRuntime."""
        runs.hit("rt")
        assert runtime.tool_call_id and runtime.state["messages"]
        return f"rt {x} {runtime.tool_call_id}"

    return [inj, rt]


INJECTED_OTHERS = {
    "clear_tool_inputs": lambda: [ContextEditingMiddleware(edits=[ClearToolUsesEdit(trigger=0, keep=0,
                                                                                    clear_tool_inputs=True)])],
    "emulator_for_other_tools": lambda: [LLMToolEmulator(tools=["zzz"], model=FakeListChatModel(responses=["e"]))],
    "summariser": lambda: [SummarizationMiddleware(FakeListChatModel(responses=["s"] * 30), trigger=("messages", 4),
                                                   keep=("messages", 2))],
}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("other", list(INJECTED_OTHERS))
def test_injected_arguments_work_under_the_probed_middleware(other, order, mode):
    prices = {"inj": 3.0, "rt": 2.0}
    runs = RunCounter()
    guard, sink = guard_for(prices, 50.0)
    script = [AIMessage("", tool_calls=[tc("inj", "i1", x="1"), tc("rt", "i2", x="1"), tc("inj", "i3", x="2")]),
              AIMessage("", tool_calls=[tc("rt", "i4", x="2")]), AIMessage("done")]
    agent = create_agent(scripted(script), _injected_tools(runs), middleware=stack(guard, INJECTED_OTHERS[other](), order),
                         checkpointer=InMemorySaver())
    out = invoke(agent, USER, mode, config(True))
    check(guard, out, runs, prices, sink, history_whole=other != "summariser", calls=script)
    assert runs == {"inj": 2, "rt": 2}
    assert any(isinstance(m, ToolMessage) and m.content == "rt 2 i4" for m in out["messages"])
