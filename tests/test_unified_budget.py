"""One money budget over the agent's model tokens and its priced tools (issue 14).

Every test counts money from outside the guard: model costs from the usage the stub
reports (tokens × the listed price), tool costs from executions counted inside the tools.
"""

from __future__ import annotations

import asyncio
import json
import threading
from typing import Any

import pytest
from decimal import Decimal
from hypothesis import given, settings
from hypothesis import strategies as st
from langchain.agents import create_agent
from langchain.agents.middleware import ModelRetryMiddleware
from langchain_core.messages import AIMessage, HumanMessage, ToolMessage
from langchain_core.tools import StructuredTool
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.types import Command

from intent import (
    AcceptAll,
    Budget,
    BudgetGuard,
    FromParent,
    GuardConfigError,
    Market,
    MemoryLogSink,
    ModelPrice,
    ModelPrices,
    PricedTool,
)
from intent.ledger import BudgetLedger
from intent.market import MarketError, UnpricedToolError
from fakes import priced_tools

from intent.testing import RunCounter, ScriptedToolModel, ai, assert_each_call_answered_once, call, scripted

PRICE = ModelPrice(input_per_mtok=2.0, output_per_mtok=8.0, cached_input_per_mtok=0.5)
PRICES = {"scripted-model": PRICE}


def model_cost(inp: int, out: int, cached: int = 0) -> float:
    return ((inp - cached) * 2.0 + cached * 0.5 + out * 8.0) / 1e6


MARKET = Market([PricedTool("search", 0.02), PricedTool("fetch", 0.05)])
TOOL_PRICE = {"search": 0.02, "fetch": 0.05}


def invariants(guard: BudgetGuard, state: dict[str, Any], sink: MemoryLogSink, runs: RunCounter,
               model_usage: list[tuple[int, int]]) -> None:
    ledger = guard.ledger(state)
    expected_tools = sum(TOOL_PRICE[n] * k for n, k in runs.items())
    expected_models = sum(model_cost(i, o) for i, o in model_usage)
    assert ledger.spent == pytest.approx(expected_tools + expected_models, abs=1e-12)
    assert ledger.spent_by_kind().get("model", 0.0) == pytest.approx(expected_models, abs=1e-12)
    assert ledger.spent <= ledger.budget + 1e-9
    assert ledger.reserved == 0
    assert sum(r.charged for r in sink.records) == pytest.approx(ledger.spent, abs=1e-12)
    charged_ids = [r.call_id for r in sink.records if r.charged > 0 and r.kind == "model"]
    assert len(charged_ids) == len(set(charged_ids)) == sum(1 for e in ledger if e.kind == "model"
                                                            and e.status == "committed")
    assert_each_call_answered_once(state["messages"])


# =========================================================== model spend
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_model_tokens_and_tools_share_one_ledger(mode):
    runs, sink = RunCounter(), MemoryLogSink()
    usage = [(1200, 60), (1900, 45), (2500, 30)]
    model = scripted([ai(call("search", q="a"), usage=usage[0]), ai(call("fetch", q="b"), usage=usage[1]),
                      ai(text="done", usage=usage[2])])
    guard = BudgetGuard(AcceptAll(), MARKET, 1.0, model_prices=PRICES, max_output_tokens=256, log_sink=sink)
    agent = create_agent(model, priced_tools(runs), middleware=[guard.middleware()])
    inp = {"messages": [HumanMessage("go")]}
    out = agent.invoke(inp) if mode == "sync" else asyncio.run(agent.ainvoke(inp))
    invariants(guard, out, sink, runs, usage)
    model_records = [r for r in sink.records if r.kind == "model"]
    assert [r.tokens for r in model_records] == [{"input": i, "output": o, "cached": 0} for i, o in usage]
    assert all(r.tool == "scripted-model" for r in model_records)


def test_cached_input_tokens_are_billed_at_the_cached_price():
    sink = MemoryLogSink()
    msg = AIMessage("done", usage_metadata={"input_tokens": 1000, "output_tokens": 10, "total_tokens": 1010,
                                            "input_token_details": {"cache_read": 800}})
    guard = BudgetGuard(AcceptAll(), MARKET, 1.0, model_prices=PRICES, max_output_tokens=64, log_sink=sink)
    out = create_agent(scripted([msg]), [], middleware=[guard.middleware()]).invoke({"messages": [HumanMessage("q")]})
    assert guard.ledger(out).spent == pytest.approx(model_cost(1000, 10, cached=800), abs=1e-15)


def test_input_written_to_the_prompt_cache_is_billed_at_the_cache_write_price_and_fits_the_worst_case():
    # A provider that writes the prompt to its cache bills those input tokens above the input price (Anthropic:
    # 1.25x, 2x for a one-hour cache). They were charged at the input price, and the worst case reserved
    # (whole prompt x input price) was below the bill: 4000 written tokens at 6/M billed 0.02415, charged 0.01215.
    price = ModelPrice(input_per_mtok=3.0, output_per_mtok=15.0, cached_input_per_mtok=0.3, cache_write_per_mtok=6.0)
    assert price.cost(4000, 10, cached_input_tokens=0, cache_write_tokens=4000) == pytest.approx(0.02415)
    assert price.cost(5000, 10, 1000, 4000) == pytest.approx((1000 * 0.3 + 4000 * 6.0 + 10 * 15.0) / 1e6)
    assert price.worst_case(4000, 10) == pytest.approx(price.cost(4000, 10, 0, 4000))
    assert ModelPrice(3.0, 15.0).worst_case(4000, 10) == pytest.approx((4000 * 3.0 + 10 * 15.0) / 1e6)

    sink = MemoryLogSink()
    msg = AIMessage("done", usage_metadata={"input_tokens": 4000, "output_tokens": 10, "total_tokens": 4010,
                                            "input_token_details": {"cache_creation": 4000, "cache_read": 0}})
    guard = BudgetGuard(AcceptAll(), MARKET, 1.0, model_prices={"scripted-model": price}, max_output_tokens=10,
                        log_sink=sink)
    out = create_agent(scripted([msg]), [], middleware=[guard.middleware()]).invoke(
        {"messages": [HumanMessage("x" * 4000)]})
    ledger = guard.ledger(out)
    assert ledger.spent == pytest.approx(0.02415, abs=1e-12) and ledger.overrun == 0.0, (
        "billed within what was reserved: the reservation prices the prompt as a cache write")
    charged = [r for r in sink.records if r.kind == "model" and r.charged]
    assert len(charged) == 1 and charged[0].reason != "overrun"


