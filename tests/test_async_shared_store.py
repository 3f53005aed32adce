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


TICKS_WHILE_WAITING = 20  # the ticker's turns a row lock is held for once the guard's store waits on it


class RowLocker:
    """Another worker: holds the budget row (``SELECT ... FOR UPDATE`` in an open transaction) from
    :meth:`take` until it has seen the guard's store wait on it while a ticker on the agent's loop ticked
    ``TICKS_WHILE_WAITING`` times (a blocked loop never does: the check fails after 30 s), or, with ``hold``,
    for ``hold`` seconds; notes how far the ticker got while the guard waited. (Counted, not timed: a loaded
    machine makes the wait longer, never the check red.)"""

    def __init__(self, dsn: str, key: str, ticks: list[int], hold: float | None = None,
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
                if self.hold is not None:
                    time.sleep(self.hold)
                else:
                    deadline = time.monotonic() + 30
                    while self.ticks[0] - at_start < TICKS_WHILE_WAITING:
                        assert time.monotonic() < deadline, "the loop did not tick while the guard's store waited"
                        time.sleep(0.01)
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
    """Another connection holds the budget row while the agent's gate (or the commit after its tool
    ran) needs it: a coroutine on the same loop keeps ticking during the wait, and the money adds up."""

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

    result = _run_ticking(agent, "t", ticks, before=locker.take if blocked == "gate" else None)
    locker.join()
    assert result["messages"][-1].content == "done"
    # The ticker went on while the guard's store call waited on the row (a blocked loop: 0 ticks).
    assert locker.ticks_while_waiting is not None and locker.ticks_while_waiting >= TICKS_WHILE_WAITING, locker.ticks_while_waiting
    assert executed == ["a"]
    assert store.spent(budget_key) == pytest.approx(len(executed) * PRICE)
    assert store.reserved(budget_key) == 0.0
    # The gate's hold moved to the run's own charge (rekey), which is the one committed; nothing still held.
    assert sorted(c.status for c in store.charges(budget_key)) == ["committed", "released"]


async def _ticking_while(awaitable, ticks: list[int]):
    stop = asyncio.Event()
    ticker = asyncio.create_task(_ticking(ticks, stop))
    try:
        return await awaitable
    finally:
        stop.set()
        await ticker


def _run_ticking(agent, thread_id: str, ticks: list[int], *, before=None) -> dict:
    """Run ``agent`` on a loop where a coroutine ticks (counted in ``ticks``) the whole time; ``before``
    (say, taking the budget row) runs first, in the loop."""
    from langchain_core.messages import HumanMessage

    async def main() -> dict:
        if before is not None:
            before()
        return await _ticking_while(agent.ainvoke({"messages": [HumanMessage("go")]},
                                                  {"configurable": {"thread_id": thread_id}}), ticks)

    return asyncio.run(main())


def _canceller(box: dict):
    """The locker's ``on_wait``: cancel the running task (in the locker's thread, once the guard waits on the row);
    returns once the loop has cancelled it, so the locker's ``hold`` starts with the cancellation under way."""

    def cancel() -> None:
        cancelled = threading.Event()

        def on_the_loop() -> None:
            box["task"].cancel()
            cancelled.set()

        box["loop"].call_soon_threadsafe(on_the_loop)
        assert cancelled.wait(30), "the loop never ran the cancellation"

    return cancel


def _run_cancelled(agent, thread_id: str, box: dict, dsn: str, key: str) -> None:
    """Run ``agent`` until it is cancelled (by :func:`_canceller`), then read the store at once, on a connection
    of its own (the guard's store object would wait for its own operation to end): ``box["spent"]``,
    ``box["reserved"]``, ``box["charges"]``."""
    from langchain_core.messages import HumanMessage

    async def main() -> None:
        box["loop"] = asyncio.get_running_loop()
        box["task"] = asyncio.create_task(agent.ainvoke({"messages": [HumanMessage("go")]},
                                                        {"configurable": {"thread_id": thread_id}}))
        with pytest.raises(asyncio.CancelledError):
            await box["task"]
        reader = open_store(dsn)
        box["spent"], box["reserved"], box["charges"] = reader.spent(key), reader.reserved(key), reader.charges(key)
        reader.close()

    asyncio.run(main())


def test_a_run_cancelled_while_its_commit_waits_on_the_store_keeps_the_charge_once(postgres_dsn, budget_key):
    """The task is cancelled while the commit of its call (which ran) waits on the budget row: the commit
    goes on in its thread and the cancellation waits for it, so when the task is done the store and the
    guard's ledger both have the one charge, committed, and nothing is held."""

    store = open_store(postgres_dsn)
    store.create_budget(budget_key, 10.0)
    ticks = [0]
    executed: list[str] = []
    box: dict[str, object] = {}

    locker = RowLocker(postgres_dsn, budget_key, ticks, hold=0.5, on_wait=_canceller(box))

    async def fetch(q: str = "") -> str:
        executed.append(q)
        await asyncio.to_thread(locker.take)
        return "ok"

    guard, agent = _agent(store, budget_key, fetch)

    _run_cancelled(agent, "c", box, postgres_dsn, budget_key)
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


# ----------------------------------------------------------------- a model execution's own reservation and commit
MODEL_PRICES = {"scripted-model": {"input_per_mtok": 1000.0, "output_per_mtok": 2000.0}}
MODEL_COST = 0.048  # (40 tokens in, 4 out) at 0.001 and 0.002 a token


def _locking_model(messages, locker: RowLocker, when: str, model_name: str = "scripted-model"):
    """The scripted model, taking the budget row before it answers its first execution (``when="answer"``):
    that execution's commit (on_llm_end) then waits on the row."""
    from intent.testing import ScriptedToolModel

    class LockingModel(ScriptedToolModel):
        async def _agenerate(self, *args, **kwargs):
            if when == "answer" and not self.executions:
                await asyncio.to_thread(locker.take)
            return await super()._agenerate(*args, **kwargs)

    return LockingModel(messages=iter(list(messages)), bound=[], model_name=model_name, fail_on=set(),
                        executions=[])


class _TakeTheRowFirst:
    """A middleware inside the guard's model step: takes the budget row before the model's first execution
    starts, so that the execution's own reservation (on_chat_model_start) waits on it."""

    def __new__(cls, locker: RowLocker):
        from langchain.agents.middleware import AgentMiddleware

        class TakeTheRow(AgentMiddleware):
            taken = False

            async def awrap_model_call(self, request, handler):
                if not TakeTheRow.taken:
                    TakeTheRow.taken = True
                    await asyncio.to_thread(locker.take)
                return await handler(request)

        return TakeTheRow()


@pytest.mark.parametrize("blocked", ["reservation", "commit"])
def test_a_model_executions_reservation_and_commit_wait_on_the_store_off_the_loop(postgres_dsn, budget_key, blocked):
    """With model_prices, each model execution is reserved before the provider is called and committed
    after it, by the step's callback. Another connection holds the budget row while the execution's
    reservation (or its commit) needs it: a coroutine on the same loop keeps ticking during the wait,
    and every execution is paid once, at its usage, nothing left held."""
    from langchain.agents import create_agent
    from langchain_core.tools import StructuredTool

    from intent.testing import ai, call

    store = open_store(postgres_dsn)
    store.create_budget(budget_key, 10.0)
    ticks = [0]
    locker = RowLocker(postgres_dsn, budget_key, ticks)
    executed: list[str] = []

    async def fetch(q: str = "") -> str:
        executed.append(q)
        return "ok"

    guard = BudgetGuard(AcceptAll(), Market([PricedTool("fetch", PRICE)]), 10.0, store=store, budget_key=budget_key,
                        model_prices=MODEL_PRICES, max_output_tokens=64)
    model = _locking_model([ai(call("fetch", q="a"), usage=(40, 4)), ai(text="done", usage=(40, 4))], locker,
                           "answer" if blocked == "commit" else "")
    inner = [_TakeTheRowFirst(locker)] if blocked == "reservation" else []
    agent = create_agent(model, [StructuredTool.from_function(coroutine=fetch, name="fetch", description="fetch")],
                         middleware=[guard.middleware(), *inner])

    result = _run_ticking(agent, "m", ticks)
    locker.join()
    assert result["messages"][-1].content == "done"
    assert locker.ticks_while_waiting is not None and locker.ticks_while_waiting >= TICKS_WHILE_WAITING, locker.ticks_while_waiting
    assert executed == ["a"] and len(model.executions) == 2
    assert store.spent(budget_key) == pytest.approx(PRICE + 2 * MODEL_COST)
    assert store.reserved(budget_key) == 0.0
    model_charges = [c for c in store.charges(budget_key) if c.charge_id.startswith("model:") or "/model:" in c.charge_id]
    assert sorted((c.status, round(c.amount, 9)) for c in model_charges) == [("committed", MODEL_COST)] * 2
    ledger = guard.ledger(result)
    assert ledger.spent == pytest.approx(PRICE + 2 * MODEL_COST) and ledger.reserved == 0.0


# ------------------------------------------------------- a sub-agent without a store, carving from a parent with one
@pytest.mark.parametrize("blocked", ["carve", "close"])
def test_a_sub_agent_carving_from_a_parent_on_a_store_waits_off_the_loop(postgres_dsn, budget_key, blocked):
    """A sub-agent whose guard has no store (budget=FromParent) carves from a parent guard that has one: the
    carve (a reservation in the parent's shared budget) and its close (the commit at what the child spent)
    reach the parent's store. Another connection holds the budget row while the carve (or the close) needs
    it: a coroutine on the same loop keeps ticking, and the money adds up."""
    from langchain.agents import create_agent
    from langchain_core.messages import HumanMessage
    from langchain_core.tools import StructuredTool

    from intent import FromParent
    from intent.testing import ai, call, scripted

    store = open_store(postgres_dsn)
    store.create_budget(budget_key, 10.0)
    ticks = [0]
    locker = RowLocker(postgres_dsn, budget_key, ticks)
    executed: list[str] = []

    async def fetch(q: str = "") -> str:
        executed.append(q)
        if blocked == "close":
            await asyncio.to_thread(locker.take)  # the child's carve is closed after this: it waits
        return "ok"

    fetch_tool = StructuredTool.from_function(coroutine=fetch, name="fetch", description="fetch")
    child_guard = BudgetGuard(AcceptAll(), Market([PricedTool("fetch", PRICE)]), FromParent(limit=2.0))

    async def research(q: str = "") -> str:
        if blocked == "carve":
            await asyncio.to_thread(locker.take)  # taken before the child starts: its carve waits
        child = create_agent(scripted([ai(call("fetch", q=q)), ai(text="child done")]), [fetch_tool],
                             middleware=[child_guard.middleware()])
        out = await child.ainvoke({"messages": [HumanMessage(q)]}, {"configurable": {"thread_id": "child"}})
        return out["messages"][-1].content

    parent_guard = BudgetGuard(AcceptAll(), Market([PricedTool("research", 0.25)]), 10.0, store=store,
                               budget_key=budget_key)
    parent = create_agent(scripted([ai(call("research", q="a")), ai(text="done")]),
                          [StructuredTool.from_function(coroutine=research, name="research", description="delegate")],
                          middleware=[parent_guard.middleware()])

    result = _run_ticking(parent, "p", ticks)
    locker.join()
    assert result["messages"][-1].content == "done"
    assert locker.ticks_while_waiting is not None and locker.ticks_while_waiting >= TICKS_WHILE_WAITING, locker.ticks_while_waiting
    assert executed == ["a"]
    assert store.spent(budget_key) == pytest.approx(0.25 + PRICE)
    assert store.reserved(budget_key) == 0.0
    ledger = parent_guard.ledger(result)
    (carve,) = [e for e in ledger if e.kind == "sub_agent"]
    assert carve.status == "committed" and carve.amount == pytest.approx(PRICE)
    assert ledger.spent == pytest.approx(0.25 + PRICE) and ledger.reserved == 0.0


def test_a_model_execution_cancelled_while_its_reservation_waits_on_the_store_is_released(postgres_dsn, budget_key):
    """The task is cancelled while the execution's reservation waits on the budget row: the reservation goes
    on in its thread and the cancellation waits for it; the request is never sent, so the reservation is
    released (not charged as a cancelled call), and nothing is held once the task is done."""
    from langchain.agents import create_agent

    from intent.testing import ai

    store = open_store(postgres_dsn)
    store.create_budget(budget_key, 10.0)
    box: dict[str, object] = {}

    locker = RowLocker(postgres_dsn, budget_key, [0], hold=0.5, on_wait=_canceller(box))
    guard = BudgetGuard(AcceptAll(), Market([PricedTool("fetch", PRICE)]), 10.0, store=store, budget_key=budget_key,
                        model_prices=MODEL_PRICES, max_output_tokens=64)
    model = _locking_model([ai(text="done", usage=(40, 4))], locker, "")
    agent = create_agent(model, [], middleware=[guard.middleware(), _TakeTheRowFirst(locker)])

    _run_cancelled(agent, "x", box, postgres_dsn, budget_key)
    locker.join()
    assert model.executions == []  # never sent
    assert box["reserved"] == 0.0
    (charge,) = box["charges"]  # the execution's reservation, made once, released once
    assert charge.status == "released"
    assert store.spent(budget_key) == 0.0 and store.reserved(budget_key) == 0.0


@pytest.mark.parametrize("fits", [True, False])
def test_a_model_invoked_synchronously_inside_an_async_step_on_a_store_is_metered_once(tmp_path, budget_key, fits):
    """A middleware inside the guard's async model step calls a side model with a blocking ``invoke``: LangChain's
    sync callback manager runs that execution's callbacks, where the step's sync callback reserves and commits it
    (once: the async twin finds it taken), and a refusal still stops the call before the provider is called."""
    from langchain.agents import create_agent
    from langchain.agents.middleware import AgentMiddleware
    from langchain_core.messages import HumanMessage

    from intent.testing import BilledChatModel, ModelRuns, ai, scripted

    store = open_store(f"sqlite:///{tmp_path / 'budgets.db'}")
    store.create_budget(budget_key, 1.0)
    runs = ModelRuns()
    # 10 tokens in, 100 out: 0.21 at 0.001 / 0.002 a token; at 100 times that a side call does not fit the budget.
    side_price = {"input_per_mtok": 1000.0, "output_per_mtok": 2000.0} if fits else {
        "input_per_mtok": 100_000.0, "output_per_mtok": 200_000.0}
    side = BilledChatModel(model_name="side-model", runs=runs, max_tokens=100)

    class AskASideModel(AgentMiddleware):
        async def awrap_model_call(self, request, handler):
            side.invoke("a side question")  # (blocking, on the loop: a sync callback manager)
            return await handler(request)

    guard = BudgetGuard(AcceptAll(), Market([PricedTool("fetch", PRICE)]), 1.0, store=store, budget_key=budget_key,
                        model_prices={**MODEL_PRICES, "side-model": side_price}, max_output_tokens=64)
    agent = create_agent(scripted([ai(text="done", usage=(40, 4))]), [],
                         middleware=[guard.middleware(), AskASideModel()])
    result = asyncio.run(agent.ainvoke({"messages": [HumanMessage("go")]}, {"configurable": {"thread_id": "s"}}))
    if fits:
        assert result["messages"][-1].content == "done" and runs.names() == ["side-model"]
        assert store.spent(budget_key) == pytest.approx(0.21 + MODEL_COST)
        assert sorted(round(c.amount, 9) for c in store.charges(budget_key)) == [MODEL_COST, 0.21]
    else:
        assert runs.names() == []  # refused before the provider was called
        assert result["messages"][-1].response_metadata.get("intent_stop")
        assert store.spent(budget_key) == 0.0
    assert store.reserved(budget_key) == 0.0


def test_an_async_run_on_a_store_cancelled_while_its_model_waits_on_a_rate_limiter_pays_nothing(tmp_path, budget_key):
    """The execution is reserved in a worker thread, and the model's rate limiter (which LangChain acquires right
    after the start callbacks, in the model call's context) still learns which run waits on it: cancelled there,
    the request was never sent, and its reservation is released, not charged as a cancelled call."""
    from langchain.agents import create_agent
    from langchain_core.rate_limiters import InMemoryRateLimiter

    from intent.testing import BilledChatModel, ModelRuns

    store = open_store(f"sqlite:///{tmp_path / 'budgets.db'}")
    store.create_budget(budget_key, 10.0)
    runs = ModelRuns()
    waiting = asyncio.Event()

    class EmptyBucket(InMemoryRateLimiter):
        async def aacquire(self, *, blocking: bool = True) -> bool:
            waiting.set()
            return await super().aacquire(blocking=blocking)

    empty_bucket = EmptyBucket(requests_per_second=0.001, check_every_n_seconds=0.01)  # waits ~1000 s
    model = BilledChatModel(model_name="primary", runs=runs, rate_limiter=empty_bucket)
    guard = BudgetGuard(AcceptAll(), Market([PricedTool("fetch", PRICE)]), 10.0, store=store, budget_key=budget_key,
                        model_prices={"primary": MODEL_PRICES["scripted-model"]}, max_output_tokens=64)
    agent = create_agent(model, [], middleware=[guard.middleware()])

    async def main() -> None:
        # Cancelled once it waits on the limiter (not after a time: on a loaded machine the reservation before it
        # may not have been made yet).
        run = asyncio.ensure_future(agent.ainvoke({"messages": [("user", "q")]}, {"configurable": {"thread_id": "t"}}))
        await asyncio.wait_for(waiting.wait(), 30)
        run.cancel()
        with pytest.raises(asyncio.CancelledError):
            await run

    asyncio.run(main())
    assert runs.names() == []
    (charge,) = store.charges(budget_key)
    assert charge.status == "released"
    assert store.spent(budget_key) == 0.0 and store.reserved(budget_key) == 0.0
    ledger = guard.episodes.peek("t").ledger
    assert ledger.spent == 0.0 and ledger.reserved == 0.0


# ------------------------------------------- a guard.metered_model copy called outside the guard's model step
SUMMARY_PRICES = {**MODEL_PRICES, "summary-model": MODEL_PRICES["scripted-model"]}


class _TakeTheRowBeforeTheSummary:
    """A middleware before SummarizationMiddleware: takes the budget row once the conversation is long
    enough to be summarised (3 messages: after the first tool call), so that the summariser's own
    reservation (its on_chat_model_start) waits on it."""

    def __new__(cls, locker: RowLocker):
        from langchain.agents.middleware import AgentMiddleware

        class TakeTheRow(AgentMiddleware):
            taken = False

            async def abefore_model(self, state, runtime):
                if not TakeTheRow.taken and len(state["messages"]) >= 3:
                    TakeTheRow.taken = True
                    await asyncio.to_thread(locker.take)
                return None

        return TakeTheRow()


def _summarised_agent(store, key: str, locker: RowLocker, blocked: str, executed: list[str]):
    """An agent calling ``fetch`` once, then answering; a SummarizationMiddleware with a
    ``guard.metered_model`` summariser (called before the guard's second model step, outside it) summarises
    the conversation once it has 3 messages. ``blocked``: what waits on the row the locker takes, the
    summariser's reservation (taken by a middleware before it) or its commit (taken by the summariser as it
    answers)."""
    from langchain.agents import create_agent
    from langchain.agents.middleware import SummarizationMiddleware
    from langchain_core.tools import StructuredTool

    from intent.testing import ai, call, scripted

    async def fetch(q: str = "") -> str:
        executed.append(q)
        return "ok"

    guard = BudgetGuard(AcceptAll(), Market([PricedTool("fetch", PRICE)]), 10.0, store=store, budget_key=key,
                        model_prices=SUMMARY_PRICES, max_output_tokens=64)
    model = scripted([ai(call("fetch", q="a"), usage=(40, 4)), ai(text="done", usage=(40, 4))])
    summariser = _locking_model([ai(text="a summary", usage=(40, 4))], locker,
                                "answer" if blocked == "commit" else "", model_name="summary-model")
    taker = [_TakeTheRowBeforeTheSummary(locker)] if blocked == "reservation" else []
    summarise = SummarizationMiddleware(guard.metered_model(summariser), trigger=("messages", 3),
                                        keep=("messages", 1))
    agent = create_agent(model, [StructuredTool.from_function(coroutine=fetch, name="fetch", description="fetch")],
                         middleware=[*taker, summarise, guard.middleware()])
    return guard, model, summariser, agent


@pytest.mark.parametrize("blocked", ["reservation", "commit"])
def test_a_metered_models_reservation_and_commit_outside_the_model_step_wait_off_the_loop(postgres_dsn, budget_key,
                                                                                         blocked):
    """A summariser made with guard.metered_model runs before the guard's model step (SummarizationMiddleware),
    so the step's callback does not meter it: its own callback reserves each execution before the provider is
    called and commits it after. Another connection holds the budget row while that reservation (or commit)
    needs it: a coroutine on the same loop keeps ticking, and every execution is paid once, nothing held."""
    store = open_store(postgres_dsn)
    store.create_budget(budget_key, 10.0)
    ticks = [0]
    locker = RowLocker(postgres_dsn, budget_key, ticks)
    executed: list[str] = []
    guard, model, summariser, agent = _summarised_agent(store, budget_key, locker, blocked, executed)

    result = _run_ticking(agent, "sum", ticks)
    locker.join()
    assert result["messages"][-1].content == "done"
    assert locker.ticks_while_waiting is not None and locker.ticks_while_waiting >= TICKS_WHILE_WAITING, locker.ticks_while_waiting
    assert executed == ["a"] and len(summariser.executions) == 1
    executions = len(model.executions) + len(summariser.executions)
    assert store.spent(budget_key) == pytest.approx(len(executed) * PRICE + executions * MODEL_COST)
    assert store.reserved(budget_key) == 0.0
    (summary,) = [c for c in store.charges(budget_key) if c.tool == "summary-model"]
    assert summary.status == "committed" and summary.amount == pytest.approx(MODEL_COST)
    ledger = guard.ledger(result)  # (the summary's charge reached graph state: the task wrote it)
    assert ledger.spent == pytest.approx(store.spent(budget_key)) and ledger.reserved == 0.0


def test_a_metered_model_cancelled_while_its_reservation_waits_on_the_store_is_released(postgres_dsn, budget_key):
    """The task is cancelled while the summariser's reservation waits on the budget row: the reservation goes on
    in its thread and the cancellation waits for it; the summary is never asked for, so its reservation is
    released (not charged as a cancelled call), and nothing is held once the task is done."""
    store = open_store(postgres_dsn)
    store.create_budget(budget_key, 10.0)
    box: dict[str, object] = {}
    locker = RowLocker(postgres_dsn, budget_key, [0], hold=0.5, on_wait=_canceller(box))
    executed: list[str] = []
    guard, model, summariser, agent = _summarised_agent(store, budget_key, locker, "reservation", executed)

    _run_cancelled(agent, "sx", box, postgres_dsn, budget_key)
    locker.join()
    assert summariser.executions == []  # never sent
    (summary,) = [c for c in box["charges"] if c.tool == "summary-model"]  # reserved once, released once
    assert summary.status == "released"
    assert box["reserved"] == 0.0
    assert box["spent"] == pytest.approx(len(executed) * PRICE + len(model.executions) * MODEL_COST)
    assert store.reserved(budget_key) == 0.0


@pytest.mark.parametrize("fits", [True, False])
@pytest.mark.parametrize("how", ["invoke", "ainvoke", "astream"])
def test_a_metered_model_called_outside_the_model_step_of_an_async_run_on_a_store_is_metered_once(tmp_path, budget_key,
                                                                                               how, fits):
    """A middleware before the guard calls a guard.metered_model copy: asynchronously (ainvoke, astream: its
    async twin reserves and commits in a worker thread) or with a blocking invoke (LangChain's sync callback
    manager: the copy's own callback, inline, as before). Either way the execution is paid once, at its usage,
    and a refusal stops it before the provider is called (and the run with it: MeteredModelRefused)."""
    from langchain.agents import create_agent
    from langchain.agents.middleware import AgentMiddleware
    from langchain_core.messages import HumanMessage

    from intent import MeteredModelRefused
    from intent.testing import BilledChatModel, ModelRuns, ai, scripted

    store = open_store(f"sqlite:///{tmp_path / 'budgets.db'}")
    store.create_budget(budget_key, 1.0)
    runs = ModelRuns()
    # 10 tokens in, 100 out: 0.21 at 0.001 / 0.002 a token; at 100 times that a side call does not fit the budget.
    side_price = {"input_per_mtok": 1000.0, "output_per_mtok": 2000.0} if fits else {
        "input_per_mtok": 100_000.0, "output_per_mtok": 200_000.0}
    guard = BudgetGuard(AcceptAll(), Market([PricedTool("fetch", PRICE)]), 1.0, store=store, budget_key=budget_key,
                        model_prices={**MODEL_PRICES, "side-model": side_price}, max_output_tokens=64)
    side = guard.metered_model(BilledChatModel(model_name="side-model", runs=runs, max_tokens=100))

    class AskASideModel(AgentMiddleware):
        async def abefore_model(self, state, runtime):
            if how == "invoke":
                side.invoke("a side question")  # (blocking, on the loop: a sync callback manager)
            elif how == "ainvoke":
                await side.ainvoke("a side question")
            else:
                assert [c async for c in side.astream("a side question")]
            return None

    agent = create_agent(scripted([ai(text="done", usage=(40, 4))]), [],
                         middleware=[AskASideModel(), guard.middleware()])
    run = agent.ainvoke({"messages": [HumanMessage("go")]}, {"configurable": {"thread_id": "s"}})
    if fits:
        result = asyncio.run(run)
        assert result["messages"][-1].content == "done" and runs.names() == ["side-model"]
        assert store.spent(budget_key) == pytest.approx(0.21 + MODEL_COST)
        assert sorted(round(c.amount, 9) for c in store.charges(budget_key)) == [MODEL_COST, 0.21]
        assert guard.ledger(result).spent == pytest.approx(0.21 + MODEL_COST)
    else:
        with pytest.raises(MeteredModelRefused):
            asyncio.run(run)
        assert runs.names() == []  # refused before the provider was called
        assert store.spent(budget_key) == 0.0 and store.charges(budget_key) == []
    assert store.reserved(budget_key) == 0.0


@pytest.mark.parametrize("how", ["ainvoke", "astream", "astream_events_v3"])
def test_each_async_call_of_a_metered_model_reserves_off_the_loop(postgres_dsn, budget_key, how):
    """A middleware before the guard takes the budget row, then calls a guard.metered_model copy each async way
    LangChain has (ainvoke, astream, astream_events v3: each configures its run's callbacks itself): the copy's
    reservation waits on the row while a coroutine on the same loop keeps ticking; the call is paid once."""
    from langchain.agents import create_agent
    from langchain.agents.middleware import AgentMiddleware

    from intent.testing import BilledChatModel, ModelRuns, ai, scripted

    store = open_store(postgres_dsn)
    store.create_budget(budget_key, 10.0)
    ticks = [0]
    locker = RowLocker(postgres_dsn, budget_key, ticks)
    runs = ModelRuns()
    guard = BudgetGuard(AcceptAll(), Market([PricedTool("fetch", PRICE)]), 10.0, store=store, budget_key=budget_key,
                        model_prices={**MODEL_PRICES, "side-model": MODEL_PRICES["scripted-model"]},
                        max_output_tokens=64)
    side = guard.metered_model(BilledChatModel(model_name="side-model", runs=runs, max_tokens=100))

    class AskASideModel(AgentMiddleware):
        async def abefore_model(self, state, runtime):
            await asyncio.to_thread(locker.take)
            if how == "ainvoke":
                await side.ainvoke("a side question")
            elif how == "astream":
                assert [c async for c in side.astream("a side question")]
            else:
                assert [e async for e in await side.astream_events("a side question", version="v3")]
            return None

    agent = create_agent(scripted([ai(text="done", usage=(40, 4))]), [], middleware=[AskASideModel(),
                                                                                     guard.middleware()])
    result = _run_ticking(agent, "side", ticks)
    locker.join()
    assert result["messages"][-1].content == "done" and runs.names() == ["side-model"]
    assert locker.ticks_while_waiting is not None and locker.ticks_while_waiting >= TICKS_WHILE_WAITING, locker.ticks_while_waiting
    assert store.spent(budget_key) == pytest.approx(0.21 + MODEL_COST) and store.reserved(budget_key) == 0.0
    assert sorted(round(c.amount, 9) for c in store.charges(budget_key)) == [MODEL_COST, 0.21]


@pytest.mark.parametrize("how", ["ainvoke", "astream"])
def test_a_metered_model_cancelled_on_its_rate_limiter_releases_off_the_loop(postgres_dsn, budget_key, how):
    """A guard.metered_model copy called outside the guard's model step waits on its rate limiter (reserved, not
    sent) when its task is cancelled, while another connection holds the budget row: LangChain reports no end
    for that run, the copy's own watch releases its reservation in a worker thread (the loop ticks meanwhile)
    and the cancellation waits for it, so once the task is done the store has it released, nothing held."""
    from langchain.agents import create_agent
    from langchain.agents.middleware import AgentMiddleware
    from langchain_core.messages import HumanMessage
    from langchain_core.rate_limiters import InMemoryRateLimiter

    from intent.testing import BilledChatModel, ModelRuns, ai, scripted

    store = open_store(postgres_dsn)
    store.create_budget(budget_key, 10.0)
    ticks = [0]
    locker = RowLocker(postgres_dsn, budget_key, ticks)
    runs = ModelRuns()
    empty_bucket = InMemoryRateLimiter(requests_per_second=0.001, check_every_n_seconds=0.01)  # waits ~1000 s
    guard = BudgetGuard(AcceptAll(), Market([PricedTool("fetch", PRICE)]), 10.0, store=store, budget_key=budget_key,
                        model_prices={**MODEL_PRICES, "side-model": MODEL_PRICES["scripted-model"]},
                        max_output_tokens=64)
    side = guard.metered_model(BilledChatModel(model_name="side-model", runs=runs, max_tokens=100,
                                               rate_limiter=empty_bucket))

    class AskASideModel(AgentMiddleware):
        async def abefore_model(self, state, runtime):
            if how == "ainvoke":
                await side.ainvoke("a side question")
            else:
                assert [c async for c in side.astream("a side question")]
            return None

    agent = create_agent(scripted([ai(text="done", usage=(40, 4))]), [], middleware=[AskASideModel(),
                                                                                     guard.middleware()])
    reader = open_store(postgres_dsn)

    async def main() -> None:
        task = asyncio.create_task(agent.ainvoke({"messages": [HumanMessage("go")]},
                                                 {"configurable": {"thread_id": "rl"}}))
        while not await asyncio.to_thread(reader.charges, budget_key):  # reserved: now on its rate limiter
            await asyncio.sleep(0.01)
        await asyncio.to_thread(locker.take)
        task.cancel()  # its release waits on the row
        with pytest.raises(asyncio.CancelledError):
            await _ticking_while(task, ticks)
        (charge,) = await asyncio.to_thread(reader.charges, budget_key)
        assert charge.status == "released"  # (already when the cancelled task is done)

    asyncio.run(main())
    locker.join()
    reader.close()
    assert runs.names() == []
    assert locker.ticks_while_waiting is not None and locker.ticks_while_waiting >= TICKS_WHILE_WAITING, locker.ticks_while_waiting
    assert store.spent(budget_key) == 0.0 and store.reserved(budget_key) == 0.0
