"""What a real small LLM does to the guard (issue 16 §3): repeated identical calls, invented
tool names, and per-turn notes that must not break the server's prefix cache."""

from __future__ import annotations

from collections import Counter

import pytest
from langchain.agents import create_agent
from langchain_core.messages import AIMessage, SystemMessage, ToolMessage
from langchain_core.tools import StructuredTool

from intent import (
    AcceptAll,
    BudgetGuard,
    Decision,
    DecisionContext,
    Market,
    MemoryLogSink,
    Oracle,
    PricedTool,
    Proposal,
)
from intent.testing import ScriptedToolModel, assert_each_call_answered_once


def _tool(runs: Counter) -> StructuredTool:
    def get_stock_price(symbol: str) -> str:
        runs[symbol] += 1
        return f"{symbol}: 101.5"

    return StructuredTool.from_function(get_stock_price, description="stock price")


def _calls(n: int, symbol: str = "ACME") -> AIMessage:
    return AIMessage("", tool_calls=[{"name": "get_stock_price", "args": {"symbol": symbol}, "id": f"c{i}",
                                      "type": "tool_call"} for i in range(n)])


class Recording(ScriptedToolModel):
    seen: list = []

    def _generate(self, messages, stop=None, run_manager=None, **kw):  # noqa: ANN001
        self.seen.append(list(messages))
        return super()._generate(messages, stop, run_manager, **kw)


class Counting(Oracle):
    def __init__(self) -> None:
        self.decisions = 0

    def decide(self, ctx: DecisionContext) -> Decision:
        self.decisions += 1
        return Decision.accepted()

    def prompt_notes(self, market, episode_id, spent, remaining, budget):  # noqa: ANN001
        return f"Budget: spent {spent:g}, {remaining:g} left."


def _run(guard: BudgetGuard, script: list[AIMessage], runs: Counter) -> tuple[dict, Recording]:
    model = Recording(messages=iter(script), seen=[])
    agent = create_agent(model, [_tool(runs)], middleware=[guard.middleware()], system_prompt="You are helpful.")
    return agent.invoke({"messages": [("user", "price of ACME")]}), model


def test_identical_calls_in_one_message_run_once_and_are_charged_once():
    runs: Counter = Counter()
    sink = MemoryLogSink()
    oracle = Counting()
    guard = BudgetGuard(oracle, Market([PricedTool("get_stock_price", 7.0)]), 50.0, log_sink=sink)
    out, _ = _run(guard, [_calls(5), AIMessage("ACME is 101.5")], runs)
    assert runs == {"ACME": 1}
    assert guard.ledger(out).spent == 7.0 and guard.ledger(out).reserved == 0
    assert oracle.decisions == 1  # the oracle judges the call once
    ai = next(m for m in out["messages"] if isinstance(m, AIMessage) and m.tool_calls)
    assert [c["id"] for c in ai.tool_calls] == ["c0"]
    assert ai.additional_kwargs["intent_merged_calls"] == {"c1": "c0", "c2": "c0", "c3": "c0", "c4": "c0"}
    assert_each_call_answered_once(out["messages"])
    assert sorted(r.call_id for r in sink.records if r.reason == "duplicate_call") == ["c1", "c2", "c3", "c4"]


def test_merging_can_be_switched_off_and_different_arguments_are_never_merged():
    runs: Counter = Counter()
    guard = BudgetGuard(AcceptAll(), Market([PricedTool("get_stock_price", 7.0)]), 50.0, merge_identical_calls=False)
    out, _ = _run(guard, [_calls(5), AIMessage("done")], runs)
    assert runs == {"ACME": 5} and guard.ledger(out).spent == 35.0  # what the guard charged before
    runs.clear()
    guard = BudgetGuard(AcceptAll(), Market([PricedTool("get_stock_price", 7.0)]), 50.0)
    two = AIMessage("", tool_calls=[{"name": "get_stock_price", "args": {"symbol": s}, "id": f"x{s}",
                                     "type": "tool_call"} for s in ("A", "B")])
    out, _ = _run(guard, [two, AIMessage("done")], runs)
    assert runs == {"A": 1, "B": 1} and guard.ledger(out).spent == 14.0


def test_an_invented_tool_name_gets_the_list_of_real_tools():
    runs: Counter = Counter()
    guard = BudgetGuard(AcceptAll(), Market([PricedTool("get_stock_price", 7.0)]), 50.0)
    bad = AIMessage("", tool_calls=[{"name": "get_stock_prices_now", "args": {"symbol": "A"}, "id": "z",
                                     "type": "tool_call"}])
    out, _ = _run(guard, [bad, AIMessage("done")], runs)
    answer = next(m for m in out["messages"] if isinstance(m, ToolMessage))
    assert "no tool named get_stock_prices_now" in answer.content
    assert "The available tools are: get_stock_price." in answer.content
    assert "PricedTool" not in answer.content  # developer advice is not for the agent


