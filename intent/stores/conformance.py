"""Conformance checks every shared-budget store must pass (run them in your store's tests).

``check_budget_store(factory)`` checks that a :class:`~intent.stores.BudgetStore` keeps the money guarantees the
guard relies on, against the store's own answers *and* money counted outside it. ``factory(lease_seconds=...,
clock=...)`` makes a store; it is called once per check (and once in each worker process when ``processes`` > 0),
and every check uses fresh keys (``conformance/<random>/<check>``), so a database holding other budgets is safe to
test against. The shipped stores are factories as they are: ``check_budget_store(MemoryBudgetStore)``,
``check_budget_store(functools.partial(SqliteBudgetStore, path))``.

What it checks, each failure an ``AssertionError`` whose message starts with the property in brackets
(``[reserve: a hold that does not fit is refused] ...``) and says what the store did and what it should do:

* the shape: the protocol's methods, and ``lease_seconds`` as the factory was given it;
* ``create_budget``: idempotent with the same amount, refused (:class:`~intent.stores.StoreError`) with another;
  an unknown key is a ``StoreError`` (never a refusal that looks like an empty budget);
* ``budget`` / ``spent`` / ``reserved`` / ``left``: ``left == budget - spent - reserved`` (never below 0), with
  exact amounts (0.1 + 0.2 fills a budget of 0.3: keep integer units, not floats);
* ``reserve``: holds what fits; raises :class:`~intent.ledger.BudgetExceededError` and changes nothing when it does
  not fit; a hold of 0 always fits, even on a budget an overrun took (how money already spent is charged);
  idempotent by charge id (a repeat holds nothing more, also once the budget is full, also after a commit);
* ``commit``: at the hold (no amount), below it (the rest given back), above it (all of it charged); idempotent;
  refused (``StoreError``) for a released charge or one never reserved;
* ``release``: gives the hold back once; never releases a committed charge; an unknown id changes nothing;
* leases: a hold past ``lease_seconds`` is released (``left`` counts it free, ``expire_leases`` reports it, its
  charge reads ``expired``); a late commit is still charged, flagged ``late``, and gives back no hold twice;
  ``renew`` extends a held lease and is ``False`` for a charge no longer held (never revives it);
* keys are isolated (one charge id on two keys is two charges); ``charges(key)`` lists each charge once with
  its status and billed amount, and the committed ones sum to ``spent``;
* concurrency: ``threads`` threads on one store object (the guard renews leases and, under asyncio, works in
  threads) hammer ``reserve`` / ``commit`` / ``release`` at the budget's edge: the money they hold at once plus
  what they committed, counted by the threads, never exceeds the budget, and at the end ``reserved == 0`` and
  ``spent == Σ`` of their commits; threads racing on one charge id hold and charge it once; with
  ``processes`` > 0 the same in worker processes (the factory must then be picklable and open the same
  budgets in every process: not the memory store);
* only when the store has them: ``currency`` (kept, refused when another), ``rekey`` (moves a held charge in one
  step, reserves afresh one no longer held, a refusal keeps the old hold), ``prune`` (deletes settled charges,
  never a hold nor the totals; a commit of a pruned charge is a ``StoreError``).

**Time.** ``clock="manual"`` (the default): the factory gets a :class:`ManualClock` and the store must read the
time of its leases from it; the suite moves it, so nothing waits. ``clock="real"``: for a store that keeps lease
time on its server (as :class:`~intent.stores.PostgresBudgetStore` does without ``clock=``): the factory gets
``time.time`` and may ignore it; leases are ``REAL_LEASE_SECONDS`` long and the suite waits them out (about 8 s).
"""

from __future__ import annotations

import pickle
import random
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, Literal

from intent.errors import UsageError
from intent.ledger import BudgetExceededError
from intent.stores.base import StoreError

__all__ = ["REAL_LEASE_SECONDS", "ManualClock", "check_budget_store"]

_EPS = 1e-9  # money compared to a nano-unit: the shipped stores keep integer nano-units
MANUAL_LEASE_SECONDS = 60.0
REAL_LEASE_SECONDS = 1.0  # long enough for a renewal's margin (a quarter lease) on a busy machine
WORKER_TIMEOUT = 120.0  # seconds the concurrent workers may take in all before the check fails (never a hang)
_REQUIRED = ("create_budget", "budget", "spent", "reserved", "left", "reserve", "commit", "release", "renew",
             "expire_leases", "charges")


class ManualClock:
    """A clock moved by hand (seconds since the epoch, starting now): pass it as a store's ``clock=`` and call
    :meth:`advance` to run leases out without waiting. Thread-safe."""

    def __init__(self, start: float | None = None) -> None:
        self._now = time.time() if start is None else float(start)
        self._lock = threading.Lock()

    def __call__(self) -> float:
        with self._lock:
            return self._now

    def advance(self, seconds: float) -> None:
        with self._lock:
            self._now += float(seconds)


