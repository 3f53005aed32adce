"""Oracle failures: only the documented recoverable errors fall back; a bug fails the run loudly.

Recoverable (``intent.errors``): a timeout, an unreachable model server, a malformed model
answer, and what the backends raise for those (httpx, openai, ``worldmodel.ModelError``).
Everything else raised inside an oracle propagates out of ``invoke`` / ``ainvoke``, sync and
async, through the gate and through the tool step's re-gate, and leaves the money right: no
charge forgotten, none taken twice, nothing left reserved. Executions are counted inside the
tools, never read back from the guard.
"""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import openai
import pytest
from langchain.agents import create_agent
from langchain_core.messages import AIMessage, HumanMessage
from langchain_core.tools import StructuredTool
from langgraph.checkpoint.memory import InMemorySaver

from intent import AcceptAll, BudgetGuard, Decision, DecisionContext, Market, MemoryLogSink, Oracle, PricedTool, Proposal
from intent.errors import (
    ContextOverflowError,
    IntentError,
    MalformedModelOutputError,
    ModelRequestError,
    ModelUnreachableError,
    OracleTimeoutError,
    OracleUnavailableError,
    as_oracle_unavailable,
)
from intent.oracles import IntentOracle, MCOOracle
from intent.policy import AgentPolicy
from intent.testing import GuardDriver, RunCounter, ScriptedToolModel, assert_each_call_answered_once
from worldmodel.openai_compat import OpenAICompatibleWorldModel
from worldmodel.protocols import ModelError

PRICES = {"a": 10.0, "b": 7.0}
MARKET = Market([PricedTool(n, p) for n, p in PRICES.items()])
REQUEST = httpx.Request("POST", "http://wm.invalid/v1/chat/completions")

# What a model backend raises when it times out, cannot be reached or answers garbage.
RECOVERABLE = {
    "TimeoutError": lambda: TimeoutError("no answer in 30 s"),
    "ConnectionError": lambda: ConnectionRefusedError("connection refused"),
    "httpx.ConnectTimeout": lambda: httpx.ConnectTimeout("timed out", request=REQUEST),
    "httpx.ConnectError": lambda: httpx.ConnectError("refused", request=REQUEST),
    "httpx.RemoteProtocolError": lambda: httpx.RemoteProtocolError("server disconnected", request=REQUEST),
    "openai.APITimeoutError": lambda: openai.APITimeoutError(request=REQUEST),
    "openai.APIConnectionError": lambda: openai.APIConnectionError(request=REQUEST),
    "openai.InternalServerError": lambda: openai.InternalServerError(
        "overloaded", response=httpx.Response(503, request=REQUEST), body=None),
    "worldmodel.ModelError": lambda: ModelError("world model down"),
    "MalformedModelOutputError": lambda: MalformedModelOutputError("no content in the reply"),
    # vLLM's own words when a prompt outgrows the context (seen from bench-llm's INTENT rollouts).
    "openai.BadRequestError (context length)": lambda: openai.BadRequestError(
        "Error code: 400 - This model's maximum context length is 8192 tokens. However, your prompt contains at "
        "least 8193 input tokens", response=httpx.Response(400, request=REQUEST), body=None),
}
# Bugs in an oracle's code, and a misconfigured model: never a fallback case.
BUGS = {
    "KeyError": lambda: KeyError("tool"),
    "TypeError": lambda: TypeError("unsupported operand type(s) for +: 'float' and 'str'"),
    "AttributeError": lambda: AttributeError("'NoneType' object has no attribute 'price'"),
    "AssertionError": lambda: AssertionError("invariant broken"),
    "ModelRequestError": lambda: ModelRequestError("HTTP 404: model 'wm' does not exist"),
    "openai.BadRequestError": lambda: openai.BadRequestError(
        "bad request", response=httpx.Response(400, request=REQUEST), body=None),
}


