"""The shortcuts the tool-call hot path takes (eval/bench_guard.py measures it) keep the slow path's meaning."""

from __future__ import annotations

import dataclasses

import pytest
from langgraph.prebuilt.tool_node import ToolCallRequest

from intent.ledger import BudgetLedger
from intent.metering import _copy_with
from intent.nesting import current_parent, spending_scope


def test_a_request_copied_with_a_new_tool_leaves_the_original_alone():
    call = {"name": "a", "args": {}, "id": "c1", "type": "tool_call"}
    request = ToolCallRequest(tool_call=call, tool=None, state={"messages": []}, runtime=None)
    copy = _copy_with(request, tool="metered")
    assert copy is not request and copy.tool == "metered" and request.tool is None
    assert copy.tool_call is call and copy.state is request.state and type(copy) is ToolCallRequest
    with pytest.raises(TypeError):  # a field the class does not have: as dataclasses.replace says
        _copy_with(request, nonsense=1)


def test_a_dataclass_with_post_init_is_copied_through_its_init():
    @dataclasses.dataclass
    class Checked:
        value: int
        doubled: int = 0

        def __post_init__(self) -> None:
            self.doubled = 2 * self.value

    assert _copy_with(Checked(1), value=5).doubled == 10


def test_a_new_run_number_moves_no_totals_and_a_commit_does():
    ledger = BudgetLedger(10.0)
    ledger.reserve("k", "a", 3.0)
    ledger.mark_run("k", 1)
    assert (ledger.reserved, ledger.spent, ledger.remaining) == (3.0, 0.0, 7.0)
    assert [e.call_id for e in ledger.held()] == ["k"] and ledger.get("k").execution == 1
    ledger.commit("k")  # the same amount, another status: the totals move
    assert (ledger.reserved, ledger.spent, ledger.remaining, ledger.held()) == (0.0, 3.0, 7.0, [])


def test_a_spending_scope_names_the_parent_call_only_inside():
    assert current_parent() is None
    with spending_scope("guard", "episode", "key") as parent:  # type: ignore[arg-type]
        assert current_parent() is parent and parent.key == "key"
    assert current_parent() is None


def test_what_state_lacks_is_told_the_same_with_or_without_the_serialised_entries_it_shares():
    # At each model step the guard asks what graph state lacks of its ledger (and the reverse). While
    # state holds the very dicts the ledger wrote, one comparison answers; any difference (a later
    # status, a field changed since, an entry state never got, a copy made by a checkpointer) must give
    # the same answer as comparing entry by entry.
    ledger = BudgetLedger(10.0)
    first = ledger.reserve("k1", "a", 3.0)
    written = {"k1": ledger.serialized(first)}
    assert ledger.serialized(first) is written["k1"], "the same dict while the entry is unchanged"
    assert ledger.unseen_in(written) == {} and not ledger.behind(written)
    assert not ledger.ahead_of({"entries": written})
    copied = {"k1": dict(written["k1"])}  # as read back from a checkpoint
    assert ledger.unseen_in(copied) == {} and not ledger.behind(copied)

    ledger.mark_run("k1", 1)  # a field moves, the status does not: nothing for state to learn
    assert ledger.unseen_in(written) == {} and not ledger.behind(written)
    ledger.commit("k1")
    ledger.reserve("k2", "b", 2.0)
    unseen = ledger.unseen_in(written)
    assert set(unseen) == {"k1", "k2"} and unseen["k1"]["status"] == "committed"
    assert ledger.ahead_of({"entries": written}) and not ledger.behind(written)
    assert unseen["k1"] is ledger.serialized(ledger.get("k1")), "state is given the dict later compared"
    assert ledger.unseen_in(unseen) == {} and not ledger.ahead_of({"entries": unseen})

    # State ahead of this ledger (another process committed k2, and made k3): behind, whatever is shared.
    further = {**unseen, "k2": {**unseen["k2"], "status": "committed"}}
    assert ledger.behind(further) and ledger.behind({**unseen, "k3": {**unseen["k2"], "call_id": "k3"}})
    assert not ledger.behind({"k1": unseen["k1"]}), "state lacking an entry is not ahead of the ledger"
    assert set(ledger.unseen_in({"k1": unseen["k1"]})) == {"k2"}


