"""Sub-agents started with a copy of the parent's graph state, as deepagents' ``task`` tool does.

deepagents copies every state key of the parent but a few into the sub-agent's input (the guard's
ledger channel included) and merges the sub-agent's changed keys back into the parent's state. A
child guard (``FromParent``) must still carve its budget from the parent's tool call and spend
only that; the parent's ledger must not be taken over, and nothing may be charged twice or lost.
Runs are counted inside the tools.
"""

from __future__ import annotations

import asyncio
from typing import Annotated, Any

import pytest
from langchain.agents import create_agent
from langchain.tools import InjectedState, InjectedToolCallId
from langchain_core.messages import AIMessage, HumanMessage, ToolMessage
from langchain_core.tools import StructuredTool
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.types import Command

from intent import AcceptAll, BudgetGuard, FromParent, GuardConfigError, Market, PricedTool
from intent.state import LEDGER_KEY
from intent.testing import ReactiveToolModel, RunCounter, ai, assert_each_call_answered_once, call, scripted

PRICE_A = 3.0
MARKET = Market([PricedTool("a", PRICE_A), PricedTool("task", 0.0)])
EXCLUDED = ("messages", "todos", "structured_response")  # what deepagents does not copy


class Runs(RunCounter):
    def tool(self) -> StructuredTool:
        def a(x: int = 0) -> str:
            self.hit("a")
            return f"a={x}"

        return StructuredTool.from_function(a, name="a", description="Tool a.")


def task_tool(make_child: Any, use_async: bool, finals: list[Any] | None = None) -> StructuredTool:
    """deepagents' task tool, reduced: the sub-agent gets a copy of the parent's state and a new
    human message; its changed state comes back as the tool's Command update. ``finals`` collects
    the sub-agent's final states."""

    def child_input(state: dict, description: str) -> dict:
        copied = {k: v for k, v in state.items() if k not in EXCLUDED}
        return {**copied, "messages": [HumanMessage(description)]}

    def answer(result: dict, tool_call_id: str) -> Command:
        if finals is not None:
            finals.append(result)
        back = {k: v for k, v in result.items() if k not in EXCLUDED}
        text = str(result["messages"][-1].content)
        return Command(update={**back, "messages": [ToolMessage(text, tool_call_id=tool_call_id, name="task")]})

    def task(description: str, state: Annotated[dict, InjectedState],
             tool_call_id: Annotated[str, InjectedToolCallId]) -> Command:
        return answer(make_child().invoke(child_input(state, description)), tool_call_id)

    async def atask(description: str, state: Annotated[dict, InjectedState],
                    tool_call_id: Annotated[str, InjectedToolCallId]) -> Command:
        return answer(await make_child().ainvoke(child_input(state, description)), tool_call_id)

    return StructuredTool.from_function(task, coroutine=atask if use_async else None, name="task",
                                        description="Delegate to a sub-agent.")


def parent_script() -> list[AIMessage]:
    return [ai(call("task", description="call a three times")), ai(call("a", x=9), call("a", x=10)),
            ai(text="parent done")]


def child_script() -> list[AIMessage]:
    return [ai(call("a", x=1)), ai(call("a", x=2)), ai(call("a", x=3)), ai(text="child done")]


def run(agent: Any, use_async: bool, config: Any) -> Any:
    inp = {"messages": [("user", "go")]}
    return asyncio.run(agent.ainvoke(inp, config)) if use_async else agent.invoke(inp, config)


