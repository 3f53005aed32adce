"""A PostgreSQL store object lends each operation a connection of its own (``pool_size``).

A process serving many tenants from one store (a web server's threads, async agents whose store work runs in
worker threads) queued every operation behind one connection: while another process held budget A's row, an
operation on an unrelated budget B waited behind the one waiting on A. The waits below are synchronised on
``pg_stat_activity`` (the store's session waiting on the row lock) and events, never on sleeps.
"""

from __future__ import annotations

import threading

import pytest
from test_async_shared_store import RowLocker

from intent.stores import PostgresBudgetStore, StoreArgumentError, open_store
from intent.stores.base import to_nano
from intent.stores.conformance import _hammer, _ThreadTally

HANG = 30  # seconds: only turns an operation that never returns into a failure (a passing run never waits it out)


def _pids(store: PostgresBudgetStore) -> set[int]:
    return {conn.info.backend_pid for conn in store._pool.connections()}


class _WhileAWaits:
    """A reserve on ``key`` through ``store`` in a thread, waiting on the budget row that a :class:`RowLocker`
    holds; ``during(store)`` runs in the locker's thread once the reserve waits, before the row is released."""

    def __init__(self, dsn: str, store: PostgresBudgetStore, key: str, during) -> None:
        self.store, self.key, self.during = store, key, during
        self.locker = RowLocker(dsn, key, ticks=[0], hold=0, on_wait=self._during)
        self.reserved = None
        self.error: BaseException | None = None
        self.pid_waiting: int | None = None
        self._thread = threading.Thread(target=self._reserve, daemon=True)

    def _reserve(self) -> None:
        try:
            self.reserved = self.store.reserve(self.key, "a", 1.0)
        except BaseException as exc:  # (raised in the test by run())
            self.error = exc

    def _during(self) -> None:
        # The reserve on A holds the store's one connection that waits on a lock: what the server says it waits on.
        with self.locker.conn.cursor() as cur:
            cur.execute("SELECT pid FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND datname = "
                        "current_database()")
            [(self.pid_waiting,)] = cur.fetchall()
        self.during(self.store)

    def run(self) -> None:
        self.locker.take()
        self._thread.start()
        self.locker.join()  # (raises what failed in `during`, or the reserve no longer waiting before the release)
        self._thread.join(HANG)
        assert not self._thread.is_alive(), "the reserve on A never returned after A's row was released"
        if self.error is not None:
            raise self.error


def _with_two_budgets(dsn: str, keys: tuple[str, str], **options) -> PostgresBudgetStore:
    """A store (``options``: its keywords) with a budget of 2.0 on each of ``keys``."""
    store = PostgresBudgetStore(dsn, **options)
    for key in keys:
        store.create_budget(key, 2.0)
    return store


@pytest.fixture
def keys(budget_key):
    return budget_key, budget_key.replace("test-", "test-b-")


def _reserve_and_commit_in_a_thread(store: PostgresBudgetStore, key: str) -> bool:
    """Reserve and commit 0.5 on ``key`` in another thread; whether that finished (within ``HANG``, a hang guard)."""
    done = threading.Event()

    def work() -> None:
        store.reserve(key, "b", 0.5)
        store.commit(key, "b")
        done.set()

    threading.Thread(target=work, daemon=True).start()
    return done.wait(HANG)


@pytest.mark.parametrize("pool_size", [2, 4])
def test_an_operation_on_one_budget_does_not_wait_behind_one_waiting_on_another(postgres_dsn, keys, pool_size):
    # Was: one connection per store object behind a lock: B's reserve waited for A's row, held by another process.
    key_a, key_b = keys
    store = _with_two_budgets(postgres_dsn, keys, pool_size=pool_size)
    assert len(store._pool.connections()) == 1  # operations that never overlapped: one connection
    finished_while_a_waited: list[bool] = []
    scene = _WhileAWaits(postgres_dsn, store, key_a,
                         lambda s: finished_while_a_waited.append(_reserve_and_commit_in_a_thread(s, key_b)))
    scene.run()  # (RowLocker: A's reserve was still waiting on the row when B's operations had finished)
    assert finished_while_a_waited == [True], "B's reserve and commit waited behind A's row lock"
    assert store.spent(key_b) == 0.5 and store.reserved(key_b) == 0
    assert scene.reserved.status == "reserved" and store.reserved(key_a) == 1.0
    assert len(store._pool.connections()) == 2  # a second one opened only when two operations overlapped
    store.close()


