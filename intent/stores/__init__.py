"""Budgets shared across runs, processes and machines.

A :class:`BudgetStore` holds budgets by **key** (``customer-42/2026-11-23``) and the charges
made against them, with the ledger's three steps done atomically in the store:

``reserve(key, charge_id, amount)``
    holds ``amount`` only if ``spent + reserved + amount <= budget`` (else
    :class:`~intent.ledger.BudgetExceededError`); idempotent by charge id; the hold is a
    **lease** that expires ``lease_seconds`` later if nobody commits or releases it (a process
    killed mid-call), and is then released with a record (``status="expired"``);
``commit(key, charge_id, amount=None)``
    turns the hold into a charge, at what was billed; a commit that arrives after its lease
    expired is still charged (the money was spent) and flagged ``late``;
``release(key, charge_id)``
    gives the hold back;
``rekey(key, old_id, new_id, amount)``
    a run starting on a reservation: moves a hold still held to ``new_id`` atomically, or reserves
    ``new_id`` afresh when ``old_id`` is no longer held (its run committed it in a process that then
    died), so every run is its own charge (optional for a store of your own: without it the guard
    releases and reserves);
``renew(key, charge_id)``
    extends a held lease (the guard renews it while the call runs: :class:`LeaseKeeper`).

Money is stored as integer nano-units, so ``spent`` is exactly the sum of the committed
charges. Stores:

* :class:`MemoryBudgetStore`: one process (an in-memory SQLite database: the same code as the
  file store); without any store the per-episode ledger works alone, as before;
* :class:`SqliteBudgetStore`: several processes on one machine (WAL mode, ``BEGIN IMMEDIATE``
  per operation);
* :class:`PostgresBudgetStore`: several machines (one transaction per operation, the budget
  row locked with ``SELECT ... FOR UPDATE``, charges idempotent by ``(key, charge_id)``).

**A store of your own** (Redis, DynamoDB, a ledger service) implements :class:`BudgetStore`; the conformance suite
:func:`intent.stores.conformance.check_budget_store` checks it keeps these guarantees.

**Keys and periods.** A key is any string; :func:`period_key` builds the documented scheme
``<scope>/<period>``: ``period_key("customer-42", "day")`` is ``customer-42/2026-11-23``,
``"month"`` gives ``customer-42/2026-11``. A new period is a new key (create it with its
amount); nothing is ever reset in place, so past periods stay readable.
"""

from __future__ import annotations

import atexit
import datetime as _dt
import logging
import os
import weakref
from typing import Any, Literal, Protocol, runtime_checkable

from intent.stores.base import (
    KeptCommitRefusedError,
    StoreArgumentError,
    StoreCharge,
    StoreError,
    StoreUnavailableError,
)

__all__ = [
    "BudgetStore",
    "CommitOutbox",
    "KeptCommitRefusedError",
    "LeaseKeeper",
    "MemoryBudgetStore",
    "PostgresBudgetStore",
    "SqliteBudgetStore",
    "StoreCharge",
    "StoreArgumentError",
    "StoreError",
    "StoreUnavailableError",
    "open_store",
    "period_key",
]


def period_key(scope: str, period: Literal["day", "month"] = "day", *, now: _dt.datetime | None = None) -> str:
    """``<scope>/<YYYY-MM-DD>`` or ``<scope>/<YYYY-MM>`` (UTC): a new period is a new key."""
    if not scope or "/" in scope:
        raise StoreArgumentError(f"scope {scope!r} must be a non-empty string without '/'")
    now = now or _dt.datetime.now(_dt.timezone.utc)
    if period == "day":
        return f"{scope}/{now:%Y-%m-%d}"
    if period == "month":
        return f"{scope}/{now:%Y-%m}"
    raise StoreArgumentError(f"period must be 'day' or 'month', got {period!r}")


@runtime_checkable
class BudgetStore(Protocol):
    """What the guard needs from a shared budget (every method atomic). A store of your own: run
    :func:`intent.conformance.check_budget_store` in its tests (:mod:`intent.stores.conformance`)."""

    lease_seconds: float

    def create_budget(self, key: str, amount: float) -> None: ...  # (the shipped stores: currency=None too)
    def budget(self, key: str) -> float: ...
    def spent(self, key: str) -> float: ...
    def reserved(self, key: str) -> float: ...
    def left(self, key: str) -> float: ...
    def renew(self, key: str, charge_id: str) -> bool: ...
    # reserve: refused (BudgetExceededError) when it does not fit; a hold of 0 always fits.
    def reserve(self, key: str, charge_id: str, amount: float, *, run_id: str = "", tool: str = "",
                kind: str = "tool") -> StoreCharge: ...
    def commit(self, key: str, charge_id: str, amount: float | None = None) -> StoreCharge: ...
    def release(self, key: str, charge_id: str) -> StoreCharge | None: ...
    # Optional: rekey(key, old_id, new_id, amount, *, run_id="", tool="", kind="tool") -> StoreCharge
    # Optional: currency(key) -> str | None (the guard refuses a budget kept in another currency than its own)
    # Optional: prune(older_than_seconds, key=None) -> int (settled history deleted: `intent store prune`)
    def expire_leases(self, key: str | None = None) -> list[StoreCharge]: ...
    def charges(self, key: str) -> list[StoreCharge]: ...


