"""Models other middleware call (a summariser) are charged to the run's episode: guard.metered_model.

Money is counted outside the guard: each model counts its executions, and every execution reports
fixed usage, so what was spent is (agent executions x agent cost) + (summaries x summary cost).
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from langchain.agents import create_agent
from langchain.agents.middleware import AgentMiddleware, SummarizationMiddleware
from langchain_core.callbacks import AsyncCallbackHandler
from langchain_core.messages import AIMessage, ToolMessage
from langchain_core.tools import StructuredTool
from langgraph.checkpoint.memory import InMemorySaver

from intent import (
    AcceptAll,
    BudgetGuard,
    GuardConfigError,
    Market,
    MemoryLogSink,
    MeteredModelRefused,
    ModelPrice,
    PricedTool,
)
from intent.state import LEDGER_KEY
from intent.testing import ReactiveToolModel, RunCounter, TurnInfo, ai, call

PRICE = ModelPrice(input_per_mtok=1000.0, output_per_mtok=1000.0)  # 0.001 per token
AGENT_USAGE, SUMMARY_USAGE = (10, 5), (200, 50)
AGENT_COST, SUMMARY_COST = 15 * 0.001, 250 * 0.001
USER = {"messages": [("user", "count to six with a")]}


def counting_agent(runs: RunCounter, until: int = 6, fail_at: int = 0) -> ReactiveToolModel:
    """Calls tool ``a`` with x = last result + 1 until x reaches ``until``, then answers; its ``fail_at``-th
    execution (counted in ``runs``) raises, as a provider outage would, before any usage."""

    def reply(messages: list, info: TurnInfo) -> AIMessage:
        if info.execution == fail_at:
            raise RuntimeError("model down")
        last = next((m for m in reversed(messages) if isinstance(m, ToolMessage)), None)
        x = int(str(last.content).split("=")[1]) if last is not None else 0
        return AIMessage("done") if x >= until else ai(call("a", x=x + 1))

    return ReactiveToolModel(reply=reply, model_name="agent-model", usage=AGENT_USAGE, runs=runs)


def summary_model(runs: RunCounter, fail_on: Any = ()) -> ReactiveToolModel:
    """Always the same summary, with SUMMARY_USAGE; the executions in ``fail_on`` raise first."""
    return ReactiveToolModel(reply=lambda messages, info: "summary of earlier turns", model_name="summary-model",
                             usage=SUMMARY_USAGE, runs=runs, fail_on=frozenset(fail_on))


def _tool_a() -> StructuredTool:
    return StructuredTool.from_function(lambda x=0: f"n={x}", name="a", description="Tool a.")


class Setup:
    def __init__(self, budget: float = 50.0, *, checkpointer: Any = None, fail_on: Any = (), tool_price: float = 0.0,
                 summarise: bool = True, until: int = 6) -> None:
        self.sink = MemoryLogSink()
        self.guard = BudgetGuard(AcceptAll(), Market([PricedTool("a", tool_price)]), budget, log_sink=self.sink,
                                 model_prices={"agent-model": PRICE, "summary-model": PRICE}, max_output_tokens=100)
        self.agent_runs, self.summary_runs = RunCounter(), RunCounter()
        self.summariser = summary_model(self.summary_runs, fail_on)
        middleware: list[Any] = []
        if summarise:
            middleware.append(SummarizationMiddleware(self.guard.metered_model(self.summariser),
                                                      trigger=("messages", 4), keep=("messages", 2)))
        middleware.append(self.guard.middleware())
        self.agent = create_agent(counting_agent(self.agent_runs, until=until), [_tool_a()],
                                  middleware=middleware, checkpointer=checkpointer)

    def run(self, use_async: bool, inp: Any = USER, config: Any = None) -> Any:
        return asyncio.run(self.agent.ainvoke(inp, config)) if use_async else self.agent.invoke(inp, config)

    def expected(self) -> float:
        return self.agent_runs.total() * AGENT_COST + self.summary_runs.total() * SUMMARY_COST

    def model_records(self, episode: str | None = None) -> list[Any]:
        return [r for r in self.sink.records if r.kind == "model" and (episode is None or r.task_id == episode)]


def committed(channel: Any) -> float:
    return sum(e["amount"] for e in channel["entries"].values() if e["status"] == "committed")


@pytest.mark.parametrize("use_async", [False, True])
@pytest.mark.parametrize("thread", [True, False])
def test_the_summarisers_executions_are_charged_to_the_runs_episode(thread, use_async):
    saver = InMemorySaver() if thread else None
    config = {"configurable": {"thread_id": "T"}} if thread else None
    s = Setup(checkpointer=saver)
    out = s.run(use_async, config=config)
    assert any("summary of earlier turns" in str(m.content) for m in out["messages"])  # it did summarise
    assert s.summary_runs.total() >= 2
    ledger = s.guard.ledger(out)
    assert ledger.spent == pytest.approx(s.expected()) and ledger.spent <= ledger.budget
    assert ledger.reserved == 0
    records = s.model_records()
    assert len(records) == s.agent_runs.total() + s.summary_runs.total()  # one record per execution
    assert {r.task_id for r in records} == {out[LEDGER_KEY]["episode_id"]}
    assert sorted({r.reason for r in records if r.tool == "summary-model"}) == ["metered_model:summarization"]
    assert sum(r.charged for r in records) == pytest.approx(s.expected())
    assert committed(out[LEDGER_KEY]) == pytest.approx(s.expected())  # graph state has every charge
    if saver is not None:
        assert committed(s.agent.get_state(config).values[LEDGER_KEY]) == pytest.approx(s.expected())


def test_concurrent_runs_without_a_thread_each_pay_for_their_own_summaries():
    s = Setup()

    async def three() -> list[Any]:
        return list(await asyncio.gather(*(s.agent.ainvoke(USER) for _ in range(3))))

    outs = asyncio.run(three())
    assert len({o[LEDGER_KEY]["episode_id"] for o in outs}) == 3
    for out in outs:
        records = s.model_records(out[LEDGER_KEY]["episode_id"])
        agent_n = sum(1 for r in records if r.tool == "agent-model")
        summary_n = sum(1 for r in records if r.tool == "summary-model")
        assert summary_n >= 2
        assert committed(out[LEDGER_KEY]) == pytest.approx(agent_n * AGENT_COST + summary_n * SUMMARY_COST)
    assert len(s.model_records()) == s.agent_runs.total() + s.summary_runs.total()


@pytest.mark.parametrize("use_async", [False, True])
def test_a_failed_summary_execution_is_released_and_its_retry_charged(use_async):
    s = Setup(fail_on={1})  # SummarizationMiddleware retries its model
    out = s.run(use_async)
    ledger = s.guard.ledger(out)
    assert ledger.spent == pytest.approx(
        s.agent_runs.total() * AGENT_COST + (s.summary_runs.total() - 1) * SUMMARY_COST)
    assert ledger.reserved == 0
    errors = [r for r in s.model_records() if r.status == "error"]
    assert [(r.tool, r.charged) for r in errors] == [("summary-model", 0.0)]


@pytest.mark.parametrize("use_async", [False, True])
def test_a_thread_resumed_by_a_fresh_guard_keeps_what_it_spent(use_async):
    # Run 1 (no summariser) spends most of the budget. A new guard (another process) resumes the
    # thread; the summariser runs before the guard's first hook of the run. Its worst case does not
    # fit what the thread has left, so it is not made (a fresh ledger would have let it through).
    saver, config = InMemorySaver(), {"configurable": {"thread_id": "R"}}
    first = Setup(7.0, checkpointer=saver, tool_price=1.0, summarise=False)
    first.run(use_async, config=config)
    spent_before = committed(first.agent.get_state(config).values[LEDGER_KEY])
    assert spent_before == pytest.approx(6 + first.agent_runs.total() * AGENT_COST)
    second = Setup(7.0, checkpointer=saver, tool_price=1.0)
    with pytest.raises(MeteredModelRefused, match="costs"):
        second.run(use_async, {"messages": [("user", "again")]}, config)
    assert second.summary_runs.total() == 0  # refused once, not retried by SummarizationMiddleware
    assert [(r.tool, r.reason, r.charged) for r in second.model_records()] == [
        ("summary-model", "model_over_budget", 0.0)]
    ledger = second.guard.episodes.peek("R").ledger
    assert ledger.spent == pytest.approx(spent_before) and ledger.reserved == 0


@pytest.mark.parametrize("use_async", [False, True])
def test_a_thread_resumed_by_a_fresh_guard_charges_on_top_of_state(use_async):
    saver, config = InMemorySaver(), {"configurable": {"thread_id": "S"}}
    first = Setup(checkpointer=saver)
    first.run(use_async, config=config)
    before = committed(first.agent.get_state(config).values[LEDGER_KEY])
    second = Setup(checkpointer=saver)
    out = second.run(use_async, {"messages": [("user", "again")]}, config)
    assert second.summary_runs.total() >= 1
    assert committed(out[LEDGER_KEY]) == pytest.approx(before + second.expected())
    assert committed(second.agent.get_state(config).values[LEDGER_KEY]) == pytest.approx(before + second.expected())


class Reviewer(AgentMiddleware):
    """Calls a model in after_model on the final answer: the run ends right after it."""

    def __init__(self, model: Any) -> None:
        super().__init__()
        self.model = model

    def after_model(self, state: Any, runtime: Any) -> None:
        last = state["messages"][-1]
        if isinstance(last, AIMessage) and not last.tool_calls:
            self.model.invoke("review: " + str(last.content))

    async def aafter_model(self, state: Any, runtime: Any) -> None:
        last = state["messages"][-1]
        if isinstance(last, AIMessage) and not last.tool_calls:
            await self.model.ainvoke("review: " + str(last.content))


@pytest.mark.parametrize("use_async", [False, True])
def test_a_charge_after_the_last_model_step_reaches_the_checkpoint(use_async):
    saver, config = InMemorySaver(), {"configurable": {"thread_id": "V"}}
    s = Setup(checkpointer=saver, summarise=False, until=1)
    reviewer = Reviewer(s.guard.metered_model(summary_model(s.summary_runs)))
    s.agent = create_agent(counting_agent(s.agent_runs, until=1), [_tool_a()],
                           middleware=[reviewer, s.guard.middleware()], checkpointer=saver)
    out = s.run(use_async, config=config)
    assert s.summary_runs.total() == 1
    assert committed(s.agent.get_state(config).values[LEDGER_KEY]) == pytest.approx(s.expected())
    assert s.guard.ledger(out).reserved == 0
    assert [r.reason for r in s.model_records() if r.tool == "summary-model"] == ["metered_model"]


@pytest.mark.parametrize("use_async", [False, True])
@pytest.mark.parametrize("thread", [True, False])
def test_a_metered_copy_used_as_the_agents_own_model_is_charged_once(thread, use_async):
    saver = InMemorySaver() if thread else None
    s = Setup(summarise=False)
    s.agent = create_agent(s.guard.metered_model(counting_agent(s.agent_runs)), [_tool_a()],
                           middleware=[s.guard.middleware()], checkpointer=saver)
    out = s.run(use_async, config={"configurable": {"thread_id": "O"}} if thread else None)
    assert out["messages"][-1].content == "done" and s.agent_runs.total() == 7  # six calls to a, then the answer
    assert s.guard.ledger(out).spent == pytest.approx(7 * AGENT_COST)
    assert [r.reason for r in s.model_records()] == ["accepted"] * 7


def test_a_run_without_a_thread_cannot_pay_for_a_summary_before_its_first_model_step():
    # A long first input makes the summariser run before the guard has named the run's episode.
    s = Setup()
    long_input = {"messages": [("user", f"message {i}") for i in range(6)]}
    with pytest.raises(MeteredModelRefused, match="thread_id"):
        s.agent.invoke(long_input)
    assert s.summary_runs.total() == 0
    with_thread = Setup(checkpointer=InMemorySaver())  # with a thread it is the thread's new episode
    out = with_thread.agent.invoke(long_input, {"configurable": {"thread_id": "L"}})
    assert with_thread.summary_runs.total() >= 1
    assert committed(out[LEDGER_KEY]) == pytest.approx(with_thread.expected())


def test_without_the_state_reader_only_an_episode_loaded_from_state_can_pay(monkeypatch):
    # A LangGraph without the task-local reader: the thread's episode as this process loaded it.
    import intent.metered_models as metered

    monkeypatch.setattr(metered, "read_ledger_channel", lambda config: (False, None))
    saver, config = InMemorySaver(), {"configurable": {"thread_id": "W"}}
    first = Setup(checkpointer=saver)
    first.run(False, config=config)  # loads the episode at its first model step, before any summary
    assert first.summary_runs.total() >= 2
    assert committed(first.agent.get_state(config).values[LEDGER_KEY]) == pytest.approx(first.expected())
    second = Setup(checkpointer=saver)  # a fresh process: the summary would run before the guard loads
    with pytest.raises(MeteredModelRefused, match="does not let"):
        second.run(False, {"messages": [("user", "again")]}, config)
    assert second.summary_runs.total() == 0


def test_metered_model_needs_a_price_table():
    guard = BudgetGuard(AcceptAll(), Market([PricedTool("a", 1.0)]), 10.0)
    with pytest.raises(GuardConfigError, match="model_prices"):
        guard.metered_model(summary_model(RunCounter()))
    priced = BudgetGuard(AcceptAll(), Market([PricedTool("a", 1.0)]), 10.0, model_prices={"gpt-4o-mini": PRICE})
    with pytest.raises(TypeError, match="chat model"):
        priced.metered_model(object())


def test_metered_model_takes_a_provider_string_and_bounds_its_output(monkeypatch):
    # As SummarizationMiddleware takes "openai:gpt-4o-mini", so does metered_model; a model without an
    # output bound gets the guard's max_output_tokens, so the worst case held is the provider's limit too.
    monkeypatch.setenv("OPENAI_API_KEY", "not-used")  # the model is built, never called
    guard = BudgetGuard(AcceptAll(), Market([PricedTool("a", 1.0)]), 10.0, model_prices={"gpt-4o-mini": PRICE},
                        max_output_tokens=123)
    model = guard.metered_model("openai:gpt-4o-mini")
    assert model.model_name == "gpt-4o-mini" and model.max_tokens == 123
    assert [type(h).__name__ for h in model.callbacks] == ["MeteredModelCallback"]


def selector_model(runs: RunCounter) -> ReactiveToolModel:
    """LLMToolSelectorMiddleware's model: picks tool ``a`` through structured output (a tool call)."""
    return ReactiveToolModel(reply=lambda messages, info: ai(call(info.tools[0], tools=["a"])),
                             model_name="summary-model", usage=SUMMARY_USAGE, runs=runs)  # priced as the summariser