def check_budget_store(factory: Callable[..., Any], *, clock: Literal["manual", "real"] = "manual",
                       threads: int = 8, processes: int = 0) -> None:
    """Check that the stores ``factory(lease_seconds=..., clock=...)`` makes keep the protocol's money guarantees
    (the module's docstring lists them). Raises ``AssertionError`` naming the first property broken."""
    if not callable(factory) or (not isinstance(factory, type) and hasattr(factory, "reserve")):  # a store itself
        raise UsageError(f"check_budget_store takes a factory that makes the store (called with lease_seconds= and "
                         f"clock=), got {type(factory).__name__} {factory!r:.60}; pass the class, or "
                         "lambda lease_seconds, clock: MyStore(..., lease_seconds=lease_seconds, clock=clock)")
    if clock not in ("manual", "real"):
        raise UsageError(f"clock must be 'manual' (the store reads the ManualClock the factory is given) or 'real' "
                         f"(the store keeps its own time: the suite waits its leases out), got {clock!r}")
    if isinstance(threads, bool) or not isinstance(threads, int) or threads < 2:
        raise UsageError(f"threads must be an int >= 2 (threads racing on one store), got {threads!r}")
    if isinstance(processes, bool) or not isinstance(processes, int) or processes < 0:
        raise UsageError(f"processes must be an int >= 0 (0: no worker processes), got {processes!r}")
    if processes:
        try:
            pickle.dumps(factory)
        except (pickle.PicklingError, AttributeError, TypeError) as exc:  # (a lambda, a local function, a lock)
            raise UsageError(f"processes={processes} needs a factory that pickles (a module-level function or a "
                             f"functools.partial of the store's class), got {factory!r:.60}: {exc}") from None
    suite = _Suite(factory, clock, threads)
    for check in (_check_shape, _check_create, _check_currency, _check_arithmetic, _check_reserve_fit,
                  _check_zero_hold, _check_reserve_idempotent, _check_commit, _check_release, _check_leases,
                  _check_renew, _check_keys_isolated, _check_charges, _check_rekey, _check_prune, _check_threads,
                  _check_one_charge_raced):
        suite.run(check)
    if processes:
        _check_processes(suite, processes)


# ----------------------------------------------------------------------------------------------- machinery
def _fail(prop: str, detail: str) -> AssertionError:
    """The failure of the property ``prop``: its name first, in brackets, then what the store did."""
    return AssertionError(f"[{prop}] {detail}")


def _require(ok: Any, prop: str, detail: str) -> None:
    if not ok:
        raise _fail(prop, detail)


def _same(a: float, b: float) -> bool:
    return abs(a - b) <= _EPS


class _Suite:
    def __init__(self, factory: Callable[..., Any], clock: str, threads: int) -> None:
        self.factory, self.real, self.threads = factory, clock == "real", threads
        self.tag = uuid.uuid4().hex[:10]
        self.lease = REAL_LEASE_SECONDS if self.real else MANUAL_LEASE_SECONDS

    def make(self) -> tuple[Any, Callable[[float], None]]:
        """A fresh store, and how to move its time forward."""
        if self.real:
            clock: Callable[[], float] = time.time
            advance: Callable[[float], None] = time.sleep
        else:
            manual = ManualClock()
            clock, advance = manual, manual.advance
        try:
            store = self.factory(lease_seconds=self.lease, clock=clock)
        except TypeError as exc:
            raise UsageError(f"factory(lease_seconds={self.lease:g}, clock=...) raised TypeError: {exc}; the factory "
                             "must take both keywords and pass them to the store, e.g. lambda lease_seconds, "
                             "clock: MyStore(..., lease_seconds=lease_seconds, clock=clock)") from exc
        return store, advance

    def run(self, check: Callable[[_Trial], None]) -> None:
        store, advance = self.make()
        try:
            check(_Trial(self, store, advance, check.__name__.removeprefix("_check_")))
        finally:
            close = getattr(store, "close", None)
            if callable(close):
                close()


class _Trial:
    """One check's store, its fresh keys, and its time."""

    def __init__(self, suite: _Suite, store: Any, advance: Callable[[float], None], name: str) -> None:
        self.suite, self.store, self.advance, self.name = suite, store, advance, name
        self.lease = suite.lease
        self._n = 0

    def key(self, amount: float | None = None) -> str:
        """A fresh key, created with ``amount`` unless None."""
        self._n += 1
        key = f"conformance/{self.suite.tag}/{self.name}-{self._n}"
        if amount is not None:
            self.store.create_budget(key, amount)
        return key

    def totals(self, key: str) -> tuple[float, float, float]:
        return self.store.spent(key), self.store.reserved(key), self.store.left(key)

    def expect_totals(self, key: str, prop: str, spent: float, reserved: float, left: float, after: str) -> None:
        got = self.totals(key)
        _require(all(_same(g, w) for g, w in zip(got, (spent, reserved, left))), prop,
                 f"after {after}: spent, reserved, left are {_fmt(got)}, should be {_fmt((spent, reserved, left))}")

    def statuses(self, key: str) -> dict[str, str]:
        return {c.charge_id: c.status for c in self.store.charges(key)}


def _fmt(values: tuple[float, ...]) -> str:
    return ", ".join(f"{v:g}" for v in values)


@contextmanager
def _refused(prop: str, what: str, errors: tuple[type[BaseException], ...], should: str) -> Iterator[None]:
    """``what`` must raise one of ``errors``."""
    names = " or ".join(e.__name__ for e in errors)
    try:
        yield
    except errors:
        return
    except Exception as exc:
        raise _fail(prop, f"{what} raised {type(exc).__name__} ({exc}), not {names}: {should}") from exc
    raise _fail(prop, f"{what} succeeded; it must raise {names}: {should}")


