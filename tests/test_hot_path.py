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
