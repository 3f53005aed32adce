"""Whether a tool's own body has started, for an async run of it that is cancelled.

LangChain runs a tool in two layers: ``BaseTool.arun`` (callbacks, argument parsing, the answer's
ToolMessage) around the body (``_arun``; for a sync tool, ``_run`` in a worker thread of the event
loop's executor). A cancellation can land in either layer, and the guard sees only the
``CancelledError``. So, under an async agent, the guard runs a shallow copy of the tool whose body
reports to a :class:`WatchedBody`:

* cancelled before the body started (in LangChain's callbacks, or a sync tool still queued in the
  executor): the body will not run (a queued one finds the flag and stops), so nothing is charged;
* cancelled after the body finished (LangChain's callbacks were still running): charged what the body
  returned (its bill, if it reported one);
* cancelled while the body runs: an async body is cancelled with it and charged its reservation; a
  sync body's thread cannot be stopped and goes on: the run is charged its reservation now, and what
  the thread reports when it ends (a bill above that) is handed to :attr:`WatchedBody.on_late`.

The copy is made only for an async run (the sync path cannot be cancelled this way), and only of a
``BaseTool``: any other tool object runs as it is.
"""

from __future__ import annotations

import asyncio
import functools
import threading
import types
from collections.abc import Callable
from typing import Any

from langchain_core.messages import ToolMessage
from langchain_core.tools import BaseTool, StructuredTool, Tool
from langgraph.types import Command
from pydantic import BaseModel

from intent.messages import is_result_list

__all__ = ["WatchedBody", "watched"]


