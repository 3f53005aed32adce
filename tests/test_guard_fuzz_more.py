"""Seeded fuzzing of the guard composed as users compose it, where the earlier property tests do not go.

``tests/test_guard_compose_properties.py`` stacks LangChain's middleware around the guard; this one adds, in random
orders around it (and around each other):

* custom ``wrap_tool_call`` middleware that retry the handler themselves (on an exception or on any error answer,
  which a guard's refusal is), rewrite a call's arguments (once, or differently on each run: ``Escalate``), send a
  call to another tool with ``request.override(tool_call=..., tool=...)``, fail before the handler or after it has
  run (their own service down, once per call: the step crashes and the thread is resumed), answer a call
  themselves, or run a call twice (async: both runs at once);
* ToolCallLimitMiddleware with each ``exit_behavior`` (``"continue"``, ``"error"``, ``"end"``), run or thread
  limits, all tools or one; HumanInTheLoopMiddleware (approve / edit / edit to another tool / reject, several
  reviews in one batch); ToolRetryMiddleware, ToolErrorMiddleware, ModelRetryMiddleware (a model that fails),
  ModelCallLimitMiddleware, ContextEditingMiddleware;
* tools that return a ``Command`` (with ``InjectedToolCallId``), that take a ``ToolRuntime``, that fail on given
  runs, that report their provider's bill (nothing, half, the quote, or twice it: an overrun); parallel and
  repeated calls in one message;
* ``invoke``, ``stream`` (left early, then the thread resumed), ``ainvoke``, ``astream`` and ``astream_events``
  (left early too), an ``ainvoke`` cancelled while a tool sleeps (then resumed); ``InMemorySaver`` and
  ``SqliteSaver``; a second user turn on the thread;
* two threads drawing on one shared budget store (memory or SQLite) at once, with one guard or a guard each.

After every example (the thread driven to its end, every interrupt answered, every crash resumed):

* ``spent == Σ runs × price`` (runs counted inside the tools' bodies; the billing tool's runs at their bills)
  ``<= budget`` (``+ overrun``: only a bill above its reservation goes past it), and with a store,
  ``store.spent ==`` both threads' spend ``<= the shared budget (+ their overruns)``, nothing held in the store;
* nothing reserved (a run ended by ToolCallLimitMiddleware's ``"error"`` excepted: its reservations are released
  at the thread's next model step, as documented);
* every proposed call answered by exactly one ToolMessage; one execution record per run; the log's charges add up
  to the spend;
* with an oracle that refuses every call with ``x == 3``, no call with ``x == 3`` runs: a call edited after the
  gate (a reviewer, a middleware rewriting arguments, on any run) is re-gated before it runs.

Found by it (each has a regression test below, red before its fix):

* an edited call whose re-gate the oracle refused ran anyway when a middleware inside the guard asked for the call
  again (a retry on the refusal, a ToolRetryMiddleware after a failure), and a retry whose arguments a middleware
  rewrote again was never re-gated (``intent/metering.py``, ``CallRun._regate`` / ``_edited``);
* a call run twice at once (a hedging middleware) whose runs were both cancelled before their bodies started: on
  resume a run took a released run's charge id, ran holding nothing and failed to commit (``LedgerError``, the run
  unpaid; ``CallRun._reserve``);
* an ``after_model`` gate whose step was cancelled after it had reserved, run again on resume, skipped the calls
  it had reserved and wrote no decision: a reviewer's edit then ran without a re-gate, and another process refused
  the approved call as never approved (``intent/gate.py``).

Each example's seed and scenario are in its failure message (``run_agent(scenario(seed))`` replays it; a
cancellation's timing varies from run to run).

``INTENT_FUZZ_SEEDS`` sets how many seeds the fast tests run (240 agent, 48 shared-store); the slow ones run 2000
and 300.
"""

from __future__ import annotations

import asyncio
import os
import random
import sqlite3
from collections import Counter
from typing import Annotated, Any

import pytest
from langchain.agents import create_agent
from langchain.agents.middleware import (
    AgentMiddleware,
    ClearToolUsesEdit,
    ContextEditingMiddleware,
    HumanInTheLoopMiddleware,
    ModelCallLimitMiddleware,
    ModelRetryMiddleware,
    ToolCallLimitMiddleware,
    ToolErrorMiddleware,
    ToolRetryMiddleware,
)
from langchain.tools import ToolRuntime
from langchain_core.callbacks import AsyncCallbackHandler
from langchain_core.messages import AIMessage, ToolMessage
from langchain_core.tools import InjectedToolCallId, StructuredTool
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.checkpoint.sqlite import SqliteSaver
from langgraph.types import Command

from intent import AcceptAll, BudgetGuard, Decision, Market, MemoryLogSink, PricedTool
from intent.stores import MemoryBudgetStore, SqliteBudgetStore
from intent.testing import ScriptedToolModel, ai, assert_each_call_answered_once, assert_one_record_per_call, call

SEEDS = int(os.environ.get("INTENT_FUZZ_SEEDS", "240"))
NAMES = ["t0", "t1", "t2", "t3", "cmd", "rt", "bill"]  # t1, rt: reviewed; t0: rewritten; t2: sent to t1; t3: answered
BILL_FACTORS = [0.0, 0.5, 1.0, 2.0]  # bill's bill, × its price, by x (0: a failure not billed; 2: an overrun)
MODES = ["sync", "async"]


