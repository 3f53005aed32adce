"""The guard composed with LangChain's own middleware and LangGraph features.

Regression tests for the guard rewrite. Each test asserts the guard's invariants:

* ``ledger.spent == Σ executions × price`` (or the billed amount) ``<= budget``;
* ``ledger.reserved == 0`` once the run is over;
* every proposed tool call gets exactly one ToolMessage answering it (a ToolMessage with
  its id after its AIMessage and before the next AIMessage).

Executions are counted inside the tools themselves (:class:`intent.testing.RunCounter`), never inferred from
the guard's own bookkeeping.
"""

import asyncio
import dataclasses
import functools
from collections import Counter
from typing import Annotated, Any

import pytest
from fakes import ai, call, scripted
from langchain.agents import create_agent
from langchain.agents.middleware import (
    AgentMiddleware,
    AgentState,
    HumanInTheLoopMiddleware,
    ModelCallLimitMiddleware,
    ModelRetryMiddleware,
    ToolCallLimitMiddleware,
    ToolRetryMiddleware,
)
from langchain.tools import InjectedState, InjectedStore, InjectedToolCallId, ToolRuntime
from langchain_core.messages import AIMessage, ToolMessage
from langchain_core.tools import StructuredTool, tool
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.graph import END, START, StateGraph
from langgraph.store.memory import InMemoryStore
from langgraph.types import Command
from typing_extensions import NotRequired, TypedDict

from intent import (  # noqa: F401
    LEDGER_KEY,
    AcceptAll,
    BudgetGuard,
    Decision,
    FromParent,
    GuardState,
    InvalidBillError,
    Market,
    MemoryLogSink,
    Oracle,
    PricedTool,
)
from intent.errors import GuardConfigError
from intent.ledger import BudgetLedger
from intent.testing import (
    ReactiveToolModel,
    RecordingOracle,
    RunCounter,
    assert_each_call_answered_once,
    assert_one_record_per_call,
)

# ====================================================================== helpers
ORDERS = ["guard_first", "guard_last"]


def make_tool(name: str, runs: RunCounter, *, raises: bool = False) -> StructuredTool:
    """A plain tool ``name(x: int = 0)`` that counts its executions; optionally always raises."""

    def fn(x: int = 0) -> str:
        runs.hit(name)
        if raises:
            raise RuntimeError("upstream 503")
        return f"{name} ran with {x}"

    return StructuredTool.from_function(fn, name=name, description=f"Tool {name}.")


def billing_tool(name: str, runs: RunCounter, billed: float, content: str = "done") -> StructuredTool:
    """A tool that reports what the provider billed via the ``intent_billed`` artifact key."""

    def fn(x: int = 0) -> tuple[str, dict[str, Any]]:
        runs.hit(name)
        return content, {"intent_billed": billed}

    return StructuredTool.from_function(fn, name=name, description=f"Tool {name}.",
                                        response_format="content_and_artifact")


def market(**prices: float) -> Market:
    return Market([PricedTool(n, p) for n, p in prices.items()])


def tc(name: str, cid: str, **args: Any) -> dict[str, Any]:
    """A tool call with an explicit id (fakes.call numbers ids itself)."""
    return {"name": name, "args": args, "id": cid, "type": "tool_call"}

class RebuildThenCache(AgentMiddleware):
    """Outside the guard: returns the first reply rebuilt with a new id, then answers the second
    model step itself (no model call, so the guard never sees it) with a call reusing id ``c0``."""

    def __init__(self) -> None:
        super().__init__()
        self.steps = 0

    def wrap_model_call(self, request: Any, handler: Any) -> Any:
        self.steps += 1
        if self.steps == 1:
            msg = handler(request).result[-1]
            return AIMessage(content=msg.content, tool_calls=msg.tool_calls, id="rebuilt-1")
        if self.steps == 2:
            return AIMessage("", tool_calls=[tc("a", "c0", x=1)], id="cached-2")
        return handler(request)



def with_guard(guard: BudgetGuard, other: list[Any] | Any, order: str) -> list[Any]:
    other = other if isinstance(other, list) else [other]
    return [guard.middleware(), *other] if order == "guard_first" else [*other, guard.middleware()]


def msgs_of(out: Any) -> list[Any]:
    return list(out["messages"])


def assert_invariants(guard: BudgetGuard, out: Any, runs: RunCounter, prices: dict[str, float], budget: float,
                      sink: MemoryLogSink | None = None) -> Any:
    """spent == Σ executions × price <= budget, reserved == 0, each call answered once."""
    ledger = guard.ledger(out)
    expected = sum(runs[name] * price for name, price in prices.items())
    assert ledger.reserved == 0, f"a reservation leaked: reserved={ledger.reserved}"
    assert ledger.spent == pytest.approx(expected), (
        f"spent {ledger.spent} but the tools ran {dict(runs)} at {prices} = {expected}")
    assert ledger.spent <= budget + 1e-9
    assert ledger.budget == budget
    assert ledger.remaining == pytest.approx(budget - ledger.spent)
    assert_each_call_answered_once(msgs_of(out))
    if sink is not None:
        assert sum(r.charged for r in sink.records) == pytest.approx(ledger.spent)
        assert_one_record_per_call(msgs_of(out), sink.records)
    return ledger


def executions(sink: MemoryLogSink, call_id: str | None = None) -> list[Any]:
    """The log records of real executions (``execution > 0``), optionally of one call."""
    return [r for r in sink.records if r.decision == "accept" and r.execution > 0
            and (call_id is None or r.call_id == call_id)]


def tool_message(out: Any, call_id: str) -> ToolMessage:
    found = [m for m in msgs_of(out) if isinstance(m, ToolMessage) and m.tool_call_id == call_id]
    assert len(found) == 1, f"{len(found)} ToolMessages for {call_id!r}"
    return found[0]


USER = {"messages": [("user", "go")]}


def gave_up(exc: Exception) -> str:
    return f"gave up: {exc}"


def retry() -> ToolRetryMiddleware:
    return ToolRetryMiddleware(max_retries=3, initial_delay=0, jitter=False, on_failure=gave_up)


# ============================================= row 1: ToolRetryMiddleware
def _retry_case(order: str, budget: float):
    runs, sink = RunCounter(), MemoryLogSink()
    guard = BudgetGuard(AcceptAll(), market(a=20.0), budget, log_sink=sink)
    c = call("a", x=1)
    agent = create_agent(scripted([ai(c), AIMessage("done")]), [make_tool("a", runs, raises=True)],
                         middleware=with_guard(guard, retry(), order))
    return guard, runs, sink, c, agent


def _check_retry_case(guard, runs, sink, c, out, budget):
    if budget == 30:
        # the first execution is charged; the retry (20 more) does not fit in the 10 left
        assert runs["a"] == 1
        assert guard.ledger(out).spent == 20
        msg = tool_message(out, c["id"])
        assert msg.status == "error"
        assert not str(msg.content).startswith("gave up"), (
            f"the refused retry should answer the call with the guard's refusal, got {msg.content!r}")
        assert any(r.decision == "reject" and r.call_id == c["id"] and r.charged == 0 for r in sink.records), (
            "the retry should reach the guard and be refused (a 'reject' record for the call, charged 0); "
            f"records: {[(r.decision, r.charged) for r in sink.records]}")
    else:
        # 1 execution + 3 retries, each one charged
        assert runs["a"] == 4
        assert guard.ledger(out).spent == 80
        assert tool_message(out, c["id"]).content == "gave up: upstream 503"
    execs = executions(sink, c["id"])
    assert [r.execution for r in execs] == list(range(1, runs["a"] + 1))
    assert all(r.charged == 20 for r in execs)
    assert_invariants(guard, out, runs, {"a": 20.0}, budget, sink)


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("budget", [30, 100])
def test_retry_middleware_each_execution_is_gated_and_charged(order, budget):
    guard, runs, sink, c, agent = _retry_case(order, budget)
    out = agent.invoke(USER)
    _check_retry_case(guard, runs, sink, c, out, budget)


def test_tool_errors_raise_reraises_the_tools_exception_after_charging():
    runs, sink = RunCounter(), MemoryLogSink()
    guard = BudgetGuard(AcceptAll(), market(a=20.0), 100, log_sink=sink)  # tool_errors="raise" is the default
    agent = create_agent(scripted([ai(call("a")), AIMessage("done")]), [make_tool("a", runs, raises=True)],
                         middleware=[guard.middleware()])
    with pytest.raises(RuntimeError, match="upstream 503"):
        agent.invoke(USER)
    assert runs["a"] == 1
    assert [(r.charged, r.execution) for r in executions(sink)] == [(20, 1)]


def test_tool_errors_message_turns_the_exception_into_a_charged_error_message():
    runs, sink = RunCounter(), MemoryLogSink()
    guard = BudgetGuard(AcceptAll(), market(a=20.0), 100, log_sink=sink, tool_errors="message")
    c = call("a")
    agent = create_agent(scripted([ai(c), AIMessage("done")]), [make_tool("a", runs, raises=True)],
                         middleware=[guard.middleware()])
    out = agent.invoke(USER)
    assert tool_message(out, c["id"]).status == "error"
    assert runs["a"] == 1
    assert_invariants(guard, out, runs, {"a": 20.0}, 100, sink)


# ========================================== row 2: duplicate ids in one message
def test_duplicate_call_ids_in_one_message_are_each_answered_once():
    runs, sink = RunCounter(), MemoryLogSink()
    guard = BudgetGuard(AcceptAll(), market(a=20.0), 30, log_sink=sink)
    agent = create_agent(scripted([ai(tc("a", "dup", x=1), tc("a", "dup", x=2)), AIMessage("done")]),
                         [make_tool("a", runs)], middleware=[guard.middleware()])
    out = agent.invoke(USER)
    first_ai = next(m for m in msgs_of(out) if isinstance(m, AIMessage))
    assert len(first_ai.tool_calls) == 2, "both proposed calls stay in the AIMessage (the guard may rename one id)"
    assert runs["a"] == 1, "the first 'dup' call runs, the second is refused (20 + 20 > 30)"
    assert guard.ledger(out).spent == 20
    assert_invariants(guard, out, runs, {"a": 20.0}, 30, sink)


# ================================== row 3: an id reused in a later message
def test_call_id_reused_in_a_later_message_runs_and_is_charged_again():
    runs, sink = RunCounter(), MemoryLogSink()
    guard = BudgetGuard(AcceptAll(), market(a=20.0, b=7.0), 100, log_sink=sink)
    agent = create_agent(scripted([ai(tc("a", "call_0")), ai(tc("b", "call_0")), AIMessage("done")]),
                         [make_tool("a", runs), make_tool("b", runs)], middleware=[guard.middleware()])
    out = agent.invoke(USER)
    assert (runs["a"], runs["b"]) == (1, 1), "b reuses a's id in a later message and must still run"
    messages = msgs_of(out)
    second_ai = [i for i, m in enumerate(messages) if isinstance(m, AIMessage)][1]
    b_answer = [m for m in messages[second_ai + 1:] if isinstance(m, ToolMessage)]
    assert len(b_answer) == 1 and b_answer[0].content == "b ran with 0", (
        "b gets its own fresh ToolMessage after the second AIMessage, not a's cached result")
    assert sorted((r.tool, r.charged) for r in executions(sink)) == [("a", 20), ("b", 7)]
    assert guard.ledger(out).spent == 27
    assert_invariants(guard, out, runs, {"a": 20.0, "b": 7.0}, 100, sink)


# =============================================== row 4: ToolCallLimitMiddleware
def _limit_case(order: str, budget: float, gate_at: str = "auto"):
    runs, sink = RunCounter(), MemoryLogSink()
    guard = BudgetGuard(AcceptAll(), market(a=20.0), budget, log_sink=sink, gate_at=gate_at)
    limiter = ToolCallLimitMiddleware(run_limit=1, exit_behavior="continue")
    agent = create_agent(scripted([ai(call("a", x=1), call("a", x=2)), AIMessage("done")]),
                         [make_tool("a", runs)], middleware=with_guard(guard, limiter, order))
    return guard, runs, sink, agent


def _check_limit_case(guard, runs, sink, out, budget):
    assert runs["a"] == 1, "the limiter lets one call through"
    ledger = assert_invariants(guard, out, runs, {"a": 20.0}, budget, sink)
    assert ledger.spent == 20 and ledger.remaining == budget - 20