@pytest.mark.parametrize("key", ["n", "candidate_count"])
def test_a_request_for_several_completions_is_reserved_for_all_of_them(key):
    # OpenAI's n (Gemini's candidate_count) bills each completion's output: reserved for one, n=3 at
    # max_tokens=100 billed 12 + 300 tokens against a reservation of 18 + 100, over the budget.
    played: list[int] = []

    class Several(ScriptedToolModel):
        max_tokens: int = 100
        n: int = 1
        candidate_count: int = 1

        def _generate(self, *args: Any, **kwargs: Any) -> Any:
            played.append(1)
            return super()._generate(*args, **kwargs)

    price = ModelPrice(input_per_mtok=1000.0, output_per_mtok=1000.0)  # 0.001 a token
    model = Several(messages=iter([ai(text="done", usage=(12, 300))]), bound=[], **{key: 3})
    guard = BudgetGuard(AcceptAll(), MARKET, 0.25, model_prices={"scripted-model": price})
    out = create_agent(model, [], middleware=[guard.middleware()]).invoke({"messages": [HumanMessage("go")]})
    assert played == [], "3 x 100 output tokens (0.3) cannot fit 0.25: the call is not made"
    assert guard.ledger(out).spent == 0.0
    model = Several(messages=iter([ai(text="done", usage=(12, 100))]), bound=[])  # one completion fits
    out = create_agent(model, [], middleware=[guard.middleware()]).invoke({"messages": [HumanMessage("go")]})
    assert played == [1] and guard.ledger(out).spent == pytest.approx(0.112)


def test_the_agents_model_streamed_inside_invoke_that_breaks_off_is_charged_the_usage_its_chunks_reported():
    # Under stream_mode="messages" LangChain streams the agent's model inside invoke and hands on_llm_error no
    # partial output: the usage its first chunk reported was ignored and the whole reservation charged.
    from langchain_core.language_models import BaseChatModel
    from langchain_core.messages import AIMessageChunk
    from langchain_core.outputs import ChatGenerationChunk

    class Drops(BaseChatModel):
        model_name: str = "scripted-model"
        max_tokens: int = 100

        @property
        def _llm_type(self) -> str:
            return "drops"

        def _generate(self, *args: Any, **kwargs: Any) -> Any:
            raise AssertionError("streamed, not generated")

        def _stream(self, messages: Any, stop: Any = None, run_manager: Any = None, **kwargs: Any) -> Any:
            usage = {"input_tokens": 10, "output_tokens": 20, "total_tokens": 30}
            chunk = ChatGenerationChunk(message=AIMessageChunk(content="he", usage_metadata=usage))
            if run_manager:
                run_manager.on_llm_new_token("he", chunk=chunk)
            yield chunk
            raise ConnectionError("dropped mid-stream")

    sink = MemoryLogSink()
    guard = BudgetGuard(AcceptAll(), MARKET, 1.0, model_prices=PRICES, log_sink=sink)
    agent = create_agent(Drops(), [], middleware=[guard.middleware()])
    with pytest.raises(ConnectionError):
        for _ in agent.stream({"messages": [HumanMessage("go")]}, stream_mode="messages"):
            pass
    charged = [(r.reason, r.charged) for r in sink.records if r.kind == "model" and r.charged]
    assert charged == [("failed_mid_stream", pytest.approx(model_cost(10, 20)))]


def test_guard_ledger_with_the_runs_config_reads_a_first_step_that_wrote_no_state():
    # A run stopped in its first model step (here the gate's oracle crashes after the model was paid) wrote no
    # ledger to state: guard.ledger(state) read 0 spent while the model execution was charged.
    class Crashes(AcceptAll):
        def decide(self, ctx: Any) -> Any:
            raise KeyError("bug")

    guard = BudgetGuard(Crashes(), MARKET, 1.0, model_prices=PRICES)
    agent = create_agent(scripted([ai(call("search", q="a"), usage=(100, 10))]), priced_tools(RunCounter()),
                         middleware=[guard.middleware()], checkpointer=InMemorySaver())
    config = {"configurable": {"thread_id": "first-step"}}
    with pytest.raises(KeyError):
        agent.invoke({"messages": [HumanMessage("go")]}, config)
    state = agent.get_state(config).values
    assert not state.get("intent_ledger")
    assert guard.ledger(state).spent == 0.0  # state alone knows nothing
    assert guard.ledger(state, config).spent == pytest.approx(model_cost(100, 10))


def test_a_model_call_that_does_not_fit_is_not_made_and_the_agent_ends_with_the_reason():
    runs, sink = RunCounter(), MemoryLogSink()
    played: list[int] = []

    class Counting(ScriptedToolModel):
        def _generate(self, *args: Any, **kwargs: Any) -> Any:
            played.append(1)
            return super()._generate(*args, **kwargs)

    msgs = [ai(call("search", q="a"), usage=(100, 10)), ai(text="never", usage=(100, 10))]
    model = Counting(messages=iter(msgs), bound=[])
    # Worst case of the 2nd call: >= 2 * 4096 output tokens * 8/M = 0.033 > what is left after search.
    budget = 0.02 + model_cost(100, 10) + 0.03
    guard = BudgetGuard(AcceptAll(), MARKET, budget, model_prices=PRICES, log_sink=sink)
    out = create_agent(model, priced_tools(runs), middleware=[guard.middleware()]).invoke(
        {"messages": [HumanMessage("go")]})
    assert len(played) == 1  # the second model call was never made
    last = out["messages"][-1]
    assert isinstance(last, AIMessage) and not last.tool_calls and "stop" in last.content
    refusal = [r for r in sink.records if r.kind == "model" and r.decision == "reject"]
    assert [r.reason for r in refusal] == ["model_over_budget"] and refusal[0].charged == 0
    invariants(guard, out, sink, runs, [(100, 10)])


def test_the_worst_case_bound_is_bound_into_the_request_as_max_tokens():
    seen: list[dict[str, Any]] = []

    class Recording(ScriptedToolModel):
        def bind(self, **kwargs: Any) -> Any:
            seen.append(kwargs)
            return super().bind(**kwargs)

    model = Recording(messages=iter([ai(text="ok", usage=(5, 5))]), bound=[])
    guard = BudgetGuard(AcceptAll(), MARKET, 1.0, model_prices=PRICES, max_output_tokens=77)
    create_agent(model, [], middleware=[guard.middleware()]).invoke({"messages": [HumanMessage("q")]})
    assert seen and seen[0].get("max_tokens") == 77


@pytest.mark.parametrize("guard_position", ["outer", "inner"])
def test_model_retries_are_metered_per_execution_wherever_the_guard_sits(guard_position):
    runs, sink = RunCounter(), MemoryLogSink()
    usage = [(300, 20), (400, 20)]
    model = scripted([ai(call("search", q="a"), usage=usage[0]), ai(text="done", usage=usage[1])], fail_on={1, 2})
    guard = BudgetGuard(AcceptAll(), MARKET, 1.0, model_prices=PRICES, max_output_tokens=128, log_sink=sink)
    retry = ModelRetryMiddleware(max_retries=3, initial_delay=0.0, backoff_factor=0.0, jitter=False)
    stack = [guard.middleware(), retry] if guard_position == "outer" else [retry, guard.middleware()]
    out = create_agent(model, priced_tools(runs), middleware=stack).invoke({"messages": [HumanMessage("go")]})
    assert len(model.executions) == 4
    invariants(guard, out, sink, runs, usage)
    errors = [r for r in sink.records if r.kind == "model" and r.status == "error"]
    assert len(errors) == 2 and all(r.charged == 0 and r.reason == "model_error" for r in errors)


