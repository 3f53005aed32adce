"""The guard's blocking work on a shared budget store, run off the event loop in the async paths.

A guard with a store (:mod:`intent.stores`) reaches it synchronously from the ledger: a round trip per
operation, and a wait while another worker holds the budget's row (PostgreSQL ``FOR UPDATE``, SQLite's write
lock) or while the store retries through a failover. Done on the event loop, that wait stalls every other
coroutine on it (every other agent one FastAPI process serves). So the async hooks run the sync steps that
may reach the store in a worker thread (the loop's default executor) when ``guard.store_outbox`` is set, and
as before, inline, when it is not (no thread, no await: nothing changes for a guard without a store).

A cancellation that lands while such a step runs in its thread does not abandon it: the step goes on (a
thread cannot be stopped, and its store operation may already be done), and the cancelled coroutine waits
for it to finish before the ``CancelledError`` goes on, so the ledger and the store both record what the
step did before anything else (a cleanup, the next run of the thread) reads them.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import logging
from collections.abc import Callable
from typing import Any, TypeVar

__all__ = ["off_loop"]

T = TypeVar("T")


async def off_loop(fn: Callable[..., T], /, *args: Any) -> T:
    """``fn(*args)`` in a worker thread, in a copy of the caller's context (LangChain's config, the guard's
    context variables); cancelled meanwhile, it still waits for ``fn`` to return (see the module)."""
    loop = asyncio.get_running_loop()
    future = loop.run_in_executor(None, functools.partial(contextvars.copy_context().run, fn, *args))
    try:
        return await asyncio.shield(future)
    except asyncio.CancelledError:
        while not future.done():
            try:
                await asyncio.wait((future,))
            except asyncio.CancelledError:
                continue  # cancelled again: still nothing to do before the step ends
        failed = future.exception()
        if failed is not None:  # (the cancellation goes on: what the step raised would be lost unsaid)
            logging.getLogger("intent").error("%s raised after its async run was cancelled", getattr(
                fn, "__qualname__", fn), exc_info=failed)
        raise
