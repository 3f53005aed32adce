"""The guard composed with LangChain middleware the earlier composition tests did not cover.

Each test checks the money promise per run: ``spent == Σ executions × price <= budget`` (executions
counted inside the tools, and model executions outside the guard when it has ``model_prices``),
``reserved == 0`` after the run, every proposed call answered by exactly one ToolMessage, one log
record per execution, and ``guard.ledger(out)`` agreeing.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from langchain.agents import create_agent
from langchain.agents.middleware import (
    AgentMiddleware,
    ClearToolUsesEdit,
    ContextEditingMiddleware,
    LLMToolSelectorMiddleware,
    ModelCallLimitMiddleware,
    ModelFallbackMiddleware,
    PIIMiddleware,
    TodoListMiddleware,
    ToolCallLimitMiddleware,
)
from langchain_core.messages import AIMessage, ToolMessage
from langchain_core.runnables import RunnableLambda
from langchain_core.tools import StructuredTool
from langgraph.checkpoint.memory import InMemorySaver

from intent import AcceptAll, BudgetGuard, Market, MemoryLogSink, ModelPrice, Oracle, PricedTool
from intent.testing import RunCounter, assert_each_call_answered_once, assert_one_record_per_call, scripted

ORDERS = ["guard_first", "guard_last"]
MODES = ["sync", "async"]


def make_tool(name: str, runs: RunCounter) -> StructuredTool:
    def fn(x: str = "0") -> str:
        runs.hit(name)
        return f"{name} ran with {x}"

    return StructuredTool.from_function(fn, name=name, description=f"Tool {name}.")


def tc(name: str, cid: str, **args: Any) -> dict[str, Any]:
    return {"name": name, "args": args, "id": cid, "type": "tool_call"}


def stack(guard: BudgetGuard, other: list[Any], order: str) -> list[Any]:
    return [guard.middleware(), *other] if order == "guard_first" else [*other, guard.middleware()]


def invoke(agent: Any, inp: Any, mode: str, config: Any = None) -> Any:
    if mode == "async":
        return asyncio.run(agent.ainvoke(inp, config))
    return agent.invoke(inp, config)


def check(guard: BudgetGuard, out: Any, runs: RunCounter, prices: dict[str, float], sink: MemoryLogSink,
          *, model_cost: float = 0.0, all_messages: list[Any] | None = None) -> Any:
    ledger = guard.ledger(out)
    expected = sum(runs[n] * p for n, p in prices.items()) + model_cost
    assert ledger.reserved == 0, f"reserved {ledger.reserved} after the run"
    assert ledger.spent == pytest.approx(expected), f"spent {ledger.spent}, tools ran {dict(runs)}: {expected}"
    assert ledger.spent <= ledger.budget + 1e-9
    msgs = list(out["messages"]) if all_messages is None else all_messages
    assert_each_call_answered_once(msgs)
    tool_runs = [r for r in sink.records if r.kind == "tool" and r.execution > 0 and r.tool in runs]
    assert len(tool_runs) == sum(runs.get(n, 0) for n in prices), (
        f"{len(tool_runs)} execution records, {dict(runs)} executions")
    assert sum(r.charged for r in sink.records) == pytest.approx(ledger.spent)
    assert_one_record_per_call(msgs, sink.records)
    return ledger


USER = {"messages": [("user", "go")]}


def _guarded(prices: dict[str, float], budget: float, **guard_kw: Any) -> tuple[Any, MemoryLogSink, BudgetGuard]:
    """Executions counted outside the guard, its log, and an AcceptAll guard over ``prices``."""
    sink = MemoryLogSink()
    return RunCounter(), sink, BudgetGuard(AcceptAll(), Market([PricedTool(n, p) for n, p in prices.items()]), budget,
                                     log_sink=sink, **guard_kw)


# ============================================== a middleware rewriting the calls in after_model
class RewriteCalls(AgentMiddleware):
    """after_model: renames tool ``a`` to ``b`` and changes its arguments (same message id)."""

    def after_model(self, state: Any, runtime: Any) -> Any:
        last = state["messages"][-1]
        if not isinstance(last, AIMessage) or not last.tool_calls:
            return None
        calls = [{**c, "name": "b", "args": {"x": "rewritten"}} if c["name"] == "a" else c for c in last.tool_calls]
        return {"messages": [last.model_copy(update={"tool_calls": calls})]}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("budget", [10.0, 30.0])
def test_after_model_rewrite_of_tool_and_args_is_regated_and_paid(order, mode, budget):
    prices = {"a": 1.0, "b": 20.0}
    runs, sink, guard = _guarded(prices, budget)
    model = scripted([AIMessage("", tool_calls=[tc("a", "c1", x="1")]), AIMessage("done")])
    agent = create_agent(model, [make_tool("a", runs), make_tool("b", runs)],
                         middleware=stack(guard, [RewriteCalls()], order))
    out = invoke(agent, USER, mode)
    check(guard, out, runs, prices, sink)
    if budget == 10.0:
        assert runs["b"] == 0 and runs["a"] == 0  # b (20) does not fit 10
    else:
        assert runs["b"] == 1 and runs["a"] == 0
        rec = [r for r in sink.records if r.execution > 0]
        assert [(r.tool, r.args) for r in rec] == [("b", {"x": "rewritten"})]


# ============================================== ContextEditingMiddleware
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("order", ORDERS)
def test_context_editing_clearing_tool_results_leaves_money_alone(order, mode):
    prices = {"a": 3.0}
    runs, sink, guard = _guarded(prices, 10.0)
    model = scripted([AIMessage("", tool_calls=[tc("a", f"c{i}", x=str(i)), tc("a", f"d{i}", x=str(i))])
                      for i in range(3)] + [AIMessage("done")])
    edit = ContextEditingMiddleware(edits=[ClearToolUsesEdit(trigger=1, keep=0, clear_tool_inputs=True)])
    agent = create_agent(model, [make_tool("a", runs)], middleware=stack(guard, [edit], order))
    out = invoke(agent, USER, mode)
    check(guard, out, runs, prices, sink)
    assert runs["a"] == 3


# ============================================== ModelFallbackMiddleware with tool calls, metered
MPRICES = {"primary": ModelPrice(1000, 1000), "fallback": ModelPrice(5000, 5000)}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("order", ORDERS)
def test_fallback_model_with_tool_calls_is_metered_each_execution(order, mode):
    runs, sink, guard = _guarded({"a": 1.0}, 10.0, model_prices=MPRICES, max_output_tokens=100)
    from intent.testing import ai

    primary = scripted([ai(tc("a", "p1", x="p"), usage=(100, 100), model_name="primary"),
                        ai(text="done", usage=(100, 100), model_name="primary")],
                       model_name="primary", fail_on={1, 2, 3, 4})
    fallback = scripted([ai(tc("a", "f1", x="f"), usage=(100, 100), model_name="fallback"),
                         ai(text="done", usage=(100, 100), model_name="fallback")], model_name="fallback")
    agent = create_agent(primary, [make_tool("a", runs)],
                         middleware=stack(guard, [ModelFallbackMiddleware(fallback)], order))
    out = invoke(agent, USER, mode)
    # primary failed twice (not billed), fallback ran twice: 2 × 200 tokens at 5000/Mtok = 2.0
    assert len(fallback.executions) == 2
    model_records = [r for r in sink.records if r.kind == "model" and r.charged]
    assert runs["a"] == 1
    ledger = guard.ledger(out)
    assert ledger.reserved == 0
    assert_each_call_answered_once(list(out["messages"]))
    if order == "guard_first":
        assert ledger.spent == pytest.approx(1.0 + 2.0), (ledger.spent, [(r.tool, r.charged) for r in model_records])
    else:
        # listed before the guard, the fallback runs the guard again: each execution is metered too
        assert ledger.spent == pytest.approx(1.0 + 2.0), (ledger.spent, [(r.tool, r.charged) for r in model_records])


# ============================================== LLMToolSelectorMiddleware
class SelectorModel(scripted([]).__class__):  # type: ignore[misc]
    """A selector whose structured output picks ``picks``; counts its executions."""

    picks: list = []
    calls: list = []

    def with_structured_output(self, schema: Any, **kwargs: Any) -> Any:
        def pick(_: Any) -> Any:
            self.calls.append(1)
            return {"tools": list(self.picks)}

        return RunnableLambda(pick)


class HideA_B(Oracle):
    def decide(self, ctx: Any) -> Any:
        from intent import Decision

        return Decision(accept=True)

    def visible_tools(self, market: Any, episode_id: str) -> Any:
        return ["a", "b"]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("order", ORDERS)
def test_tool_selector_picking_a_hidden_tool_cannot_unhide_it(order, mode):
    runs, sink = RunCounter(), MemoryLogSink()
    prices = {"a": 1.0, "b": 2.0, "c": 1.0}
    # b banned in the market (refused at the gate), c hidden by the oracle (not shown)
    guard = BudgetGuard(HideA_B(), Market([PricedTool(n, p) for n, p in prices.items()], banned=["b"]), 10.0,
                        log_sink=sink)
    model = scripted([AIMessage("", tool_calls=[tc("b", "c1"), tc("a", "c2")]), AIMessage("done")])
    selector = SelectorModel(messages=iter([]), bound=[], picks=["b", "a"] if order == "guard_last" else ["a"], calls=[], executions=[])
    agent = create_agent(model, [make_tool(n, runs) for n in prices],
                         middleware=stack(guard, [LLMToolSelectorMiddleware(model=selector)], order))
    out = invoke(agent, USER, mode)
    check(guard, out, runs, prices, sink)
    assert runs["b"] == 0 and runs["a"] == 1
    assert all("b" not in bound and "c" not in bound for bound in model.bound), model.bound


# ============================================== TodoListMiddleware
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("priced", [False, True])
def test_todo_list_write_todos_priced_or_not(order, mode, priced):
    runs, sink = RunCounter(), MemoryLogSink()
    prices = {"a": 1.0}
    tools = [PricedTool("a", 1.0)] + ([PricedTool("write_todos", 0.0)] if priced else [])
    guard = BudgetGuard(AcceptAll(), Market(tools), 10.0, log_sink=sink)
    todos = [{"content": "x", "status": "pending"}]
    model = scripted([AIMessage("", tool_calls=[tc("write_todos", "t1", todos=todos), tc("a", "c1")]),
                      AIMessage("done")])
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        agent = create_agent(model, [make_tool("a", runs)], middleware=stack(guard, [TodoListMiddleware()], order))
        out = invoke(agent, USER, mode)
    check(guard, out, runs, prices, sink)
    assert runs["a"] == 1
    assert bool(out.get("todos")) == priced


# ============================================== PIIMiddleware
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("order", ORDERS)
def test_pii_redacting_args_and_results(order, mode):
    prices = {"a": 2.0}
    runs, sink, guard = _guarded(prices, 10.0)
    model = scripted([AIMessage("", tool_calls=[tc("a", "c1", x="mail bob@example.com"), tc("a", "c2", x="z")]),
                      AIMessage("done")])
    pii = PIIMiddleware("email", strategy="redact", apply_to_input=True, apply_to_output=True,
                        apply_to_tool_results=True)
    agent = create_agent(model, [make_tool("a", runs)], middleware=stack(guard, [pii], order))
    out = invoke(agent, USER, mode)
    check(guard, out, runs, prices, sink)
    assert runs["a"] == 2


# ============================================== ToolCallLimitMiddleware thread_limit across runs
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("order", ORDERS)
def test_tool_call_thread_limit_across_two_runs(order, mode):
    prices = {"a": 1.0}
    runs, sink, guard = _guarded(prices, 10.0)
    model = scripted([AIMessage("", tool_calls=[tc("a", "c1", x="1"), tc("a", "c2", x="2")]), AIMessage("done"),
                      AIMessage("", tool_calls=[tc("a", "c3", x="3"), tc("a", "c4", x="4")]), AIMessage("done")])
    limit = ToolCallLimitMiddleware(thread_limit=3, exit_behavior="continue")
    agent = create_agent(model, [make_tool("a", runs)], middleware=stack(guard, [limit], order),
                         checkpointer=InMemorySaver())
    cfg = {"configurable": {"thread_id": "t"}}
    invoke(agent, USER, mode, cfg)
    out = invoke(agent, {"messages": [("user", "again")]}, mode, cfg)
    check(guard, out, runs, prices, sink)
    assert runs["a"] == 3


# ============================================== ModelCallLimitMiddleware exit_behavior="end"
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("order", ORDERS)
def test_model_call_limit_end_mid_episode(order, mode):
    prices = {"a": 1.0}
    runs, sink, guard = _guarded(prices, 10.0)
    model = scripted([AIMessage("", tool_calls=[tc("a", f"c{i}", x=str(i))]) for i in range(5)] + [AIMessage("done")])
    limit = ModelCallLimitMiddleware(run_limit=2, exit_behavior="end")
    agent = create_agent(model, [make_tool("a", runs)], middleware=stack(guard, [limit], order))
    out = invoke(agent, USER, mode)
    check(guard, out, runs, prices, sink)
    assert runs["a"] == 2


# ============================================== more after_model rewrites
class Rewrite(AgentMiddleware):
    """after_model: applies ``fn`` to the last AIMessage's tool calls (same message id)."""

    def __init__(self, fn: Any) -> None:
        super().__init__()
        self.fn = fn

    def after_model(self, state: Any, runtime: Any) -> Any:
        last = state["messages"][-1]
        if not isinstance(last, AIMessage) or not last.tool_calls:
            return None
        return {"messages": [last.model_copy(update={"tool_calls": self.fn(list(last.tool_calls))})]}