@pytest.mark.parametrize("gate_at", ["model_call", "after_model"])
@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("budget", [100, 30])
def test_tool_call_limit_blocked_call_keeps_no_reservation(order, budget, gate_at):
    # With the gate in an after_model hook and the guard listed first, the limit answers the
    # blocked call before the gate sees it: logged as "answered", never reserved.
    guard, runs, sink, agent = _limit_case(order, budget, gate_at)
    out = agent.invoke(USER)
    _check_limit_case(guard, runs, sink, out, budget)
    answered = [r for r in sink.records if r.decision == "answered"]
    assert len(answered) == (1 if (gate_at, order) == ("after_model", "guard_first") else 0)


# ============================================ row 5: HumanInTheLoopMiddleware
def _hitl_case(order: str, budget: float, thread: str):
    runs, sink = RunCounter(), MemoryLogSink()
    guard = BudgetGuard(AcceptAll(), market(a=20.0, b=50.0), budget, log_sink=sink)
    c = call("a", x=1)
    agent = create_agent(scripted([ai(c), AIMessage("done")]), [make_tool("a", runs), make_tool("b", runs)],
                         middleware=with_guard(guard, HumanInTheLoopMiddleware(interrupt_on={"a": True}), order),
                         checkpointer=InMemorySaver())
    config = {"configurable": {"thread_id": thread}}
    first = agent.invoke(USER, config)
    assert "__interrupt__" in first, "the human-in-the-loop middleware should pause before a runs"
    assert runs.total() == 0
    return guard, runs, sink, c, agent, config


@pytest.mark.parametrize("order", ORDERS)
def test_hitl_reject_releases_the_reservation(order):
    guard, runs, sink, c, agent, config = _hitl_case(order, 100, f"hitl-reject-{order}")
    out = agent.invoke(Command(resume={"decisions": [{"type": "reject", "message": "no"}]}), config)
    assert runs.total() == 0
    assert "no" in tool_message(out, c["id"]).content
    ledger = assert_invariants(guard, out, runs, {"a": 20.0, "b": 50.0}, 100, sink)
    assert ledger.spent == 0 and ledger.reserved == 0


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("budget", [60, 40])
def test_hitl_edit_to_a_pricier_tool_is_repriced(order, budget):
    guard, runs, sink, c, agent, config = _hitl_case(order, budget, f"hitl-edit-{order}-{budget}")
    edit = {"type": "edit", "edited_action": {"name": "b", "args": {"x": 2}}}
    out = agent.invoke(Command(resume={"decisions": [edit]}), config)
    assert runs["a"] == 0
    if budget == 60:  # b (50) fits: charged at b's price, not a's 20
        assert runs["b"] == 1
        assert guard.ledger(out).spent == 50, "the edited call runs b and is charged b's price 50, not a's 20"
        assert [r.charged for r in executions(sink)] == [50]
    else:  # b (50) does not fit in 40: refused, not run, nothing charged
        assert runs["b"] == 0, "b costs 50 and the budget is 40: the edited call must be refused"
        assert guard.ledger(out).spent == 0
        assert tool_message(out, c["id"]).status == "error"
    assert_invariants(guard, out, runs, {"a": 20.0, "b": 50.0}, budget, sink)


class RefusesToolB:
    """An oracle with a reason of its own (not the budget): it never lets tool b run."""

    def decide(self, ctx: Any) -> Decision:
        if ctx.tool == "b":
            return Decision.rejected("b is not wanted for this task", reason="not_wanted")
        return Decision.accepted()


def _run_then_resume(agent: Any, config: dict[str, Any], resume: Command, use_async: bool) -> Any:
    """Run until the reviewer is asked, then resume with ``resume``; the final state."""
    async def drive() -> Any:
        await agent.ainvoke(USER, config)
        return await agent.ainvoke(resume, config)

    if use_async:
        return asyncio.run(drive())
    agent.invoke(USER, config)
    return agent.invoke(resume, config)


@pytest.mark.parametrize("use_async", [False, True])
@pytest.mark.parametrize("order", ORDERS)
def test_hitl_edit_is_regated_and_the_oracle_can_refuse_it_for_its_own_reason(order, use_async):
    runs, sink = RunCounter(), MemoryLogSink()
    guard = BudgetGuard(RefusesToolB(), market(a=20.0, b=5.0), 100, log_sink=sink)
    c = call("a", x=1)
    agent = create_agent(scripted([ai(c), AIMessage("done")]), [make_tool("a", runs), make_tool("b", runs)],
                         middleware=with_guard(guard, HumanInTheLoopMiddleware(interrupt_on={"a": True}), order),
                         checkpointer=InMemorySaver())
    config = {"configurable": {"thread_id": f"hitl-regate-{order}-{use_async}"}}
    resume = Command(resume={"decisions": [{"type": "edit", "edited_action": {"name": "b", "args": {"x": 2}}}]})

    out = _run_then_resume(agent, config, resume, use_async)
    assert runs.total() == 0, "the reviewer turned a into b, which the oracle refuses: nothing may run"
    message = tool_message(out, c["id"])
    assert message.status == "error" and "not wanted" in message.content
    assert [r.reason for r in sink.records if r.decision == "reject"] == ["not_wanted"]
    assert_invariants(guard, out, runs, {"a": 20.0, "b": 5.0}, 100, sink)


@pytest.mark.parametrize("use_async", [False, True])
def test_a_call_a_reviewer_edited_before_the_gate_is_not_merged_with_its_old_twin(use_async):
    # gate_at="after_model", the guard listed first: the reviewer acts before the gate. The model proposes
    # a(x=1) twice; the reviewer edits the first to a(x=2) and approves the second. HumanInTheLoopMiddleware
    # keeps the edit in state and runs it at the tool step, so both calls must run (the gate merged the
    # approved twin into the edited call by the message's arguments: it never ran).
    runs, sink = RunCounter(), MemoryLogSink()
    guard = BudgetGuard(AcceptAll(), market(a=5.0), 100, log_sink=sink, gate_at="after_model")
    first, twin = call("a", x=1), call("a", x=1)
    agent = create_agent(scripted([ai(first, twin), AIMessage("done")]), [make_tool("a", runs)],
                         middleware=[guard.middleware(), HumanInTheLoopMiddleware(interrupt_on={"a": True})],
                         checkpointer=InMemorySaver())
    config = {"configurable": {"thread_id": f"hitl-edit-twin-{use_async}"}}
    resume = Command(resume={"decisions": [{"type": "edit", "edited_action": {"name": "a", "args": {"x": 2}}},
                                           {"type": "approve"}]})

    out = _run_then_resume(agent, config, resume, use_async)
    assert runs["a"] == 2, "the edited call and its approved twin both run"
    assert "a ran with 1" in tool_message(out, twin["id"]).content
    assert_invariants(guard, out, runs, {"a": 5.0}, 100, sink)


# ======================================================= row 6: injected args
def _injected_tools(runs: RunCounter) -> list[Any]:
    @tool
    def with_runtime(x: int, runtime: ToolRuntime) -> str:
        """Uses the tool runtime."""
        runs.hit("with_runtime")
        return f"runtime:{runtime.tool_call_id}"

    @tool
    def with_state(x: int, state: Annotated[dict, InjectedState]) -> str:
        """Uses the graph state."""
        runs.hit("with_state")
        return f"state:{len(state['messages'])}"

    @tool
    def with_store(x: int, store: Annotated[Any, InjectedStore()]) -> str:
        """Uses the store."""
        runs.hit("with_store")
        store.put(("ns",), "k", {"x": x})
        return "store:ok"

    @tool
    def with_call_id(x: int, tool_call_id: Annotated[str, InjectedToolCallId]) -> str:
        """Uses its own tool call id."""
        runs.hit("with_call_id")
        return f"id:{tool_call_id}"

    return [with_runtime, with_state, with_store, with_call_id]


def test_tools_with_injected_arguments_run_and_are_charged():
    runs, sink = RunCounter(), MemoryLogSink()
    prices = {"with_runtime": 1.0, "with_state": 2.0, "with_store": 3.0, "with_call_id": 4.0}
    guard = BudgetGuard(AcceptAll(), market(**prices), 100, log_sink=sink)
    calls = [call(name, x=1) for name in prices]
    store = InMemoryStore()
    agent = create_agent(scripted([ai(*calls), AIMessage("done")]), _injected_tools(runs),
                         middleware=[guard.middleware()], store=store)
    out = agent.invoke(USER)
    assert dict(runs) == {name: 1 for name in prices}, [
        m.content for m in msgs_of(out) if isinstance(m, ToolMessage)]
    by_name = {c["name"]: c["id"] for c in calls}
    assert tool_message(out, by_name["with_runtime"]).content == f"runtime:{by_name['with_runtime']}"
    assert tool_message(out, by_name["with_call_id"]).content == f"id:{by_name['with_call_id']}"
    assert tool_message(out, by_name["with_state"]).content.startswith("state:")
    assert store.get(("ns",), "k").value == {"x": 1}
    assert guard.ledger(out).spent == 10
    assert sorted(r.charged for r in executions(sink)) == [1, 2, 3, 4]
    assert_invariants(guard, out, runs, prices, 100, sink)


# ================================================ row 7: Command.PARENT handoff
def test_handoff_command_to_parent_graph_reaches_the_target_and_is_charged():
    runs, sink = RunCounter(), MemoryLogSink()
    guard = BudgetGuard(AcceptAll(), market(handoff=5.0), 100, log_sink=sink)

    @tool
    def handoff(tool_call_id: Annotated[str, InjectedToolCallId]) -> Command:
        """Hand the conversation over to the other agent."""
        runs.hit("handoff")
        return Command(goto="other", graph=Command.PARENT,
                       update={"messages": [ToolMessage("handed off", tool_call_id=tool_call_id)]})

    agent = create_agent(scripted([ai(call("handoff")), AIMessage("not handed off")]), [handoff],
                         middleware=[guard.middleware()])
    reached: list[str] = []

    def other(state: GuardState) -> dict[str, Any]:
        reached.append("other")
        return {"messages": [AIMessage("other agent here")]}

    parent = StateGraph(GuardState)
    parent.add_node("agent", agent)
    parent.add_node("other", other)
    parent.add_edge(START, "agent")
    parent.add_edge("agent", END)
    parent.add_edge("other", END)
    out = parent.compile().invoke(USER)
    assert reached == ["other"], "the parent graph should follow the tool's Command(goto='other', graph=PARENT)"
    assert out["messages"][-1].content == "other agent here"
    assert runs["handoff"] == 1
    charged = [r for r in sink.records if r.charged]
    assert len(charged) == 1 and charged[0].charged == 5.0 and charged[0].tool == "handoff"


def _handing_off_graph() -> Any:
    """A graph a tool's body runs, whose node hands control to the graph above it (the guarded agent's
    tool step) with ``Command(graph=Command.PARENT)``: LangGraph raises it out of the tool as a
    ``ParentCommand``, which the agent's tool step then applies as its own output."""

    class Inner(TypedDict):
        tool_call_id: str

    inner = StateGraph(Inner)
    inner.add_node("n", lambda s: Command(graph=Command.PARENT, goto="model", update={
        "messages": [ToolMessage("handed back", tool_call_id=s["tool_call_id"])]}))
    inner.add_edge(START, "n")
    return inner.compile()


@pytest.mark.parametrize("sync", [True, False])
def test_a_handoff_raised_out_of_the_tool_body_is_charged_and_keeps_the_budget(sync):
    # The body did its (paid) work, then a graph it ran handed control back: the run happened. It was
    # taken for an interrupt (the run would re-run on resume) and released: 2 runs of 5 on a budget of 6,
    # ledger spent 0.
    runs, sink = RunCounter(), MemoryLogSink()
    guard = BudgetGuard(AcceptAll(), market(handoff=5.0), 6.0, log_sink=sink)
    inner = _handing_off_graph()

    def handoff(x: int, tool_call_id: Annotated[str, InjectedToolCallId]) -> str:
        runs.hit("handoff")
        inner.invoke({"tool_call_id": tool_call_id})
        return "never reached"

    async def ahandoff(x: int, tool_call_id: Annotated[str, InjectedToolCallId]) -> str:
        runs.hit("handoff")
        await inner.ainvoke({"tool_call_id": tool_call_id})
        return "never reached"

    tool_ = (StructuredTool.from_function(handoff, name="handoff", description="hand off") if sync else
             StructuredTool.from_function(coroutine=ahandoff, name="handoff", description="hand off"))
    agent = create_agent(scripted([ai(tc("handoff", "h1", x=1)), ai(tc("handoff", "h2", x=2)), AIMessage("done")]),
                         [tool_], middleware=[guard.middleware()])
    out = agent.invoke(USER) if sync else asyncio.run(agent.ainvoke(USER))
    assert runs["handoff"] == 1, "the second handoff (5 more on a budget of 6 with 5 spent) must not run"
    assert tool_message(out, "h1").content.startswith("handed back")
    assert tool_message(out, "h2").status == "error"
    assert [r.charged for r in executions(sink)] == [5.0]
    assert_invariants(guard, out, runs, {"handoff": 5.0}, 6.0, sink)