@pytest.mark.parametrize("use_async", [False, True])
@pytest.mark.parametrize("thread", [True, False])
def test_a_child_guard_on_a_copy_of_the_parents_state_spends_only_its_carve(thread, use_async):
    runs = Runs()
    parent = BudgetGuard(AcceptAll(), MARKET, 10.0)
    child = BudgetGuard(AcceptAll(), MARKET, FromParent(limit=4.0))  # room for one run of a

    def make_child() -> Any:
        return create_agent(scripted(child_script()), [runs.tool()], middleware=[child.middleware()])

    finals: list[Any] = []
    agent = create_agent(scripted(parent_script()), [runs.tool(), task_tool(make_child, use_async, finals)],
                         middleware=[parent.middleware()], checkpointer=InMemorySaver() if thread else None)
    out = run(agent, use_async, {"configurable": {"thread_id": "p"}} if thread else None)
    ledger = parent.ledger(out)
    # The child runs a once (3 of its 4), its second call does not fit; the parent then has 7 left
    # and runs both of its calls: 9 spent, and every run is paid exactly once.
    assert runs["a"] == 3
    assert ledger.spent == pytest.approx(runs["a"] * PRICE_A) and ledger.spent <= 10.0
    (carve,) = [e for e in ledger.entries() if e.kind == "sub_agent"]
    assert carve.status == "committed" and carve.amount == pytest.approx(PRICE_A)
    assert ledger.reserved == 0
    # The parent's state is the parent's: its budget, and its charges only (the child's runs are in
    # the carve, not copied back into the parent's channel by the task tool's update).
    channel = out[LEDGER_KEY]
    assert channel["budget"] == 10.0 and (channel["episode_id"] == "p" if thread else True)
    committed = [e for e in channel["entries"].values() if e["status"] == "committed"]
    assert sum(e["amount"] for e in committed) == pytest.approx(ledger.spent)
    assert sorted(e["kind"] for e in committed) == ["sub_agent", "tool", "tool", "tool"]  # task (0), a, a
    assert_each_call_answered_once(out["messages"])
    assert len(parent.episodes) == 0 and len(child.episodes) == 0
    # The sub-agent's state holds its own ledger: an episode of its own (not the parent's, though it
    # ran with the parent's thread id), the carve as its budget, and each of its charges.
    (final,) = finals
    mine = final[LEDGER_KEY]
    assert mine["episode_id"] != channel["episode_id"] and mine["budget"] == pytest.approx(4.0)
    assert sorted((e["kind"], e["status"], e["amount"]) for e in mine["entries"].values()) == [
        ("tool", "committed", PRICE_A)]
    assert child.ledger(final).spent == pytest.approx(PRICE_A)


@pytest.mark.parametrize("use_async", [False, True])
def test_the_same_guard_in_a_sub_agent_on_a_copy_of_the_state_is_a_configuration_error(use_async):
    runs = Runs()
    guard = BudgetGuard(AcceptAll(), MARKET, 10.0)

    def make_child() -> Any:
        return create_agent(scripted(child_script()), [runs.tool()], middleware=[guard.middleware()])

    agent = create_agent(scripted(parent_script()), [runs.tool(), task_tool(make_child, use_async)],
                         middleware=[guard.middleware()])
    with pytest.raises(GuardConfigError, match="FromParent"):
        run(agent, use_async, None)
    assert runs["a"] == 0  # nothing ran on a ledger that was not the sub-agent's


@pytest.mark.parametrize("use_async", [False, True])
@pytest.mark.parametrize("copy_state", [True, False])
def test_parallel_grandchildren_on_the_parents_thread_each_carve_their_own(copy_state, use_async):
    # Top agent (thread "p") -> a child sub-agent -> two grandchildren started in one message. Each
    # runs with its ancestors' config (thread "p"): each must still get an episode and a carve of its
    # own. (Sharing one, the first to end dropped it and the other spent outside every ledger.)
    import itertools

    runs = Runs()
    top = BudgetGuard(AcceptAll(), MARKET, 100.0)
    mid = BudgetGuard(AcceptAll(), MARKET, FromParent(limit=50.0))
    leaf = BudgetGuard(AcceptAll(), MARKET, FromParent(limit=20.0))
    n = itertools.count()

    def task(make: Any) -> StructuredTool:
        if copy_state:
            return task_tool(make, use_async)

        def plain(description: str) -> str:  # a sub-agent on a fresh state of its own
            return str(make().invoke({"messages": [HumanMessage(description)]})["messages"][-1].content)

        async def aplain(description: str) -> str:
            return str((await make().ainvoke({"messages": [HumanMessage(description)]}))["messages"][-1].content)

        return StructuredTool.from_function(plain, coroutine=aplain, name="task", description="Delegate.")

    def make_leaf() -> Any:
        script = ([ai(text="short done")] if next(n) == 0 else
                  [*(ai(call("a", x=i)) for i in range(4)), ai(text="long done")])
        return create_agent(scripted(script), [runs.tool()], middleware=[leaf.middleware()])

    def make_mid() -> Any:
        return create_agent(scripted([ai(call("task", description="g1"), call("task", description="g2")),
                                      ai(text="mid done")]), [runs.tool(), task(make_leaf)],
                            middleware=[mid.middleware()])

    agent = create_agent(scripted([ai(call("task", description="c")), ai(text="top done")]),
                         [runs.tool(), task(make_mid)], middleware=[top.middleware()], checkpointer=InMemorySaver())
    out = run(agent, use_async, {"configurable": {"thread_id": "p"}})
    ledger = top.ledger(out)
    assert runs["a"] == 4  # the long grandchild's four calls fit its carve of 20
    assert ledger.spent == pytest.approx(4 * PRICE_A) and ledger.reserved == 0
    assert len(top.episodes) == len(mid.episodes) == len(leaf.episodes) == 0


