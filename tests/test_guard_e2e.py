"""End to end: create_agent middleware, hand-built StateGraph, guard_react_agent, checkpointers."""

import asyncio

import numpy as np
import pytest
from fakes import ai, call, flaky, get_quote, scripted, search_news
from langchain.agents import create_agent
from langchain_core.messages import AIMessage, ToolMessage
from langchain_core.tools import tool
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.graph import END, START, StateGraph

from intent import (
    LEDGER_KEY,
    AcceptAll,
    BudgetGuard,
    Decision,
    GuardState,
    InvalidDecisionError,
    JsonlLogSink,
    Market,
    MemoryLogSink,
    Oracle,
    PricedTool,
    guard_react_agent,
    read_log,
)
from intent.logs import LogFormatError

TOOLS = [get_quote, search_news, flaky]


def market(**prices):
    prices = prices or {"get_quote": 12.0, "search_news": 5.0, "flaky": 3.0}
    return Market([PricedTool(n, p) for n, p in prices.items()])


def tool_messages(out):
    return {m.tool_call_id: m for m in out["messages"] if isinstance(m, ToolMessage)}


def run_agent(guard, script, **kw):
    agent = create_agent(scripted(script), TOOLS, middleware=[guard.middleware()], **kw)
    return agent, agent.invoke({"messages": [("user", "get quotes")]}, kw.get("config"))


def test_parallel_batch_is_gated_in_order_and_charges_once():
    sink = MemoryLogSink()
    guard = BudgetGuard(AcceptAll(), market(), 20, log_sink=sink, tool_errors="message")
    a, b, c = call("get_quote", symbol="A"), call("get_quote", symbol="B"), call("flaky", x=1)
    _, out = run_agent(guard, [ai(a, b, c), AIMessage("done")])
    msgs = tool_messages(out)
    assert msgs[a["id"]].status == "success"
    assert msgs[b["id"]].status == "error" and "only 8 of the budget 20" in msgs[b["id"]].content
    assert msgs[c["id"]].status == "error" and "charged" in msgs[c["id"]].content  # a raising tool is charged
    ledger = guard.ledger(out)
    assert (ledger.spent, ledger.reserved) == (15, 0)
    assert sum(r.charged for r in sink.records) == 15
    assert sorted(r.call_id for r in sink.records) == sorted([a["id"], b["id"], c["id"]])


def test_async_agent_works_with_async_oracle():
    class AsyncOracle(Oracle):
        async def adecide(self, ctx):
            await asyncio.sleep(0)
            return Decision.rejected("too pricey", reason="test") if ctx.price > 10 else Decision.accepted()

    guard = BudgetGuard(AsyncOracle(), market(), 50)
    q, n = call("get_quote", symbol="A"), call("search_news", topic="t")
    agent = create_agent(scripted([ai(q, n), AIMessage("ok")]), TOOLS, middleware=[guard.middleware()])
    out = asyncio.run(agent.ainvoke({"messages": [("user", "x")]}))
    msgs = tool_messages(out)
    assert msgs[q["id"]].content == "too pricey" and msgs[n["id"]].status == "success"
    assert guard.ledger(out).spent == 5


def test_oracle_returning_garbage_raises_with_a_fix():
    class Bad(Oracle):
        def decide(self, ctx):
            return True

    guard = BudgetGuard(Bad(), market(), 50)
    with pytest.raises(InvalidDecisionError, match="returned bool, not an intent.Decision; return Decision"):
        run_agent(guard, [ai(call("get_quote", symbol="A")), AIMessage("x")])