REWRITES = {
    "drop_second": lambda cs: cs[:1],
    "new_id": lambda cs: [{**c, "id": c["id"] + "x"} for c in cs],
    "add_call": lambda cs: [*cs, tc("b", "added", x="9")],
    "to_unknown": lambda cs: [{**c, "name": "zzz"} for c in cs],
    "swap_names": lambda cs: [{**c, "name": "b" if c["name"] == "a" else "a"} for c in cs],
}


@pytest.mark.parametrize("gate_at", ["model_call", "after_model"])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("how", list(REWRITES))
@pytest.mark.parametrize("budget", [6.0, 50.0])
def test_after_model_rewrites(how, order, mode, gate_at, budget):
    prices = {"a": 1.0, "b": 5.0}
    runs, sink, guard = _guarded(prices, budget, gate_at=gate_at)
    model = scripted([AIMessage("", tool_calls=[tc("a", "c1", x="1"), tc("b", "c2", x="2")]),
                      AIMessage("", tool_calls=[tc("a", "c3", x="3"), tc("b", "c4", x="4")]),
                      AIMessage("done")])
    agent = create_agent(model, [make_tool("a", runs), make_tool("b", runs)],
                         middleware=stack(guard, [Rewrite(REWRITES[how])], order))
    out = invoke(agent, USER, mode)
    check(guard, out, runs, prices, sink)
    if how in ("new_id", "add_call") and not (order == "guard_first" and gate_at == "after_model"):
        # (guard first with its gate in after_model: the rewrite runs before the gate, which decides it)
        # a call the gate never decided is refused at the tool step, with its own log record
        assert any(r.reason == "not_gated" for r in sink.records)