@pytest.mark.parametrize("use_async", [False, True])
@pytest.mark.parametrize("selector_first", [True, False])
def test_a_tool_selectors_model_is_charged_in_either_order(selector_first, use_async):
    # LLMToolSelectorMiddleware calls its model inside its wrap_model_call: inside the guard's model
    # call when listed after the guard (the guard's step names the episode, even on the first step of a
    # run without a thread), outside it when listed first (then the run's state must name the episode:
    # with a thread; without one the first selection cannot be placed and is refused, never free).
    from langchain.agents.middleware import LLMToolSelectorMiddleware

    def build(s: Setup, saver: Any = None) -> None:
        b = StructuredTool.from_function(lambda: "b", name="b", description="Tool b.")
        selector = LLMToolSelectorMiddleware(model=s.guard.metered_model(selector_model(s.summary_runs)),
                                             max_tools=1)
        stack = [selector, s.guard.middleware()] if selector_first else [s.guard.middleware(), selector]
        s.agent = create_agent(counting_agent(s.agent_runs, until=3), [_tool_a(), b], middleware=stack,
                               checkpointer=saver)

    if selector_first:
        unplaced = Setup(summarise=False)
        build(unplaced)
        with pytest.raises(MeteredModelRefused, match="thread_id"):
            unplaced.run(use_async)
        assert unplaced.summary_runs.total() == 0 and unplaced.agent_runs.total() == 0
    s = Setup(summarise=False, until=3)
    saver = InMemorySaver() if selector_first else None
    build(s, saver)
    out = s.run(use_async, config={"configurable": {"thread_id": "sel"}} if selector_first else None)
    assert s.agent_runs.total() == 4 and s.summary_runs.total() == 4  # one selection before each model call
    ledger = s.guard.ledger(out)
    assert ledger.spent == pytest.approx(s.expected()) and ledger.reserved == 0
    assert sorted({r.reason for r in s.model_records() if r.tool == "summary-model"}) == [
        "metered_model:tool_selection"]
    assert {r.query for r in s.model_records()} == {"count to six with a"}  # the first selection's too
    assert committed(out[LEDGER_KEY]) == pytest.approx(s.expected())