class ToolDown(RuntimeError):
    """A tool's own failure."""


class MiddlewareDown(RuntimeError):
    """A middleware's own failure (its service down), not the tool's."""


class RefusesThree:
    """An oracle with a reason of its own: it refuses every call whose ``x`` is 3."""

    def decide(self, ctx: Any) -> Decision:
        if ctx.args.get("x") == 3:
            return Decision.rejected(f"{ctx.tool} with x=3 is not wanted", reason="refuses_three")
        return Decision.accepted()


def make_tools(fail_runs: dict[str, set[int]], runs: Counter, xs: Counter, prices: dict[str, float],
               bills: list[float]) -> list[StructuredTool]:
    """The tools, counting their runs (by name, and by argument ``x``) in their bodies; ``bill`` reports what its
    provider billed (``BILL_FACTORS[x]`` × its price, in its artifact), appended to ``bills``, or its price when it
    fails without a bill (the guard charges a failed run its quote)."""

    def counted(name: str, x: int) -> None:
        runs[name] += 1
        xs[x] += 1
        if runs[name] in fail_runs.get(name, ()):
            raise ToolDown(f"{name} is down (run {runs[name]})")

    def make(name: str) -> StructuredTool:
        def run(x: int = 0) -> str:
            counted(name, x)
            return f"{name}:{x}"

        async def arun(x: int = 0) -> str:
            if name == "t1":  # a slow body: a cancellation may land while it runs (it started: paid)
                counted(name, x)
                await asyncio.sleep(0.02)
                return f"{name}:{x}"
            return run(x)

        return StructuredTool.from_function(run, coroutine=arun, name=name, description=f"tool {name}")

    def cmd(x: int, tool_call_id: Annotated[str, InjectedToolCallId]) -> Command:
        counted("cmd", x)
        return Command(update={"messages": [ToolMessage(f"cmd:{x}", tool_call_id=tool_call_id, name="cmd")]})

    async def acmd(x: int, tool_call_id: Annotated[str, InjectedToolCallId]) -> Command:
        return cmd(x, tool_call_id)

    def bill(x: int) -> tuple[str, dict[str, float]]:
        try:
            counted("bill", x)
        except ToolDown:
            bills.append(prices["bill"])
            raise
        bills.append(prices["bill"] * BILL_FACTORS[x])
        return f"bill:{x}", {"intent_billed": bills[-1]}

    async def abill(x: int) -> tuple[str, dict[str, float]]:
        return bill(x)

    def rt(x: int, runtime: ToolRuntime) -> str:
        counted("rt", x)
        return f"rt:{x}:{runtime.tool_call_id}"

    async def art(x: int, runtime: ToolRuntime) -> str:
        return rt(x, runtime)

    return [*(make(n) for n in NAMES[:4]),
            StructuredTool.from_function(cmd, coroutine=acmd, name="cmd", description="returns a Command"),
            StructuredTool.from_function(rt, coroutine=art, name="rt", description="reads its runtime"),
            StructuredTool.from_function(bill, coroutine=abill, name="bill", description="reports its bill",
                                         response_format="content_and_artifact")]


# ------------------------------------------------------------------ custom tool-call middleware
class _Custom(AgentMiddleware):
    """A tool-call middleware written once for both hooks: ``edit`` the request, then ``call`` the handler."""

    def edit(self, request: Any) -> Any:
        return request

    def wrap_tool_call(self, request: Any, handler: Any) -> Any:
        return handler(self.edit(request))

    async def awrap_tool_call(self, request: Any, handler: Any) -> Any:
        return await handler(self.edit(request))


class RetryOnError(_Custom):
    """Asks for the call again, up to twice, when it raised a tool's error or was answered with an error (a
    guard's refusal is one)."""

    def __init__(self, times: int = 2) -> None:
        super().__init__()
        self.times = times

    def wrap_tool_call(self, request: Any, handler: Any) -> Any:
        for attempt in range(self.times + 1):
            try:
                out = handler(request)
            except ToolDown:
                if attempt == self.times:
                    raise
                continue
            if not (isinstance(out, ToolMessage) and out.status == "error") or attempt == self.times:
                return out
        raise AssertionError("unreachable")

    async def awrap_tool_call(self, request: Any, handler: Any) -> Any:
        for attempt in range(self.times + 1):
            try:
                out = await handler(request)
            except ToolDown:
                if attempt == self.times:
                    raise
                continue
            if not (isinstance(out, ToolMessage) and out.status == "error") or attempt == self.times:
                return out
        raise AssertionError("unreachable")


class ArgBump(_Custom):
    """Rewrites t0's ``x`` to ``x + 1`` (3 from 2: what RefusesThree refuses)."""

    def edit(self, request: Any) -> Any:
        c = request.tool_call
        if c["name"] != "t0":
            return request
        return request.override(tool_call={**c, "args": {**c["args"], "x": int(c["args"].get("x", 0)) + 1}})


