"""Worker processes for the shared-budget tests (importable by multiprocessing's spawn)."""

from __future__ import annotations

import json
import os
import random
import time
from pathlib import Path
from typing import Any

from intent.ledger import BudgetExceededError
from intent.stores import open_store


def hammer(url: str, key: str, worker: int, calls: int, seed: int, out: str) -> None:
    """``calls`` priced calls with random prices: reserve, then commit (sometimes billed less),
    or release; some operations are sent twice (idempotency). Writes what it committed."""
    store = open_store(url)
    rng = random.Random(seed)
    committed: dict[str, float] = {}
    refused = 0
    for j in range(calls):
        cid = f"w{worker}-c{j}"
        price = round(rng.uniform(0.01, 2.0), 4)
        try:
            store.reserve(key, cid, price, run_id=f"w{worker}", tool=rng.choice(["search", "fetch"]))
        except BudgetExceededError:
            refused += 1
            continue
        if rng.random() < 0.1:
            store.reserve(key, cid, price)  # a replayed reserve changes nothing
        if rng.random() < 0.2:
            store.release(key, cid)
            continue
        billed = price if rng.random() < 0.7 else round(price * rng.uniform(0.0, 1.0), 4)
        charge = store.commit(key, cid, billed)
        if rng.random() < 0.1:
            store.commit(key, cid, billed)  # a replayed commit is not a second charge
        committed[cid] = charge.amount
    Path(out).write_text(json.dumps({"committed": committed, "refused": refused}))


def reserve_then_die(url: str, key: str, progress: str, lease: float) -> None:
    """Reserve and commit in a loop, writing each commit to ``progress`` after the store has it;
    the parent kills this process (SIGKILL) at a random point."""
    store = open_store(url, lease_seconds=lease)
    j = 0
    while True:
        cid = f"k-{os.getpid()}-{j}"
        store.reserve(key, cid, 0.01, run_id="doomed")
        time.sleep(0.002)
        charge = store.commit(key, cid)
        with open(progress, "a") as fh:
            fh.write(json.dumps([cid, charge.amount]) + "\n")
        store.reserve(key, f"{cid}-held", 0.02, run_id="doomed")  # held when the kill comes, often
        time.sleep(0.003)
        store.release(key, f"{cid}-held")
        j += 1


def guarded_agent(url: str, key: str, thread: str, calls: int, out: str) -> None:
    """An agent behind a guard drawing on the shared budget ``key``: ``calls`` priced calls."""
    from langchain.agents import create_agent
    from langchain_core.messages import AIMessage, HumanMessage
    from langchain_core.tools import StructuredTool

    from intent import AcceptAll, BudgetGuard, Market, MemoryLogSink, PricedTool
    from intent.testing import ScriptedToolModel

    runs: list[int] = []

    def fetch(q: str = "") -> str:
        runs.append(1)
        return "ok"

    script = [AIMessage("", tool_calls=[{"name": "fetch", "args": {"q": str(i)}, "id": f"{thread}-{i}",
                                         "type": "tool_call"}]) for i in range(calls)] + [AIMessage("done")]
    sink = MemoryLogSink()
    guard = BudgetGuard(AcceptAll(), Market([PricedTool("fetch", 0.25)]), 100.0, store=open_store(url),
                        budget_key=key, log_sink=sink)
    agent = create_agent(ScriptedToolModel(messages=iter(script), bound=[]),
                         [StructuredTool.from_function(fetch, name="fetch", description="fetch")],
                         middleware=[guard.middleware()])
    state = agent.invoke({"messages": [HumanMessage("go")]}, {"configurable": {"thread_id": thread},
                                                                "recursion_limit": 10 * calls + 10})
    ledger = guard.ledger(state)
    Path(out).write_text(json.dumps({"spent": ledger.spent, "reserved": ledger.reserved, "runs": len(runs),
                                     "refused": sum(1 for r in sink.records if r.reason == "over_budget")}))