@pytest.mark.parametrize("mode", MODES)
def test_a_call_added_after_the_gate_has_one_not_gated_record_when_its_tool_step_is_resumed(mode):
    # A hand-built graph whose one ToolNode task runs every call of the message: a node after the guard adds a
    # call (refused at the tool step: never gated), and another call of the same step pauses for a human. The
    # resume runs the whole step again: the added call is answered again, and logged once (was: twice).
    from langgraph.graph import END, START, StateGraph
    from langgraph.types import Command, interrupt

    from intent import GuardState

    runs, sink, guard = _guarded({"ask": 1.0, "b": 5.0}, 50.0)

    def ask(x: str = "0") -> str:
        runs.hit("ask")
        return f"human said {interrupt('ok?')}"

    model = scripted([AIMessage("", tool_calls=[tc("ask", "c1", x="1")]), AIMessage("done")])

    def add_call(state: Any) -> Any:
        last = state["messages"][-1]
        return {"messages": [last.model_copy(update={"tool_calls": [tc("b", "added", x="9"), *last.tool_calls]})]}

    g = StateGraph(GuardState)
    g.add_node("agent", lambda state: {"messages": [model.invoke(state["messages"])]})
    g.add_node("guard", guard.node())
    g.add_node("add_call", add_call)
    g.add_node("tools", guard.tool_node([make_tool("b", runs),
                                         StructuredTool.from_function(ask, name="ask", description="Ask.")]))
    g.add_edge(START, "agent")
    g.add_conditional_edges("agent", lambda s: "guard" if s["messages"][-1].tool_calls else END, ["guard", END])
    g.add_edge("guard", "add_call")
    g.add_edge("add_call", "tools")
    g.add_edge("tools", "agent")
    agent = g.compile(checkpointer=InMemorySaver())
    config = {"configurable": {"thread_id": f"not-gated-resumed-{mode}"}}
    assert invoke(agent, USER, mode, config).get("__interrupt__")
    out = invoke(agent, Command(resume="yes"), mode, config)
    assert runs["ask"] == 2 and runs["b"] == 0 and out["messages"][-1].content == "done"
    assert [(r.call_id, r.tool) for r in sink.records if r.reason == "not_gated"] == [("added", "b")]
    assert guard.ledger(out).spent == 1.0


