"""The budget-store conformance suite (``intent.conformance.check_budget_store``): every shipped store passes it
(PostgreSQL on a real server, the ``postgres_dsn`` fixture), and each deliberately broken store below, a
:class:`MemoryBudgetStore` with one money guarantee broken, is caught with the message naming that guarantee."""

from __future__ import annotations

import functools
import re
import threading
import time

import pytest

from intent.conformance import ManualClock, check_budget_store
from intent.errors import UsageError
from intent.ledger import BudgetExceededError
from intent.stores import MemoryBudgetStore, PostgresBudgetStore, SqliteBudgetStore
from intent.stores.base import _no_fit, to_nano


@pytest.fixture(params=["memory", "sqlite", "postgres", "postgres-one-connection"])
def store_factory(request, tmp_path):
    if request.param == "memory":
        return MemoryBudgetStore
    if request.param == "sqlite":
        return functools.partial(SqliteBudgetStore, tmp_path / "budgets.db")
    # (the default pool, whose threads' operations run on connections of their own, and one connection they share)
    pool_size = 1 if request.param == "postgres-one-connection" else 4
    return functools.partial(PostgresBudgetStore, request.getfixturevalue("postgres_dsn"), pool_size=pool_size)


def test_every_shipped_store_passes(store_factory):
    check_budget_store(store_factory)


@pytest.mark.slow  # worker processes (spawned interpreters): run by make test-slow (CI)
@pytest.mark.parametrize("kind", ["sqlite", "postgres"])
def test_the_shipped_shared_stores_pass_with_worker_processes(kind, tmp_path, request):
    factory = (functools.partial(SqliteBudgetStore, tmp_path / "budgets.db") if kind == "sqlite" else
               functools.partial(PostgresBudgetStore, request.getfixturevalue("postgres_dsn")))
    check_budget_store(factory, processes=3)


@pytest.mark.slow  # worker processes
def test_a_store_atomic_only_within_its_process_fails_with_worker_processes(tmp_path):
    factory = functools.partial(LocksInItsProcessOnly, tmp_path / "budgets.db")
    check_budget_store(factory)  # its threads see nothing wrong
    with pytest.raises(AssertionError, match=re.escape("[concurrency: never overspend") + ".* 3 processes held"):
        check_budget_store(factory, processes=3)


@pytest.mark.slow  # waits its leases out in real time (about 8 s)
def test_postgres_passes_with_leases_in_the_servers_time(request):
    dsn = request.getfixturevalue("postgres_dsn")
    check_budget_store(lambda lease_seconds, clock: PostgresBudgetStore(dsn, lease_seconds=lease_seconds),
                       clock="real")


class OnlyTheProtocol:
    """A store of one's own with the required methods only: no rekey, currency or prune."""

    _REQUIRED = {"create_budget", "budget", "spent", "reserved", "left", "reserve", "commit", "release", "renew",
                 "expire_leases", "charges", "close"}

    def __init__(self, *, lease_seconds, clock):
        self.lease_seconds = lease_seconds
        self._inner = MemoryBudgetStore(lease_seconds=lease_seconds, clock=clock)

    def __getattr__(self, name):
        if name not in self._REQUIRED:
            raise AttributeError(name)
        return getattr(self._inner, name)


def test_a_store_without_the_optional_operations_passes():
    check_budget_store(OnlyTheProtocol)


# ============================================================ broken stores, each caught by its property
class SkipsTheFitCheck(MemoryBudgetStore):
    def _reserve(self, key, charge_id, amount, *, run_id, tool, kind, moving=None):
        with self._tx(key) as cur:
            self._row(cur, key)  # (an unknown key is still refused)
            existing = self._get(cur, key, charge_id)
            return existing or self._hold(cur, key, charge_id, to_nano(amount), run_id, tool, kind)


def _check_then_hold(store, key, charge_id, amount, run_id, tool, kind, window=0.002):
    """A reserve in two transactions: the fit checked in one, the hold made ``window`` seconds later in the next."""
    n = to_nano(amount)
    with store._tx(key) as cur:
        store._expire(cur, key)
        existing = store._get(cur, key, charge_id)
        if existing is not None:
            return existing
        budget, spent, reserved = store._row(cur, key)
        if n > 0 and spent + reserved + n > budget:
            raise _no_fit(key, charge_id, n, budget, spent, reserved)
    time.sleep(window)  # (another worker's hold lands here)
    with store._tx(key) as cur:
        return store._hold(cur, key, charge_id, n, run_id, tool, kind)


class ChecksThenHoldsInTwoSteps(MemoryBudgetStore):
    """Right one call at a time; two threads can both pass the check before either holds."""

    def _reserve(self, key, charge_id, amount, *, run_id, tool, kind, moving=None):
        if moving is not None:  # (rekey as shipped)
            return super()._reserve(key, charge_id, amount, run_id=run_id, tool=tool, kind=kind, moving=moving)
        return _check_then_hold(self, key, charge_id, amount, run_id, tool, kind)


