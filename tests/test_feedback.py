"""intent.feedback.without_result_note: the one place that takes a method's budget note off a tool result."""

from baselines.bats import tracker_block
from intent.feedback import budget_status, without_result_note


def test_the_notes_methods_append_are_taken_off_and_nothing_else():
    result = '{"rate": 1.08, "note": "[Budget status] is not a note inside the line"}'
    assert without_result_note(f"{result}\n{budget_status(10, 40, 50)}") == result
    assert without_result_note(f"{result}\n{tracker_block(10, 40)}") == result
    assert without_result_note(result) == result  # a mark inside the tool's own line stays
    assert without_result_note("") == ""