# ============================================== a billed selector model under model_prices
from intent.testing import BilledChatModel, ModelRuns, ai  # noqa: E402


class BilledSelector(BilledChatModel):
    picks: list = []

    def with_structured_output(self, schema: Any, **kwargs: Any) -> Any:
        return self | RunnableLambda(lambda _: {"tools": list(self.picks)})


SPRICES = {"main": ModelPrice(1000, 1000), "selector": ModelPrice(2000, 2000)}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("order", ORDERS)
def test_selector_model_executions_inside_the_guard_are_metered(order, mode):
    runs, sink, mruns = RunCounter(), MemoryLogSink(), ModelRuns()
    prices = {"a": 1.0, "b": 1.0}
    guard = BudgetGuard(AcceptAll(), Market([PricedTool(n, p) for n, p in prices.items()]), 10.0, log_sink=sink,
                        model_prices=SPRICES, max_output_tokens=100)
    model = scripted([ai(tc("a", "c1", x="1"), usage=(100, 100), model_name="main"),
                      ai(text="done", usage=(100, 100), model_name="main")], model_name="main")
    selector = BilledSelector(model_name="selector", runs=mruns, tokens=(100, 100), picks=["a"])
    agent = create_agent(model, [make_tool(n, runs) for n in prices],
                         middleware=stack(guard, [LLMToolSelectorMiddleware(model=selector)], order))
    out = invoke(agent, USER, mode)
    assert len(mruns.log) == 2 and len(model.executions) == 2
    main_cost = 2 * SPRICES["main"].cost(100, 100)
    ledger = guard.ledger(out)
    assert ledger.reserved == 0 and runs["a"] == 1
    if order == "guard_first":
        # the selector runs inside the guard's model call: each of its executions is paid
        assert ledger.spent == pytest.approx(1.0 + main_cost + mruns.cost(SPRICES))
    else:
        assert ledger.spent == pytest.approx(1.0 + main_cost)  # documented: outside the guard, unmetered


