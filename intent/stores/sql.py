"""SQLite and PostgreSQL budget stores: one implementation of the money steps, two dialects.

Every operation is one transaction that first locks the budget's row (SQLite: ``BEGIN
IMMEDIATE`` takes the database's write lock; PostgreSQL: ``SELECT ... FOR UPDATE`` on the
budget row), then expires the key's stale leases, then checks and writes. So two processes (or
machines) can never both pass the ``spent + reserved + amount <= budget`` check on the same
money, and a repeated charge id finds its row and changes nothing.
"""

from __future__ import annotations

import functools
import logging
import math
import random
import re
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from intent.stores.base import (
    StoreArgumentError,
    StoreCharge,
    StoreError,
    StoreUnavailableError,
    _no_fit,
    from_nano,
    to_nano,
)

__all__ = ["MemoryBudgetStore", "PostgresBudgetStore", "SqliteBudgetStore"]

log = logging.getLogger("intent.stores")

# A key's charges in time order: what the report reads and prune deletes, without reading the whole table.
_BY_TIME = "CREATE INDEX IF NOT EXISTS intent_charges_by_time ON intent_charges (key, updated_at)"
_SCHEMA = [
    """CREATE TABLE IF NOT EXISTS intent_budgets (
        key TEXT PRIMARY KEY,
        amount BIGINT NOT NULL,
        spent BIGINT NOT NULL DEFAULT 0,
        reserved BIGINT NOT NULL DEFAULT 0,
        created_at DOUBLE PRECISION NOT NULL,
        currency TEXT)""",
    """CREATE TABLE IF NOT EXISTS intent_charges (
        key TEXT NOT NULL REFERENCES intent_budgets(key),
        charge_id TEXT NOT NULL,
        amount BIGINT NOT NULL,
        status TEXT NOT NULL,
        late BOOLEAN NOT NULL DEFAULT FALSE,
        run_id TEXT NOT NULL DEFAULT '',
        tool TEXT NOT NULL DEFAULT '',
        kind TEXT NOT NULL DEFAULT 'tool',
        lease_until DOUBLE PRECISION NOT NULL,
        updated_at DOUBLE PRECISION NOT NULL,
        PRIMARY KEY (key, charge_id))""",
    "CREATE INDEX IF NOT EXISTS intent_charges_held ON intent_charges (key, status, lease_until)",
    _BY_TIME,
]
_COLS = "key, charge_id, amount, status, late, run_id, tool, kind, lease_until, updated_at"
_BUDGET_COLS = "key, amount, spent, reserved, created_at"  # (and currency, added to tables made before it)
_ADD_CURRENCY = "ALTER TABLE intent_budgets ADD COLUMN currency TEXT"
PRUNE_BATCH = 10_000  # settled charges deleted per transaction (each holds its key's row lock while it runs)


def _without_password(dsn: str) -> str:
    """``dsn`` with its password replaced by ``***`` (URL ``user:pw@`` and ``password=`` forms), for messages."""
    dsn = re.sub(r"(://[^:/@?]*:)[^@/?]*@", r"\1***@", dsn)
    return re.sub(r"(password\s*=\s*)('(?:[^'\\]|\\.)*'|[^\s&]+)", r"\1***", dsn)


def _one_line(exc: BaseException) -> str:
    """A driver's message on one line (PostgreSQL's carry DETAIL / LINE / caret lines after the first)."""
    return " ".join(str(exc).split()) or type(exc).__name__


def _charge(row: Any) -> StoreCharge:
    key, cid, amount, status, late, run_id, tool, kind, lease_until, updated_at = row
    return StoreCharge(key, cid, from_nano(int(amount)), status, bool(late), run_id, tool, kind, float(lease_until),
                       float(updated_at))