@pytest.mark.parametrize("sync", [True, False])
def test_a_sub_agent_that_hands_off_out_of_a_guarded_call_keeps_what_it_spent(sync):
    # A FromParent sub-agent inside the call spends (b: 3), then its transfer tool (0.5) hands control to
    # the outer agent's tool step: the sub-agent never ends its episode. Its carve was released as
    # unused and the call itself was not charged: 8.5 run, 0 spent.
    runs, sink = RunCounter(), MemoryLogSink()
    prices = {"handoff": 5.0, "b": 3.0, "transfer": 0.5}
    outer_call: dict[str, str] = {}

    def transfer(tool_call_id: Annotated[str, InjectedToolCallId]) -> Command:
        """Hand back."""
        runs.hit("transfer")
        return Command(graph=Command.PARENT, goto="model", update={
            "messages": [ToolMessage("back", tool_call_id=outer_call["id"], name="handoff")]})

    child_guard = BudgetGuard(AcceptAll(), market(**prices), FromParent(limit=10.0))
    child = create_agent(scripted([ai(tc("b", "b1")), ai(tc("transfer", "x1")), AIMessage("never reached")]),
                         [make_tool("b", runs), StructuredTool.from_function(transfer, name="transfer",
                                                                             description="hand back")],
                         middleware=[child_guard.middleware()])

    def handoff(q: str, tool_call_id: Annotated[str, InjectedToolCallId]) -> str:
        runs.hit("handoff")
        outer_call["id"] = tool_call_id
        child.invoke({"messages": [("user", q)]})
        return "never reached"

    async def ahandoff(q: str, tool_call_id: Annotated[str, InjectedToolCallId]) -> str:
        runs.hit("handoff")
        outer_call["id"] = tool_call_id
        await child.ainvoke({"messages": [("user", q)]})
        return "never reached"

    guard = BudgetGuard(AcceptAll(), market(**prices), 100.0, log_sink=sink)
    tool_ = (StructuredTool.from_function(handoff, name="handoff", description="delegate") if sync else
             StructuredTool.from_function(coroutine=ahandoff, name="handoff", description="delegate"))
    agent = create_agent(scripted([ai(tc("handoff", "d1", q="x")), AIMessage("done")]), [tool_],
                         middleware=[guard.middleware()])
    out = agent.invoke(USER) if sync else asyncio.run(agent.ainvoke(USER))
    assert dict(runs) == {"handoff": 1, "b": 1, "transfer": 1}
    assert tool_message(out, "d1").content.startswith("back")
    assert_invariants(guard, out, runs, prices, 100.0)


@pytest.mark.parametrize("sync", [True, False])
def test_a_tool_returning_a_list_of_command_and_message_keeps_both_and_its_bill(sync):
    # ToolNode takes a list of Commands and ToolMessages with one message answering the call. The guard
    # answered with str(list): the Command's update was lost and the reported bill (0.5) ignored.
    class NoteState(AgentState):
        note: NotRequired[str]

    def multi(x: int, tool_call_id: Annotated[str, InjectedToolCallId]) -> list[Any]:
        return [Command(update={"note": "set by the tool"}),
                ToolMessage("multi ok", tool_call_id=tool_call_id, name="multi", artifact={"intent_billed": 0.5})]

    async def amulti(x: int, tool_call_id: Annotated[str, InjectedToolCallId]) -> list[Any]:
        return multi(x, tool_call_id)

    sink = MemoryLogSink()
    guard = BudgetGuard(AcceptAll(), market(multi=2.0), 10.0, log_sink=sink)
    tool_ = (StructuredTool.from_function(multi, name="multi", description="m") if sync else
             StructuredTool.from_function(coroutine=amulti, name="multi", description="m"))
    agent = create_agent(scripted([ai(tc("multi", "m1", x=1)), AIMessage("done")]), [tool_],
                         middleware=[guard.middleware()], state_schema=NoteState)
    out = agent.invoke(USER) if sync else asyncio.run(agent.ainvoke(USER))
    assert out.get("note") == "set by the tool"
    assert tool_message(out, "m1").content == "multi ok"
    ledger = guard.ledger(out)
    assert (ledger.spent, ledger.reserved) == (0.5, 0.0)
    assert [r.charged for r in executions(sink)] == [0.5]


def _one_call(fn: Any, *, sync: bool, price: float = 5.0, budget: float = 10.0, **agent: Any) -> tuple[Any, Any]:
    """The guard and the final state of an agent that calls tool ``t`` (``fn``, or an async twin of it) once."""

    @functools.wraps(fn)  # the same arguments, so the same schema the model sees
    async def afn(*args: Any, **kwargs: Any) -> Any:
        return fn(*args, **kwargs)

    guard = BudgetGuard(AcceptAll(), market(t=price), budget)
    tool_ = (StructuredTool.from_function(fn, name="t", description="t") if sync else
             StructuredTool.from_function(coroutine=afn, name="t", description="t"))
    graph = create_agent(scripted([ai(tc("t", "c1", x=1)), AIMessage("done")]), [tool_],
                         middleware=[guard.middleware()], **agent)
    return guard, graph.invoke(USER) if sync else asyncio.run(graph.ainvoke(USER))


@pytest.mark.parametrize("sync", [True, False])
def test_a_bill_in_a_message_given_as_a_dict_is_what_the_run_costs(sync):
    # LangGraph takes a message in dict form in a Command's update; its bill (0: the provider did not bill the
    # failed call) was not read, and the quote was charged.
    def billed(x: int, tool_call_id: Annotated[str, InjectedToolCallId]) -> Command:
        return Command(update={"messages": [{"role": "tool", "content": "failed, not billed",
                                             "tool_call_id": tool_call_id, "artifact": {"intent_billed": 0.0}}]})

    guard, out = _one_call(billed, sync=sync)
    assert tool_message(out, "c1").content.startswith("failed, not billed")
    ledger = guard.ledger(out)
    assert (ledger.spent, ledger.reserved) == (0.0, 0.0)


@dataclasses.dataclass
class _MessagesUpdate:
    messages: list[Any]


@pytest.mark.parametrize("sync", [True, False])
@pytest.mark.parametrize("shape", ["returned_object", "raised_pairs"])
def test_a_command_whose_update_is_not_a_dict_keeps_its_update_and_answer(shape, sync):
    # LangGraph applies an update given as an annotated object or as (key, value) pairs. The guard rebuilt
    # the command with a dict of its own charges only: the answer was lost, the call left unanswered.
    runs = RunCounter()

    class Inner(TypedDict):
        tool_call_id: str

    inner = StateGraph(Inner)
    inner.add_node("n", lambda s: Command(graph=Command.PARENT, goto="model", update=[
        ("messages", [ToolMessage("handed back", tool_call_id=s["tool_call_id"])])]))
    inner.add_edge(START, "n")
    handing_back = inner.compile()

    def t(x: int, tool_call_id: Annotated[str, InjectedToolCallId]) -> Any:
        runs.hit("t")
        if shape == "returned_object":
            return Command(update=_MessagesUpdate([ToolMessage("answered", tool_call_id=tool_call_id)]))
        handing_back.invoke({"tool_call_id": tool_call_id})
        return "never reached"

    guard, out = _one_call(t, sync=sync)
    expected = "answered" if shape == "returned_object" else "handed back"
    assert tool_message(out, "c1").content.startswith(expected)
    assert_invariants(guard, out, runs, {"t": 5.0}, 10.0)


def test_two_messages_a_command_gives_for_its_call_both_reach_the_history():
    # Only the first answers the call (and gets the oracle's note); the second was replaced by the first.
    def t(x: int, tool_call_id: Annotated[str, InjectedToolCallId]) -> Command:
        return Command(update={"messages": [ToolMessage("one", tool_call_id=tool_call_id),
                                            ToolMessage("two", tool_call_id=tool_call_id)]})

    guard = BudgetGuard(AcceptAll(), market(t=5.0), 10.0)
    agent = create_agent(scripted([ai(tc("t", "c1", x=1)), AIMessage("done")]),
                         [StructuredTool.from_function(t, name="t", description="t")], middleware=[guard.middleware()])
    out = agent.invoke(USER)
    answers = [m.content for m in msgs_of(out) if isinstance(m, ToolMessage)]
    assert answers == ["one", "two"]
    assert guard.ledger(out).spent == 5.0


# ======================================================== row 8: re-pricing
class Repricer(AgentMiddleware):
    """Changes the price of a tool between the gate and the execution."""

    name = "TestRepricer"

    def __init__(self, guard: BudgetGuard, tool_name: str, price: float) -> None:
        super().__init__()
        self.guard, self.tool_name, self.price = guard, tool_name, price

    def _reprice(self) -> None:
        self.guard.update_market(lambda m: m.with_price(self.tool_name, self.price))

    def wrap_tool_call(self, request: Any, handler: Any) -> Any:
        self._reprice()
        return handler(request)

    async def awrap_tool_call(self, request: Any, handler: Any) -> Any:
        self._reprice()
        return await handler(request)


@pytest.mark.parametrize("order", ORDERS)
def test_price_change_between_gate_and_execution_charges_the_new_price(order):
    runs, sink = RunCounter(), MemoryLogSink()
    guard = BudgetGuard(AcceptAll(), market(a=10.0), 40, log_sink=sink)
    agent = create_agent(scripted([ai(call("a", x=1), call("a", x=2)), AIMessage("done")]), [make_tool("a", runs)],
                         middleware=with_guard(guard, Repricer(guard, "a", 25.0), order))
    out = agent.invoke(USER)
    # both gated at 10 (20 <= 40); at execution each costs 25: one fits, 25 + 25 > 40 does not
    assert runs["a"] == 1, "the second call at the new price 25 does not fit (25 + 25 > 40) and must not run"
    assert guard.ledger(out).spent == 25
    assert [r.charged for r in executions(sink)] == [25]
    assert_invariants(guard, out, runs, {"a": 25.0}, 40, sink)


def test_tool_that_reports_a_zero_bill_on_failure_is_charged_nothing():
    runs, sink = RunCounter(), MemoryLogSink()
    guard = BudgetGuard(AcceptAll(), market(a=20.0), 100, log_sink=sink)
    c = call("a")
    agent = create_agent(scripted([ai(c), AIMessage("done")]), [billing_tool("a", runs, 0.0, "quota error")],
                         middleware=[guard.middleware()])
    out = agent.invoke(USER)
    assert runs["a"] == 1
    ledger = guard.ledger(out)
    assert ledger.spent == 0 and ledger.reserved == 0 and ledger.remaining == 100
    assert [r.charged for r in executions(sink)] == [0]
    assert sum(r.charged for r in sink.records) == 0
    assert_each_call_answered_once(msgs_of(out))


class _ProviderError(RuntimeError):
    def __init__(self, billed: Any) -> None:
        super().__init__("provider error")
        self.intent_billed = billed


@pytest.mark.parametrize(("billed", "charged"), [(0.0, 0.0), (7, 7.0), (None, 20.0)])
def test_a_tool_that_raises_can_report_its_bill_on_the_exception(billed: Any, charged: float):
    runs, sink = RunCounter(), MemoryLogSink()
    guard = BudgetGuard(AcceptAll(), market(a=20.0), 100, log_sink=sink, tool_errors="message")

    def fn(x: int = 0) -> str:
        runs.hit("a")
        raise _ProviderError(billed) if billed is not None else RuntimeError("no bill reported")

    tool_a = StructuredTool.from_function(fn, name="a", description="Tool a.")
    agent = create_agent(scripted([ai(call("a")), AIMessage("done")]), [tool_a], middleware=[guard.middleware()])
    out = agent.invoke(USER)
    assert runs["a"] == 1
    ledger = guard.ledger(out)
    assert ledger.spent == charged and ledger.reserved == 0  # no bill reported: the quote
    assert [r.charged for r in executions(sink)] == [charged]
    assert_each_call_answered_once(msgs_of(out))