def emulator_model(runs: RunCounter) -> ReactiveToolModel:
    """LLMToolEmulator's model: answers tool a's call as the tool would ("n=<x>")."""

    def reply(messages: list, info: TurnInfo) -> str:
        import re

        x = re.search(r"'x': (\d+)", str(messages[-1].content)).group(1)
        return f"n={x}"

    return ReactiveToolModel(reply=reply, model_name="summary-model", usage=SUMMARY_USAGE, runs=runs)


@pytest.mark.parametrize("use_async", [False, True])
@pytest.mark.parametrize("emulator_first", [True, False])
def test_a_tool_emulators_model_is_charged_and_the_emulated_tool_is_not(emulator_first, use_async):
    # LLMToolEmulator answers tool a's calls with its model instead of running the tool: inside the
    # guard's tool step when listed after the guard, before it when listed first. The tool never runs,
    # so it costs nothing; each emulation is paid. A tool step always follows a model step, so the
    # run's state names the episode even without a thread.
    from langchain.agents.middleware import LLMToolEmulator

    s = Setup(summarise=False, tool_price=1.0, until=3)
    emulator = LLMToolEmulator(tools=["a"], model=s.guard.metered_model(emulator_model(s.summary_runs)))
    stack = [emulator, s.guard.middleware()] if emulator_first else [s.guard.middleware(), emulator]
    s.agent = create_agent(counting_agent(s.agent_runs, until=3), [_tool_a()], middleware=stack)
    out = s.run(use_async)
    assert s.agent_runs.total() == 4 and s.summary_runs.total() == 3  # three emulated calls to a
    ledger = s.guard.ledger(out)
    assert ledger.spent_by_kind() == {"model": pytest.approx(s.expected())}  # tool a never ran: not charged
    assert ledger.reserved == 0
    assert sorted({r.reason for r in s.model_records() if r.tool == "summary-model"}) == [
        "metered_model:tool_emulation"]