class _BuggyOracle:
    def decide(self, ctx: Any) -> Any:
        raise KeyError("a bug in the oracle")


def test_with_model_retries_inside_the_guard_an_oracles_bug_is_not_retried():
    # [guard, ModelRetryMiddleware]: the retries wrap the model alone, so the gate's bug (raised
    # after the model answered) leaves the run at once, unchanged, and the model ran once.
    runs = RunCounter()
    model = scripted([ai(call("search", q="a"), usage=(300, 20)), ai(text="done", usage=(10, 10))])
    guard = BudgetGuard(_BuggyOracle(), MARKET, 1.0, model_prices=PRICES, max_output_tokens=128)
    retry = ModelRetryMiddleware(max_retries=3, initial_delay=0.0, backoff_factor=0.0, jitter=False)
    agent = create_agent(model, priced_tools(runs), middleware=[guard.middleware(), retry])
    with pytest.raises(KeyError, match="a bug in the oracle"):
        agent.invoke({"messages": [HumanMessage("go")]})
    assert len(model.executions) == 1 and sum(runs.values()) == 0


def test_unknown_model_is_refused_or_charged_the_worst_case_never_free():
    msgs = [ai(text="hi", usage=(10, 10), model_name="mystery-1")]
    refuse = BudgetGuard(AcceptAll(), MARKET, 1.0, model_prices={"other": PRICE}, max_output_tokens=64)
    model = scripted(msgs, model_name="mystery-1")
    out = create_agent(model, [], middleware=[refuse.middleware()]).invoke({"messages": [HumanMessage("q")]})
    assert "no price" in out["messages"][-1].content and refuse.ledger(out).spent == 0
    assert out["messages"][-1].content != "hi"  # the call was not made

    expensive = ModelPrice(10.0, 30.0)
    worst = BudgetGuard(AcceptAll(), MARKET, 1.0, model_prices={"other": PRICE, "pricey": expensive},
                        unpriced_model="worst_case", max_output_tokens=64)
    out = create_agent(scripted(msgs, model_name="mystery-1"), [], middleware=[worst.middleware()]).invoke(
        {"messages": [HumanMessage("q")]})
    assert out["messages"][-1].content == "hi"
    assert worst.ledger(out).spent == pytest.approx(expensive.cost(10, 10))


@pytest.mark.parametrize("policy", ["worst_case", "refuse"])
def test_a_response_without_usage_is_charged_its_reservation(policy):
    runs, sink = RunCounter(), MemoryLogSink()
    msgs = [ai(call("search", q="a")), ai(text="second", usage=(10, 10))]  # the first reports no usage
    guard = BudgetGuard(AcceptAll(), MARKET, 1.0, model_prices=PRICES, max_output_tokens=100, log_sink=sink,
                        missing_usage=policy)
    out = create_agent(scripted(msgs), priced_tools(runs), middleware=[guard.middleware()]).invoke(
        {"messages": [HumanMessage("go")]})
    first = next(r for r in sink.records if r.kind == "model")
    assert first.reason == "missing_usage" and first.charged > model_cost(0, 100)  # prompt + every output token
    ledger = guard.ledger(out)
    assert ledger.reserved == 0 and sum(r.charged for r in sink.records) == pytest.approx(ledger.spent)
    if policy == "refuse":
        assert out["messages"][-1].content != "second" and "usage" in out["messages"][-1].content
    else:
        assert out["messages"][-1].content == "second"


def test_sub_caps_bind_each_kind_inside_the_total():
    runs, sink = RunCounter(), MemoryLogSink()
    msgs = [ai(call("fetch", q="1"), usage=(10, 10)), ai(call("fetch", q="2"), usage=(10, 10)),
            ai(text="done", usage=(10, 10))]
    guard = BudgetGuard(AcceptAll(), MARKET, Budget(total=1.0, tools=0.08, llm=0.5), model_prices=PRICES,
                        max_output_tokens=64, log_sink=sink)
    out = create_agent(scripted(msgs), priced_tools(runs), middleware=[guard.middleware()]).invoke(
        {"messages": [HumanMessage("go")]})
    assert runs["fetch"] == 1  # the second fetch would take tools to 0.10 > 0.08 although the total has room
    rejected = [r for r in sink.records if r.decision == "reject" and r.kind == "tool"]
    assert [r.reason for r in rejected] == ["over_budget"]
    assert guard.ledger(out).caps == {"tools": 0.08, "llm": 0.5}
    invariants(guard, out, sink, runs, [(10, 10)] * 3)


def test_llm_sub_cap_stops_model_calls_while_tools_money_is_left():
    msgs = [ai(call("search", q="1"), usage=(10, 1000)), ai(text="never", usage=(10, 10))]
    # Worst case of a call: 1000 output tokens = 0.008 (+ a small prompt). The first fits the llm
    # cap of 0.012; after it spent 0.008, the second's worst case does not, though the total has room.
    guard = BudgetGuard(AcceptAll(), MARKET, Budget(total=1.0, llm=0.012), model_prices=PRICES,
                        max_output_tokens=1000)
    out = create_agent(scripted(msgs), priced_tools(RunCounter()), middleware=[guard.middleware()]).invoke(
        {"messages": [HumanMessage("go")]})
    assert out["messages"][-1].content.startswith("I have to stop")


# ========================================================= human top-up
def _saver_agent(tmp_path, guard: BudgetGuard, msgs: list[AIMessage], runs: RunCounter, conn_holder: list) -> Any:
    import sqlite3

    from langgraph.checkpoint.sqlite import SqliteSaver

    conn = sqlite3.connect(str(tmp_path / "checkpoints.sqlite"), check_same_thread=False)
    conn_holder.append(conn)
    return create_agent(scripted(msgs), priced_tools(runs), middleware=[guard.middleware()],
                        checkpointer=SqliteSaver(conn))


def _ask_guard(sink: MemoryLogSink, budget: float = 0.06) -> BudgetGuard:
    return BudgetGuard(AcceptAll(), MARKET, budget, model_prices=PRICES, max_output_tokens=64, log_sink=sink,
                       on_over_budget="ask")


