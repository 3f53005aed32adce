"""An async agent on a shared budget store does the store's blocking work off the event loop.

Many agents served by one event loop (a FastAPI app) share it: a store round trip, a PostgreSQL row-lock
wait while another worker holds the budget row, a retry during a failover, made on the loop, stalls every
other agent on it. The guard's async paths run them in a worker thread; a run cancelled meanwhile waits
for that thread, so the ledger and the store record what it did (no charge lost or doubled).
"""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from intent import AcceptAll, BudgetGuard, Market, PricedTool
from intent.stores import open_store

PRICE = 0.5


def _waiting_on_a_lock(cur) -> int:
    cur.execute("SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
                "AND datname = current_database()")
    return cur.fetchone()[0]


class RowLocker:
    """Another worker: holds the budget row (``SELECT ... FOR UPDATE`` in an open transaction) from
    :meth:`take` until it has seen the guard's store wait on it for ``hold`` seconds, and notes how far a
    ticker on the agent's loop got while the guard waited."""

    def __init__(self, dsn: str, key: str, ticks: list[int], hold: float = 1.0,
                 on_wait: object = None) -> None:
        import psycopg

        self.conn = psycopg.connect(dsn)  # (not autocommit: the lock lasts until the commit)
        self.key, self.ticks, self.hold, self.on_wait = key, ticks, hold, on_wait
        self.locked = threading.Event()
        self.released = threading.Event()
        self.ticks_while_waiting: int | None = None
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, daemon=True)

    def take(self) -> None:
        self._thread.start()
        assert self.locked.wait(10), "the locker could not lock the budget row"

    def _run(self) -> None:
        try:
            with self.conn.cursor() as cur, self.conn.cursor() as watch:
                cur.execute("SELECT 1 FROM intent_budgets WHERE key = %s FOR UPDATE", (self.key,))
                self.locked.set()
                deadline = time.monotonic() + 30
                while _waiting_on_a_lock(watch) == 0:  # the guard's store reaches the row
                    assert time.monotonic() < deadline, "the guard never waited on the budget row"
                    time.sleep(0.01)
                if callable(self.on_wait):
                    self.on_wait()
                at_start = self.ticks[0]
                time.sleep(self.hold)
                assert _waiting_on_a_lock(watch) == 1, "the guard's store call stopped waiting before the release"
                self.ticks_while_waiting = self.ticks[0] - at_start
                self.conn.commit()
        except BaseException as exc:  # (raised in the test by join())
            self.error = exc
            self.conn.rollback()
        finally:
            self.released.set()

    def join(self) -> None:
        self._thread.join(30)
        self.conn.close()
        if self.error is not None:
            raise self.error


def _agent(store, key: str, tool):
    from langchain.agents import create_agent
    from langchain_core.tools import StructuredTool

    from intent.testing import ai, call, scripted

    guard = BudgetGuard(AcceptAll(), Market([PricedTool("fetch", PRICE)]), 10.0, store=store, budget_key=key)
    fetch = StructuredTool.from_function(coroutine=tool, name="fetch", description="fetch")
    return guard, create_agent(scripted([ai(call("fetch", q="a")), ai(text="done")]), [fetch],
                               middleware=[guard.middleware()])


async def _ticking(ticks: list[int], stop: asyncio.Event) -> None:
    while not stop.is_set():
        ticks[0] += 1
        await asyncio.sleep(0.002)


@pytest.mark.parametrize("blocked", ["gate", "commit"])
def test_a_row_lock_wait_in_the_store_does_not_stall_other_coroutines_on_the_loop(postgres_dsn, budget_key,
                                                                                  blocked):
    """Another connection holds the budget row for 1 s while the agent's gate (or the commit after its tool
    ran) needs it: a coroutine on the same loop keeps ticking during the wait, and the money adds up."""
    from langchain_core.messages import HumanMessage

    store = open_store(postgres_dsn)
    store.create_budget(budget_key, 10.0)
    ticks = [0]
    locker = RowLocker(postgres_dsn, budget_key, ticks)
    executed: list[str] = []

    async def fetch(q: str = "") -> str:
        executed.append(q)
        if blocked == "commit":
            await asyncio.to_thread(locker.take)  # the row is taken while the call runs: its commit waits
        return "ok"

    guard, agent = _agent(store, budget_key, fetch)

    async def main() -> dict:
        stop = asyncio.Event()
        ticker = asyncio.create_task(_ticking(ticks, stop))
        if blocked == "gate":
            locker.take()
        try:
            return await agent.ainvoke({"messages": [HumanMessage("go")]}, {"configurable": {"thread_id": "t"}})
        finally:
            stop.set()
            await ticker

    result = asyncio.run(main())
    locker.join()
    assert result["messages"][-1].content == "done"
    # The ticker went on while the guard's store call waited on the row (a blocked loop: 0 ticks).
    assert locker.ticks_while_waiting is not None and locker.ticks_while_waiting >= 20, locker.ticks_while_waiting
    assert executed == ["a"]
    assert store.spent(budget_key) == pytest.approx(len(executed) * PRICE)
    assert store.reserved(budget_key) == 0.0
    # The gate's hold moved to the run's own charge (rekey), which is the one committed; nothing still held.
    assert sorted(c.status for c in store.charges(budget_key)) == ["committed", "released"]