@pytest.mark.parametrize("use_async", [False, True])
def test_a_sub_agent_without_a_guard_pays_its_metered_model_from_the_parents_tool_call(use_async):
    # A tool starts a sub-agent (a plain create_agent graph: no guard, no ledger channel in its state)
    # whose model is the parent guard's metered copy, as deepagents' general-purpose sub-agent uses the
    # main model. Its executions are paid by the parent's tool call; nothing reads a channel it lacks.
    s = Setup(summarise=False, until=1)
    child_runs = RunCounter()
    child_model = s.guard.metered_model(counting_agent(child_runs, until=2))

    def delegate(q: str = "") -> str:
        child = create_agent(child_model, [_tool_a()])
        child.invoke({"messages": [("user", q)]})
        return "n=1"  # what the parent's counting model reads

    async def adelegate(q: str = "") -> str:
        child = create_agent(child_model, [_tool_a()])
        await child.ainvoke({"messages": [("user", q)]})
        return "n=1"

    tool = StructuredTool.from_function(delegate, coroutine=adelegate, name="a", description="Delegate.")
    parent_model = counting_agent(s.agent_runs, until=1)
    s.agent = create_agent(parent_model, [tool], middleware=[s.guard.middleware()])
    out = s.run(use_async)
    assert child_runs.total() == 3 and s.agent_runs.total() == 2  # the child called its a twice then answered
    ledger = s.guard.ledger(out)
    assert ledger.spent == pytest.approx((s.agent_runs.total() + child_runs.total()) * AGENT_COST)
    assert ledger.reserved == 0
    assert committed(out[LEDGER_KEY]) == pytest.approx(ledger.spent)
    assert len(s.model_records()) == s.agent_runs.total() + child_runs.total()


def test_metered_model_refuses_a_completion_model():
    # A completion (non-chat) model's runs start with on_llm_start, which the meter does not price:
    # refused when wrapped, rather than never charged.
    from langchain_core.language_models.fake import FakeListLLM

    guard = BudgetGuard(AcceptAll(), Market([PricedTool("a", 1.0)]), 10.0, model_prices={"summary-model": PRICE})
    with pytest.raises(TypeError, match="chat model"):
        guard.metered_model(FakeListLLM(responses=["x"]))


@pytest.mark.parametrize("use_async", [False, True])
def test_a_summary_charge_survives_a_crash_of_the_next_model_step(use_async):
    # The summariser runs (and is paid) in its own node; then the agent's model step fails and the run
    # dies. The summary's charge is in the checkpoint with the summary itself, so a fresh guard that
    # resumes the thread (another process) counts it.
    saver, config = InMemorySaver(), {"configurable": {"thread_id": "C"}}

    def build(s: Setup, fail_at: int) -> None:
        s.agent = create_agent(counting_agent(s.agent_runs, fail_at=fail_at), [_tool_a()], middleware=[
            SummarizationMiddleware(s.guard.metered_model(s.summariser), trigger=("messages", 4), keep=("messages", 2)),
            s.guard.middleware()], checkpointer=saver)

    first = Setup(checkpointer=saver)
    build(first, fail_at=3)  # the third model execution fails, after the first summary
    with pytest.raises(RuntimeError, match="model down"):
        first.run(use_async, config=config)
    assert first.summary_runs.total() == 1
    paid = (first.agent_runs.total() - 1) * AGENT_COST + SUMMARY_COST  # the failed execution is not billed
    assert committed(first.agent.get_state(config).values[LEDGER_KEY]) == pytest.approx(paid)
    second = Setup(checkpointer=saver)
    second.agent_runs, second.summary_runs, second.summariser = first.agent_runs, first.summary_runs, first.summariser
    build(second, fail_at=0)
    out = asyncio.run(second.agent.ainvoke(None, config)) if use_async else second.agent.invoke(None, config)
    paid = (first.agent_runs.total() - 1) * AGENT_COST + first.summary_runs.total() * SUMMARY_COST
    assert second.guard.ledger(out).spent == pytest.approx(paid)


@pytest.mark.parametrize("mode", ["updates", "messages", "values"])
def test_a_streamed_run_charges_the_summariser_as_an_invoked_one(mode):
    saver, config = InMemorySaver(), {"configurable": {"thread_id": f"stream-{mode}"}}
    s = Setup(checkpointer=saver)
    chunks = list(s.agent.stream(USER, config, stream_mode=mode))
    assert chunks and s.summary_runs.total() >= 2
    state = s.agent.get_state(config).values
    assert committed(state[LEDGER_KEY]) == pytest.approx(s.expected())
    assert s.guard.ledger(state).reserved == 0