@pytest.mark.parametrize("use_async", [False, True])
def test_a_child_s_metered_model_before_its_guard_s_first_step_pays_from_the_child_s_carve(use_async):
    # The child lists LLMToolSelectorMiddleware before its guard, so the selector's model runs before the
    # child guard's first step has replaced the copied ledger. Its executions must be paid from the
    # child's own carve, in the episode the child's guard then continues (not a copy of the parent's).
    from langchain.agents.middleware import LLMToolSelectorMiddleware

    from intent import ModelPrice

    selections = RunCounter()

    def selector_model() -> ReactiveToolModel:
        """LLMToolSelectorMiddleware's model: picks tool ``a`` through structured output (a tool call)."""
        return ReactiveToolModel(reply=lambda messages, info: AIMessage("", tool_calls=[
            {"name": info.tools[0], "args": {"tools": ["a"]}, "id": "s", "type": "tool_call"}]),
                                 model_name="selector", usage=(100, 10), runs=selections)

    runs = Runs()
    prices = {"selector": ModelPrice(input_per_mtok=1000.0, output_per_mtok=1000.0)}  # 0.11 per selection
    parent = BudgetGuard(AcceptAll(), MARKET, 10.0, model_prices=prices, charge_models=False)
    child = BudgetGuard(AcceptAll(), MARKET, FromParent(limit=4.0), model_prices=prices, charge_models=False,
                        max_output_tokens=10)
    b = StructuredTool.from_function(lambda: "b", name="b", description="Tool b.")

    def make_child() -> Any:
        selector = LLMToolSelectorMiddleware(model=child.metered_model(selector_model()), max_tools=1)
        return create_agent(scripted([ai(call("a", x=1)), ai(text="child done")]), [runs.tool(), b],
                            middleware=[selector, child.middleware()])

    agent = create_agent(scripted([ai(call("task", description="work")), ai(text="parent done")]),
                         [runs.tool(), task_tool(make_child, use_async)], middleware=[parent.middleware()],
                         checkpointer=InMemorySaver())
    out = run(agent, use_async, {"configurable": {"thread_id": "p"}})
    ledger = parent.ledger(out)
    counted = runs["a"] * PRICE_A + selections.total() * 0.11
    assert runs["a"] == 1 and selections.total() == 2
    assert ledger.spent == pytest.approx(counted) and ledger.reserved == 0
    (carve,) = [e for e in ledger.entries() if e.kind == "sub_agent"]
    assert carve.amount == pytest.approx(counted)  # the child's tool run and both selections, in its carve
    assert len(child.episodes) == 0


def test_a_child_with_a_thread_of_its_own_carves_again_each_time_it_is_started():
    # A long-lived sub-agent (its own checkpointer and thread) started from two tool calls: its second
    # start finds its ledger in its own state. It must draw a new carve from the second call, and what
    # it spent the first time must not be counted again. (It used to rebuild a plain ledger from its
    # state: the second start's spending reached no parent ledger.)
    runs = Runs()
    parent = BudgetGuard(AcceptAll(), MARKET, 20.0)
    child = BudgetGuard(AcceptAll(), MARKET, FromParent(limit=10.0))
    child_agent = create_agent(scripted([ai(call("a", x=1)), ai(text="first"), ai(call("a", x=2)),
                                         ai(call("a", x=3)), ai(text="second")]),
                               [runs.tool()], middleware=[child.middleware()], checkpointer=InMemorySaver())

    def task(description: str) -> str:
        out = child_agent.invoke({"messages": [HumanMessage(description)]}, {"configurable": {"thread_id": "own"}})
        return str(out["messages"][-1].content)

    agent = create_agent(scripted([ai(call("task", description="one")), ai(call("task", description="two")),
                                   ai(text="done")]),
                         [runs.tool(), StructuredTool.from_function(task, name="task", description="Delegate.")],
                         middleware=[parent.middleware()], checkpointer=InMemorySaver())
    out = agent.invoke({"messages": [("user", "go")]}, {"configurable": {"thread_id": "p"}})
    ledger = parent.ledger(out)
    assert runs["a"] == 3
    assert ledger.spent == pytest.approx(3 * PRICE_A) and ledger.reserved == 0
    assert sorted(e.amount for e in ledger.entries() if e.kind == "sub_agent") == [PRICE_A, 2 * PRICE_A]


