"""A run left with tool calls no ToolMessage answers, then a new message on the thread.

A stream its reader left, a cancelled task, a crash or a new message on an interrupted thread ends a
run before its tool step answered the model's calls. LangGraph keeps the AIMessage; the next run starts
from a history in which those calls have no answer, which OpenAI and Anthropic reject, with or
without the guard. The guard does not rewrite the history (it settles the money: a call that never
ran is released, one that ran is charged, as in tests/test_guard_lifecycle.py). LangChain's answer is
a middleware that answers such calls before the run (deepagents' ``PatchToolCallsMiddleware``: a
``before_agent`` hook writing the history back with a ToolMessage after each unanswered call). These
tests compose the guard with one, in both orders and both gate positions, sync and async: every model
request of the next run has each call answered, the money holds (``spent == Σ runs × price``,
nothing reserved), and each call has one answer and one answering log record.
"""

from __future__ import annotations

import asyncio
import itertools
from typing import Any

import pytest
from langchain.agents import create_agent
from langchain.agents.middleware import AgentMiddleware
from langchain_core.messages import AIMessage, ToolMessage
from langchain_core.tools import StructuredTool
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.types import Overwrite

from intent import AcceptAll, BudgetGuard, Market, MemoryLogSink, PricedTool
from intent.testing import (ScriptedToolModel, ai, assert_each_call_answered_once, assert_one_record_per_call,
                            call)

PRICES = {"slow": 7.0, "echo": 2.0}


class PatchUnansweredCalls(AgentMiddleware):
    """What deepagents' PatchToolCallsMiddleware does: before the run, a ToolMessage after each tool call
    that has none, the history written back whole (``Overwrite``), so it keeps its order."""

    def before_agent(self, state: Any, runtime: Any) -> dict[str, Any] | None:
        messages = state["messages"]
        answered = {m.tool_call_id for m in messages if isinstance(m, ToolMessage)}
        patched: list[Any] = []
        for m in messages:
            patched.append(m)
            if isinstance(m, AIMessage):
                patched += [ToolMessage(f"{c['name']} was not run: the run ended before it could be completed.",
                                        name=c["name"], tool_call_id=c["id"], status="error")
                            for c in m.tool_calls if c["id"] not in answered]
        return {"messages": Overwrite(patched)} if len(patched) != len(messages) else None

    async def abefore_agent(self, state: Any, runtime: Any) -> dict[str, Any] | None:
        return self.before_agent(state, runtime)


class RecordingModel(ScriptedToolModel):
    """The scripted model, keeping every request's messages (what a provider would be sent)."""

    requests: list = []

    def _generate(self, messages: Any, *args: Any, **kwargs: Any) -> Any:
        self.requests.append(list(messages))
        return super()._generate(messages, *args, **kwargs)


def _agent(order: str, gate_at: str, script: list[AIMessage], tools: list[Any]):
    sink = MemoryLogSink()
    guard = BudgetGuard(AcceptAll(), Market([PricedTool(n, p) for n, p in PRICES.items()]), 50.0,
                        log_sink=sink, gate_at=gate_at)
    model = RecordingModel(messages=iter(script), bound=[], executions=[], requests=[])
    middleware = [guard.middleware(), PatchUnansweredCalls()]
    if order == "patch_first":
        middleware.reverse()
    agent = create_agent(model, tools, middleware=middleware, checkpointer=InMemorySaver())
    return agent, guard, model, sink


def _check_next_run(out: dict[str, Any], guard: BudgetGuard, model: RecordingModel, sink: MemoryLogSink,
                    runs: dict[str, int], requests_before: int) -> None:
    assert len(model.requests) > requests_before
    for request in model.requests[requests_before:]:
        # (The model's own reply is not in its request: every AIMessage in it must be answered.)
        assert_each_call_answered_once(request)
    messages = out["messages"]
    assert_each_call_answered_once(messages)
    assert_one_record_per_call(messages, sink.records)
    ledger = guard.ledger(out)
    assert ledger.spent == pytest.approx(sum(n * PRICES[t] for t, n in runs.items()))
    assert ledger.reserved == 0
    assert ledger.spent <= ledger.budget


ORDERS = ["guard_first", "patch_first"]
GATES = ["model_call", "after_model"]


