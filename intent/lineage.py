"""Whether a step runs on the branch of a thread that an episode's working copy followed.

The guard keeps a working copy of a live episode's ledger in process (:mod:`intent.episodes`), ahead of
graph state when a step's writes were lost: a crash drops them (a tool that raised out of the graph, a
sibling call's crash, a middleware raising after the guard), and a resume in the same process still
pays what that step spent. Time travel makes state "behind" for another reason: a replay or a fork of an
older checkpoint (``invoke(None, older_config)``, ``update_state(older_config, ...)``, a resume of an
earlier interrupt) runs on that checkpoint's ledger, and what the working copy holds beyond it was spent
on the branch it left. There "the ledger in state wins": the branch starts from its checkpoint's ledger,
as a guard in another process would.

Which of the two it is, the checkpoints tell. Each step of the episode notes the checkpoint it ran from
(:meth:`Lineage.ran`); a top-up written with ``update_state`` notes the checkpoint it made
(:meth:`Lineage.landed`). When state lacks what the working copy holds, the step walks up from its own
checkpoint to the nearest one a step ran from (:func:`forked`; top-ups' checkpoints are walked through). The
working copy belongs to another branch only on
evidence: a step ran from that checkpoint, its result was saved (a child with ``source="loop"``), and
this branch left it another way (a replay, ``"fork"``; an edit, ``"update"``), or went on through its
result while the episode noted something after it elsewhere. A step whose result was never saved (it
crashed, or was interrupted) is this branch's whatever way the thread goes on from it (a resume,
``update_state`` on it, a new message, a replay of it): the working copy is kept, and with it whatever
the thread ran elsewhere since (never less than was spent). Whatever cannot be
read (a checkpoint not saved yet: ``durability="exit"``, an async saver that is still writing on the
event loop the step runs on) keeps the working copy too: the guard never forgets a charge on a guess.

Only the top graph's checkpoints are walked: a guarded agent run as a subgraph, and fan-out branches,
keep the working copy, as before.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

from intent.ledger import merge_ledger_states

__all__ = ["Lineage", "Reader", "checkpoint_here", "forked", "new_input"]

_CHECKPOINTER = "__pregel_checkpointer"  # LangGraph's CONFIG_KEY_CHECKPOINTER (a test pins it)
_DURABILITY = "__pregel_durability"  # LangGraph's CONFIG_KEY_DURABILITY
MAX_MARKS = 256  # an episode's noted checkpoints kept (the oldest go)
MAX_HOPS = 2000  # checkpoints walked up, or listed, before giving up (then the working copy is kept)
SAVE_WAIT_S = 2.0  # how long a step waits for its own checkpoint's background save (durability="async")

_RAN, _LANDED = 1, 2


class Lineage:
    """The checkpoints an episode's steps ran from and its top-ups landed in, in the order first noted."""

    __slots__ = ("_marks",)

    def __init__(self) -> None:
        self._marks: OrderedDict[str, int] = OrderedDict()

    def _note(self, checkpoint_id: str, flag: int) -> None:
        self._marks[checkpoint_id] = self._marks.get(checkpoint_id, 0) | flag
        while len(self._marks) > MAX_MARKS:
            self._marks.popitem(last=False)

    def ran(self, checkpoint_id: str) -> None:
        """A step of the episode runs from ``checkpoint_id``."""
        if self._marks.get(checkpoint_id, 0) & _RAN == 0:
            self._note(checkpoint_id, _RAN)

    def landed(self, checkpoint_id: str) -> None:
        """A write of the episode's (a top-up) is in ``checkpoint_id`` itself."""
        self._note(checkpoint_id, _LANDED)

    def __bool__(self) -> bool:
        return bool(self._marks)

    def _noted_after(self, checkpoint_id: str, on_path: set[str]) -> bool:
        """Whether anything off ``on_path`` was noted after ``checkpoint_id`` (the asking step's own checkpoint,
        which a parallel task of the step may have noted meanwhile, is on it: no evidence of another branch)."""
        after = False
        for cid in self._marks:
            if after and cid not in on_path:
                return True
            after = after or cid == checkpoint_id
        return False