def _seconds(value: Any, name: str, *, hint: str, above_zero: bool = False, meaning: str = "") -> float:
    """``value`` as a store's duration in seconds: finite, and > 0 (``above_zero``) or >= 0; else one
    :class:`StoreArgumentError` naming ``name`` (``meaning`` follows the bound, ``hint`` the value given)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or value < 0 or (above_zero and value == 0):
        raise StoreArgumentError(f"{name} must be a finite number of seconds {'> 0' if above_zero else '>= 0'}"
                                 f"{meaning}, got {value!r}; {hint}")
    return float(value)


class _SqlBudgetStore:
    """The money logic, written once; subclasses give a connection, a transaction and the placeholder."""

    placeholder = "?"

    def __init__(self, *, lease_seconds: float, clock: Callable[[], float]) -> None:
        # 0 or less: every hold expired as it was made (every commit late), and a LeaseKeeper renewing every quarter
        # of it spun.
        self.lease_seconds = _seconds(lease_seconds, "lease_seconds", above_zero=True,
                                      hint="e.g. lease_seconds=600 (the default), above your slowest model call")
        self._clock = clock

    # -- dialect -------------------------------------------------------------
    @contextmanager
    def _tx(self, key: str | None) -> Iterator[Any]:  # yields a cursor with the key's row locked
        raise NotImplementedError

    def _q(self, sql: str) -> str:
        return sql.replace("?", self.placeholder)

    def _now(self, cur: Any) -> float:
        """The time leases are read and written in (seconds since the epoch), inside the transaction."""
        return self._clock()

    # -- helpers -------------------------------------------------------------
    def _row(self, cur: Any, key: str) -> tuple[int, int, int]:
        cur.execute(self._q("SELECT amount, spent, reserved FROM intent_budgets WHERE key = ?"), (key,))
        row = cur.fetchone()
        if row is None:
            raise StoreError(f"no shared budget {key!r}; create it with store.create_budget({key!r}, amount)")
        return int(row[0]), int(row[1]), int(row[2])

    def _expire(self, cur: Any, key: str) -> list[StoreCharge]:
        now = self._now(cur)
        cur.execute(self._q(f"SELECT {_COLS} FROM intent_charges WHERE key = ? AND status = 'reserved' "
                            "AND lease_until < ?"), (key, now))
        stale = [_charge(r) for r in cur.fetchall()]
        if not stale:
            return []
        total = sum(to_nano(c.amount) for c in stale)
        cur.execute(self._q("UPDATE intent_charges SET status = 'expired', updated_at = ? WHERE key = ? "
                            "AND status = 'reserved' AND lease_until < ?"), (now, key, now))
        cur.execute(self._q("UPDATE intent_budgets SET reserved = reserved - ? WHERE key = ?"), (total, key))
        for c in stale:
            log.warning("lease expired: charge %s on %s (%g, run %s, %s) released; its holder never committed",
                        c.charge_id, key, c.amount, c.run_id, c.tool)
        return [StoreCharge(c.key, c.charge_id, c.amount, "expired", False, c.run_id, c.tool, c.kind, c.lease_until,
                            now) for c in stale]

    def _hold(self, cur: Any, key: str, charge_id: str, n: int, run_id: str, tool: str, kind: str) -> StoreCharge:
        """Insert a held charge of ``n`` nano-units under a fresh lease (the fit already checked)."""
        now = self._now(cur)
        cur.execute(self._q(f"INSERT INTO intent_charges ({_COLS}) VALUES (?, ?, ?, 'reserved', ?, ?, ?, ?, ?, ?)"),
                    (key, charge_id, n, False, run_id, tool, kind, now + self.lease_seconds, now))
        cur.execute(self._q("UPDATE intent_budgets SET reserved = reserved + ? WHERE key = ?"), (n, key))
        return StoreCharge(key, charge_id, from_nano(n), "reserved", False, run_id, tool, kind,
                           now + self.lease_seconds, now)

    def _unhold(self, cur: Any, charge: StoreCharge) -> StoreCharge:
        """Give a held charge back (its status checked by the caller)."""
        now = self._now(cur)
        cur.execute(self._q("UPDATE intent_charges SET status = 'released', updated_at = ? "
                            "WHERE key = ? AND charge_id = ?"), (now, charge.key, charge.charge_id))
        cur.execute(self._q("UPDATE intent_budgets SET reserved = reserved - ? WHERE key = ?"),
                    (to_nano(charge.amount), charge.key))
        return StoreCharge(charge.key, charge.charge_id, charge.amount, "released", False, charge.run_id, charge.tool,
                           charge.kind, charge.lease_until, now)

    def _get(self, cur: Any, key: str, charge_id: str) -> StoreCharge | None:
        cur.execute(self._q(f"SELECT {_COLS} FROM intent_charges WHERE key = ? AND charge_id = ?"), (key, charge_id))
        row = cur.fetchone()
        return _charge(row) if row else None

    # -- the protocol ----------------------------------------------------------
    def create_budget(self, key: str, amount: float, currency: str | None = None) -> None:
        """Create ``key`` with ``amount`` (idempotent). ``currency``: its code (``"USD"``), kept with the budget, so
        that a guard whose money is in another currency is refused; ``None`` says nothing about it."""
        n = to_nano(amount)
        if currency is not None:
            if not isinstance(currency, str) or not currency.strip():
                raise StoreError(f"currency must be a currency code like 'USD' or None, got {currency!r}")
            currency = currency.strip().upper()
        with self._tx(None) as cur:
            # Insert unless the key exists, then read what is there: workers creating the same key at once (each
            # at start-up) all succeed; a read-then-insert let two see no row and the second insert fail.
            cur.execute(self._q("INSERT INTO intent_budgets (key, amount, spent, reserved, created_at, currency) "
                                "VALUES (?, ?, 0, 0, ?, ?) ON CONFLICT (key) DO NOTHING"),
                        (key, n, self._now(cur), currency))
            cur.execute(self._q("SELECT amount, currency FROM intent_budgets WHERE key = ?"), (key,))
            existing, existing_currency = cur.fetchone()
            if int(existing) != n:
                raise StoreError(f"budget {key!r} exists with amount {from_nano(int(existing)):g}; a period's "
                                 "budget is never changed in place: use a new key")
            if currency is not None and existing_currency != currency:
                raise StoreError(f"budget {key!r} exists " + (f"in {existing_currency}" if existing_currency else
                                                              "without a currency") +
                                 f", not {currency}; a budget has one currency, never changed in place: use a new key")

    def currency(self, key: str) -> str | None:
        """The currency ``key`` was created in, or None when it was created without one."""
        with self._tx(None) as cur:
            self._row(cur, key)  # (an unknown key: the error that names the fix)
            cur.execute(self._q("SELECT currency FROM intent_budgets WHERE key = ?"), (key,))
            return cur.fetchone()[0]

    def budget(self, key: str) -> float:
        with self._tx(None) as cur:
            return from_nano(self._row(cur, key)[0])

    def spent(self, key: str) -> float:
        with self._tx(None) as cur:
            return from_nano(self._row(cur, key)[1])

    def reserved(self, key: str) -> float:
        with self._tx(key) as cur:
            self._expire(cur, key)
            return from_nano(self._row(cur, key)[2])

    def renew(self, key: str, charge_id: str) -> bool:
        """Extend a held reservation's lease by ``lease_seconds`` from now (a call still running).
        False when it is no longer held (committed, released, or already expired)."""
        with self._tx(key) as cur:
            now = self._now(cur)
            cur.execute(self._q("UPDATE intent_charges SET lease_until = ?, updated_at = ? WHERE key = ? "
                                "AND charge_id = ? AND status = 'reserved' AND lease_until >= ?"),
                        (now + self.lease_seconds, now, key, charge_id, now))
            return cur.rowcount == 1

    def left(self, key: str) -> float:
        """What can still be reserved (budget - spent - reserved), expired leases released first:
        one transaction, for the guard's check before it asks the oracle."""
        with self._tx(key) as cur:
            self._expire(cur, key)
            budget, spent, reserved = self._row(cur, key)
            return from_nano(max(0, budget - spent - reserved))

    def reserve(self, key: str, charge_id: str, amount: float, *, run_id: str = "", tool: str = "",
                kind: str = "tool") -> StoreCharge:
        return self._reserve(key, charge_id, amount, run_id=run_id, tool=tool, kind=kind)

    def rekey(self, key: str, old_id: str, new_id: str, amount: float, *, run_id: str = "", tool: str = "",
              kind: str = "tool") -> StoreCharge:
        """Hold ``amount`` under ``new_id`` for a run starting on the reservation ``old_id``, in one
        transaction: a hold still held moves (no second check, never two holds at once); one that is
        not (its run committed it in a process that then died, it was released, its lease expired) is
        not reused: ``new_id`` is reserved afresh, and refused when it no longer fits. So each run is
        its own charge, and a run repeated after a crash is counted. Idempotent by ``new_id``."""
        return self._reserve(key, new_id, amount, run_id=run_id, tool=tool, kind=kind, moving=old_id)

    def _reserve(self, key: str, charge_id: str, amount: float, *, run_id: str, tool: str, kind: str,
                 moving: str | None = None) -> StoreCharge:
        """Hold ``amount`` under ``charge_id`` if it fits (idempotent by id), first giving back the hold
        ``moving`` when it is still held, all in one transaction (a refusal rolls that back too)."""
        n = to_nano(amount)
        with self._tx(key) as cur:
            self._expire(cur, key)
            existing = self._get(cur, key, charge_id)
            if existing is not None:
                return existing
            old = self._get(cur, key, moving) if moving is not None else None
            if old is not None and old.status == "reserved":
                self._unhold(cur, old)
            budget, spent, reserved = self._row(cur, key)
            # A hold of 0 takes no money, so it always fits: it is how money already spent (a model answer
            # nobody metered, an oracle's decision, a late bill) is charged, even on a budget an overrun took.
            if n > 0 and spent + reserved + n > budget:
                raise _no_fit(key, charge_id, n, budget, spent, reserved)
            return self._hold(cur, key, charge_id, n, run_id, tool, kind)

    def commit(self, key: str, charge_id: str, amount: float | None = None) -> StoreCharge:
        with self._tx(key) as cur:
            self._expire(cur, key)
            charge = self._get(cur, key, charge_id)
            if charge is None:
                raise StoreError(
                    f"cannot commit {charge_id!r} on {key!r}: no such charge: it was never reserved, or it settled "
                    "(expired, released) long ago and was pruned from the store's history (store.prune); a late "
                    "commit of a pruned charge is not charged by itself: if its call ran, charge its money with "
                    f"store.reserve({key!r}, NEW_ID, 0) then store.commit({key!r}, NEW_ID, amount)")
            if charge.status == "committed":
                return charge
            if charge.status == "released":
                raise StoreError(f"cannot commit {charge_id!r} on {key!r}: it was released, so it must not have run")
            held = to_nano(charge.amount)
            billed = held if amount is None else to_nano(amount)
            late = charge.status == "expired"
            if late:
                log.warning("late commit: charge %s on %s arrived after its lease expired; charged %g (money spent)",
                            charge_id, key, from_nano(billed))
            now = self._now(cur)
            cur.execute(self._q("UPDATE intent_charges SET status = 'committed', amount = ?, late = ?, updated_at = ? "
                                "WHERE key = ? AND charge_id = ?"), (billed, late, now, key, charge_id))
            cur.execute(self._q("UPDATE intent_budgets SET spent = spent + ?, reserved = reserved - ? WHERE key = ?"),
                        (billed, 0 if late else held, key))
            return StoreCharge(key, charge_id, from_nano(billed), "committed", late, charge.run_id, charge.tool,
                               charge.kind, charge.lease_until, now)

    def release(self, key: str, charge_id: str) -> StoreCharge | None:
        with self._tx(key) as cur:
            charge = self._get(cur, key, charge_id)
            if charge is None or charge.status != "reserved":
                return charge
            return self._unhold(cur, charge)

    def expire_leases(self, key: str | None = None) -> list[StoreCharge]:
        if key is not None:
            with self._tx(key) as cur:
                return self._expire(cur, key)
        with self._tx(None) as cur:
            cur.execute("SELECT key FROM intent_budgets")
            keys = [r[0] for r in cur.fetchall()]
        out: list[StoreCharge] = []
        for k in keys:
            out += self.expire_leases(k)
        return out

    def charges(self, key: str) -> list[StoreCharge]:
        with self._tx(None) as cur:
            cur.execute(self._q(f"SELECT {_COLS} FROM intent_charges WHERE key = ? ORDER BY updated_at"), (key,))
            return [_charge(r) for r in cur.fetchall()]

    def prune(self, older_than_seconds: float, key: str | None = None) -> int:
        """Delete the settled charges (committed, released, expired) of ``key`` (every key when None) last changed
        more than ``older_than_seconds`` ago; a held reservation is never deleted. Returns how many were deleted.

        The budget's totals do not change: ``spent`` and ``reserved`` are kept in the budget's row, so the report
        still shows all the money and itemizes what is left. ``older_than_seconds`` must span at least two leases
        (a live hold is renewed within one), and should be far longer than any worker may stay away: a commit that
        arrives after its charge was pruned (a worker revived after days, an outbox journal sent late) finds no
        charge and is refused with a :class:`StoreError` naming pruning, not charged. Deleted in batches of
        ``PRUNE_BATCH``, each its own short transaction, so workers on the key wait for one batch at most. On
        PostgreSQL the role needs ``DELETE`` on ``intent_charges`` (the workers' roles do not)."""
        if isinstance(older_than_seconds, bool) or not isinstance(older_than_seconds, (int, float)) \
                or not math.isfinite(older_than_seconds):
            raise StoreArgumentError(f"older_than_seconds must be a number of seconds, got {older_than_seconds!r}; "
                                     "e.g. 90 days = 7776000")
        if older_than_seconds < 2 * self.lease_seconds:
            raise StoreArgumentError(
                f"older_than_seconds={older_than_seconds:g} keeps less than two leases (lease_seconds="
                f"{self.lease_seconds:g}) of settled history: a commit of a charge pruned that soon would be "
                "refused; keep far more, e.g. 90 days = 7776000")
        deleted = 0
        for k in ([key] if key is not None else self.keys()):
            while True:
                n = self._prune_batch(k, float(older_than_seconds))
                deleted += n
                if n < PRUNE_BATCH:
                    break
        return deleted

    def _prune_batch(self, key: str, older_than_seconds: float) -> int:
        with self._tx(key) as cur:
            self._row(cur, key)  # (an unknown key: the error that names the fix)
            cutoff = self._now(cur) - older_than_seconds
            # (a subquery with LIMIT: neither SQLite, as usually built, nor PostgreSQL has DELETE ... LIMIT)
            cur.execute(self._q("DELETE FROM intent_charges WHERE key = ? AND charge_id IN (SELECT charge_id FROM "
                                "intent_charges WHERE key = ? AND status <> 'reserved' AND updated_at < ? LIMIT ?)"),
                        (key, key, cutoff, PRUNE_BATCH))
            return int(cur.rowcount)

    def keys(self) -> list[str]:
        with self._tx(None) as cur:
            cur.execute("SELECT key FROM intent_budgets ORDER BY key")
            return [r[0] for r in cur.fetchall()]


