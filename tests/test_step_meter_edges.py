"""Models called inside the guard's model step in the ways real middleware call them: streamed and
stopped early, cancelled by a timeout, served from LangChain's cache, a completion model, another guard's
metered copy, a task left running after the step, a model named only for tracers.

Money is counted outside the guard: each fake model logs its executions (tokens in and out).
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from langchain.agents import create_agent
from langchain.agents.middleware import AgentMiddleware, ModelRetryMiddleware
from langchain_core.globals import set_llm_cache
from langchain_core.caches import InMemoryCache
from langchain_core.language_models.fake import FakeListLLM
from langchain_core.messages import AIMessage, HumanMessage

from intent import AcceptAll, BudgetGuard, Market, MemoryLogSink, ModelPrice, PricedTool
from intent.testing import BilledChatModel, ModelRuns, SwapModel

PRICES = {"primary": ModelPrice(1000, 1000), "side": ModelPrice(5000, 5000)}  # per token: 0.001, 0.005


def Fake(*, model_name: str = "primary", runs: ModelRuns) -> BilledChatModel:  # noqa: N802 - reads as a model
    """10 tokens in, 100 out; streams three chunks, the usage on the last."""
    return BilledChatModel(model_name=model_name, runs=runs)


class SlowSide(BilledChatModel):
    async def _agenerate(self, messages: Any, stop: Any = None, run_manager: Any = None, **kwargs: Any) -> Any:
        self.runs.hit(self.model_name, 10, 100)  # the request reached the provider
        await asyncio.sleep(10)
        raise AssertionError("not reached: cancelled by the caller's timeout")


async def _timed_out_once(call: Any, reached: Any) -> None:
    """``asyncio.wait_for(call, ...)`` timing out once ``reached()`` says the call got where the test cancels it
    (its request at the provider, or waiting on its rate limiter): a loaded machine may take longer than any
    fixed timeout to get there."""
    task = asyncio.ensure_future(call)
    while not reached() and not task.done():
        await asyncio.sleep(0.001)
    with pytest.raises((asyncio.TimeoutError, TimeoutError)):
        await asyncio.wait_for(task, 0.05)


class Side(AgentMiddleware):
    """Listed after the guard: calls ``fn`` inside the guard's model step, then the agent's model."""

    def __init__(self, fn: Any = None, afn: Any = None) -> None:
        super().__init__()
        self.fn, self.afn = fn, afn

    def wrap_model_call(self, request: Any, handler: Any) -> Any:
        self.fn(request)
        return handler(request)

    async def awrap_model_call(self, request: Any, handler: Any) -> Any:
        if self.afn is not None:
            await self.afn(request)
        else:
            self.fn(request)
        return await handler(request)


def _guard(budget: float = 10.0, *, max_output_tokens: int = 100) -> BudgetGuard:
    return BudgetGuard(AcceptAll(), Market([PricedTool("a", 1.0)]), budget, model_prices=PRICES,
                       max_output_tokens=max_output_tokens, log_sink=MemoryLogSink())


class Bounded(BilledChatModel):
    """A model whose output bound is an attribute only (not in its invocation parameters)."""

    max_tokens: int | None = None


def _charges(guard: BudgetGuard) -> list[tuple[str, float, str]]:
    return [(r.tool, round(r.charged, 6), r.reason) for r in guard.log_sink.records if r.kind == "model" and r.charged]


def _run(guard: BudgetGuard, runs: ModelRuns, middleware: list[Any], use_async: bool = False) -> Any:
    agent = create_agent(Fake(runs=runs), [], middleware=[guard.middleware(), *middleware])
    inp = {"messages": [("user", "q")]}
    return asyncio.run(agent.ainvoke(inp)) if use_async else agent.invoke(inp)


def test_a_stream_stopped_early_is_charged_its_reservation():
    # The request was sent: the provider bills it. It was released (charged 0).
    runs, guard = ModelRuns(), _guard()

    def first_chunk(request: Any) -> None:
        for _chunk in Fake(model_name="side", runs=runs).stream("q"):
            break

    out = _run(guard, runs, [Side(first_chunk)])
    ledger = guard.ledger(out)
    assert runs.names() == ["side", "primary"]
    assert ledger.spent >= runs.cost(PRICES) and ledger.reserved == 0
    assert ("side", pytest.approx(ledger.spent - 0.11), "cancelled") in _charges(guard)


def test_a_side_call_cancelled_by_a_timeout_is_charged_its_reservation():
    runs, guard = ModelRuns(), _guard()

    async def with_timeout(request: Any) -> None:
        await _timed_out_once(SlowSide(model_name="side", runs=runs).ainvoke("q"), runs.names)

    out = _run(guard, runs, [Side(afn=with_timeout)], use_async=True)
    ledger = guard.ledger(out)
    assert runs.names() == ["side", "primary"]
    # Charged its reservation once: (17 prompt + 100 output tokens) x 0.005, beside the agent's 0.11.
    assert ledger.spent == pytest.approx(0.11 + 0.585) and ledger.reserved == 0  # was 0.11 for 0.66 spent


def test_a_response_from_langchains_cache_costs_nothing():
    runs, guard = ModelRuns(), _guard()
    set_llm_cache(InMemoryCache())
    try:
        side = BilledChatModel(model_name="side", runs=runs, cache=True)
        out = _run(guard, runs, [Side(lambda request: (side.invoke("q"), side.invoke("q")))])
    finally:
        set_llm_cache(None)
    assert runs.names() == ["side", "primary"]  # the second side call was a cache hit
    assert guard.ledger(out).spent == pytest.approx(runs.cost(PRICES))  # was charged twice
    assert [r.reason for r in guard.log_sink.records if r.kind == "model" and r.tool == "side"] == [
        "accepted", "cache_hit"]


def test_a_completion_model_inside_the_step_is_priced_before_it_runs():
    # A completion (non-chat) model went through unpriced and unrefused. Priced as "side", its worst
    # case does not fit 0.3: it is not called.
    runs, guard = ModelRuns(), _guard(0.3)
    calls: list[str] = []

    class Completion(FakeListLLM):
        def _call(self, *args: Any, **kwargs: Any) -> str:
            calls.append("ran")
            return super()._call(*args, **kwargs)

        @property
        def _identifying_params(self) -> dict[str, Any]:
            return {"model_name": "side"}

    out = _run(guard, runs, [Side(lambda request: Completion(responses=["x"]).invoke("q"))])
    assert calls == [] and guard.ledger(out).spent == 0
    assert "budget" in str(out["messages"][-1].content)


def test_another_guards_metered_copy_inside_the_step_is_charged_once():
    runs, guard, other = ModelRuns(), _guard(), _guard()
    side = other.metered_model(Fake(model_name="side", runs=runs))
    out = _run(guard, runs, [Side(lambda request: side.invoke("q"))])
    assert guard.ledger(out).spent == pytest.approx(runs.cost(PRICES)) == 0.66  # was 1.21: paid by both guards
    assert _charges(other) == []


def test_a_task_left_running_after_the_step_is_not_the_steps():
    runs, guard = ModelRuns(), _guard()
    tasks: list[asyncio.Task[Any]] = []
    step_over = asyncio.Event()

    async def start_later(request: Any) -> None:
        async def later() -> None:
            await step_over.wait()  # (made in the step, with its context; calls once the run is over)
            await Fake(model_name="side", runs=runs).ainvoke("q")

        tasks.append(asyncio.get_running_loop().create_task(later()))

    async def main() -> Any:
        agent = create_agent(Fake(runs=runs), [], middleware=[guard.middleware(), Side(afn=start_later)])
        out = await agent.ainvoke({"messages": [("user", "q")]})
        step_over.set()
        await asyncio.gather(*tasks)
        return out

    out = asyncio.run(main())
    assert runs.names() == ["primary", "side"]
    assert _charges(guard) == [("primary", 0.11, "accepted")]  # the late call is not logged as the step's
    assert guard.ledger(out).spent == pytest.approx(0.11)


def test_an_agent_model_named_only_for_tracers_is_priced():
    runs, guard = ModelRuns(), _guard()

    class Deployed(BilledChatModel):
        model_name: str = ""
        deployment: str = "primary"

        def _get_ls_params(self, stop: Any = None, **kwargs: Any) -> Any:
            return {**super()._get_ls_params(stop=stop, **kwargs), "ls_model_name": self.deployment}

    agent = create_agent(Deployed(runs=runs), [], middleware=[guard.middleware()])
    out = agent.invoke({"messages": [("user", "q")]})
    assert out["messages"][-1].content == "done"  # was refused as unnamed
    assert guard.ledger(out).spent == pytest.approx(0.11)


def test_a_refused_side_call_is_not_retried_by_model_retry_middleware():
    runs, guard = ModelRuns(), _guard(1.5)
    side = Fake(model_name="side", runs=runs)
    retry = ModelRetryMiddleware(max_retries=3, initial_delay=0.0, jitter=False, backoff_factor=0.0,
                                 on_failure="error")
    out = _run(guard, runs, [retry, Side(lambda request: [side.invoke("q") for _ in range(3)])])
    # Two side calls fit 1.5, the third is refused, once (not three more times), and the guard says why.
    assert runs.names() == ["side", "side"]
    assert "budget" in str(out["messages"][-1].content)
    assert len([r for r in guard.log_sink.records if r.reason == "model_over_budget"]) == 1


class InThread(AgentMiddleware):
    """Runs the rest of the model step in a plain thread, which does not carry the context (a timeout)."""

    def __init__(self, before: Any = None) -> None:
        super().__init__()
        self.before = before

    def wrap_model_call(self, request: Any, handler: Any) -> Any:
        if self.before is not None:
            self.before(request)
        with ThreadPoolExecutor(1) as pool:
            return pool.submit(handler, request).result()


def test_the_agents_model_run_in_a_thread_without_the_context_is_still_metered():
    # Its executions went unchecked and only the answer was charged, after the fact.
    runs, guard = ModelRuns(), _guard()
    out = _run(guard, runs, [InThread()])
    assert runs.names() == ["primary"] and guard.ledger(out).spent == pytest.approx(runs.cost(PRICES))
    assert [r.reason for r in guard.log_sink.records if r.kind == "model"] == ["accepted"]


def test_a_side_call_does_not_make_the_agents_unmetered_answer_free():
    runs, guard = ModelRuns(), _guard()
    side = Fake(model_name="side", runs=runs)
    agent_model = Fake(runs=runs)

    class Bare(AgentMiddleware):  # the agent's model called bare, in a thread without the context
        def wrap_model_call(self, request: Any, handler: Any) -> Any:
            side.invoke("q")
            with ThreadPoolExecutor(1) as pool:
                return pool.submit(lambda: handler(request.override(model=agent_model))).result()

    out = _run(guard, runs, [Bare()])
    assert runs.names() == ["side", "primary"]
    assert guard.ledger(out).spent == pytest.approx(runs.cost(PRICES))  # was 0.55: the answer went unpaid


def test_a_side_model_of_the_agents_name_without_a_bound_is_reserved_at_the_guards_bound():
    # The agent's model has max_tokens=100; a summariser of the same name has none and writes 2000. It
    # was reserved at the agent's 100 (0.12) and billed 2.01 on a budget of 1.0.
    runs, guard = ModelRuns(), _guard(1.0, max_output_tokens=1000)
    side = Bounded(model_name="primary", runs=runs, tokens=(10, 2000))
    agent = create_agent(Bounded(model_name="primary", runs=runs, max_tokens=100), [],
                         middleware=[guard.middleware(), Side(lambda request: side.invoke("q"))])
    out = agent.invoke({"messages": [("user", "q")]})
    assert runs.names() == [] and guard.ledger(out).spent == 0  # 1000 tokens at the most do not fit 1.0
    assert "budget" in str(out["messages"][-1].content)


def test_a_side_model_that_names_no_model_is_refused_not_priced_as_the_agents():
    class Unnamed(BilledChatModel):
        pass

    runs, guard = ModelRuns(), _guard()
    out = _run(guard, runs, [Side(lambda request: Unnamed(model_name="", runs=runs).invoke("q"))])
    assert runs.names() == [] and guard.ledger(out).spent == 0
    assert "no price" in str(out["messages"][-1].content)


def test_a_call_in_flight_when_another_is_refused_is_charged():
    # Two side calls at once; the second does not fit and is refused at once, the first was sent.
    runs, guard = ModelRuns(), _guard(0.8)

    class Slow(BilledChatModel):
        async def _agenerate(self, messages: Any, stop: Any = None, run_manager: Any = None, **kwargs: Any) -> Any:
            self.runs.hit(self.model_name, *self.tokens)
            await asyncio.sleep(0.2)
            return await super()._agenerate(messages, stop, run_manager, **kwargs)

    async def both(request: Any) -> None:
        await asyncio.gather(Slow(model_name="side", runs=runs).ainvoke("q"),
                             Fake(model_name="side", runs=runs).ainvoke("q"))

    out = _run(guard, runs, [Side(afn=both)], use_async=True)
    ledger = guard.ledger(out)
    assert runs.names() == ["side"]
    assert runs.cost(PRICES) <= ledger.spent <= 0.8 and ledger.reserved == 0  # it was released: 0 spent


def test_the_agents_own_bound_prices_its_runs_even_when_its_invocation_parameters_omit_it():
    # A custom model whose max_tokens is an attribute only: reserved at the guard's 1000 (refused on a
    # budget of 1.0) while the precheck used its 100.
    runs, guard = ModelRuns(), _guard(1.0, max_output_tokens=1000)
    agent = create_agent(Bounded(model_name="primary", runs=runs, max_tokens=100), [], middleware=[guard.middleware()])
    out = agent.invoke({"messages": [("user", "q")]})
    assert runs.names() == ["primary"] and out["messages"][-1].content == "done"
    assert guard.ledger(out).spent == pytest.approx(runs.cost(PRICES))


def test_an_answer_without_an_id_from_outside_langchain_is_charged_beside_a_metered_side_call():
    runs, guard = ModelRuns(), _guard()
    side = Fake(model_name="side", runs=runs)

    class Direct(AgentMiddleware):  # answers with a provider SDK's call: usage, no id
        def wrap_model_call(self, request: Any, handler: Any) -> Any:
            side.invoke("classify")
            runs.hit("primary", 10, 100)
            return AIMessage("answer", usage_metadata={"input_tokens": 10, "output_tokens": 100, "total_tokens": 110},
                             response_metadata={"model_name": "primary"})

    out = _run(guard, runs, [Direct()])
    assert guard.ledger(out).spent == pytest.approx(runs.cost(PRICES)) == 0.66  # the answer was free


def test_a_batch_with_a_refused_prompt_sends_nothing_and_charges_nothing():
    # generate() starts every prompt's run before it sends any: the third does not fit, none is sent.
    runs, guard = ModelRuns(), _guard(1.5)
    side = Fake(model_name="side", runs=runs)
    out = _run(guard, runs, [Side(lambda request: side.generate([[HumanMessage("a")], [HumanMessage("b")],
                                                                   [HumanMessage("c")]]))])
    assert runs.names() == [] and guard.ledger(out).spent == 0  # two unsent prompts were charged 1.17


def test_two_batches_at_once_are_told_apart_when_one_has_a_refused_prompt():
    # Two 2-prompt agenerate() calls at once under the same parent: the second batch's refusal released
    # the first batch's runs, already sent, which then went unpaid (0.11 for 1.21 billed).
    runs, guard = ModelRuns(), _guard(1.9)
    side = Fake(model_name="side", runs=runs)

    async def two_batches(request: Any) -> None:
        await asyncio.gather(side.agenerate([[HumanMessage("a")], [HumanMessage("b")]]),
                             side.agenerate([[HumanMessage("c")], [HumanMessage("d")]]), return_exceptions=True)

    out = _run(guard, runs, [Side(afn=two_batches)], use_async=True)
    assert guard.ledger(out).spent == pytest.approx(runs.cost(PRICES)) and guard.ledger(out).reserved == 0


def test_a_sync_batch_that_fails_at_its_first_prompt_charges_nothing_for_the_prompts_never_sent():
    runs, guard = ModelRuns(), _guard()
    down = BilledChatModel(model_name="side", runs=runs, fail=True)

    def try_batch(request: Any) -> None:
        with pytest.raises(ConnectionError):
            down.generate([[HumanMessage("a")], [HumanMessage("b")], [HumanMessage("c")]])

    out = _run(guard, runs, [Side(try_batch)])
    assert runs.names() == ["primary"] and guard.ledger(out).spent == pytest.approx(0.11)  # was 1.28


def test_an_answer_rebuilt_without_its_id_is_not_charged_twice():
    runs, guard = ModelRuns(), _guard()

    class Redactor(AgentMiddleware):  # rebuilds the model's answer: same usage, no id
        def wrap_model_call(self, request: Any, handler: Any) -> Any:
            answer = handler(request).result[-1]
            return AIMessage("redacted", usage_metadata=answer.usage_metadata,
                             response_metadata=answer.response_metadata)

    out = _run(guard, runs, [Redactor()])
    assert guard.ledger(out).spent == pytest.approx(runs.cost(PRICES)) == pytest.approx(0.11)


def test_an_agent_run_cancelled_from_outside_pays_for_the_request_it_sent():
    # asyncio.wait_for around ainvoke: LangChain reports no error for the cancelled request, and the step's
    # end released it (charged 0 for a billed call).
    class Slow(BilledChatModel):
        async def _agenerate(self, messages: Any, stop: Any = None, run_manager: Any = None, **kwargs: Any) -> Any:
            self.runs.hit(self.model_name, *self.tokens)  # the request reached the provider
            await asyncio.sleep(10)

    runs, guard = ModelRuns(), _guard()
    agent = create_agent(Slow(model_name="primary", runs=runs), [], middleware=[guard.middleware()])

    async def main() -> None:
        await _timed_out_once(agent.ainvoke({"messages": [("user", "q")]}, {"configurable": {"thread_id": "t"}}),
                              runs.names)

    asyncio.run(main())
    ledger = guard.episodes.peek("t").ledger
    assert runs.names() == ["primary"] and ledger.spent >= runs.cost(PRICES) and ledger.reserved == 0


def test_a_sync_batch_failing_at_its_second_prompt_pays_for_the_first():
    class FailsOnB(BilledChatModel):
        def _generate(self, messages: Any, stop: Any = None, run_manager: Any = None, **kwargs: Any) -> Any:
            if messages[-1].content == "b":
                raise ConnectionError("down")
            return super()._generate(messages, stop, run_manager, **kwargs)

    runs, guard = ModelRuns(), _guard()
    side = FailsOnB(model_name="side", runs=runs)

    def try_batch(request: Any) -> None:
        with pytest.raises(ConnectionError):
            side.generate([[HumanMessage("a")], [HumanMessage("b")], [HumanMessage("c")]])

    out = _run(guard, runs, [Side(try_batch)])
    ledger = guard.ledger(out)
    assert runs.names() == ["side", "primary"]  # a was sent (billed, its answer dropped); c never was
    assert runs.cost(PRICES) <= ledger.spent <= 0.11 + 0.585 + 1e-9 and ledger.reserved == 0  # was 0.11


def test_an_unmetered_answer_equal_to_a_metered_side_calls_is_still_charged():
    runs, guard = ModelRuns(), _guard()
    check = Fake(runs=runs)  # a side call with the agent's model name and the same usage

    class Direct(AgentMiddleware):
        def wrap_model_call(self, request: Any, handler: Any) -> Any:
            check.invoke("self-check")
            runs.hit("primary", 10, 100)  # a provider SDK's call: no id
            return AIMessage("answer", usage_metadata={"input_tokens": 10, "output_tokens": 100, "total_tokens": 110},
                             response_metadata={"model_name": "primary"})

    out = _run(guard, runs, [Direct()])
    assert guard.ledger(out).spent == pytest.approx(runs.cost(PRICES)) == pytest.approx(0.22)


def test_side_calls_in_flight_when_the_step_fails_are_paid():
    # A middleware after the guard runs the agent's model and a side call at once; the agent's model fails
    # (503) and a ModelRetryMiddleware outside the guard runs the step again. The side calls of the failed
    # attempts were sent and billed: they were released (0.66 charged for 1.76 billed).
    fails = [2]

    class Flaky(BilledChatModel):
        async def _agenerate(self, messages: Any, stop: Any = None, run_manager: Any = None, **kwargs: Any) -> Any:
            await asyncio.sleep(0.01)
            if fails[0] > 0:
                fails[0] -= 1
                raise ConnectionError("503")  # not billed
            return await super()._agenerate(messages, stop, run_manager, **kwargs)

    class SlowSide(BilledChatModel):
        async def _agenerate(self, messages: Any, stop: Any = None, run_manager: Any = None, **kwargs: Any) -> Any:
            await asyncio.sleep(0.1)
            return await super()._agenerate(messages, stop, run_manager, **kwargs)  # logs the billed run

    runs, guard = ModelRuns(), _guard()
    side = SlowSide(model_name="side", runs=runs)
    side_calls: list[asyncio.Task[Any]] = []

    class Together(AgentMiddleware):
        async def awrap_model_call(self, request: Any, handler: Any) -> Any:
            side_calls.append(asyncio.ensure_future(side.ainvoke("moderate")))  # (gather left it running on a 503)
            response, _ = await asyncio.gather(handler(request), side_calls[-1])
            return response

    retry = ModelRetryMiddleware(max_retries=3, initial_delay=0.0, jitter=False, backoff_factor=0.0)
    agent = create_agent(Flaky(model_name="primary", runs=runs), [], middleware=[retry, guard.middleware(), Together()])

    async def main() -> Any:
        out = await agent.ainvoke({"messages": [("user", "q")]}, {"configurable": {"thread_id": "r"}})
        await asyncio.gather(*side_calls)  # the side calls of the failed attempts finish
        return out

    out = asyncio.run(main())
    assert runs.names().count("side") == 3
    assert guard.ledger(out).spent >= runs.cost(PRICES) and guard.ledger(out).reserved == 0


def test_ctrl_c_during_a_sync_side_call_pays_for_it():
    class Interrupted(BilledChatModel):
        def _generate(self, messages: Any, stop: Any = None, run_manager: Any = None, **kwargs: Any) -> Any:
            self.runs.hit(self.model_name, *self.tokens)  # sent, billed
            raise KeyboardInterrupt

    runs, guard = ModelRuns(), _guard()

    def side_call(request: Any) -> None:
        with pytest.raises(KeyboardInterrupt):
            Interrupted(model_name="side", runs=runs).invoke("q")

    out = _run(guard, runs, [Side(side_call)])
    assert guard.ledger(out).spent >= runs.cost(PRICES)  # the side call was released: free


def test_an_answer_rebuilt_with_a_new_id_is_not_charged_twice():
    runs, guard = ModelRuns(), _guard()

    class Redactor(AgentMiddleware):
        def wrap_model_call(self, request: Any, handler: Any) -> Any:
            answer = handler(request).result[-1]
            return AIMessage("redacted", id="new-id", usage_metadata=answer.usage_metadata,
                             response_metadata=answer.response_metadata)

    out = _run(guard, runs, [Redactor()])
    assert guard.ledger(out).spent == pytest.approx(runs.cost(PRICES)) == pytest.approx(0.11)


class DropsMidStream(BilledChatModel):
    """Streams a chunk, then its connection drops: the request was served in part, and billed. (It reports
    no tokens itself: LangChain's stream() and invoke() do, and stream_events(version="v3") sends events.)"""

    def _stream(self, messages: Any, stop: Any = None, run_manager: Any = None, **kwargs: Any) -> Any:
        from langchain_core.messages import AIMessageChunk
        from langchain_core.outputs import ChatGenerationChunk

        self.runs.hit(self.model_name, 10, 100)
        yield ChatGenerationChunk(message=AIMessageChunk(content="partial "))
        raise ConnectionError("connection reset mid-stream")

    async def _astream(self, messages: Any, stop: Any = None, run_manager: Any = None, **kwargs: Any) -> Any:
        for chunk in self._stream(messages, stop, None, **kwargs):
            yield chunk


@pytest.mark.parametrize("use_async", [False, True])
def test_a_side_stream_that_breaks_off_after_its_first_chunk_is_paid(use_async):
    runs, guard = ModelRuns(), _guard()
    side = DropsMidStream(model_name="side", runs=runs)

    def read(request: Any) -> None:
        with pytest.raises(ConnectionError):
            for _ in side.stream("q"):
                pass

    async def aread(request: Any) -> None:
        with pytest.raises(ConnectionError):
            async for _ in side.astream("q"):
                pass

    out = _run(guard, runs, [Side(read, aread)], use_async)
    ledger = guard.ledger(out)
    # The side call is charged its reservation (its usage never came): was released, 0.11 for 0.66 billed.
    assert runs.cost(PRICES) == pytest.approx(0.66) and ledger.spent >= 0.66 - 1e-9 and ledger.reserved == 0
    assert ("side", pytest.approx(0.585), "failed_mid_stream") in _charges(guard)


@pytest.mark.parametrize("use_async", [False, True])
@pytest.mark.parametrize("mode", ["messages", "v3"])
def test_the_agents_model_streamed_inside_invoke_that_breaks_off_and_is_retried_pays_both_attempts(use_async, mode):
    # agent.stream(stream_mode="messages") makes the model stream inside its invoke; LangChain then reports the
    # failure with no partial output, only the tokens as they came. stream_events(version="v3") streams it with
    # protocol events instead of tokens.
    runs, guard = ModelRuns(), _guard()
    attempts = {"n": 0}

    class Flaky(DropsMidStream):
        def _stream(self, messages: Any, stop: Any = None, run_manager: Any = None, **kwargs: Any) -> Any:
            attempts["n"] += 1
            if attempts["n"] == 1:
                yield from super()._stream(messages, stop, run_manager, **kwargs)
            else:
                yield from BilledChatModel._stream(self, messages, stop, run_manager, **kwargs)

    retry = ModelRetryMiddleware(max_retries=2, initial_delay=0.0, jitter=False, backoff_factor=0.0)
    from langgraph.checkpoint.memory import InMemorySaver

    agent = create_agent(Flaky(model_name="primary", runs=runs), [], middleware=[guard.middleware(), retry],
                         checkpointer=InMemorySaver())
    inp = {"messages": [("user", "q")]}

    async def astream() -> Any:
        last = None
        async for kind, chunk in agent.astream(inp, config, stream_mode=["messages", "values"]):
            last = chunk if kind == "values" else last
        return last

    async def aevents() -> None:
        async for _ in await agent.astream_events(inp, config, version="v3"):
            pass

    config = {"configurable": {"thread_id": f"t-{mode}-{use_async}"}}
    if mode == "v3":
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # LangChainBetaWarning: the v3 protocol is beta
            if use_async:
                asyncio.run(aevents())
            else:
                for _ in agent.stream_events(inp, config, version="v3"):
                    pass
        out = agent.get_state(config).values
    elif use_async:
        out = asyncio.run(astream())
    else:
        out = None
        for kind, chunk in agent.stream(inp, config, stream_mode=["messages", "values"]):
            out = chunk if kind == "values" else out
    ledger = guard.ledger(out)
    assert runs.names() == ["primary", "primary"]
    assert ledger.spent >= runs.cost(PRICES) - 1e-9 and ledger.reserved == 0  # was 0.11 for 0.22 billed


class _Redactor(AgentMiddleware):
    """Rebuilds the answer below it: same usage and model, a new id (or none)."""

    def __init__(self, new_id: str | None) -> None:
        super().__init__()
        self.new_id = new_id

    def _rebuilt(self, response: Any) -> AIMessage:
        m = response.result[-1]
        return AIMessage("[redacted]", id=self.new_id, usage_metadata=m.usage_metadata,
                         response_metadata=m.response_metadata)

    def wrap_model_call(self, request: Any, handler: Any) -> Any:
        return self._rebuilt(handler(request))

    async def awrap_model_call(self, request: Any, handler: Any) -> Any:
        return self._rebuilt(await handler(request))




@pytest.mark.parametrize("use_async", [False, True])
@pytest.mark.parametrize("new_id", [None, "new-id"])
def test_a_routed_models_answer_rebuilt_by_a_middleware_is_paid_once(use_async, new_id):
    runs, guard = ModelRuns(), _guard(budget=0.7)
    out = _run(guard, runs, [_Redactor(new_id), SwapModel(Fake(model_name="side", runs=runs))], use_async)
    ledger = guard.ledger(out)
    # was 1.10 (the routed run metered, then its rebuilt copy charged again), over the budget of 0.7
    assert ledger.spent == pytest.approx(runs.cost(PRICES)) == pytest.approx(0.55)


def test_a_rebuilt_answer_naming_a_model_the_table_lacks_is_paid_not_a_crash():
    runs, guard = ModelRuns(), _guard()

    class Versioned(BilledChatModel):  # priced as "side"; the provider reports a name the table lacks
        def _generate(self, *args: Any, **kwargs: Any) -> Any:
            result = super()._generate(*args, **kwargs)
            result.generations[0].message.response_metadata["model_name"] = "acme/side-v2"
            return result

    out = _run(guard, runs, [_Redactor(None), SwapModel(Versioned(model_name="side", runs=runs))])
    assert guard.ledger(out).spent == pytest.approx(runs.cost(PRICES)) == pytest.approx(0.55)  # was UnpricedModelError


def test_an_unmetered_answer_naming_a_model_the_table_lacks_is_charged_at_the_dearest_price():
    runs, guard = ModelRuns(), _guard()

    class Direct(AgentMiddleware):  # a provider SDK's call: not a LangChain run, so only settle() sees it
        def wrap_model_call(self, request: Any, handler: Any) -> Any:
            runs.hit("side", 10, 100)
            return AIMessage("answer", usage_metadata={"input_tokens": 10, "output_tokens": 100, "total_tokens": 110},
                             response_metadata={"model_name": "acme/unknown-v9"})

    out = _run(guard, runs, [Direct()])
    assert guard.ledger(out).spent == pytest.approx(0.55)  # side's price, the dearest: was UnpricedModelError


@pytest.mark.parametrize("use_async", [False, True])
def test_a_side_models_bound_that_langchain_reports_for_tracers_prices_its_run(use_async):
    # max_tokens is an attribute of the model only (not in its invocation parameters); LangChain reports it to
    # callbacks as ls_max_tokens.
    runs, guard = ModelRuns(), _guard(budget=2.0, max_output_tokens=100)

    class TracedBound(Bounded):
        def _get_ls_params(self, stop: Any = None, **kwargs: Any) -> Any:
            return {**super()._get_ls_params(stop=stop, **kwargs), "ls_max_tokens": self.max_tokens}

    side = TracedBound(model_name="side", runs=runs, max_tokens=1000)
    refused: list[str] = []

    def call(request: Any) -> None:
        try:
            side.invoke("q")
        except Exception as exc:  # noqa: BLE001 - the refusal is what is checked
            refused.append(type(exc).__name__)

    async def acall(request: Any) -> None:
        try:
            await side.ainvoke("q")
        except Exception as exc:  # noqa: BLE001
            refused.append(type(exc).__name__)

    out = _run(guard, runs, [Side(call, acall)], use_async)
    # Reserved at 1000 output tokens (5.05 > 2.0): refused, never run. Was reserved at 100, then 5.05 spent.
    assert refused == ["ModelCallRefused"] and runs.names() == ["primary"]
    assert guard.ledger(out).spent == pytest.approx(0.11)


@pytest.mark.parametrize("use_async", [False, True])
def test_an_image_given_by_url_counts_as_many_tokens_not_as_its_url(use_async):
    from intent.model_meter import MEDIA_PART_TOKENS, count_prompt_tokens

    image = {"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}
    text_only = count_prompt_tokens([HumanMessage(content=[{"type": "text", "text": "what is this?"}])])
    with_image = count_prompt_tokens([HumanMessage(content=[{"type": "text", "text": "what is this?"}, image])])
    assert with_image - text_only >= MEDIA_PART_TOKENS  # was the URL's 70-odd bytes
    runs, guard = ModelRuns(), _guard(budget=0.5)
    agent = create_agent(Fake(runs=runs), [], middleware=[guard.middleware()])
    inp = {"messages": [HumanMessage(content=[{"type": "text", "text": "what is this?"}, image])]}
    out = asyncio.run(agent.ainvoke(inp)) if use_async else agent.invoke(inp)
    assert runs.names() == [] and guard.ledger(out).spent == 0  # its worst case (about 6.2) does not fit 0.5


@pytest.mark.parametrize("use_async", [False, True])
def test_a_metered_copy_streamed_outside_the_model_step_that_breaks_off_is_paid_and_in_state(use_async):
    # guard.metered_model() called from a before_model hook (a summariser's place): not inside the step's meter.
    runs, guard = ModelRuns(), _guard()
    side = guard.metered_model(DropsMidStream(model_name="side", runs=runs))

    class Before(AgentMiddleware):
        def before_model(self, state: Any, runtime: Any) -> None:
            with pytest.raises(ConnectionError):
                for _ in side.stream("q"):
                    pass

        async def abefore_model(self, state: Any, runtime: Any) -> None:
            with pytest.raises(ConnectionError):
                async for _ in side.astream("q"):
                    pass

    agent = create_agent(Fake(runs=runs), [], middleware=[guard.middleware(), Before()])
    inp, config = {"messages": [("user", "q")]}, {"configurable": {"thread_id": f"t{use_async}"}}
    out = asyncio.run(agent.ainvoke(inp, config)) if use_async else agent.invoke(inp, config)
    entries = out["intent_ledger"]["entries"].values()
    assert runs.cost(PRICES) == pytest.approx(0.66)
    # The broken-off run's charge is in graph state (was released: 0.11 for 0.66 billed).
    assert sum(e["amount"] for e in entries if e["status"] == "committed") >= 0.66 - 1e-9
    assert guard.ledger(out).reserved == 0


def test_parts_that_are_not_media_are_counted_by_their_bytes_only():
    # A history with a refusal, a provider's server-side tool call and its result, redacted thinking: text, not
    # images (each counted as 6,000 tokens once made calls that fit be refused).
    from intent.model_meter import count_prompt_tokens

    parts = [{"type": "refusal", "refusal": "no"}, {"type": "server_tool_call", "id": "s1", "name": "web_search",
             "args": {"q": "x"}}, {"type": "server_tool_result", "tool_call_id": "s1", "output": "found"},
             {"type": "redacted_thinking", "data": "abc"}, {"type": "web_search_call", "id": "w1"}]
    message = AIMessage(content=parts)
    import json

    assert count_prompt_tokens([message]) == len(json.dumps(parts).encode()) + 16


def _waiting_limiter() -> Any:
    from langchain_core.rate_limiters import InMemoryRateLimiter

    class Watched(InMemoryRateLimiter):
        waiting = False  # a request has reached the limiter

        async def aacquire(self, *, blocking: bool = True) -> bool:
            self.waiting = True
            return await super().aacquire(blocking=blocking)

    # An empty bucket that refills once in 1000 s: the first acquire waits (cancelled long before).
    return Watched(requests_per_second=0.001, check_every_n_seconds=0.01)


@pytest.mark.parametrize("stream", [False, True])
def test_a_metered_model_cancelled_while_waiting_on_its_rate_limiter_is_not_charged(stream: bool) -> None:
    # Its request never left the process: nothing to bill (was: its worst case, 0.585, charged).
    runs, guard = ModelRuns(), _guard()
    limiter = _waiting_limiter()
    side = guard.metered_model(BilledChatModel(model_name="side", runs=runs, rate_limiter=limiter))

    async def call_side() -> None:
        if stream:
            async for _chunk in side.astream("q"):
                pass
        else:
            await side.ainvoke("q")

    async def with_timeout(request: Any) -> None:
        await _timed_out_once(call_side(), lambda: limiter.waiting)

    out = _run(guard, runs, [Side(afn=with_timeout)], use_async=True)
    ledger = guard.ledger(out)
    assert runs.names() == ["primary"]
    assert ledger.spent == pytest.approx(0.11) and ledger.reserved == 0
    side_records = [r for r in guard.log_sink.records if r.kind == "model" and r.tool == "side"]
    assert [(r.charged, r.reason) for r in side_records] == [(0.0, "not_sent")]


def test_an_agent_run_cancelled_while_its_model_waits_on_a_rate_limiter_pays_nothing() -> None:
    runs, guard = ModelRuns(), _guard()
    limiter = _waiting_limiter()
    model = BilledChatModel(model_name="primary", runs=runs, rate_limiter=limiter)
    agent = create_agent(model, [], middleware=[guard.middleware()])

    async def main() -> None:
        await _timed_out_once(agent.ainvoke({"messages": [("user", "q")]}, {"configurable": {"thread_id": "t"}}),
                              lambda: limiter.waiting)

    asyncio.run(main())
    ledger = guard.episodes.peek("t").ledger
    assert runs.names() == []
    assert ledger.spent == 0.0 and ledger.reserved == 0


def test_a_model_that_passed_its_rate_limiter_and_is_then_cancelled_is_still_charged() -> None:
    # The other side of the rule: once the limiter let it through, the request is sent.
    from langchain_core.rate_limiters import InMemoryRateLimiter

    class Slow(BilledChatModel):
        async def _agenerate(self, messages: Any, stop: Any = None, run_manager: Any = None, **kwargs: Any) -> Any:
            self.runs.hit(self.model_name, *self.tokens)
            await asyncio.sleep(10)

    runs, guard = ModelRuns(), _guard()
    open_limiter = InMemoryRateLimiter(requests_per_second=1000, check_every_n_seconds=0.001, max_bucket_size=10)
    side = guard.metered_model(Slow(model_name="side", runs=runs, rate_limiter=open_limiter))

    async def with_timeout(request: Any) -> None:
        await _timed_out_once(side.ainvoke("q"), runs.names)

    out = _run(guard, runs, [Side(afn=with_timeout)], use_async=True)
    ledger = guard.ledger(out)
    assert runs.names() == ["side", "primary"]
    assert ledger.spent == pytest.approx(0.11 + 0.585) and ledger.reserved == 0
