"""Property tests: whatever the oracle, the tools and the market do, the budget holds.

Random markets and budgets; model turns with one or several (parallel) tool calls, some to
unknown tools, some to tools that raise; an adversarial oracle that accepts everything (or
fails); market updates between turns; interrupts after the tool node with a resume in a
fresh guard (a new process) from the checkpointer. Checked after every run: executed spend
never exceeds the budget, every charge is in the log exactly once, and the log's charges add
up to the ledger's spend.
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

NAMES = ["t0", "t1", "t2", "t3", "t4"]


def make_tool(name: str, raises: bool) -> StructuredTool:
    def run(x: int = 0) -> str:
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
    tools = [make_tool(n, n in sc["raising"]) for n in NAMES if n in sc["prices"]]
    saver = InMemorySaver()
    config = {"configurable": {"thread_id": "prop"}}
    model = ScriptedToolModel(messages=iter(build_script(sc["turns"])), bound=[])
    oracle = Chaos(sc["crash_every"])

    def new_agent(guard):
        if sc["shape"] == "middleware":
            return create_agent(model, tools, middleware=[guard.middleware()], checkpointer=saver,
                                interrupt_after=["tools"])
        graph = guard_react_agent(model, tools, market=market, budget=sc["budget"], guard=guard, checkpointer=saver)
        graph.interrupt_after_nodes = ["tools"]
        return graph

    guard = BudgetGuard(oracle, market, sc["budget"], log_sink=sink, tool_errors="message")
    agent = new_agent(guard)
    out = agent.invoke({"messages": [("user", "go")]}, config)
    updates = list(sc["updates"])
    for i in range(len(sc["turns"]) + 1):
        if agent.get_state(config).next == ():
            break
        if updates:  # the market moves between steps
            name, new_price, ban = updates.pop()
            guard.update_market(lambda m, n=name, p=new_price, b=ban: m.ban(n) if b else m.with_price(n, p))
        if i in sc["resume_after"]:  # a new process resumes the thread from the checkpointer
            event("resumed in a fresh guard")
            guard = BudgetGuard(oracle, guard.market, sc["budget"], log_sink=sink, tool_errors="message")
            agent = new_agent(guard)
        out = agent.invoke(None, config)

    state = agent.get_state(config).values
    ledger = BudgetGuard(AcceptAll(), market, sc["budget"]).ledger(state)  # from state alone
    assert ledger.spent <= sc["budget"] + 1e-9
    assert ledger.reserved == 0 or agent.get_state(config).next != ()
    charged = [r for r in sink.records if r.charged > 0]
    assert Counter(r.call_id for r in charged) == Counter(e.tool_call_id for e in ledger if e.status == "committed" and e.amount > 0)
    assert abs(sum(r.charged for r in sink.records) - ledger.spent) < 1e-6
    assert max(Counter(r.call_id for r in sink.records).values(), default=1) == 1
    event(f"shape={sc['shape']}")
    if any(r.reason == "over_budget" for r in sink.records):
        event("guard refused an unaffordable call")
    if any(r.status == "error" and r.charged for r in sink.records):
        event("a raising tool was charged")
    for r in sink.records:
        assert r.spent <= sc["budget"] + 1e-9