class LeaseKeeper:
    """Renews a reservation's lease while its call runs (a thread that wakes every quarter of the
    lease), so a long call keeps its money; a process that dies stops renewing and its lease
    expires as before. ``with LeaseKeeper(store, key, charge_id): run_the_call()``."""

    def __init__(self, store: Any, key: str, charge_id: str) -> None:
        import threading

        self.store, self.key, self.charge_id = store, key, charge_id
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"lease-{charge_id}", daemon=True)

    def _run(self) -> None:
        # Renew at once (the gate reserved a while ago) and then every quarter of the lease, so a
        # renewal delayed by a busy machine still lands before the lease runs out.
        period = max(0.01, float(self.store.lease_seconds) / 4)
        log = logging.getLogger("intent.stores")
        while True:
            try:
                renewed = self.store.renew(self.key, self.charge_id)
            except StoreUnavailableError as exc:
                # The store is away past its own retries: the hold is still ours until its lease ends, so keep
                # trying (ending the thread here would let the lease run out once the store is back).
                log.warning("could not renew the lease of charge %s on %r (%s): trying again in %gs",
                            self.charge_id, self.key, exc, period)
                renewed = True
            if not renewed:
                log.warning("the lease of charge %s on %r ran out before it was renewed: another run may take "
                            "its money while the call runs; raise the store's lease_seconds", self.charge_id, self.key)
                return
            if self._stop.wait(period):
                return

    def __enter__(self) -> LeaseKeeper:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()


class CommitOutbox:
    """The store as a guard uses it: a commit the store cannot take for now (:class:`StoreUnavailableError`:
    unreachable past its own retries) is kept and sent again before the guard's next operation on the store.

    The call has run by then, and its charge is in the guard's ledger: raising out of the tool step would lose its
    answer, and LangGraph would run the call again when the thread resumes (a second execution, and neither
    charge in the store). A kept commit goes out first on the next reserve, commit, release or read; while the
    store is still away that operation fails (nothing else changed). Commits are idempotent by charge id, so one
    the store took before its answer was lost is not charged twice; one sent after its lease ran out is charged
    and flagged ``late``. Any other :class:`StoreError` (a released charge committed, an unknown key) is a bug
    and is raised. What a process still keeps when it exits is lost with it (:attr:`pending` says what that is, and
    a warning at exit names it) unless the outbox has a ``journal`` (:class:`intent.stores.journal.OutboxJournal`,
    ``BudgetGuard(outbox_journal=PATH)``): each kept commit is then written to that file before the tool step ends,
    and an outbox that opens the file later sends it before its first operation on the store.

    A kept commit the store refuses when it is sent again (a :class:`StoreError` that is not
    :class:`StoreUnavailableError`: its hold was released meanwhile, its key deleted) will never be taken, so it is
    dropped from the outbox (kept, it would fail every later operation) and raised once, as a
    :class:`KeptCommitRefusedError`, by the operation that sent it: the kept commits behind it are still sent, and
    that operation is then not done (a reserve, a read: call it again), except a commit, which is done first (its
    call ran: its charge must not be lost) and then raises.
    """

    def __init__(self, store: Any, journal: str | os.PathLike[str] | None = None) -> None:
        import threading

        self.store = store
        self._lock = threading.Lock()
        self.journal = None
        if journal is not None:
            from intent.stores.journal import OutboxJournal

            self.journal = OutboxJournal(journal)
        # (key, charge id) -> billed amount, in order; a journal's unsent commits first
        self._pending: dict[tuple[str, str], float | None] = {} if self.journal is None else dict(self.journal.pending)
        _LIVE_OUTBOXES.add(self)  # (weakly: one exit check for all of them, nothing kept alive)

    def close(self) -> None:
        """Close the journal (and free it for another guard); what is still pending stays in it."""
        if self.journal is not None:
            self.journal.close()

    @property
    def pending(self) -> dict[tuple[str, str], float | None]:
        """The commits kept, not yet taken by the store."""
        with self._lock:
            return dict(self._pending)

    def flush(self) -> None:
        """Send the kept commits, oldest first; :class:`StoreUnavailableError` while the store is still away (the
        rest stay kept), :class:`KeptCommitRefusedError` for those the store refused (dropped)."""
        if not self._pending:  # (the usual case: one dict test per operation)
            return
        with self._lock:
            kept = list(self._pending.items())
        log = logging.getLogger("intent.stores")
        refused: list[tuple[str, str, float | None, StoreError]] = []
        try:
            for (key, charge_id), amount in kept:
                try:
                    self.store.commit(key, charge_id, amount)
                except StoreUnavailableError:
                    raise
                except StoreError as exc:
                    refused.append((key, charge_id, amount, exc))
                    log.error("kept commit of charge %s on %r refused by the store (%s): dropped", charge_id, key, exc)
                else:
                    log.warning("kept commit of charge %s on %r sent to the store (it was unreachable when the call "
                                "ended)", charge_id, key)
                with self._lock:
                    self._pending.pop((key, charge_id), None)
                    if self.journal is not None:
                        self.journal.done(key, charge_id, nothing_pending=not self._pending)
        finally:
            # (also when the store went away again part-way: what it refused before is raised, not lost)
            if refused:
                raise KeptCommitRefusedError(refused)

    def commit(self, key: str, charge_id: str, amount: float | None = None) -> StoreCharge | None:
        refused: KeptCommitRefusedError | None = None
        try:
            try:
                self.flush()
            except KeptCommitRefusedError as exc:
                refused = exc  # raised once this call's own commit is done: the call ran, its charge goes first
            charge = self.store.commit(key, charge_id, amount)
        except StoreUnavailableError as exc:
            with self._lock:
                self._pending[(key, charge_id)] = amount
                if self.journal is not None:  # on disk before the tool step ends: a crash now loses nothing
                    self.journal.kept(key, charge_id, amount)
            logging.getLogger("intent.stores").warning(
                "charge %s on %r is in the guard's ledger but the store is unreachable (%s): kept, and sent again "
                "before the next operation on the store", charge_id, key, exc)
            charge = None
        if refused is not None:
            raise refused
        return charge

    def _flushed(self, name: str) -> Any:
        method = getattr(self.store, name)

        def run(*args: Any, **kwargs: Any) -> Any:
            self.flush()
            return method(*args, **kwargs)
        return run

    def __getattr__(self, name: str) -> Any:
        # The operations that read or move money send what is kept first; the rest (renew, lease_seconds,
        # charges, a store's own extras) go straight through. An operation the store lacks (rekey is optional)
        # is missing here too.
        if name in ("reserve", "release", "rekey", "left", "budget", "spent", "reserved"):
            return self._flushed(name)
        return getattr(self.store, name)