# ============================================== limits across runs, exit "end"
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("which", ["model_thread_end", "tool_thread_end", "tool_run_end"])
def test_limits_ending_runs_across_a_thread(which, order, mode):
    prices = {"a": 1.0}
    runs, sink, guard = _guarded(prices, 10.0)
    model = scripted([AIMessage("", tool_calls=[tc("a", f"c{i}a", x=f"{i}a"), tc("a", f"c{i}b", x=f"{i}b")])
                      for i in range(8)] + [AIMessage("done")] * 4)
    limit = {"model_thread_end": ModelCallLimitMiddleware(thread_limit=3, exit_behavior="end"),
             "tool_thread_end": ToolCallLimitMiddleware(thread_limit=3, exit_behavior="end"),
             "tool_run_end": ToolCallLimitMiddleware(run_limit=3, exit_behavior="end")}[which]
    agent = create_agent(model, [make_tool("a", runs)], middleware=stack(guard, [limit], order),
                         checkpointer=InMemorySaver())
    cfg = {"configurable": {"thread_id": "t"}, "recursion_limit": 40}
    invoke(agent, USER, mode, cfg)
    ledger1 = guard.ledger(agent.get_state(cfg).values)
    assert ledger1.reserved == 0 and ledger1.spent == runs["a"]
    out = invoke(agent, {"messages": [("user", "again")]}, mode, cfg)
    check(guard, out, runs, prices, sink)