class SqliteBudgetStore(_SqlBudgetStore):
    """Shared budgets for several processes on one machine: one SQLite file in WAL mode."""

    def __init__(self, path: str | Path, *, lease_seconds: float = 600.0, clock: Callable[[], float] = time.time,
                 timeout: float = 30.0) -> None:
        super().__init__(lease_seconds=lease_seconds, clock=clock)
        # One connection per store object; threads take turns (SQLite locks the whole file for a write anyway, so
        # more connections would only wait on each other).
        self._lock = threading.RLock()
        self.path = str(path)
        self.timeout = _seconds(timeout, "timeout", meaning=" (how long an operation waits for another connection's "
                                "write lock)", hint="e.g. timeout=30")
        # isolation_level=None: we issue BEGIN IMMEDIATE ourselves, one per operation.
        try:
            self._conn = sqlite3.connect(self.path, timeout=timeout, isolation_level=None, check_same_thread=False)
            self._conn.execute("PRAGMA journal_mode=WAL")
        except sqlite3.Error as exc:
            raise StoreError(f"cannot open the budget store {self.path!r}: {exc}; check the path and that its "
                             "directory exists") from exc
        self._conn.execute("PRAGMA synchronous=NORMAL")
        self._conn.execute("PRAGMA foreign_keys=ON")
        with self._tx(None) as cur:
            for stmt in _SCHEMA:
                cur.execute(stmt)
            cur.execute("SELECT name FROM pragma_table_info('intent_budgets')")
            if "currency" not in {r[0] for r in cur.fetchall()}:  # a file made before budgets had a currency
                cur.execute(_ADD_CURRENCY)

    @contextmanager
    def _tx(self, key: str | None) -> Iterator[Any]:
        with self._lock:
            cur = self._conn.cursor()
            try:
                try:
                    cur.execute("BEGIN IMMEDIATE")  # the write lock first: no other process interleaves
                except sqlite3.OperationalError as exc:
                    if not _busy(exc):
                        raise
                    raise self._unavailable(exc) from exc
                try:
                    yield cur
                except BaseException:
                    cur.execute("ROLLBACK")
                    raise
                try:
                    cur.execute("COMMIT")
                except sqlite3.OperationalError as exc:
                    if not _busy(exc):
                        raise
                    cur.execute("ROLLBACK")
                    raise self._unavailable(exc) from exc
            finally:
                cur.close()

    def _unavailable(self, exc: sqlite3.OperationalError) -> StoreUnavailableError:
        """Another process held the write lock past ``timeout`` (a long transaction, a backup, a sqlite3 shell):
        a :class:`StoreUnavailableError`, so the guard keeps a commit and sends it later."""
        return StoreUnavailableError(f"the budget store {self.path!r} is locked by another connection past the "
                                     f"store's timeout={self.timeout:g}s ({exc}); try again later, or raise timeout=")

    def close(self) -> None:
        self._conn.close()