# ----------------------------------------------------------------------------------------------- the checks
def _check_shape(t: _Trial) -> None:
    missing = [m for m in _REQUIRED if not callable(getattr(t.store, m, None))]
    _require(not missing, "shape: the BudgetStore protocol's methods",
             f"{type(t.store).__name__} lacks {', '.join(missing)} (intent.stores.BudgetStore lists them)")
    lease = getattr(t.store, "lease_seconds", None)
    _require(isinstance(lease, (int, float)) and _same(float(lease), t.lease), "shape: lease_seconds as given",
             f"factory(lease_seconds={t.lease:g}, clock=...) made a store whose lease_seconds is {lease!r}: pass "
             "lease_seconds (and clock) through to the store (the lease checks and the guard's LeaseKeeper read it)")


def _check_create(t: _Trial) -> None:
    prop = "create_budget: idempotent with the same amount, refused with another"
    key = t.key(2.5)
    got = (t.store.budget(key), *t.totals(key))
    _require(all(_same(g, w) for g, w in zip(got, (2.5, 0, 0, 2.5))), "create_budget: a new budget is all left",
             f"create_budget({key!r}, 2.5), then budget, spent, reserved, left are {_fmt(got)}, should be 2.5, 0, "
             "0, 2.5")
    try:
        t.store.create_budget(key, 2.5)
    except Exception as exc:
        raise _fail(prop, f"create_budget of an existing key with its own amount raised {type(exc).__name__} "
                    f"({exc}); it must do nothing (every worker creates its period's budget at start-up)") from exc
    with _refused(prop, f"create_budget({key!r}, 3.0) on a budget of 2.5", (StoreError,),
                  "a budget is never changed in place (a new period is a new key)"):
        t.store.create_budget(key, 3.0)
    _require(_same(t.store.budget(key), 2.5), prop, f"a refused create_budget changed the budget to "
             f"{t.store.budget(key):g}; it must stay 2.5")
    unknown = t.key()
    should = "an unknown key is an error naming it (the guard's outbox drops a commit the store refuses so)"
    for name, call in (("left", lambda: t.store.left(unknown)), ("budget", lambda: t.store.budget(unknown)),
                       ("reserve", lambda: t.store.reserve(unknown, "c", 0.1)),
                       ("commit", lambda: t.store.commit(unknown, "c"))):
        with _refused("an unknown key is a StoreError", f"{name} on the key {unknown!r} never created",
                      (StoreError,), should):
            call()


def _check_currency(t: _Trial) -> None:
    if not callable(getattr(t.store, "currency", None)):
        return  # optional: a store without currency(key) is not asked
    prop = "currency: kept with the budget, refused when another"
    key = t.key()
    try:
        t.store.create_budget(key, 1.0, currency="USD")
    except TypeError as exc:
        raise _fail(prop, f"the store has currency(key) but create_budget(key, amount, currency='USD') raised "
                    f"TypeError ({exc}): take currency= (None: says nothing) or drop currency()") from exc
    _require(t.store.currency(key) == "USD", prop, f"create_budget(..., currency='USD'), then currency(key) is "
             f"{t.store.currency(key)!r}")
    t.store.create_budget(key, 1.0, currency="USD")
    t.store.create_budget(key, 1.0)  # (None says nothing about the currency: accepted)
    with _refused(prop, "create_budget(key, 1.0, currency='EUR') on a budget in USD", (StoreError,),
                  "a budget has one currency (a guard counting in EUR must not draw on dollars)"):
        t.store.create_budget(key, 1.0, currency="EUR")
    _require(t.store.currency(key) == "USD", prop, f"a refused create_budget changed the currency to "
             f"{t.store.currency(key)!r}")
    plain = t.key(1.0)
    _require(t.store.currency(plain) is None, prop, f"a budget created without a currency has currency "
             f"{t.store.currency(plain)!r}; it must be None")


def _check_arithmetic(t: _Trial) -> None:
    prop = "totals: left == budget - spent - reserved"
    key = t.key(10.0)
    t.store.reserve(key, "a", 3.0)
    t.store.reserve(key, "b", 2.5)
    t.expect_totals(key, prop, 0, 5.5, 4.5, "holds of 3 and 2.5 on a budget of 10")
    t.store.commit(key, "a")
    t.expect_totals(key, prop, 3, 2.5, 4.5, "committing the hold of 3 at its amount")
    t.store.commit(key, "b", 1.0)
    t.expect_totals(key, prop, 4, 0, 6, "committing the hold of 2.5 at 1")
    _require(_same(t.store.budget(key), 10.0), prop, f"the budget moved to {t.store.budget(key):g}: it stays 10")
    exact = "amounts are exact (keep integer units, not floats)"
    key = t.key(0.3)
    t.store.reserve(key, "x", 0.1)
    try:
        t.store.reserve(key, "y", 0.2)
    except BudgetExceededError as exc:
        raise _fail(exact, f"0.2 after 0.1 on a budget of 0.3 was refused ({exc}): in floats 0.1 + 0.2 > 0.3; "
                    "keep money in integer units (the shipped stores use nano-units)") from exc
    t.store.commit(key, "x")
    t.store.commit(key, "y")
    t.expect_totals(key, exact, 0.3, 0, 0, "0.1 and 0.2 committed on a budget of 0.3")