# ============================================== PII block on a tool result
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("order", ORDERS)
def test_pii_block_on_tool_result_keeps_the_charge(order, mode):
    from langchain.agents.middleware import PIIDetectionError

    runs, sink = RunCounter(), MemoryLogSink()
    guard = BudgetGuard(AcceptAll(), Market([PricedTool("a", 2.0)]), 10.0, log_sink=sink)
    model = scripted([AIMessage("", tool_calls=[tc("a", "c1", x="x@example.com"), tc("a", "c2", x="y")]),
                      AIMessage("done")])
    pii = PIIMiddleware("email", strategy="block", apply_to_input=False, apply_to_tool_results=True)
    agent = create_agent(model, [make_tool("a", runs)], middleware=stack(guard, [pii], order),
                         checkpointer=InMemorySaver())
    cfg = {"configurable": {"thread_id": "t"}}
    with pytest.raises(PIIDetectionError):
        invoke(agent, USER, mode, cfg)
    ledger = guard.ledger(agent.get_state(cfg).values, cfg)
    assert runs["a"] == 2
    assert ledger.spent == pytest.approx(4.0) and ledger.reserved == 0
    assert sum(r.charged for r in sink.records) == pytest.approx(4.0)


def strict_tool(name: str, runs: RunCounter) -> StructuredTool:
    def fn(x: int) -> str:
        runs.hit(name)
        return f"{name} ran with {x}"

    return StructuredTool.from_function(fn, name=name, description=f"Tool {name}.")


REWRITES2 = {
    "to_unpriced": lambda cs: [{**c, "name": "free"} for c in cs],
    "bad_args": lambda cs: [{**c, "args": {"x": "not an int"}} for c in cs],
    "drop_args": lambda cs: [{**c, "args": {}} for c in cs],
    "to_banned": lambda cs: [{**c, "name": "banned"} for c in cs],
}


@pytest.mark.parametrize("gate_at", ["model_call", "after_model"])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("how", list(REWRITES2))
def test_after_model_rewrites_to_unusable_calls(how, order, mode, gate_at):
    runs, sink = RunCounter(), MemoryLogSink()
    prices = {"a": 1.0, "banned": 1.0}
    guard = BudgetGuard(AcceptAll(), Market([PricedTool(n, p) for n, p in prices.items()], banned=["banned"]), 10.0,
                        log_sink=sink, gate_at=gate_at)
    model = scripted([AIMessage("", tool_calls=[tc("a", "c1", x=1), tc("a", "c2", x=2)]), AIMessage("done")])
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        agent = create_agent(model, [strict_tool("a", runs), strict_tool("free", runs), strict_tool("banned", runs)],
                             middleware=stack(guard, [Rewrite(REWRITES2[how])], order))
        out = invoke(agent, USER, mode)
    check(guard, out, runs, {**prices, "free": 0.0}, sink)
    assert runs["free"] == 0 and runs["banned"] == 0 and runs["a"] == 0