def test_a_frozen_dataclass_made_the_cheap_way_is_the_one_its_constructor_makes():
    from intent._build import builder
    from intent.ledger import LedgerEntry
    from intent.oracle import Decision

    build = builder(LedgerEntry)
    made, expected = build("k", "a", 1.5, "reserved", 3, kind="model"), LedgerEntry("k", "a", 1.5, "reserved", 3, kind="model")
    assert build is not LedgerEntry and type(made) is LedgerEntry
    assert made == expected and hash(made) == hash(expected) and repr(made) == repr(expected)
    assert dataclasses.replace(made, amount=2.0) == dataclasses.replace(expected, amount=2.0)
    with pytest.raises(dataclasses.FrozenInstanceError):
        made.amount = 2.0  # type: ignore[misc]
    with pytest.raises(TypeError):  # a field the class does not have, or one missing: as the constructor says
        build("k", "a", 1.5, "reserved", 3, nonsense=1)
    with pytest.raises(TypeError):
        build("k")
    # A default_factory gives each instance its own value, and accepted() still makes a Decision
    one, two = builder(Decision)(True), builder(Decision)(True)
    assert one == Decision(True) and one.usage is not two.usage
    assert Decision.accepted(tokens=3.0) == Decision(True, usage={"tokens": 3.0})

    @dataclasses.dataclass(frozen=True, slots=True)
    class Checked:
        value: int

        def __post_init__(self) -> None:
            if self.value < 0:
                raise ValueError("negative")

    assert builder(Checked) is Checked  # its __post_init__ would be skipped: the class itself


def test_the_ledger_channel_applies_a_write_as_its_reducer_does_also_when_it_takes_the_last_result_again():
    from langgraph.channels.binop import BinaryOperatorAggregate
    from langgraph.types import Overwrite

    from intent.ledger import merge_ledger_states
    from intent.state import LedgerAggregate, LedgerChannel

    channel = LedgerAggregate(LedgerChannel | None)
    assert channel == BinaryOperatorAggregate(LedgerChannel | None, merge_ledger_states)  # LangGraph: the same channel
    assert not channel.is_available() and not channel.copy().is_available()
    first = {"episode_id": "e", "budget": 5.0, "entries": {}}
    entry = {"call_id": "m:c", "tool": "a", "amount": 1.0, "status": "reserved", "seq": 0, "market_version": 0,
             "tool_call_id": "c", "execution": 0, "overrun": 0.0}
    write = {"episode_id": "e", "entries": {"m:c": entry}, "decisions": {"m:c": {"accept": True}}}
    channel.update([first])
    beside = channel.copy()  # a parallel branch's fresh read, of the same value
    fresh = channel.copy()  # a conditional edge's fresh read, then the step's end: the same write twice
    assert fresh.update([write]) and channel.update([write])
    assert channel.get() is fresh.get() and channel.get() == merge_ledger_states(first, write)
    # Another write object, or the same one on another value, is merged afresh
    committed = {"entries": {"m:c": {**entry, "status": "committed"}}}
    beside.update([committed])
    assert beside.get() == merge_ledger_states(first, committed)
    again = channel.copy()
    again.update([committed])
    assert again.get() == merge_ledger_states(merge_ledger_states(first, write), committed)
    other = LedgerAggregate(LedgerChannel | None)
    other.update([{"episode_id": "f", "budget": 1.0}])
    other._last = channel._last  # even sharing what it remembers
    other.update([committed])
    assert other.get() == merge_ledger_states({"episode_id": "f", "budget": 1.0}, committed)
    channel.update([Overwrite({"episode_id": "g"})])
    assert channel.get() == {"episode_id": "g"}
    assert channel.update([]) is False and channel.get() == {"episode_id": "g"}