@pytest.mark.parametrize("body", ["sync", "async", "both"])
@pytest.mark.parametrize("use_async", [False, True])
@pytest.mark.parametrize(("billed", "charged"), [(0.0, 0.0), (7, 7.0), (None, 20.0)])
def test_a_bill_on_a_tool_exception_langchain_handles_is_what_the_run_costs(billed, charged, use_async, body):
    # handle_tool_error=True: LangChain answers the ToolException with a message, without the exception. The
    # bill on it is still what the run is charged (was: the quote, 20; a tool with both bodies under a sync
    # agent was charged the quote after that, its sync body not watched).
    from langchain_core.tools import ToolException

    if body == "async" and not use_async:
        pytest.skip("an async-only tool runs only under an async agent")
    runs, sink = RunCounter(), MemoryLogSink()
    guard = BudgetGuard(AcceptAll(), market(a=20.0), 100, log_sink=sink)

    def fail() -> None:
        runs.hit("a")
        exc = ToolException("provider error")
        if billed is not None:
            exc.intent_billed = billed
        raise exc

    async def afn(x: int = 0) -> str:
        fail()
        return "never"

    def fn(x: int = 0) -> str:
        fail()
        return "never"

    bodies = {"sync": {"func": fn}, "async": {"coroutine": afn}, "both": {"func": fn, "coroutine": afn}}[body]
    tool_a = StructuredTool.from_function(**bodies, name="a", description="Tool a.", handle_tool_error=True)
    agent = create_agent(scripted([ai(call("a")), AIMessage("done")]), [tool_a], middleware=[guard.middleware()])
    out = asyncio.run(agent.ainvoke(USER)) if use_async else agent.invoke(USER)
    assert runs["a"] == 1 and "provider error" in msgs_of(out)[2].content
    ledger = guard.ledger(out)
    assert ledger.spent == charged and ledger.reserved == 0
    assert [(r.charged, r.status) for r in executions(sink)] == [(charged, "error")]


@pytest.mark.parametrize("use_async", [False, True])
@pytest.mark.parametrize("kept_in", ["field", "slots"])
def test_a_tool_that_keeps_state_on_itself_keeps_it_when_the_guard_watches_its_body(kept_in, use_async):
    # The guard runs a copy of a handle_tool_error tool (sync and async) and of any tool under an async agent
    # (intent.tool_body). What a run sets on the tool is set on the tool (was: on the copy: 'call 1' twice),
    # in a field or in __slots__ of the tool's class, which model_copy does not copy (was: AttributeError on
    # the copy, the call never answered).
    from langchain_core.tools import BaseTool

    class Counter(BaseTool):
        name: str = "count"
        description: str = "Counts its calls."
        handle_tool_error: bool = True
        calls: int = 0

        def _run(self, x: int = 0) -> str:
            self.calls += 1
            return f"call {self.calls}"

    class SlotCounter(BaseTool):
        __slots__ = ("calls", "_SlotCounter__unset")
        name: str = "count"
        description: str = "Counts its calls."
        handle_tool_error: bool = True

        def __init__(self) -> None:
            super().__init__()
            object.__setattr__(self, "calls", 0)

        def _run(self, x: int = 0) -> str:
            object.__setattr__(self, "calls", self.calls + 1)
            return f"call {self.calls}"

    tool = Counter() if kept_in == "field" else SlotCounter()
    guard = BudgetGuard(AcceptAll(), market(count=1.0), 100)
    agent = create_agent(scripted([ai(call("count", x=1)), ai(call("count", x=2)), AIMessage("done")]), [tool],
                         middleware=[guard.middleware()])
    out = asyncio.run(agent.ainvoke(USER)) if use_async else agent.invoke(USER)
    assert [m.content for m in msgs_of(out) if m.type == "tool"] == ["call 1", "call 2"] and tool.calls == 2
    assert guard.ledger(out).spent == 2.0 and guard.ledger(out).reserved == 0


@pytest.mark.parametrize("tool_errors", ["raise", "message"])
@pytest.mark.parametrize("bad", ["free", -1.0, True])
def test_a_malformed_bill_on_an_exception_is_charged_at_the_quote_and_fails_loudly(bad: Any, tool_errors: str):
    # A bug in the tool: never turned into an error message for the agent, even with
    # tool_errors="message", and the run is charged at its quote, not forgotten.
    runs, sink = RunCounter(), MemoryLogSink()
    guard = BudgetGuard(AcceptAll(), market(a=20.0), 100, log_sink=sink, tool_errors=tool_errors)

    def fn(x: int = 0) -> str:
        runs.hit("a")
        raise _ProviderError(bad)

    tool_a = StructuredTool.from_function(fn, name="a", description="Tool a.")
    agent = create_agent(scripted([ai(call("a")), AIMessage("done")]), [tool_a], middleware=[guard.middleware()],
                         checkpointer=InMemorySaver())
    config = {"configurable": {"thread_id": f"bad-bill-{bad!r}-{tool_errors}"}}
    with pytest.raises(InvalidBillError, match="intent_billed") as raised:
        agent.invoke(USER, config)
    assert isinstance(raised.value.__cause__, _ProviderError)  # the tool's own error stays attached
    assert runs["a"] == 1
    assert [r.charged for r in executions(sink)] == [20]


def test_bill_above_the_price_is_an_overrun_and_refuses_further_calls():
    runs, sink = RunCounter(), MemoryLogSink()
    guard = BudgetGuard(AcceptAll(), market(a=10.0), 100, log_sink=sink)
    first, second = call("a", x=1), call("a", x=2)
    agent = create_agent(scripted([ai(first), ai(second), AIMessage("done")]), [billing_tool("a", runs, 15.0)],
                         middleware=[guard.middleware()])
    out = agent.invoke(USER)
    assert runs["a"] == 1, "after an overrun no further call is accepted"
    ledger = guard.ledger(out)
    assert ledger.spent == 15 and ledger.reserved == 0  # the overrun is committed as billed
    assert [r.charged for r in executions(sink, first["id"])] == [15]
    assert executions(sink, second["id"]) == []
    assert tool_message(out, second["id"]).status == "error"
    assert sum(r.charged for r in sink.records) == 15
    assert_each_call_answered_once(msgs_of(out))


@pytest.mark.parametrize("use_async", [False, True])
def test_an_overrun_stops_the_calls_still_waiting_in_its_batch(use_async: bool):
    # Three calls in one message, gated together (10 each fits 30), run one at a time: the first
    # is billed 15, an overrun, so the two still waiting must not run on their gate reservations.
    runs, sink = RunCounter(), MemoryLogSink()
    guard = BudgetGuard(AcceptAll(), market(a=10.0), 30, log_sink=sink)
    batch = [call("a", x=i) for i in range(3)]
    agent = create_agent(scripted([ai(*batch), AIMessage("done")]), [billing_tool("a", runs, 15.0)],
                         middleware=[guard.middleware()])
    config = {"max_concurrency": 1}
    out = asyncio.run(agent.ainvoke(USER, config)) if use_async else agent.invoke(USER, config)
    assert runs["a"] == 1, "a call reserved before the overrun must not run after it"
    ledger = guard.ledger(out)
    assert ledger.spent == 15 and ledger.reserved == 0 and ledger.overrun == 5
    for waiting in batch[1:]:
        message = tool_message(out, waiting["id"])
        assert message.status == "error" and "above its quoted price" in message.content
        assert executions(sink, waiting["id"]) == []
    assert sum(r.charged for r in sink.records) == 15
    assert_each_call_answered_once(msgs_of(out))


# ============================================ row 9: resume with another budget
def _first_run(saver: InMemorySaver, config: dict[str, Any], runs: RunCounter):
    guard1 = BudgetGuard(AcceptAll(), market(a=20.0, b=40.0), 50)
    agent1 = create_agent(scripted([ai(call("a")), AIMessage("done")]), [make_tool("a", runs), make_tool("b", runs)],
                          middleware=[guard1.middleware()], checkpointer=saver)
    agent1.invoke(USER, config)
    assert guard1.ledger(agent1.get_state(config).values).spent == 20


def _second_agent(saver: InMemorySaver, runs: RunCounter, sink: MemoryLogSink, b_call: dict[str, Any]):
    guard2 = BudgetGuard(AcceptAll(), market(a=20.0, b=40.0), 500, log_sink=sink)
    agent2 = create_agent(scripted([ai(b_call), AIMessage("done again")]), [make_tool("a", runs), make_tool("b", runs)],
                          middleware=[guard2.middleware()], checkpointer=saver)
    return guard2, agent2


def test_resumed_thread_keeps_the_budget_in_state():
    saver, runs, sink = InMemorySaver(), RunCounter(), MemoryLogSink()
    config = {"configurable": {"thread_id": "resume-budget"}}
    _first_run(saver, config, runs)
    b = call("b")
    guard2, agent2 = _second_agent(saver, runs, sink, b)
    assert guard2.ledger(agent2.get_state(config).values).budget == 50  # the ledger in state wins over 500
    out = agent2.invoke({"messages": [("user", "more")]}, config)
    assert runs["b"] == 0 and tool_message(out, b["id"]).status == "error"  # 20 + 40 > 50
    assert_invariants(guard2, out, runs, {"a": 20.0, "b": 40.0}, 50, sink=None)


def test_top_up_raises_the_budget_in_state_and_is_logged():
    """With ``graph=`` the top-up is in state at once."""
    saver, runs, sink = InMemorySaver(), RunCounter(), MemoryLogSink()
    config = {"configurable": {"thread_id": "top-up"}}
    _first_run(saver, config, runs)
    b = call("b")
    guard2, agent2 = _second_agent(saver, runs, sink, b)
    assert guard2.ledger(agent2.get_state(config).values).budget == 50
    assert guard2.top_up(config, 25, graph=agent2, reason="grant") == 75
    ledger = guard2.ledger(agent2.get_state(config).values)
    assert (ledger.budget, ledger.spent, ledger.remaining) == (75, 20, 55)
    top_ups = [r for r in sink.records if r.decision == "top_up"]
    assert len(top_ups) == 1 and top_ups[0].reason == "grant" and top_ups[0].charged == 0
    assert top_ups[0].budget == 75
    out = agent2.invoke({"messages": [("user", "more")]}, config)
    assert runs["b"] == 1  # 20 + 40 <= 75
    assert_invariants(guard2, out, runs, {"a": 20.0, "b": 40.0}, 75, sink=None)


def test_top_up_without_the_graph_of_a_thread_with_no_run_here_is_refused_not_guessed():
    # Its budget is only in state: the guard (built with 500) returned 525 and logged "budget 525" for a thread
    # whose budget is 50 (the ledger in state wins), and the top-up landed on a budget of 50.
    saver, runs, sink = InMemorySaver(), RunCounter(), MemoryLogSink()
    config = {"configurable": {"thread_id": "top-up-no-graph"}}
    _first_run(saver, config, runs)
    guard2, agent2 = _second_agent(saver, runs, sink, call("b"))
    with pytest.raises(GuardConfigError, match="graph=agent"):
        guard2.top_up(config, 25, reason="grant")
    assert not sink.records and guard2.ledger(agent2.get_state(config).values).budget == 50


@pytest.mark.parametrize("use_async", [False, True], ids=["sync", "async"])
def test_top_up_without_the_graph_of_a_paused_run_reaches_state_at_its_next_step(use_async):
    # The documented way for a thread paused inside a tool step (update_state there would run the step again).
    from langgraph.types import interrupt

    saver, runs, sink = InMemorySaver(), RunCounter(), MemoryLogSink()
    config = {"configurable": {"thread_id": f"top-up-paused-{use_async}"}}
    _first_run(saver, config, runs)  # a: 20 of 50

    def ask() -> str:
        """Ask a human."""
        return str(interrupt("ok?"))

    b = call("b")
    guard2 = BudgetGuard(AcceptAll(), market(a=20.0, b=40.0, ask=10.0), 500, log_sink=sink)
    agent2 = create_agent(scripted([ai(call("ask")), ai(b), AIMessage("done again")]),
                          [make_tool("a", runs), make_tool("b", runs), StructuredTool.from_function(ask)],
                          middleware=[guard2.middleware()], checkpointer=saver)

    async def arun():
        await agent2.ainvoke({"messages": [("user", "more")]}, config)
        assert await guard2.atop_up(config, 25, reason="grant") == 75  # 50 in state, not the guard's 500
        return await agent2.ainvoke(Command(resume="yes"), config)

    if use_async:
        out = asyncio.run(arun())
    else:
        agent2.invoke({"messages": [("user", "more")]}, config)
        assert guard2.top_up(config, 25, reason="grant") == 75
        out = agent2.invoke(Command(resume="yes"), config)
    assert runs["b"] == 1  # 20 + 10 + 40 <= 75
    ledger = guard2.ledger(out)
    assert (ledger.budget, ledger.spent, ledger.reserved) == (75, 70, 0)
    assert [(r.price, r.budget) for r in sink.records if r.decision == "top_up"] == [(25, 75)]