@pytest.mark.parametrize("accept", ["no", 1, None], ids=["str-no", "int", "none"])
@pytest.mark.parametrize("use_async", [False, True], ids=["sync", "async"])
def test_a_decision_whose_accept_is_not_a_bool_raises_naming_the_field(accept, use_async):
    # Decision(accept="no") read as truthy: the oracle's rejection ran the call and paid it.
    runs = []

    @tool
    def priced(q: str) -> str:
        """A priced tool that records its runs."""
        runs.append(q)
        return q

    class Sloppy(Oracle):
        def decide(self, ctx):
            return Decision(accept=accept, feedback="not now")

    guard = BudgetGuard(Sloppy(), Market([PricedTool("priced", 2.0)]), 50)
    agent = create_agent(scripted([ai(call("priced", q="x")), AIMessage("x")]), [priced], middleware=[guard.middleware()])
    inp = {"messages": [("user", "go")]}
    with pytest.raises(InvalidDecisionError, match=r"Decision\.accept must be True or False, got "):
        asyncio.run(agent.ainvoke(inp)) if use_async else agent.invoke(inp)
    assert runs == []


def test_a_numpy_bool_decision_is_read_as_the_bool_it_is():
    class Vectorised(Oracle):
        def decide(self, ctx):
            return Decision(accept=np.float64(ctx.price) <= 10.0, feedback="too dear")

    sink = MemoryLogSink()
    guard = BudgetGuard(Vectorised(), market(), 50, log_sink=sink)
    q, n = call("get_quote", symbol="A"), call("search_news", topic="t")
    _, out = run_agent(guard, [ai(q, n), AIMessage("x")])
    assert tool_messages(out)[q["id"]].content == "too dear" and guard.ledger(out).spent == 5
    assert sorted(r.decision for r in sink.records) == ["accept", "reject"]


def test_oracle_failure_falls_back_but_never_overspends():
    class Down(Oracle):
        def decide(self, ctx):
            raise TimeoutError("world model timed out")

    sink = MemoryLogSink()
    guard = BudgetGuard(Down(), market(), 15, log_sink=sink)
    a, b = call("get_quote", symbol="A"), call("get_quote", symbol="B")
    _, out = run_agent(guard, [ai(a, b), AIMessage("x")])
    assert guard.ledger(out).spent == 12
    assert [r.reason for r in sink.records] == ["over_budget", "oracle_error"] or \
        sorted(r.reason for r in sink.records) == ["oracle_error", "over_budget"]
    strict = BudgetGuard(Down(), market(), 15, on_oracle_error="reject")
    _, out = run_agent(strict, [ai(call("get_quote", symbol="A")), AIMessage("x")])
    assert strict.ledger(out).spent == 0


def test_unknown_tool_bad_args_and_malformed_calls_cost_nothing():
    sink = MemoryLogSink()
    guard = BudgetGuard(AcceptAll(), market(), 50, log_sink=sink)
    unknown = call("nope", q=1)
    bad_args = call("get_quote", wrong=1)
    malformed = AIMessage(content="", invalid_tool_calls=[
        {"name": "get_quote", "args": "{not json", "id": "bad_json", "error": "JSON decode error", "type": "invalid_tool_call"}])
    _, out = run_agent(guard, [ai(unknown, bad_args), malformed, AIMessage("done")])
    msgs = tool_messages(out)
    assert "no tool named nope" in msgs[unknown["id"]].content
    assert "The available tools are: flaky, get_quote, search_news." in msgs[unknown["id"]].content
    assert "malformed" in msgs[bad_args["id"]].content and "symbol" in msgs[bad_args["id"]].content
    assert "JSON decode error" in msgs["bad_json"].content  # and the loop went back to the model
    assert out["messages"][-1].content == "done"
    assert guard.ledger(out).spent == 0 and guard.ledger(out).reserved == 0
    assert all(r.charged == 0 for r in sink.records) and len(sink.records) == 3


def test_tool_registered_in_market_but_not_in_agent_is_not_charged():
    guard = BudgetGuard(AcceptAll(), market(get_quote=1, ghost=2), 50)
    g = call("ghost")
    agent = create_agent(scripted([ai(g), AIMessage("x")]), [get_quote], middleware=[guard.middleware()])
    out = agent.invoke({"messages": [("user", "x")]})
    assert tool_messages(out)[g["id"]].status == "error"
    assert guard.ledger(out).spent == 0 and guard.ledger(out).reserved == 0