@pytest.mark.parametrize("gate_at", GATES)
@pytest.mark.parametrize("order", ORDERS)
def test_a_call_whose_run_was_left_before_it_ran_is_answered_released_and_never_charged(order, gate_at):
    runs = dict.fromkeys(PRICES, 0)

    def echo(x: int = 0) -> str:
        runs["echo"] += 1
        return str(x)

    def slow(x: int = 0) -> str:
        runs["slow"] += 1
        return "slow"

    tools = [StructuredTool.from_function(f, name=f.__name__, description=f.__name__) for f in (echo, slow)]
    script = [ai(call("slow")), ai(call("echo", x=1)), AIMessage("done")]
    agent, guard, model, sink = _agent(order, gate_at, script, tools)
    config = {"configurable": {"thread_id": "left"}}
    for chunk in agent.stream({"messages": [("user", "go")]}, config, stream_mode="updates"):
        if any(part and "messages" in part and any(isinstance(m, AIMessage) and m.tool_calls
                                                   for m in _messages_of(part)) for part in chunk.values()):
            break  # the reader leaves once the model has asked for `slow`: the tool step never runs
    assert runs["slow"] == 0
    before = len(model.requests)
    out = agent.invoke({"messages": [("user", "go on")]}, config)
    assert runs == {"slow": 0, "echo": 1}
    _check_next_run(out, guard, model, sink, runs, before)


@pytest.mark.parametrize("gate_at", GATES)
@pytest.mark.parametrize("order", ORDERS)
def test_a_call_cancelled_while_it_ran_is_answered_and_charged_once(order, gate_at):
    runs = dict.fromkeys(PRICES, 0)
    started = asyncio.Event()

    async def slow(x: int = 0) -> str:
        runs["slow"] += 1
        started.set()
        await asyncio.sleep(10)
        return "never"

    async def echo(x: int = 0) -> str:
        runs["echo"] += 1
        return str(x)

    tools = [StructuredTool.from_function(coroutine=f, name=f.__name__, description=f.__name__) for f in (slow, echo)]
    script = [ai(call("slow")), ai(call("echo", x=1)), AIMessage("done")]
    agent, guard, model, sink = _agent(order, gate_at, script, tools)
    config = {"configurable": {"thread_id": "cancelled"}}

    before: list[int] = []

    async def main() -> dict[str, Any]:
        task = asyncio.create_task(agent.ainvoke({"messages": [("user", "go")]}, config))
        await started.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        before.append(len(model.requests))
        return await agent.ainvoke({"messages": [("user", "go on")]}, config)

    out = asyncio.run(main())
    assert runs == {"slow": 1, "echo": 1}  # the cancelled call ran: money spent is spent
    _check_next_run(out, guard, model, sink, runs, before[0])


def _messages_of(part: Any) -> list[Any]:
    messages = part.get("messages") if isinstance(part, dict) else None
    if isinstance(messages, Overwrite):
        messages = messages.value
    return list(messages or [])


def test_without_a_patcher_the_next_run_sends_the_unanswered_call():
    # What the patcher is for (LangGraph's behaviour, with or without the guard): the check above fails
    # without it, so the tests above can tell a patched history from an unpatched one.
    runs = itertools.count()
    tool = StructuredTool.from_function(lambda x=0: str(next(runs)), name="slow", description="slow")
    guard = BudgetGuard(AcceptAll(), Market([PricedTool("slow", 7.0), PricedTool("echo", 2.0)]), 50.0)
    model = RecordingModel(messages=iter([ai(call("slow")), AIMessage("done")]), bound=[], executions=[],
                           requests=[])
    agent = create_agent(model, [tool], middleware=[guard.middleware()], checkpointer=InMemorySaver())
    config = {"configurable": {"thread_id": "unpatched"}}
    for _ in agent.stream({"messages": [("user", "go")]}, config, stream_mode="updates"):
        break
    out = agent.invoke({"messages": [("user", "go on")]}, config)
    with pytest.raises(AssertionError, match="has 0 ToolMessages"):
        assert_each_call_answered_once(model.requests[-1])
    assert guard.ledger(out).reserved == 0 and guard.ledger(out).spent == 0


