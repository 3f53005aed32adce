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
    gives the hold back.

Money is stored as integer nano-units, so ``spent`` is exactly the sum of the committed
charges. Stores:

* :class:`MemoryBudgetStore`: one process (the default when no store is given is the
  per-episode ledger alone);
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
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, Protocol, runtime_checkable

from intent.errors import IntentError
from intent.ledger import BudgetExceededError, LedgerError
from intent.market import check_amount

__all__ = [
    "BudgetStore",
    "MemoryBudgetStore",
    "PostgresBudgetStore",
    "SqliteBudgetStore",
    "StoreCharge",
    "StoreError",
    "open_store",
    "period_key",
]

NANO = 1_000_000_000
ChargeStatus = Literal["reserved", "committed", "released", "expired"]


class StoreError(IntentError, RuntimeError):
    """A shared-budget operation the store cannot do (unknown key, released charge committed...)."""


def to_nano(amount: float) -> int:
    return int(round(check_amount(amount, "amount") * NANO))


def from_nano(n: int) -> float:
    return n / NANO


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


@dataclass(frozen=True)
class StoreCharge:
    """One charge against a shared budget."""

    key: str
    charge_id: str
    amount: float
    status: ChargeStatus
    late: bool = False  # committed after its lease had expired
    run_id: str = ""  # the episode (graph thread) that made it
    tool: str = ""  # the tool or model it paid for
    kind: str = "tool"
    lease_until: float = 0.0
    updated_at: float = 0.0


@runtime_checkable
class BudgetStore(Protocol):
    """What the guard needs from a shared budget (every method atomic)."""

    lease_seconds: float

    def create_budget(self, key: str, amount: float) -> None: ...
    def budget(self, key: str) -> float: ...
    def spent(self, key: str) -> float: ...
    def reserved(self, key: str) -> float: ...
    def reserve(self, key: str, charge_id: str, amount: float, *, run_id: str = "", tool: str = "",
                kind: str = "tool") -> StoreCharge: ...
    def commit(self, key: str, charge_id: str, amount: float | None = None) -> StoreCharge: ...
    def release(self, key: str, charge_id: str) -> StoreCharge | None: ...
    def expire_leases(self, key: str | None = None) -> list[StoreCharge]: ...
    def charges(self, key: str) -> list[StoreCharge]: ...


def _no_fit(key: str, charge_id: str, amount: int, budget: int, spent: int, reserved: int) -> BudgetExceededError:
    return BudgetExceededError(
        f"shared budget {key!r}: charge {charge_id!r} of {from_nano(amount):g} does not fit "
        f"(budget {from_nano(budget):g}, spent {from_nano(spent):g}, reserved {from_nano(reserved):g})")