def _check_reserve_fit(t: _Trial) -> None:
    prop = "reserve: a hold that does not fit is refused"
    key = t.key(1.0)
    t.store.reserve(key, "a", 0.6)
    with _refused(prop, "reserve of 0.5 with 0.4 left (budget 1, 0.6 held)", (BudgetExceededError,),
                  "the guard turns only BudgetExceededError into a refusal; anything else lets money through that "
                  "is not there or crashes the run"):
        t.store.reserve(key, "b", 0.5)
    unchanged = "reserve: a refused hold changes nothing"
    t.expect_totals(key, unchanged, 0, 0.6, 0.4, "a refused reserve of 0.5")
    _require(t.statuses(key).get("b") in (None, "released", "expired"), unchanged,
             f"the refused charge 'b' is listed as {t.statuses(key).get('b')!r} in charges()")
    try:
        t.store.reserve(key, "b", 0.4)
    except BudgetExceededError as exc:
        raise _fail(prop, f"a hold of exactly what is left (0.4 of budget 1, 0.6 held) was refused ({exc}): a "
                    "hold fits when spent + reserved + amount <= budget") from exc
    t.expect_totals(key, unchanged, 0, 1.0, 0, "reserving 0.4 under the id refused before (its refusal must not "
                    "have used the id)")
    with _refused(prop, "reserve of 0.001 on a budget fully held", (BudgetExceededError,),
                  "any hold above 0 must fit in what is left"):
        t.store.reserve(key, "c", 0.001)
    with _refused("reserve: a negative amount is refused", "reserve of -1.0", (ValueError, StoreError),
                  "a negative hold would create money"):
        t.store.reserve(key, "neg", -1.0)
    t.expect_totals(key, "reserve: a negative amount is refused", 0, 1.0, 0, "a refused reserve of -1")


def _check_zero_hold(t: _Trial) -> None:
    prop = "reserve: a hold of 0 always fits"
    why = ("it is how money already spent (an unmetered model answer, an oracle's decision, a late bill) is "
           "charged: reserve(key, id, 0) then commit(key, id, amount)")
    key = t.key(1.0)
    t.store.reserve(key, "full", 1.0)
    try:
        t.store.reserve(key, "z0", 0.0)
    except BudgetExceededError as exc:
        raise _fail(prop, f"a hold of 0 on a budget fully held was refused ({exc}): {why}") from exc
    t.store.commit(key, "z0", 0.25)
    t.store.commit(key, "full", 1.5)  # an overrun: the provider billed above the hold
    t.expect_totals(key, "commit: above the hold, all of it is charged", 1.75, 0, 0,
                    "committing a hold of 0 at 0.25 and a hold of 1 at 1.5 on a budget of 1 (left never below 0)")
    try:
        t.store.reserve(key, "z1", 0.0)
    except BudgetExceededError as exc:
        raise _fail(prop, f"a hold of 0 on a budget an overrun took (spent 1.75 of 1) was refused ({exc}): "
                    f"{why}") from exc
    t.store.commit(key, "z1", 0.1)
    _require(_same(t.store.spent(key), 1.85), prop, f"a hold of 0 committed at 0.1 on an overspent budget left spent "
             f"{t.store.spent(key):g}, should be 1.85")
    with _refused("reserve: a hold that does not fit is refused", "reserve of 0.01 on a budget an overrun took",
                  (BudgetExceededError,), "an overspent budget has nothing left"):
        t.store.reserve(key, "more", 0.01)


def _check_reserve_idempotent(t: _Trial) -> None:
    prop = "reserve: idempotent by charge id"
    key = t.key(1.0)
    t.store.reserve(key, "a", 0.4)
    t.store.reserve(key, "a", 0.4)
    t.expect_totals(key, prop, 0, 0.4, 0.6, "reserving 'a' (0.4) twice: one hold")
    t.store.reserve(key, "a", 0.5)
    _require(_same(t.store.reserved(key), 0.4) or _same(t.store.reserved(key), 0.5), prop,
             f"reserving 'a' again with 0.5 made reserved {t.store.reserved(key):g}: a charge id holds once")
    t.store.release(key, "a")
    t.store.reserve(key, "big", 0.7)
    try:
        t.store.reserve(key, "big", 0.7)
    except BudgetExceededError as exc:
        raise _fail(prop, f"a repeated reserve of a hold already made was refused ({exc}) because the budget "
                    "had no room for a second one: a reserve retried after its answer was lost must find its "
                    "hold") from exc
    t.store.commit(key, "big")
    t.store.reserve(key, "big", 0.7)
    t.expect_totals(key, prop, 0.7, 0, 0.3, "reserving 'big' again after its commit (a retried call)")
    t.store.reserve(key, "gone", 0.2)
    t.store.release(key, "gone")
    t.store.reserve(key, "gone", 0.2)
    t.expect_totals(key, prop, 0.7, 0, 0.3, "reserving 'gone' again after its release (a charge id is used once)")