def test_over_budget_pauses_for_a_human_and_a_fresh_guard_resumes_from_sqlite(tmp_path):
    runs, conns = RunCounter(), []
    msgs = [ai(call("fetch", q="1"), usage=(50, 5)), ai(call("fetch", q="2"), usage=(50, 5)),
            ai(text="done", usage=(50, 5))]
    cfg = {"configurable": {"thread_id": "human-1"}}
    sink1 = MemoryLogSink()
    first = _saver_agent(tmp_path, _ask_guard(sink1), msgs, runs, conns)
    out = first.invoke({"messages": [HumanMessage("go")]}, cfg)
    (pause,) = out["__interrupt__"]
    assert pause.value["type"] == "intent.over_budget" and pause.value["tool"] == "fetch"
    assert pause.value["price"] == 0.05 and pause.value["remaining"] < 0.05
    assert {"spent", "remaining", "reason", "plan_estimate", "shortfall"} <= set(pause.value)
    assert runs["fetch"] == 1

    # A new process: a new guard and a new agent over the same checkpoint file.
    sink2 = MemoryLogSink()
    guard2 = _ask_guard(sink2)
    second = _saver_agent(tmp_path, guard2, msgs[2:], runs, conns)  # the model has answered twice already
    out = second.invoke(Command(resume={"action": "top_up", "amount": 0.10, "approved_by": "alice"}), cfg)
    assert "__interrupt__" not in out
    assert runs["fetch"] == 2 and out["messages"][-1].content == "done"
    ledger = guard2.ledger(out)
    assert sum(ledger.top_ups.values()) == pytest.approx(0.10)
    assert list(ledger.approved_by.values()) == ["alice"]
    assert ledger.budget == pytest.approx(0.16) and ledger.spent <= ledger.budget and ledger.reserved == 0
    assert ledger.spent == pytest.approx(0.10 + 3 * model_cost(50, 5))
    (top,) = [r for r in sink2.records if r.decision == "top_up"]
    assert top.approved_by == "alice" and top.price == pytest.approx(0.10)
    for c in conns:
        c.close()


@pytest.mark.parametrize("action", ["approve_once", "deny"])
def test_approve_once_tops_up_exactly_the_shortfall_and_deny_keeps_the_refusal(action):
    runs, sink = RunCounter(), MemoryLogSink()
    msgs = [ai(call("fetch", q="1"), usage=(50, 5)), ai(call("fetch", q="2"), usage=(50, 5)),
            ai(text="done", usage=(50, 5))]
    guard = _ask_guard(sink)
    agent = create_agent(scripted(msgs), priced_tools(runs), middleware=[guard.middleware()],
                         checkpointer=InMemorySaver())
    cfg = {"configurable": {"thread_id": f"h-{action}"}}
    out = agent.invoke({"messages": [HumanMessage("go")]}, cfg)
    shortfall = out["__interrupt__"][0].value["shortfall"]
    out = agent.invoke(Command(resume={"action": action, "approved_by": "bob"}), cfg)
    ledger = guard.ledger(out)
    if action == "approve_once":
        assert runs["fetch"] == 2 and sum(ledger.top_ups.values()) == pytest.approx(shortfall)
    else:
        assert runs["fetch"] == 1 and not ledger.top_ups
        assert any(isinstance(m, ToolMessage) and "not executed" in m.content for m in out["messages"])
    assert ledger.spent <= ledger.budget + 1e-12 and ledger.reserved == 0
    assert_each_call_answered_once(out["messages"])


@pytest.mark.parametrize("bad", [{"amount": 1.0}, {"action": "top_up", "amount": "5"}, "yes",
                                 {"action": "top_up", "amount": Decimal("sNaN")}])
def test_a_malformed_resume_value_asks_again_with_the_fix_and_the_thread_goes_on(bad):
    """LangGraph keeps a resume value as its interrupt's answer: raising on a bad one would replay it on every
    later resume, and the thread could never go on. The run pauses again, saying what was wrong."""
    runs, sink = RunCounter(), MemoryLogSink()
    guard = _ask_guard(sink)
    msgs = [ai(call("fetch", q="1"), usage=(50, 5)), ai(call("fetch", q="2"), usage=(50, 5)),
            ai(text="done", usage=(50, 5))]
    agent = create_agent(scripted(msgs), priced_tools(runs), middleware=[guard.middleware()],
                         checkpointer=InMemorySaver())
    cfg = {"configurable": {"thread_id": "bad-resume"}}
    first = agent.invoke({"messages": [HumanMessage("go")]}, cfg)["__interrupt__"][0].value
    again = agent.invoke(Command(resume=bad), cfg)["__interrupt__"][0].value
    assert "error" not in first and "amount" in again["error"]
    assert {k: v for k, v in again.items() if k != "error"} == first
    out = agent.invoke(Command(resume={"action": "top_up", "amount": 0.10, "approved_by": "alice"}), cfg)
    assert "__interrupt__" not in out and out["messages"][-1].content == "done" and runs["fetch"] == 2
    ledger = guard.ledger(out)
    assert sum(ledger.top_ups.values()) == pytest.approx(0.10) and ledger.reserved == 0
    assert [r.price for r in sink.records if r.decision == "top_up"] == [pytest.approx(0.10)]


def test_a_top_up_that_would_make_the_budget_infinite_asks_again():
    # The ask loop checks the top-up before leaving it (the ledger would refuse it after the loop, with the
    # answer kept by LangGraph: every later resume would replay it and the thread could never go on).
    runs, sink = RunCounter(), MemoryLogSink()
    market = Market([PricedTool("search", 0.02), PricedTool("fetch", 1.5e308)])
    guard = BudgetGuard(AcceptAll(), market, 1e308, model_prices=PRICES, max_output_tokens=64, log_sink=sink,
                        on_over_budget="ask")
    msgs = [ai(call("fetch", q="1"), usage=(50, 5)), ai(text="done", usage=(50, 5))]
    agent = create_agent(scripted(msgs), priced_tools(runs), middleware=[guard.middleware()],
                         checkpointer=InMemorySaver())
    cfg = {"configurable": {"thread_id": "inf-top-up"}}
    first = agent.invoke({"messages": [HumanMessage("go")]}, cfg)["__interrupt__"][0].value
    again = agent.invoke(Command(resume={"action": "top_up", "amount": 1e308}), cfg)["__interrupt__"][0].value
    assert "error" not in first and "makes it infinite" in again["error"]
    out = agent.invoke(Command(resume={"action": "deny"}), cfg)
    assert "__interrupt__" not in out and out["messages"][-1].content == "done" and runs["fetch"] == 0
    ledger = guard.ledger(out)
    assert not ledger.top_ups and ledger.budget == 1e308 and ledger.reserved == 0
    assert_each_call_answered_once(out["messages"])


def test_a_model_call_over_budget_also_asks_and_resumes():
    sink = MemoryLogSink()
    msgs = [ai(text="answer", usage=(50, 5))]
    guard = BudgetGuard(AcceptAll(), MARKET, 0.0001, model_prices=PRICES, max_output_tokens=64, log_sink=sink,
                        on_over_budget="ask")
    agent = create_agent(scripted(msgs), [], middleware=[guard.middleware()], checkpointer=InMemorySaver())
    cfg = {"configurable": {"thread_id": "model-ask"}}
    out = agent.invoke({"messages": [HumanMessage("q")]}, cfg)
    assert out["__interrupt__"][0].value["kind"] == "model"
    out = agent.invoke(Command(resume={"action": "top_up", "amount": 0.01, "approved_by": "carol"}), cfg)
    assert out["messages"][-1].content == "answer"
    ledger = guard.ledger(out)
    assert ledger.spent == pytest.approx(model_cost(50, 5)) and ledger.approved_by and ledger.reserved == 0