class Runs(RunCounter):
    """Real executions per tool, counted inside the tools (thread-safe), and what they cost."""

    def tool(self, name: str) -> StructuredTool:
        def fn(x: int = 0) -> str:
            self.hit(name)
            return f"{name} ran with {x}"

        return StructuredTool.from_function(fn, name=name, description=f"Tool {name}.")

    def money(self) -> float:
        return sum(n * PRICES[name] for name, n in self.items())


class Scripted(Oracle):
    """Accepts every call; raises ``make()`` on the decisions numbered in ``fail_on`` (1-based)."""

    def __init__(self, make: Any, fail_on: set[int], *, is_async: bool = False) -> None:
        self.make, self.fail_on, self.n = make, set(fail_on), 0
        if is_async:
            self.adecide = self._adecide  # only the async path has adecide (the sync one must not need it)

    def decide(self, ctx: DecisionContext) -> Decision:
        self.n += 1
        if self.n in self.fail_on:
            raise self.make()
        return Decision.accepted()

    async def _adecide(self, ctx: DecisionContext) -> Decision:
        await asyncio.sleep(0)
        return self.decide(ctx)


def tc(name: str, cid: str, **args: Any) -> dict[str, Any]:
    return {"name": name, "args": args, "id": cid, "type": "tool_call"}


def script() -> list[AIMessage]:
    # Turn 1: one call (decision 1). Turn 2: a parallel batch (decisions 2 and 3). Then an answer.
    return [AIMessage("", tool_calls=[tc("a", "c1", x=1)]),
            AIMessage("", tool_calls=[tc("b", "c2", x=2), tc("a", "c3", x=3)]),
            AIMessage("done")]


def run(agent: Any, inputs: Any, config: dict[str, Any], is_async: bool) -> Any:
    return asyncio.run(agent.ainvoke(inputs, config)) if is_async else agent.invoke(inputs, config)


# =========================================================== the classification itself
@pytest.mark.parametrize("name", sorted(RECOVERABLE))
def test_recoverable_errors_are_typed(name):
    exc = RECOVERABLE[name]()
    typed = as_oracle_unavailable(exc)
    assert isinstance(typed, OracleUnavailableError) and isinstance(typed, IntentError)
    assert typed is exc or typed.__cause__ is exc
    if "Timeout" in name:
        assert isinstance(typed, OracleTimeoutError)
    if "context length" in name:
        assert isinstance(typed, ContextOverflowError)


@pytest.mark.parametrize("name", sorted(BUGS))
def test_bugs_are_not_recoverable(name):
    assert as_oracle_unavailable(BUGS[name]()) is None