def _check_commit(t: _Trial) -> None:
    key = t.key(10.0)
    t.store.reserve(key, "a", 2.0)
    t.store.commit(key, "a")
    t.expect_totals(key, "commit: no amount charges the hold", 2, 0, 8, "committing a hold of 2 with no amount")
    t.store.reserve(key, "b", 3.0)
    t.store.commit(key, "b", 1.0)
    t.expect_totals(key, "commit: below the hold, the rest is given back", 3, 0, 7,
                    "committing a hold of 3 at 1")
    t.store.reserve(key, "c", 1.0)
    t.store.commit(key, "c", 4.0)
    t.expect_totals(key, "commit: above the hold, all of it is charged", 7, 0, 3, "committing a hold of 1 at 4")
    prop = "commit: idempotent by charge id"
    for amount in (4.0, None, 9.0):
        t.store.commit(key, "c", amount)
        t.expect_totals(key, prop, 7, 0, 3, f"committing 'c' again (amount {amount}): a commit resent after its "
                        "answer was lost must not charge twice")
    t.store.commit(key, "b", 1.0)
    t.expect_totals(key, prop, 7, 0, 3, "committing 'b' again")
    with _refused("commit: refused for a charge never reserved", "commit of 'never'", (StoreError,),
                  "a commit of a charge the store does not know must not charge money nor pass in silence"):
        t.store.commit(key, "never", 1.0)
    t.store.reserve(key, "d", 1.0)
    t.store.release(key, "d")
    with _refused("commit: refused after release", "commit of 'd' after its release", (StoreError,),
                  "a released charge's money may already be someone else's: its call must not have run"):
        t.store.commit(key, "d")
    t.expect_totals(key, "commit: refused after release", 7, 0, 3, "a refused commit of a released charge")
    t.store.reserve(key, "e", 1.0)
    with _refused("commit: a negative amount is refused", "commit of 'e' at -1.0", (ValueError, StoreError),
                  "a negative charge would create money"):
        t.store.commit(key, "e", -1.0)
    t.expect_totals(key, "commit: a negative amount is refused", 7, 1, 2, "a refused commit at -1")


def _check_release(t: _Trial) -> None:
    prop = "release: gives the hold back once"
    key = t.key(1.0)
    t.store.reserve(key, "a", 0.4)
    released = t.store.release(key, "a")
    t.expect_totals(key, prop, 0, 0, 1, "releasing a hold of 0.4")
    _require(released is None or getattr(released, "status", None) == "released", prop,
             f"release returned {released!r}; it returns the charge, released (or None)")
    t.store.release(key, "a")
    t.expect_totals(key, prop, 0, 0, 1, "releasing it again (a repeat gives nothing back twice)")
    keep = "release: never releases a committed charge"
    t.store.reserve(key, "b", 0.5)
    t.store.commit(key, "b")
    t.store.release(key, "b")
    t.expect_totals(key, keep, 0.5, 0, 0.5, "releasing a committed charge of 0.5 (its call ran: its money is spent)")
    _require(t.statuses(key).get("b") == "committed", keep, f"after release, the committed charge 'b' reads "
             f"{t.statuses(key).get('b')!r} in charges()")
    t.store.release(key, "never")
    t.expect_totals(key, "release: an unknown charge id changes nothing", 0.5, 0, 0.5, "releasing 'never'")


def _check_leases(t: _Trial) -> None:
    L = t.lease
    prop = "leases: a hold past lease_seconds is released"
    key = t.key(1.0)
    t.store.reserve(key, "slow", 0.6)
    with _refused("reserve: a hold that does not fit is refused", "reserve of 0.6 with 0.4 left",
                  (BudgetExceededError,), "a live hold keeps its money"):
        t.store.reserve(key, "other", 0.6)
    t.advance(L / 2)
    _require(_same(t.store.reserved(key), 0.6), "leases: a hold is kept until its lease ends",
             f"half a lease after a hold of 0.6, reserved is {t.store.reserved(key):g}")
    t.advance(L / 2 + L / 10)
    _require(_same(t.store.left(key), 1.0), prop, f"{1.1 * L:g} s after a hold of 0.6 whose lease is {L:g} s (a "
             f"process that died mid-call), left is {t.store.left(key):g}, should be 1: its money never comes back")
    try:
        t.store.reserve(key, "other", 0.6)
    except BudgetExceededError as exc:
        raise _fail(prop, f"the money of an expired hold could not be reserved again ({exc})") from exc
    t.store.expire_leases(key)
    status = t.statuses(key).get("slow")
    _require(status == "expired", prop, f"charges() lists the expired hold 'slow' as {status!r}, not 'expired'")
    late = "leases: a late commit is still charged and flagged late"
    charge = t.store.commit(key, "slow")  # the call ran after all: its money was spent
    _require(getattr(charge, "late", None) is True and getattr(charge, "status", None) == "committed", late,
             f"commit of a charge whose lease expired returned {charge!r}; it must be status 'committed', late=True")
    t.expect_totals(key, late, 0.6, 0.6, 0, "a late commit of the expired 0.6, with another 0.6 held (it gives back "
                    "no hold: its lease's expiry did)")
    listed = {c.charge_id: c for c in t.store.charges(key)}["slow"]
    _require(listed.status == "committed" and listed.late is True, late,
             f"charges() lists the late commit as {listed!r}; it must read committed, late=True")

    prop = "leases: expire_leases reports what it released"
    key = t.key(1.0)
    t.store.reserve(key, "e", 0.3)
    t.advance(1.1 * L)
    expired = t.store.expire_leases(key)
    _require([c.charge_id for c in expired] == ["e"] and expired[0].status == "expired", prop,
             f"expire_leases(key) after a hold's lease ended returned {expired!r}; it must list that charge, expired")
    again = t.store.expire_leases(key)
    _require(not again, prop, f"expire_leases(key) a second time returned {again!r}: a hold expires once")
    t.store.release(key, "e")
    t.expect_totals(key, prop, 0, 0, 1, "a hold expired, then expire_leases twice and release (nothing given back "
                    "twice)")
    # (expire_leases() of every key is not called: with the suite's clock ahead it would expire the live holds of
    # other budgets in a database shared with them)