class Escalate(_Custom):
    """Each time it passes a t0 call on, the call's ``x`` is how many times it has (1, 2, then 3)."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: Counter = Counter()

    def edit(self, request: Any) -> Any:
        c = request.tool_call
        if c["name"] != "t0":
            return request
        self.seen[c["id"]] += 1
        return request.override(tool_call={**c, "args": {**c["args"], "x": min(3, self.seen[c["id"]])}})


class Redirect(_Custom):
    """Sends t2's calls to t1 (the tool from ``runtime.tools``, as a reviewer's redirect is resolved)."""

    def edit(self, request: Any) -> Any:
        c = request.tool_call
        target = next((t for t in getattr(request.runtime, "tools", None) or [] if t.name == "t1"), None)
        if c["name"] != "t2" or target is None:
            return request
        return request.override(tool_call={**c, "name": "t1"}, tool=target)


class FailsBefore(_Custom):
    """Its own service is down the first time it sees each t1 call: it raises before the handler."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: set[str] = set()

    def edit(self, request: Any) -> Any:
        c = request.tool_call
        if c["name"] == "t1" and c["id"] not in self.seen:
            self.seen.add(c["id"])
            raise MiddlewareDown("down before the run")
        return request


class FailsAfter(_Custom):
    """Fails the first time each t1 or t2 call comes back through it: after the handler (the tool ran)."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: set[str] = set()

    def _after(self, request: Any, out: Any) -> Any:
        c = request.tool_call
        if c["name"] in ("t1", "t2") and c["id"] not in self.seen:
            self.seen.add(c["id"])
            raise MiddlewareDown("down after the run")
        return out

    def wrap_tool_call(self, request: Any, handler: Any) -> Any:
        return self._after(request, handler(request))

    async def awrap_tool_call(self, request: Any, handler: Any) -> Any:
        return self._after(request, await handler(request))


class Answerer(_Custom):
    """Answers t3's calls itself (a cache): the tool never runs."""

    def wrap_tool_call(self, request: Any, handler: Any) -> Any:
        if request.tool_call["name"] == "t3":
            return ToolMessage("from cache", tool_call_id=request.tool_call["id"], name="t3")
        return handler(request)

    async def awrap_tool_call(self, request: Any, handler: Any) -> Any:
        if request.tool_call["name"] == "t3":
            return ToolMessage("from cache", tool_call_id=request.tool_call["id"], name="t3")
        return await handler(request)


class Hedge(_Custom):
    """Runs each ``cmd`` call twice and keeps the first answer (async: both runs at once)."""

    def wrap_tool_call(self, request: Any, handler: Any) -> Any:
        if request.tool_call["name"] != "cmd":
            return handler(request)
        first = handler(request)
        handler(request)
        return first

    async def awrap_tool_call(self, request: Any, handler: Any) -> Any:
        if request.tool_call["name"] != "cmd":
            return await handler(request)
        answers = await asyncio.gather(handler(request), handler(request), return_exceptions=True)
        for answer in answers:
            if not isinstance(answer, BaseException):
                return answer
        raise answers[0]


# ------------------------------------------------------------------ scenarios
EXTRAS = ["retry", "tool_error", "retry_on_error", "arg_bump", "escalate", "redirect", "fails_before", "fails_after",
          "answerer", "hedge", "model_limit", "model_retry", "context_edit"]


def scenario(seed: int) -> dict[str, Any]:
    rng = random.Random(seed)
    # ToolCallLimitMiddleware and HumanInTheLoopMiddleware together answer a rejected call twice without any guard
    # (both answer it in after_model): at most one of them.
    order = ["guard", *rng.choice([[], ["limit"], ["hitl"]]), *(k for k in EXTRAS if rng.random() < 0.3)]
    rng.shuffle(order)
    return {
        "seed": seed,
        "order": order,
        "prices": {n: rng.choice([0.0, 1.0, 2.5, 5.0, 10.0]) for n in NAMES},
        "budget": rng.choice([0.0, 5.0, 12.0, 30.0, 100.0]),
        "fail_runs": {n: set(rng.sample(range(1, 7), rng.randint(0, 2))) for n in NAMES},
        "turns": [[(rng.choice(NAMES), rng.randint(0, 3)) for _ in range(rng.randint(1, 4))]
                  for _ in range(rng.randint(1, 4))],
        "limit_exit": rng.choice(["continue", "error", "end"]),
        "limit_kind": rng.choice(["run", "thread"]),
        "limit_tool": rng.choice([None, "t0", "t1"]),
        "tool_limit": rng.randint(1, 4),
        "model_limit": rng.randint(1, 5),
        "retries": rng.randint(1, 3),
        "reviews": [rng.choice(["approve", "edit", "edit_tool", "reject"]) for _ in range(8)],
        "oracle": rng.choice(["accept_all", "refuses_three"]),
        "gate_at": rng.choice(["model_call", "after_model"]),
        "tool_errors": rng.choice(["raise", "message"]),
        "mode": rng.choice(["invoke", "stream", "ainvoke", "astream", "astream_events"]),
        "ckpt": rng.choice(["memory", "sqlite"]),
        "leave_after": rng.choice([None, None, 1, 2, 3]),  # a stream's reader leaves after this many chunks
        "second_turn": rng.random() < 0.4,
        # at most two failed model executions, so ModelRetryMiddleware's two retries get through
        "model_failures": set(rng.sample(range(1, 9), rng.randint(0, 2))),
        "cancel_after": rng.choice([None, None, None, 0.01, 0.03, 0.06]),  # ainvoke cancelled after (s)
        # two threads on one shared budget store
        "turns_b": [[(rng.choice(NAMES), rng.randint(0, 3)) for _ in range(rng.randint(1, 4))]
                    for _ in range(rng.randint(1, 4))],
        "store": rng.choice(["memory", "sqlite"]),
        "shared_budget": rng.choice([0.0, 5.0, 10.0, 20.0, 60.0]),
        "one_guard": rng.random() < 0.5,
    }