def test_a_run_cancelled_while_its_commit_waits_on_the_store_keeps_the_charge_once(postgres_dsn, budget_key):
    """The task is cancelled while the commit of its call (which ran) waits on the budget row: the commit
    goes on in its thread and the cancellation waits for it, so when the task is done the store and the
    guard's ledger both have the one charge, committed, and nothing is held."""
    from langchain_core.messages import HumanMessage

    store = open_store(postgres_dsn)
    store.create_budget(budget_key, 10.0)
    ticks = [0]
    executed: list[str] = []
    box: dict[str, object] = {}

    def cancel() -> None:  # (in the locker's thread, once the guard's commit waits on the row)
        box["loop"].call_soon_threadsafe(box["task"].cancel)

    locker = RowLocker(postgres_dsn, budget_key, ticks, hold=0.5, on_wait=cancel)

    async def fetch(q: str = "") -> str:
        executed.append(q)
        await asyncio.to_thread(locker.take)
        return "ok"

    guard, agent = _agent(store, budget_key, fetch)

    async def main() -> None:
        box["loop"] = asyncio.get_running_loop()
        task = asyncio.create_task(agent.ainvoke({"messages": [HumanMessage("go")]},
                                                 {"configurable": {"thread_id": "c"}}))
        box["task"] = task
        with pytest.raises(asyncio.CancelledError):
            await task
        # Read as soon as the cancelled task is done, on a connection of its own (the guard's store object would
        # wait for its own commit to end), with the guard's charge id and status as the store has them.
        reader = open_store(postgres_dsn)
        box["spent"], box["charges"] = reader.spent(budget_key), reader.charges(budget_key)
        reader.close()

    asyncio.run(main())
    locker.join()
    assert executed == ["a"]
    assert box["spent"] == pytest.approx(PRICE)
    (charge,) = [c for c in box["charges"] if c.status != "released"]
    assert charge.status == "committed" and charge.amount == pytest.approx(PRICE)
    assert store.spent(budget_key) == pytest.approx(PRICE) and store.reserved(budget_key) == 0.0
    (ledger,) = [e.ledger for e in guard.episodes._episodes.values()]
    assert ledger.spent == pytest.approx(PRICE) and ledger.reserved == 0.0


def test_concurrent_async_agents_on_one_loop_share_a_sqlite_budget_exactly(tmp_path, budget_key):
    """Twelve agents on one loop, each with two calls of 0.5, on a shared SQLite budget of 5: the store
    work runs in threads now, interleaved; the budget is never overspent and every charge is paid once."""
    from langchain.agents import create_agent
    from langchain_core.messages import HumanMessage
    from langchain_core.tools import StructuredTool

    from intent.testing import ai, call, scripted

    url = f"sqlite:///{tmp_path / 'budgets.db'}"
    store = open_store(url)
    store.create_budget(budget_key, 5.0)
    executed: list[str] = []

    async def fetch(q: str = "") -> str:
        await asyncio.sleep(0.001)
        executed.append(q)
        return "ok"

    tool = StructuredTool.from_function(coroutine=fetch, name="fetch", description="fetch")

    async def one(i: int) -> None:
        guard = BudgetGuard(AcceptAll(), Market([PricedTool("fetch", PRICE)]), 10.0, store=open_store(url),
                            budget_key=budget_key)
        agent = create_agent(scripted([ai(call("fetch", q=f"{i}-1"), call("fetch", q=f"{i}-2")), ai(text="done")]),
                             [tool], middleware=[guard.middleware()])
        await agent.ainvoke({"messages": [HumanMessage("go")]}, {"configurable": {"thread_id": f"t{i}"}})

    async def main() -> None:
        await asyncio.gather(*(one(i) for i in range(12)))

    asyncio.run(main())
    assert 0 < len(executed) <= 10  # 24 calls proposed, 10 fit
    assert store.spent(budget_key) == pytest.approx(len(executed) * PRICE)
    assert store.reserved(budget_key) == 0.0