def test_the_task_local_reader_and_writer_keys_are_langgraphs():
    # intent.state reads and writes the running task's state with two LangGraph-internal config keys.
    # A LangGraph that renames them would silently degrade metered models to the fallbacks: fail here.
    from langgraph._internal._constants import CONFIG_KEY_READ, CONFIG_KEY_SEND

    import intent.state as state

    assert (state._CONFIG_KEY_READ, state._CONFIG_KEY_SEND) == (CONFIG_KEY_READ, CONFIG_KEY_SEND)


def test_a_model_class_that_cannot_be_subclassed_plainly_is_still_metered():
    # The metered copy's class is a same-named subclass of the model's class (to see a cancelled agenerate);
    # a class whose __init_subclass__ needs a keyword cannot be subclassed so: its copy stays of its class
    # (was: TypeError from guard.metered_model).
    from intent.testing import BilledChatModel, ModelRuns

    class Base(BilledChatModel):
        def __init_subclass__(cls, *, provider: str, **kwargs: Any) -> None:
            super().__init_subclass__(**kwargs)
            cls.provider_name = provider

    class Mine(Base, provider="acme"):
        pass

    guard = BudgetGuard(AcceptAll(), Market([]), 5.0, model_prices={"sel": ModelPrice(0.0, 10000.0)},
                        charge_models=False, max_output_tokens=100)
    runs = ModelRuns()
    model = guard.metered_model(Mine(model_name="sel", runs=runs, tokens=(0, 100)))
    assert type(model) is Mine
    plain = guard.metered_model(BilledChatModel(model_name="sel", runs=runs, tokens=(0, 100)))
    assert type(plain) is not BilledChatModel and isinstance(plain, BilledChatModel)
    assert type(plain).__name__ == "BilledChatModel" and plain.get_name() == "BilledChatModel"


def _side_guard(**kwargs: Any) -> BudgetGuard:
    """A guard pricing the agent's scripted model and a "side-model" at PRICE, its output bound 64 tokens (a side
    model's worst case: the input plus 64 out)."""
    return BudgetGuard(AcceptAll(), Market([PricedTool("a", 1.0)]), 10.0, max_output_tokens=64,
                       model_prices={"scripted-model": PRICE, "side-model": PRICE}, **kwargs)


class SlowTracer(AsyncCallbackHandler):
    """A user's async tracer, in line and ahead of the guard's meter (config callbacks come before a model's own),
    that takes a while to record each model run's end: LangChain awaits it before the meter hears the end."""

    run_inline = True

    async def on_llm_end(self, response: Any, **kwargs: Any) -> None:
        await asyncio.sleep(0.3)


@pytest.mark.parametrize("version", ["v2", "v3"])
@pytest.mark.parametrize("store", ["memory", "postgres"])
def test_an_event_streams_run_is_charged_what_it_reported_when_its_reader_finishes_first(request, store, version):
    """astream_events(version="v3") runs the model in a producer task of its own, which reports the run's end after
    the reader has seen the last event (v2 runs it in a task of its own too): the middleware that read the stream (and its graph task) may be done
    before the meter hears the end. The run is charged its reported usage, once, not the worst case as a
    cancelled run (what the task that started it being done used to mean)."""
    from langchain_core.messages import HumanMessage

    from intent.testing import BilledChatModel, ModelRuns, scripted

    kwargs: dict[str, Any] = {}
    if store == "postgres":
        import uuid

        from intent.stores import open_store

        shared = open_store(request.getfixturevalue("postgres_dsn"))
        key = f"v3-{uuid.uuid4().hex[:12]}"
        shared.create_budget(key, 10.0)
        kwargs = {"store": shared, "budget_key": key}
    runs = ModelRuns()
    guard = _side_guard(**kwargs)
    side = guard.metered_model(BilledChatModel(model_name="side-model", runs=runs))  # reports (10, 100)

    class AskASideModel(AgentMiddleware):
        async def abefore_model(self, state, runtime):
            if version == "v3":
                events = [e async for e in await side.astream_events("a side question", version="v3")]
                assert events[-1]["event"] == "message-finish"
            else:
                events = [e async for e in side.astream_events("a side question", version="v2")]
                assert events[-1]["event"] == "on_chat_model_end"
            return None

    agent = create_agent(scripted([ai(text="done", usage=AGENT_USAGE)]), [],
                         middleware=[AskASideModel(), guard.middleware()])
    out = asyncio.run(agent.ainvoke({"messages": [HumanMessage("go")]},
                                    {"configurable": {"thread_id": f"{version}-{store}"}, "callbacks": [SlowTracer()]}))
    assert runs.names() == ["side-model"]
    side_cost = 110 * 0.001
    assert sorted(round(e.amount, 9) for e in guard.ledger(out).entries() if e.status == "committed") == [
        AGENT_COST, side_cost]
    if store == "postgres":
        assert shared.spent(key) == pytest.approx(AGENT_COST + side_cost) and shared.reserved(key) == 0.0