def stack(sc: dict[str, Any], guard: BudgetGuard) -> list[Any]:
    made = {
        "guard": guard.middleware,
        "retry": lambda: ToolRetryMiddleware(max_retries=sc["retries"], initial_delay=0.0, jitter=False,
                                             backoff_factor=0.0, on_failure="continue"),
        "limit": lambda: ToolCallLimitMiddleware(tool_name=sc["limit_tool"], exit_behavior=sc["limit_exit"],
                                                 **{f"{sc['limit_kind']}_limit": sc["tool_limit"]}),
        "hitl": lambda: HumanInTheLoopMiddleware(interrupt_on={"t1": True, "rt": True}),
        "model_limit": lambda: ModelCallLimitMiddleware(run_limit=sc["model_limit"], exit_behavior="end"),
        "model_retry": lambda: ModelRetryMiddleware(max_retries=2, initial_delay=0.0, jitter=False,
                                                    backoff_factor=0.0),
        "context_edit": lambda: ContextEditingMiddleware(edits=[ClearToolUsesEdit(trigger=50, keep=1)]),
        "tool_error": lambda: ToolErrorMiddleware(lambda exc, request: f"tool error: {exc}"),
        "retry_on_error": RetryOnError,
        "arg_bump": ArgBump,
        "escalate": Escalate,
        "redirect": Redirect,
        "fails_before": FailsBefore,
        "fails_after": FailsAfter,
        "answerer": Answerer,
        "hedge": Hedge,
    }
    return [made[k]() for k in sc["order"]]


def script(turns: list[list[tuple[str, int]]], prefix: str = "c") -> list[AIMessage]:
    out, k = [], 0
    for calls in turns:
        tool_calls = []
        for name, x in calls:
            k += 1
            tool_calls.append({"name": name, "args": {"x": x}, "id": f"{prefix}{k}", "type": "tool_call"})
        out.append(AIMessage("plan", tool_calls=tool_calls))
    return [*out, *(AIMessage("final answer") for _ in range(12))]


def review(sc: dict[str, Any], interrupt: Any, k: int) -> dict[str, Any]:
    decisions = []
    for i, action in enumerate(interrupt.value["action_requests"]):
        kind = sc["reviews"][(k + i) % len(sc["reviews"])]
        if kind in ("edit", "edit_tool"):  # x=3: what RefusesThree refuses, so a run that skipped the re-gate shows
            name = "t2" if kind == "edit_tool" else action["name"]
            decisions.append({"type": "edit", "edited_action": {"name": name, "args": {"x": 3}}})
        else:
            decisions.append({"type": kind, **({"message": "no"} if kind == "reject" else {})})
    return {"decisions": decisions}


def new_guard(sc: dict[str, Any], sink: MemoryLogSink, **kwargs: Any) -> BudgetGuard:
    return BudgetGuard(RefusesThree() if sc["oracle"] == "refuses_three" else AcceptAll(),
                       Market([PricedTool(n, p) for n, p in sc["prices"].items()]), sc["budget"], log_sink=sink,
                       tool_errors=sc["tool_errors"], gate_at=sc["gate_at"], **kwargs)


class Drive:
    """Drives one thread to its end: interrupts answered, crashes resumed, streams left early and resumed."""

    def __init__(self, sc: dict[str, Any], agent: Any, config: dict[str, Any], mode: str) -> None:
        self.sc, self.agent, self.config, self.mode = sc, agent, config, mode
        self.left = self.cancelled = self.crashed = 0
        self.limit_error = False

    def _values(self) -> dict[str, Any]:
        snapshot = self.agent.get_state(self.config)
        return {**snapshot.values, **({"__interrupt__": snapshot.interrupts} if snapshot.interrupts else {})}

    def _sync(self, inp: Any) -> dict[str, Any] | None:
        if self.mode != "stream":
            return self.agent.invoke(inp, self.config)
        for n, _ in enumerate(self.agent.stream(inp, self.config, stream_mode="values"), 1):
            if self.sc["leave_after"] and not self.left and n >= self.sc["leave_after"]:
                self.left += 1
                return None  # the reader leaves (the generator is closed when dropped)
        return self._values()

    async def _async(self, inp: Any) -> dict[str, Any] | None:
        if self.mode in ("astream", "astream_events"):
            stream = (self.agent.astream(inp, self.config, stream_mode="values") if self.mode == "astream"
                      else self.agent.astream_events(inp, self.config, version="v2"))
            n = 0
            async for _ in stream:
                n += 1
                if self.sc["leave_after"] and not self.left and n >= 3 * self.sc["leave_after"]:
                    self.left += 1
                    await stream.aclose()
                    return None
            snapshot = await self.agent.aget_state(self.config)
            return {**snapshot.values, **({"__interrupt__": snapshot.interrupts} if snapshot.interrupts else {})}
        if self.sc["cancel_after"] and self.cancelled < 2:
            task = asyncio.ensure_future(self.agent.ainvoke(inp, self.config))
            done, _ = await asyncio.wait({task}, timeout=self.sc["cancel_after"])
            if not done:
                task.cancel()
                try:
                    await task
                except asyncio.CancelledError:
                    self.cancelled += 1
                    return None
            return task.result()
        return await self.agent.ainvoke(inp, self.config)

    async def run(self, first: Any) -> None:
        inp, k = first, 0
        for _ in range(40):
            try:
                out = await (self._async(inp) if self.mode.startswith("a") else asyncio.to_thread(self._sync, inp))
            except (MiddlewareDown, ToolDown):
                self.crashed += 1
                inp = None  # resume the thread from its last checkpoint (the crashed step runs again)
                continue
            except Exception as exc:
                if type(exc).__name__ != "ToolCallLimitExceededError":
                    raise
                self.limit_error = True  # the run ends with the error, as without the guard
                return
            if out is None:  # a stream left early, a cancelled run: resume
                await asyncio.sleep(0.05)  # a sync tool's thread the reader left finishes
                inp = None
            elif out.get("__interrupt__"):
                inp, k = Command(resume=review(self.sc, out["__interrupt__"][0], k)), k + 1
            else:
                return
        raise AssertionError(f"seed {self.sc['seed']}: the thread did not end after 40 drives")