# =========================================================== through create_agent
@pytest.mark.parametrize("gate_at", ["after_model", "model_call"])
@pytest.mark.parametrize("is_async", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("tool_errors", ["raise", "message"])
@pytest.mark.parametrize("bug", ["KeyError", "TypeError", "AttributeError", "ModelRequestError"])
def test_a_bug_in_the_oracle_fails_the_run_and_the_money_stays_right(bug, tool_errors, is_async, gate_at):
    """The oracle crashes on decision 3, mid-batch, after decision 2 accepted c2: the run
    raises the oracle's own exception; only c1 ran and was paid; c2 was neither run nor left
    reserved. Resumed with the oracle fixed: with the gate in an after_model hook, the batch's
    message was checkpointed and is gated afresh, every call paid exactly once; with the gate
    inside the model call, the step that failed is the model's, so the model is asked again
    (here its next reply, the final answer) and the crashed batch never existed."""
    runs, sink, saver = Runs(), MemoryLogSink(), InMemorySaver()
    oracle = Scripted(BUGS[bug], {3}, is_async=is_async)
    guard = BudgetGuard(oracle, MARKET, 100.0, log_sink=sink, tool_errors=tool_errors, gate_at=gate_at)
    agent = create_agent(ScriptedToolModel(messages=iter(script()), bound=[]), [runs.tool("a"), runs.tool("b")],
                         middleware=[guard.middleware()], checkpointer=saver)
    config = {"configurable": {"thread_id": f"bug-{bug}-{tool_errors}-{is_async}-{gate_at}"}}
    expected = type(BUGS[bug]())
    with pytest.raises(expected) as raised:
        run(agent, {"messages": [("user", "go")]}, config, is_async)
    assert type(raised.value) is expected  # unchanged, not wrapped, not turned into a fallback

    assert runs == {"a": 1}  # c1 only
    state = agent.get_state(config).values
    ledger = guard.ledger(state)
    assert ledger.spent == runs.money() == 10.0
    assert ledger.reserved == 0, "the crashed batch left a reservation behind"
    assert not any(r.reason == "oracle_error" for r in sink.records)
    assert {r.call_id for r in sink.records} == {"c1"}  # the crashed batch logged nothing

    oracle.fail_on = set()  # fixed: the thread resumes where it failed
    out = run(agent, None, config, is_async)
    ledger = guard.ledger(out)
    if gate_at == "after_model":
        assert runs == {"a": 2, "b": 1}
        assert ledger.spent == runs.money() == 27.0
        assert sorted(r.call_id for r in sink.records if r.execution > 0) == ["c1", "c2", "c3"]
    else:
        assert runs == {"a": 1}
        assert ledger.spent == runs.money() == 10.0
        assert out["messages"][-1].content == "done"
        assert not any(c["id"] in ("c2", "c3") for m in out["messages"] for c in getattr(m, "tool_calls", []))
    assert ledger.reserved == 0
    assert_each_call_answered_once(out["messages"])


@pytest.mark.parametrize("is_async", [False, True], ids=["sync", "async"])
def test_an_oracle_raising_stop_iteration_fails_instead_of_ending_the_batch(is_async):
    """The gate is driven as a generator: a StopIteration from the oracle (an exhausted
    scripted model, say) must not read as "batch done" and leave the calls ungated."""
    runs = Runs()
    guard = BudgetGuard(Scripted(StopIteration, {1}, is_async=is_async), MARKET, 100.0)
    agent = create_agent(ScriptedToolModel(messages=iter(script()), bound=[]), [runs.tool("a"), runs.tool("b")],
                         middleware=[guard.middleware()])
    with pytest.raises(RuntimeError, match="raised StopIteration"):
        run(agent, {"messages": [("user", "go")]}, {"configurable": {"thread_id": f"stop-{is_async}"}}, is_async)
    assert runs == {}


@pytest.mark.parametrize("is_async", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("name", ["TimeoutError", "httpx.ConnectError", "openai.APITimeoutError",
                                  "worldmodel.ModelError", "MalformedModelOutputError"])
@pytest.mark.parametrize("policy", ["accept_if_fits", "reject"])
def test_a_recoverable_failure_falls_back_as_documented(policy, name, is_async):
    runs, sink = Runs(), MemoryLogSink()
    oracle = Scripted(RECOVERABLE[name], {3}, is_async=is_async)
    guard = BudgetGuard(oracle, MARKET, 100.0, log_sink=sink, on_oracle_error=policy)
    agent = create_agent(ScriptedToolModel(messages=iter(script()), bound=[]), [runs.tool("a"), runs.tool("b")],
                         middleware=[guard.middleware()])
    out = run(agent, {"messages": [("user", "go")]}, {"configurable": {"thread_id": f"fb-{name}"}}, is_async)
    fallback = [r for r in sink.records if r.reason == "oracle_error"]
    assert [r.call_id for r in fallback] == ["c3"]
    if policy == "accept_if_fits":
        assert runs == {"a": 2, "b": 1} and fallback[0].decision == "accept"
    else:
        assert runs == {"a": 1, "b": 1} and fallback[0].decision == "reject"
    ledger = guard.ledger(out)
    assert ledger.spent == runs.money() and ledger.reserved == 0
    assert_each_call_answered_once(out["messages"])


def test_the_fallback_never_accepts_what_does_not_fit():
    runs = Runs()
    guard = BudgetGuard(Scripted(lambda: TimeoutError("slow"), {2, 3}), MARKET, 15.0)
    agent = create_agent(ScriptedToolModel(messages=iter(script()), bound=[]), [runs.tool("a"), runs.tool("b")],
                         middleware=[guard.middleware()])
    out = agent.invoke({"messages": [("user", "go")]})
    assert runs == {"a": 1}  # b (7) does not fit in the 5 left, nor does the second a
    assert guard.ledger(out).spent == runs.money() == 10.0


# =========================================================== the tool step's re-gate
@pytest.mark.parametrize("tool_errors", ["raise", "message"])
def test_a_bug_while_re_gating_an_edited_call_fails_and_releases_the_reservation(tool_errors):
    """A reviewer edits the call's arguments inside the guard: the oracle is asked again and
    crashes. The edited call never runs and its reservation is given back; the bug is raised at the
    episode's next step (here its end), not inside the tool's run, where a retry middleware would take
    it for the tool's failure. ``tool_errors="message"`` does not swallow it."""
    runs = Runs()
    guard = BudgetGuard(Scripted(lambda: KeyError("args"), {2}), MARKET, 100.0, tool_errors=tool_errors)
    driver = GuardDriver(guard, thread_id=f"regate-{tool_errors}", tools={"a": runs.tool("a")})

    def edit_then_run(request):
        c = request.tool_call
        return request.tool.invoke({**c, "args": {"x": 99}, "type": "tool_call"})

    answers = driver.step(AIMessage("", tool_calls=[tc("a", "e1", x=1)]), run_tool=edit_then_run)
    assert [(m.status, m.artifact["intent_reason"]) for m in answers] == [("error", "oracle_bug")]
    assert runs == {}
    ledger = guard.episodes.get("regate-" + tool_errors).ledger
    assert (ledger.spent, ledger.reserved) == (0.0, 0.0)
    with pytest.raises(KeyError, match="args"):
        driver.finish()


@pytest.mark.parametrize("is_async", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("order", ["no_retry", "guard_first", "retry_first", "model_retry_first"])
@pytest.mark.parametrize("hook", ["observe", "result_note"])
def test_a_bug_in_an_oracle_hook_at_the_tool_step_is_raised_once_and_the_tool_runs_once(hook, order, is_async):
    """observe (and result_note) run inside the tool step: raised there, a ToolRetryMiddleware took the
    oracle's bug for the tool's failure, ran (and paid) the tool three times, and answered the call
    "failed after 3 attempts". The bug is raised at the episode's next model step: the tool ran once,
    its charge is in the checkpoint."""
    from langchain.agents.middleware import ToolRetryMiddleware

    class Buggy(AcceptAll):
        pass

    def bug(self: Any, outcome: Any) -> None:
        raise KeyError(f"bug in {hook}")

    setattr(Buggy, hook, bug)
    runs, saver = Runs(), InMemorySaver()
    guard = BudgetGuard(Buggy(), MARKET, 100.0)
    retry = ToolRetryMiddleware(max_retries=2, initial_delay=0.0, jitter=False)
    from langchain.agents.middleware import ModelRetryMiddleware

    # A model retry listed before the guard re-runs the model step the bug is raised in: it must not be lost.
    model_retry = ModelRetryMiddleware(max_retries=2, initial_delay=0.0, jitter=False)
    middleware = {"no_retry": [guard.middleware()], "guard_first": [guard.middleware(), retry],
                  "retry_first": [retry, guard.middleware()],
                  "model_retry_first": [model_retry, guard.middleware()]}[order]
    agent = create_agent(ScriptedToolModel(messages=iter([AIMessage("", tool_calls=[tc("a", "c1", x=1)]),
                                                         AIMessage("done")]), bound=[]),
                         [runs.tool("a")], middleware=middleware, checkpointer=saver)
    config = {"configurable": {"thread_id": f"hook-{hook}-{order}-{is_async}"}}
    with pytest.raises(KeyError, match=f"bug in {hook}"):
        run(agent, {"messages": [("user", "go")]}, config, is_async)
    assert runs == {"a": 1}
    ledger = guard.ledger(agent.get_state(config).values)
    assert ledger.spent == runs.money() == 10.0 and ledger.reserved == 0


# =========================================================== the planning oracles
class FailingWM:
    def __init__(self, make: Any) -> None:
        self.make = make

    def simulate(self, tool, args, *, satisfied=None):
        raise self.make()


class OnePredictor:
    def predict(self, reasoning, tool, args):
        return 1.0


def ctx(tool: str = "a", remaining: float = 50.0) -> DecisionContext:
    prop = Proposal(f"p-{tool}", tool, {"x": 1}, f"I need {tool}")
    return DecisionContext("e1", "q", prop, MARKET.price(tool), 50.0, 50.0 - remaining, remaining, MARKET, step=0,
                           history=[HumanMessage("q"), AIMessage(f"I need {tool}", tool_calls=[tc(tool, prop.call_id, x=1)])],
                           batch=(prop,))


def planners(wm: Any, model: Any = None) -> dict[str, Any]:
    policy = AgentPolicy(model or ScriptedToolModel(messages=iter([AIMessage("done")] * 4), bound=[]))
    return {"mco": MCOOracle(policy, wm, max_depth=3), "intent": IntentOracle(policy, wm, OnePredictor(), max_depth=3)}


@pytest.mark.parametrize("kind", ["mco", "intent"])
@pytest.mark.parametrize("is_async", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("name", sorted(RECOVERABLE))
def test_planning_oracles_fall_back_on_an_unavailable_world_model(name, is_async, kind):
    oracle = planners(FailingWM(RECOVERABLE[name]))[kind]
    d = asyncio.run(oracle.adecide(ctx())) if is_async else oracle.decide(ctx())
    assert d.reason == "oracle_error" and d.usage["model_error"] == 1 and d.accept


@pytest.mark.parametrize("kind", ["mco", "intent"])
@pytest.mark.parametrize("is_async", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("name", sorted(BUGS))
def test_planning_oracles_raise_a_bug_in_the_world_model(name, is_async, kind):
    oracle = planners(FailingWM(BUGS[name]))[kind]
    expected = type(BUGS[name]())
    with pytest.raises(expected):
        asyncio.run(oracle.adecide(ctx())) if is_async else oracle.decide(ctx())


class ModelDown(ScriptedToolModel):
    """The agent's chat model behind the policy: its client cannot reach the server."""

    def invoke(self, *args: Any, **kwargs: Any) -> Any:
        raise openai.APIConnectionError(request=REQUEST)


class WM:
    def simulate(self, tool, args, *, satisfied=None):
        return '{"ok": true}'


@pytest.mark.parametrize("kind", ["mco", "intent"])
def test_an_unreachable_policy_model_is_typed_and_falls_back(kind):
    oracle = planners(WM(), ModelDown(messages=iter([]), bound=[]))[kind]
    d = oracle.decide(ctx())
    assert d.reason == "oracle_error" and d.accept and d.usage["model_error"] == 1
    with pytest.raises(ModelUnreachableError, match="agent policy's model"):
        AgentPolicy(ModelDown(messages=iter([]), bound=[])).next_action([HumanMessage("q")])


def test_a_predictor_returning_a_non_probability_falls_back():
    class Wild:
        def predict(self, reasoning, tool, args):
            return 7.0  # not in [0, 1]: a malformed model answer

    policy = AgentPolicy(ScriptedToolModel(messages=iter([AIMessage("done")]), bound=[]))
    d = IntentOracle(policy, WM(), Wild(), max_depth=2).decide(ctx())
    assert d.reason == "oracle_error"


# =========================================================== the OpenAI-compatible world model
def _wm(handler: Any, **kw: Any) -> OpenAICompatibleWorldModel:
    return OpenAICompatibleWorldModel("http://wm.invalid/v1", "wm", retries=1, backoff=0,
                                      transport=httpx.MockTransport(handler), **kw)


@pytest.mark.parametrize("case,typed", [
    ("timeout", OracleTimeoutError), ("refused", ModelUnreachableError), ("503", ModelUnreachableError),
    ("malformed", MalformedModelOutputError),
])
def test_openai_compatible_world_model_raises_typed_recoverable_errors(case, typed):
    hits = []

    def handler(request: httpx.Request) -> httpx.Response:
        hits.append(1)
        if case == "timeout":
            raise httpx.ReadTimeout("slow", request=request)
        if case == "refused":
            raise httpx.ConnectError("refused", request=request)
        if case == "503":
            return httpx.Response(503)
        return httpx.Response(200, json={"nothing": "here"})

    with pytest.raises(typed) as raised:
        _wm(handler).simulate("a", {})
    assert isinstance(raised.value, ModelError)  # still the world-model protocol's error
    assert as_oracle_unavailable(raised.value) is raised.value
    assert len(hits) == (1 if case == "malformed" else 2)  # retried unless asking again cannot help
    d = planners(_wm(handler))["mco"].decide(ctx())
    assert d.reason == "oracle_error"


def test_openai_compatible_world_model_4xx_is_a_configuration_error_that_fails_loudly():
    wm = _wm(lambda request: httpx.Response(404, text="model 'wm' not found"))
    with pytest.raises(ModelRequestError, match="check the model name"):
        wm.simulate("a", {})
    with pytest.raises(ModelError, match="HTTP 404"):
        planners(wm)["mco"].decide(ctx())  # not a fallback: the run must stop


def test_an_edited_call_whose_regate_crashed_never_runs_undecided():
    """A handler inside the guard edits the call (as a reviewer does), the oracle crashes on the
    re-gate, and the handler swallows the crash and runs the tool again: the second run must be
    re-gated (and crash again), never run without a decision."""

    class CrashOnRegate(Oracle):
        def __init__(self) -> None:
            self.calls = 0

        def decide(self, ctx: DecisionContext) -> Decision:
            self.calls += 1
            if self.calls > 1:
                raise KeyError("bug in the oracle")
            return Decision.accepted()

    runs: list[str] = []

    def quote(symbol: str) -> str:
        runs.append(symbol)
        return f"{symbol}: 1.0"

    tool = StructuredTool.from_function(quote, name="quote", description="a quote")
    guard = BudgetGuard(CrashOnRegate(), Market([PricedTool("quote", 5.0)]), 50.0)
    driver = GuardDriver(guard, tools={"quote": tool})

    def edit_then_retry(request: Any) -> Any:
        edited = {**request.tool_call, "args": {"symbol": "EDITED"}}
        first = request.tool.invoke({**edited, "type": "tool_call"})
        assert first.status == "error"  # the crash is not raised inside the tool's run
        return request.tool.invoke({**edited, "type": "tool_call"})  # a careless handler runs it again

    driver.step(AIMessage("", tool_calls=[{"name": "quote", "args": {"symbol": "A"}, "id": "c1",
                                           "type": "tool_call"}]), edit_then_retry)
    assert runs == []  # the edited call never ran undecided
    assert driver.guard.oracle.calls == 3  # the gate, then a re-gate for each attempt
    with pytest.raises(KeyError, match="bug in the oracle"):
        driver.finish()  # raised at the episode's next step


class ContextFullAfterOneTurn(ScriptedToolModel):
    """The agent's model behind the policy: one more call, then the simulated history is too long."""

    turns: int = 0

    def invoke(self, *args: Any, **kwargs: Any) -> Any:
        self.turns += 1
        if self.turns > 1:
            raise openai.BadRequestError(
                "Error code: 400 - This model's maximum context length is 8192 tokens. However, your prompt "
                "contains at least 8193 input tokens", response=httpx.Response(400, request=REQUEST), body=None)
        return AIMessage("", tool_calls=[tc("b", "r1", x=2)])


def test_a_rollout_that_outgrows_the_policy_models_context_ends_there_and_the_oracle_still_plans():
    # bench-llm with a 0.5B model: INTENT's rollouts called the agent's model on a simulated
    # history that grew past its 8,192-token context, and the HTTP 400 crashed the episode.
    from intent.rollout import simulate_rollout

    policy = AgentPolicy(ContextFullAfterOneTurn(messages=iter([]), bound=[]))
    out = simulate_rollout(ctx(), policy, WM(), satisfied=None, max_depth=5)
    assert out.context_full and out.truncated and not out.answered
    assert [s.tool for s in out.steps] == ["a", "b"]  # the proposal and the one turn that fit
    for kind in ("mco", "intent"):
        d = planners(WM(), ContextFullAfterOneTurn(messages=iter([]), bound=[]))[kind].decide(ctx())
        assert d.reason != "oracle_error", kind  # a plan from the rollout it had, not the fallback
        assert d.trace, kind


def test_openai_compatible_world_model_context_overflow_is_recoverable():
    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(400, text='{"error": {"message": "This model\'s maximum context length is 2048 tokens"}}')

    with pytest.raises(ContextOverflowError) as raised:
        _wm(handler).simulate("a", {})
    assert isinstance(raised.value, ModelError) and as_oracle_unavailable(raised.value) is raised.value
    assert planners(_wm(handler))["mco"].decide(ctx()).reason == "oracle_error"


@pytest.mark.parametrize("value", ["abc", None, object()])
def test_a_predictor_that_returns_no_number_is_a_bug_named_as_such(value):
    # A predictor's wrong type is its code's bug: a TypeError naming it (it was a bare float() error for a
    # string and None), not the recoverable ModelError that NaN or a value outside [0, 1] is.
    from worldmodel.protocols import predict_many

    class Wrong:
        def predict(self, reasoning, tool, args):
            return value

    with pytest.raises(TypeError, match="Wrong returned .*a predictor returns each probability as a float"):
        predict_many(Wrong(), [("r", "a", {})])
    with pytest.raises(ModelError, match="p=nan"):
        predict_many(type("NaN", (), {"predict": lambda self, *a: float("nan")})(), [("r", "a", {})])


@pytest.mark.parametrize("value", [None, {"ok": True}, 3])
def test_a_world_model_that_returns_no_text_is_a_bug_not_an_observation(value):
    # str() made "None" a plausible simulated observation.
    from worldmodel.protocols import simulate_counted

    class Wrong:
        def simulate(self, tool, args, *, satisfied=None):
            return value

    with pytest.raises(TypeError, match="Wrong.simulate returned"):
        simulate_counted(Wrong(), "a", {}, satisfied=True)


def test_a_deferred_oracle_bug_is_not_raised_again_on_the_threads_next_run():
    # The bug of one run's observe fails that run (at its next model step); a new message on the thread is the
    # next run, which starts without it (it was raised again before the new run's start could drop it).
    class OnceBuggy(AcceptAll):
        broken = True

        def observe(self, outcome: Any) -> None:
            if self.broken:
                raise KeyError("bug in observe")

    oracle, runs = OnceBuggy(), Runs()
    guard = BudgetGuard(oracle, MARKET, 100.0)
    # (The first run's second model step raises before its model is called.)
    model = ScriptedToolModel(messages=iter([AIMessage("", tool_calls=[tc("a", "c1", x=1)]),
                                             AIMessage("second run's answer")]), bound=[])
    agent = create_agent(model, [runs.tool("a")], middleware=[guard.middleware()], checkpointer=InMemorySaver())
    config = {"configurable": {"thread_id": "deferred-next-run"}}
    with pytest.raises(KeyError, match="bug in observe"):
        agent.invoke({"messages": [("user", "go")]}, config)
    oracle.broken = False
    out = agent.invoke({"messages": [("user", "again")]}, config)
    assert out["messages"][-1].content == "second run's answer" and runs == {"a": 1}
