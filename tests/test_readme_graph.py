"""The README's hand-built LangGraph graph, as written there, holds the money invariants."""

from __future__ import annotations

from typing import Any

import asyncio

import pytest
from langchain.agents import create_agent
from langchain_core.messages import AIMessage
from langchain_core.tools import StructuredTool
from langgraph.graph import END, START, StateGraph

from intent import AcceptAll, BudgetGuard, Decision, GuardState, Market, Oracle, PricedTool
from intent import MeteredModelRefused
from intent.testing import ReactiveToolModel, TurnInfo, ai, assert_each_call_answered_once, call, scripted


def _readme_graph(guard: BudgetGuard, model: Any, tools: list[Any], schema: Any = GuardState, *,
                  tool_node: Any = None) -> StateGraph:
    """The README's graph (the test below spells it out as written there); ``tool_node`` replaces its tools
    node, ``guard.tool_node(tools)`` (tests/test_plain_tool_node.py wires a plain ToolNode there)."""

    def agent_node(state, config):
        settled = guard.prepare(state, config) or {}
        return {**settled, "messages": [model.bind_tools(tools).invoke(state["messages"], config)]}

    g = StateGraph(schema)
    g.add_node("agent", agent_node)
    g.add_node("guard", guard.node())
    g.add_node("tools", guard.tool_node(tools) if tool_node is None else tool_node)
    g.add_node("end", lambda state, config: guard.finish(state, config) or {})
    g.add_edge(START, "agent")
    g.add_conditional_edges("agent", lambda s: "guard" if s["messages"][-1].tool_calls else "end", ["guard", "end"])
    g.add_conditional_edges("guard", lambda s: guard.route(s, end="end"), ["tools", "agent", "end"])
    g.add_edge("tools", "agent")
    g.add_edge("end", END)
    return g


@pytest.mark.parametrize("use_async", [False, True], ids=["sync", "async"])
def test_the_readme_graph_pays_each_run_and_ends_with_nothing_reserved(use_async):
    runs: list[str] = []
    tools = [StructuredTool.from_function(lambda x=0, n=n: runs.append(n) or n, name=n, description=n)
             for n in ("a", "b")]
    guard = BudgetGuard(AcceptAll(), Market([PricedTool("a", 3.0), PricedTool("b", 5.0)]), 12.0)
    model = scripted([ai(call("a", x=1), call("b", x=1), call("a", x=2), call("b", x=2)), AIMessage("done")])

    # ---- as in the README
    def agent_node(state, config):
        settled = guard.prepare(state, config) or {}
        reply = model.bind_tools(tools).invoke(state["messages"], config)
        return {**settled, "messages": [reply]}

    def after_agent(state):
        return "guard" if state["messages"][-1].tool_calls else "end"

    g = StateGraph(GuardState)
    g.add_node("agent", agent_node)
    g.add_node("guard", guard.node())
    g.add_node("tools", guard.tool_node(tools))
    g.add_node("end", lambda state, config: guard.finish(state, config) or {})
    g.add_edge(START, "agent")
    g.add_conditional_edges("agent", after_agent, ["guard", "end"])
    g.add_conditional_edges("guard", lambda s: guard.route(s, end="end"), ["tools", "agent", "end"])
    g.add_edge("tools", "agent")
    g.add_edge("end", END)
    # ----
    graph = g.compile()
    inp = {"messages": [("user", "go")]}
    out = asyncio.run(graph.ainvoke(inp)) if use_async else graph.invoke(inp)
    ledger = guard.ledger(out)
    prices = {"a": 3.0, "b": 5.0}
    assert ledger.spent == sum(prices[n] for n in runs) <= 12.0 and len(runs) == 3  # the fourth does not fit
    assert ledger.reserved == 0 and len(guard.episodes) == 0
    assert_each_call_answered_once(out["messages"])


def test_a_state_schema_without_the_ledger_channel_is_a_clear_configuration_error():
    # StateGraph(MessagesState): LangGraph dropped the gate's decisions, and every call was refused "as never
    # approved ... place the guard's gate before the tools" although it was there.
    from langgraph.checkpoint.memory import InMemorySaver
    from langgraph.graph import MessagesState

    from intent import GuardConfigError

    runs: list[str] = []
    tools = [StructuredTool.from_function(lambda x=0: runs.append("a") or "a", name="a", description="a")]
    guard = BudgetGuard(AcceptAll(), Market([PricedTool("a", 3.0)]), 100.0)
    model = scripted([ai(call("a", x=1)), AIMessage("done")])
    built = _readme_graph(guard, model, tools, schema=MessagesState)
    with pytest.raises(GuardConfigError, match="no 'intent_ledger' channel.*GuardState"):
        built.compile(checkpointer=InMemorySaver()).invoke({"messages": [("user", "go")]},
                                                            {"configurable": {"thread_id": "t"}})
    assert runs == []
    # The edge after the gate says the same for a state object without the channel (a Pydantic schema's).
    with pytest.raises(GuardConfigError, match="no 'intent_ledger' channel"):
        guard.route({"messages": [ai(call("a", x=1))]})


def test_a_call_with_an_empty_id_is_run_and_answered_as_create_agent_does():
    # Some OpenAI-compatible servers send id "": the route dropped the call, so it was never answered.
    from intent.logs import MemoryLogSink

    runs: list[str] = []
    tools = [StructuredTool.from_function(lambda x=0: runs.append("a") or "a", name="a", description="a")]
    sink = MemoryLogSink()
    guard = BudgetGuard(AcceptAll(), Market([PricedTool("a", 3.0)]), 12.0, log_sink=sink)
    empty = AIMessage("", tool_calls=[{"name": "a", "args": {"x": 1}, "id": "", "type": "tool_call"}])
    out = _readme_graph(guard, scripted([empty, AIMessage("done")]), tools).compile().invoke(
        {"messages": [("user", "go")]})
    assert_each_call_answered_once(out["messages"])
    assert runs == ["a"] and guard.ledger(out).spent == 3.0 and guard.ledger(out).reserved == 0
    assert [(r.call_id, r.status) for r in sink.records if r.kind == "tool"] == [("", "ok")]