_LIVE_OUTBOXES: weakref.WeakSet[CommitOutbox] = weakref.WeakSet()


@atexit.register
def _warn_at_exit() -> None:
    """At interpreter exit: say which kept commits never reached the store, and whether a journal keeps them."""
    for outbox in list(_LIVE_OUTBOXES):
        if outbox._pending:
            _warn_lost(outbox)


def _warn_lost(outbox: CommitOutbox) -> None:
    log = logging.getLogger("intent.stores")
    if outbox.journal is not None:
        log.warning("%d commit(s) the store could not take are kept in the outbox journal %s: a guard that opens it "
                    "again sends them", len(outbox._pending), outbox.journal.path)
    else:
        log.error("%d commit(s) the store could not take are lost at exit (%s): the calls ran and were paid, but the "
                  "shared budget will not count them; pass BudgetGuard(..., outbox_journal=PATH) to keep them",
                  len(outbox._pending), ", ".join(f"{c} on {k!r}" for k, c in outbox._pending))


def open_store(url: str, **kwargs: Any) -> BudgetStore:
    """A store from a URL: ``memory://``, ``sqlite:///path/to/budgets.db``, ``postgresql://...``; ``kwargs`` go to its
    class (``lease_seconds=``; ``retry_seconds=``, ``pool_size=`` and ``pool_timeout=`` for PostgreSQL, ``timeout=`` for SQLite)."""
    if not isinstance(url, str):
        raise StoreArgumentError(f"store URL must be a str, got {type(url).__name__} {url!r:.60}; use memory://, "
                                 "sqlite:///PATH or postgresql://...")
    if "retry_seconds" in kwargs and not url.startswith(("postgresql://", "postgres://")):
        raise StoreArgumentError(f"retry_seconds= is for postgresql:// stores, not {url.split('://')[0]}://; a SQLite "
                                 "store waits for another connection's lock up to its timeout= (seconds)")
    for pool_arg in ("pool_size", "pool_timeout"):
        if pool_arg in kwargs and not url.startswith(("postgresql://", "postgres://")):
            raise StoreArgumentError(f"{pool_arg}= is for postgresql:// stores, not {url.split('://')[0]}://; a SQLite "
                                     "or memory store has one connection (SQLite locks the whole file for a write "
                                     "anyway)")
    if url.startswith("memory://"):
        return MemoryBudgetStore(**kwargs)
    if url.startswith("sqlite:///"):
        return SqliteBudgetStore(url[len("sqlite:///"):], **kwargs)
    if url.startswith(("postgresql://", "postgres://")):
        return PostgresBudgetStore(url, **kwargs)
    raise StoreArgumentError(f"unknown store URL {url!r}; use memory://, sqlite:///PATH or postgresql://...")


from intent.stores.sql import MemoryBudgetStore, PostgresBudgetStore, SqliteBudgetStore  # noqa: E402
