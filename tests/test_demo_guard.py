"""`make demo-guard` (`intent demo`): the walk-through runs to its end and shows what it promises."""

from __future__ import annotations

import io

from rich.console import Console

from intent.demo import run_demo


def test_the_guard_demo_runs_to_the_end_and_charges_the_failed_call():
    console = Console(file=io.StringIO(), width=130)
    out = run_demo(console=console)
    shown = console.file.getvalue()
    by_call = {r.call_id: r for r in out["records"]}
    assert by_call["c1"].decision == "reject" and by_call["c1"].reason == "cheaper_alternative"
    assert by_call["c4"].status == "error" and by_call["c4"].charged == 5  # the flaky tool failed, still paid
    assert out["spent"] == sum(r.charged for r in out["records"]) <= 50
    assert "Final answer: Oslo: rain." in shown
