"""MCO and INTENT: ``adecide`` never blocks the event loop and decides exactly as ``decide``."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
from fakes import ScriptedToolModel
from langchain_core.messages import AIMessage, HumanMessage

from intent import DecisionContext, Market, PricedTool, Proposal
from intent.oracles import IntentOracle, MCOOracle
from intent.policy import AgentPolicy
from worldmodel.protocols import ModelError

MARKET = Market([PricedTool("a", 10), PricedTool("b", 20), PricedTool("c", 5)])
SLOW = 0.2  # every model call sleeps this long (a blocking call, as a real HTTP/GPU call would be)
TICK = 0.01
MODEL_THREADS: list[int] = []  # the thread each model call ran on


def _model_call() -> None:
    MODEL_THREADS.append(threading.get_ident())
    time.sleep(SLOW)


class SlowWM:
    def __init__(self, fail: bool = False):
        self.fail, self.active, self.max_active, self.calls = fail, 0, 0, 0
        self._lock = threading.Lock()

    def simulate(self, tool, args, *, satisfied=None):
        with self._lock:
            self.calls += 1
            self.active += 1
            self.max_active = max(self.max_active, self.active)
        try:
            _model_call()
            if self.fail:
                raise ModelError("world model down")
            return '{"ok": true}'
        finally:
            with self._lock:
                self.active -= 1


class SlowPredictor:
    def __init__(self, table):
        self.table = table

    def predict(self, reasoning, tool, args):
        _model_call()
        return self.table.get(tool, 1.0)

    def predict_batch(self, items):
        _model_call()
        return [self.table.get(t, 1.0) for _, t, _ in items]


class SlowScriptedModel(ScriptedToolModel):
    def invoke(self, *args, **kwargs):
        _model_call()
        return super().invoke(*args, **kwargs)


def tc(name, cid="x", **args):
    return {"name": name, "args": args, "id": cid, "type": "tool_call"}


def slow_policy(*replies):
    return AgentPolicy(SlowScriptedModel(messages=iter(list(replies)), bound=[]))


def ctx(tool="a", remaining=50.0, episode="e1", args=None):
    args = args or {"q": 1}
    prop = Proposal(f"{episode}-{tool}", tool, args, f"I need {tool}")
    return DecisionContext(episode, "q", prop, MARKET.price(tool), 50.0, 50 - remaining, remaining, MARKET, step=0,
                           history=[HumanMessage("q"), AIMessage(f"I need {tool}", tool_calls=[tc(tool, prop.call_id, **args)])],
                           batch=(prop,))


PLAN = (AIMessage("then b", tool_calls=[tc("b", q=2)]), AIMessage("done"))  # a, then b, then answer


def mco(fail=False):
    return MCOOracle(slow_policy(*PLAN), SlowWM(fail=fail), max_depth=5)


def intent(gamma=0.5, fail=False):
    return IntentOracle(slow_policy(*PLAN), SlowWM(fail=fail), SlowPredictor({"a": 0.5, "b": 0.8}), gamma=gamma)


# case -> (oracle factory, budget left, expected (accept, reason))
FACTORIES = {
    "mco-accept": (mco, 50.0, (True, "accepted")),
    "mco-reject": (mco, 29.0, (False, "plan_over_budget")),  # plan a + b = 30 > 29
    "intent-accept": (intent, 50.0, (True, "accepted")),  # 0.5 * (20 + 25) = 22.5
    "intent-reject": (lambda: intent(gamma=2.5), 50.0, (False, "plan_over_budget")),  # 2.5 * 45 = 112.5
    "mco-model-error": (lambda: mco(fail=True), 50.0, (True, "oracle_error")),
    "intent-model-error": (lambda: intent(fail=True), 50.0, (True, "oracle_error")),
}


def comparable(decision):
    """A decision without its wall-clock latency (``oracle_ms``), the one field that may differ."""
    d = decision.to_dict()
    d["usage"].pop("oracle_ms", None)
    return d


async def decide_while_ticking(oracle, context):
    """Run ``adecide`` beside a 10 ms ticker; return the decision, the ticks during it, the longest gap."""
    ticks, gaps, stop = [0], [0.0], asyncio.Event()

    async def ticker():
        last = time.perf_counter()
        while not stop.is_set():
            await asyncio.sleep(TICK)
            now = time.perf_counter()
            ticks[0] += 1
            gaps[0] = max(gaps[0], now - last)
            last = now

    task = asyncio.create_task(ticker())
    await asyncio.sleep(TICK * 2)  # the ticker is running
    before, gaps[0] = ticks[0], 0.0
    MODEL_THREADS.clear()
    started = time.perf_counter()
    decision = await oracle.adecide(context)
    elapsed = time.perf_counter() - started
    during, longest = ticks[0] - before, gaps[0]
    stop.set()
    await task
    return decision, during, longest, elapsed, threading.get_ident(), list(MODEL_THREADS)


@pytest.mark.parametrize("case", list(FACTORIES))
def test_adecide_does_not_block_the_loop_and_equals_decide(case):
    factory, remaining, outcome = FACTORIES[case]
    context = ctx("a", remaining=remaining)
    expected = factory().decide(context)
    assert (expected.accept, expected.reason) == outcome  # the case covers what it claims to
    decision, during, longest, elapsed, loop_thread, model_threads = asyncio.run(
        decide_while_ticking(factory(), context))

    assert comparable(decision) == comparable(expected)
    assert elapsed >= SLOW and model_threads  # at least one slow model call really ran
    # Behaviour, not timing: no blocking model call ran on the event loop's thread, and the loop
    # went on ticking while they ran (a blocked loop cannot tick at all during a call).
    assert loop_thread not in model_threads, "a model call ran on the event loop's thread"
    assert during >= 1, (during, elapsed, longest)


@pytest.mark.parametrize("make", [mco, intent], ids=["mco", "intent"])
def test_a_sequence_of_adecide_updates_the_caches_as_decide_does(make):
    """Accept a (caching the plan's tail b), then b hits the rollout cache: same as the sync path."""
    sync_oracle, async_oracle = make(), make()
    steps = [ctx("a", remaining=50), ctx("b", remaining=40, args={"q": 2})]
    sync = [comparable(sync_oracle.decide(c)) for c in steps]

    async def run():
        return [comparable(await async_oracle.adecide(c)) for c in steps]

    assert asyncio.run(run()) == sync
    assert sync[1]["reason"] == "cache_hit"
    assert async_oracle.memory.rollout("e1") == sync_oracle.memory.rollout("e1") == []


class MeetingWM(SlowWM):
    """A world model whose calls wait (up to 10 s) until ``parties`` of them are in it at once: decisions that
    overlap all get through; decisions run one at a time break the barrier (noted in ``missed``)."""

    def __init__(self, parties: int):
        super().__init__()
        self.barrier, self.missed = threading.Barrier(parties, timeout=10), []

    def simulate(self, tool, args, *, satisfied=None):
        try:
            self.barrier.wait()
        except threading.BrokenBarrierError as exc:  # (the oracle would take it for a model error: noted here)
            self.missed.append(exc)
        return super().simulate(tool, args, satisfied=satisfied)


def test_one_episode_is_serialized_and_episodes_run_in_parallel():
    def oracle_on(wm):
        script = [AIMessage("done")] * 8
        return MCOOracle(AgentPolicy(ScriptedToolModel(messages=iter(script), bound=[])), wm, max_depth=5)

    async def run(oracle, episodes):
        return await asyncio.gather(*(oracle.adecide(ctx("a", episode=e)) for e in episodes))

    wm = SlowWM()
    oracle = oracle_on(wm)
    same = asyncio.run(run(oracle, ["e1", "e1"]))
    assert all(d.accept for d in same) and wm.max_active == 1  # the same episode: one decision at a time
    assert oracle._turns == {}  # no per-episode lock left behind
    # Other episodes overlap: each decision's world-model call waits for the other's to start (not a race
    # against the clock: a loaded machine may start the second thread late, never after the first ended).
    meeting = MeetingWM(2)
    oracle = oracle_on(meeting)
    other = asyncio.run(run(oracle, ["e2", "e3"]))
    assert not meeting.missed, "the two episodes' decisions did not run at the same time"
    assert [d.reason for d in other] == ["accepted", "accepted"] and meeting.max_active == 2
    assert oracle._turns == {}