def test_enforce_false_records_overspend():
    sink = MemoryLogSink()
    guard = BudgetGuard(AcceptAll(), market(), 10, enforce=False, log_sink=sink)
    _, out = run_agent(guard, [ai(call("get_quote", symbol="A"), call("search_news", topic="t")), AIMessage("x")])
    ledger = guard.ledger(out)
    assert ledger.spent == 17 and ledger.overspent == 7
    assert all(not r.enforce for r in sink.records)


def test_market_update_applies_from_next_decision_and_hooks_shape_the_prompt():
    class Hider(AcceptAll):
        def visible_tools(self, market, episode_id):
            return [n for n in market.names if n != "flaky"]

        def prompt_notes(self, market, episode_id, spent, remaining, budget):
            return f"remaining={remaining:g}"

        def result_note(self, outcome):
            return f"[spent {outcome.spent:g}]"

    guard = BudgetGuard(Hider(), market(), 50)
    q1, q2 = call("get_quote", symbol="A"), call("get_quote", symbol="B")

    model = scripted([ai(q1), ai(q2), AIMessage("x")])
    agent = create_agent(model, TOOLS, middleware=[guard.middleware()])
    config = {"configurable": {"thread_id": "t-upd"}}
    agent = create_agent(model, TOOLS, middleware=[guard.middleware()], checkpointer=InMemorySaver(),
                         interrupt_after=["tools"])
    agent.invoke({"messages": [("user", "x")]}, config)
    guard.update_market(lambda m: m.with_price("get_quote", 30))
    out = agent.invoke(None, config)
    ledger = guard.ledger(out)
    assert [e.amount for e in ledger] == [12, 30]
    assert [e.market_version for e in ledger] == [0, 1]
    assert all("flaky" not in names for names in model.bound)
    assert tool_messages(out)[q1["id"]].content.endswith("[spent 12]")


def test_hand_built_state_graph_and_guard_react_agent():
    guard = BudgetGuard(AcceptAll(), market(), 13)
    a, b = call("get_quote", symbol="A"), call("search_news", topic="t")
    model = scripted([ai(a, b), AIMessage("done")])

    def agent_node(state):
        return {"messages": [model.invoke(state["messages"])]}

    g = StateGraph(GuardState)
    g.add_node("agent", agent_node)
    g.add_node("guard", guard.node())
    g.add_node("tools", guard.tool_node(TOOLS))
    g.add_edge(START, "agent")
    g.add_conditional_edges("agent", lambda s: "guard" if s["messages"][-1].tool_calls else END, ["guard", END])
    g.add_conditional_edges("guard", guard.route, ["tools", "agent", END])
    g.add_edge("tools", "agent")
    out = g.compile().invoke({"messages": [("user", "x")]})
    assert guard.ledger(out).spent == 12 and tool_messages(out)[b["id"]].status == "error"

    c, d = call("get_quote", symbol="A"), call("search_news", topic="t")
    app = guard_react_agent(scripted([ai(c, d), AIMessage("fin")]), TOOLS, market=market(), budget=13)
    out = app.invoke({"messages": [("user", "x")]})
    assert out["messages"][-1].content == "fin"
    assert app.guard.ledger(out).spent == 12


def test_guard_react_agent_with_a_guard_refuses_arguments_it_would_ignore():
    # budget=1000, tool_errors="message" with guard= were silently dropped (the guard's own were used).
    from intent import GuardConfigError

    guard = BudgetGuard(AcceptAll(), market(), 13)
    for kwargs in ({"budget": 1000}, {"market": Market([PricedTool("get_quote", 1.0)])}, {"tool_errors": "message"}):
        with pytest.raises(GuardConfigError, match=f"{next(iter(kwargs))} would be ignored"):
            guard_react_agent(scripted([AIMessage("x")]), TOOLS, guard=guard, **kwargs)
    assert guard_react_agent(scripted([AIMessage("x")]), TOOLS, guard=guard, market=guard.market, budget=13).guard is guard
    with pytest.raises(GuardConfigError, match="needs market= and budget="):
        guard_react_agent(scripted([AIMessage("x")]), TOOLS, budget=13)


