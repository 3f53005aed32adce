"""Whether a step runs on the branch of a thread that an episode's working copy followed.

The guard keeps a working copy of a live episode's ledger in process (:mod:`intent.episodes`), ahead of
graph state when a step's writes were lost: a crash drops them, and a resume in the same process still
pays what that step spent. Time travel makes state "behind" for another reason: a replay or a fork from
an older checkpoint (``invoke(None, older_config)``, ``update_state(older_config, ...)``, a resume of an
earlier interrupt) runs on that checkpoint's ledger, and what the working copy holds beyond it was spent
on the branch it left. There "the ledger in state wins": the branch starts from its checkpoint's ledger,
as a guard in another process would.

Which of the two it is, the checkpoints tell. Each step of the episode notes the checkpoint it ran from
(:meth:`Lineage.ran`) and whether it returned (:meth:`Lineage.done`: its writes went into the checkpoint
LangGraph saves after it); a top-up written with ``update_state`` notes the checkpoint it made
(:meth:`Lineage.landed`). When state lacks what the working copy holds, the step walks up from its own
checkpoint to the nearest one noted (:func:`forked`): the working copy is on this branch unless a write
noted after that one landed (its checkpoint is not above this step), or the nearest is a step that
returned and this branch left it by a replay (``source="fork"``) or an edit (``source="update"``) instead
of its own result (``source="loop"``). A step that runs again from the checkpoint it ran from (after a
crash or an interrupt) or from a new input after a crash is the same branch: nothing is dropped.

Only the top graph's checkpoints are walked (a guarded agent run as a subgraph, and fan-out branches,
keep the working copy, as before), with a checkpointer that can be read from the step (an async-only
saver cannot be read synchronously from its event loop: the working copy is kept then).
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import Callable, Mapping
from typing import Any, Literal

__all__ = ["Lineage", "checkpoint_here", "forked", "parent_reader"]

_CHECKPOINTER = "__pregel_checkpointer"  # LangGraph's CONFIG_KEY_CHECKPOINTER (a test pins it)
MAX_MARKS = 256  # an episode's noted checkpoints kept (the oldest go: a fork further back reloads too)
MAX_HOPS = 2000  # checkpoints walked up before giving up (then the working copy is kept)

Mark = Literal["ran", "done", "landed"]


class Lineage:
    """The checkpoints an episode's steps ran from and the top-ups it wrote landed in, in order."""

    __slots__ = ("_marks",)

    def __init__(self) -> None:
        self._marks: OrderedDict[str, Mark] = OrderedDict()

    def ran(self, checkpoint_id: str) -> None:
        """A step of the episode starts from ``checkpoint_id`` (kept in its first place when it runs again)."""
        if checkpoint_id not in self._marks:
            self._marks[checkpoint_id] = "ran"
            while len(self._marks) > MAX_MARKS:
                self._marks.popitem(last=False)

    def done(self, checkpoint_id: str) -> None:
        """The step that ran from ``checkpoint_id`` returned: its writes are in the checkpoint after it."""
        if self._marks.get(checkpoint_id) == "ran":
            self._marks[checkpoint_id] = "done"

    def landed(self, checkpoint_id: str) -> None:
        """A write of the episode's (a top-up) is in ``checkpoint_id`` itself."""
        self._marks[checkpoint_id] = "landed"
        while len(self._marks) > MAX_MARKS:
            self._marks.popitem(last=False)

    def __bool__(self) -> bool:
        return bool(self._marks)

    def _written_after(self, checkpoint_id: str) -> bool:
        after = False
        for cid, mark in self._marks.items():
            if after and mark != "ran":
                return True
            after = after or cid == checkpoint_id
        return False


def forked(lineage: Lineage, here: str, parent_of: Callable[[str], tuple[str | None, str | None] | None]) -> bool:
    """Whether the step running from checkpoint ``here`` is on another branch than the one ``lineage``
    followed (see the module's doc). ``parent_of(checkpoint_id)``: ``(its source, its parent's id)``, the
    parent ``None`` for the thread's first checkpoint, or ``None`` when it cannot be read (then: not forked,
    the working copy is kept)."""
    marks = lineage._marks
    if here in marks:  # this step's own checkpoint again: a crash's or an interrupt's resume, a parallel task
        return lineage._written_after(here)
    current = here
    for _ in range(MAX_HOPS):
        read = parent_of(current)
        if read is None:
            return False
        source, parent = read
        if parent is None:  # the thread's first checkpoint: nothing the episode wrote is on this branch
            return any(mark != "ran" for mark in marks.values())
        mark = marks.get(parent)
        if mark is not None:
            if lineage._written_after(parent):
                return True
            # A step's writes land in its result (source "loop"); a replay ("fork") or an edit ("update") of the
            # checkpoint it ran from leaves them behind. (A new input after a crash, "input", does not: that
            # step never returned, its writes were lost, and the working copy still has what it spent.)
            return mark == "done" and source in ("fork", "update")
        current = parent
    return False


def checkpoint_here(config: Mapping[str, Any] | None) -> str | None:
    """The checkpoint a step of the top graph runs from, with a checkpointer; ``None`` otherwise (no
    checkpointer, outside a graph, or a step of a subgraph)."""
    configurable = (config or {}).get("configurable") or {}
    stamps = configurable.get("checkpoint_map")
    if not stamps or len(stamps) != 1 or configurable.get(_CHECKPOINTER) is None:
        return None
    here = stamps.get("")
    return str(here) if here else None


def parent_reader(config: Mapping[str, Any]) -> Callable[[str], tuple[str | None, str | None] | None]:
    """``parent_of`` for :func:`forked`, reading the step's own checkpointer (top graph, its thread)."""
    configurable = config.get("configurable") or {}
    saver, thread = configurable.get(_CHECKPOINTER), configurable.get("thread_id")

    def parent_of(checkpoint_id: str) -> tuple[str | None, str | None] | None:
        try:
            found = saver.get_tuple({"configurable": {"thread_id": thread, "checkpoint_ns": "",
                                                      "checkpoint_id": checkpoint_id}})
        except (NotImplementedError, asyncio.InvalidStateError):
            return None  # a saver with no sync reads, or an async one called from its own event loop
        if found is None:
            return None
        parent = ((found.parent_config or {}).get("configurable") or {}).get("checkpoint_id")
        return (found.metadata or {}).get("source"), (str(parent) if parent else None)

    return parent_of