@pytest.mark.parametrize("order", ORDERS)
def test_a_patched_call_with_a_thread_model_call_limit_has_one_record(order):
    # With a thread's model-call limit ending the next run: the patched call the after_model gate never saw
    # is logged once (not by both the new run's start and its end), and nothing was spent or held.
    from langchain.agents.middleware import ModelCallLimitMiddleware

    tools = [StructuredTool.from_function(lambda x=0: "ran", name=n, description=n) for n in PRICES]
    sink = MemoryLogSink()
    guard = BudgetGuard(AcceptAll(), Market([PricedTool(n, p) for n, p in PRICES.items()]), 50.0,
                        log_sink=sink, gate_at="after_model")
    model = RecordingModel(messages=iter([ai(call("slow")), AIMessage("done")]), bound=[], executions=[],
                           requests=[])
    middleware = [guard.middleware(), PatchUnansweredCalls(),
                  ModelCallLimitMiddleware(thread_limit=1, exit_behavior="end")]
    if order == "patch_first":
        middleware.reverse()
    agent = create_agent(model, tools, middleware=middleware, checkpointer=InMemorySaver())
    config = {"configurable": {"thread_id": "limited"}}
    for chunk in agent.stream({"messages": [("user", "go")]}, config, stream_mode="updates"):
        if any(part and any(isinstance(m, AIMessage) and m.tool_calls for m in _messages_of(part))
               for part in chunk.values()):
            break
    out = agent.invoke({"messages": [("user", "go on")]}, config)
    assert_each_call_answered_once(out["messages"])
    assert_one_record_per_call(out["messages"], sink.records)
    ledger = guard.ledger(out)
    assert (ledger.spent, ledger.reserved) == (0, 0)


class _FailsOnce(RecordingModel):
    """Fails the request numbered ``fail_at`` (a provider's 503), once."""

    fail_at: int = -1

    def _generate(self, messages: Any, *args: Any, **kwargs: Any) -> Any:
        if len(self.requests) == self.fail_at:
            self.fail_at = -1
            self.requests.append(list(messages))
            raise RuntimeError("provider 503")
        return super()._generate(messages, *args, **kwargs)


@pytest.mark.parametrize("how", ["outer_retry", "crash_then_new_message"])
def test_a_patched_call_is_logged_once_when_the_next_runs_first_step_is_lost(how):
    # The next run's first model call fails, so its step's update (with the patched call's `answered` decision)
    # never reaches state; the retried step (ModelRetryMiddleware before the guard) or the run after the crash
    # settles again and must not log the call a second time (final review: two records).
    from langchain.agents.middleware import ModelRetryMiddleware

    tools = [StructuredTool.from_function(lambda x=0: "ran", name=n, description=n) for n in PRICES]
    sink = MemoryLogSink()
    guard = BudgetGuard(AcceptAll(), Market([PricedTool(n, p) for n, p in PRICES.items()]), 50.0,
                        log_sink=sink, gate_at="after_model")
    model = _FailsOnce(messages=iter([ai(call("slow")), AIMessage("done")]), bound=[], executions=[], requests=[])
    middleware = [PatchUnansweredCalls(), guard.middleware()]
    if how == "outer_retry":
        middleware.insert(0, ModelRetryMiddleware(max_retries=2, initial_delay=0.0, jitter=False))
    agent = create_agent(model, tools, middleware=middleware, checkpointer=InMemorySaver())
    config = {"configurable": {"thread_id": "lost"}}
    for chunk in agent.stream({"messages": [("user", "go")]}, config, stream_mode="updates"):
        if any(part and any(isinstance(m, AIMessage) and m.tool_calls for m in _messages_of(part))
               for part in chunk.values()):
            break  # left before the after_model gate saw the reply
    model.fail_at = len(model.requests)
    if how == "outer_retry":
        out = agent.invoke({"messages": [("user", "go on")]}, config)
    else:
        with pytest.raises(RuntimeError, match="provider 503"):
            agent.invoke({"messages": [("user", "go on")]}, config)
        out = agent.invoke({"messages": [("user", "again")]}, config)
    assert_one_record_per_call(out["messages"], sink.records)
    ledger = guard.ledger(out)
    assert (ledger.spent, ledger.reserved) == (0, 0)