def check_thread(sc: dict[str, Any], guard: BudgetGuard, state: dict[str, Any], config: Any, runs: Counter,
                 xs: Counter, bills: list[float], *, limit_error: bool) -> tuple[float, float]:
    """The money invariants of one thread; returns what its tools really ran for, and its overrun."""
    ledger = guard.ledger(state, config)
    ran = sum(runs[n] * sc["prices"][n] for n in NAMES if n != "bill") + sum(bills)
    assert ledger.spent == pytest.approx(ran, abs=1e-9), f"spent {ledger.spent:g}, the tools ran {dict(runs)}, {bills}"
    # Only a bill above its reservation (an overrun, recorded as such) goes past the budget.
    assert ledger.spent <= sc["budget"] + ledger.overrun + 1e-9
    assert ledger.overrun <= sum(b for b in bills if b > sc["prices"]["bill"]) + 1e-9
    if not limit_error:  # a run ToolCallLimitMiddleware ended with its error keeps its reservations till the next step
        assert ledger.reserved == 0
        assert_each_call_answered_once(state["messages"])
    if sc["oracle"] == "refuses_three":
        assert xs[3] == 0, "a call with x=3 ran: an edit was not re-gated"
    return ran, ledger.overrun


def check_log(sink: MemoryLogSink, runs: Counter, spent: float) -> None:
    executions = [r for r in sink.records if r.execution > 0]
    assert len(executions) == sum(runs.values()), f"{len(executions)} execution records, runs {dict(runs)}"
    assert sum(r.charged for r in sink.records) == pytest.approx(spent, abs=1e-9)


def run_agent(sc: dict[str, Any]) -> None:
    runs, xs, bills = Counter(), Counter(), []
    sink = MemoryLogSink()
    guard = new_guard(sc, sink)
    failures = sc["model_failures"] if "model_retry" in sc["order"] else set()
    model = ScriptedToolModel(messages=iter(script(sc["turns"])), bound=[], fail_on=failures, executions=[])
    sync_sqlite = sc["ckpt"] == "sqlite" and not sc["mode"].startswith("a")  # SqliteSaver is sync only
    conn = sqlite3.connect(":memory:", check_same_thread=False) if sync_sqlite else None
    agent = create_agent(model, make_tools(sc["fail_runs"], runs, xs, sc["prices"], bills), middleware=stack(sc, guard),
                         checkpointer=SqliteSaver(conn) if conn is not None else InMemorySaver())
    config = {"configurable": {"thread_id": f"fuzz-{sc['seed']}"}, "recursion_limit": 100}
    drive = Drive(sc, agent, config, sc["mode"])

    async def turns() -> None:
        await drive.run({"messages": [("user", "go")]})
        if sc["second_turn"] and not drive.limit_error:
            await drive.run({"messages": [("user", "again")]})

    try:
        asyncio.run(turns())
        state = agent.get_state(config).values
        spent, _ = check_thread(sc, guard, state, config, runs, xs, bills, limit_error=drive.limit_error)
        check_log(sink, runs, spent)
        asks_again = {"retry", "retry_on_error", "hedge", "fails_before", "fails_after"} & set(sc["order"])
        resumed = drive.crashed or drive.left or drive.cancelled
        if not (drive.limit_error or "model_limit" in sc["order"] or asks_again or resumed):
            # (A call asked for again, by a middleware or by a crashed step run again on resume, gets a refusal
            # record per refused attempt; one refused inside the guard, then failed by a middleware after the
            # refusal, has its reservation released unused at the next model step, a second record.)
            assert_one_record_per_call(state["messages"], sink.records)
    finally:
        if conn is not None:
            conn.close()