class WatchedBody:
    """What one run of a tool's body did, read under :attr:`lock` by the run's cancellation."""

    __slots__ = ("after", "cancelled", "finished", "in_thread", "lock", "on_late", "result", "started")

    def __init__(self, in_thread: bool) -> None:
        self.lock = threading.Lock()
        self.in_thread = in_thread  # a sync body in the executor: it outlives a cancellation
        self.started = self.finished = self.cancelled = False
        self.result: Any = None  # what the body returned, or the exception it raised
        # Called (in the body's thread, outside the lock) with the body's result when a sync body ends
        # after its run was cancelled.
        self.on_late: Callable[[Any], None] | None = None
        self.after: Callable[[], None] | None = None  # called when the body ends (watched: keeps its changes)

    def _begin(self) -> None:
        with self.lock:
            if self.cancelled:
                # Queued in the executor when its run was cancelled: it must not run (nothing was charged).
                raise asyncio.CancelledError("the tool's run was cancelled before its body started")
            self.started = True

    def _end(self, result: Any) -> None:
        if self.after is not None:
            self.after()
        with self.lock:
            self.finished, self.result = True, result
            late = self.on_late if self.cancelled else None
        if late is not None:
            late(result)

    def sync_body(self, run: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(run)
        def body(*args: Any, **kwargs: Any) -> Any:
            self._begin()
            try:
                out = run(*args, **kwargs)
            except BaseException as exc:
                self._end(exc)
                raise
            self._end(out)
            return out
        return body

    def async_body(self, arun: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(arun)
        async def body(*args: Any, **kwargs: Any) -> Any:
            self._begin()
            try:
                out = await arun(*args, **kwargs)
            except BaseException as exc:
                self._end(exc)
                raise
            self._end(out)
            return out
        return body


def _body_in_a_thread(tool: BaseTool) -> bool:
    """Whether LangChain's async run of ``tool`` runs its sync ``_run`` in the executor."""
    arun = type(tool)._arun
    if arun is BaseTool._arun:
        return True
    if isinstance(tool, (StructuredTool, Tool)) and arun in (StructuredTool._arun, Tool._arun):
        return getattr(tool, "coroutine", None) is None
    return False


def watched(tool: Any, *, sync: bool = False) -> tuple[Any, WatchedBody] | None:
    """A shallow copy of ``tool`` whose body reports to the returned :class:`WatchedBody`, or ``None``
    for an object that is not a ``BaseTool`` (it runs unwatched). ``sync``: the copy is run with
    ``invoke`` (its ``_run`` is the body), else with ``ainvoke``.

    What the run sets on the copy (a counter, a cache the tool assigns) is set on ``tool`` when the body
    ends: the copy is the tool for this one run."""
    if not isinstance(tool, BaseTool):
        return None
    in_thread = sync or _body_in_a_thread(tool)
    body = WatchedBody(in_thread)
    copy = tool.model_copy()
    for slot, value in _slot_values(tool).items():  # model_copy copies fields, private and extra attributes,
        slot.__set__(copy, value)                     # not a class's __slots__
    before = _attributes(copy)
    # An instance attribute over the class's method (pydantic leaves object.__setattr__ alone): only
    # this copy, for this run, is watched.
    if in_thread:
        object.__setattr__(copy, "_run", body.sync_body(copy._run))
    else:
        object.__setattr__(copy, "_arun", body.async_body(copy._arun))
    body.after = functools.partial(_set_back, tool, copy, before)
    return copy, body


_STORES = ("__pydantic_private__", "__pydantic_extra__")  # besides __dict__: private and extra attributes


_PYDANTIC_SLOTS = frozenset(BaseModel.__slots__)


@functools.cache
def _slots(cls: type) -> tuple[types.MemberDescriptorType, ...]:
    """The slot descriptors a tool class (or a base of it) declares with ``__slots__``, pydantic's own left out."""
    return tuple(d for klass in cls.__mro__ for name, d in vars(klass).items()
                 if isinstance(d, types.MemberDescriptorType) and name not in _PYDANTIC_SLOTS)


def _slot_values(tool: BaseTool) -> dict[types.MemberDescriptorType, Any]:
    """The values of the tool's own slots (:func:`_slots`) that are set, by slot descriptor."""
    values: dict[types.MemberDescriptorType, Any] = {}
    for slot in _slots(type(tool)):
        try:
            values[slot] = slot.__get__(tool)
        except AttributeError:
            pass  # not set
    return values


def _attributes(tool: BaseTool) -> tuple[dict[str, Any], ...]:
    """The tool's fields, private and extra attributes, and its slots, as they are now (shallow)."""
    return (dict(tool.__dict__), *(dict(getattr(tool, store, None) or {}) for store in _STORES), _slot_values(tool))


def _set_back(tool: BaseTool, copy: BaseTool, before: tuple[dict[str, Any], ...]) -> None:
    """Set on ``tool`` what its run set on ``copy``: the attributes it changed, and only those (another run
    of the same tool may have changed others meanwhile; two parallel runs that set the same attribute keep
    the value of the one that ends last)."""
    after = _attributes(copy)
    for key, value in after[0].items():
        if key not in ("_run", "_arun") and before[0].get(key, _MISSING) is not value:
            tool.__dict__[key] = value
    for store, was, now in zip(_STORES, before[1:], after[1:]):
        own = getattr(tool, store, None)
        if own is not None:
            for key, value in now.items():
                if was.get(key, _MISSING) is not value:
                    own[key] = value
    for slot, value in after[-1].items():
        if before[-1].get(slot, _MISSING) is not value:
            slot.__set__(tool, value)


_MISSING = object()


def as_message(tool: Any, output: Any, tool_call_id: str) -> Any:
    """A body's raw output as LangChain would answer with it (``BaseTool.arun`` formats it, but a
    cancelled run never gets there): a ``(content, artifact)`` pair becomes a ToolMessage with the
    artifact, where a bill is reported; a message or a Command is kept; anything else is the content."""
    if isinstance(output, BaseException):
        return output
    if (getattr(tool, "response_format", "content") == "content_and_artifact" and isinstance(output, tuple)
            and len(output) == 2):
        return ToolMessage(content=output[0], artifact=output[1], tool_call_id=tool_call_id,
                           name=getattr(tool, "name", None))
    if isinstance(output, (ToolMessage, Command)) or is_result_list(output):
        return output
    return ToolMessage(content=output if isinstance(output, (str, list)) else str(output), tool_call_id=tool_call_id,
                       name=getattr(tool, "name", None))