def test_sub_agents_started_together_by_one_call_on_the_inherited_thread_are_all_paid():
    # One tool call starts two sub-agents at once with its config (the parent's thread id): they share
    # the call's episode. When the short one ends, its carve is closed; the long one goes on under a
    # new carve of the same call, so every run is still paid from the parent's budget.
    runs = Runs()
    parent = BudgetGuard(AcceptAll(), MARKET, 50.0)
    child = BudgetGuard(AcceptAll(), MARKET, FromParent(limit=20.0))

    def make(script: list[AIMessage]) -> Any:
        return create_agent(scripted(script), [runs.tool()], middleware=[child.middleware()])

    async def fan_out(description: str) -> str:
        short = make([ai(text="short done")])
        long = make([*(ai(call("a", x=i)) for i in range(3)), ai(text="long done")])

        short_done = asyncio.Event()

        async def short_first() -> Any:
            try:
                return await short.ainvoke({"messages": [HumanMessage(description)]})
            finally:
                short_done.set()

        async def slow_start() -> Any:
            await short_done.wait()  # so that the short one ends first
            return await long.ainvoke({"messages": [HumanMessage(description)]})

        await asyncio.gather(short_first(), slow_start())
        return "both done"

    tool = StructuredTool.from_function(coroutine=fan_out, name="task", description="Fan out.")
    agent = create_agent(scripted([ai(call("task", description="go")), ai(text="done")]), [runs.tool(), tool],
                         middleware=[parent.middleware()], checkpointer=InMemorySaver())
    out = asyncio.run(agent.ainvoke({"messages": [("user", "go")]}, {"configurable": {"thread_id": "p"}}))
    ledger = parent.ledger(out)
    assert runs["a"] == 3
    assert ledger.spent == pytest.approx(3 * PRICE_A) and ledger.reserved == 0


MARKET_AB = Market([PricedTool("a", PRICE_A), PricedTool("b", 1.0), PricedTool("task", 0.0)])


def _ab_tools(runs: Runs) -> list[StructuredTool]:
    def b(x: int = 0) -> str:
        with runs._lock:
            runs["b"] += 1
        return "b"

    return [runs.tool(), StructuredTool.from_function(b, name="b", description="Tool b.")]


def _reviewed_child_under_parent(runs: Runs, saver: Any, child_msgs: list[AIMessage], parent_msgs: list[AIMessage],
                                 child: BudgetGuard) -> tuple[BudgetGuard, Any]:
    """A parent (budget 20, on ``saver``) whose task tool runs a child with a reviewer on b; the child's
    graph is a subgraph of the parent's call (its checkpoints and interrupts are the parent's)."""
    from langchain.agents.middleware import HumanInTheLoopMiddleware

    parent = BudgetGuard(AcceptAll(), MARKET_AB, 20.0)
    child_agent = create_agent(scripted(child_msgs), _ab_tools(runs), middleware=[
        HumanInTheLoopMiddleware(interrupt_on={"b": True}), child.middleware()])

    def task(description: str) -> str:
        return str(child_agent.invoke({"messages": [HumanMessage(description)]})["messages"][-1].content)

    return parent, create_agent(scripted(parent_msgs), [*_ab_tools(runs), StructuredTool.from_function(
        task, name="task", description="Delegate.")], middleware=[parent.middleware()], checkpointer=saver)


def _hitl_child_script() -> list[AIMessage]:
    return [ai(call("a", x=1)), ai(call("b", x=2)), ai(call("a", x=3)), ai(text="child done")]