@pytest.mark.parametrize("use_async", [False, True], ids=["sync", "async"])
def test_a_call_added_while_paused_before_the_tools_is_answered_once_and_not_run(use_async):
    # graph.update_state on a thread paused before the tool node (LangGraph infers as_node="guard"): the gate
    # never saw the added call. It was left unanswered (the model then saw a call without its ToolMessage).
    from langgraph.checkpoint.memory import InMemorySaver

    runs: list[str] = []
    tools = [StructuredTool.from_function(lambda x=0, n=n: runs.append(n) or n, name=n, description=n)
             for n in ("a", "b")]
    guard = BudgetGuard(AcceptAll(), Market([PricedTool("a", 3.0), PricedTool("b", 5.0)]), 20.0)
    model = scripted([ai(call("a", x=1)), AIMessage("done")])

    g = _readme_graph(guard, model, tools)
    graph = g.compile(checkpointer=InMemorySaver(), interrupt_before=["tools"])
    config = {"configurable": {"thread_id": f"added-{use_async}"}}

    async def arun() -> None:
        await graph.ainvoke({"messages": [("user", "go")]}, config)
        last = (await graph.aget_state(config)).values["messages"][-1]
        added = {"name": "b", "args": {"x": 2}, "id": "added_1", "type": "tool_call"}
        await graph.aupdate_state(config, {"messages": [last.model_copy(update={"tool_calls": [*last.tool_calls, added]})]})
        await graph.ainvoke(None, config)

    if use_async:
        asyncio.run(arun())
    else:
        graph.invoke({"messages": [("user", "go")]}, config)
        last = graph.get_state(config).values["messages"][-1]
        added = {"name": "b", "args": {"x": 2}, "id": "added_1", "type": "tool_call"}
        graph.update_state(config, {"messages": [last.model_copy(update={"tool_calls": [*last.tool_calls, added]})]})
        graph.invoke(None, config)
    out = graph.get_state(config).values
    assert_each_call_answered_once(out["messages"])
    assert runs == ["a"] and guard.ledger(out).spent == 3.0 and guard.ledger(out).reserved == 0


@pytest.mark.parametrize("use_async", [False, True], ids=["sync", "async"])
def test_the_readme_graph_fanned_out_as_parallel_subgraphs_shares_one_budget(use_async):
    # A parent graph sends three tasks to the guarded agent at once (map-reduce of agents) in one thread:
    # the branches share the thread's episode. One branch's model step released a sibling's reservation while
    # the sibling's tool ran (LedgerError after the tool had run; tools ran for 14 against a budget of 12).
    import threading

    runs: list[str] = []
    lock = threading.Lock()
    second_turn = threading.Event()  # a branch's model has been called for its second turn
    inside = threading.Semaphore(0)  # a first call of branch 1 or 2 is running

    def body(name: str) -> Any:
        def run(x: int = 0, k: int = 0) -> str:
            # The overlap the bug needs, every time: branches 1 and 2 are inside their first call (its
            # reservation held) when branch 0 settles at its next model step (its model is called right after).
            if x == 0 and k > 0:
                inside.release()
                assert second_turn.wait(timeout=30)
            elif x == 0:
                assert inside.acquire(timeout=30) and inside.acquire(timeout=30)
            with lock:
                runs.append(name)
            return name
        return run

    tools = [StructuredTool.from_function(body(n), name=n, description=n) for n in ("a", "b")]
    prices = {"a": 3.0, "b": 5.0}
    guard = BudgetGuard(AcceptAll(), Market([PricedTool(n, p) for n, p in prices.items()]), 12.0)

    def branchy(messages: list, info: TurnInfo) -> AIMessage:
        """a, then b, then a, then b, then done, by the turn of the branch's own history."""
        turn = sum(1 for m in messages if isinstance(m, AIMessage))
        k = int(str(messages[0].content).split()[-1])  # "task k"
        if turn == 1:
            second_turn.set()
        name = ("a", "b", "a", "b")[turn] if turn < 4 else None
        return AIMessage("done") if name is None else AIMessage("", tool_calls=[
            {"name": name, "args": {"x": turn, "k": k}, "id": f"c{turn}-{k}", "type": "tool_call"}])

    model = ReactiveToolModel(reply=branchy, model_name=None)

    graph = _fanned_out(_readme_graph(guard, model, tools).compile(), 3)
    config = {"configurable": {"thread_id": f"fan-{use_async}"}}
    inp = {"messages": [("user", "fan out")]}
    out = asyncio.run(graph.ainvoke(inp, config)) if use_async else graph.invoke(inp, config)
    ledger = guard.ledger(out)
    assert ledger.spent == sum(prices[n] for n in runs) <= 12.0 and len(runs) >= 3
    assert ledger.reserved == 0 and len(guard.episodes) == 0


def _by_turn_reply(*names: str) -> Any:
    """Calls ``names[i]`` at the i-th turn after the latest human message, then answers "done"."""

    def reply(messages: list, info: TurnInfo) -> AIMessage:
        last_human = max(i for i, m in enumerate(messages) if m.type == "human")
        turn = sum(1 for m in messages[last_human:] if isinstance(m, AIMessage))
        text = str(messages[last_human].content)
        todo = names if not text.startswith("ask") else ("ask",)
        return AIMessage("done") if turn >= len(todo) else ai(call(todo[turn], x=turn))

    return reply


def _by_turn(*names: str) -> ReactiveToolModel:
    return ReactiveToolModel(reply=_by_turn_reply(*names), model_name=None)


def _priced_tools(prices: dict[str, float], runs: list[str], **bodies: Any) -> list[Any]:
    def body(name: str) -> Any:
        def run(x: int = 0) -> str:
            runs.append(name)
            return bodies[name](x) if name in bodies else name
        return run
    return [StructuredTool.from_function(body(n), name=n, description=n) for n in prices]


@pytest.mark.parametrize("use_async", [False, True], ids=["sync", "async"])
def test_a_subgraph_turn_after_an_abandoned_pause_releases_the_paused_reservation(use_async):
    # The guarded agent as a parent's subgraph node: turn 1 pauses inside a tool (3 held), the user drops the
    # pause and sends a new task. Turn 2 runs under another parent task: the paused call is not running any
    # more and its reservation is released (was: held forever, and a call that fits was refused).
    from langchain_core.messages import HumanMessage
    from langgraph.checkpoint.memory import InMemorySaver
    from langgraph.types import interrupt

    prices, runs = {"a": 3.0, "ask": 3.0}, []
    tools = _priced_tools(prices, runs, ask=lambda x: f"human said {interrupt('ok?')}")
    guard = BudgetGuard(AcceptAll(), Market([PricedTool(n, p) for n, p in prices.items()]), 5.0)
    parent = StateGraph(GuardState)
    parent.add_node("sub", _readme_graph(guard, _by_turn("a"), tools).compile())
    parent.add_edge(START, "sub")
    parent.add_edge("sub", END)
    graph = parent.compile(checkpointer=InMemorySaver())
    config = {"configurable": {"thread_id": f"abandoned-{use_async}"}}

    def invoke(inp: Any) -> Any:
        return asyncio.run(graph.ainvoke(inp, config)) if use_async else graph.invoke(inp, config)

    assert invoke({"messages": [HumanMessage("ask first")]}).get("__interrupt__")
    out = invoke({"messages": [HumanMessage("forget that, new task")]})
    ledger = guard.ledger(out)
    assert runs == ["ask", "a"] and ledger.spent == 3.0 and ledger.reserved == 0 and len(guard.episodes) == 0