class LocksInItsProcessOnly(SqliteBudgetStore):
    """Atomic between its own threads (the store's lock held over both steps), not between processes."""

    def _reserve(self, key, charge_id, amount, *, run_id, tool, kind, moving=None):
        if moving is not None:
            return super()._reserve(key, charge_id, amount, run_id=run_id, tool=tool, kind=kind, moving=moving)
        with self._lock:
            # A wider window than the threads' variant: three spawned processes must overlap at the budget's edge
            # (with 2 ms the suite caught it in about 3 runs of 5 here, so the test failed now and then).
            return _check_then_hold(self, key, charge_id, amount, run_id, tool, kind, window=0.02)


class LooksUpTheChargeIdOutsideTheHold(MemoryBudgetStore):
    """Idempotent one call at a time; threads racing on one charge id both try to hold it."""

    def _reserve(self, key, charge_id, amount, *, run_id, tool, kind, moving=None):
        with self._tx(key) as cur:
            existing = self._get(cur, key, charge_id)
        if existing is not None:
            return existing
        time.sleep(0.002)
        return super()._reserve(key, charge_id, amount, run_id=run_id, tool=tool, kind=kind, moving=moving) \
            if moving is not None else self._hold_fresh(key, charge_id, amount, run_id, tool, kind)

    def _hold_fresh(self, key, charge_id, amount, run_id, tool, kind):
        n = to_nano(amount)
        with self._tx(key) as cur:
            budget, spent, reserved = self._row(cur, key)
            if n > 0 and spent + reserved + n > budget:
                raise _no_fit(key, charge_id, n, budget, spent, reserved)
            return self._hold(cur, key, charge_id, n, run_id, tool, kind)


class RefusesZeroHoldsOnAFullBudget(MemoryBudgetStore):
    def _reserve(self, key, charge_id, amount, **kw):
        if amount == 0 and self.left(key) <= 0:
            raise BudgetExceededError(f"{key!r} has nothing left")
        return super()._reserve(key, charge_id, amount, **kw)


class HoldsARepeatedChargeIdAgain(MemoryBudgetStore):
    def reserve(self, key, charge_id, amount, **kw):
        with self._tx(key) as cur:
            existing = self._get(cur, key, charge_id)
            if existing is not None and existing.status == "reserved":  # "a retry": held once more
                cur.execute("UPDATE intent_budgets SET reserved = reserved + ? WHERE key = ?", (to_nano(amount), key))
                return existing
        return super().reserve(key, charge_id, amount, **kw)


class CountsARepeatedCommitAgain(MemoryBudgetStore):
    def commit(self, key, charge_id, amount=None):
        with self._tx(key) as cur:
            existing = self._get(cur, key, charge_id)
            if existing is not None and existing.status == "committed":
                cur.execute("UPDATE intent_budgets SET spent = spent + ? WHERE key = ?",
                            (to_nano(existing.amount if amount is None else amount), key))
                return existing
        return super().commit(key, charge_id, amount)


class CommitsAReleasedCharge(MemoryBudgetStore):
    def commit(self, key, charge_id, amount=None):
        with self._tx(key) as cur:
            existing = self._get(cur, key, charge_id)
            if existing is not None and existing.status == "released":
                n = to_nano(existing.amount if amount is None else amount)
                cur.execute("UPDATE intent_charges SET status = 'committed', amount = ? WHERE key = ? AND "
                            "charge_id = ?", (n, key, charge_id))
                cur.execute("UPDATE intent_budgets SET spent = spent + ? WHERE key = ?", (n, key))
                return existing
        return super().commit(key, charge_id, amount)


class ReleasesACommittedCharge(MemoryBudgetStore):
    def release(self, key, charge_id):
        with self._tx(key) as cur:
            existing = self._get(cur, key, charge_id)
            if existing is not None and existing.status == "committed":
                cur.execute("UPDATE intent_charges SET status = 'released' WHERE key = ? AND charge_id = ?",
                            (key, charge_id))
                cur.execute("UPDATE intent_budgets SET spent = spent - ? WHERE key = ?",
                            (to_nano(existing.amount), key))
                return existing
        return super().release(key, charge_id)


class KeepsMoneyInFloats(MemoryBudgetStore):
    def _reserve(self, key, charge_id, amount, **kw):
        spent, reserved, budget = self.spent(key), self.reserved(key), self.budget(key)
        if amount > 0 and spent + reserved + amount > budget:  # 0.1 + 0.2 > 0.3 in floats
            raise BudgetExceededError(f"{amount} does not fit")
        return super()._reserve(key, charge_id, amount, **kw)


class LeasesNeverExpire(MemoryBudgetStore):
    def _expire(self, cur, key):
        return []


class LateCommitGivesTheHoldBackAgain(MemoryBudgetStore):
    def commit(self, key, charge_id, amount=None):
        with self._tx(key) as cur:
            self._expire(cur, key)
            was = self._get(cur, key, charge_id)
        charge = super().commit(key, charge_id, amount)
        if was is not None and was.status == "expired":
            with self._tx(key) as cur:
                cur.execute("UPDATE intent_budgets SET reserved = reserved - ? WHERE key = ?",
                            (to_nano(was.amount), key))
        return charge