@pytest.mark.parametrize("fresh", [True, False])
def test_a_child_paused_by_a_reviewer_and_resumed_pays_each_run_once(fresh):
    # The child (on the parent's checkpointer) runs a, then a reviewer pauses it on b; the whole run
    # stops at the interrupt. It is resumed, by the same guards or by new ones (another process). The
    # parent's tool call runs again and the child's ledger is in its state: its new carve takes the
    # child's earlier charges with it (the interrupted call's carve was never paid), so each of the
    # three runs (a, b, a) is paid once, and the approved b runs.
    from langgraph.types import Command

    runs, saver, config = Runs(), InMemorySaver(), {"configurable": {"thread_id": "p"}}

    def build(child_script: list[AIMessage], parent_script: list[AIMessage]) -> tuple[BudgetGuard, Any]:
        return _reviewed_child_under_parent(runs, saver, child_script, parent_script,
                                            BudgetGuard(AcceptAll(), MARKET_AB, FromParent(limit=10.0)))

    parent_script = [ai(call("task", description="go")), ai(text="parent done")]
    parent, agent = build(_hitl_child_script(), parent_script)
    assert "__interrupt__" in agent.invoke({"messages": [("user", "go")]}, config)
    if fresh:
        parent, agent = build(_hitl_child_script()[2:], parent_script[1:])
    out = agent.invoke(Command(resume={"decisions": [{"type": "approve"}]}), config)
    assert dict(runs) == {"a": 2, "b": 1}
    ledger = parent.ledger(out)
    assert ledger.spent == pytest.approx(2 * PRICE_A + 1.0) and ledger.reserved == 0


def test_a_child_with_its_own_thread_paused_in_one_call_and_resumed_from_the_next_pays_each_run_once():
    # The child has its own checkpointer and thread: paused on b in the parent's first call (the child's
    # invoke returns the interrupt; its reservation for b is held when that call's carve closes, so the
    # parent pays it there), resumed and approved from the second call. The second carve runs b on
    # the reservation already paid and charges only what is new.
    from langchain.agents.middleware import HumanInTheLoopMiddleware
    from langgraph.types import Command

    runs = Runs()
    parent = BudgetGuard(AcceptAll(), MARKET_AB, 20.0)
    child = BudgetGuard(AcceptAll(), MARKET_AB, FromParent(limit=10.0))
    child_agent = create_agent(scripted(_hitl_child_script()), _ab_tools(runs), middleware=[
        HumanInTheLoopMiddleware(interrupt_on={"b": True}), child.middleware()], checkpointer=InMemorySaver())
    own = {"configurable": {"thread_id": "own"}}

    def task(description: str) -> str:
        if child_agent.get_state(own).interrupts:
            out = child_agent.invoke(Command(resume={"decisions": [{"type": "approve"}]}), own)
        else:
            out = child_agent.invoke({"messages": [HumanMessage(description)]}, own)
        return str(out["messages"][-1].content)

    agent = create_agent(scripted([ai(call("task", description="one")), ai(call("task", description="two")),
                                   ai(text="done")]),
                         [*_ab_tools(runs), StructuredTool.from_function(task, name="task", description="Delegate.")],
                         middleware=[parent.middleware()], checkpointer=InMemorySaver())
    out = agent.invoke({"messages": [("user", "go")]}, {"configurable": {"thread_id": "p"}})
    assert dict(runs) == {"a": 2, "b": 1}
    ledger = parent.ledger(out)
    assert ledger.spent == pytest.approx(2 * PRICE_A + 1.0) and ledger.reserved == 0
    assert len(child.episodes) == 0


def test_sub_agents_running_at_the_same_time_from_one_call_each_get_their_own_episode():
    # One call starts two sub-agents at once on the inherited thread id; the short one ends while the
    # long one's tool is running. They must not share an episode (the short one's end would settle the
    # long one's ledger under it: its running call's reservation released, the commit crashing).
    runs = Runs()
    long_in_tool, short_done = asyncio.Event(), asyncio.Event()

    async def a(x: int = 0) -> str:
        long_in_tool.set()
        await short_done.wait()  # the long sub-agent's run is in flight when the short one ends
        with runs._lock:
            runs["a"] += 1
        return f"a={x}"

    def tool_a() -> StructuredTool:
        return StructuredTool.from_function(coroutine=a, name="a", description="Tool a.")

    parent = BudgetGuard(AcceptAll(), MARKET, 50.0)
    child = BudgetGuard(AcceptAll(), MARKET, FromParent(limit=20.0))

    async def fan_out(description: str) -> str:
        long = create_agent(scripted([ai(call("a", x=1)), ai(call("a", x=2)), ai(text="long done")]), [tool_a()],
                            middleware=[child.middleware()])
        short = create_agent(scripted([ai(text="short done")]), [tool_a()], middleware=[child.middleware()])

        async def short_then_signal() -> Any:
            await long_in_tool.wait()  # the long one has started its episode and is running a call
            out = await short.ainvoke({"messages": [HumanMessage(description)]})
            short_done.set()
            return out

        await asyncio.gather(long.ainvoke({"messages": [HumanMessage(description)]}), short_then_signal())
        return "both done"

    tool = StructuredTool.from_function(coroutine=fan_out, name="task", description="Fan out.")
    agent = create_agent(scripted([ai(call("task", description="go")), ai(text="done")]), [tool_a(), tool],
                         middleware=[parent.middleware()], checkpointer=InMemorySaver())
    out = asyncio.run(agent.ainvoke({"messages": [("user", "go")]}, {"configurable": {"thread_id": "p"}}))
    ledger = parent.ledger(out)
    assert runs["a"] == 2
    assert ledger.spent == pytest.approx(2 * PRICE_A) and ledger.reserved == 0
    assert len([e for e in ledger.entries() if e.kind == "sub_agent"]) == 2  # one carve each
    assert len(child.episodes) == 0