def checkpointed_run(url: str, key: str, saver_kind: str, saver_url: str, phase: str, out: str) -> None:
    """One half of a run paused by a human review and resumed in another process."""
    from langchain.agents import create_agent
    from langchain.agents.middleware import HumanInTheLoopMiddleware
    from langchain_core.messages import AIMessage, HumanMessage
    from langchain_core.tools import StructuredTool
    from langgraph.types import Command

    from intent import AcceptAll, BudgetGuard, Market, PricedTool
    from intent.testing import ScriptedToolModel

    def tool(q: str = "") -> str:
        return "ok"

    msgs: list[Any] = [
        AIMessage("", tool_calls=[{"name": "search", "args": {"q": "1"}, "id": "s1", "type": "tool_call"}]),
        AIMessage("", tool_calls=[{"name": "fetch", "args": {"q": "2"}, "id": "f1", "type": "tool_call"}]),
        AIMessage("done"),
    ]
    # The model's turns already taken before the pause are not replayed on resume.
    model = ScriptedToolModel(messages=iter(msgs if phase == "start" else msgs[2:]), bound=[])
    guard = BudgetGuard(AcceptAll(), Market([PricedTool("search", 0.5), PricedTool("fetch", 1.5)]), 10.0,
                        store=open_store(url), budget_key=key)
    tools = [StructuredTool.from_function(tool, name=n, description=n) for n in ("search", "fetch")]

    def run(saver: Any) -> dict[str, Any]:
        agent = create_agent(model, tools, checkpointer=saver, middleware=[
            HumanInTheLoopMiddleware(interrupt_on={"fetch": True}), guard.middleware()])
        # (The thread is the test's own: a PostgreSQL saver keeps its checkpoints on the server the tests share.)
        cfg = {"configurable": {"thread_id": f"paused-{key}"}}
        if phase == "start":
            return agent.invoke({"messages": [HumanMessage("go")]}, cfg)
        return agent.invoke(Command(resume={"decisions": [{"type": "approve"}]}), cfg)

    if saver_kind == "sqlite":
        import sqlite3

        from langgraph.checkpoint.sqlite import SqliteSaver

        conn = sqlite3.connect(saver_url, check_same_thread=False)
        state = run(SqliteSaver(conn))
        conn.close()
    else:
        from langgraph.checkpoint.postgres import PostgresSaver

        with PostgresSaver.from_conn_string(saver_url) as saver:
            saver.setup()
            state = run(saver)
    ledger = guard.ledger(state)
    Path(out).write_text(json.dumps({"interrupted": bool(state.get("__interrupt__")), "spent": ledger.spent,
                                     "reserved": ledger.reserved}))


def run_then_die_with_commits_kept(url: str, key: str, journal: str | None, calls: int, out: str) -> None:
    """An agent behind a guard whose store takes reservations but cannot take commits (unreachable past its
    retries): one message with ``calls`` priced calls, which run and whose commits are kept; then, when the model
    is asked again, the process is killed (SIGKILL: no exit handlers, nothing flushed)."""
    import signal

    from langchain.agents import create_agent
    from langchain_core.messages import AIMessage, HumanMessage
    from langchain_core.tools import StructuredTool

    from intent import AcceptAll, BudgetGuard, Market, PricedTool
    from intent.stores import StoreUnavailableError
    from intent.testing import ScriptedToolModel

    class CommitsUnreachable:
        def __init__(self, store: Any) -> None:
            self.store = store

        def commit(self, *args: Any, **kwargs: Any) -> Any:
            raise StoreUnavailableError("the budget store failed commit 5 times: OperationalError: server closed")

        def __getattr__(self, name: str) -> Any:
            return getattr(self.store, name)

    ran: list[str] = []

    def fetch(q: str = "") -> str:
        ran.append(q)
        return "ok"

    guard = BudgetGuard(AcceptAll(), Market([PricedTool("fetch", 0.25)]), 100.0,
                        store=CommitsUnreachable(open_store(url)), budget_key=key, outbox_journal=journal)

    def script() -> Any:
        yield AIMessage("", tool_calls=[{"name": "fetch", "args": {"q": str(i)}, "id": f"die-{i}",
                                         "type": "tool_call"} for i in range(calls)])
        Path(out).write_text(json.dumps({"ran": len(ran), "kept": len(guard.store_outbox.pending)}))
        os.kill(os.getpid(), signal.SIGKILL)  # between the tool step and the next model step
        yield AIMessage("done")

    agent = create_agent(ScriptedToolModel(messages=script(), bound=[]),
                         [StructuredTool.from_function(fetch, name="fetch", description="fetch")],
                         middleware=[guard.middleware()])
    agent.invoke({"messages": [HumanMessage("go")]}, {"configurable": {"thread_id": "dies"}})


def reserve_and_hang(url: str, key: str, charge_id: str, amount: float, ready: str) -> None:
    """Hold ``amount`` under ``charge_id`` (run ``doomed``), say so in ``ready``, and wait to be killed."""
    store = open_store(url)
    store.reserve(key, charge_id, amount, run_id="doomed", tool="fetch")
    Path(ready).write_text("held")
    time.sleep(600)
