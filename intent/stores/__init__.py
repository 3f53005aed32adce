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

**Keys and periods.** A key is any string; :func:`period_key` builds the documented scheme
``<scope>/<period>``: ``period_key("customer-42", "day")`` is ``customer-42/2026-11-23``,
``"month"`` gives ``customer-42/2026-11``. A new period is a new key (create it with its
amount); nothing is ever reset in place, so past periods stay readable.
"""

from __future__ import annotations

import datetime as _dt
import logging
from typing import Any, Literal, Protocol, runtime_checkable

from intent.stores.base import StoreCharge, StoreError

__all__ = [
    "BudgetStore",
    "LeaseKeeper",
    "MemoryBudgetStore",
    "PostgresBudgetStore",
    "SqliteBudgetStore",
    "StoreCharge",
    "StoreError",
    "open_store",
    "period_key",
]


def period_key(scope: str, period: Literal["day", "month"] = "day", *, now: _dt.datetime | None = None) -> str:
    """``<scope>/<YYYY-MM-DD>`` or ``<scope>/<YYYY-MM>`` (UTC): a new period is a new key."""
    if not scope or "/" in scope:
        raise StoreError(f"scope {scope!r} must be a non-empty string without '/'")
    now = now or _dt.datetime.now(_dt.timezone.utc)
    if period == "day":
        return f"{scope}/{now:%Y-%m-%d}"
    if period == "month":
        return f"{scope}/{now:%Y-%m}"
    raise StoreError(f"period must be 'day' or 'month', got {period!r}")


@runtime_checkable
class BudgetStore(Protocol):
    """What the guard needs from a shared budget (every method atomic)."""

    lease_seconds: float

    def create_budget(self, key: str, amount: float) -> None: ...
    def budget(self, key: str) -> float: ...
    def spent(self, key: str) -> float: ...
    def reserved(self, key: str) -> float: ...
    def left(self, key: str) -> float: ...
    def renew(self, key: str, charge_id: str) -> bool: ...
    def reserve(self, key: str, charge_id: str, amount: float, *, run_id: str = "", tool: str = "",
                kind: str = "tool") -> StoreCharge: ...
    def commit(self, key: str, charge_id: str, amount: float | None = None) -> StoreCharge: ...
    def release(self, key: str, charge_id: str) -> StoreCharge | None: ...
    # Optional: rekey(key, old_id, new_id, amount, *, run_id="", tool="", kind="tool") -> StoreCharge
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
        while True:
            if not self.store.renew(self.key, self.charge_id):
                logging.getLogger("intent.stores").warning(
                    "the lease of charge %s on %r ran out before it was renewed: another run may take "
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


def open_store(url: str, **kwargs: Any) -> BudgetStore:
    """A store from a URL: ``memory://``, ``sqlite:///path/to/budgets.db``, ``postgresql://...``."""
    if url.startswith("memory://"):
        return MemoryBudgetStore(**kwargs)
    if url.startswith("sqlite:///"):
        return SqliteBudgetStore(url[len("sqlite:///"):], **kwargs)
    if url.startswith(("postgresql://", "postgres://")):
        return PostgresBudgetStore(url, **kwargs)
    raise StoreError(f"unknown store URL {url!r}; use memory://, sqlite:///PATH or postgresql://...")


from intent.stores.sql import MemoryBudgetStore, PostgresBudgetStore, SqliteBudgetStore  # noqa: E402