def test_sqlite_checkpointer_resume_in_a_new_process_knows_the_spend(tmp_path):
    from langgraph.checkpoint.sqlite import SqliteSaver

    db = str(tmp_path / "ckpt.sqlite")
    config = {"configurable": {"thread_id": "resume-1"}}
    a, b = call("get_quote", symbol="A"), call("get_quote", symbol="B")
    script = [ai(a), ai(b), AIMessage("done")]
    with SqliteSaver.from_conn_string(db) as saver:
        guard1 = BudgetGuard(AcceptAll(), market(), 20)
        agent1 = create_agent(scripted(script), TOOLS, middleware=[guard1.middleware()], checkpointer=saver,
                              interrupt_after=["tools"])
        agent1.invoke({"messages": [("user", "x")]}, config)
        assert guard1.ledger(agent1.get_state(config).values).spent == 12
    # "new process": a fresh guard and agent on the same database
    with SqliteSaver.from_conn_string(db) as saver:
        guard2 = BudgetGuard(AcceptAll(), market(), 20)
        agent2 = create_agent(scripted([*script[1:], AIMessage("again")]), TOOLS, middleware=[guard2.middleware()], checkpointer=saver)
        state = agent2.get_state(config).values
        assert guard2.ledger(state).spent == 12 and guard2.ledger(state).remaining == 8
        out = agent2.invoke(None, config)
        assert tool_messages(out)[b["id"]].status == "error"  # 12 more does not fit in 8
        assert guard2.ledger(out).spent == 12
        # replaying the whole thread from its first checkpoint never charges a call twice
        history = list(agent2.get_state_history(config))
        first_tools = [h for h in history if h.next == ("tools",)]
        assert first_tools
        replay = agent2.invoke(None, first_tools[-1].config)
        assert guard2.ledger(replay).spent == 12


def test_jsonl_logs_roundtrip_and_line_numbers(tmp_path):
    path = tmp_path / "log.jsonl"
    guard = BudgetGuard(AcceptAll(), market(), 20, log_sink=JsonlLogSink(path))
    run_agent(guard, [ai(call("get_quote", symbol="A"), call("get_quote", symbol="B")), AIMessage("x")])
    records = list(read_log(path))
    assert [r.decision for r in sorted(records, key=lambda r: r.charged)] == ["reject", "accept"]
    assert records[0].query == "get quotes"
    with open(path, "a") as fh:
        fh.write("{broken\n")
        fh.write('{"schema_version": 1}\n')
    with pytest.raises(LogFormatError, match=r"log.jsonl:3: not valid JSON"):
        list(read_log(path))


def test_constructor_rejects_bad_input():
    with pytest.raises(TypeError, match="decide"):
        BudgetGuard(object(), market(), 10)
    with pytest.raises(TypeError, match="intent.Market"):
        BudgetGuard(AcceptAll(), {"a": 1}, 10)
    with pytest.raises(ValueError, match="budget"):
        BudgetGuard(AcceptAll(), market(), float("nan"))
    assert LEDGER_KEY == "intent_ledger"


def test_a_tool_filter_keeps_dict_schemas_in_openais_form():
    # An oracle that hides one tool makes the guard filter the model request's tools; a tool given
    # as a dict schema with its name under "function" (OpenAI's form) is kept when it is visible.
    class Hider(AcceptAll):
        def visible_tools(self, market, episode_id):
            return [n for n in market.names if n != "flaky"]

    lookup = {"type": "function", "function": {"name": "lookup", "description": "looks up",
                                                "parameters": {"type": "object", "properties": {}}}}
    guard = BudgetGuard(Hider(), market(get_quote=12, search_news=5, flaky=3, lookup=1), 50)
    model = scripted([AIMessage("done")])
    create_agent(model, [*TOOLS, lookup], middleware=[guard.middleware()]).invoke({"messages": [("user", "x")]})
    assert model.bound and all("lookup" in names and "flaky" not in names for names in model.bound)


