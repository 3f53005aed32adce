"""Property test of the unified budget (issue 14): random interleavings of model calls, tool
calls, sub-agents and human top-ups, sync and async, through ``create_agent``.

Money is counted from outside the guard: each model execution's usage (recorded by the model
itself) × its listed price, each tool run (counted inside the tool) × its price, and each
sub-agent's own executions the same way. Invariants:

* ``spent == Σ model executions + Σ tool runs + Σ sub-agent spend`` (exactly, to float noise);
* ``spent <= base budget + Σ top-ups``; nothing reserved at the end, in the parent or a child;
* every charge is logged once: Σ ``charged`` in the log == spent, one record per charge;
* every proposed call is answered exactly once;
* with ModelRetryMiddleware (flaky executions), ModelFallbackMiddleware (the model swapped in again
  by the middleware after a failure) and ModelCallLimitMiddleware in random orders around the guard:
  a failed execution is released, never charged; the fallback's is charged once.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import threading
from collections import Counter
from typing import Any

from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from langchain.agents import create_agent
from langchain.agents.middleware import ModelCallLimitMiddleware, ModelFallbackMiddleware, ModelRetryMiddleware
from langchain_core.messages import AIMessage, HumanMessage
from langchain_core.tools import StructuredTool
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.types import Command

from intent import AcceptAll, Budget, BudgetGuard, FromParent, Market, MemoryLogSink, ModelPrice, PricedTool
from intent.testing import ScriptedToolModel, ai, assert_each_call_answered_once
from intent.testing import call as tool_call

EXAMPLES = int(os.environ.get("INTENT_UNIFIED_EXAMPLES", "15"))  # 100 in `make test-slow`
PRICE = ModelPrice(input_per_mtok=3.0, output_per_mtok=15.0)
PRICES = {"scripted-model": PRICE}
TOOLS = {"search": 0.02, "fetch": 0.07}
_ids = itertools.count()


class Ledgerless(ScriptedToolModel):
    """Reports usage as an honest provider does, and records it (the truth the charges are checked
    against): input tokens from the prompt it received (4 bytes a token, a typical BPE ratio), and
    at most ``max_out`` output tokens (the provider enforces the max_tokens the guard binds)."""

    executed: list = []
    max_out: int = 4096
    fail_at: frozenset = frozenset()  # 1-based executions that fail before any usage (not billed)
    attempts: list = []

    def _generate(self, messages: Any, *args: Any, **kwargs: Any) -> Any:
        self.attempts.append(1)
        if len(self.attempts) in self.fail_at:
            raise ConnectionError("provider hiccup")
        result = super()._generate(messages, *args, **kwargs)
        message = result.generations[0].message
        drawn = (message.usage_metadata or {}).get("output_tokens", 0)
        prompt_bytes = sum(len(str(m.content).encode()) + len(str(getattr(m, "tool_calls", "") or "")) for m in messages)
        inp, out = max(1, prompt_bytes // 4), min(drawn, self.max_out)
        message.usage_metadata = {"input_tokens": inp, "output_tokens": out, "total_tokens": inp + out}
        self.executed.append((inp, out))
        return result

    async def _agenerate(self, *args: Any, **kwargs: Any) -> Any:
        return self._generate(*args, **kwargs)


def message(calls: list[tuple[str, str]], usage: tuple[int, int]) -> AIMessage:
    return ai(*(tool_call(n, q=q) for n, q in calls), usage=usage)


usage = st.tuples(st.integers(1, 400), st.integers(1, 3000))
call = st.tuples(st.sampled_from(["search", "fetch", "research"]), st.sampled_from(["a", "b", "c"]))
turn = st.tuples(st.lists(call, min_size=1, max_size=3), usage)
child_call = st.tuples(st.sampled_from(["search", "fetch"]), st.sampled_from(["a", "b", "c"]))
child_turn = st.tuples(st.lists(child_call, min_size=1, max_size=3), usage)


@st.composite
def scenario(draw: Any) -> dict[str, Any]:
    return {
        "budget": draw(st.sampled_from([0.05, 0.12, 0.25, 0.6])),
        "llm_cap": draw(st.sampled_from([None, 0.08])),
        "turns": draw(st.lists(turn, min_size=1, max_size=4)),
        "final_usage": draw(usage),
        "child_turns": draw(st.lists(child_turn, max_size=2)),
        "child_limit": draw(st.sampled_from([None, 0.03, 0.1])),
        "ask": draw(st.booleans()),
        "resumes": draw(st.lists(st.sampled_from(["top_up", "approve_once", "deny"]), min_size=6, max_size=6)),
        "top_up": draw(st.sampled_from([0.01, 0.05, 0.2])),
        "max_out": draw(st.sampled_from([64, 2000])),
        # LangChain's model middleware around the guard, in a random order
        "stack": draw(st.permutations(["guard", *draw(st.lists(st.sampled_from(["retry", "model_limit", "fallback"]),
                                                                unique=True))])),
        "fail_at": draw(st.sets(st.integers(1, 6), max_size=2)),
        "model_limit": draw(st.integers(1, 6)),
    }


def run_once(sc: dict[str, Any], mode: str) -> None:
    runs: Counter = Counter()
    lock = threading.Lock()
    parent_sink, child_sink = MemoryLogSink(), MemoryLogSink()
    child_models: list[Ledgerless] = []
    child_guards: list[BudgetGuard] = []

    def priced(name: str) -> StructuredTool:
        def run(q: str = "") -> str:
            with lock:
                runs[name] += 1
            return f"{name}:{q}"

        async def arun(q: str = "") -> str:
            return run(q)

        return StructuredTool.from_function(run, coroutine=arun, name=name, description=name)

    def child_agent() -> tuple[Any, BudgetGuard]:
        guard = BudgetGuard(AcceptAll(), Market([PricedTool(n, p) for n, p in TOOLS.items()]),
                            FromParent(sc["child_limit"]), model_prices=PRICES, max_output_tokens=sc["max_out"],
                            log_sink=child_sink)
        model = Ledgerless(messages=iter([*(message(c, u) for c, u in sc["child_turns"]),
                                          AIMessage("child done", usage_metadata={
                                              "input_tokens": 5, "output_tokens": 5, "total_tokens": 10})]),
                           bound=[], executed=[], max_out=sc["max_out"])
        child_models.append(model)
        child_guards.append(guard)
        return create_agent(model, [priced("search"), priced("fetch")], middleware=[guard.middleware()]), guard

    def research(q: str = "") -> str:
        agent, _ = child_agent()
        out = agent.invoke({"messages": [HumanMessage(q)]}, {"configurable": {"thread_id": f"child-{next(_ids)}"}})
        return str(out["messages"][-1].content)

    async def aresearch(q: str = "") -> str:
        agent, _ = child_agent()
        out = await agent.ainvoke({"messages": [HumanMessage(q)]},
                                  {"configurable": {"thread_id": f"child-{next(_ids)}"}})
        return str(out["messages"][-1].content)

    tools = [priced("search"), priced("fetch"),
             StructuredTool.from_function(research, coroutine=aresearch, name="research", description="delegate")]
    market = Market([PricedTool(n, p) for n, p in TOOLS.items()] + [PricedTool("research", 0.0)])
    budget = Budget(sc["budget"], llm=sc["llm_cap"])
    guard = BudgetGuard(AcceptAll(), market, budget, model_prices=PRICES, max_output_tokens=sc["max_out"],
                        log_sink=parent_sink, on_over_budget="ask" if sc["ask"] else "refuse")
    final = AIMessage("done", usage_metadata={"input_tokens": sc["final_usage"][0],
                                              "output_tokens": sc["final_usage"][1],
                                              "total_tokens": sum(sc["final_usage"])})
    # Failures only with a retry middleware: without one a failed model call ends the run with its
    # exception, as without the guard.
    fail_at = frozenset(sc["fail_at"]) if "retry" in sc["stack"] else frozenset()
    if "fallback" in sc["stack"] and "retry" not in sc["stack"]:
        # ModelFallbackMiddleware alone: the fallback (the same model, swapped in by the middleware, so
        # metered as a model other than the agent's) runs the next attempt, which must not fail too.
        fail_at = frozenset(k for k in sc["fail_at"] if k + 1 not in sc["fail_at"])
    model = Ledgerless(messages=iter([*(message(c, u) for c, u in sc["turns"]), final]), bound=[], executed=[],
                       max_out=sc["max_out"], fail_at=fail_at, attempts=[])
    made = {"guard": guard.middleware(),
            "retry": ModelRetryMiddleware(max_retries=3, initial_delay=0.0, backoff_factor=0.0, jitter=False),
            "model_limit": ModelCallLimitMiddleware(run_limit=sc["model_limit"], exit_behavior="end"),
            "fallback": ModelFallbackMiddleware(model)}
    agent = create_agent(model, tools, middleware=[made[k] for k in sc["stack"]], checkpointer=InMemorySaver())
    config = {"configurable": {"thread_id": f"unified-{mode}"}, "recursion_limit": 200}

    def resume(k: int) -> Command:
        action = sc["resumes"][k % len(sc["resumes"])]
        value: dict[str, Any] = {"action": action, "approved_by": f"human-{k}"}
        if action == "top_up":
            value["amount"] = sc["top_up"]
        return Command(resume=value)

    if mode == "sync":
        out = agent.invoke({"messages": [HumanMessage("go")]}, config)
        k = 0
        while out.get("__interrupt__"):
            out = agent.invoke(resume(k), config)
            k += 1
    else:
        async def drive() -> dict[str, Any]:
            res = await agent.ainvoke({"messages": [HumanMessage("go")]}, config)
            i = 0
            while res.get("__interrupt__"):
                res = await agent.ainvoke(resume(i), config)
                i += 1
            return res

        out = asyncio.run(drive())

    ledger = guard.ledger(out)
    model_money = sum(PRICE.cost(i, o) for i, o in model.executed)
    child_model_money = sum(PRICE.cost(i, o) for m in child_models for i, o in m.executed)
    tool_money = sum(TOOLS[n] * k for n, k in runs.items())
    assert abs(ledger.spent - (model_money + child_model_money + tool_money)) < 1e-9, (
        ledger.spent, model_money, child_model_money, dict(runs))
    assert ledger.spent <= sc["budget"] + sum(ledger.top_ups.values()) + 1e-9
    assert ledger.reserved == 0
    if sc["llm_cap"] is not None:
        assert ledger.spent_by_kind().get("model", 0.0) <= sc["llm_cap"] + 1e-9
    for sink, spent in ((parent_sink, ledger.spent),):
        assert abs(sum(r.charged for r in sink.records) - spent) < 1e-9
    charges = [e for e in ledger if e.status == "committed"]
    charging = [r for r in parent_sink.records if r.decision == "accept" and r.status in ("ok", "error")
                and (r.execution > 0)]
    assert len(charging) == len(charges), (len(charging), len(charges))
    assert len([r for r in parent_sink.records if r.decision == "top_up"]) == len(ledger.top_ups)
    carves = [e for e in ledger if e.kind == "sub_agent"]
    assert all(e.status == "committed" for e in carves)
    assert abs(sum(e.amount for e in carves) - (child_model_money + sum(
        r.charged for r in child_sink.records if r.kind == "tool"))) < 1e-9
    for child in child_guards:
        assert len(child.episodes) == 0
    assert_each_call_answered_once(out["messages"])
    if carves:
        event("a sub-agent ran")
    if ledger.top_ups:
        event("a human topped up")
    if any(r.reason == "model_over_budget" for r in parent_sink.records):
        event("a model call was refused")
    if any(r.reason == "over_budget" for r in parent_sink.records):
        event("a tool call was refused")
    if any(r.reason == "model_error" for r in parent_sink.records):
        event("a model execution failed and was retried")
        if "fallback" in sc["stack"]:
            event("a failed execution with ModelFallbackMiddleware in the stack")


@settings(max_examples=EXAMPLES, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(scenario())
def test_unified_budget_invariants_under_random_interleavings(sc):
    run_once(sc, "sync")
    run_once(sc, "async")
