"""Long jobs print progress: a line at least every interval with an ETA when not on a TTY."""

from __future__ import annotations

import io
import time

from eval.progress import progress


def test_plain_lines_with_eta_when_not_a_tty():
    out = io.StringIO()  # not a TTY
    with progress(4, "intent", stream=out, every_s=0.05) as p:
        p.update(2)
        # An item runs while intervals pass: lines keep coming (two ticker lines waited for, not a fixed time: a
        # loaded machine may run the ticker late).
        deadline = time.monotonic() + 30
        while len(out.getvalue().splitlines()) < 2:
            assert time.monotonic() < deadline, "no progress line while an item ran"
            time.sleep(0.01)
        p.update(2)
    lines = out.getvalue().splitlines()
    assert len(lines) >= 3
    # (A ticker line may come before the first update on a loaded machine: it has no ETA yet.)
    before = [line for line in lines if line.startswith("intent 0/4 (0%)")]
    assert all("ETA unknown" in line for line in before)
    half = lines[len(before)]
    assert half.startswith("intent 2/4 (50%)") and "ETA" in half and "ETA unknown" not in half
    assert lines[-1].startswith("intent 4/4 (100%)")


def test_disabled_prints_nothing():
    out = io.StringIO()
    with progress(3, "x", enabled=False, stream=out, every_s=0.01) as p:
        p.update(3)
        time.sleep(0.05)
    assert out.getvalue() == ""