def _check_renew(t: _Trial) -> None:
    L = t.lease
    prop = "renew: extends a held lease"
    key = t.key(1.0)
    t.store.reserve(key, "r", 0.5)
    t.advance(0.6 * L)
    renewed = t.store.renew(key, "r")
    _require(renewed is True, prop, f"renew of a hold whose lease has not ended returned {renewed!r}, not True")
    t.advance(0.6 * L)
    _require(_same(t.store.reserved(key), 0.5), prop, f"a hold renewed {0.6 * L:g} s ago (lease {L:g} s, "
             f"{1.2 * L:g} s after it was made) was released: reserved is {t.store.reserved(key):g} (a long call "
             "loses its money while it runs)")
    gone = "renew: False for a charge no longer held"
    t.store.commit(key, "r")
    _require(t.store.renew(key, "r") is False, gone, "renew of a committed charge did not return False")
    _require(t.store.renew(key, "never") is False, gone, "renew of an unknown charge id did not return False")
    t.store.reserve(key, "q", 0.2)
    t.store.reserve(key, "p", 0.2)
    t.advance(1.1 * L)
    _require(t.store.renew(key, "q") is False, gone, "renew of a hold whose lease had ended did not return False "
             "(its money may be another run's by now; the LeaseKeeper warns on False)")
    t.store.left(key)  # (another run's reserve or read may have released it already)
    _require(t.store.renew(key, "p") is False, gone, "renew of a hold whose lease had ended and was released did "
             "not return False")
    t.expect_totals(key, gone, 0.5, 0, 0.5, "renewing two expired holds (renew must not revive them)")


def _check_keys_isolated(t: _Trial) -> None:
    prop = "keys: isolated (a charge id is per key)"
    one, two = t.key(1.0), t.key(1.0)
    t.store.reserve(one, "x", 1.0)
    try:
        t.store.reserve(two, "x", 1.0)
    except BudgetExceededError as exc:
        raise _fail(prop, f"a hold of 1 on a second key of 1 was refused while the first key was full "
                    f"({exc})") from exc
    t.store.commit(one, "x", 0.7)
    t.expect_totals(two, prop, 0, 1.0, 0, "committing 'x' on the other key")
    t.store.release(two, "x")
    t.expect_totals(one, prop, 0.7, 0, 0.3, "releasing 'x' on the other key")
    t.expect_totals(two, prop, 0, 0, 1, "releasing 'x' on this key")
    keys = {c.key for c in t.store.charges(one)}
    _require(keys == {one}, prop, f"charges({one!r}) lists charges of the keys {sorted(keys)}")


def _check_charges(t: _Trial) -> None:
    prop = "charges: each charge once, with its status and billed amount"
    key = t.key(5.0)
    t.store.reserve(key, "a", 1.0)
    t.store.commit(key, "a")
    t.store.reserve(key, "b", 0.5)
    t.store.commit(key, "b", 0.2)
    t.store.reserve(key, "c", 0.3)
    t.store.release(key, "c")
    t.store.reserve(key, "d", 0.4)
    listed = t.store.charges(key)
    ids = [c.charge_id for c in listed]
    _require(sorted(ids) == ["a", "b", "c", "d"], prop, f"charges(key) lists {ids}, should list a, b, c, d once each")
    got = {c.charge_id: (c.status, round(c.amount, 9)) for c in listed}
    want = {"a": ("committed", 1.0), "b": ("committed", 0.2), "c": ("released", 0.3), "d": ("reserved", 0.4)}
    _require(got == want, prop, f"charges(key) reads {got}, should read {want} (a commit's amount is what was billed)")
    spent = sum(c.amount for c in listed if c.status == "committed")
    _require(_same(spent, t.store.spent(key)), prop, f"the committed charges sum to {spent:g} but spent is "
             f"{t.store.spent(key):g}")


def _check_rekey(t: _Trial) -> None:
    if not callable(getattr(t.store, "rekey", None)):
        return  # optional: without it the guard releases and reserves
    prop = "rekey: moves a held charge in one step"
    key = t.key(10.0)
    t.store.reserve(key, "old", 6.0)
    try:
        t.store.rekey(key, "old", "new", 6.0)
    except BudgetExceededError as exc:
        raise _fail(prop, f"rekey of a hold of 6 to a new id on a budget of 10 was refused ({exc}): the old "
                    "hold is given back in the same step, never two holds at once") from exc
    t.expect_totals(key, prop, 0, 6, 4, "rekey of a hold of 6")
    statuses = t.statuses(key)
    _require(statuses.get("new") == "reserved" and statuses.get("old") != "reserved", prop,
             f"after rekey, charges() reads old: {statuses.get('old')!r}, new: {statuses.get('new')!r}; the hold "
             "must be the new id's")
    t.store.rekey(key, "old", "new", 6.0)
    t.expect_totals(key, "rekey: idempotent by the new id", 0, 6, 4, "the same rekey again")
    t.store.commit(key, "new")
    afresh = "rekey: reserves afresh a charge no longer held"
    with _refused(afresh, "rekey of the committed 'new' (6 of 10 spent) to 'again' with 6", (BudgetExceededError,),
                  "a charge no longer held is not reused (its run committed it): the new id is reserved afresh, "
                  "and 6 more does not fit"):
        t.store.rekey(key, "new", "again", 6.0)
    t.store.rekey(key, "new", "fits", 4.0)
    t.expect_totals(key, afresh, 6, 4, 0, "rekey of the committed 'new' to 'fits' with 4")
    atomic = "rekey: a refusal keeps the old hold"
    key = t.key(10.0)
    t.store.reserve(key, "a", 6.0)
    t.store.reserve(key, "b", 3.0)
    with _refused(atomic, "rekey of a hold of 6 to 8 with 3 held by another (budget 10)", (BudgetExceededError,),
                  "8 + 3 > 10"):
        t.store.rekey(key, "a", "a2", 8.0)
    t.expect_totals(key, atomic, 0, 9, 1, "a refused rekey (the old hold of 6 must still be held: one step)")
    t.store.release(key, "b")
    t.store.rekey(key, "a", "a3", 9.0)
    t.expect_totals(key, prop, 0, 9, 1, "rekey of a hold of 6 to 9 on a budget of 10 (the 6 given back first)")