class Reader:
    """Reads the top graph's checkpoints of a step's thread from the step's own checkpointer."""

    def __init__(self, config: Mapping[str, Any]) -> None:
        configurable = config.get("configurable") or {}
        self.saver = configurable.get(_CHECKPOINTER)
        self.thread = configurable.get("thread_id")
        self.durability = configurable.get(_DURABILITY)

    def _config(self, checkpoint_id: str | None = None) -> dict[str, Any]:
        configurable: dict[str, Any] = {"thread_id": self.thread, "checkpoint_ns": ""}
        if checkpoint_id is not None:
            configurable["checkpoint_id"] = checkpoint_id
        return {"configurable": configurable}

    def _tuple(self, checkpoint_id: str, wait: bool = False) -> Any:
        try:
            found = self.saver.get_tuple(self._config(checkpoint_id))
            if found is None and wait and self.durability != "exit" and not _on_running_loop():
                # The step's own checkpoint, saved in the background (durability="async"): wait for it.
                deadline = time.monotonic() + SAVE_WAIT_S
                while found is None and time.monotonic() < deadline:
                    time.sleep(0.002)
                    found = self.saver.get_tuple(self._config(checkpoint_id))
            return found
        except (NotImplementedError, asyncio.InvalidStateError):
            return None  # a saver with no sync reads, or an async one called from its own event loop

    def pending_writes(self, checkpoint_id: str) -> list[tuple[str, str, Any]]:
        """The writes saved against ``checkpoint_id`` by tasks of its step that finished (``(task id,
        channel, value)``): a resumed step's siblings; ``[]`` when none, or when they cannot be read."""
        found = self._tuple(checkpoint_id)
        return list(getattr(found, "pending_writes", None) or []) if found is not None else []

    def latest_ledger(self, namespace: str, channel: str) -> Any:
        """The guard's ledger ``channel`` in the latest checkpoint of the thread's ``namespace`` (a call's
        sub-agent's), with the pending writes its finished tasks saved merged in; ``None`` when there is
        none or it cannot be read."""
        try:
            found = self.saver.get_tuple({"configurable": {"thread_id": self.thread, "checkpoint_ns": namespace}})
        except (NotImplementedError, asyncio.InvalidStateError):
            return None
        if found is None:
            return None
        value = (found.checkpoint.get("channel_values") or {}).get(channel)
        for _task, written, update in found.pending_writes or ():
            if written == channel and isinstance(update, Mapping):
                value = merge_ledger_states(value, update)
        return value

    def parent(self, checkpoint_id: str, *, wait: bool = False) -> tuple[str | None, str | None] | None:
        """``(the checkpoint's source, its parent's id)``, the parent ``None`` for the thread's first
        checkpoint; ``None`` when it cannot be read."""
        found = self._tuple(checkpoint_id, wait)
        if found is None:
            return None
        parent = ((found.parent_config or {}).get("configurable") or {}).get("checkpoint_id")
        return (found.metadata or {}).get("source"), (str(parent) if parent else None)

    def result_saved(self, checkpoint_id: str) -> bool | None:
        """Whether the step run from ``checkpoint_id`` has its result saved (a child with ``source="loop"``);
        ``None`` when that cannot be read."""
        try:
            for n, found in enumerate(self.saver.list(self._config())):  # newest first
                cid = (found.config.get("configurable") or {}).get("checkpoint_id")
                if cid == checkpoint_id or n >= MAX_HOPS:
                    return False if cid == checkpoint_id else None  # older ones are not its children
                parent = ((found.parent_config or {}).get("configurable") or {}).get("checkpoint_id")
                if parent == checkpoint_id and (found.metadata or {}).get("source") == "loop":
                    return True
        except (NotImplementedError, asyncio.InvalidStateError):
            return None
        return False


def _on_running_loop() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


def forked(lineage: Lineage, here: str, reader: Reader) -> bool:
    """Whether the step running from checkpoint ``here`` is on another branch than the one ``lineage``
    followed (see the module's doc): only on evidence; anything unreadable says no. The nearest checkpoint a
    step of the episode ran from decides; top-ups' checkpoints on the way are walked through (a top-up's own
    state holds only what state held when it was written, not what a crashed step spent)."""
    marks = lineage._marks
    if not marks:
        return False
    on_path = {here}
    nearest, via = here, None  # the nearest checkpoint a step ran from, and the source of its child here
    if not marks.get(here, 0) & _RAN:
        current = here
        for hop in range(MAX_HOPS):
            read = reader.parent(current, wait=hop == 0)
            if read is None:
                return False
            source, parent = read
            if parent is None:  # the thread's first checkpoint: no step of the episode ran on this branch
                return True
            on_path.add(parent)
            if marks.get(parent, 0) & _RAN:
                nearest, via = parent, source
                break
            current = parent
        else:
            return False
    if nearest != here and via != "loop":
        # This branch did not go on through that step's result. If the result was never saved (the step
        # crashed, or was interrupted), what it spent belongs here too (a replay runs it again): the working
        # copy is kept, even if the thread went on elsewhere since (then this branch is also charged what the
        # other one ran: never less than was spent). If it was saved, what the step wrote is elsewhere.
        return bool(reader.result_saved(nearest))
    if nearest == here:
        # This step's own checkpoint again (a crash's or an interrupt's resume, a parallel task): another
        # branch only if the episode went on past it elsewhere and the step's result was saved.
        return lineage._noted_after(nearest, on_path) and bool(reader.result_saved(nearest))
    return lineage._noted_after(nearest, on_path)  # went on through its result, and the episode went on elsewhere


def new_input(lineage: Lineage, here: str, reader: Reader, hops: int = 32) -> bool:
    """Whether a user's new input (a checkpoint with ``source="input"``) lies between the checkpoint ``here``
    and the nearest one the episode's steps ran from (looked for within ``hops``: LangGraph makes the
    input's checkpoint a step before the agent's first node, and each ``before_agent`` / ``before_model``
    hook is a step of its own)."""
    current = here  # (noted already by the step asking, or by its crashed first attempt: looked above)
    for hop in range(hops):
        if current != here and current in lineage._marks:
            return False  # a step of the episode ran here: no new input after it
        read = reader.parent(current, wait=hop == 0)
        if read is None:
            return False
        source, parent = read
        if source == "input":
            return True
        if parent is None:
            return False
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