@pytest.mark.asyncio
async def test_an_async_top_up_writes_through_an_async_only_checkpointer(tmp_path):
    # AsyncSqliteSaver (as AsyncPostgresSaver) has no sync methods: top_up(graph=) could not write to it.
    from langgraph.checkpoint.sqlite.aio import AsyncSqliteSaver

    runs, sink = RunCounter(), MemoryLogSink()
    config = {"configurable": {"thread_id": "async-top-up"}}
    tools = [make_tool("a", runs), make_tool("b", runs)]
    async with AsyncSqliteSaver.from_conn_string(str(tmp_path / "threads.db")) as saver:
        guard = BudgetGuard(AcceptAll(), market(a=20.0, b=40.0), 50, log_sink=sink)
        b = call("b")
        agent = create_agent(scripted([ai(call("a")), AIMessage("done"), ai(b), AIMessage("done again")]), tools,
                             middleware=[guard.middleware()], checkpointer=saver)
        await agent.ainvoke(USER, config)
        assert await guard.atop_up(config, 25, graph=agent, reason="grant") == 75
        ledger = guard.ledger((await agent.aget_state(config)).values)
        assert (ledger.budget, ledger.spent, ledger.remaining) == (75, 20, 55)
        saved = BudgetLedger.from_state((await agent.aget_state(config)).values[LEDGER_KEY])
        assert saved.budget == 75, "the top-up is in the checkpoint, not only in this process's working copy"
        out = await agent.ainvoke({"messages": [("user", "more")]}, config)
    assert runs["b"] == 1, "20 + 40 fits the budget topped up to 75"
    assert [r.reason for r in sink.records if r.decision == "top_up"] == ["grant"]
    assert_invariants(guard, out, runs, {"a": 20.0, "b": 40.0}, 75, sink=None)


# ================================================================ row 10: async
@pytest.mark.asyncio
@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("budget", [30, 100])
async def test_async_retry_middleware_each_execution_is_gated_and_charged(order, budget):
    guard, runs, sink, c, agent = _retry_case(order, budget)
    out = await agent.ainvoke(USER)
    _check_retry_case(guard, runs, sink, c, out, budget)


@pytest.mark.asyncio
@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("budget", [100, 30])
async def test_async_tool_call_limit_blocked_call_keeps_no_reservation(order, budget):
    guard, runs, sink, agent = _limit_case(order, budget)
    out = await agent.ainvoke(USER)
    _check_limit_case(guard, runs, sink, out, budget)


def test_a_malformed_bill_fails_loudly_and_the_run_is_still_charged():
    runs, sink = RunCounter(), MemoryLogSink()
    guard = BudgetGuard(AcceptAll(), market(a=20.0), 100, log_sink=sink)

    def run() -> tuple[str, dict]:
        runs.hit("a")
        return "done", {"intent_billed": "lots"}

    tool_ = StructuredTool.from_function(run, name="a", description="a", response_format="content_and_artifact")
    agent = create_agent(scripted([ai(call("a")), AIMessage("done")]), [tool_], middleware=[guard.middleware()],
                         checkpointer=InMemorySaver())
    config = {"configurable": {"thread_id": "bad-bill"}}
    with pytest.raises(TypeError, match="intent_billed"):
        agent.invoke(USER, config)
    assert runs["a"] == 1
    assert guard.ledger(agent.get_state(config).values).spent == 20  # the quote, not forgotten
    assert [r.charged for r in executions(sink)] == [20]


# ====================== found in review: replies of malformed calls only, and outer model retries
_MALFORMED = AIMessage("", invalid_tool_calls=[{"name": "a", "args": "{oops", "id": "bad1", "error": "bad json",
                                                "type": "invalid_tool_call"}])


def _other(kind: str) -> Any:
    if kind == "limit":
        return ToolCallLimitMiddleware(thread_limit=5)
    if kind == "model_limit":
        return ModelCallLimitMiddleware(run_limit=10, exit_behavior="end")
    return HumanInTheLoopMiddleware(interrupt_on={"b": True})


@pytest.mark.parametrize("use_async", [False, True])
@pytest.mark.parametrize("gate_at", ["model_call", "after_model"])
@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("other", ["limit", "model_limit", "hitl"])
def test_a_reply_of_malformed_calls_only_goes_back_to_the_model_in_any_stack(other, order, gate_at, use_async):
    runs, sink = RunCounter(), MemoryLogSink()
    guard = BudgetGuard(AcceptAll(), market(a=5.0, b=5.0), 50, log_sink=sink, gate_at=gate_at)
    c = call("a", x=1)
    agent = create_agent(scripted([_MALFORMED, ai(c), AIMessage("done")]), [make_tool("a", runs), make_tool("b", runs)],
                         middleware=with_guard(guard, _other(other), order), checkpointer=InMemorySaver())
    config = {"configurable": {"thread_id": f"malformed-{other}-{order}-{gate_at}-{use_async}"}}
    out = asyncio.run(agent.ainvoke(USER, config)) if use_async else agent.invoke(USER, config)
    assert out["messages"][-1].content == "done", "the model must be asked again after its malformed reply"
    assert runs["a"] == 1 and tool_message(out, "bad1").status == "error"
    assert guard.ledger(out).spent == 5.0 and guard.ledger(out).reserved == 0


@pytest.mark.parametrize("use_async", [False, True])
def test_an_outer_model_retry_without_a_thread_id_keeps_one_episode(use_async):
    # [ModelRetryMiddleware, guard], no thread_id: the retried model call is the same episode, which
    # starts once, ends once and leaves nothing behind.
    oracle = RecordingOracle(end_hook=True)
    guard = BudgetGuard(oracle, market(a=1.0), 10.0)
    for _ in range(3):
        model = scripted([ai(call("a", x=1)), AIMessage("done")], fail_on={1, 2})
        retry = ModelRetryMiddleware(max_retries=3, initial_delay=0.0, backoff_factor=0.0, jitter=False)
        agent = create_agent(model, [make_tool("a", RunCounter())], middleware=[retry, guard.middleware()])
        out = asyncio.run(agent.ainvoke(USER)) if use_async else agent.invoke(USER)
        assert guard.ledger(out).spent == 1.0
    assert len(guard.episodes) == 0
    assert len(oracle.episodes) == len(oracle.ended) == 3


def _hooks(oracle: RecordingOracle) -> list[tuple[str, str]]:
    """The oracle's start, decide and end hooks in order, each with its episode id."""
    return [(hook, arg if isinstance(arg, str) else arg.episode_id) for hook, arg in oracle.calls]


@pytest.mark.parametrize("with_end", [True, False])
@pytest.mark.parametrize("use_async", [False, True])
def test_each_run_of_a_thread_starts_the_oracle_again(with_end, use_async):
    # Three runs (turns) on one thread: each starts the oracle before its first decision and, for an
    # oracle with an end hook, ends it after its last; the thread's budget goes on. The second run pauses
    # at a human's approval and is resumed by a guard in another process (a fresh guard, the same
    # checkpointer): a resumed run is the same run, so its oracle is not started again.
    from langchain_core.messages import HumanMessage

    saver, runs = InMemorySaver(), RunCounter()
    oracle = RecordingOracle(end_hook=with_end)  # one record across the guards

    def agent_with_fresh_guard(replies: list[AIMessage]) -> tuple[Any, BudgetGuard]:
        guard = BudgetGuard(oracle, market(a=1.0), 10.0)
        middleware = [guard.middleware(), HumanInTheLoopMiddleware(interrupt_on={"a": {"allowed_decisions": [
            "approve"], "description": "pay?"}})] if len(replies) > 2 else [guard.middleware()]
        return create_agent(scripted(replies), [make_tool("a", runs)], middleware=middleware,
                            checkpointer=saver), guard

    def go(agent: Any, payload: Any) -> Any:
        config = {"configurable": {"thread_id": "turns"}}
        return asyncio.run(agent.ainvoke(payload, config)) if use_async else agent.invoke(payload, config)

    agent, _ = agent_with_fresh_guard([ai(call("a", x=1)), AIMessage("one")])
    go(agent, {"messages": [HumanMessage("first")]})
    agent, _ = agent_with_fresh_guard([ai(call("a", x=2)), AIMessage("two"), AIMessage("unused")])
    paused = go(agent, {"messages": [HumanMessage("second")]})
    assert "__interrupt__" in paused
    agent, _ = agent_with_fresh_guard([AIMessage("two"), AIMessage("unused"), AIMessage("unused")])
    go(agent, Command(resume={"decisions": [{"type": "approve"}]}))
    agent, guard = agent_with_fresh_guard([ai(call("a", x=3)), AIMessage("three")])
    out = go(agent, {"messages": [HumanMessage("third")]})
    hooks = _hooks(oracle)
    episode = hooks[0][1]
    assert {e for _, e in hooks} == {episode}, "one thread, one episode id"
    per_run = [k for k, _ in hooks]
    expected = ["start", "decide", "end"] if with_end else ["start", "decide"]
    assert per_run == expected * 3
    assert runs.total() == 3 and guard.ledger(out).spent == 3.0 and guard.ledger(out).reserved == 0
    assert out["intent_ledger"]["runs_started"] == out["intent_ledger"]["runs_ended"] == 3


def test_a_run_resumed_elsewhere_that_ends_without_a_model_step_is_counted_ended():
    # A return_direct tool approved by a human: the run resumed by a fresh guard (another process) ends right
    # after the tool, with no model step there. Its end is counted in state, so the next turn starts the
    # oracle again (was: the next turn decided right after end, with no start).
    from langchain_core.messages import HumanMessage

    oracle = RecordingOracle(end_hook=True)  # one record across the guards
    saver, runs = InMemorySaver(), RunCounter()
    tool_a = StructuredTool.from_function(lambda x=0: runs.hit("a") and "a", name="a", description="a",
                                          return_direct=True)

    def agent(replies: list[AIMessage]) -> Any:
        guard = BudgetGuard(oracle, market(a=1.0), 10.0)
        approve = HumanInTheLoopMiddleware(interrupt_on={"a": {"allowed_decisions": ["approve"]}})
        return create_agent(scripted(replies), [tool_a], middleware=[guard.middleware(), approve], checkpointer=saver)

    config = {"configurable": {"thread_id": "direct"}}
    assert "__interrupt__" in agent([ai(call("a", x=1))]).invoke({"messages": [HumanMessage("one")]}, config)
    resumed = agent([ai(call("a", x=2))])  # the resumed run asks no model; the next turn does
    out = resumed.invoke(Command(resume={"decisions": [{"type": "approve"}]}), config)
    assert runs["a"] == 1 and out["intent_ledger"]["runs_ended"] == 1
    resumed.invoke({"messages": [HumanMessage("two")]}, config)  # pauses at the approval again
    assert [k for k, _ in _hooks(oracle)] == ["start", "decide", "end", "start", "decide"]


def test_malformed_replies_are_asked_again_at_most_three_times_in_one_step():
    from intent.middleware import MAX_MALFORMED_REASKS

    sink = MemoryLogSink()
    guard = BudgetGuard(AcceptAll(), market(a=5.0), 50, log_sink=sink)
    bad = [AIMessage("", invalid_tool_calls=[{"name": "a", "args": "{", "id": f"bad{i}", "error": "bad json",
                                              "type": "invalid_tool_call"}]) for i in range(6)]
    model = scripted([*bad, AIMessage("done")])
    agent = create_agent(model, [make_tool("a", RunCounter())],
                         middleware=[guard.middleware(), ToolCallLimitMiddleware(thread_limit=5)])
    out = agent.invoke(USER)
    asked = 1 + MAX_MALFORMED_REASKS
    assert [r.call_id for r in sink.records if r.decision == "invalid"] == [f"bad{i}" for i in range(asked)]
    assert [m.tool_call_id for m in out["messages"] if isinstance(m, ToolMessage)] == [f"bad{i}" for i in range(asked)]
    assert guard.ledger(out).spent == 0 and guard.ledger(out).reserved == 0