def test_the_shipped_scripted_model_streams_its_tool_calls():
    # intent.testing.scripted is GenericFakeChatModel underneath, whose stream dropped the message's tool
    # calls: under stream_mode="messages" the agent saw none and ended without running a tool.
    from langchain.agents import create_agent
    from langchain_core.messages import HumanMessage
    from langchain_core.tools import StructuredTool

    from intent import AcceptAll, BudgetGuard, Market, PricedTool
    from intent.testing import ai, assert_each_call_answered_once, call, scripted

    runs: list[str] = []

    def fetch(q: str = "") -> str:
        runs.append(q)
        return "ok"

    guard = BudgetGuard(AcceptAll(), Market([PricedTool("fetch", 1.0)]), 10.0)
    agent = create_agent(scripted([ai(call("fetch", q="1"), call("fetch", q="2")), ai(text="done")]),
                         [StructuredTool.from_function(fetch, name="fetch", description="f")],
                         middleware=[guard.middleware()])
    chunks = list(agent.stream({"messages": [HumanMessage("go")]}, stream_mode=["messages", "values"]))
    final = [c for mode, c in chunks if mode == "values"][-1]
    assert sorted(runs) == ["1", "2"] and final["messages"][-1].content == "done"
    assert guard.ledger(final).spent == 2.0 and guard.ledger(final).reserved == 0
    assert any(mode == "messages" and getattr(c[0], "tool_call_chunks", None) for mode, c in chunks)
    assert_each_call_answered_once(final["messages"])


def test_update_episode_market_refuses_an_episode_that_is_not_live_unless_asked_to_create_it():
    from intent.errors import UsageError

    guard = BudgetGuard(AcceptAll(), market(), 50)
    model = scripted([ai(call("get_quote", symbol="A")), AIMessage("x")])
    agent = create_agent(model, TOOLS, middleware=[guard.middleware()], checkpointer=InMemorySaver(),
                         interrupt_after=["tools"])
    config = {"configurable": {"thread_id": "t-live"}}
    agent.invoke({"messages": [("user", "x")]}, config)
    assert list(guard.episodes.ids()) == ["t-live"]
    with pytest.raises(UsageError, match=r"'t-lvie'.*'t-live'.*create=True"):
        guard.update_episode_market("t-lvie", lambda m: m.with_price("get_quote", 30))
    assert "t-lvie" not in guard.episodes  # the typo made no episode
    # The live episode's market changes; a thread whose run has not started here gets one only on request.
    assert guard.update_episode_market("t-live", lambda m: m.with_price("get_quote", 30)).price("get_quote") == 30
    assert guard.update_episode_market("t-next", market(get_quote=7.0), create=True).price("get_quote") == 7
    assert guard.market_for("t-next").price("get_quote") == 7


def test_a_reservation_released_after_its_run_was_abandoned_is_logged_with_that_runs_task():
    # Turn 1 pauses inside a tool (its reservation held); the user drops the pause and sends a new task. The
    # release record written at turn 2's first model step belongs to turn 1's call: it carries turn 1's task
    # (was: an empty query).
    from langchain_core.messages import HumanMessage
    from langchain_core.tools import tool
    from langgraph.types import interrupt

    @tool
    def ask(x: int) -> str:
        """Ask a human."""
        return f"human said {interrupt('ok?')}"

    sink = MemoryLogSink()
    guard = BudgetGuard(AcceptAll(), market(ask=3.0, get_quote=2.0), 10, log_sink=sink)
    model = scripted([ai(call("ask", x=1)), ai(call("get_quote", symbol="A")), AIMessage("done")])
    agent = create_agent(model, [ask, get_quote], middleware=[guard.middleware()], checkpointer=InMemorySaver())
    config = {"configurable": {"thread_id": "t-abandoned"}}
    assert agent.invoke({"messages": [HumanMessage("ask first")]}, config).get("__interrupt__")
    out = agent.invoke({"messages": [HumanMessage("forget that, new task")]}, config)
    assert guard.ledger(out).spent == 2.0 and guard.ledger(out).reserved == 0
    released = [r for r in sink.records if r.status == "released"]
    assert [(r.tool, r.reason, r.query) for r in released] == [("ask", "released_unused", "ask first")]
    assert {r.query for r in sink.records if r.tool == "get_quote"} == {"forget that, new task"}
