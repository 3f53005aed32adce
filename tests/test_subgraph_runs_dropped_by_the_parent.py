"""A guarded agent run as a parent graph's node whose parent step never saved its result (a sync stream
closed early, a sibling node that crashed the step), then a new message on the thread: its spending is kept.

Each test counts executions inside the tools and checks the money promise: ``spent == Σ executions ×
price <= budget``, nothing reserved after the run, one log record per execution."""

from collections import Counter

from langchain.agents import create_agent
from langchain_core.messages import AIMessage, HumanMessage
from langchain_core.tools import StructuredTool
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.graph import END, START, StateGraph

from intent import AcceptAll, BudgetGuard, BudgetState, Market, MemoryLogSink, PricedTool
from intent.testing import ai, assert_each_call_answered_once, call, scripted


def test_a_subgraph_agent_whose_stream_was_closed_keeps_its_spending_for_the_next_message():
    # A guarded agent run as a parent graph's node, streamed with subgraphs=True by a sync caller that
    # stops reading after the first chunk (a client that went away). LangGraph cannot stop the node's
    # thread: the agent runs to its end (both calls, 6 of 7 spent) and ends its episode, but the parent's
    # loop is closed and the node's output is only a pending write, which the thread's next message
    # discards. That run then started from a fresh budget of 7: a third call ran, 9 spent of 7.
    runs: Counter[str] = Counter()

    def a(x: int = 0) -> str:
        """a"""
        runs["a"] += 1
        return "a"

    tool = StructuredTool.from_function(a, name="a", description="a")
    model = scripted([ai(call("a", x=0), text="0"), ai(call("a", x=1), text="1"), AIMessage("done"),
                      ai(call("a", x=2), text="2"), AIMessage("done2")])
    sink = MemoryLogSink()
    guard = BudgetGuard(AcceptAll(), Market([PricedTool("a", 3.0)]), 7.0, log_sink=sink)
    parent_graph = StateGraph(BudgetState)
    parent_graph.add_node("agent", create_agent(model, [tool], middleware=[guard.middleware()]))
    parent_graph.add_edge(START, "agent")
    parent_graph.add_edge("agent", END)
    parent = parent_graph.compile(checkpointer=InMemorySaver())
    cfg = {"configurable": {"thread_id": "closed-stream"}}

    stream = parent.stream({"messages": [("user", "go")]}, cfg, stream_mode="updates", subgraphs=True)
    for _chunk in stream:
        break
    stream.close()
    assert runs["a"] == 2  # the node's thread ran the agent to its end

    parent.invoke({"messages": [("user", "again")]}, cfg)
    state = parent.get_state(cfg)
    ledger = guard.ledger(state)
    assert runs["a"] == 2, f"a call ran on a budget that forgot the closed run: {runs['a'] * 3} spent of 7"
    assert ledger.spent == 3.0 * runs["a"] and ledger.reserved == 0
    assert len([r for r in sink.records if r.execution >= 1]) == runs["a"]
    assert_each_call_answered_once(state.values["messages"])