def _busy(exc: sqlite3.OperationalError) -> bool:
    return getattr(exc, "sqlite_errorcode", None) in (sqlite3.SQLITE_BUSY, sqlite3.SQLITE_LOCKED)


class MemoryBudgetStore(SqliteBudgetStore):
    """Shared budgets inside one process (threads): an in-memory SQLite database, so the money
    logic is the very code the file and server stores run."""

    def __init__(self, *, lease_seconds: float = 600.0, clock: Callable[[], float] = time.time) -> None:
        super().__init__(":memory:", lease_seconds=lease_seconds, clock=clock)


class _ConnectionPool:
    """Up to ``size`` PostgreSQL connections, opened only when every open one is in use (lazily: operations that
    never overlap keep one), each lent to one transaction at a time. A connection that comes back broken or closed
    (the server dropped it) is discarded with the idle ones (a server restart takes them all), and the next checkout
    that finds none idle opens a new one. An operation finding all ``size`` in use waits up to ``timeout`` seconds
    for one to come back (``None``: for as long as it takes), then :class:`PoolTimeout`."""

    def __init__(self, connect: Callable[[], Any], size: int, first: Any, timeout: float | None = None) -> None:
        self._connect = connect
        self.size = size
        self.timeout = timeout
        self._cond = threading.Condition()
        self._idle: list[Any] = [first]  # a stack: the connection used last is lent first, so the others stay few
        self._open = 1  # idle + lent out, and being opened
        self._conns = {first}  # the open ones, idle and lent out (what connections() reports)
        self._generation = 0  # bumped by close(): a connection lent out before it is closed when it comes back

    @contextmanager
    def connection(self) -> Iterator[Any]:
        conn, generation = self._checkout()
        try:
            yield conn
        finally:
            self._checkin(conn, generation)

    def _checkout(self) -> tuple[Any, int]:
        deadline = None if self.timeout is None else time.monotonic() + self.timeout
        with self._cond:
            while True:
                while self._idle:
                    conn = self._idle.pop()
                    if not (conn.broken or conn.closed):  # (lost while idle and already seen so: not lent again)
                        return conn, self._generation
                    self._discard(conn)
                if self._open < self.size:
                    self._open += 1  # (taken before connecting, outside the lock: no other thread overshoots)
                    generation = self._generation
                    break
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise PoolTimeout(self.size, self.timeout)
                self._cond.wait(left)
        try:
            conn = self._connect()
        except BaseException:  # (refused: the caller's retry comes back here; a waiter may try meanwhile)
            with self._cond:
                self._open -= 1
                self._cond.notify()
            raise
        with self._cond:
            self._conns.add(conn)
        return conn, generation

    def _checkin(self, conn: Any, generation: int) -> None:
        from psycopg.pq import TransactionStatus

        with self._cond:
            if conn.broken:
                # Lost: the server most likely restarted or failed over, and took the idle connections with it
                # (they would each fail one attempt of the caller's retry, with its pause, before a new one
                # opens): they go too, and the retry opens a fresh connection.
                self._discard(conn)
                while self._idle:
                    self._discard(self._idle.pop())
            # (not idle: a transaction its operation could not end, e.g. interrupted mid-query; never lent again)
            elif conn.closed or generation != self._generation \
                    or conn.info.transaction_status != TransactionStatus.IDLE:
                self._discard(conn)
            else:
                self._idle.append(conn)
            self._cond.notify()

    def _discard(self, conn: Any) -> None:  # (under the lock)
        self._open -= 1
        self._conns.discard(conn)
        _close_quietly(conn)

    def connections(self) -> list[Any]:
        """The connections open now, idle or lent out."""
        with self._cond:
            return list(self._conns)

    def close(self) -> None:
        """Close the idle connections now and those lent out when they come back."""
        with self._cond:
            self._generation += 1
            while self._idle:
                self._discard(self._idle.pop())
            self._cond.notify_all()