def test_a_sync_v3_event_stream_dropped_before_its_end_is_charged_once_collected():
    """stream_events(version="v3") pulls the model as its reader reads, and reports the run's end with its last
    event; LangChain's sync stream has no close, so a reader that stops early leaves the run open. Its reservation
    was held for good (the thread's budget smaller in every later run). Charged as a cancelled run (the reserved
    worst case: the provider bills what it generated) once Python collects the stream."""
    import gc
    import threading

    from intent.metered_models import MeteredModelCallback
    from intent.testing import BilledChatModel, ModelRuns, scripted

    runs = ModelRuns()
    guard = _side_guard()
    side = guard.metered_model(BilledChatModel(model_name="side-model", runs=runs))

    class ReadsOneEvent(AgentMiddleware):
        def before_model(self, state, runtime):
            stream = side.stream_events("a side question", version="v3")
            assert next(iter(stream))["event"] == "message-start"
            del stream
            # The stream is in a reference cycle: collected by the cyclic collector, which may run while the
            # collecting thread holds the meter's lock (any allocation can start it): the charge must not run
            # there (it needs that lock) but at the next safe point, the guard's model step below.
            [meter] = [h for h in side.callbacks if isinstance(h, MeteredModelCallback)]
            collected = threading.Event()

            def collect() -> None:
                with meter._lock:
                    gc.collect()
                collected.set()

            threading.Thread(target=collect, daemon=True).start()
            assert collected.wait(30), "the dropped stream's charge ran inside the collector: deadlocked"
            return None

    agent = create_agent(scripted([ai(text="done", usage=AGENT_USAGE)]), [],
                         middleware=[ReadsOneEvent(), guard.middleware()])
    out = agent.invoke({"messages": [("user", "go")]}, {"configurable": {"thread_id": "dropped-v3"}})
    assert runs.names() == ["side-model"]
    ledger = guard.ledger(out)
    assert ledger.reserved == 0
    worst_case = [e.amount for e in ledger.entries() if e.status == "committed" and e.amount != AGENT_COST]
    assert len(worst_case) == 1 and worst_case[0] >= 64 * 0.001  # at least the output bound: the worst case


def test_a_dropped_v3_stream_of_a_guard_on_a_store_is_not_charged_on_another_guards_event_loop(monkeypatch):
    """The queue of dropped streams' runs is the process's: the next guard hook drains it, whichever guard's. A
    guard without a store runs its async hooks on the event loop; a run of a guard on a store is charged there
    only off the loop (its commit waits on the store: every task on the loop would wait with it), by that
    guard's next hook."""
    import gc
    import uuid

    from langchain_core.messages import HumanMessage

    from intent.stores import open_store
    from intent.testing import BilledChatModel, ModelRuns, scripted

    store = open_store("memory://")
    key = f"dropped-{uuid.uuid4().hex[:8]}"
    store.create_budget(key, 10.0)
    on_loop: list[str] = []
    for name in ("commit", "release"):
        def on_store(*args: Any, _op: Any = getattr(store, name), _name: str = name, **kwargs: Any) -> Any:
            try:
                asyncio.get_running_loop()
                on_loop.append(_name)
            except RuntimeError:
                pass
            return _op(*args, **kwargs)

        monkeypatch.setattr(store, name, on_store)
    runs = ModelRuns()
    on_a_store = _side_guard(store=store, budget_key=key)
    side = on_a_store.metered_model(BilledChatModel(model_name="side-model", runs=runs))
    kept: list[Any] = []

    class ReadsOneEvent(AgentMiddleware):
        def before_model(self, state, runtime):
            stream = side.stream_events("a side question", version="v3")
            assert next(iter(stream))["event"] == "message-start"
            kept.append(stream)  # (dropped after this run: no hook of this guard comes after)
            return None

    agent = create_agent(scripted([ai(text="done", usage=AGENT_USAGE)]), [],
                         middleware=[ReadsOneEvent(), on_a_store.middleware()])
    agent.invoke({"messages": [("user", "go")]}, {"configurable": {"thread_id": "on-a-store"}})
    worst_case = store.reserved(key)
    assert worst_case >= 64 * 0.001
    kept.clear()
    gc.collect()  # (queued: intent.dropped_streams)

    in_memory = BudgetGuard(AcceptAll(), Market([PricedTool("a", 1.0)]), 10.0, model_prices={"scripted-model": PRICE})
    other = create_agent(scripted([ai(text="done", usage=AGENT_USAGE)]), [], middleware=[in_memory.middleware()])
    asyncio.run(other.ainvoke({"messages": [HumanMessage("go")]}, {"configurable": {"thread_id": "in-memory"}}))
    assert on_loop == []
    spent = store.spent(key)
    again = create_agent(scripted([ai(text="done", usage=AGENT_USAGE)]), [], middleware=[on_a_store.middleware()])
    again.invoke({"messages": [("user", "go")]}, {"configurable": {"thread_id": "on-a-store-again"}})
    assert store.reserved(key) == 0.0
    assert store.spent(key) == pytest.approx(spent + worst_case + AGENT_COST)
    assert on_loop == []


def test_a_sync_v3_stream_collected_after_its_run_ended_is_charged_in_the_threads_next_run():
    """The reader keeps the stream past the end of the run (the run ends with its reservation held), then drops it;
    the collector runs after the run (the usual case). The charge was made in the episode the run's end had
    dropped here, and the thread's next run, made again from state, released the reservation as unused: the
    money the provider billed was forgotten. It is now carried into that next run (as a late tool bill is)."""
    import gc

    from langgraph.checkpoint.memory import InMemorySaver

    from intent.testing import BilledChatModel, ModelRuns, scripted

    runs = ModelRuns()
    guard = _side_guard()
    side = guard.metered_model(BilledChatModel(model_name="side-model", runs=runs))
    kept: list[Any] = []

    class ReadsOneEventOnce(AgentMiddleware):
        def before_model(self, state, runtime):
            if not runs.names():
                stream = side.stream_events("a side question", version="v3")
                next(iter(stream))
                kept.append(stream)
            return None

    agent = create_agent(scripted([ai(text="done", usage=AGENT_USAGE)] * 2), [],
                         middleware=[ReadsOneEventOnce(), guard.middleware()], checkpointer=InMemorySaver())
    config = {"configurable": {"thread_id": "kept-v3"}}
    first = guard.ledger(agent.invoke({"messages": [("user", "go")]}, config))
    assert first.reserved > 0 and first.spent == pytest.approx(AGENT_COST)  # the stream is still open
    worst_case = first.reserved
    kept.clear()
    gc.collect()  # after the run: the run's episode is no longer live here
    second = guard.ledger(agent.invoke({"messages": [("user", "again")]}, config))
    assert runs.names() == ["side-model"]
    assert second.reserved == 0
    assert second.spent == pytest.approx(2 * AGENT_COST + worst_case)