def run_two_threads_on_a_store(sc: dict[str, Any], tmp_path: Any) -> None:
    store = MemoryBudgetStore() if sc["store"] == "memory" else SqliteBudgetStore(str(tmp_path / f"{sc['seed']}.db"))
    key = f"team/{sc['seed']}"
    store.create_budget(key, sc["shared_budget"])
    # No middleware that ends a run early here (a call limit's error, a model limit): each thread runs to its end.
    sc = {**sc, "order": [k for k in sc["order"] if k not in ("limit", "model_limit")]}
    sinks = [MemoryLogSink(), MemoryLogSink()]
    guards = [new_guard(sc, sinks[0], store=store, budget_key=key)]
    guards.append(guards[0] if sc["one_guard"] else new_guard(sc, sinks[1], store=store, budget_key=key))
    threads = []
    for i, turns in enumerate([sc["turns"], sc["turns_b"]]):
        runs, xs, bills = Counter(), Counter(), []
        model = ScriptedToolModel(messages=iter(script(turns, prefix=f"b{i}-")), bound=[], fail_on=set(),
                                  executions=[])
        agent = create_agent(model, make_tools(sc["fail_runs"], runs, xs, sc["prices"], bills),
                             middleware=stack(sc, guards[i]),
                             checkpointer=InMemorySaver())
        config = {"configurable": {"thread_id": f"store-{sc['seed']}-{i}"}, "recursion_limit": 100}
        mode = "ainvoke" if sc["mode"].startswith("a") else "invoke"
        threads.append((agent, config, runs, xs, bills, Drive({**sc, "cancel_after": None}, agent, config, mode)))

    async def both() -> None:
        await asyncio.gather(*(d.run({"messages": [("user", "go")]}) for *_, d in threads))

    asyncio.run(both())
    total = overrun = 0.0
    for i, (agent, config, runs, xs, bills, _) in enumerate(threads):
        ran, over = check_thread(sc, guards[i], agent.get_state(config).values, config, runs, xs, bills,
                                 limit_error=False)
        total, overrun = total + ran, overrun + over
        if not sc["one_guard"]:
            check_log(sinks[i], runs, ran)
    assert store.spent(key) == pytest.approx(total, abs=1e-9), f"the store spent {store.spent(key):g}, the tools ran {total:g}"
    assert store.spent(key) <= sc["shared_budget"] + overrun + 1e-9
    assert store.reserved(key) == 0


def _run_seeds(seeds: range, run: Any, *args: Any) -> None:
    for seed in seeds:
        sc = scenario(seed)
        try:
            run(sc, *args)
        except AssertionError as exc:
            shown = {k: sc[k] for k in ("order", "mode", "ckpt", "gate_at", "tool_errors", "oracle", "budget")}
            raise AssertionError(f"seed {seed} {shown}: {exc}") from exc


# ------------------------------------------------------------------ the property tests
BLOCK = 40


@pytest.mark.parametrize("start", range(0, SEEDS, BLOCK))
def test_money_invariants_under_random_custom_and_library_middleware(start):
    _run_seeds(range(start, min(start + BLOCK, SEEDS)), run_agent)


@pytest.mark.slow
@pytest.mark.parametrize("start", range(10_000, 12_000, 200))
def test_money_invariants_under_random_custom_and_library_middleware_slow(start):
    _run_seeds(range(start, start + 200), run_agent)


