"""The planning oracles' per-episode memory: dropped when a run ends, never written by a decision that
outlived its run, and reset when the next run starts even if the last one lost its first step's writes."""

from __future__ import annotations

import asyncio
import threading

from langchain.agents import create_agent
from langchain_core.messages import AIMessage
from langchain_core.tools import tool
from langgraph.checkpoint.memory import InMemorySaver

from intent import AcceptAll, BudgetGuard, Decision, DecisionContext, Market, PricedTool, Proposal
from intent.oracle import EpisodeInfo
from intent.oracles import MCOOracle
from intent.oracles.base import PlanningOracle
from intent.oracles.caches import CachedStep
from intent.policy import AgentPolicy
from intent.testing import RecordingOracle, ScriptedToolModel, ai, call, scripted

MARKET = Market([PricedTool("a", 1.0)])


@tool
def a(x: int = 0) -> str:
    """a"""
    return f"a {x}"


def _ctx(episode: str) -> DecisionContext:
    prop = Proposal(f"{episode}-c", "a", {"x": 1}, "")
    return DecisionContext(episode, "q", prop, 1.0, 10.0, 0.0, 10.0, MARKET, step=0, history=[], batch=(prop,))


def test_a_planning_oracle_forgets_each_episode_when_its_run_ends():
    # 30 threads through one guard: the oracle's caches of each are dropped at the run's end (they were
    # kept forever: memory grew with every episode).
    class Answers(ScriptedToolModel):
        def invoke(self, *args: object, **kwargs: object) -> AIMessage:
            return AIMessage("done")  # the simulated agent answers after the call

    world = type("WM", (), {"simulate": lambda self, tool, args, **kw: '{"ok": true}'})()
    oracle = MCOOracle(AgentPolicy(Answers(messages=iter([]), bound=[])), world, max_depth=2, temperature=None)
    guard = BudgetGuard(oracle, MARKET, 100.0)
    for i in range(30):
        agent = create_agent(scripted([ai(call("a", x=i)), AIMessage("done")]), [a], middleware=[guard.middleware()])
        agent.invoke({"messages": [("user", "go")]}, {"configurable": {"thread_id": f"t{i}"}})
    assert len(oracle.memory) == 0


class _Blocking(PlanningOracle):
    """Its decision writes a plan to the rollout cache after waiting for ``release``."""

    def __init__(self) -> None:
        super().__init__(AgentPolicy(ScriptedToolModel(messages=iter([]), bound=[])), max_depth=1)
        self.entered, self.release = threading.Event(), threading.Event()

    def _decide(self, ctx: DecisionContext) -> Decision:
        self.entered.set()
        assert self.release.wait(10)
        self.memory.set_rollout(ctx.episode_id, [CachedStep("a", {"x": 2})])
        return Decision.accepted()


def test_a_decision_that_outlives_its_run_does_not_write_into_the_next_runs_memory():
    # An async run cancelled mid-decision leaves the decision running in its thread; the thread's next run
    # resets the episode's memory meanwhile. The old decision's plan must not become the new run's cache
    # (it was: the new run's first call was accepted as a cache hit, never simulated).
    oracle = _Blocking()
    done = threading.Thread(target=oracle.decide, args=(_ctx("e"),))
    done.start()
    assert oracle.entered.wait(10)
    oracle.start(EpisodeInfo("e", "the next run's task", 10.0, MARKET))
    oracle.release.set()
    done.join(10)
    assert oracle.memory.rollout("e") == []
    # Without a reset in between, the decision's plan is the episode's cache, as before.
    oracle.decide(_ctx("e"))  # (released already)
    assert oracle.memory.rollout("e") == [CachedStep("a", {"x": 2})]


class _Slow(AcceptAll):
    """Records each start; its async decision waits until released (the run is cancelled meanwhile)."""

    def __init__(self) -> None:
        self.started: list[str] = []
        self.waiting = asyncio.Event()

    def start(self, episode: EpisodeInfo) -> None:
        self.started.append(episode.query)

    async def adecide(self, ctx: DecisionContext) -> Decision:
        self.waiting.set()
        await asyncio.sleep(30)
        return Decision.accepted()


def test_a_new_message_after_a_run_cancelled_in_its_first_step_starts_the_next_run():
    # The first run is cancelled at its first gate: the step's writes (the run counter) are lost, and state
    # says a run begins when the user sends the next message. The working copy had started that run: the
    # oracle was not told a new run started (its caches of the cancelled run were kept for the new task).
    oracle = _Slow()
    guard = BudgetGuard(oracle, MARKET, 10.0)
    agent = create_agent(scripted([ai(call("a", x=1)), AIMessage("done")]), [a], middleware=[guard.middleware()],
                         checkpointer=InMemorySaver())
    cfg = {"configurable": {"thread_id": "t"}}

    async def main() -> None:
        run = asyncio.create_task(agent.ainvoke({"messages": [("user", "task one")]}, cfg))
        await oracle.waiting.wait()
        run.cancel()
        try:
            await run
        except asyncio.CancelledError:
            pass
        await agent.ainvoke({"messages": [("user", "task two")]}, cfg)

    asyncio.run(main())
    assert oracle.started == ["task one", "task two"]


def test_fan_out_branches_of_one_step_are_one_run_not_a_new_one_each():
    # Branches of one step, each with one of the thread's own human messages, share the step's checkpoint: the
    # second was taken for the thread's next run (a new message after a lost first step) and the oracle told
    # to start again mid-run.
    import threading

    from langchain_core.messages import HumanMessage
    from langgraph.graph import END, START, StateGraph
    from langgraph.types import Send

    from intent.state import GuardState

    oracle = RecordingOracle()
    guard = BudgetGuard(oracle, MARKET, 10.0)
    branch_0_prepared = threading.Event()

    def agent_node(state, config):  # noqa: ANN001, ANN202 - LangGraph passes config by this signature
        if state["messages"][-1].content == "sub-task 1":
            assert branch_0_prepared.wait(30)  # branch 0 starts the run
        settled = guard.prepare(state, config)
        if state["messages"][-1].content == "sub-task 0":
            branch_0_prepared.set()
        return {**(settled or {}), "messages": [AIMessage(f"done {state['messages'][-1].content}")]}

    graph = StateGraph(GuardState)
    graph.add_node("agent", agent_node)
    graph.add_conditional_edges(START, lambda s: [Send("agent", {"messages": [m]}) for m in s["messages"]], ["agent"])
    graph.add_edge("agent", END)
    graph.compile(checkpointer=InMemorySaver()).invoke(
        {"messages": [HumanMessage("sub-task 0"), HumanMessage("sub-task 1")]}, {"configurable": {"thread_id": "fan"}})
    assert [e.query for e in oracle.episodes] == ["sub-task 0"]