class MemoryBudgetStore:
    """Shared budgets inside one process (threads): the reference implementation."""

    def __init__(self, *, lease_seconds: float = 600.0, clock: Callable[[], float] = time.time) -> None:
        self.lease_seconds = float(lease_seconds)
        self._clock = clock
        self._lock = threading.RLock()
        self._budgets: dict[str, list[int]] = {}  # key -> [amount, spent, reserved]
        self._charges: dict[tuple[str, str], StoreCharge] = {}
        self._nano: dict[tuple[str, str], int] = {}

    def create_budget(self, key: str, amount: float) -> None:
        n = to_nano(amount)
        with self._lock:
            if key in self._budgets:
                if self._budgets[key][0] != n:
                    raise StoreError(f"budget {key!r} exists with amount {from_nano(self._budgets[key][0]):g}; "
                                     "a period's budget is never changed in place: use a new key")
                return
            self._budgets[key] = [n, 0, 0]

    def _row(self, key: str) -> list[int]:
        row = self._budgets.get(key)
        if row is None:
            raise StoreError(f"no shared budget {key!r}; create it with store.create_budget({key!r}, amount)")
        return row

    def budget(self, key: str) -> float:
        with self._lock:
            return from_nano(self._row(key)[0])

    def spent(self, key: str) -> float:
        with self._lock:
            return from_nano(self._row(key)[1])

    def reserved(self, key: str) -> float:
        with self._lock:
            self._expire(key)
            return from_nano(self._row(key)[2])

    def reserve(self, key: str, charge_id: str, amount: float, *, run_id: str = "", tool: str = "",
                kind: str = "tool") -> StoreCharge:
        n = to_nano(amount)
        with self._lock:
            row = self._row(key)
            self._expire(key)
            existing = self._charges.get((key, charge_id))
            if existing is not None:
                return existing
            if row[1] + row[2] + n > row[0]:
                raise _no_fit(key, charge_id, n, *row)
            row[2] += n
            now = self._clock()
            charge = StoreCharge(key, charge_id, from_nano(n), "reserved", False, run_id, tool, kind,
                                 now + self.lease_seconds, now)
            self._charges[(key, charge_id)] = charge
            self._nano[(key, charge_id)] = n
            return charge

    def commit(self, key: str, charge_id: str, amount: float | None = None) -> StoreCharge:
        with self._lock:
            row = self._row(key)
            self._expire(key)
            charge = self._charges.get((key, charge_id))
            if charge is None:
                raise StoreError(f"cannot commit {charge_id!r} on {key!r}: it was never reserved")
            if charge.status == "committed":
                return charge
            if charge.status == "released":
                raise StoreError(f"cannot commit {charge_id!r} on {key!r}: it was released, so it must not have run")
            held = self._nano[(key, charge_id)]
            billed = held if amount is None else to_nano(amount)
            late = charge.status == "expired"
            if not late:
                row[2] -= held
            row[1] += billed
            self._nano[(key, charge_id)] = billed
            charge = StoreCharge(key, charge_id, from_nano(billed), "committed", late, charge.run_id, charge.tool,
                                 charge.kind, charge.lease_until, self._clock())
            self._charges[(key, charge_id)] = charge
            return charge

    def release(self, key: str, charge_id: str) -> StoreCharge | None:
        with self._lock:
            row = self._row(key)
            charge = self._charges.get((key, charge_id))
            if charge is None or charge.status != "reserved":
                return charge
            row[2] -= self._nano[(key, charge_id)]
            charge = StoreCharge(key, charge_id, charge.amount, "released", False, charge.run_id, charge.tool,
                                 charge.kind, charge.lease_until, self._clock())
            self._charges[(key, charge_id)] = charge
            return charge

    def _expire(self, key: str | None) -> list[StoreCharge]:
        now = self._clock()
        out = []
        for (k, cid), charge in list(self._charges.items()):
            if (key is None or k == key) and charge.status == "reserved" and charge.lease_until < now:
                self._budgets[k][2] -= self._nano[(k, cid)]
                charge = StoreCharge(k, cid, charge.amount, "expired", False, charge.run_id, charge.tool,
                                     charge.kind, charge.lease_until, now)
                self._charges[(k, cid)] = charge
                out.append(charge)
        return out

    def expire_leases(self, key: str | None = None) -> list[StoreCharge]:
        with self._lock:
            return self._expire(key)

    def charges(self, key: str) -> list[StoreCharge]:
        with self._lock:
            return sorted((c for (k, _), c in self._charges.items() if k == key), key=lambda c: c.updated_at)


def open_store(url: str, **kwargs: Any) -> BudgetStore:
    """A store from a URL: ``memory://``, ``sqlite:///path/to/budgets.db``, ``postgresql://...``."""
    if url.startswith("memory://"):
        return MemoryBudgetStore(**kwargs)
    if url.startswith("sqlite:///"):
        return SqliteBudgetStore(url[len("sqlite:///"):], **kwargs)
    if url.startswith(("postgresql://", "postgres://")):
        return PostgresBudgetStore(url, **kwargs)
    raise StoreError(f"unknown store URL {url!r}; use memory://, sqlite:///PATH or postgresql://...")


from intent.stores.sql import PostgresBudgetStore, SqliteBudgetStore  # noqa: E402  (they use the names above)

_ = LedgerError  # re-exported for callers catching ledger errors from stores
