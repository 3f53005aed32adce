"""Model runs of streams their readers dropped before the end, charged at the next safe point.

A sync ``stream_events(version="v3")`` stream of a metered model has no close: dropped before its last event, its
run stays open (:func:`intent.metered_models._settled_when_dropped`). The garbage collector's finalizer queues such
runs here, and the next metered run or guard hook charges them. Not in the finalizer itself: the collector runs it
in whatever the collecting thread was doing, which may hold a lock the charge needs (a deadlock).
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Iterable
from typing import Any

__all__ = ["queue", "settle"]

# (handler, run id, meter): a MeteredModelCallback, one of its runs, and that run's execution (a run id given again
# later is another execution, left alone). A deque: its append and popleft need no lock.
_DROPPED: collections.deque[tuple[Any, Any, Any]] = collections.deque()


def queue(runs: Iterable[tuple[Any, Any, Any]]) -> None:
    """Note the runs of a dropped stream (from a finalizer: takes no lock)."""
    _DROPPED.extend(runs)


def settle() -> None:
    """Charge each queued run still open as a cancelled one (its reserved worst case); a run that ended is
    not open any more, and nothing happens for it.

    On an event loop (the hook of a guard without a store, whose async steps stay on the loop), a run of a guard
    that reaches a store stays queued: its charge would wait on the store there. That guard's own hooks and
    metered runs settle off the loop (intent.off_loop), and charge it."""
    try:
        asyncio.get_running_loop()
        on_loop = True
    except RuntimeError:
        on_loop = False
    kept: list[tuple[Any, Any, Any]] = []
    try:
        while _DROPPED:
            try:
                handler, run_id, meter = entry = _DROPPED.popleft()
            except IndexError:  # (another thread took the last one)
                break
            if on_loop and handler.guard.reaches_store():
                kept.append(entry)
                continue
            handler._cancelled(run_id, write=False, meter=meter)
    finally:
        _DROPPED.extend(kept)