# ======================================================== nested budgets
def _sub_agent_tool(child_guard_factory, runs: RunCounter, child_msgs_factory,
                    name: str = "research") -> StructuredTool:
    def research(q: str = "") -> str:
        child = child_guard_factory()
        agent = create_agent(scripted(child_msgs_factory()), priced_tools(runs), middleware=[child.middleware()])
        out = agent.invoke({"messages": [HumanMessage(q)]}, {"configurable": {"thread_id": f"child-{q}"}})
        return out["messages"][-1].content

    return StructuredTool.from_function(research, name=name, description="delegate to a sub-agent")


def test_a_sub_agent_spends_only_what_its_parent_has_left_and_returns_the_rest():
    runs, parent_sink, child_sink = RunCounter(), MemoryLogSink(), MemoryLogSink()
    child_guards: list[BudgetGuard] = []

    def child_guard() -> BudgetGuard:
        g = BudgetGuard(AcceptAll(), MARKET, FromParent(limit=0.30), model_prices=PRICES, max_output_tokens=64,
                        log_sink=child_sink)
        child_guards.append(g)
        return g

    def child_msgs() -> list[AIMessage]:
        return [ai(call("fetch", q="c1"), usage=(40, 4)), ai(text="child done", usage=(40, 4))]

    market = MARKET.with_tool(PricedTool("research", 0.0))
    parent = BudgetGuard(AcceptAll(), market, 1.0, model_prices=PRICES, max_output_tokens=64, log_sink=parent_sink)
    msgs = [ai(call("research", q="x"), usage=(60, 6)), ai(text="parent done", usage=(60, 6))]
    tools = [*priced_tools(runs), _sub_agent_tool(child_guard, runs, child_msgs)]
    out = create_agent(scripted(msgs), tools, middleware=[parent.middleware()]).invoke(
        {"messages": [HumanMessage("go")]}, {"configurable": {"thread_id": "parent"}})
    ledger = parent.ledger(out)
    (carve,) = [e for e in ledger if e.kind == "sub_agent"]
    child_spent = 0.05 + 2 * model_cost(40, 4)
    assert carve.status == "committed" and carve.amount == pytest.approx(child_spent)
    assert ledger.spent == pytest.approx(child_spent + 2 * model_cost(60, 6))
    assert ledger.reserved == 0
    assert sum(r.charged for r in parent_sink.records) == pytest.approx(ledger.spent)
    assert sum(r.charged for r in child_sink.records) == pytest.approx(child_spent)


def test_two_levels_deep_and_the_grandchild_is_capped_by_what_the_child_has():
    runs = RunCounter()

    def grandchild_guard() -> BudgetGuard:
        return BudgetGuard(AcceptAll(), MARKET, FromParent(limit=0.50), model_prices=PRICES, max_output_tokens=32)

    def gc_msgs() -> list[AIMessage]:
        # Three fetches (0.15) but the child carved only 0.12 for itself and spent some: the grandchild
        # gets what the child has left and cannot run all three.
        return [ai(call("fetch", q="g1"), usage=(10, 1)), ai(call("fetch", q="g2"), usage=(10, 1)),
                ai(call("fetch", q="g3"), usage=(10, 1)), ai(text="gc done", usage=(10, 1))]

    child_market = MARKET.with_tool(PricedTool("deeper", 0.0))

    def child_guard() -> BudgetGuard:
        return BudgetGuard(AcceptAll(), child_market, FromParent(limit=0.12), model_prices=PRICES,
                           max_output_tokens=32)

    def child_msgs() -> list[AIMessage]:
        return [ai(call("deeper", q="y"), usage=(10, 1)), ai(text="child done", usage=(10, 1))]

    def child_tools() -> list[StructuredTool]:
        return [*priced_tools(runs), _sub_agent_tool(grandchild_guard, runs, gc_msgs, name="deeper")]

    def research(q: str = "") -> str:
        child = child_guard()
        agent = create_agent(scripted(child_msgs()), child_tools(), middleware=[child.middleware()])
        return agent.invoke({"messages": [HumanMessage(q)]}, {"configurable": {"thread_id": "child"}})[
            "messages"][-1].content

    parent = BudgetGuard(AcceptAll(), MARKET.with_tool(PricedTool("research", 0.0)), 1.0, model_prices=PRICES,
                         max_output_tokens=32)
    tools = [StructuredTool.from_function(research, name="research", description="delegate")]
    out = create_agent(scripted([ai(call("research", q="x"), usage=(10, 1)), ai(text="done", usage=(10, 1))]),
                       tools, middleware=[parent.middleware()]).invoke({"messages": [HumanMessage("go")]},
                                                                        {"configurable": {"thread_id": "p"}})
    ledger = parent.ledger(out)
    (carve,) = [e for e in ledger if e.kind == "sub_agent"]
    assert runs["fetch"] == 2  # 0.12 minus the child's own model calls leaves room for two fetches, not three
    assert carve.amount <= 0.12 + 1e-12 and ledger.reserved == 0
    # the child's 2 model calls, the grandchild's 4, and the grandchild's two fetches
    assert carve.amount == pytest.approx(0.10 + 6 * model_cost(10, 1), rel=1e-9)


@settings(max_examples=25, deadline=None, derandomize=True)
@given(st.integers(2, 8), st.lists(st.sampled_from([None, 0.05, 0.3, 0.7]), min_size=8, max_size=8),
       st.sampled_from([0.1, 1.0, 2.5]), st.lists(st.floats(0.0, 1.0), min_size=8, max_size=8))