class RenewRevivesAnExpiredHold(MemoryBudgetStore):
    def renew(self, key, charge_id):
        with self._tx(key) as cur:
            existing = self._get(cur, key, charge_id)
            if existing is not None and existing.status == "expired":
                cur.execute("UPDATE intent_charges SET status = 'reserved', lease_until = ? WHERE key = ? AND "
                            "charge_id = ?", (self._clock() + self.lease_seconds, key, charge_id))
                cur.execute("UPDATE intent_budgets SET reserved = reserved + ? WHERE key = ?",
                            (to_nano(existing.amount), key))
                return True
        return super().renew(key, charge_id)


class RekeyReleasesThenReserves(MemoryBudgetStore):
    """Two steps: a refused rekey has already given the old hold away."""

    def rekey(self, key, old_id, new_id, amount, **kw):
        self.release(key, old_id)
        return self.reserve(key, new_id, amount, **kw)


class PruneDeletesHolds(MemoryBudgetStore):
    def _prune_batch(self, key, older_than_seconds):
        with self._tx(key) as cur:
            cur.execute("DELETE FROM intent_charges WHERE key = ?", (key,))
            return int(cur.rowcount)


class CurrencyForgotten(MemoryBudgetStore):
    def create_budget(self, key, amount, currency=None):
        super().create_budget(key, amount)


def ignores_its_lease(*, lease_seconds, clock):
    return MemoryBudgetStore(clock=clock)


BROKEN = [
    (ignores_its_lease, "shape: lease_seconds as given"),
    (SkipsTheFitCheck, "reserve: a hold that does not fit is refused"),
    (ChecksThenHoldsInTwoSteps, "concurrency: never overspend"),
    (LooksUpTheChargeIdOutsideTheHold, "concurrency: threads racing on one charge id hold and charge it once"),
    (RefusesZeroHoldsOnAFullBudget, "reserve: a hold of 0 always fits"),
    (HoldsARepeatedChargeIdAgain, "reserve: idempotent by charge id"),
    (CountsARepeatedCommitAgain, "commit: idempotent by charge id"),
    (CommitsAReleasedCharge, "commit: refused after release"),
    (ReleasesACommittedCharge, "release: never releases a committed charge"),
    (KeepsMoneyInFloats, "amounts are exact"),
    (LeasesNeverExpire, "leases: a hold past lease_seconds is released"),
    (LateCommitGivesTheHoldBackAgain, "leases: a late commit is still charged and flagged late"),
    (RenewRevivesAnExpiredHold, "renew: False for a charge no longer held"),
    (RekeyReleasesThenReserves, "rekey: a refusal keeps the old hold"),
    (PruneDeletesHolds, "prune: deletes settled charges, never a hold nor the totals"),
    (CurrencyForgotten, "currency: kept with the budget, refused when another"),
]


@pytest.mark.parametrize("broken, prop", BROKEN, ids=[getattr(b, "__name__", "?") for b, _ in BROKEN])
def test_a_store_that_breaks_a_guarantee_fails_on_that_guarantee(broken, prop):
    with pytest.raises(AssertionError, match=r"^\[" + re.escape(prop)):
        check_budget_store(broken)


def test_a_store_operation_that_never_returns_fails_the_check_instead_of_hanging(monkeypatch):
    from intent.stores import conformance

    monkeypatch.setattr(conformance, "WORKER_TIMEOUT", 0.5)
    gate = threading.Event()

    class NeverReturnsInWorkers(MemoryBudgetStore):
        def reserve(self, key, charge_id, amount, **kw):
            if threading.current_thread().name.startswith("conformance-"):  # (the suite's worker threads)
                gate.wait()
            return super().reserve(key, charge_id, amount, **kw)

    try:
        with pytest.raises(AssertionError, match=re.escape("[concurrency: one store used from threads] 8 of 8 "
                                                           "threads still ran 0.5 s")):
            check_budget_store(NeverReturnsInWorkers)
    finally:
        gate.set()  # (the threads left behind end)


# ============================================================ the suite's own arguments
def test_the_suite_takes_a_factory_and_says_how_to_write_one():
    with pytest.raises(UsageError, match="takes a factory that makes the store"):
        check_budget_store(MemoryBudgetStore())
    with pytest.raises(UsageError, match="must take both keywords"):
        check_budget_store(lambda: MemoryBudgetStore())
    with pytest.raises(UsageError, match="clock must be 'manual'"):
        check_budget_store(MemoryBudgetStore, clock="fake")
    with pytest.raises(UsageError, match="threads must be an int >= 2"):
        check_budget_store(MemoryBudgetStore, threads=1)
    with pytest.raises(UsageError, match="a factory that pickles"):
        check_budget_store(lambda lease_seconds, clock: MemoryBudgetStore(), processes=2)


def test_the_manual_clock_moves_only_when_told():
    clock = ManualClock(100.0)
    assert clock() == 100.0
    clock.advance(61)
    assert clock() == 161.0