def test_many_threads_on_a_few_budgets_through_one_pooled_store_keep_the_money_exact(postgres_dsn, budget_key):
    # Two connections of one store on the same budget row now wait on each other in the server, not in the store.
    store = PostgresBudgetStore(postgres_dsn, pool_size=3)
    budget_cents, threads, ops = 400, 9, 30  # (three threads a budget, about what they hold at once: the edge)
    budgets = [f"{budget_key}-{i}" for i in range(3)]
    for key in budgets:
        store.create_budget(key, budget_cents / 100)
    tallies = {key: _ThreadTally() for key in budgets}
    errors: list[BaseException] = []
    start = threading.Barrier(threads)

    def work(n: int) -> None:
        key = budgets[n % len(budgets)]
        try:
            start.wait()
            _hammer(store, key, budget_cents, f"t{n}", ops, n, tallies[key])
        except BaseException as exc:
            errors.append(exc)

    workers = [threading.Thread(target=work, args=(n,), daemon=True) for n in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(HANG * 4)
    assert not any(w.is_alive() for w in workers) and not errors, errors
    assert 1 < len(store._pool.connections()) <= 3  # the threads did overlap, within the pool's bound
    for key, tally in tallies.items():
        committed_cents, worst = tally[1], tally[2]
        assert worst <= 0, f"{key}: the threads held and committed {budget_cents + worst} cents at once"
        assert to_nano(store.spent(key)) == to_nano(committed_cents / 100) and store.reserved(key) == 0
        assert store.spent(key) <= budget_cents / 100
    store.close()


def test_a_broken_pool_connection_is_replaced_and_its_operation_retried_the_others_untouched(postgres_dsn, keys):
    import psycopg

    key_a, key_b = keys
    store = _with_two_budgets(postgres_dsn, keys, pool_size=2)
    seen: dict[str, object] = {}

    def during(s: PostgresBudgetStore) -> None:
        s.reserve(key_b, "b", 0.5)  # the pool's second connection (the first waits on A's row)
        [idle] = _pids(s) - {scene.pid_waiting}
        with psycopg.connect(postgres_dsn, autocommit=True) as admin:
            admin.execute("SELECT pg_terminate_backend(%s)", (idle,))  # that session dies while idle
        seen["charge"] = s.commit(key_b, "b")  # lent the dead one first: it fails, is replaced, and retried
        seen["killed"], seen["pids"] = idle, _pids(s)

    scene = _WhileAWaits(postgres_dsn, store, key_a, during)
    scene.run()
    assert seen["charge"].status == "committed" and store.spent(key_b) == 0.5 and store.reserved(key_b) == 0
    assert seen["killed"] not in seen["pids"] and scene.pid_waiting in seen["pids"] and len(seen["pids"]) == 2
    assert scene.reserved.status == "reserved" and store.reserved(key_a) == 1.0  # A's operation was not disturbed
    assert scene.pid_waiting in _pids(store)  # (nor its connection)
    store.close()


def test_overlapping_transactions_each_keep_their_own_server_time(postgres_dsn, keys, monkeypatch):
    # Leases are in the server's time, read once per transaction: with two transactions open at once on two
    # connections, one's reading must not become the other's (a shared attribute, reset by B's transaction while
    # A's was open, gave A's hold B's later time).
    key_a, key_b = keys
    store = _with_two_budgets(postgres_dsn, keys, pool_size=2, lease_seconds=60)
    read_by_a: list[float] = []
    a_read, b_done = threading.Event(), threading.Event()
    server_now = store._now

    def now(cur) -> float:
        t = server_now(cur)
        if threading.current_thread().name == "a":
            read_by_a.append(t)
            if not a_read.is_set():  # A's transaction is open and has read its time: B's runs now, start to end
                a_read.set()
                assert b_done.wait(HANG), "B's transaction did not run while A's was open"
        return t

    monkeypatch.setattr(store, "_now", now)
    charges = {}
    a = threading.Thread(target=lambda: charges.setdefault("a", store.reserve(key_a, "a", 1.0)), name="a")
    a.start()
    assert a_read.wait(HANG)
    charges["b"] = store.reserve(key_b, "b", 1.0)
    b_done.set()
    a.join(HANG)
    assert not a.is_alive()
    assert len(read_by_a) == 2 and read_by_a[0] == read_by_a[1]  # (expiry, then the hold: one time)
    assert charges["a"].updated_at == read_by_a[0] and charges["a"].lease_until == read_by_a[0] + 60
    assert charges["b"].updated_at > read_by_a[0]  # (B's own, later)
    store.close()


def test_close_closes_every_connection_one_in_use_when_its_operation_ends(postgres_dsn, keys):
    key_a, key_b = keys
    store = _with_two_budgets(postgres_dsn, keys, pool_size=2)
    open_while_a_waited: list[set[int]] = []

    def during(s: PostgresBudgetStore) -> None:
        s.spent(key_b)  # (a second connection, idle again)
        assert len(_pids(s)) == 2
        s.close()
        open_while_a_waited.append(_pids(s))

    scene = _WhileAWaits(postgres_dsn, store, key_a, during)
    scene.run()
    assert open_while_a_waited == [{scene.pid_waiting}]  # the idle one at once; the one in use stayed usable
    assert scene.reserved.status == "reserved" and store._pool.connections() == []  # and was closed after it
    assert store.reserved(key_a) == 1.0  # a store used after close() opens a connection again, as before pooling


def test_pool_size_is_checked_and_passed_through_open_store(postgres_dsn, tmp_path):
    assert PostgresBudgetStore(postgres_dsn).pool_size == 4
    assert open_store(postgres_dsn, pool_size=2).pool_size == 2
    for bad in (0, -1, 2.5, "4", True, None):
        with pytest.raises(StoreArgumentError, match=r"^pool_size must be a whole number of connections >= 1, got "
                                                     r".*; e\.g\. pool_size=4 \(the default\), 1 for one"):
            PostgresBudgetStore(postgres_dsn, pool_size=bad)
    for url in (f"sqlite:///{tmp_path / 'x.db'}", "memory://"):
        with pytest.raises(StoreArgumentError, match=r"pool_size= is for postgresql:// stores.*one connection"):
            open_store(url, pool_size=2)


def test_an_operation_waiting_for_a_connection_past_pool_timeout_is_store_unavailable(postgres_dsn, keys):
    """pool_size=1: A's reserve holds the one connection, waiting on a row another session holds (PostgreSQL's
    default lock_timeout: none). B's operation waited for that connection without limit, so one session hanging
    on a lock stalled every budget of the process; now it gives up after pool_timeout, with the store's
    documented recoverable error, and a commit that fails so is kept by the guard's outbox."""
    from intent.stores import StoreUnavailableError

    key_a, key_b = keys
    store = _with_two_budgets(postgres_dsn, keys, pool_size=1, pool_timeout=0.2)
    errors: list[BaseException] = []

    def during(s: PostgresBudgetStore) -> None:
        with pytest.raises(StoreUnavailableError) as raised:
            s.reserve(key_b, "b", 0.5)
        errors.append(raised.value)

    scene = _WhileAWaits(postgres_dsn, store, key_a, during)
    scene.run()
    [error] = errors
    assert "could not start reserve: all 1 connections of this store object stayed in use by other operations " \
           "for 0.2 s (pool_timeout)" in str(error) and "raise it" in str(error)
    assert store.reserved(key_b) == 0 and scene.reserved.status == "reserved"  # nothing held for B; A unharmed
    assert store.reserve(key_b, "b", 0.5).status == "reserved"  # the connection free again: B goes ahead
    store.close()


def test_pool_timeout_is_checked_and_passed_through_open_store(postgres_dsn, tmp_path):
    assert PostgresBudgetStore(postgres_dsn).pool_timeout == 30.0
    assert open_store(postgres_dsn, pool_timeout=None).pool_timeout is None
    assert open_store(postgres_dsn, pool_timeout=2).pool_timeout == 2.0
    for bad in (0, -1, float("inf"), float("nan"), "30", True):
        with pytest.raises(StoreArgumentError, match=r"^pool_timeout must be a finite number of seconds > 0 or "
                                                     r"None, got .*; e\.g\. pool_timeout=30 \(the default\), None"):
            PostgresBudgetStore(postgres_dsn, pool_timeout=bad)
    for url in (f"sqlite:///{tmp_path / 'x.db'}", "memory://"):
        with pytest.raises(StoreArgumentError, match=r"pool_timeout= is for postgresql:// stores"):
            open_store(url, pool_timeout=2)


def test_after_a_server_restart_one_lost_connection_retires_the_idle_ones(postgres_dsn, budget_key, monkeypatch):
    """Every session of the pool dies at once (a server restart, a failover). The first operation after it fails
    once on a dead connection; the idle ones died too, so they go with it and the retry opens a fresh one. Before,
    each dead idle connection cost one failed attempt and one of the retry's pauses (4 connections: most of the
    default retry_seconds=1 spent before a live connection was even tried)."""
    import psycopg

    import intent.stores.sql as sql

    store = PostgresBudgetStore(postgres_dsn, pool_size=3, retry_seconds=60)
    store.create_budget(budget_key, 2.0)
    with store._pool.connection(), store._pool.connection(), store._pool.connection():
        pass  # three operations at once: three connections, idle now
    dead = _pids(store)
    assert len(dead) == 3
    with psycopg.connect(postgres_dsn, autocommit=True) as admin:
        for pid in dead:
            admin.execute("SELECT pg_terminate_backend(%s)", (pid,))
    pauses: list[float] = []
    monkeypatch.setattr(sql.time, "sleep", pauses.append)  # (the retry's pauses, counted and not slept)
    assert store.spent(budget_key) == 0.0
    assert len(pauses) == 1, pauses  # one failed attempt, then a fresh connection
    assert not (_pids(store) & dead) and len(_pids(store)) == 1
    store.close()
