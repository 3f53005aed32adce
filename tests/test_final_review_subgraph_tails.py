"""Final review of the dropped-subgraph-run take-back (BudgetGuard._take_back_dropped_run): it must not
crash a parent graph without a checkpointer, nor take a run whose parent step DID save its result into a
fork made from that step's checkpoint (the fork runs on its checkpoint's ledger, as documented)."""

from collections import Counter

from langchain.agents import create_agent
from langchain_core.messages import AIMessage, HumanMessage
from langchain_core.tools import StructuredTool
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.graph import END, START, StateGraph

from intent import AcceptAll, BudgetGuard, BudgetState, Market, MemoryLogSink, PricedTool
from intent.testing import ai, call, scripted


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