def _check_prune(t: _Trial) -> None:
    if not callable(getattr(t.store, "prune", None)):
        return  # optional: `intent store prune`
    prop = "prune: deletes settled charges, never a hold nor the totals"
    key = t.key(10.0)
    t.store.reserve(key, "spent", 1.0)
    t.store.commit(key, "spent")
    t.store.reserve(key, "back", 1.0)
    t.store.release(key, "back")
    t.advance(3 * t.lease)
    t.store.reserve(key, "held", 2.0)
    deleted = t.store.prune(2 * t.lease, key=key)
    left = sorted(t.statuses(key))
    _require(left == ["held"], prop, f"prune(2 leases) after 3 leases left charges {left}; it must delete the "
             "settled 'spent' and 'back' and keep the live hold 'held'")
    _require(deleted == 2, prop, f"prune returned {deleted!r}; it returns how many charges it deleted (2)")
    t.expect_totals(key, prop, 1, 2, 7, "prune (spent and reserved are the budget's, not the history's)")
    with _refused("prune: a commit of a pruned charge is refused", "commit of the pruned charge 'spent'",
                  (StoreError,), "the store no longer knows whether it was charged: a commit it cannot match is "
                  "reported (the guard's KeptCommitRefusedError), never charged nor passed in silence"):
        t.store.commit(key, "spent")
    t.expect_totals(key, prop, 1, 2, 7, "a refused commit of a pruned charge")


# ----------------------------------------------------------------------------------------------- concurrency
class _ThreadTally:
    """What the workers hold and committed, counted by them in cents (the store is not asked)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._values = [0, 0, -(10**12)]  # held, committed, the worst (held + committed - budget) seen

    def get_lock(self) -> threading.Lock:
        return self._lock

    def __getitem__(self, i: int) -> int:
        return self._values[i]

    def __setitem__(self, i: int, value: int) -> None:
        self._values[i] = value


def _hammer(store: Any, key: str, budget_cents: int, worker: str, ops: int, seed: int, tally: Any) -> None:
    """Reserve, then commit (at the hold, below it, again) or release (sometimes twice, sometimes after a commit),
    ``ops`` times at the budget's edge, counting in ``tally`` what is held and what was committed."""
    rng = random.Random(seed)
    for i in range(ops):
        cid = f"{worker}-{i}"
        held = rng.randint(50, 250)
        try:
            store.reserve(key, cid, held / 100)
        except BudgetExceededError:
            continue
        with tally.get_lock():  # after the store said yes: what the workers hold is never overcounted
            tally[0] += held
            tally[2] = max(tally[2], tally[0] + tally[1] - budget_cents)
        roll = rng.random()
        with tally.get_lock():  # before the store is told: never overcounted either
            tally[0] -= held
        if roll < 0.5:
            store.release(key, cid)
            if roll < 0.1:
                store.release(key, cid)
            continue
        billed = held if roll < 0.55 else rng.randint(0, 5)
        store.commit(key, cid, None if roll < 0.52 else billed / 100)
        with tally.get_lock():
            tally[1] += billed
        if roll > 0.9:
            store.commit(key, cid, rng.randint(0, 300) / 100)  # a commit resent: charged once
        elif roll > 0.8:
            store.release(key, cid)  # never releases a committed charge


def _hammer_checked(t: _Trial, key: str, budget_cents: int, tally: Any, who: str) -> None:
    prop = "concurrency: never overspend, spent == Σ commits, nothing left reserved"
    committed_cents, worst = tally[1], tally[2]
    _require(worst <= 0, prop, f"{who} held and committed {(budget_cents + worst) / 100:g} at once (counted by the "
             f"workers) on a budget of {budget_cents / 100:g}: reserve let through money that was not there "
             "(the fit check and the hold must be one atomic step)")
    spent, reserved = t.store.spent(key), t.store.reserved(key)
    _require(_same(reserved, 0), prop, f"{who} settled every hold but reserved is {reserved:g}, should be 0")
    _require(_same(spent, committed_cents / 100), prop, f"{who} committed {committed_cents / 100:g} in all but spent "
             f"is {spent:g} (a commit lost, or counted twice)")
    _require(spent <= budget_cents / 100 + _EPS, prop, f"spent {spent:g} of a budget of {budget_cents / 100:g}")
    listed = sum(c.amount for c in t.store.charges(key) if c.status == "committed")
    _require(_same(listed, spent), "charges: each charge once, with its status and billed amount",
             f"after {who}, the committed charges sum to {listed:g} but spent is {spent:g}")