def _store_noting_the_loop(monkeypatch) -> tuple[Any, list[str]]:
    """A memory:// shared store with budget "k" (10), and the list where each reserve, commit and release through it
    notes whether it ran on an event loop."""
    from intent.stores import open_store

    store = open_store("memory://")
    store.create_budget("k", 10.0)
    where: list[str] = []
    for name in ("commit", "release", "reserve"):
        def on_loop_or_not(self, *args, _inner=getattr(type(store), name), _name=name, **kwargs):
            try:
                asyncio.get_running_loop()
                where.append(f"{_name} on the loop")
            except RuntimeError:
                where.append(f"{_name} off the loop")
            return _inner(self, *args, **kwargs)

        monkeypatch.setattr(type(store), name, on_loop_or_not)
    return store, where


def test_a_v3_stream_closed_before_its_producer_ran_reaches_the_store_off_the_loop(monkeypatch):
    """aclose() right after the stream started cancels its producer before it ran; the producer-task watch fired
    first and charged the run on the event loop, blocking it on the store. LangChain closes that run itself
    (aclose's on_llm_error), which the guard's async twin charges off the loop; the watch leaves it to that."""
    from langchain_core.messages import HumanMessage

    from intent.testing import BilledChatModel, ModelRuns, scripted

    store, where = _store_noting_the_loop(monkeypatch)
    runs = ModelRuns()
    guard = _side_guard(store=store, budget_key="k")
    side = guard.metered_model(BilledChatModel(model_name="side-model", runs=runs))

    class ClosesAtOnce(AgentMiddleware):
        async def abefore_model(self, state, runtime):
            stream = await side.astream_events("a side question", version="v3")
            await stream._ensure_started()  # (what the first read does: the run starts, its producer is made)
            await stream.aclose()
            return None

    agent = create_agent(scripted([ai(text="done", usage=AGENT_USAGE)]), [],
                         middleware=[ClosesAtOnce(), guard.middleware()])
    asyncio.run(agent.ainvoke({"messages": [HumanMessage("go")]}, {"configurable": {"thread_id": "closed-v3"}}))
    assert where and not [w for w in where if w.endswith("on the loop")], where
    assert store.reserved("k") == 0.0


@pytest.mark.parametrize("end", ["read on after the run", "producer cancelled as asyncio.run ends"])
def test_a_v3_streams_run_that_ends_after_the_agent_run_is_charged_in_the_threads_next_run(end):
    """A middleware reads an astream_events(version="v3") stream's first event and keeps the stream; its producer
    ends the run after the agent's run is over: the reader reads it to its end later (charged what the provider
    reported), or asyncio.run ends with the producer pending and cancels it (charged the worst case, as a cancelled
    run). The charge went into the writes of a graph task long done, which LangGraph drops, and the thread's next
    run released the reservation as unused: the money the provider billed was forgotten."""
    import gc

    from langchain_core.messages import AIMessageChunk, HumanMessage
    from langchain_core.outputs import ChatGenerationChunk

    from intent.testing import BilledChatModel, ModelRuns, scripted

    go: dict[str, asyncio.Event] = {}  # made on the first run's loop

    class WaitsAfterItsFirstChunk(BilledChatModel):
        async def _astream(self, messages: Any, stop: Any = None, run_manager: Any = None, **kwargs: Any) -> Any:
            self.runs.hit(self.model_name, *self.tokens)
            for k in range(3):
                if k == 1:
                    await go["event"].wait()
                extra: dict[str, Any] = {"usage_metadata": self._usage()} if k == 2 else {}
                yield ChatGenerationChunk(message=AIMessageChunk(content=f"part {k} ", **extra))

    runs = ModelRuns()
    guard = _side_guard()
    side = guard.metered_model(WaitsAfterItsFirstChunk(model_name="side-model", runs=runs))
    kept: list[Any] = []

    class KeepsTheStream(AgentMiddleware):
        async def abefore_model(self, state, runtime):
            if not runs.names():
                stream = await side.astream_events("a side question", version="v3")
                events = stream.__aiter__()
                assert (await anext(events))["event"] == "message-start"
                kept.append(events)
            return None

    agent = create_agent(scripted([ai(text="done", usage=AGENT_USAGE)] * 2), [],
                         middleware=[KeepsTheStream(), guard.middleware()], checkpointer=InMemorySaver())
    config = {"configurable": {"thread_id": f"late-v3-{end}"}}

    async def first_run() -> float:
        go["event"] = asyncio.Event()
        reserved = guard.ledger(await agent.ainvoke({"messages": [HumanMessage("go")]}, config)).reserved
        if end == "read on after the run":
            go["event"].set()
            assert [e["event"] async for e in kept[0]][-1] == "message-finish"
        return reserved  # (else returned with the producer pending: asyncio.run cancels it)

    worst_case = asyncio.run(first_run())
    assert worst_case >= 64 * 0.001  # the run was open when the agent's run ended
    kept.clear()
    gc.collect()
    second = guard.ledger(asyncio.run(agent.ainvoke({"messages": [HumanMessage("again")]}, config)))
    assert runs.names() == ["side-model"]
    side_charge = 110 * 0.001 if end == "read on after the run" else worst_case
    assert second.reserved == 0
    assert second.spent == pytest.approx(2 * AGENT_COST + side_charge)