@pytest.mark.parametrize("use_async", [False, True])
@pytest.mark.parametrize("gate_at", ["model_call", "after_model"])
def test_structured_output_keeps_its_answer_and_the_money_holds(gate_at, use_async):
    from langchain.agents.structured_output import ToolStrategy
    from pydantic import BaseModel

    class Answer(BaseModel):
        text: str

    runs, sink = RunCounter(), MemoryLogSink()
    guard = BudgetGuard(AcceptAll(), market(a=5.0), 50, log_sink=sink, gate_at=gate_at)
    # A priced call and the structured answer in one reply, as a model may give them.
    reply = ai(call("a", x=1), {"name": "Answer", "args": {"text": "hi"}, "id": "s1", "type": "tool_call"})
    agent = create_agent(scripted([reply, AIMessage("done")]), [make_tool("a", runs)],
                         middleware=[guard.middleware()], response_format=ToolStrategy(Answer))
    out = asyncio.run(agent.ainvoke(USER)) if use_async else agent.invoke(USER)
    assert out["structured_response"] == Answer(text="hi")
    assert_invariants(guard, out, runs, {"a": 5.0}, 50, sink)
    answered = [r for r in sink.records if r.call_id == "s1"]
    assert [(r.decision, r.reason, r.charged) for r in answered] == [("answered", "answered_elsewhere", 0.0)]


def test_runs_without_a_thread_id_that_reuse_one_input_stay_separate_episodes():
    # add_messages writes an id into the caller's own message, so two runs on one input object
    # share that id: they must still be two episodes, concurrently and one after the other.
    from langchain_core.messages import HumanMessage

    sink = MemoryLogSink()
    guard = BudgetGuard(AcceptAll(), market(a=3.0), 10.0, log_sink=sink)

    def agent() -> Any:
        return create_agent(scripted([ai(call("a", x=1)), ai(call("a", x=2)), AIMessage("done")]),
                            [make_tool("a", RunCounter())], middleware=[guard.middleware()])

    inp = {"messages": [HumanMessage("go")]}

    async def both() -> list[Any]:
        return list(await asyncio.gather(agent().ainvoke(inp), agent().ainvoke(inp)))

    outs = [*asyncio.run(both()), agent().invoke(inp), agent().invoke(inp)]
    assert [guard.ledger(out).spent for out in outs] == [6.0] * 4
    assert len({r.task_id for r in sink.records}) == 4
    assert len(guard.episodes) == 0


@pytest.mark.parametrize("use_async", [False, True])
@pytest.mark.parametrize("gate_at", ["model_call", "after_model"])
def test_a_summarised_history_keeps_the_turn_numbers_and_the_task(gate_at, use_async):
    # SummarizationMiddleware replaces old turns with a summary (a new first human message). The
    # guard must still number each model turn once (log records are ordered by it, an oracle keys
    # its per-turn state by it) and keep the episode's task as it was given.
    from langchain.agents.middleware import SummarizationMiddleware

    oracle = RecordingOracle()

    from intent import ModelPrice

    runs, sink = RunCounter(), MemoryLogSink()
    # The agent's model calls are priced too: each is charged under the turn it makes.
    guard = BudgetGuard(oracle, market(a=1.0), 50, log_sink=sink, gate_at=gate_at,
                        model_prices={"scripted-model": ModelPrice(input_per_mtok=1.0, output_per_mtok=1.0)})
    turns = 6
    summariser = scripted([AIMessage("an earlier turn called a") for _ in range(turns)])
    replies = [*(ai(call("a", x=i), usage=(10, 5)) for i in range(turns)), ai(text="done", usage=(10, 5))]
    agent = create_agent(
        scripted(replies), [make_tool("a", runs)],
        middleware=[SummarizationMiddleware(summariser, trigger=("messages", 4), keep=("messages", 2)),
                    guard.middleware()])
    out = asyncio.run(agent.ainvoke(USER)) if use_async else agent.invoke(USER)
    assert any("an earlier turn called a" in str(m.content) for m in out["messages"])  # it did summarise
    task = USER["messages"][0][1]
    assert [(c.step, c.query) for c in oracle.contexts] == [(i, task) for i in range(turns)]
    ran = [r for r in sink.records if r.execution == 1]
    assert [r.step for r in ran if r.kind == "tool"] == list(range(turns))
    assert [r.step for r in ran if r.kind == "model"] == list(range(turns + 1))
    assert {r.query for r in sink.records} == {task}
    ledger = guard.ledger(out)
    assert ledger.spent_by_kind()["tool"] == turns * 1.0 and ledger.reserved == 0


@pytest.mark.parametrize("use_async", [False, True])
@pytest.mark.parametrize("budget", [50.0, 4.0])
@pytest.mark.parametrize("rebuild", ["new_id", "no_id", "new_args"])
def test_a_message_rebuilt_outside_the_guard_still_runs_its_gated_calls(rebuild, budget, use_async):
    # A custom middleware listed before the guard (so outside its model call) returns the model's
    # message rebuilt: another id, or none. The calls the gate decided must still run (or stay
    # refused), be paid and be answered once with one record, turns numbered as in the history;
    # a rebuilt call with other arguments is re-gated, as a reviewer's edit is.
    from langchain.agents.middleware import AgentMiddleware

    class Rebuild(AgentMiddleware):
        def _rebuilt(self, response: Any) -> Any:
            msg = response.result[-1]
            calls = [{**c, "args": {"x": c["args"]["x"] + 100}} if rebuild == "new_args" else c
                     for c in msg.tool_calls]
            return AIMessage(content=msg.content, tool_calls=calls,
                             **({} if rebuild == "no_id" else {"id": f"rebuilt-{msg.id}"}))

        def wrap_model_call(self, request: Any, handler: Any) -> Any:
            return self._rebuilt(handler(request))

        async def awrap_model_call(self, request: Any, handler: Any) -> Any:
            return self._rebuilt(await handler(request))

    oracle = RecordingOracle()
    runs, sink = RunCounter(), MemoryLogSink()
    guard = BudgetGuard(oracle, market(a=2.0, b=3.0), budget, log_sink=sink)
    agent = create_agent(scripted([ai(call("a", x=1), call("b", x=2)), ai(call("a", x=3)), AIMessage("done")]),
                         [make_tool("a", runs), make_tool("b", runs)], middleware=[Rebuild(), guard.middleware()])
    out = asyncio.run(agent.ainvoke(USER)) if use_async else agent.invoke(USER)
    # With a budget of 4, b (3) does not fit after a (2): refused at the gate, never run.
    assert runs == (Counter({"a": 2, "b": 1}) if budget == 50 else Counter({"a": 2}))
    refused = [m.tool_call_id for m in msgs_of(out) if isinstance(m, ToolMessage) and m.status == "error"]
    assert len(refused) == (0 if budget == 50 else 1)
    assert_invariants(guard, out, runs, {"a": 2.0, "b": 3.0}, budget, sink)
    # New arguments are decided again before they run; the same ones are not.
    again = [101, 103] if budget == 4 else [101, 102, 103]
    assert sorted(c.args["x"] for c in oracle.contexts) == ([1, 2, 3, *again] if rebuild == "new_args" else [1, 2, 3])


@pytest.mark.parametrize("gate_at", ["model_call", "after_model"])
def test_turns_stay_unique_when_a_summariser_removes_replies_without_calls_over_many_runs(gate_at):
    # A chat thread: a tool turn, then replies without calls, over eight runs; the summariser cuts
    # the old turns, replies without calls included. Every model turn keeps its own number.
    from langchain.agents.middleware import SummarizationMiddleware
    from langchain_core.messages import HumanMessage

    from intent import ModelPrice

    sink = MemoryLogSink()
    guard = BudgetGuard(AcceptAll(), market(a=1.0), 50, log_sink=sink, gate_at=gate_at,
                        model_prices={"scripted-model": ModelPrice(input_per_mtok=1.0, output_per_mtok=1.0)})
    replies = [ai(call("a", x=1), usage=(10, 5)), *(ai(text=f"reply {i}", usage=(10, 5)) for i in range(7)),
               ai(call("a", x=2), usage=(10, 5)), ai(text="done", usage=(10, 5))]
    agent = create_agent(scripted(replies), [make_tool("a", RunCounter())],
                         middleware=[SummarizationMiddleware(scripted([AIMessage("summary")] * 20),
                                                             trigger=("messages", 4), keep=("messages", 2)),
                                     guard.middleware()], checkpointer=InMemorySaver())
    config = {"configurable": {"thread_id": "chat"}}
    for i in range(8):
        agent.invoke({"messages": [HumanMessage(f"user {i}")]}, config)
    assert [r.step for r in sink.records if r.kind == "model" and r.execution == 1] == list(range(10))
    assert [r.step for r in sink.records if r.kind == "tool"] == [0, 8]
    # Each run's task is the message that started it, kept while the summariser rewrites the history.
    runs_of_model_turns = [0, 0, 1, 2, 3, 4, 5, 6, 7, 7]
    assert [r.query for r in sink.records if r.kind == "model" and r.execution == 1] == [
        f"user {i}" for i in runs_of_model_turns]


@pytest.mark.parametrize("use_async", [False, True])
@pytest.mark.parametrize("gate_at", ["model_call", "after_model"])
def test_each_run_of_a_chat_thread_is_its_own_task_across_processes(gate_at, use_async):
    # A chat thread: every user turn is a run with a task of its own. The oracle's start hook, its
    # decisions and the log records (a metered summariser's included) see the turn's question, not the
    # thread's first one; kept in state, so a run whose question the summariser replaced, paused by a
    # reviewer and resumed by another process (a fresh guard on the same checkpointer), keeps it.
    from langchain.agents.middleware import SummarizationMiddleware
    from langchain_core.messages import HumanMessage

    from intent import LEDGER_KEY, ModelPrice

    oracle = RecordingOracle()  # the same oracle for both guards (both processes' records in one list)
    saver, runs, sink = InMemorySaver(), RunCounter(), MemoryLogSink()
    prices = {"scripted-model": ModelPrice(input_per_mtok=1.0, output_per_mtok=1.0),
              "summariser": ModelPrice(input_per_mtok=1.0, output_per_mtok=1.0)}
    replies = [ai(call("a", x=1), usage=(10, 5)), ai(text="weather done", usage=(10, 5)),
               ai(call("a", x=2), usage=(10, 5)), ai(call("b", x=3), usage=(10, 5)), ai(text="stocks done", usage=(10, 5))]
    model = scripted(replies)
    summaries = scripted([ai(text="an earlier turn called a", usage=(10, 5), model_name="summariser")
                          for _ in range(6)], model_name="summariser")

    def agent() -> Any:
        guard = BudgetGuard(oracle, market(a=1.0, b=2.0), 10, log_sink=sink, gate_at=gate_at,
                            model_prices=prices)
        summariser = SummarizationMiddleware(guard.metered_model(summaries), trigger=("messages", 4),
                                             keep=("messages", 1))
        return guard, create_agent(model, [make_tool("a", runs), make_tool("b", runs)],
                                   middleware=[summariser, HumanInTheLoopMiddleware(interrupt_on={"b": True}),
                                               guard.middleware()], checkpointer=saver)

    def invoke(graph: Any, value: Any) -> Any:
        return asyncio.run(graph.ainvoke(value, config)) if use_async else graph.invoke(value, config)

    config = {"configurable": {"thread_id": f"chat-{gate_at}-{use_async}"}}
    _, first = agent()
    invoke(first, {"messages": [HumanMessage("what is the weather")]})
    paused = invoke(first, {"messages": [HumanMessage("and the stock price?")]})
    assert "__interrupt__" in paused
    state = first.get_state(config).values
    assert "and the stock price?" not in [m.content for m in state["messages"]]  # summarised away
    assert (state[LEDGER_KEY]["query"], state[LEDGER_KEY]["query_run"]) == ("and the stock price?", 2)
    guard, resumed = agent()  # another process picks the thread up
    out = invoke(resumed, Command(resume={"decisions": [{"type": "approve"}]}))
    assert runs == Counter({"a": 2, "b": 1})
    weather, stocks = "what is the weather", "and the stock price?"
    assert [e.query for e in oracle.episodes] == [weather, stocks]
    assert [c.query for c in oracle.contexts] == [weather, stocks, stocks]
    assert [(r.tool, r.query) for r in sink.records if r.kind == "tool"] == [("a", weather), ("a", stocks), ("b", stocks)]
    summarised = [r.query for r in sink.records if r.kind == "model" and r.tool == "summariser"]
    assert summarised and set(summarised) == {stocks}  # the metered summariser runs on run 2's first step
    ledger = guard.ledger(out)
    assert ledger.spent_by_kind()["tool"] == 4.0 and ledger.reserved == 0