def _check_threads(t: _Trial) -> None:
    budget_cents, ops = 125 * t.suite.threads, 40  # (about what the threads hold at once: they meet the edge)
    key = t.key(budget_cents / 100)
    tally = _ThreadTally()
    errors: list[BaseException] = []
    start = threading.Barrier(t.suite.threads)

    def work(n: int) -> None:
        try:
            start.wait()
            _hammer(t.store, key, budget_cents, f"t{n}", ops, n, tally)
        except BaseException as exc:
            errors.append(exc)

    _run_threads([threading.Thread(target=work, args=(n,), name=f"conformance-{n}", daemon=True)
                  for n in range(t.suite.threads)], "concurrency: one store used from threads")
    if errors:
        raise _fail(f"concurrency: one store used from {t.suite.threads} threads", f"a worker thread's "
                    f"{type(errors[0]).__name__}: {errors[0]} (the guard uses one store from several threads: the "
                    "lease keeper, async agents' worker threads)") from errors[0]
    _hammer_checked(t, key, budget_cents, tally, f"{t.suite.threads} threads")


def _run_threads(workers: list[threading.Thread], prop: str) -> None:
    """Start the workers and wait for them, at most ``WORKER_TIMEOUT`` in all (daemon threads: one stuck in the
    store is left behind, and the check fails instead of hanging)."""
    for w in workers:
        w.start()
    deadline = time.monotonic() + WORKER_TIMEOUT
    for w in workers:
        w.join(max(0.0, deadline - time.monotonic()))
    stuck = sum(w.is_alive() for w in workers)
    _require(not stuck, prop, f"{stuck} of {len(workers)} threads still ran {WORKER_TIMEOUT:g} s after they started "
             "(a store operation that never returns: a lock never released?)")


def _check_one_charge_raced(t: _Trial) -> None:
    prop = "concurrency: threads racing on one charge id hold and charge it once"
    key = t.key(1.0)
    n = t.suite.threads
    errors: list[BaseException] = []
    start = threading.Barrier(n)

    def race(op: Callable[[], Any]) -> None:
        try:
            start.wait()
            op()
        except BaseException as exc:
            errors.append(exc)

    for what, op in (("reserve 0.7", lambda: t.store.reserve(key, "one", 0.7)),
                     ("commit at 0.5", lambda: t.store.commit(key, "one", 0.5))):
        _run_threads([threading.Thread(target=race, args=(op,), daemon=True) for _ in range(n)], prop)
        if errors:
            raise _fail(prop, f"{n} threads that {what} the same charge at once: one raised "
                        f"{type(errors[0]).__name__} ({errors[0]}); a repeat must find the first") from errors[0]
        if what.startswith("reserve"):
            t.expect_totals(key, prop, 0, 0.7, 0.3, f"{n} threads reserving 'one' (0.7) at once")
    t.expect_totals(key, prop, 0.5, 0, 0.5, f"{n} threads committing 'one' at 0.5 at once")


def _process_worker(factory: Callable[..., Any], key: str, budget_cents: int, worker: str, ops: int, seed: int,
                    tally: Any, start: Any, errors: Any) -> None:
    """One worker process: its own store from the factory (no lease runs out here: the real clock will do)."""
    import traceback

    try:
        store = factory(lease_seconds=600.0, clock=time.time)
        try:
            start.wait(60)
            _hammer(store, key, budget_cents, worker, ops, seed, tally)
        finally:
            close = getattr(store, "close", None)
            if callable(close):
                close()
    except BaseException as exc:
        errors.put(f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}")


def _check_processes(suite: _Suite, processes: int) -> None:
    import multiprocessing as mp
    import queue

    store, advance = suite.make()
    try:
        t = _Trial(suite, store, advance, "processes")
        budget_cents, ops = 125 * processes, 100  # (about what the workers hold at once: they meet the edge)
        key = t.key(budget_cents / 100)
        ctx = mp.get_context("spawn")  # fresh interpreters, as separate deployments are
        tally = ctx.Array("q", [0, 0, -(10**12)])
        start, errors = ctx.Barrier(processes), ctx.Queue()
        workers = [ctx.Process(target=_process_worker, name=f"conformance-p{n}", args=(
            suite.factory, key, budget_cents, f"p{n}", ops, n, tally, start, errors)) for n in range(processes)]
        for w in workers:
            w.start()
        deadline = time.monotonic() + WORKER_TIMEOUT
        for w in workers:
            w.join(max(0.0, deadline - time.monotonic()))
        stuck = [w for w in workers if w.is_alive()]
        for w in stuck:
            w.terminate()
        _require(not stuck, "concurrency: one budget used from worker processes", f"{len(stuck)} worker "
                 f"process(es) still ran {WORKER_TIMEOUT:g} s after they started (a store operation that never "
                 "returns: a lock never released?); ended")
        failures = []
        while True:  # (a worker's error is in the queue's pipe once the worker has exited)
            try:
                failures.append(errors.get(timeout=0.2))
            except queue.Empty:
                break
        crashed = [w.exitcode for w in workers if w.exitcode]
        _require(not failures and not crashed, "concurrency: one budget used from worker processes",
                 f"a worker process failed: {failures[0] if failures else f'exit codes {crashed}'}")
        _hammer_checked(t, key, budget_cents, tally, f"{processes} processes")
    finally:
        close = getattr(store, "close", None)
        if callable(close):
            close()