class PoolTimeout(Exception):
    """Every connection of a store's pool stayed lent out for ``timeout`` seconds (internal: the store raises
    :class:`StoreUnavailableError` naming itself)."""

    def __init__(self, size: int, timeout: float | None) -> None:
        super().__init__(size, timeout)
        self.size, self.timeout = size, timeout


def _close_quietly(conn: Any) -> None:
    import psycopg

    try:
        conn.close()
    except psycopg.Error:  # (a connection already broken may fail to say goodbye)
        pass


DEFAULT_POOL_SIZE = 4
DEFAULT_POOL_TIMEOUT = 30.0  # seconds, psycopg_pool's default for getconn()


class PostgresBudgetStore(_SqlBudgetStore):
    """Shared budgets for several machines: PostgreSQL, one transaction per operation.

    ``dsn`` is a libpq connection string or URL (``postgresql://user@host/db``). Needs
    ``psycopg`` (``pip install 'intent[postgres]'``).

    ``retry_seconds`` (default 1): how long an operation that fails transiently (a connection lost or refused, a
    failover, a serialization failure, a deadlock, a lock timeout) is tried again after its first failure, with
    pauses of 0.05 s doubling up to 2 s, each jittered (so workers that lost the server together do not come back
    in lockstep); then :class:`StoreUnavailableError`. Opening the store is retried the same way. Set it to cover
    your failover (``retry_seconds=60``); an attempt itself is bounded by the DSN's ``connect_timeout`` and
    ``lock_timeout`` / ``statement_timeout``, so one operation can take ``retry_seconds`` plus one attempt.

    ``pool_size`` (default 4): how many connections the store object may hold, each lent to one operation (one
    transaction) at a time. A process serving many budgets from one store (a web server's threads, async agents
    whose store work runs in worker threads) would otherwise queue every operation behind one connection: an
    operation waiting on budget A's row, which another process holds, would hold back operations on unrelated
    budgets too. Connections open only when operations overlap, so a process doing one thing at a time keeps one.
    The default is what ``psycopg_pool`` users expect and bounds what each process may take of the server's
    ``max_connections`` (100 by default, a few reserved): 20 busy processes take at most 80. With more processes
    than that, lower it (``pool_size=2``) or raise ``max_connections`` (or put PgBouncer in front, in transaction
    mode: each operation is one transaction); ``pool_size=1`` is the single connection of earlier versions. An
    operation finding all ``pool_size`` connections in use waits for one up to ``pool_timeout`` seconds (default 30,
    psycopg_pool's default; ``None``: without limit), then :class:`StoreUnavailableError`: each operation it waits
    behind is bounded only by the DSN's ``lock_timeout`` / ``statement_timeout`` (PostgreSQL's default: none) and
    the network, so a session that hangs holding its connection would otherwise stall the process's every budget.
    """

    placeholder = "%s"

    def __init__(self, dsn: str, *, lease_seconds: float = 600.0, clock: Callable[[], float] | None = None,
                 retry_seconds: float = 1.0, pool_size: int = DEFAULT_POOL_SIZE,
                 pool_timeout: float | None = DEFAULT_POOL_TIMEOUT) -> None:
        # clock=None (the default): leases in the database server's time, one clock for every machine, so a
        # machine whose clock runs ahead cannot expire another machine's live hold. A callable: that clock
        # (tests that move time).
        super().__init__(lease_seconds=lease_seconds, clock=clock or time.time)
        self.retry_seconds = _seconds(retry_seconds, "retry_seconds",
                                      hint="e.g. retry_seconds=60 to ride out a failover, 0 to never retry")
        if isinstance(pool_size, bool) or not isinstance(pool_size, int) or pool_size < 1:
            raise StoreArgumentError(f"pool_size must be a whole number of connections >= 1, got {pool_size!r}; e.g. "
                                     f"pool_size={DEFAULT_POOL_SIZE} (the default), 1 for one connection that operations "
                                     "take turns on")
        self.pool_size = pool_size
        self.pool_timeout = None if pool_timeout is None else _seconds(
            pool_timeout, "pool_timeout", above_zero=True, meaning=" or None",
            hint=f"e.g. pool_timeout={DEFAULT_POOL_TIMEOUT:g} (the default), None to wait for a free connection "
                 "without limit")
        self._server_clock = clock is None
        # The server time read in each open transaction, by its connection (two run at once on two connections).
        self._tx_time: dict[Any, float] = {}
        try:
            import psycopg
        except ImportError as exc:
            raise StoreError("PostgresBudgetStore needs psycopg: pip install 'intent[postgres]'") from exc
        self.dsn = dsn
        self.shown_dsn = _without_password(dsn)  # what errors and logs print: never the password
        pauses = None
        while True:
            try:
                first = self._connect()
                break
            except psycopg.OperationalError as exc:  # (refused, unreachable, the server starting or shutting down)
                if pauses is None:
                    pauses = _retry_pauses(self.retry_seconds)
                pause = None if _misconfigured(exc) else next(pauses, None)
                if pause is None:
                    raise StoreError(f"cannot connect to the budget store {self.shown_dsn!r}: "
                                     f"{_one_line(exc)}") from exc
                time.sleep(pause)
            except psycopg.Error as exc:  # (a malformed string is a ProgrammingError)
                raise StoreError(f"cannot connect to the budget store {self.shown_dsn!r}: {_one_line(exc)}") from exc
        self._pool = _ConnectionPool(self._connect, pool_size, first, self.pool_timeout)
        try:
            self._open_schema(psycopg)
        except BaseException:
            self._pool.close()
            raise

    def _connect(self) -> Any:
        import psycopg

        return psycopg.connect(self.dsn, autocommit=True)

    def _open_schema(self, psycopg: Any) -> None:
        """Create the tables when they are missing, and check they are this version's and usable by this role.

        Tables that exist are not created again: ``CREATE TABLE IF NOT EXISTS`` needs CREATE on the schema even
        then, which a least-privilege application role lacks (PostgreSQL 15 and later grant none on ``public``)."""
        tables = ("intent_budgets", "intent_charges")
        with self._tx(None) as cur:
            cur.execute("SELECT current_schema(), current_user, to_regclass('intent_budgets') IS NOT NULL, "
                        "to_regclass('intent_charges') IS NOT NULL")
            schema, role, *present = cur.fetchone()
            if not all(present):
                try:
                    with cur.connection.transaction():  # (a savepoint: a refusal leaves the outer transaction usable)
                        cur.execute("SELECT pg_advisory_xact_lock(727274)")  # two processes creating the schema
                        for stmt in _SCHEMA:
                            cur.execute(stmt)
                except psycopg.errors.InsufficientPrivilege as exc:
                    raise StoreError(
                        f"the budget store {self.shown_dsn!r} has no tables {', '.join(tables)} in schema {schema} "
                        f"and its role may not create them ({_one_line(exc)}): open it once as the schema's owner "
                        f"(that creates them), or GRANT CREATE ON SCHEMA {schema} TO {role}") from None
            qualified = []  # schema.table, as a GRANT names it
            for table, cols in zip(tables, (_BUDGET_COLS, _COLS)):
                cur.execute("SELECT format('%%I.%%I', n.nspname, c.relname), array(SELECT attname FROM pg_attribute "
                            "WHERE attrelid = c.oid AND attnum > 0 AND NOT attisdropped) FROM pg_class c JOIN "
                            "pg_namespace n ON n.oid = c.relnamespace WHERE c.oid = to_regclass(%s)", (table,))
                name, columns = cur.fetchone()
                qualified.append(name)
                missing = [c for c in cols.split(", ") if c not in columns]
                if missing:
                    raise StoreError(
                        f"the budget store {self.shown_dsn!r} has a table {name} without the columns {missing}: "
                        "not the columns this version of intent uses (another application's table of that name, or "
                        "an older schema); use another database or schema (options=-c search_path=...)")
            self._charges_table = qualified[1]
            cur.execute("SELECT 1 FROM pg_attribute WHERE attrelid = to_regclass('intent_budgets') AND "
                        "attname = 'currency' AND NOT attisdropped")
            if cur.fetchone() is None:  # tables made before budgets had a currency
                try:
                    with cur.connection.transaction():
                        cur.execute("SELECT pg_advisory_xact_lock(727274)")
                        cur.execute(_ADD_CURRENCY.replace("ADD COLUMN", "ADD COLUMN IF NOT EXISTS"))
                except psycopg.errors.InsufficientPrivilege as exc:
                    raise StoreError(
                        f"the budget store {self.shown_dsn!r} was made by an earlier version of intent and its role "
                        f"may not upgrade it ({_one_line(exc)}): open it once as the owner of {qualified[0]}, or run "
                        f"{_ADD_CURRENCY.replace('intent_budgets', qualified[0])} as that owner") from None
            cur.execute("SELECT 1 FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid WHERE i.indrelid = "
                        "to_regclass('intent_charges') AND c.relname = 'intent_charges_by_time'")
            if cur.fetchone() is None:  # tables made before the index
                try:
                    with cur.connection.transaction():
                        cur.execute("SELECT pg_advisory_xact_lock(727274)")
                        cur.execute(_BY_TIME)
                except psycopg.errors.InsufficientPrivilege as exc:
                    # Not needed to move money: the store works without it, the report and prune read more.
                    log.warning("the budget store %s has no index intent_charges_by_time and its role may not create "
                                "it (%s): the report and prune read a key's whole history until the owner of %s "
                                "runs %s", self.shown_dsn, _one_line(exc), qualified[1],
                                _BY_TIME.replace("INDEX", "INDEX CONCURRENTLY").replace(
                                    "ON intent_charges", f"ON {qualified[1]}"))
            for table in qualified:
                for privilege in ("SELECT", "INSERT", "UPDATE"):
                    cur.execute("SELECT has_table_privilege(%s, %s)", (table, privilege))
                    if not cur.fetchone()[0]:
                        raise StoreError(
                            f"the budget store {self.shown_dsn!r}: role {role} may not {privilege} {table}; "
                            f"GRANT SELECT, INSERT, UPDATE ON {', '.join(qualified)} TO {role}")

    @contextmanager
    def _tx(self, key: str | None) -> Iterator[Any]:
        with self._pool.connection() as conn:
            try:
                with conn.transaction(), conn.cursor() as cur:
                    # The money logic locks the key's row; it needs READ COMMITTED whatever the server's or role's
                    # default (REPEATABLE READ or SERIALIZABLE fail a transaction that waited on the lock).
                    cur.execute("SET TRANSACTION ISOLATION LEVEL READ COMMITTED")
                    if key is not None:
                        cur.execute("SELECT 1 FROM intent_budgets WHERE key = %s FOR UPDATE", (key,))
                    yield cur
            finally:
                self._tx_time.pop(conn, None)  # (the next transaction on it reads its own)

    def _now(self, cur: Any) -> float:
        if not self._server_clock:
            return self._clock()
        conn = cur.connection  # (lent to this transaction alone until it ends)
        now = self._tx_time.get(conn)
        if now is None:  # read once per transaction (after the row lock), one round trip
            cur.execute("SELECT EXTRACT(EPOCH FROM clock_timestamp())")
            now = self._tx_time[conn] = float(cur.fetchone()[0])
        return now

    def close(self) -> None:
        """Close every connection (one in use, when its operation ends); a later operation opens a new one."""
        self._pool.close()