@pytest.mark.parametrize("use_async", [False, True])
def test_each_fan_out_branch_of_one_run_keeps_its_own_task(use_async):
    # A parent graph sends three tasks to a guarded agent in one thread: the branches share the run's
    # episode and budget, but each decides and logs its own task.
    from langchain_core.messages import HumanMessage
    from langgraph.types import Send

    from intent import GuardState

    def per_branch(messages: list, info: Any) -> AIMessage:
        """Branch k calls a(x=k) once, then answers."""
        k = int(str(next(m for m in messages if isinstance(m, HumanMessage)).content).split()[-1])
        done = any(isinstance(m, AIMessage) for m in messages)
        return AIMessage("done") if done else ai(call("a", x=k))

    oracle = RecordingOracle()
    runs, sink = RunCounter(), MemoryLogSink()
    guard = BudgetGuard(oracle, market(a=1.0), 10, log_sink=sink)
    sub = create_agent(ReactiveToolModel(reply=per_branch, model_name=None), [make_tool("a", runs)],
                       middleware=[guard.middleware()])
    parent = StateGraph(GuardState)
    parent.add_node("sub", sub)
    parent.add_conditional_edges(
        START, lambda state: [Send("sub", {"messages": [HumanMessage(f"task {k}")]}) for k in range(3)], ["sub"])
    parent.add_edge("sub", END)
    graph = parent.compile(checkpointer=InMemorySaver())
    config = {"configurable": {"thread_id": f"fan-tasks-{use_async}"}}
    out = asyncio.run(graph.ainvoke({"messages": []}, config)) if use_async else graph.invoke({"messages": []}, config)
    assert sorted((c.query, c.args["x"]) for c in oracle.contexts) == [(f"task {k}", k) for k in range(3)]
    assert sorted((r.args["x"], r.query) for r in sink.records if r.kind == "tool") == [(k, f"task {k}") for k in range(3)]
    assert guard.ledger(out).spent == 3.0 and guard.ledger(out).reserved == 0


def test_a_later_message_reusing_a_rebuilt_calls_id_is_not_run_on_its_reservation():
    # An outer middleware rebuilds turn 1's message (supported), then answers turn 2 itself without
    # calling the model, reusing the call id: the guard never gated that message, so its call must
    # not run on the first call's (already spent) reservation.
    runs, sink = RunCounter(), MemoryLogSink()
    guard = BudgetGuard(AcceptAll(), market(a=2.0), 10.0, log_sink=sink)
    agent = create_agent(scripted([ai(tc("a", "c0", x=1)), AIMessage("done")]), [make_tool("a", runs)],
                         middleware=[RebuildThenCache(), guard.middleware()])
    out = agent.invoke(USER)
    assert runs["a"] == 1 and guard.ledger(out).spent == 2.0 and guard.ledger(out).reserved == 0
    answers = [m for m in msgs_of(out) if isinstance(m, ToolMessage)]
    assert [m.status for m in answers] == ["success", "error"]
    assert "never approved it" in str(answers[1].content)


def test_parallel_sub_agents_sharing_an_episode_each_keep_their_own_task():
    # Sub-agents that inherit the parent's thread share one child episode; each one's task is
    # still its own first human message (read from its own state), not the first child's.
    import threading

    from langchain_core.messages import HumanMessage

    from intent import FromParent

    oracle = RecordingOracle()
    prices = market(fetch=0.01, research=0.0)
    child = BudgetGuard(oracle, prices, FromParent(limit=0.3))
    barrier = threading.Barrier(2)

    def fetch(q: str = "") -> str:
        return "ok"

    def research(q: str = "") -> str:
        barrier.wait(10)
        agent = create_agent(scripted([ai(tc("fetch", f"f-{q}", q=q)), AIMessage("child done")]),
                             [StructuredTool.from_function(fetch, name="fetch", description="f")],
                             middleware=[child.middleware()])
        return agent.invoke({"messages": [HumanMessage(f"task {q}")]})["messages"][-1].content

    parent = BudgetGuard(AcceptAll(), prices, 1.0)
    create_agent(scripted([ai(tc("research", "r-A", q="A"), tc("research", "r-B", q="B")), AIMessage("done")]),
                 [StructuredTool.from_function(research, name="research", description="r")],
                 middleware=[parent.middleware()]).invoke(USER, {"configurable": {"thread_id": "p"}})
    assert sorted((c.query, c.args.get("q")) for c in oracle.contexts) == [("task A", "A"), ("task B", "B")]


@pytest.mark.parametrize("gate_at", ["model_call", "after_model"])
def test_a_middlewares_own_unpriced_tool_is_refused_as_unpriced_with_one_warning_and_runs_once_priced(gate_at):
    # TodoListMiddleware adds write_todos to the agent's tools. Unpriced, its calls are refused as
    # unusable under this budget (not as a tool that does not exist), the developer is warned once,
    # and an invented name still hears "no such tool"; both list only tools the agent has and can pay.
    import warnings

    from langchain.agents.middleware import TodoListMiddleware

    from intent import UnpricedToolWarning

    todo = {"todos": [{"content": "x", "status": "pending"}]}
    replies = [ai(tc("write_todos", "t1", **todo)), ai(tc("write_todos", "t2", **todo), tc("invented", "i1")),
               AIMessage("done")]
    runs, sink = RunCounter(), MemoryLogSink()
    # "b" is priced but not the agent's: never offered as usable.
    guard = BudgetGuard(AcceptAll(), market(a=1.0, b=1.0), 10.0, log_sink=sink, gate_at=gate_at)
    agent = create_agent(scripted(replies), [make_tool("a", runs)], middleware=[TodoListMiddleware(), guard.middleware()])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = agent.invoke(USER)
    unpriced = [w for w in caught if issubclass(w.category, UnpricedToolWarning)]
    assert len(unpriced) == 1 and "PricedTool('write_todos', 0.0)" in str(unpriced[0].message)
    answers = {m.tool_call_id: str(m.content) for m in msgs_of(out) if isinstance(m, ToolMessage)}
    for cid in ("t1", "t2"):
        assert "write_todos cannot be used under this budget" in answers[cid]
        assert answers[cid].endswith("The tools you can use are: a.")
    assert answers["i1"] == ("Error: there is no tool named invented; the call was not made and cost nothing. "
                             "The available tools are: a.")
    assert [r.reason for r in sink.records if r.call_id in ("t1", "t2", "i1")] == \
        ["unpriced_tool", "unpriced_tool", "unknown_tool"]
    assert_invariants(guard, out, runs, {"a": 1.0, "b": 1.0}, 10.0, sink)

    # Priced (free), the middleware's tool runs and costs nothing.
    sink = MemoryLogSink()
    guard = BudgetGuard(AcceptAll(), market(a=1.0, write_todos=0.0), 10.0, log_sink=sink, gate_at=gate_at)
    agent = create_agent(scripted([ai(tc("write_todos", "t1", **todo)), AIMessage("done")]), [make_tool("a", runs)],
                         middleware=[TodoListMiddleware(), guard.middleware()])
    out = agent.invoke(USER)
    assert out["todos"] == todo["todos"]
    assert [(r.call_id, r.execution, r.charged) for r in sink.records] == [("t1", 1, 0.0)]


@pytest.mark.parametrize("use_async", [False, True])
@pytest.mark.parametrize("gate_at", ["model_call", "after_model"])
@pytest.mark.parametrize("outer", ["retry", "fallback"])
def test_an_outer_model_retry_of_a_first_reply_without_calls_leaves_a_whole_channel(outer, gate_at, use_async):
    # No thread, the first model execution fails and an outer retry's reply has no calls: the step
    # must still write the episode's whole channel (not one of turns alone), and the run's episode
    # ends: its oracle is ended and its working state dropped.
    from langchain.agents.middleware import ModelRetryMiddleware

    from langchain.agents.middleware import ModelFallbackMiddleware

    oracle = RecordingOracle(end_hook=True)
    guard = BudgetGuard(oracle, market(a=1.0), 10.0, gate_at=gate_at)
    first = scripted([AIMessage("done, no calls")], fail_on={1})
    retry = (ModelRetryMiddleware(max_retries=3, initial_delay=0.0, backoff_factor=0.0, jitter=False)
             if outer == "retry" else ModelFallbackMiddleware(scripted([AIMessage("done by the fallback")])))
    agent = create_agent(first, [make_tool("a", RunCounter())], middleware=[retry, guard.middleware()])
    out = asyncio.run(agent.ainvoke(USER)) if use_async else agent.invoke(USER)
    channel = out["intent_ledger"]
    started = [e.episode_id for e in oracle.episodes]
    assert channel["budget"] == 10.0 and channel["episode_id"] == started[0]
    assert oracle.ended == started and len(guard.episodes) == 0
    assert guard.ledger(out).spent == 0.0


def test_replies_rebuilt_outside_the_guard_keep_their_turn_numbers_over_many_runs():
    # Every reply, with calls or without, is rebuilt with a new id by a middleware outside the
    # guard, in a thread over three runs: each turn keeps the number of its place in the history.
    from langchain.agents.middleware import AgentMiddleware
    from langchain_core.messages import HumanMessage

    class Rebuild(AgentMiddleware):
        def wrap_model_call(self, request: Any, handler: Any) -> Any:
            msg = handler(request).result[-1]
            return AIMessage(content=msg.content, tool_calls=msg.tool_calls, id=f"rebuilt-{msg.id}")

    oracle = RecordingOracle()
    runs, sink = RunCounter(), MemoryLogSink()
    guard = BudgetGuard(oracle, market(a=1.0), 50, log_sink=sink)
    replies = [r for i in range(3) for r in (ai(call("a", x=i)), AIMessage(f"answer {i}"))]
    agent = create_agent(scripted(replies), [make_tool("a", runs)], middleware=[Rebuild(), guard.middleware()],
                         checkpointer=InMemorySaver())
    config = {"configurable": {"thread_id": "rebuilt"}}
    for i in range(3):
        out = agent.invoke({"messages": [HumanMessage(f"q{i}")]}, config)
    assert [c.step for c in oracle.contexts] == [0, 2, 4]
    assert_one_record_per_call(out["messages"], sink.records)
    assert runs["a"] == 3 and guard.ledger(out).spent == 3.0


def test_a_cached_message_after_a_rejected_rebuilt_call_is_not_run_on_its_reservation():
    # Turn 1 is rebuilt outside the guard and a reviewer rejects its call (its reservation is still
    # unused until the next model step settles it); turn 2 is answered by a cache outside the guard
    # that reuses the call id. The guard never saw that message: its call must not run.
    from langchain.agents.middleware import HumanInTheLoopMiddleware

    runs = RunCounter()
    guard = BudgetGuard(AcceptAll(), market(a=2.0), 10.0)
    agent = create_agent(scripted([ai(tc("a", "c0", x=1)), AIMessage("done")]), [make_tool("a", runs)],
                         middleware=[RebuildThenCache(), guard.middleware(),
                                     HumanInTheLoopMiddleware(interrupt_on={"a": True})],
                         checkpointer=InMemorySaver())
    config = {"configurable": {"thread_id": "t"}}
    out = agent.invoke(USER, config)
    out = agent.invoke(Command(resume={"decisions": [{"type": "reject", "message": "no"}]}), config)
    while out.get("__interrupt__"):
        out = agent.invoke(Command(resume={"decisions": [{"type": "approve"}]}), config)
    assert runs["a"] == 0
    ledger = guard.ledger(out)
    assert ledger.spent == 0.0 and ledger.reserved == 0.0
    answers = [str(m.content) for m in msgs_of(out) if isinstance(m, ToolMessage)]
    assert len(answers) == 2 and "never approved it" in answers[1]