def test_a_subgraph_agent_whose_parent_step_crashed_in_a_sibling_keeps_its_spending_for_the_next_message():
    # The same loss without a stream: the agent's node ends (its episode with it), a sibling node of the
    # same parent step raises, and the user sends a new message instead of resuming: LangGraph drops the
    # agent's pending write with the failed step. The next run started from a fresh budget: 9 spent of 7.
    import time

    runs: Counter[str] = Counter()

    def a(x: int = 0) -> str:
        """a"""
        runs["a"] += 1
        return "a"

    failures = iter([True])

    def flaky(state: dict) -> dict:
        time.sleep(0.2)  # ends after the agent
        if next(failures, False):
            raise RuntimeError("the sibling's service is down")
        return {}

    tool = StructuredTool.from_function(a, name="a", description="a")
    model = scripted([ai(call("a", x=0), text="0"), ai(call("a", x=1), text="1"), AIMessage("done"),
                      ai(call("a", x=2), text="2"), AIMessage("done2")])
    guard = BudgetGuard(AcceptAll(), Market([PricedTool("a", 3.0)]), 7.0, log_sink=MemoryLogSink())
    parent_graph = StateGraph(BudgetState)
    parent_graph.add_node("agent", create_agent(model, [tool], middleware=[guard.middleware()]))
    parent_graph.add_node("flaky", flaky)
    for node in ("agent", "flaky"):
        parent_graph.add_edge(START, node)
        parent_graph.add_edge(node, END)
    parent = parent_graph.compile(checkpointer=InMemorySaver())
    cfg = {"configurable": {"thread_id": "crashed-sibling"}}
    try:
        parent.invoke({"messages": [("user", "go")]}, cfg)
    except RuntimeError:
        pass
    assert runs["a"] == 2

    parent.invoke({"messages": [("user", "again")]}, cfg)
    ledger = guard.ledger(parent.get_state(cfg))
    assert runs["a"] == 2, f"a call ran on a budget that forgot the crashed step's agent: {runs['a'] * 3} spent of 7"
    assert ledger.spent == 6.0 and ledger.reserved == 0


# Where nothing is taken back: a parent graph without a checkpointer (nothing LangGraph could drop), and a fork
# made from the checkpoint a saved step ran from (the fork runs on its checkpoint's ledger: intent.lineage).
def _parent(checkpointer=None):
    runs: Counter[str] = Counter()

    def a(x: int = 0) -> str:
        """a"""
        runs["a"] += 1
        return "a"

    tool = StructuredTool.from_function(a, name="a", description="a")
    model = scripted([ai(call("a", x=0), text="0"), AIMessage("done"), ai(call("a", x=2), text="2"),
                      AIMessage("done2")])
    guard = BudgetGuard(AcceptAll(), Market([PricedTool("a", 3.0)]), 7.0, log_sink=MemoryLogSink())
    g = StateGraph(BudgetState)
    g.add_node("agent", create_agent(model, [tool], middleware=[guard.middleware()]))
    g.add_edge(START, "agent")
    g.add_edge("agent", END)
    return g.compile(checkpointer=checkpointer), guard, runs


def test_a_subgraph_agent_in_a_parent_without_checkpointer_runs_a_second_turn():
    # The state carried by the caller from one invoke to the next (no checkpointer): the second turn's
    # first model step crashed with AttributeError ('NoneType' object has no attribute 'get_tuple').
    parent, guard, runs = _parent()
    state = parent.invoke({"messages": [("user", "go")]})
    assert guard.ledger(state).spent == 3.0
    state["messages"].append(HumanMessage("again"))
    state = parent.invoke(state)
    assert runs["a"] == 2
    assert guard.ledger(state).spent == 6.0 and guard.ledger(state).reserved == 0


def test_a_fork_from_a_saved_subgraph_step_runs_on_its_checkpoints_ledger():
    # Run 1 spends 3 and its parent step saves the result. The user then forks from the checkpoint that
    # step ran from, with a new message: the fork's state has no charge (run 1 is on the other branch), its
    # own call costs 3. Taking run 1's ledger back gave the fork 6 spent for one call of its own.
    parent, guard, runs = _parent(InMemorySaver())
    cfg = {"configurable": {"thread_id": "fork"}}
    parent.invoke({"messages": [("user", "go")]}, cfg)
    ran_from = next(h for h in parent.get_state_history(cfg) if h.next == ("agent",))
    parent.invoke({"messages": [("user", "instead")]}, ran_from.config)
    state = parent.get_state(cfg)
    assert [m.content for m in state.values["messages"]][:2] == ["go", "instead"]
    assert runs["a"] == 2
    ledger = guard.ledger(state)
    assert ledger.spent == 3.0, f"the fork counts the other branch's run: {ledger.spent} spent for one call"
    assert ledger.reserved == 0