@pytest.mark.parametrize("notes_at", ["end", "system"])
def test_per_turn_notes_after_the_conversation_keep_the_prefix_stable(notes_at):
    runs: Counter = Counter()
    guard = BudgetGuard(Counting(), Market([PricedTool("get_stock_price", 7.0)]), 50.0, notes_at=notes_at)
    out, model = _run(guard, [_calls(1), _calls(1, "B"), AIMessage("done")], runs)
    first, second = model.seen[0], model.seen[1]
    if notes_at == "end":
        # The system prompt is the same on every turn; the changing notes come last.
        assert first[0] == second[0] and first[0].content == "You are helpful."
        assert isinstance(second[-1], SystemMessage) and second[-1].content == "Budget: spent 7, 43 left."
        # The prefix of turn 2 starts with all of turn 1 except its trailing notes.
        assert second[: len(first) - 1] == first[:-1]
        assert not any(isinstance(m, SystemMessage) and "Budget" in str(m.content) for m in out["messages"])
    else:
        assert "Budget: spent 0, 50 left." in first[0].content and "spent 7" in second[0].content


class RejectsWithAPlan(Oracle):
    """Rejects every call with a long plan, as INTENT does (a head and one line per planned step)."""

    def decide(self, ctx: DecisionContext) -> Decision:
        plan = "\n".join(f"{i} | tool_{i} | 5 | 0.50 | 10" for i in range(60))
        return Decision.rejected(f"Budget check failed: {ctx.tool}({ctx.args['symbol']}) not executed.\n"
                                 f"Remaining budget: 50.\nPredicted tool trace:\n{plan}", reason="plan_over_budget")


def _symbols(n: int, turn: int) -> AIMessage:
    return AIMessage("", tool_calls=[{"name": "get_stock_price", "args": {"symbol": f"S{turn}{i}"},
                                      "id": f"t{turn}c{i}", "type": "tool_call"} for i in range(n)])


def test_feedback_chars_caps_a_turns_refusal_notes_and_shortens_earlier_turns_in_the_request():
    # bench-llm: INTENT rejected 14 of a 0.5B model's calls in one turn with its plan (15,448
    # characters shown to the agent), and the episode then overflowed the 8,192-token context.
    runs: Counter = Counter()
    guard = BudgetGuard(RejectsWithAPlan(), Market([PricedTool("get_stock_price", 7.0)]), 50.0, feedback_chars=1500)
    full = RejectsWithAPlan().decide(DecisionContext(  # what the oracle says about the first call
        "e", "q", Proposal("x", "get_stock_price", {"symbol": "S00"}, ""), 7.0, 50.0, 0.0, 50.0,
        guard.market, step=0)).feedback
    assert len(full) > 1500
    out, model = _run(guard, [_symbols(6, 0), _symbols(2, 1), AIMessage("done")], runs)
    assert not runs and guard.ledger(out).spent == 0
    assert_each_call_answered_once(out["messages"])
    turn0 = [m for m in out["messages"] if isinstance(m, ToolMessage) and m.tool_call_id.startswith("t0")]
    assert len(turn0) == 6
    # The turn's first note is cut to the cap at a line boundary; the others keep their first lines.
    assert turn0[0].content.startswith(full.splitlines()[0]) and len(turn0[0].content) <= 1500
    assert all(len(m.content) < 320 and "Budget check failed" in m.content for m in turn0[1:])
    assert sum(len(m.content) for m in turn0) < 1500 + 5 * 320
    # The second model call sees turn 0's notes as they are; the third sees them shortened.
    def notes(request: list, prefix: str) -> list[str]:
        return [m.content for m in request if isinstance(m, ToolMessage) and m.tool_call_id.startswith(prefix)]
    assert notes(model.seen[1], "t0") == [m.content for m in turn0]
    older = notes(model.seen[2], "t0")
    assert "an earlier refusal" in older[0] and older[0].startswith("Budget check failed")
    assert all(len(c) < 320 for c in older)
    assert notes(model.seen[2], "t1") == [m.content for m in out["messages"]
                                          if isinstance(m, ToolMessage) and m.tool_call_id.startswith("t1")]


def test_without_feedback_chars_every_note_is_whole():
    runs: Counter = Counter()
    guard = BudgetGuard(RejectsWithAPlan(), Market([PricedTool("get_stock_price", 7.0)]), 50.0)
    out, model = _run(guard, [_symbols(3, 0), _symbols(1, 1), AIMessage("done")], runs)
    assert all(len(m.content) > 1500 for m in out["messages"] if isinstance(m, ToolMessage))
    assert all(len(m.content) > 1500 for m in model.seen[2] if isinstance(m, ToolMessage))


@pytest.mark.parametrize("bad", [10, 0, True, 2.5, "1500"])
def test_feedback_chars_must_leave_room_for_a_short_note(bad):
    from intent import GuardConfigError

    with pytest.raises(GuardConfigError, match="feedback_chars"):
        BudgetGuard(AcceptAll(), Market([PricedTool("get_stock_price", 7.0)]), 50.0, feedback_chars=bad)