@pytest.mark.parametrize("start", range(0, SEEDS // 5, 24))
def test_two_threads_at_once_on_one_shared_store(start, tmp_path):
    _run_seeds(range(start, min(start + 24, SEEDS // 5)), run_two_threads_on_a_store, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("start", range(20_000, 20_300, 50))
def test_two_threads_at_once_on_one_shared_store_slow(start, tmp_path):
    _run_seeds(range(start, start + 50), run_two_threads_on_a_store, tmp_path)


# ------------------------------------------------------------------ regression: a refused re-gate
def _edited_call_agent(middleware: list[Any], fail_first_run: bool = False) -> tuple[Any, BudgetGuard, Counter, MemoryLogSink]:
    runs: Counter = Counter()  # runs by x

    def search(x: int) -> str:
        runs[x] += 1
        if fail_first_run and sum(runs.values()) == 1:
            raise ToolDown("search is down")
        return f"ran {x}"

    async def asearch(x: int) -> str:
        return search(x)

    sink = MemoryLogSink()
    guard = BudgetGuard(RefusesThree(), Market([PricedTool("search", 5.0)]), 100.0, log_sink=sink)
    tool = StructuredTool.from_function(search, coroutine=asearch, name="search", description="search")
    agent = create_agent(ScriptedToolModel(messages=iter([ai(call("search", x=0)), AIMessage("done")]), bound=[],
                                           fail_on=set(), executions=[]),
                         [tool], middleware=[guard.middleware(), *middleware], checkpointer=InMemorySaver())
    return agent, guard, runs, sink


def _drive(agent: Any, mode: str, resume: Any = None) -> dict[str, Any]:
    cfg = {"configurable": {"thread_id": "regate"}}

    async def go() -> dict[str, Any]:
        out = await agent.ainvoke({"messages": [("user", "go")]}, cfg)
        if resume is not None:
            out = await agent.ainvoke(Command(resume=resume), cfg)
        return out

    if mode == "async":
        return asyncio.run(go())
    out = agent.invoke({"messages": [("user", "go")]}, cfg)
    return agent.invoke(Command(resume=resume), cfg) if resume is not None else out


class FailsOnceAfter(_Custom):
    """Raises once, after the handler has answered (its own failure): ToolRetryMiddleware asks again."""

    def __init__(self) -> None:
        super().__init__()
        self.failed = False

    def _after(self, out: Any) -> Any:
        if not self.failed:
            self.failed = True
            raise MiddlewareDown("down after the run")
        return out

    def wrap_tool_call(self, request: Any, handler: Any) -> Any:
        return self._after(handler(request))

    async def awrap_tool_call(self, request: Any, handler: Any) -> Any:
        return self._after(await handler(request))


class SetsX(_Custom):
    """Sets the call's ``x`` to each of ``values`` in turn, one per run it passes on."""

    def __init__(self, *values: int) -> None:
        super().__init__()
        self.values = list(values)

    def edit(self, request: Any) -> Any:
        c = request.tool_call
        x = self.values.pop(0) if len(self.values) > 1 else self.values[0]
        return request.override(tool_call={**c, "args": {"x": x}})


def _retry() -> ToolRetryMiddleware:
    return ToolRetryMiddleware(max_retries=2, initial_delay=0.0, jitter=False, backoff_factor=0.0,
                               on_failure="continue")


SHAPES = {
    # a reviewer edits the call to x=3; a middleware inside the guard asks again when the answer is an error
    "review_edit_then_retry_on_the_refusal": (lambda: [RetryOnError(), HumanInTheLoopMiddleware(
        interrupt_on={"search": True})], {"decisions": [{"type": "edit", "edited_action": {
            "name": "search", "args": {"x": 3}}}]}, False),
    # a middleware rewrites the call to x=3; another one fails after the refusal; ToolRetryMiddleware asks again
    "rewrite_then_tool_retry_after_a_middleware_failure": (lambda: [_retry(), FailsOnceAfter(), SetsX(3)], None, False),
    # the first run's rewrite (x=1) is re-gated, accepted, runs and fails; the retry's rewrite (x=3) is another call
    "accepted_rewrite_then_a_retry_with_other_arguments": (lambda: [_retry(), SetsX(1, 3)], None, True),
}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("shape", list(SHAPES))
def test_a_run_of_an_edit_the_oracle_refused_is_re_gated_not_run(shape, mode):
    middleware, resume, fail_first_run = SHAPES[shape]
    agent, guard, runs, sink = _edited_call_agent(middleware(), fail_first_run)
    out = _drive(agent, mode, resume)
    assert runs[3] == 0, f"the call with x=3, which the oracle refused, ran: runs by x {dict(runs)}"
    refusals = [r for r in sink.records if r.reason == "refuses_three"]
    assert refusals and all(r.args == {"x": 3} and r.execution == 0 and r.charged == 0 for r in refusals)
    ledger = guard.ledger(out)
    assert ledger.spent == pytest.approx(5.0 * sum(runs.values()))
    assert ledger.reserved == 0
    assert_each_call_answered_once(out["messages"])
    if fail_first_run:
        assert runs == {1: 1}  # the accepted rewrite ran once (and failed); the retry's x=3 did not run


# ------------------------------------------------------------------ regression: a hedged call's runs on resume
class HedgeAll(_Custom):
    """Runs every call twice at once and keeps the first answer (a hedged request)."""

    async def awrap_tool_call(self, request: Any, handler: Any) -> Any:
        first, _ = await asyncio.gather(handler(request), handler(request))
        return first


class SlowToolStart(AsyncCallbackHandler):
    """A tracer whose ``on_tool_start`` takes long: a cancellation lands before the tool's body starts."""

    async def on_tool_start(self, *args: Any, **kwargs: Any) -> None:
        await asyncio.sleep(30)


@pytest.mark.parametrize("price_on_resume", [5.0, 8.0])
@pytest.mark.parametrize("hedge_first", [False, True])
def test_a_hedged_call_cancelled_before_its_bodies_started_pays_each_run_on_resume(hedge_first, price_on_resume):
    """Both hedged runs are cancelled before their bodies start (released, never charged); the thread is resumed
    (the price rising to 8 meanwhile: one run of 8 fits the budget of 10, not two) and the call runs again, twice.
    Each run is reserved under a charge id of its own, checked against the budget and paid (before: a resumed run
    took a released run's id, ran holding nothing, unchecked, and failed to commit: LedgerError, the run unpaid)."""
    runs: Counter = Counter()

    async def search(q: str) -> str:
        runs["search"] += 1
        return "found"

    tool = StructuredTool.from_function(coroutine=search, name="search", description="search")
    sink = MemoryLogSink()
    guard = BudgetGuard(AcceptAll(), Market([PricedTool("search", 5.0)]), 10.0, log_sink=sink)
    hedge = [HedgeAll(), guard.middleware()] if hedge_first else [guard.middleware(), HedgeAll()]
    agent = create_agent(ScriptedToolModel(messages=iter([ai(call("search", q="x")), AIMessage("done")]), bound=[],
                                           fail_on=set(), executions=[]),
                         [tool], middleware=hedge, checkpointer=InMemorySaver())
    cfg = {"configurable": {"thread_id": "hedged"}}

    async def go() -> dict[str, Any]:
        task = asyncio.ensure_future(agent.ainvoke({"messages": [("user", "go")]},
                                                   {**cfg, "callbacks": [SlowToolStart()]}))
        for _ in range(300):  # until both runs wait in the tracer, each holding 5
            await asyncio.sleep(0.01)
            if guard.episodes.peek("hedged") is not None and guard.ledger({}, cfg).reserved == 10.0:
                break
        assert guard.ledger({}, cfg).reserved == 10.0
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert runs["search"] == 0
        guard.update_market(lambda m: m.with_price("search", price_on_resume))
        return await agent.ainvoke(None, cfg)

    out = asyncio.run(go())
    ledger = guard.ledger(out)
    assert runs["search"] == (2 if price_on_resume == 5.0 else 1)
    assert ledger.spent == pytest.approx(price_on_resume * runs["search"])
    assert ledger.spent <= 10.0
    assert ledger.reserved == 0
    assert_each_call_answered_once(out["messages"])
    assert len([r for r in sink.records if r.execution > 0]) == runs["search"]


# ------------------------------------------------------------------ regression: a gate's update lost, the gate re-run
class SlowToCloseTheGate(AsyncCallbackHandler):
    """A tracer slow to close the guard's ``after_model`` node: the run is cancelled there, after the gate has
    decided and reserved, and the node's update is lost with it."""

    def __init__(self) -> None:
        self.names: dict[Any, Any] = {}

    async def on_chain_start(self, serialized: Any, inputs: Any, *, run_id: Any, **kwargs: Any) -> None:
        self.names[run_id] = kwargs.get("name")

    async def on_chain_end(self, outputs: Any, *, run_id: Any, **kwargs: Any) -> None:
        if self.names.get(run_id) == "BudgetGuard.after_model":
            await asyncio.sleep(30)


@pytest.mark.parametrize("resumed_by", ["this_guard", "a_fresh_guard"])
def test_a_gate_run_again_after_its_update_was_lost_writes_its_decisions_again(resumed_by):
    """The after_model gate decides and reserves; the run is cancelled before the gate's step is saved; the thread
    is resumed: the gate runs again on the same message. Its decision must reach state: the reviewer's edit to
    ``x=3`` is re-gated (refused, never run), and a guard in another process resuming the review finds the
    approved call (it runs once, paid). Before: the gate skipped the call it had reserved and wrote nothing, so
    the edit ran unchecked (a call with no decision in state is never re-gated), and in another process the
    approved call was refused as never approved. (A sync run keeps the finished gate's update: LangGraph saves it
    though the step times out or a tracer raises, so this is async only.)"""
    runs: Counter = Counter()

    def search(x: int) -> str:
        runs[x] += 1
        return f"ran {x}"

    tool = StructuredTool.from_function(search, name="search", description="search")
    saver = InMemorySaver()

    def build(replies: list[AIMessage]) -> tuple[Any, BudgetGuard, MemoryLogSink]:
        sink = MemoryLogSink()
        guard = BudgetGuard(RefusesThree(), Market([PricedTool("search", 5.0)]), 100.0, gate_at="after_model",
                            log_sink=sink)
        model = ScriptedToolModel(messages=iter(replies), bound=[], fail_on=set(), executions=[])
        return create_agent(model, [tool], middleware=[HumanInTheLoopMiddleware(interrupt_on={"search": True}),
                                                       guard.middleware()], checkpointer=saver), guard, sink

    agent, guard, sink = build([ai(call("search", x=1)), AIMessage("done")])
    cfg = {"configurable": {"thread_id": "lost-gate"}}

    async def paused() -> None:
        task = asyncio.ensure_future(agent.ainvoke({"messages": [("user", "go")]},
                                                   {**cfg, "callbacks": [SlowToCloseTheGate()]}))
        for _ in range(300):  # until the gate has reserved the call
            await asyncio.sleep(0.01)
            if guard.episodes.peek("lost-gate") is not None and guard.ledger({}, cfg).reserved == 5.0:
                break
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        lost = (await agent.aget_state(cfg)).values.get("intent_ledger") or {}
        assert not lost.get("decisions") and not lost.get("entries")  # the gate's update was lost
        assert (await agent.ainvoke(None, cfg)).get("__interrupt__")  # the gate's step again, then the review

    asyncio.run(paused())
    decisions = agent.get_state(cfg).values["intent_ledger"].get("decisions") or {}
    assert [d["args"] for d in decisions.values()] == [{"x": 1}], decisions  # the gate's decision is in state
    if resumed_by == "a_fresh_guard":
        agent, guard, sink = build([AIMessage("done")])  # another process: only state knows what was approved
        resume = {"decisions": [{"type": "approve"}]}
    else:
        resume = {"decisions": [{"type": "edit", "edited_action": {"name": "search", "args": {"x": 3}}}]}
    out = asyncio.run(agent.ainvoke(Command(resume=resume), cfg))
    ledger = guard.ledger(out)
    assert runs == ({1: 1} if resumed_by == "a_fresh_guard" else {}), f"runs by x: {dict(runs)}"
    assert ledger.spent == pytest.approx(5.0 * sum(runs.values()))
    assert ledger.reserved == 0
    assert_each_call_answered_once(out["messages"])
    if resumed_by == "this_guard":
        assert [r.reason for r in sink.records] == ["refuses_three"]  # the edit re-gated, and refused