def test_a_run_id_of_an_execution_still_open_is_refused_not_left_unmetered():
    """A caller passes run_id in the config, the same for two executions of a metered copy, the first still open (a
    stream_events v3 stream it keeps unread). The second start was taken for the async twin's (begun already) and
    skipped: that execution was never reserved nor checked against the budget, and its end charged the first one's
    reservation, so two executions were charged one. It is refused now, with the fix in the message."""
    import uuid

    from intent.testing import BilledChatModel, ModelRuns, scripted

    runs = ModelRuns()
    guard = _side_guard()
    side = guard.metered_model(BilledChatModel(model_name="side-model", runs=runs))
    run_id = uuid.uuid4()
    kept: list[Any] = []

    class TwoExecutionsOneRunId(AgentMiddleware):
        def before_model(self, state, runtime):
            stream = side.stream_events("a side question", {"run_id": run_id}, version="v3")
            next(iter(stream))
            kept.append(stream)
            with pytest.raises(MeteredModelRefused, match="pass a fresh run_id"):
                side.invoke("another", {"run_id": run_id})
            return None

    agent = create_agent(scripted([ai(text="done", usage=AGENT_USAGE)]), [],
                         middleware=[TwoExecutionsOneRunId(), guard.middleware()])
    out = agent.invoke({"messages": [("user", "go")]}, {"configurable": {"thread_id": "one-run-id"}})
    assert runs.names() == ["side-model"]  # the second execution was not made
    assert out["messages"][-1].content == "done"


def test_an_astream_kept_past_its_task_by_a_guard_on_a_store_is_charged_off_the_loop(monkeypatch):
    """A middleware reads an astream's first chunk and keeps the stream: its task is done with the run open, and the
    task's done-callback charged the run (as a cancelled one) there, on the event loop, where the commit waits on the
    store with every task on the loop. It is charged at the guard's next hook, off the loop, before the run ends."""
    from langchain_core.messages import HumanMessage

    from intent.testing import BilledChatModel, ModelRuns, scripted

    store, where = _store_noting_the_loop(monkeypatch)
    runs = ModelRuns()
    guard = _side_guard(store=store, budget_key="k")
    side = guard.metered_model(BilledChatModel(model_name="side-model", runs=runs))
    kept: list[Any] = []

    class KeepsTheAstream(AgentMiddleware):
        async def abefore_model(self, state, runtime):
            chunks = side.astream("a side question")
            await anext(chunks)
            kept.append(chunks)
            return None

    agent = create_agent(scripted([ai(text="done", usage=AGENT_USAGE)]), [],
                         middleware=[KeepsTheAstream(), guard.middleware()])

    async def run() -> float:
        await agent.ainvoke({"messages": [HumanMessage("go")]}, {"configurable": {"thread_id": "kept-astream"}})
        reserved = store.reserved("k")
        await kept[0].aclose()
        return reserved

    assert asyncio.run(run()) == 0.0  # charged before the run's end
    assert runs.names() == ["side-model"]
    assert where and not [w for w in where if w.endswith("on the loop")], where
    assert store.spent("k") >= AGENT_COST + 64 * 0.001  # the side run's worst case, as a cancelled run


def test_a_queued_run_whose_watching_tasks_loop_has_closed_is_charged_without_touching_that_loop():
    """A run queued when the task watching it finished with it open (a v3 stream's producer, a store guard's caller:
    intent.dropped_streams) may be charged after asyncio.run has closed that task's loop, in a later run. Taking the
    run removed the task's done-callback through the loop (call_soon_threadsafe): 'Event loop is closed', raised
    from the guard's hook that settled the queue."""
    import uuid

    from intent.metered_models import MeteredModelCallback
    from intent.testing import BilledChatModel, ModelRuns

    guard = BudgetGuard(AcceptAll(), Market([PricedTool("a", 1.0)]), 10.0, model_prices={"side-model": PRICE})
    handler = MeteredModelCallback(guard, BilledChatModel(model_name="side-model", runs=ModelRuns()))
    run_id = uuid.uuid4()

    async def watched_by_a_task_that_ends() -> None:
        producer = asyncio.get_running_loop().create_task(asyncio.sleep(0))
        handler.watch(run_id, object(), producer, queue=True)  # (an execution that is not open: nothing queued)
        await producer

    asyncio.run(watched_by_a_task_that_ends())
    handler._cancelled(run_id)  # (what dropped_streams.settle calls, in the next run)
    assert not handler._callers


def test_a_dropped_streams_queued_run_leaves_a_later_execution_under_the_same_run_id_alone():
    """A caller may give a run_id again once its first execution has ended. The first execution's stream, read to its
    end and dropped, is queued when collected; the queued entry then took the open second execution under that id
    and charged it as cancelled (its worst case), and the second's own end found nothing to charge."""
    import gc
    import uuid

    from intent.testing import BilledChatModel, ModelRuns, scripted

    runs = ModelRuns()
    guard = _side_guard()
    side = guard.metered_model(BilledChatModel(model_name="side-model", runs=runs))  # reports (10, 100)
    run_id = uuid.uuid4()

    class SameRunIdTwice(AgentMiddleware):
        def before_model(self, state, runtime):
            first = side.stream_events("a side question", {"run_id": run_id}, version="v3")
            assert list(first)[-1]["event"] == "message-finish"  # ended: charged what it reported
            second = side.stream_events("a side question", {"run_id": run_id}, version="v3")
            next(iter(second))  # open, under the same run id
            del first
            gc.collect()  # the first stream is collected and its run queued
            side.invoke("another side question")  # a metered run: settles the queue first
            assert list(second)[-1]["event"] == "message-finish"
            return None

    agent = create_agent(scripted([ai(text="done", usage=AGENT_USAGE)]), [],
                         middleware=[SameRunIdTwice(), guard.middleware()])
    out = agent.invoke({"messages": [("user", "go")]}, {"configurable": {"thread_id": "same-run-id"}})
    assert runs.names() == ["side-model"] * 3
    side_cost = 110 * 0.001
    ledger = guard.ledger(out)
    assert ledger.reserved == 0
    assert sorted(round(e.amount, 9) for e in ledger.entries() if e.status == "committed") == [
        AGENT_COST, side_cost, side_cost, side_cost]
