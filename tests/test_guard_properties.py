"""Property tests: whatever the oracle, the tools and the market do, the budget holds.

Random markets and budgets; model turns with one or several (parallel) tool calls, some to
unknown tools, some to tools that raise; an adversarial oracle that accepts everything (or
fails); market updates between turns; interrupts after the tool node with a resume in a
fresh guard (a new process) from the checkpointer. Checked after every run, against what the
tools themselves observed (each run counted inside the tool, at the price in force when it
ran), never against numbers read back from the guard: the money of the runs never exceeds the
budget; the ledger charged exactly that money; the log has one execution record per run and
its charges add up to that money; when the run is over nothing is reserved and every proposed
call got exactly one answer.
"""

from __future__ import annotations

from collections import Counter

from fakes import ScriptedToolModel
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from langchain.agents import create_agent
from langchain_core.messages import AIMessage
from langchain_core.tools import StructuredTool
from langgraph.checkpoint.memory import InMemorySaver

from intent import AcceptAll, BudgetGuard, Decision, Market, MemoryLogSink, Oracle, PricedTool, guard_react_agent
from intent.testing import assert_each_call_answered_once

NAMES = ["t0", "t1", "t2", "t3", "t4"]


def make_tool(name: str, raises: bool, runs: list[tuple[str, float]], price_now) -> StructuredTool:
    """A tool that records each of its runs with the market price in force as it runs
    (a raising run included: money spent is spent)."""

    def run(x: int = 0) -> str:
        runs.append((name, price_now(name)))
        if raises:
            raise RuntimeError(f"{name} is down")
        return f"{name}:{x}"

    return StructuredTool.from_function(run, name=name, description=f"tool {name}")


class Chaos(Oracle):
    """Accepts everything, except that it sometimes crashes (the fallback must still hold)."""

    def __init__(self, crash_every: int) -> None:
        self.crash_every = crash_every
        self.n = 0

    def decide(self, ctx):
        self.n += 1
        if self.crash_every and self.n % self.crash_every == 0:
            raise ConnectionError("oracle backend down")
        return Decision.accepted()


price = st.one_of(st.integers(0, 30).map(float), st.floats(0, 30, allow_nan=False).map(lambda x: round(x, 2)))
turn = st.lists(st.tuples(st.sampled_from([*NAMES, "unknown"]), st.integers(0, 9)), min_size=1, max_size=4)


@st.composite
def scenario(draw):
    n_tools = draw(st.integers(1, 5))
    prices = {NAMES[i]: draw(price) for i in range(n_tools)}
    return {
        "prices": prices,
        "raising": draw(st.sets(st.sampled_from(NAMES[:n_tools]))),
        "budget": draw(st.one_of(st.integers(0, 60).map(float), st.floats(0, 60).map(lambda x: round(x, 2)))),
        "turns": draw(st.lists(turn, min_size=1, max_size=5)),
        "updates": draw(st.lists(st.tuples(st.sampled_from(NAMES[:n_tools]), price, st.booleans()), max_size=5)),
        "resume_after": draw(st.sets(st.integers(0, 4))),
        "crash_every": draw(st.sampled_from([0, 0, 2, 3])),
        "shape": draw(st.sampled_from(["middleware", "graph"])),
    }


def build_script(turns):
    script, k = [], 0
    for calls in turns:
        tool_calls = []
        for name, x in calls:
            tool_calls.append({"name": name, "args": {"x": x}, "id": f"c{k}", "type": "tool_call"})
            k += 1
        script.append(AIMessage(content="plan", tool_calls=tool_calls))
    script.append(AIMessage(content="final answer"))
    return script


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenario())
def test_budget_is_never_exceeded_and_every_charge_logged_once(sc):
    sink = MemoryLogSink()
    market = Market([PricedTool(n, p) for n, p in sc["prices"].items()])
    runs: list[tuple[str, float]] = []
    current: dict[str, BudgetGuard] = {}
    tools = [make_tool(n, n in sc["raising"], runs, lambda name: current["guard"].market.price(name))
             for n in NAMES if n in sc["prices"]]
    saver = InMemorySaver()
    config = {"configurable": {"thread_id": "prop"}}
    model = ScriptedToolModel(messages=iter(build_script(sc["turns"])), bound=[])
    oracle = Chaos(sc["crash_every"])

    def new_agent(guard):
        if sc["shape"] == "middleware":
            return create_agent(model, tools, middleware=[guard.middleware()], checkpointer=saver,
                                interrupt_after=["tools"])
        graph = guard_react_agent(model, tools, guard=guard, checkpointer=saver)
        graph.interrupt_after_nodes = ["tools"]
        return graph

    guard = current["guard"] = BudgetGuard(oracle, market, sc["budget"], log_sink=sink, tool_errors="message")
    agent = new_agent(guard)
    agent.invoke({"messages": [("user", "go")]}, config)
    updates = list(sc["updates"])
    for i in range(len(sc["turns"]) + 1):
        if agent.get_state(config).next == ():
            break
        if updates:  # the market moves between steps
            name, new_price, ban = updates.pop()
            guard.update_market(lambda m, n=name, p=new_price, b=ban: m.ban(n) if b else m.with_price(n, p))
        if i in sc["resume_after"]:  # a new process resumes the thread from the checkpointer
            event("resumed in a fresh guard")
            guard = current["guard"] = BudgetGuard(oracle, guard.market, sc["budget"], log_sink=sink,
                                                   tool_errors="message")
            agent = new_agent(guard)
        agent.invoke(None, config)

    state = agent.get_state(config).values
    ledger = BudgetGuard(AcceptAll(), market, sc["budget"]).ledger(state)  # from state alone
    ran = sum(price for _, price in runs)  # observed by the tools, not read from the guard
    assert ran <= sc["budget"] + 1e-9, f"the tools ran for {ran} ({runs}) but the budget is {sc['budget']}"
    assert abs(ledger.spent - ran) < 1e-6, f"the ledger charged {ledger.spent} but the tools ran for {ran} ({runs})"
    executions = [r for r in sink.records if r.execution > 0]
    assert Counter(r.tool for r in executions) == Counter(name for name, _ in runs), "one log record per run"
    assert abs(sum(r.charged for r in sink.records) - ran) < 1e-6
    if agent.get_state(config).next == ():  # the run is over
        assert ledger.reserved == 0
        assert_each_call_answered_once(state["messages"])
    event(f"shape={sc['shape']}")
    if any(r.reason == "over_budget" for r in sink.records):
        event("guard refused an unaffordable call")
    if any(r.status == "error" and r.charged for r in sink.records):
        event("a raising tool was charged")
