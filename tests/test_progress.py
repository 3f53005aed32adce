"""Long jobs print progress: a line at least every interval with an ETA when not on a TTY."""

from __future__ import annotations

import io
import time

from eval.progress import progress


def test_plain_lines_with_eta_when_not_a_tty():
    out = io.StringIO()  # not a TTY
    with progress(4, "intent", stream=out, every_s=0.05) as p:
        p.update(2)
        time.sleep(0.2)  # several intervals pass while an item runs: lines keep coming
        p.update(2)
    lines = out.getvalue().splitlines()
    assert len(lines) >= 3
    assert lines[0].startswith("intent 2/4 (50%)") and "ETA" in lines[0] and "ETA unknown" not in lines[0]
    assert lines[-1].startswith("intent 4/4 (100%)")


def test_disabled_prints_nothing():
    out = io.StringIO()
    with progress(3, "x", enabled=False, stream=out, every_s=0.01) as p:
        p.update(3)
        time.sleep(0.05)
    assert out.getvalue() == ""