def _bad_reply(i: int) -> AIMessage:
    return AIMessage("", invalid_tool_calls=[{"name": "a", "args": "{bad", "id": f"bad{i}", "error": "not JSON",
                                              "type": "invalid_tool_call"}],
                     usage_metadata={"input_tokens": 10, "output_tokens": 5, "total_tokens": 15})


@pytest.mark.parametrize("gate_at", ["model_call", "after_model"])
@pytest.mark.parametrize("stack", ["malformed_asked_again", "call_limit_ends_the_run", "reply_where_the_last_was",
                                   "ended_before_the_gate"])
def test_turns_stay_unique_over_runs_with_a_summariser_and_replies_no_gate_sees_alone(stack, gate_at):
    # Over a thread's runs with a summariser: a reply of malformed calls only that the guard asks
    # the model about again inside one step, or a reply whose run a call limit listed after the
    # guard ends before an after_model gate sees it. Each model turn keeps a number of its own.
    from langchain.agents.middleware import SummarizationMiddleware
    from langchain_core.messages import HumanMessage

    from intent import ModelPrice

    sink = MemoryLogSink()
    guard = BudgetGuard(AcceptAll(), market(a=1.0), 50, log_sink=sink, gate_at=gate_at,
                        model_prices={"scripted-model": ModelPrice(input_per_mtok=1.0, output_per_mtok=1.0)})
    summariser = SummarizationMiddleware(scripted([AIMessage("summary")] * 20), trigger=("messages", 3),
                                         keep=("messages", 1))
    if stack == "ended_before_the_gate":
        # A custom after_model listed after the guard ends the run on a reply with calls before an
        # after_model gate sees it; the summariser then puts the next run's reply in its place.
        from langchain.agents.middleware.types import hook_config

        class EndOnCalls(AgentMiddleware):
            @hook_config(can_jump_to=["end"])
            def after_model(self, state: Any, runtime: Any) -> dict[str, Any] | None:
                last = state["messages"][-1]
                return {"jump_to": "end"} if isinstance(last, AIMessage) and last.tool_calls else None

        replies = [ai(text="answer 0", usage=(10, 5)), ai(call("a", x=1), call("a", x=2), usage=(10, 5)),
                   ai(text="answer 2", usage=(10, 5)), ai(text="answer 3", usage=(10, 5))]
        middleware, runs_of_thread = [summariser, guard.middleware(), EndOnCalls()], 4
    elif stack == "reply_where_the_last_was":
        # The summariser leaves [summary, human, reply]; the next run's reply lands where the last
        # counted one was: it is a new turn, not that one rebuilt.
        replies = [ai(text="answer 0", usage=(10, 5)), ai(text="answer 1", usage=(10, 5)),
                   ai(call("a", x=1), usage=(10, 5)), ai(text="answer 2", usage=(10, 5))]
        middleware, runs_of_thread = [summariser, guard.middleware()], 3
    elif stack == "malformed_asked_again":
        replies = [ai(call("a", x=1), usage=(10, 5)), ai(text="answer 0", usage=(10, 5)),
                   _bad_reply(1), ai(call("a", x=2), usage=(10, 5)), ai(text="answer 1", usage=(10, 5))]
        middleware, runs_of_thread = [summariser, guard.middleware()], 2
    else:
        replies = [ai(call("a", x=1), usage=(10, 5)), ai(text="answer 0", usage=(10, 5)),
                   ai(call("a", x=2), usage=(10, 5)), ai(call("a", x=3), usage=(10, 5)),
                   ai(call("a", x=4), usage=(10, 5)), ai(text="answer 2", usage=(10, 5))]
        middleware = [summariser, guard.middleware(), ToolCallLimitMiddleware(run_limit=1, exit_behavior="end")]
        runs_of_thread = 3
    agent = create_agent(scripted(replies), [make_tool("a", RunCounter())], middleware=middleware,
                         checkpointer=InMemorySaver())
    config = {"configurable": {"thread_id": "chat"}}
    for i in range(runs_of_thread):
        agent.invoke({"messages": [HumanMessage(f"user {i}")]}, config)
    model_steps = [r.step for r in sink.records if r.kind == "model" and r.execution == 1]
    assert model_steps == list(range(len(replies)))
    tool_steps = [r.step for r in sink.records if r.kind == "tool" and r.execution <= 1]
    assert all(s in model_steps for s in tool_steps) and len(tool_steps) == len(set(zip(tool_steps, [
        r.call_id for r in sink.records if r.kind == "tool" and r.execution <= 1])))


def test_the_scripted_model_binds_dict_schemas_with_or_without_a_name():
    model = scripted([AIMessage("x")])
    model.bind_tools([{"name": "a"}, {"type": "function", "function": {"name": "b"}}, {"title": "Answer"}, {}])
    assert model.bound == [["", "Answer", "a", "b"]]


def test_a_cached_message_in_a_cut_down_history_is_not_run_on_the_rebuilt_calls_place():
    # A before_model middleware cuts the history down to a summary once a tool has answered, so the
    # cache's later message (reusing id c0) lands where the rebuilt message was: the gated call has
    # already run, so that message is a later one the guard never saw, and its call must not run.
    from langchain.agents.middleware import AgentMiddleware
    from langchain_core.messages import HumanMessage, RemoveMessage
    from langgraph.graph.message import REMOVE_ALL_MESSAGES

    class CutDown(AgentMiddleware):
        def before_model(self, state: Any, runtime: Any) -> dict[str, Any] | None:
            if any(isinstance(m, ToolMessage) for m in state["messages"]):
                return {"messages": [RemoveMessage(id=REMOVE_ALL_MESSAGES), HumanMessage("summary: a ran", id="s")]}
            return None

    runs = RunCounter()
    guard = BudgetGuard(AcceptAll(), market(a=2.0), 10.0)
    agent = create_agent(scripted([ai(tc("a", "c0", x=1)), AIMessage("done")]), [make_tool("a", runs)],
                         middleware=[CutDown(), RebuildThenCache(), guard.middleware()])
    out = agent.invoke(USER)
    assert runs["a"] == 1
    ledger = guard.ledger(out)
    assert ledger.spent == 2.0 and ledger.reserved == 0.0


def test_an_offered_tool_the_market_cannot_price_is_warned_of_at_the_first_model_step():
    # deepagents offers a dozen file tools the model may never call: the developer hears of each
    # unpriced one when the agent is first shown it, not only if and when the model calls it.
    import warnings

    from langchain.agents.middleware import TodoListMiddleware

    from intent import UnpricedToolWarning

    guard = BudgetGuard(AcceptAll(), market(a=1.0), 10.0)
    agent = create_agent(scripted([AIMessage("done"), AIMessage("done")]), [make_tool("a", RunCounter())],
                         middleware=[TodoListMiddleware(), guard.middleware()])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        agent.invoke(USER)
        agent.invoke(USER)  # once per guard and tool
    unpriced = [str(w.message) for w in caught if issubclass(w.category, UnpricedToolWarning)]
    assert len(unpriced) == 1 and "'write_todos'" in unpriced[0]


def test_a_providers_server_side_tool_is_not_warned_of():
    # Anthropic's web search and the like are dicts the provider runs itself: no call reaches the gate.
    import warnings

    from intent import UnpricedToolWarning

    guard = BudgetGuard(AcceptAll(), market(a=1.0), 10.0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        guard.prepare({"messages": []}, {"configurable": {"thread_id": "w"}},
                      offered=[make_tool("a", RunCounter()), {"type": "web_search_20250305", "name": "web_search"},
                               {"name": "lookup", "description": "d", "input_schema": {"type": "object"}}])
    unpriced = [str(w.message) for w in caught if issubclass(w.category, UnpricedToolWarning)]
    assert len(unpriced) == 1 and "'lookup'" in unpriced[0]


@pytest.mark.parametrize("hidden_by", ["market_ban", "oracle"])
def test_hiding_priced_tools_keeps_the_providers_server_side_tools_bound(hidden_by):
    # A provider's own tools (OpenAI's {"type": "tool_search"}, Anthropic's named web search) are run by
    # the provider and never gated: hiding a banned or unapproved priced tool must leave them bound (a
    # tool deferred behind a tool search is unreachable without it).
    from intent.testing import ScriptedToolModel

    class Hides(AcceptAll):
        def visible_tools(self, market: Any, episode_id: str) -> list[str]:
            return ["a"]

    prices = market(a=1.0, c=1.0)
    guard = BudgetGuard(Hides(), prices, 10.0) if hidden_by == "oracle" else BudgetGuard(
        AcceptAll(), prices.ban("c"), 10.0)
    server_side = [{"type": "tool_search"}, {"type": "web_search_20250305", "name": "web_search"}]
    model = ScriptedToolModel(messages=iter([AIMessage("done")]), bound=[], fail_on=set(), executions=[])
    create_agent(model, [make_tool("a", RunCounter()), make_tool("c", RunCounter()), *server_side],
                 middleware=[guard.middleware()]).invoke(USER)
    assert model.bound == [sorted(["a", "", "web_search"])]  # c hidden; the unnamed tool_search kept


# =========================================== a tool a middleware adds at runtime
class AddsTool(AgentMiddleware):
    """LangChain's dynamic-tool pattern: offers ``tool`` to the model in ``wrap_model_call`` and hands it
    to the tool step with ``request.override(tool=...)`` (it is not registered with the ToolNode)."""

    def __init__(self, tool: Any) -> None:
        super().__init__()
        self.tool = tool

    def wrap_model_call(self, request: Any, handler: Any) -> Any:
        return handler(request.override(tools=[*request.tools, self.tool]))

    async def awrap_model_call(self, request: Any, handler: Any) -> Any:
        return await handler(request.override(tools=[*request.tools, self.tool]))

    def wrap_tool_call(self, request: Any, handler: Any) -> Any:
        if request.tool_call["name"] == self.tool.name:
            return handler(request.override(tool=self.tool))
        return handler(request)

    async def awrap_tool_call(self, request: Any, handler: Any) -> Any:
        if request.tool_call["name"] == self.tool.name:
            return await handler(request.override(tool=self.tool))
        return await handler(request)


@pytest.mark.parametrize("use_async", [False, True])
@pytest.mark.parametrize("order", ORDERS)
def test_a_tool_a_middleware_adds_at_runtime_is_paid_on_either_side_of_the_guard(order: str, use_async: bool) -> None:
    # Listed after the guard, the added tool ran unpaid and was logged as never run: 50 spent of 35.
    runs, sink = RunCounter(), MemoryLogSink()
    guard = BudgetGuard(AcceptAll(), market(a=10.0, extra=20.0), 35.0, log_sink=sink)
    model = scripted([ai(call("extra", x=1), call("a", x=1)), ai(call("extra", x=2)), AIMessage("done")])
    agent = create_agent(model, [make_tool("a", runs)],
                         middleware=with_guard(guard, AddsTool(make_tool("extra", runs)), order))
    inp = {"messages": [("user", "go")]}
    out = asyncio.run(agent.ainvoke(inp)) if use_async else agent.invoke(inp)
    ledger = guard.ledger(out)
    assert (runs["extra"], runs["a"]) == (1, 1)  # the second extra (20 more of the 5 left) is refused
    assert ledger.spent == pytest.approx(runs["extra"] * 20.0 + runs["a"] * 10.0) and ledger.reserved == 0
    assert_each_call_answered_once(msgs_of(out))
    assert_one_record_per_call(msgs_of(out), sink.records)
    extra = [(r.decision, r.execution, r.charged) for r in sink.records if r.tool == "extra" and r.execution]
    assert extra == [("accept", 1, 20.0)]


def test_an_unpriced_tool_close_to_a_priced_name_is_warned_of_as_a_likely_typo():
    # PricedTool("get_qoute", ...) for a tool named get_quote: the warning guessed "a middleware's own tool".
    import warnings

    from intent import UnpricedToolWarning

    guard = BudgetGuard(AcceptAll(), market(get_qoute=1.0), 10.0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        guard.prepare({"messages": []}, {"configurable": {"thread_id": "w"}},
                      offered=[make_tool("get_quote", RunCounter()), make_tool("write_todos", RunCounter())])
    unpriced = sorted(str(w.message) for w in caught if issubclass(w.category, UnpricedToolWarning))
    assert len(unpriced) == 2
    assert "the market prices 'get_qoute': a typo of 'get_quote'?" in unpriced[0]
    assert "typo" not in unpriced[1] and "'write_todos'" in unpriced[1]