@pytest.mark.parametrize("use_async", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("carried", [False, True], ids=["one-turn", "two-turns-channel-sent"])
def test_a_fan_out_branch_that_starts_after_its_sibling_ended_spends_from_the_same_budget(use_async, carried):
    # A Send fan-out in one thread in which branch 1 first runs a slow node, so branch 0 has finished (and
    # ended the episode) before branch 1's agent starts. Was: branch 1 got a new ledger (16 spent against 12
    # in one turn), and, over two turns that send the thread's ledger channel with each task, one built from
    # the channel it was sent, without branch 0's spend in that turn (22 against 20). The oracle is told the
    # episode starts again before it decides for the late branch (was: decide after end).

    prices, runs, oracle = {"a": 3.0, "b": 5.0}, [], _LiveEpisodes()
    budget = 20.0 if carried else 12.0
    guard = BudgetGuard(oracle, Market([PricedTool(n, p) for n, p in prices.items()]), budget)
    graph = _late_fan_out(guard, prices, runs, carried)
    config = {"configurable": {"thread_id": f"late-{use_async}-{carried}"}}
    for turn in range(2 if carried else 1):
        inp = {"messages": [("user", f"fan out {turn}")]}
        out = asyncio.run(graph.ainvoke(inp, config)) if use_async else graph.invoke(inp, config)
        ledger = guard.ledger(out)
        assert sum(prices[n] for n in runs) == ledger.spent <= budget
        # (A later turn's episode is loaded from state, which calls no start hook: checked on the first.)
        assert ledger.reserved == 0 and (turn > 0 or oracle.bad == [])


def test_an_oracle_without_an_end_hook_keeps_its_episode_when_a_late_branch_revives_it():
    # start() resets what an oracle knows of an episode (MCO's and INTENT's memory); one that was never told the
    # episode ended is not told it starts again.

    class Starts(Oracle):
        def __init__(self) -> None:
            self.starts = 0

        def start(self, info: Any) -> None:
            self.starts += 1

        def decide(self, ctx: Any) -> Decision:
            return Decision.accepted()

    prices, runs, oracle = {"a": 3.0, "b": 5.0}, [], Starts()
    guard = BudgetGuard(oracle, Market([PricedTool(n, p) for n, p in prices.items()]), 12.0)
    out = _late_fan_out(guard, prices, runs, False).invoke({"messages": [("user", "fan out")]},
                                                          {"configurable": {"thread_id": "late-no-end"}})
    assert oracle.starts == 1 and guard.ledger(out).spent == sum(prices[n] for n in runs) <= 12.0


def _waiting_branch(agent: Any, wait_or_pass: Any, first_done: Any) -> Any:
    """A fan-out branch: ``wait_or_pass`` (a late branch waits there), the agent, then ``first_done`` set."""
    sub = StateGraph(GuardState)
    sub.add_node("prepare", wait_or_pass)
    sub.add_node("agent", agent)
    sub.add_node("mark", lambda s: first_done.set() or {})
    sub.add_edge(START, "prepare")
    sub.add_edge("prepare", "agent")
    sub.add_edge("agent", "mark")
    sub.add_edge("mark", END)
    return sub.compile()


class _LiveEpisodes(Oracle):
    """Accepts every call, and notes each decision that comes outside its episode's start and end."""

    def __init__(self) -> None:
        self.live: set[str] = set()
        self.bad: list[str] = []

    def start(self, info: Any) -> None:
        self.live.add(info.episode_id)

    def end(self, episode_id: str) -> None:
        self.live.discard(episode_id)

    def decide(self, ctx: Any) -> Decision:
        if ctx.episode_id not in self.live:
            self.bad.append(ctx.tool)
        return Decision.accepted()


def _late_fan_out(guard: BudgetGuard, prices: dict[str, float], runs: list[str], carried: bool = False, *,
                  branches: int = 2, after_wait: Any = None) -> Any:
    """Send branches of the README graph in one thread; every branch but branch 0 waits until branch 0 has
    finished, then runs ``after_wait(k)`` (when given) before its agent starts."""
    import threading

    agent = _readme_graph(guard, _by_turn("a", "b"), _priced_tools(prices, runs)).compile()
    first_done = threading.Event()

    def wait_or_pass(state: Any) -> dict[str, Any]:
        k = int(state["messages"][-1].content.split()[-1])
        if k > 0:
            assert first_done.wait(timeout=30)
            if after_wait is not None:
                after_wait(k)
        return {}

    return _fanned_out(_waiting_branch(agent, wait_or_pass, first_done), branches, carried=carried, each_turn=first_done.clear)  # branches wait again


def _fanned_out(sub: Any, branches: int, *, carried: bool = False, each_turn: Any = None) -> Any:
    """A parent graph (with a checkpointer) that sends ``sub`` the tasks "task 0".."task n-1" at once, with the
    parent's ledger channel when ``carried``; ``each_turn()`` runs before each turn's tasks are sent."""
    from langchain_core.messages import HumanMessage
    from langgraph.checkpoint.memory import InMemorySaver
    from langgraph.types import Send

    def send(state: Any) -> list[Any]:
        if each_turn is not None:
            each_turn()
        channel = {"intent_ledger": state.get("intent_ledger")} if carried else {}
        return [Send("sub", {"messages": [HumanMessage(f"task {k}")], **channel}) for k in range(branches)]

    parent = StateGraph(GuardState)
    parent.add_node("sub", sub)
    parent.add_conditional_edges(START, send, ["sub"])
    parent.add_edge("sub", END)
    return parent.compile(checkpointer=InMemorySaver())


def _cued_reply(on_turn: Any = None, branch_calls: dict[int, str] | None = None) -> Any:
    """Branch k ("task k"; -1 without a number) calls ``branch_calls[k]`` at its first turn, then answers
    "done"; ``on_turn(k, turn)`` runs before it answers (to line branches up)."""

    def reply(messages: list, info: TurnInfo) -> AIMessage:
        k = int(str(messages[0].content).split()[-1]) if str(messages[0].content)[-1:].isdigit() else -1
        turn = sum(1 for m in messages if isinstance(m, AIMessage))
        if on_turn is not None:
            on_turn(k, turn)
        name = (branch_calls or {}).get(k) if turn == 0 else None
        return AIMessage("done") if name is None else AIMessage("", tool_calls=[
            {"name": name, "args": {"x": k}, "id": f"c{k}-{turn}", "type": "tool_call"}])

    return reply


def _cued(on_turn: Any = None, branch_calls: dict[int, str] | None = None) -> ReactiveToolModel:
    return ReactiveToolModel(reply=_cued_reply(on_turn, branch_calls), model_name=None)


class _SlowRevivingStart(_LiveEpisodes):
    """An oracle whose second start hook (branch 1 reviving the episode) says so, waits for the sibling that
    must wait for it to get going, then takes ``pause`` seconds: that sibling reaches its model step meanwhile."""

    def __init__(self, reviving: Any, sibling_going: Any, pause: float) -> None:
        super().__init__()
        self.starts, self.reviving, self.sibling_going, self.pause = 0, reviving, sibling_going, pause

    def start(self, info: Any) -> None:
        import time

        self.starts += 1
        if self.starts == 2:
            self.reviving.set()
            assert self.sibling_going.wait(timeout=30)
            time.sleep(self.pause)
        super().start(info)


@pytest.mark.parametrize("use_async", [False, True], ids=["sync", "async"])
def test_a_sub_agents_carve_inside_one_fan_out_branch_is_left_to_it_by_a_sibling(use_async):
    # Branch 0's tool runs a sub-agent that carves from the thread's budget (FromParent); branch 1 settles at
    # its next model step while that sub-agent runs. The carve is reserved from the sub-agent's own steps, one
    # level below branch 0. Was: branch 1 released it, LedgerError after the sub-agent's tool had run.
    import threading

    from langchain_core.messages import HumanMessage

    from intent import FromParent

    carved, sibling_settled = threading.Event(), threading.Event()

    def parent_cue(k: int, turn: int) -> None:
        if k == 1 and turn == 0:
            assert carved.wait(timeout=30)  # branch 1 gates once the carve exists
        if k == 1 and turn == 1:
            sibling_settled.set()  # its second step has settled

    def child_cue(k: int, turn: int) -> None:
        if turn == 0:
            carved.set()  # the child's first step has carved from the parent
            assert sibling_settled.wait(timeout=30)

    runs: list[str] = []
    child_guard = BudgetGuard(AcceptAll(), Market([PricedTool("b", 5.0)]), FromParent(limit=6.0))
    child = _readme_graph(child_guard, _cued(on_turn=child_cue, branch_calls={-1: "b"}),
                          _priced_tools({"b": 5.0}, runs)).compile()
    prices = {"a": 3.0, "delegate": 1.0}
    tools = _priced_tools(prices, runs, delegate=lambda x: child.invoke({"messages": [HumanMessage("child task")]})
                          and "child done")
    guard = BudgetGuard(AcceptAll(), Market([PricedTool(n, p) for n, p in prices.items()]), 12.0)
    graph = _fanned_out(_readme_graph(guard, _cued(on_turn=parent_cue, branch_calls={0: "delegate", 1: "a"}),
                                      tools).compile(), 2)
    config = {"configurable": {"thread_id": f"carve-{use_async}"}}
    inp = {"messages": [("user", "fan out")]}
    out = asyncio.run(graph.ainvoke(inp, config)) if use_async else graph.invoke(inp, config)
    ledger = guard.ledger(out)
    assert sorted(runs) == ["a", "b", "delegate"] and ledger.spent == 9.0 and ledger.reserved == 0


def test_no_decision_of_a_revived_episode_comes_before_its_start_hook_has_finished_or_after_its_end():
    # Three Send branches: branch 0 ends the episode, branch 1 revives it and its oracle's start hook is slow
    # (loads memory), branch 2 joins meanwhile. Was: branch 2 decided before that start had finished, then
    # ended the episode under branch 1, which decided after end.
    import threading

    reviving, sibling_going = threading.Event(), threading.Event()

    prices, runs, oracle = {"a": 1.0, "b": 5.0}, [], _SlowRevivingStart(reviving, sibling_going, 0.2)
    guard = BudgetGuard(oracle, Market([PricedTool(n, p) for n, p in prices.items()]), 16.0)

    def branch_2_joins_while_branch_1_starts(k: int) -> None:
        if k == 2:
            assert reviving.wait(timeout=30)
            sibling_going.set()

    graph = _late_fan_out(guard, prices, runs, branches=3, after_wait=branch_2_joins_while_branch_1_starts)
    out = graph.invoke({"messages": [("user", "fan out")]}, {"configurable": {"thread_id": "slow-start"}})
    ledger = guard.ledger(out)
    assert oracle.bad == [] and ledger.spent == sum(prices[n] for n in runs) <= 16.0 and ledger.reserved == 0


def test_a_late_branch_inside_a_run_under_way_waits_for_the_revived_episodes_start_hook():
    # A lead step of the guarded thread (guard.prepare) starts run 1, then sends three branches of the README
    # agent with its ledger channel (a run under way) and its reply. Branch 0 ends the episode; branch 1
    # revives it and its oracle's start hook is slow; branch 2 joins meanwhile. Branch 2's first step is inside
    # the run state says is under way, with no new user message: it must still wait for that start.
    import threading

    from langchain_core.messages import HumanMessage
    from langgraph.checkpoint.memory import InMemorySaver
    from langgraph.types import Send

    reviving, sibling_going, first_done = threading.Event(), threading.Event(), threading.Event()

    prices, runs, oracle = {"a": 1.0, "b": 2.0}, [], _SlowRevivingStart(reviving, sibling_going, 0.3)
    guard = BudgetGuard(oracle, Market([PricedTool(n, p) for n, p in prices.items()]), 30.0)
    agent = _readme_graph(guard, _by_turn("a", "b"), _priced_tools(prices, runs)).compile()

    def wait_or_pass(state: Any) -> dict[str, Any]:
        k = int(state["messages"][0].content.split()[-1])
        if k > 0:
            assert first_done.wait(timeout=30)
            if k == 2:
                assert reviving.wait(timeout=30)
                sibling_going.set()
        return {}

    sub = _waiting_branch(agent, wait_or_pass, first_done)

    def lead(state, config):
        return {**(guard.prepare(state, config) or {}), "messages": [AIMessage("split into three tasks")]}

    def send(state: Any) -> list[Any]:
        return [Send("sub", {"messages": [HumanMessage(f"task {k}"), AIMessage(f"on task {k}")],
                             "intent_ledger": state["intent_ledger"]}) for k in range(3)]

    parent = StateGraph(GuardState)
    parent.add_node("lead", lead)
    parent.add_node("sub", sub)
    parent.add_edge(START, "lead")
    parent.add_conditional_edges("lead", send, ["sub"])
    parent.add_edge("sub", END)
    graph = parent.compile(checkpointer=InMemorySaver())
    out = graph.invoke({"messages": [("user", "plan")]}, {"configurable": {"thread_id": "lead-fan-out"}})
    ledger = guard.ledger(out)
    assert oracle.starts == 2
    assert oracle.bad == [] and ledger.spent == sum(prices[n] for n in runs) and ledger.reserved == 0


@pytest.mark.parametrize("use_async", [False, True], ids=["sync", "async"])
def test_two_sub_agents_in_one_tool_call_are_two_episodes(use_async):
    # A FromParent child agent run twice inside one guarded tool call, with the parent's config: the second
    # revived the first one's ended episode (one start for two tasks; the first one's stop carried over), and
    # every ended sub-agent episode was kept aside.
    from langchain.agents import create_agent
    from langchain_core.messages import HumanMessage

    from intent import FromParent

    class Starts(Oracle):
        def __init__(self) -> None:
            self.queries: list[str] = []

        def start(self, info: Any) -> None:
            self.queries.append(info.query)

        def decide(self, ctx: Any) -> Decision:
            return Decision.accepted()

    oracle, runs = Starts(), []
    child = BudgetGuard(oracle, Market([PricedTool("fetch", 1.0)]), FromParent(limit=3.0))
    fetch = _priced_tools({"fetch": 1.0}, runs)

    def child_agent() -> Any:
        return create_agent(scripted([ai(call("fetch", x=1)), AIMessage("child done")]), fetch,
                            middleware=[child.middleware()])

    def research(x: int = 0) -> str:
        return ",".join(child_agent().invoke({"messages": [HumanMessage(f"task {i}")]})["messages"][-1].content
                        for i in range(2))

    async def aresearch(x: int = 0) -> str:
        return ",".join([(await child_agent().ainvoke({"messages": [HumanMessage(f"task {i}")]}))["messages"][-1]
                         .content for i in range(2)])

    parent = BudgetGuard(AcceptAll(), Market([PricedTool("research", 0.0)]), 100.0)
    tool = StructuredTool.from_function(research, coroutine=aresearch, name="research", description="d")
    agent = create_agent(scripted([ai(call("research", x=1)), AIMessage("done")]), [tool],
                         middleware=[parent.middleware()])
    config = {"configurable": {"thread_id": f"subs-{use_async}"}}
    inp = {"messages": [HumanMessage("go")]}
    out = asyncio.run(agent.ainvoke(inp, config)) if use_async else agent.invoke(inp, config)
    assert oracle.queries == ["task 0", "task 1"] and runs == ["fetch", "fetch"]
    assert parent.ledger(out).spent == 2.0 and len(child.episodes) == 0 and len(child.episodes._ended) == 0


def _classifying_fan_out(guard: BudgetGuard, selector: Any, model: Any, tools: list[Any], *, before: Any = None,
                         only: str | None = None) -> Any:
    """``create_agent`` with a middleware of one's own listed before the guard that calls ``selector`` (a
    ``guard.metered_model``) before the agent's first model call (in the branch whose task is ``only``, when
    given), fanned out as two Send branches; ``before(k)`` runs first in branch k's subgraph."""
    from langchain.agents import create_agent
    from langchain.agents.middleware import AgentMiddleware

    class Classify(AgentMiddleware):
        def before_model(self, state: Any, runtime: Any) -> None:
            if self._classifies(state):
                selector.invoke("classify")

        async def abefore_model(self, state: Any, runtime: Any) -> None:
            if self._classifies(state):
                await selector.ainvoke("classify")

        def _classifies(self, state: Any) -> bool:
            messages = state["messages"]
            return not any(m.type == "ai" for m in messages) and only in (None, messages[0].content)

    agent = create_agent(model, tools, middleware=[Classify(), guard.middleware()])
    sub = StateGraph(GuardState)
    def before_agent(state: Any) -> dict[str, Any]:
        if before is not None:
            before(int(state["messages"][-1].content.split()[-1]))
        return {}

    sub.add_node("before", before_agent)
    sub.add_node("agent", agent)
    sub.add_edge(START, "before")
    sub.add_edge("before", "agent")
    sub.add_edge("agent", END)
    return _fanned_out(sub.compile(), 2)


def _selector_guard(prices: dict[str, float], budget: float) -> tuple[BudgetGuard, Any]:
    from intent import ModelPrice
    from intent.testing import BilledChatModel, ModelRuns

    guard = BudgetGuard(AcceptAll(), Market([PricedTool(n, p) for n, p in prices.items()]), budget,
                        model_prices={"sel": ModelPrice(0.0, 10000.0)}, charge_models=False, max_output_tokens=100)
    return guard, BilledChatModel(model_name="sel", runs=ModelRuns(), tokens=(0, 100))  # 1.0 an execution


@pytest.mark.parametrize("use_async", [False, True], ids=["sync", "async"])
def test_a_metered_model_in_a_late_fan_out_branch_spends_from_the_threads_budget(use_async):
    # Branch 1 starts after branch 0 has ended the episode; its middleware's metered model call comes before
    # the guard's first step. Was: that call made a new episode with the whole budget, which the branch then
    # spent from (22 spent of 12).
    import threading

    guard, billed = _selector_guard({"a": 5.0}, 12.0)
    selector = guard.metered_model(billed)
    first_done, runs = threading.Event(), []

    by_turn = _by_turn_reply("a", "a")

    def mark_done(messages: list, info: TurnInfo) -> AIMessage:
        out = by_turn(messages, info)
        if out.content == "done" and messages[0].content == "task 0":
            first_done.set()
        return out

    model = ReactiveToolModel(reply=mark_done, model_name=None)
    graph = _classifying_fan_out(guard, selector, model, _priced_tools({"a": 5.0}, runs),
                                 before=lambda k: k == 0 or first_done.wait(timeout=30))
    config = {"configurable": {"thread_id": f"late-selector-{use_async}"}}
    inp = {"messages": [("user", "fan out")]}
    out = asyncio.run(graph.ainvoke(inp, config)) if use_async else graph.invoke(inp, config)
    ledger = guard.ledger(out)
    paid = 5.0 * len(runs) + 1.0 * len(billed.runs.log)
    assert ledger.spent == paid <= 12.0 and ledger.reserved == 0 and len(guard.episodes) == 0


@pytest.mark.parametrize("use_async", [False, True], ids=["sync", "async"])
def test_a_sibling_settling_leaves_a_running_metered_call_of_a_branch_that_has_not_stepped_yet(use_async):
    # Branch 1's metered call (before its first guarded step) is running when branch 0 settles at its second
    # step. Was: branch 0 released the call's reservation, and its charge failed after the model had run
    # (LedgerError).
    import threading

    from intent.testing import BilledChatModel

    in_flight, settled = threading.Event(), threading.Event()
    guard, billed = _selector_guard({"a": 5.0}, 12.0)

    class Slow(BilledChatModel):
        def _generate(self, *args: Any, **kwargs: Any) -> Any:
            in_flight.set()
            assert settled.wait(timeout=30)
            return super()._generate(*args, **kwargs)

        async def _agenerate(self, *args: Any, **kwargs: Any) -> Any:
            in_flight.set()
            assert await asyncio.to_thread(settled.wait, 30)  # the event loop goes on with branch 0
            return super()._generate(*args, **kwargs)

    selector = guard.metered_model(Slow(model_name="sel", runs=billed.runs, tokens=(0, 100)))

    cued = _cued_reply(branch_calls={0: "a"})

    def branch_0_waits(messages: list, info: TurnInfo) -> AIMessage:
        if messages[0].content == "task 0":
            turn = sum(1 for m in messages if isinstance(m, AIMessage))
            if turn == 0:
                assert in_flight.wait(timeout=30)  # branch 1's metered call is running
            else:
                settled.set()  # branch 0's second step has settled
        return cued(messages, info)

    runs: list[str] = []
    model = ReactiveToolModel(reply=branch_0_waits, model_name=None)
    graph = _classifying_fan_out(guard, selector, model, _priced_tools({"a": 5.0}, runs), only="task 1")
    config = {"configurable": {"thread_id": f"in-flight-{use_async}"}}
    inp = {"messages": [("user", "fan out")]}
    out = asyncio.run(graph.ainvoke(inp, config)) if use_async else graph.invoke(inp, config)
    ledger = guard.ledger(out)
    assert runs == ["a"] and len(billed.runs.log) == 1
    assert ledger.spent == 6.0 and ledger.reserved == 0 and len(guard.episodes) == 0


def test_a_late_branch_starts_the_episode_again_only_after_its_end_hook_has_returned():
    # Branch 0 ends the episode and its oracle's end hook is slow (saves memory); branch 1 revives the episode
    # meanwhile. Was: start ran inside that end (end>, start, <end), so branch 1 decided after end.
    import threading
    import time

    class SlowEnd(_LiveEpisodes):
        def __init__(self) -> None:
            super().__init__()
            self.log: list[str] = []
            self.ending = threading.Event()

        def start(self, info: Any) -> None:
            self.log.append("start")
            super().start(info)

        def end(self, episode_id: str) -> None:
            self.log.append("end>")
            self.ending.set()
            time.sleep(0.3)
            super().end(episode_id)
            self.log.append("<end")

    oracle, runs = SlowEnd(), []
    guard = BudgetGuard(oracle, Market([PricedTool("a", 3.0)]), 12.0)
    agent = _readme_graph(guard, _by_turn("a"), _priced_tools({"a": 3.0}, runs)).compile()

    def wait_for_the_end(state: Any) -> dict[str, Any]:
        if state["messages"][-1].content != "task 0":
            assert oracle.ending.wait(timeout=30)  # branch 0's end hook is running
        return {}

    sub = StateGraph(GuardState)
    sub.add_node("prepare", wait_for_the_end)
    sub.add_node("agent", agent)
    sub.add_edge(START, "prepare")
    sub.add_edge("prepare", "agent")
    sub.add_edge("agent", END)
    out = _fanned_out(sub.compile(), 2).invoke({"messages": [("user", "fan out")]},
                                               {"configurable": {"thread_id": "slow-end"}})
    assert oracle.log == ["start", "end>", "<end", "start", "end>", "<end"] and oracle.bad == []
    assert guard.ledger(out).spent == 6.0 == 3.0 * len(runs) and guard.ledger(out).reserved == 0


@pytest.mark.parametrize("late", [False, True], ids=["together", "after"])
def test_a_scope_node_fanned_out_beside_the_guarded_agent_spends_from_the_same_budget(late):
    # One Send task runs the guarded agent, the other a node that runs a FromParent sub-agent inside
    # guard.scope(config). Together: the agent settles at its next step while the sub-agent's carve is held
    # (was: released, LedgerError after the sub-agent's tool ran). After: the node starts once the agent has
    # ended the episode, with 3 of 6 left: the sub-agent cannot afford its call (was: a fresh budget, and it
    # ran: 14 spent of 12 in a probe with more calls).
    import threading

    from langchain_core.messages import HumanMessage

    from intent import FromParent

    carved, settled, agent_done = threading.Event(), threading.Event(), threading.Event()

    def agent_cue(k: int, turn: int) -> None:
        if not late and turn == 0:
            assert carved.wait(timeout=30)
        if turn == 1:
            settled.set()  # the agent's second step has settled

    def child_cue(k: int, turn: int) -> None:
        if turn == 0:
            carved.set()
            if not late:
                assert settled.wait(timeout=30)

    runs: list[str] = []
    budget = 6.0 if late else 12.0
    guard = BudgetGuard(AcceptAll(), Market([PricedTool("a", 3.0)]), budget)
    agent = _readme_graph(guard, _cued(on_turn=agent_cue, branch_calls={0: "a"}), _priced_tools({"a": 3.0}, runs))
    agent = agent.compile()
    child_guard = BudgetGuard(AcceptAll(), Market([PricedTool("c", 4.0)]), FromParent(limit=8.0))
    child = _readme_graph(child_guard, _cued(on_turn=child_cue, branch_calls={-1: "c"}),
                          _priced_tools({"c": 4.0}, runs)).compile()

    def helper(state, config):  # noqa: ANN001 - unannotated, for LangGraph to pass the config
        if late:
            assert agent_done.wait(timeout=30)
        with guard.scope(config):
            child.invoke({"messages": [HumanMessage("child task")]})
        return {}

    out = _beside_the_agent(guard, agent, helper, f"scope-{late}", agent_done=agent_done)
    ledger = guard.ledger(out)
    prices = {"a": 3.0, "c": 4.0}
    assert sorted(runs) == (["a"] if late else ["a", "c"])
    assert ledger.spent == sum(prices[n] for n in runs) <= budget and ledger.reserved == 0


def _beside_the_agent(guard: BudgetGuard, agent: Any, helper: Any, thread: str, *, use_async: bool = False,
                      agent_done: Any = None) -> Any:
    """Run ``agent`` (a compiled guarded subgraph) and ``helper`` (a plain node) as two Send tasks of one step."""
    from langchain_core.messages import HumanMessage
    from langgraph.checkpoint.memory import InMemorySaver
    from langgraph.types import Send

    def run_agent(state: Any) -> dict[str, Any]:
        out = agent.invoke(state)
        if agent_done is not None:
            agent_done.set()
        return {"messages": out["messages"][1:], "intent_ledger": out.get("intent_ledger")}

    parent = StateGraph(GuardState)
    parent.add_node("sub", agent if use_async else run_agent)
    parent.add_node("helper", helper)
    parent.add_conditional_edges(START, lambda s: [Send("sub", {"messages": [HumanMessage("task 0")]}),
                                                   Send("helper", {"messages": [HumanMessage("task 1")]})],
                                 ["sub", "helper"])
    parent.add_edge("sub", END)
    parent.add_edge("helper", END)
    graph = parent.compile(checkpointer=InMemorySaver())
    config = {"configurable": {"thread_id": thread}}
    if use_async:
        return asyncio.run(graph.ainvoke({"messages": [("user", "fan out")]}, config))
    return graph.invoke({"messages": [("user", "fan out")]}, config)


def _one_node_subgraph(node: Any) -> Any:
    """``node`` as a compiled subgraph of its own (its steps then run in a branch of the parent)."""
    graph = StateGraph(GuardState)
    graph.add_node("node", node)
    graph.add_edge(START, "node")
    graph.add_edge("node", END)
    return graph.compile()


@pytest.mark.parametrize("in_scope", [False, True], ids=["plain-node", "in-scope"])
def test_a_metered_model_in_a_plain_node_beside_the_agent_keeps_its_reservation_and_reaches_state(in_scope):
    # A Send task that is a plain node (not a subgraph) calls a metered model while the agent's branch settles
    # (was: the node's task was never a visitor, so the agent released the running call's reservation:
    # LedgerError after the model ran). In a scope, the model's charge reaches state when the agent ended
    # before the model did (was: the scope wrote only its carves: the run ended with 1 reserved).
    import threading

    from intent.testing import BilledChatModel

    in_flight, settled, agent_done = threading.Event(), threading.Event(), threading.Event()
    guard, billed = _selector_guard({"a": 3.0}, 12.0)

    class Slow(BilledChatModel):
        def _generate(self, *args: Any, **kwargs: Any) -> Any:
            in_flight.set()
            assert settled.wait(timeout=30)
            if in_scope:
                assert agent_done.wait(timeout=30)  # the agent's last write is before this charge
            return super()._generate(*args, **kwargs)

    selector = guard.metered_model(Slow(model_name="sel", runs=billed.runs, tokens=(0, 100)))

    def agent_cue(k: int, turn: int) -> None:
        if turn == 0:
            assert in_flight.wait(timeout=30)
        if turn == 1:
            settled.set()  # the agent's second step has settled, with the model call running

    runs: list[str] = []
    agent = _readme_graph(guard, _cued(on_turn=agent_cue, branch_calls={0: "a"}),
                          _priced_tools({"a": 3.0}, runs)).compile()

    def helper(state, config):  # noqa: ANN001 - unannotated, for LangGraph to pass the config
        if in_scope:
            with guard.scope(config):
                selector.invoke("classify")
        else:
            selector.invoke("classify")
        return {}

    out = _beside_the_agent(guard, agent, helper, f"plain-{in_scope}", agent_done=agent_done)
    ledger = guard.ledger(out)
    assert runs == ["a"] and len(billed.runs.log) == 1
    assert ledger.spent == 4.0 and ledger.reserved == 0.0


async def _given_up_once(call: Any, reached: Any, give_up: str = "wait_for") -> None:
    """Give up on ``call`` with ``asyncio.wait_for`` (a task of its own) or ``asyncio.timeout`` (this task), the
    timeout firing once ``reached()`` says the call got where the test gives up on it (a loaded machine may take
    longer than any fixed timeout to get there). Raises the timeout's TimeoutError."""
    if give_up == "wait_for":
        task = asyncio.ensure_future(call)
        while not reached() and not task.done():
            await asyncio.sleep(0.001)
        await asyncio.wait_for(task, 0.05)
        return
    async with asyncio.timeout(None) as deadline:
        async def fire() -> None:
            while not reached():
                await asyncio.sleep(0.001)
            deadline.reschedule(asyncio.get_running_loop().time())

        firing = asyncio.ensure_future(fire())
        try:
            await call
        finally:
            firing.cancel()


@pytest.mark.parametrize("give_up", ["wait_for", "timeout"])
def test_a_cancelled_async_metered_call_is_charged_and_leaves_no_visitor_or_reservation(give_up):
    # asyncio.wait_for (a task of its own on 3.11) or asyncio.timeout (the node's own task) gives up on a
    # metered model's ainvoke in a fan-out branch. LangChain calls neither on_llm_end nor on_llm_error for it
    # (was: a visitor forever, its 1 reserved after the run, which no settle could release; then, charged only
    # when the task that called it was done: with asyncio.timeout, after the node had returned). Cancelled, it
    # is charged its reserved worst case, as a cancelled model call is, at once.
    import threading

    from intent.testing import BilledChatModel

    guard, billed = _selector_guard({"a": 3.0}, 12.0)
    sent: list[bool] = []

    class Slow(BilledChatModel):
        async def _agenerate(self, *args: Any, **kwargs: Any) -> Any:
            sent.append(True)  # the request is at the provider
            await asyncio.sleep(30)
            raise AssertionError("not reached")

    selector = guard.metered_model(Slow(model_name="sel", runs=billed.runs, tokens=(0, 100)))
    timed_out, seen = threading.Event(), {}
    runs: list[str] = []
    agent = _readme_graph(guard, _cued(on_turn=lambda k, t: t == 0 and timed_out.wait(30), branch_calls={0: "a"}),
                          _priced_tools({"a": 3.0}, runs)).compile()

    async def classify(state: Any) -> dict[str, Any]:
        with pytest.raises(asyncio.TimeoutError):
            await _given_up_once(selector.ainvoke("classify"), lambda: bool(sent), give_up)
        episode = guard.episodes.peek("cancelled")
        seen.update(visitors=dict(episode.visitors), reserved=episode.ledger.reserved)
        timed_out.set()
        return {}

    out = _beside_the_agent(guard, agent, _one_node_subgraph(classify), "cancelled", use_async=True)
    ledger = guard.ledger(out)
    assert seen == {"visitors": {}, "reserved": 0.0}
    assert runs == ["a"] and ledger.spent == 4.0 and ledger.reserved == 0.0
    charges = [e for e in ledger.entries() if e.kind == "model"]
    assert [(e.status, e.amount) for e in charges] == [("committed", 1.0)]


def test_a_refused_prompt_of_a_batch_releases_the_prompts_started_before_it():
    # generate() with two prompts in a fan-out branch; only one fits. The first prompt's run had started
    # (reserved, visiting); the refusal of the second is raised from LangChain's callbacks, so the first never
    # gets an end or error (was: 1 reserved after the run, and a visitor left). Neither prompt is sent.
    import threading

    from langchain_core.messages import HumanMessage

    guard, billed = _selector_guard({"a": 3.0}, 1.5)  # one model execution (1.0) fits
    selector = guard.metered_model(billed)
    tried, seen = threading.Event(), {}
    runs: list[str] = []
    agent = _readme_graph(guard, _cued(on_turn=lambda k, t: t == 0 and tried.wait(30), branch_calls={}),
                          _priced_tools({"a": 3.0}, runs)).compile()

    def classify(state: Any) -> dict[str, Any]:
        with pytest.raises(MeteredModelRefused):
            selector.generate([[HumanMessage("one")], [HumanMessage("two")]])
        episode = guard.episodes.peek("batch")
        seen.update(visitors=dict(episode.visitors), reserved=episode.ledger.reserved)
        tried.set()
        return {}

    out = _beside_the_agent(guard, agent, _one_node_subgraph(classify), "batch")
    ledger = guard.ledger(out)
    assert seen == {"visitors": {}, "reserved": 0.0}
    assert billed.runs.log == [] and ledger.spent == 0.0 and ledger.reserved == 0.0


def test_a_metered_call_beside_the_agent_in_the_same_node_keeps_its_reservation():
    # One async node awaits the guarded agent and a metered classifier together (asyncio.gather): both run in
    # the node's task, so the classifier's task is the agent's branch. Was: the agent's settle took the
    # classifier's running reservation for its own and released it (LedgerError after the model ran).
    from langchain.agents.middleware import AgentMiddleware
    from langchain_core.messages import HumanMessage
    from langgraph.checkpoint.memory import InMemorySaver

    from intent.testing import BilledChatModel

    guard, billed = _selector_guard({"a": 3.0}, 12.0)
    events: dict[str, asyncio.Event] = {}

    class Slow(BilledChatModel):
        async def _agenerate(self, *args: Any, **kwargs: Any) -> Any:
            events["in_flight"].set()
            await events["settled"].wait()
            return await super()._agenerate(*args, **kwargs)

    class Cue(AgentMiddleware):
        async def abefore_model(self, state: Any, runtime: Any) -> None:
            if not any(m.type == "ai" for m in state["messages"]):
                await events["in_flight"].wait()

        async def aafter_model(self, state: Any, runtime: Any) -> None:
            if sum(1 for m in state["messages"] if m.type == "ai") == 2:
                events["settled"].set()  # the agent's second model step has settled

    selector = guard.metered_model(Slow(model_name="sel", runs=billed.runs, tokens=(0, 100)))
    runs: list[str] = []
    agent = create_agent(scripted([ai(call("a", x=1)), AIMessage("done")]), _priced_tools({"a": 3.0}, runs),
                         middleware=[Cue(), guard.middleware()])

    async def node(state: Any) -> dict[str, Any]:
        out, _ = await asyncio.gather(agent.ainvoke({"messages": state["messages"]}), selector.ainvoke("classify"))
        return {"intent_ledger": out.get("intent_ledger")}

    graph = StateGraph(GuardState)
    graph.add_node("sub", node)
    graph.add_node("other", lambda s: {})  # a sibling task: "sub" runs as a branch of the top graph's step
    graph.add_edge(START, "sub")
    graph.add_edge(START, "other")
    graph.add_edge("sub", END)
    graph.add_edge("other", END)
    compiled = graph.compile(checkpointer=InMemorySaver())

    async def main() -> Any:
        events.update(in_flight=asyncio.Event(), settled=asyncio.Event())
        return await compiled.ainvoke({"messages": [HumanMessage("go")]}, {"configurable": {"thread_id": "same"}})

    ledger = guard.ledger(asyncio.run(main()))
    assert runs == ["a"] and len(billed.runs.log) == 1
    assert ledger.spent == 4.0 and ledger.reserved == 0.0


def test_a_metered_call_after_the_agent_spends_from_state_after_another_process_spent():
    # Runs of one thread by two guards sharing a checkpointer (two processes): g1, g2, g1; each run's nodes
    # before and after the agent call a metered model (1.0 each) with a budget of 4.5. Was: g1 kept its
    # episode from run 1 and spent from that copy at run 3 (5.0 of 4.5).
    from langchain_core.messages import HumanMessage
    from langgraph.checkpoint.memory import InMemorySaver

    from intent.ledger import BudgetLedger

    first, billed = _selector_guard({"a": 3.0}, 4.5)
    second, _ = _selector_guard({"a": 3.0}, 4.5)
    current = [first]
    selectors = {id(g): g.metered_model(billed) for g in (first, second)}
    agents = {id(g): create_agent(scripted([AIMessage("done")] * 5), [], middleware=[g.middleware()])
              for g in (first, second)}

    def pre(state: Any) -> dict[str, Any]:
        selectors[id(current[0])].invoke("pre")
        return {}

    def post(state: Any) -> dict[str, Any]:
        selectors[id(current[0])].invoke("post")
        return {}

    def agent(state, config):  # noqa: ANN001 - unannotated, for LangGraph to pass the config
        agents[id(current[0])].invoke(state, config)
        return {}

    graph = StateGraph(GuardState)
    for name, fn in (("pre", pre), ("agent", agent), ("post", post)):
        graph.add_node(name, fn)
    graph.add_edge(START, "pre")
    graph.add_edge("pre", "agent")
    graph.add_edge("agent", "post")
    graph.add_edge("post", END)
    compiled = graph.compile(checkpointer=InMemorySaver())
    config = {"configurable": {"thread_id": "stale"}}
    for guard in (first, second):
        current[0] = guard
        compiled.invoke({"messages": [HumanMessage("go")]}, config)
    current[0] = first
    with pytest.raises(MeteredModelRefused):  # 0.5 left: run 3's first call does not fit
        compiled.invoke({"messages": [HumanMessage("go")]}, config)
    ledger = BudgetLedger.from_state(compiled.get_state(config).values["intent_ledger"])
    assert ledger.spent == 4.0 and len(billed.runs.log) == 4


@pytest.mark.parametrize("how", ["copy-of-a-copy", "astream-rate-limited"])
def test_every_cancelled_metered_call_is_charged_once_and_leaves_nothing_held(how):
    # A metered copy of another guard's metered copy, cancelled: each guard charges its own run (was: only the
    # first, the second held 1.0 forever). An astream cancelled while its rate limiter waits (before LangChain's
    # try, so no end or error, and not through agenerate): settled when the calling task is done (was: held),
    # and released, not charged: the limiter never let the request out (intent.model_meter.SentSignal).
    from langchain_core.rate_limiters import InMemoryRateLimiter

    from intent.testing import BilledChatModel

    sent: list[bool] = []

    class Slow(BilledChatModel):
        async def _agenerate(self, *args: Any, **kwargs: Any) -> Any:
            sent.append(True)  # the request is at the provider
            await asyncio.sleep(30)
            raise AssertionError("not reached")

    class Watched(InMemoryRateLimiter):
        waiting = False  # a request has reached the limiter

        async def aacquire(self, *, blocking: bool = True) -> bool:
            self.waiting = True
            return await super().aacquire(blocking=blocking)

    guards = [_selector_guard({"a": 3.0}, 12.0)[0] for _ in range(2)]
    billed = _selector_guard({"a": 3.0}, 12.0)[1]
    if how == "copy-of-a-copy":
        model = guards[1].metered_model(guards[0].metered_model(Slow(model_name="sel", runs=billed.runs,
                                                                     tokens=(0, 100))))
    else:
        guards = guards[:1]
        limiter = Watched(requests_per_second=0.01, check_every_n_seconds=0.05, max_bucket_size=1)
        limiter.available_tokens = 0.0  # the first request waits
        model = guards[0].metered_model(Slow(model_name="sel", runs=billed.runs, tokens=(0, 100),
                                             rate_limiter=limiter))

    async def node(state: Any) -> dict[str, Any]:
        with pytest.raises(asyncio.TimeoutError):
            if how == "copy-of-a-copy":
                await _given_up_once(model.ainvoke("classify"), lambda: bool(sent))
            else:
                async def drain() -> None:
                    async for _ in model.astream("classify"):
                        pass
                await _given_up_once(drain(), lambda: limiter.waiting)
        return {}

    compiled = _one_node_subgraph(node)
    asyncio.run(compiled.ainvoke({"messages": []}, {"configurable": {"thread_id": f"twice-{how}"}}))
    for guard in guards:
        episode = guard.episodes.peek(f"twice-{how}")
        assert episode is not None and episode.visitors == {}
        settled = "released" if how == "astream-rate-limited" else "committed"
        assert [(e.status, e.amount) for e in episode.ledger.entries()] == [(settled, 1.0)]