@pytest.mark.parametrize("gate_at", ["model_call", "after_model"])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("order", ORDERS)
def test_priced_write_todos_and_pii_args(order, mode, gate_at):
    runs, sink = RunCounter(), MemoryLogSink()
    guard = BudgetGuard(AcceptAll(), Market([PricedTool("a", 2.0), PricedTool("write_todos", 0.5)]), 10.0,
                        log_sink=sink, gate_at=gate_at)
    todos = [{"content": "mail bob@example.com", "status": "pending"}]
    model = scripted([AIMessage("", tool_calls=[tc("write_todos", "t1", todos=todos), tc("a", "c1", x="bob@example.com"),
                                                tc("a", "c2", x="joe@example.com")]),
                      AIMessage("", tool_calls=[tc("write_todos", "t2", todos=todos), tc("a", "c3", x="q")]),
                      AIMessage("done")])
    pii = PIIMiddleware("email", strategy="hash", apply_to_input=True, apply_to_output=True,
                        apply_to_tool_results=True)
    agent = create_agent(model, [make_tool("a", runs)], middleware=stack(guard, [TodoListMiddleware(), pii], order))
    out = invoke(agent, USER, mode)
    todo_runs = [m for m in out["messages"] if isinstance(m, ToolMessage) and m.name == "write_todos"
                 and m.status != "error"]
    ledger = guard.ledger(out)
    assert ledger.reserved == 0
    assert_each_call_answered_once(list(out["messages"]))
    assert ledger.spent == pytest.approx(2.0 * runs["a"] + 0.5 * len(todo_runs)), (runs.counts, len(todo_runs))
    assert sum(r.charged for r in sink.records) == pytest.approx(ledger.spent)
    assert_one_record_per_call(list(out["messages"]), sink.records)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("order", ORDERS)
def test_tool_call_limit_error_then_next_run_on_the_thread(order, mode):
    from langchain.agents.middleware.tool_call_limit import ToolCallLimitExceededError

    prices = {"a": 1.0}
    runs, sink, guard = _guarded(prices, 10.0)
    model = scripted([AIMessage("", tool_calls=[tc("a", "c1", x="1"), tc("a", "c2", x="2")]),
                      AIMessage("", tool_calls=[tc("a", "c3", x="3"), tc("a", "c4", x="4")]),
                      AIMessage("done"), AIMessage("done")])
    limit = ToolCallLimitMiddleware(thread_limit=3, exit_behavior="error")
    agent = create_agent(model, [make_tool("a", runs)], middleware=stack(guard, [limit], order),
                         checkpointer=InMemorySaver())
    cfg = {"configurable": {"thread_id": "t"}}
    with pytest.raises(ToolCallLimitExceededError):
        invoke(agent, USER, mode, cfg)
    assert runs["a"] == 2
    limit2 = ToolCallLimitMiddleware(thread_limit=30, exit_behavior="error")
    agent2 = create_agent(model, [make_tool("a", runs)], middleware=stack(guard, [limit2], order),
                          checkpointer=agent.checkpointer)
    out = invoke(agent2, {"messages": [("user", "again")]}, mode, cfg)
    ledger = guard.ledger(out)
    assert ledger.reserved == 0 and ledger.spent == pytest.approx(runs["a"] * 1.0)
    assert sum(r.charged for r in sink.records) == pytest.approx(ledger.spent)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("order", ORDERS)
def test_rewritten_args_retried_each_run_paid(order, mode):
    from langchain.agents.middleware import ToolRetryMiddleware

    runs, sink = RunCounter(), MemoryLogSink()

    def fn(x: str = "0") -> str:
        runs.hit("a")
        raise RuntimeError("503")

    tool = StructuredTool.from_function(fn, name="a", description="Tool a.")
    guard = BudgetGuard(AcceptAll(), Market([PricedTool("a", 3.0)]), 10.0, log_sink=sink)
    model = scripted([AIMessage("", tool_calls=[tc("a", "c1", x="1")]), AIMessage("done")])
    retry = ToolRetryMiddleware(max_retries=5, initial_delay=0, jitter=False, on_failure=lambda e: f"gave up: {e}")
    rewrite = Rewrite(lambda cs: [{**c, "args": {"x": "rewritten"}} for c in cs])
    other = [rewrite, retry] if order == "guard_first" else [retry, rewrite]
    agent = create_agent(model, [tool], middleware=stack(guard, other, order))
    out = invoke(agent, USER, mode)
    check(guard, out, runs, {"a": 3.0}, sink)
    assert runs["a"] == 3


@pytest.fixture(autouse=True, params=["default_gate", "after_model_gate"])
def _gate_position(request, monkeypatch):
    """Every test above runs with the gate in the model call and in an after_model hook (unless it chose)."""
    if request.param == "after_model_gate":
        class Guard(BudgetGuard):
            def __init__(self, *a: Any, **kw: Any) -> None:
                kw.setdefault("gate_at", "after_model")
                super().__init__(*a, **kw)

        monkeypatch.setitem(globals(), "BudgetGuard", Guard)