def test_parallel_sub_agents_never_take_more_than_the_parent_has_left(n, limits, parent_budget, fractions):
    """Sub-agents started at once, with random limits, spending a random part of their carve: carves
    are reservations in the parent's ledger, so together they never exceed what it has left, and
    what they did not spend goes back."""
    from intent.episodes import Episode
    from intent.nesting import close_carves, spending_scope

    parent = BudgetGuard(AcceptAll(), MARKET, parent_budget)
    episode: Episode = parent.episodes.get("p")
    episode.ledger.reserve("earlier", "fetch", parent_budget / 4)  # the parent already holds some
    carved: dict[int, BudgetLedger] = {}
    barrier = threading.Barrier(n)
    lock = threading.Lock()

    def start(i: int) -> None:
        with spending_scope(parent, episode, "call-k"):
            barrier.wait()
            child = FromParent(limits[i]).carve(f"c{i}")
            spend = child.budget * fractions[i]
            child.reserve("x", "fetch", spend)
            child.commit("x")
            with lock:
                carved[i] = child

    threads = [threading.Thread(target=start, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(carved) == n
    assert sum(c.budget for c in carved.values()) <= parent_budget * 3 / 4 + 1e-9
    for i, c in carved.items():
        assert limits[i] is None or c.budget <= limits[i] + 1e-12
    close_carves(episode, "call-k")
    spent_by_children = sum(c.spent for c in carved.values())
    assert episode.ledger.spent == pytest.approx(spent_by_children)
    assert episode.ledger.reserved == pytest.approx(parent_budget / 4)  # only the parent's own hold


def test_from_parent_outside_a_guarded_call_is_a_clear_error():
    child = BudgetGuard(AcceptAll(), MARKET, FromParent(0.1))
    agent = create_agent(scripted([ai(text="x")]), [], middleware=[child.middleware()])
    with pytest.raises(GuardConfigError, match="FromParent"):
        agent.invoke({"messages": [HumanMessage("q")]}, {"configurable": {"thread_id": "orphan"}})


def test_a_sub_agent_priced_in_another_currency_than_its_parent_is_refused():
    # "One budget has one currency": a FromParent child with EUR prices paid its EUR tokens from a USD budget
    # as if they were dollars.
    runs = RunCounter()

    def child_guard() -> BudgetGuard:
        return BudgetGuard(AcceptAll(), MARKET, FromParent(limit=0.3),
                           model_prices=ModelPrices({"scripted-model": PRICE}, currency="EUR"))

    market = MARKET.with_tool(PricedTool("research", 0.0))
    parent = BudgetGuard(AcceptAll(), market, Budget(total=1.0, currency="USD"),
                         model_prices=ModelPrices(PRICES, currency="USD"))
    tools = [*priced_tools(runs), _sub_agent_tool(child_guard, runs, lambda: [ai(text="child done", usage=(4, 4))])]
    agent = create_agent(scripted([ai(call("research", q="x"), usage=(6, 6)), ai(text="done", usage=(6, 6))]), tools,
                         middleware=[parent.middleware()])
    with pytest.raises(GuardConfigError, match="prices in EUR but the guard it spends from counts in USD"):
        agent.invoke({"messages": [HumanMessage("go")]}, {"configurable": {"thread_id": "fx"}})


def _scope_node_graph(guards: list[BudgetGuard], runs: RunCounter) -> Any:
    """A one-node graph whose node runs a FromParent sub-agent (one 0.05 fetch) inside ``guards[-1].scope``."""
    from langgraph.graph import END, START, StateGraph

    from intent import GuardState

    child = BudgetGuard(AcceptAll(), MARKET, FromParent(0.2))

    def node(state, config):  # noqa: ANN001 - unannotated, for LangGraph to pass the config
        with guards[-1].scope(config):
            agent = create_agent(scripted([ai(call("fetch", q="1")), ai(text="ok")]), priced_tools(runs),
                                 middleware=[child.middleware()])
            agent.invoke({"messages": [HumanMessage("q")]})
        return {}

    graph = StateGraph(GuardState)
    graph.add_node("node", node)
    graph.add_edge(START, "node")
    graph.add_edge("node", END)
    return graph.compile(checkpointer=InMemorySaver())


def test_a_subgraph_node_carves_through_guard_scope():
    # The node's state carries the thread's ledger channel: the sub-agent's spending goes there. Twice on one
    # thread, the second time by a fresh guard (another process): its scope starts from what the first run
    # left in state.
    guards = [BudgetGuard(AcceptAll(), MARKET, 0.07)]
    runs = RunCounter()
    graph = _scope_node_graph(guards, runs)
    config = {"configurable": {"thread_id": "thread-s"}}
    out = graph.invoke({"messages": [HumanMessage("go")]}, config)
    assert guards[0].ledger(out).spent == pytest.approx(0.05) and guards[0].ledger(out).reserved == 0
    guards.append(BudgetGuard(AcceptAll(), MARKET, 0.07))
    out = graph.invoke({"messages": [HumanMessage("again")]}, config)
    # 0.02 left: the second sub-agent's carve cannot pay for its 0.05 call
    assert guards[1].ledger(out).spent == pytest.approx(0.05) and guards[1].ledger(out).reserved == 0
    assert runs["fetch"] == 1


def test_a_scope_node_spends_from_state_after_another_process_spent_on_the_thread():
    # Runs of one thread by two guards (two processes sharing the checkpointer): g1, g1, g2, g1. Each run's node
    # carves for a sub-agent's 0.05 call from the budget 0.17. Was: g1 kept its episode from its second run
    # and, at the fourth, spent from it as it was (0.10 spent) rather than from state (0.15): 0.20 of 0.17.
    # After a run, the scope keeps nothing: a bare thread id is then the clear error.
    first, second = BudgetGuard(AcceptAll(), MARKET, 0.17), BudgetGuard(AcceptAll(), MARKET, 0.17)
    runs, current = RunCounter(), [first]
    graph = _scope_node_graph(current, runs)
    config = {"configurable": {"thread_id": "thread-p"}}
    spent = []
    for guard in (first, first, second, first):
        current[-1] = guard
        out = graph.invoke({"messages": [HumanMessage("go")]}, config)
        spent.append(round(guard.ledger(out).spent, 2))
        assert guard.ledger(out).reserved == 0
    assert spent == [0.05, 0.10, 0.15, 0.15] and runs["fetch"] == 3
    assert len(first.episodes) == 0
    with pytest.raises(GuardConfigError, match="thread 'thread-p'"):
        with first.scope("thread-p"):
            pass


def test_a_top_up_made_between_runs_reaches_the_next_scope_node():
    # A top-up between runs (written to state with graph=; without it the guard refuses, since no run of the
    # thread is going on here) is what the next scope node spends from. (Was, when a top-up without a graph
    # waited on the episode: the scope dropped it, and state said 0.10 spent of 0.07.)
    guards = [BudgetGuard(AcceptAll(), MARKET, 0.07)]
    runs = RunCounter()
    graph = _scope_node_graph(guards, runs)
    config = {"configurable": {"thread_id": "thread-t"}}
    graph.invoke({"messages": [HumanMessage("go")]}, config)
    with pytest.raises(GuardConfigError, match="graph=agent"):
        guards[0].top_up(config, 0.10, approved_by="test")
    assert guards[0].top_up(config, 0.10, approved_by="test", graph=graph) == pytest.approx(0.17)
    graph.invoke({"messages": [HumanMessage("again")]}, config)
    ledger = BudgetLedger.from_state(graph.get_state(config).values["intent_ledger"])  # what another process reads
    assert ledger.budget == pytest.approx(0.17) and ledger.spent == pytest.approx(0.10) and runs["fetch"] == 2
    assert list(ledger.top_ups.values()) == [pytest.approx(0.10)]


def test_guard_scope_with_a_bare_thread_id_and_no_run_going_is_a_clear_error():
    # Nothing says what the thread has left (it may have spent in an earlier run): a fresh budget would
    # spend its money twice. Was: a sub-agent carved 5 from a thread with 2 left, and spent 12 of 10.
    parent = BudgetGuard(AcceptAll(), MARKET, 1.0)
    with pytest.raises(GuardConfigError, match="scope.*thread 'thread-s'.*graph node"):
        with parent.scope("thread-s"):
            pass


# ================================================== prices from metadata
def _declared(name: str, metadata: dict[str, Any] | None) -> StructuredTool:
    return StructuredTool.from_function(lambda q: q, name=name, description=name, metadata=metadata)


def test_market_reads_prices_the_tools_declare():
    a = _declared("a", {"price": 0.02, "currency": "USD"})
    b = _declared("b", {"_meta": {"price": 0.5, "currency": "USD"}})  # an MCP tool's _meta
    # an x402 payment requirement, in the asset's micro-units
    c = _declared("c", {"x402": {"accepts": [{"maxAmountRequired": "30000", "decimals": 6, "asset": "USD"}]}})
    d = _declared("d", None)

    market = Market.from_tools([a, b, c], currency="USD")
    assert market.prices() == {"a": 0.02, "b": 0.5, "c": pytest.approx(0.03)} and market.currency == "USD"
    with pytest.raises(UnpricedToolError, match="'d'"):
        Market.from_tools([a, d])
    assert Market.from_tools([a, d], unpriced="free").price("d") == 0.0
    assert Market.from_tools([a, d], unpriced=0.07).price("d") == 0.07

    e = _declared("e", {"price": 1.0, "currency": "EUR"})
    with pytest.raises(MarketError, match="'e'.*EUR"):
        Market.from_tools([a, e])


def test_one_currency_per_budget():
    eur_market = Market([PricedTool("search", 0.1)], currency="EUR")
    with pytest.raises(GuardConfigError, match="currencies disagree"):
        BudgetGuard(AcceptAll(), eur_market, Budget(1.0, currency="USD"))
    with pytest.raises(GuardConfigError, match="currencies disagree"):
        BudgetGuard(AcceptAll(), eur_market, 1.0, model_prices=ModelPrices(PRICES, currency="USD"))
    BudgetGuard(AcceptAll(), eur_market, Budget(1.0, currency="EUR"))
    BudgetGuard(AcceptAll(), eur_market, Budget(1.0, currency="eur"))  # a currency code, whatever its case


def test_price_tables_load_from_a_file_and_match_dated_model_names(tmp_path):
    path = tmp_path / "prices.json"
    path.write_text(json.dumps({"currency": "USD", "models": {
        "gpt-4o-mini": {"input_per_mtok": 0.15, "output_per_mtok": 0.6, "cached_input_per_mtok": 0.075}}}))
    table = ModelPrices.from_file(path)
    name, price = table.find("gpt-4o-mini-2024-07-18")
    assert name == "gpt-4o-mini" and price.cost(1_000_000, 0) == pytest.approx(0.15)
    assert table.find("gpt-4o") is None  # a prefix of a listed name is not that model
    path.write_text(json.dumps({"models": {"m": {"input": 1}}}))
    with pytest.raises(GuardConfigError, match="input_per_mtok"):
        ModelPrices.from_file(path)


def test_prices_from_the_genai_prices_library():
    pytest.importorskip("genai_prices")
    table = ModelPrices.from_genai_prices(["gpt-4o-mini"])
    price = table.find("gpt-4o-mini")[1]
    assert price.input_per_mtok == pytest.approx(0.15) and price.output_per_mtok == pytest.approx(0.60)
    assert price.cached_input_per_mtok == pytest.approx(0.075) and table.currency == "USD"
    claude = ModelPrices.from_genai_prices(["claude-sonnet-4-0"]).find("claude-sonnet-4-0")[1]
    assert claude.cache_write_per_mtok == pytest.approx(1.25 * claude.input_per_mtok)  # a five-minute cache write
    with pytest.raises(GuardConfigError, match="genai-prices does not know"):
        ModelPrices.from_genai_prices(["surely-not-a-model-xyz"])


def test_bad_model_price_input_names_the_field():
    with pytest.raises(GuardConfigError, match="model_prices\\['m'\\]"):
        BudgetGuard(AcceptAll(), MARKET, 1.0, model_prices={"m": 0.5})
    with pytest.raises(GuardConfigError, match="unpriced_model"):
        BudgetGuard(AcceptAll(), MARKET, 1.0, model_prices=PRICES, unpriced_model="free")
    with pytest.raises(ValueError, match="output_per_mtok"):
        ModelPrice(1.0, -2.0)


def test_two_calls_over_budget_in_one_message_ask_twice_and_each_top_up_is_logged_once():
    runs, sink = RunCounter(), MemoryLogSink()
    msgs = [ai(call("fetch", q="1"), call("fetch", q="2"), usage=(50, 5)), ai(text="done", usage=(50, 5))]
    guard = _ask_guard(sink, budget=0.01)
    agent = create_agent(scripted(msgs), priced_tools(runs), middleware=[guard.middleware()],
                         checkpointer=InMemorySaver())
    cfg = {"configurable": {"thread_id": "two-asks"}}
    out = agent.invoke({"messages": [HumanMessage("go")]}, cfg)
    asks = 0
    while out.get("__interrupt__"):
        asks += 1
        out = agent.invoke(Command(resume={"action": "top_up", "amount": 0.05, "approved_by": f"h{asks}"}), cfg)
    assert asks == 2 and runs["fetch"] == 2
    ledger = guard.ledger(out)
    tops = [r for r in sink.records if r.decision == "top_up"]
    assert len(tops) == len(ledger.top_ups) == 2 and sorted(r.approved_by for r in tops) == ["h1", "h2"]
    assert ledger.spent <= ledger.budget and ledger.reserved == 0


def test_charge_oracle_counts_the_oracles_tokens_in_the_same_budget():
    from intent import Decision, Oracle

    class Thinking(Oracle):
        def decide(self, ctx):  # an oracle that spent 1000 in / 200 out tokens on its own model
            return Decision.accepted(input_tokens=1000, output_tokens=200)

    runs, sink = RunCounter(), MemoryLogSink()
    prices = {**PRICES, "judge-model": ModelPrice(1.0, 2.0)}
    guard = BudgetGuard(Thinking(), MARKET, 1.0, model_prices=prices, max_output_tokens=64, log_sink=sink,
                        charge_oracle=True, oracle_model="judge-model")
    msgs = [ai(call("search", q="1"), call("fetch", q="2"), usage=(20, 5)), ai(text="done", usage=(20, 5))]
    out = create_agent(scripted(msgs), priced_tools(runs), middleware=[guard.middleware()]).invoke(
        {"messages": [HumanMessage("go")]})
    ledger = guard.ledger(out)
    oracle_cost = 2 * (1000 * 1.0 + 200 * 2.0) / 1e6
    assert ledger.spent_by_kind()["oracle"] == pytest.approx(oracle_cost)
    assert ledger.spent == pytest.approx(oracle_cost + 0.07 + 2 * model_cost(20, 5))
    assert sum(r.charged for r in sink.records) == pytest.approx(ledger.spent)
    assert [r.kind for r in sink.records].count("oracle") == 2
    with pytest.raises(GuardConfigError, match="oracle_model"):
        BudgetGuard(Thinking(), MARKET, 1.0, model_prices=PRICES, charge_oracle=True)

    # With a per-decision bound the oracle's worst case is held before it runs: when the budget
    # cannot pay for a decision, the oracle is not asked (the guard's own check decides).
    asked: list[int] = []

    class Counting(Thinking):
        def decide(self, ctx):
            asked.append(1)
            return super().decide(ctx)

    tight = BudgetGuard(Counting(), MARKET, 0.08, model_prices=prices, charge_oracle=True,
                        oracle_model="judge-model", oracle_max_tokens=5000, charge_models=False)
    msgs = [ai(call("fetch", q="1")), ai(call("search", q="2")), ai(text="done")]
    out = create_agent(scripted(msgs), priced_tools(RunCounter()), middleware=[tight.middleware()]).invoke(
        {"messages": [HumanMessage("go")]})
    ledger = tight.ledger(out)
    # fetch: hold 0.01 (5000 tokens at 2/M), oracle costs 0.0014, fetch 0.05 -> 0.0514 spent; search:
    # hold 0.01 fits (0.0286 left), oracle 0.0014, then search 0.02 fits -> 0.0728 <= 0.08
    assert len(asked) == 2 and ledger.spent <= 0.08 + 1e-12 and ledger.reserved == 0
    assert ledger.spent == pytest.approx(0.07 + 2 * 0.0014)

    asked.clear()
    sink = MemoryLogSink()
    tighter = BudgetGuard(Counting(), MARKET, 0.059, model_prices=prices, charge_oracle=True, log_sink=sink,
                          oracle_model="judge-model", oracle_max_tokens=5000, charge_models=False)
    msgs = [ai(call("fetch", q="1")), ai(call("search", q="2")), ai(text="done")]
    out = create_agent(scripted(msgs), priced_tools(RunCounter()), middleware=[tighter.middleware()]).invoke(
        {"messages": [HumanMessage("go")]})
    # after fetch 0.0514 is spent; the next decision's hold (0.01) does not fit the 0.0076 left
    assert len(asked) == 1 and tighter.ledger(out).spent == pytest.approx(0.0514)
    assert [r.reason for r in sink.records if r.tool == "search"] == ["over_budget"]


@pytest.mark.slow
def test_the_benchmark_charges_the_oracles_tokens_when_asked(tmp_path):
    """`intent bench --charge-oracle PRICE`: the oracle's tokens are paid from the episode's budget."""
    from pathlib import Path

    from eval.results import EpisodeResult, ResultStore
    from eval.runner import BenchConfig, run_benchmark

    def run(options: dict[str, Any], out: str) -> list[EpisodeResult]:
        run_benchmark(BenchConfig(market="synthetic-v2", agent="sim-llm", tasks=4, methods=["mco"], out=out,
                                  options=options), progress=False)
        return ResultStore(Path(out) / "episodes.jsonl").load(repair=False)

    free = run({}, str(tmp_path / "free"))
    paid = run({"charge_oracle": 2000.0, "oracle_max_tokens": 20000}, str(tmp_path / "paid"))
    assert all(e.extra["oracle_charged"] == 0 for e in free)
    charged = [e.extra["oracle_charged"] for e in paid]
    assert sum(charged) > 0
    for e in paid:  # the oracle's money is part of what the episode spent, held before each decision
        assert e.cost >= e.extra["oracle_charged"] - 1e-9
        assert e.cost <= e.budget + 1e-9


def test_an_mcp_servers_tools_are_priced_from_their_meta_through_langchain_mcp_adapters():
    """A real MCP server (FastMCP, in memory) declares prices in each tool's ``_meta``; the tools
    come through langchain-mcp-adapters; the market reads the prices and the guard charges them."""
    from langchain_mcp_adapters.tools import load_mcp_tools
    from mcp.server.fastmcp import FastMCP
    from mcp.shared.memory import create_connected_server_and_client_session

    server = FastMCP("priced")

    @server.tool(meta={"price": 0.03, "currency": "USD"})
    def quote(symbol: str) -> str:
        """A stock quote."""
        return f"{symbol}: 123"

    @server.tool(meta={"price": 0.5, "currency": "USD"})
    def report(symbol: str) -> str:
        """An analyst report."""
        return f"{symbol}: buy"

    async def run() -> tuple[Market, dict[str, Any]]:
        async with create_connected_server_and_client_session(server._mcp_server) as session:
            tools = await load_mcp_tools(session)
            market = Market.from_tools(tools, currency="USD")
            guard = BudgetGuard(AcceptAll(), market, Budget(0.6, currency="USD"))
            model = scripted([ai(call("quote", symbol="X"), call("report", symbol="X")),
                              ai(call("report", symbol="Y")), ai(text="done")])
            agent = create_agent(model, tools, middleware=[guard.middleware()])
            return market, await agent.ainvoke({"messages": [HumanMessage("go")]})

    market, out = asyncio.run(run())
    assert market.prices() == {"quote": 0.03, "report": 0.5}
    ledger = BudgetGuard(AcceptAll(), market, 0.6).ledger(out)
    assert ledger.spent == pytest.approx(0.53)  # the second report did not fit 0.6
    assert_each_call_answered_once(out["messages"])


def test_a_tools_x402_payment_requirement_in_its_first_answer_prices_its_next_calls():
    served: list[str] = []

    def premium(q: str) -> Any:
        if not served:
            served.append("402")
            return ToolMessage("402 Payment Required: 0.25 USDC per call", tool_call_id="", artifact={
                "x402": {"x402Version": 1, "accepts": [{"maxAmountRequired": "250000", "decimals": 6,
                                                        "asset": "USD"}]}})
        served.append(q)
        return f"premium data for {q}"

    tool = StructuredTool.from_function(premium, name="premium", description="premium data",
                                        response_format="content")
    sink = MemoryLogSink()
    market = Market.from_tools([tool], unpriced="free", currency="USD")
    guard = BudgetGuard(AcceptAll(), market, Budget(0.6, currency="USD"), log_sink=sink)
    model = scripted([ai(call("premium", q="a")), ai(call("premium", q="a")), ai(call("premium", q="b")),
                      ai(call("premium", q="c")), ai(text="done")])
    out = create_agent(model, [tool], middleware=[guard.middleware()]).invoke(
        {"messages": [HumanMessage("go")]}, {"configurable": {"thread_id": "x402"}})
    ledger = guard.ledger(out)
    assert served == ["402", "a", "b"]  # the third paid call (0.75 > 0.6) was refused
    assert ledger.spent == pytest.approx(0.5) and ledger.reserved == 0
    runs = [r for r in sink.records if r.execution > 0]
    assert [r.reason for r in runs][0] == "payment_required" and runs[0].charged == 0
    assert [r.charged for r in runs[1:]] == [0.25, 0.25]
    assert guard.market.price("premium") == 0.0  # learned for this episode only


def test_a_closed_carve_takes_nothing_more():
    """A sub-agent still running after its parent's call ended cannot spend: its carve is closed."""
    from intent.ledger import BudgetExceededError
    from intent.nesting import spending_scope

    parent = BudgetGuard(AcceptAll(), MARKET, 1.0)
    episode = parent.episodes.get("p")
    with spending_scope(parent, episode, "call-k"):
        child = FromParent(0.5).carve("late-child")
    child.reserve("a", "fetch", 0.1)
    child.commit("a")
    child.close()
    with pytest.raises(BudgetExceededError):
        child.reserve("b", "fetch", 0.1)
    assert episode.ledger.spent == pytest.approx(0.1) and episode.ledger.reserved == 0