RETRY_PAUSE_FIRST = 0.05  # seconds before the first retry; doubled after each
RETRY_PAUSE_CAP = 2.0  # the longest pause: a long outage is tried every second or two


def _retry_pauses(retry_seconds: float, rand: Callable[[], float] = random.random) -> Iterator[float]:
    """The pauses before each retry, until ``retry_seconds`` from now: exponential, each jittered to 50-100 % of its
    step (workers that lost the server at once spread out), the last one ending at the deadline."""
    deadline = time.monotonic() + retry_seconds
    step = RETRY_PAUSE_FIRST
    while (left := deadline - time.monotonic()) > 0:
        yield min(left, step * (0.5 + rand() / 2))
        step = min(step * 2, RETRY_PAUSE_CAP)


def _misconfigured(exc: BaseException) -> bool:
    """A refusal no retry cures: a database that does not exist, a wrong password (a role that may not log in is
    retried: that is how a server in the middle of a failover or a maintenance window may answer)."""
    return getattr(exc, "sqlstate", None) in ("3D000", "28P01")


def _retried(op: Callable[..., Any]) -> Callable[..., Any]:
    """``op`` run again when PostgreSQL fails it transiently: a connection that dropped (a restart, a
    failover, an idle timeout: reconnected first), a serialization failure or a deadlock, a lock timeout.
    Every operation is idempotent by charge id, so one that committed before its answer was lost changes
    nothing the second time. Still failing ``retry_seconds`` after its first failure: a
    :class:`StoreUnavailableError` naming the store."""
    name = op.__name__.lstrip("_").replace("_", " ").removesuffix(" batch")  # (what messages call it)

    @functools.wraps(op)
    def run(self: PostgresBudgetStore, *args: Any, **kwargs: Any) -> Any:
        import psycopg

        pauses = None
        attempts = 0
        first_failure = 0.0
        while True:
            attempts += 1
            try:
                # (a connection lost in an earlier attempt was discarded: the pool lends another or opens a new
                # one, and a connection refused while the server is away is that attempt's failure, retried)
                return op(self, *args, **kwargs)
            except (psycopg.errors.InsufficientPrivilege, psycopg.errors.UndefinedTable,
                    psycopg.errors.UndefinedColumn) as exc:  # (a grant revoked, a table dropped while workers ran)
                grants = (f"prune deletes: GRANT DELETE ON {self._charges_table} TO the role that prunes (workers "
                          "need none)" if name == "prune" else
                          "SELECT, INSERT, UPDATE on intent_budgets and intent_charges")
                raise StoreError(f"the budget store {self.shown_dsn!r} refused {name}: {_one_line(exc)}; "
                                 f"check its tables and the role's grants ({grants})") from exc
            except PoolTimeout as exc:  # (not retried: the wait for a connection was the retry)
                raise StoreUnavailableError(
                    f"the budget store {self.shown_dsn!r} could not start {name}: all {exc.size} connections of this "
                    f"store object stayed in use by other operations for {exc.timeout:g} s (pool_timeout); a session "
                    "hanging on a lock or the network holds one (set lock_timeout / statement_timeout in the DSN), or "
                    "more operations overlap than pool_size allows (raise it)") from None
            except psycopg.OperationalError as exc:  # (serialization failures, deadlocks, lost connections)
                if pauses is None:
                    pauses = _retry_pauses(self.retry_seconds)
                    first_failure = time.monotonic()
                pause = next(pauses, None)
                if pause is None:
                    raise StoreUnavailableError(
                        f"the budget store {self.shown_dsn!r} failed {name} {attempts} times over "
                        f"{time.monotonic() - first_failure:.1f} s (retry_seconds={self.retry_seconds:g}; raise it "
                        f"to ride out a longer outage): {type(exc).__name__}: {_one_line(exc)}") from exc
                time.sleep(pause)
    return run


for _name in ("create_budget", "currency", "budget", "spent", "reserved", "renew", "left", "reserve", "rekey", "commit",
              "release", "expire_leases", "charges", "keys", "_prune_batch"):
    setattr(PostgresBudgetStore, _name, _retried(getattr(_SqlBudgetStore, _name)))
# Opening too: a worker starting during a failover may lose its new session before the tables are checked.
PostgresBudgetStore._open_schema = _retried(PostgresBudgetStore._open_schema)  # type: ignore[method-assign]