def test_a_child_with_its_own_thread_run_twice_in_one_call_is_paid_once_per_run():
    # The same call runs a long-lived child twice: the first run's carve is committed when it ends; the
    # second run's new carve must not take that run's paid charges again (it did: 9 paid for 6 run).
    runs = Runs()
    parent = BudgetGuard(AcceptAll(), MARKET, 20.0)
    child = BudgetGuard(AcceptAll(), MARKET, FromParent(limit=10.0))
    child_agent = create_agent(scripted([ai(call("a", x=1)), ai(text="first"), ai(call("a", x=2)), ai(text="second")]),
                               [runs.tool()], middleware=[child.middleware()], checkpointer=InMemorySaver())
    own = {"configurable": {"thread_id": "own"}}

    def task(description: str) -> str:
        child_agent.invoke({"messages": [HumanMessage(description)]}, own)
        return str(child_agent.invoke({"messages": [HumanMessage("and again")]}, own)["messages"][-1].content)

    agent = create_agent(scripted([ai(call("task", description="go")), ai(text="done")]),
                         [runs.tool(), StructuredTool.from_function(task, name="task", description="Delegate.")],
                         middleware=[parent.middleware()], checkpointer=InMemorySaver())
    ledger = parent.ledger(agent.invoke({"messages": [("user", "go")]}, {"configurable": {"thread_id": "p"}}))
    assert runs["a"] == 2
    assert ledger.spent == pytest.approx(2 * PRICE_A) and ledger.reserved == 0


def test_a_childs_top_up_before_a_pause_grows_the_new_carve_after_a_resume_in_another_process():
    # The child (limit 4, on_over_budget="ask") is topped up by 3 for its second a, then a reviewer
    # pauses it on b; new guards resume it. Its new carve takes its state and its top-up: the carve
    # grows in the parent by the top-up (it did not: the parent recorded an overrun and then refused
    # its own next call).
    from langgraph.types import Command

    runs, saver, config = Runs(), InMemorySaver(), {"configurable": {"thread_id": "p"}}
    child_script = [ai(call("a", x=1)), ai(call("a", x=2)), ai(call("b", x=3)), ai(text="child done")]
    parent_script = [ai(call("task", description="go")), ai(call("a", x=8)), ai(text="done")]

    def build(child_msgs: list[AIMessage], parent_msgs: list[AIMessage]) -> tuple[BudgetGuard, Any]:
        return _reviewed_child_under_parent(runs, saver, child_msgs, parent_msgs, BudgetGuard(
            AcceptAll(), MARKET_AB, FromParent(limit=4.0), on_over_budget="ask"))

    parent, agent = build(child_script, parent_script)
    out = agent.invoke({"messages": [("user", "go")]}, config)
    assert out["__interrupt__"][0].value["kind"] == "tool"  # the top-up question
    out = agent.invoke(Command(resume={"action": "top_up", "amount": 3.0, "approved_by": "h"}), config)
    assert "__interrupt__" in out  # now the reviewer, on b
    parent, agent = build(child_script[3:], parent_script[1:])  # another process
    out = agent.invoke(Command(resume={"decisions": [{"type": "approve"}]}), config)
    assert dict(runs) == {"a": 3, "b": 1}  # the child's two, and the parent's own
    ledger = parent.ledger(out)
    assert ledger.spent == pytest.approx(3 * PRICE_A + 1.0) and ledger.reserved == 0 and ledger.overrun == 0
