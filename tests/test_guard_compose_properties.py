"""Property test: the guard composed with LangChain's own middleware, as users stack it.

Random stacks of ToolRetryMiddleware, ToolErrorMiddleware, ToolCallLimitMiddleware, HumanInTheLoopMiddleware
(approve / edit / reject), ModelCallLimitMiddleware, ModelRetryMiddleware (the model fails some
executions), a custom middleware that answers some calls itself and one that returns the model's
message rebuilt with a new id (outside the guard's model call, after its gate), in random orders around the
guard, which gates inside the model call or in an after_model hook (``gate_at``); replies of
malformed calls only; flaky tools; parallel batches;
call ids duplicated inside a message and reused across messages. Each example runs sync
and async through ``create_agent``. After every run:

* ``spent == Σ executions × price <= budget`` (executions counted inside the tools);
* nothing stays reserved;
* every proposed call is answered by exactly one ToolMessage and has exactly one answering
  log record (its refusal, its first run, its release, or ``answered`` by another middleware);
* no call is answered as "never approved by the guard": the gate saw each one;
* one execution record per run of a tool, and the log's charges add up to the spend;
* without a model call limit the run reaches the script's final answer (malformed replies go
  back to the model, failed executions are retried);
* with an oracle that refuses every call with ``x == 3``, no such call runs, reviewers' edits
  (which set ``x = 3``, on the same tool or another one) included: an edit is re-gated.

``INTENT_PROPERTY_EXAMPLES`` sets the number of examples (100 in `make test`, 500 in `make test-slow`, which CI runs).
"""

from __future__ import annotations

import asyncio
import os
from collections import Counter
from typing import Any

from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from langchain.agents import create_agent
from langchain.agents.middleware import (
    AgentMiddleware,
    HumanInTheLoopMiddleware,
    ModelResponse,
    ModelCallLimitMiddleware,
    ModelRetryMiddleware,
    ToolCallLimitMiddleware,
    ToolErrorMiddleware,
    ToolRetryMiddleware,
)
from langchain_core.messages import AIMessage, ToolMessage
from langchain_core.tools import StructuredTool
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.types import Command

from intent import AcceptAll, BudgetGuard, Decision, Market, MemoryLogSink, PricedTool
from intent.testing import ScriptedToolModel, assert_each_call_answered_once, assert_one_record_per_call

# 100 examples in `make test`; `make test-slow` (CI) runs 500.
EXAMPLES = int(os.environ.get("INTENT_PROPERTY_EXAMPLES", "100"))
NAMES = ["t0", "t1", "t2", "t3"]  # t1: a human reviews it; t3: the custom middleware answers it


class ToolDown(RuntimeError):
    pass


class RefusesThree:
    """An oracle with a reason of its own: it refuses every call whose ``x`` is 3."""

    def decide(self, ctx: Any) -> Decision:
        if ctx.args.get("x") == 3:
            return Decision.rejected(f"{ctx.tool} with x=3 is not wanted", reason="refuses_three")
        return Decision.accepted()


class Answerer(AgentMiddleware):
    """A custom middleware that answers calls to t3 itself (a cache, say): the tool never runs."""

    @property
    def name(self) -> str:
        return "Answerer"

    def wrap_tool_call(self, request, handler):
        if request.tool_call["name"] == "t3":
            return ToolMessage("from cache", tool_call_id=request.tool_call["id"], name="t3")
        return handler(request)

    async def awrap_tool_call(self, request, handler):
        if request.tool_call["name"] == "t3":
            return ToolMessage("from cache", tool_call_id=request.tool_call["id"], name="t3")
        return await handler(request)


class Rebuilder(AgentMiddleware):
    """A custom middleware that returns the model's last message rebuilt, with a new id."""

    @property
    def name(self) -> str:
        return "Rebuilder"

    @staticmethod
    def _rebuilt(response: Any) -> Any:
        *earlier, msg = response.result
        if not isinstance(msg, AIMessage):
            return response
        copy = AIMessage(content=msg.content, tool_calls=msg.tool_calls, invalid_tool_calls=msg.invalid_tool_calls,
                         id=f"rebuilt-{msg.id}")
        return ModelResponse(result=[*earlier, copy], structured_response=response.structured_response)

    def wrap_model_call(self, request, handler):
        return self._rebuilt(handler(request))

    async def awrap_model_call(self, request, handler):
        return self._rebuilt(await handler(request))


def make_tools(fail_runs: dict[str, set[int]], runs: Counter, xs: Counter) -> list[StructuredTool]:
    def make(name: str) -> StructuredTool:
        def run(x: int = 0) -> str:
            runs[name] += 1
            xs[x] += 1
            if runs[name] in fail_runs.get(name, ()):
                raise ToolDown(f"{name} is down")
            return f"{name}:{x}"

        async def arun(x: int = 0) -> str:
            return run(x)

        return StructuredTool.from_function(run, coroutine=arun, name=name, description=f"tool {name}")

    return [make(n) for n in NAMES]


price = st.sampled_from([0.0, 1.0, 2.5, 5.0, 10.0, 20.0])
call_id = st.sampled_from(["a", "b", "c", "d"])  # few ids: duplicates and reuse happen often
turn = st.lists(st.tuples(st.sampled_from(NAMES), call_id, st.integers(0, 3)), min_size=1, max_size=4)


@st.composite
def scenario(draw: Any) -> dict[str, Any]:
    # ToolCallLimitMiddleware and HumanInTheLoopMiddleware together answer a rejected call twice
    # without any guard (both answer it in after_model), so a stack holds at most one of them.
    reviewer = draw(st.sampled_from([[], ["limit"], ["hitl"]]))
    stack = reviewer + draw(st.lists(st.sampled_from(["retry", "model_limit", "answerer", "model_retry", "rebuilder",
                                                      "tool_error"]),
                                     unique=True))
    order = draw(st.permutations(["guard", *stack]))
    return {
        "prices": {n: draw(price) for n in NAMES},
        "budget": draw(st.sampled_from([0.0, 5.0, 12.0, 30.0, 100.0])),
        "fail_runs": {n: draw(st.sets(st.integers(1, 6), max_size=3)) for n in NAMES},
        "turns": draw(st.lists(turn, min_size=1, max_size=4)),
        # a reply of malformed calls only before the turn (the guard answers it; the model is asked again)
        "malformed": draw(st.lists(st.booleans(), min_size=4, max_size=4)),
        # the model's executions that fail (a ConnectionError), only with ModelRetryMiddleware in the
        # stack; at most two, so its two retries always get through
        "model_failures": draw(st.sets(st.integers(1, 8), max_size=2)),
        "order": order,
        "retries": draw(st.integers(1, 3)),
        "tool_limit": draw(st.integers(1, 4)),
        "model_limit": draw(st.integers(1, 5)),
        "reviews": draw(st.lists(st.sampled_from(["approve", "edit", "edit_tool", "reject"]), min_size=8,
                                 max_size=8)),
        "oracle": draw(st.sampled_from(["accept_all", "refuses_three"])),
        "gate_at": draw(st.sampled_from(["model_call", "after_model"])),
        "tool_errors": draw(st.sampled_from(["raise", "message"])),
    }


def build_stack(sc: dict[str, Any], guard: BudgetGuard) -> list[Any]:
    made = {
        "guard": guard.middleware(),
        "retry": ToolRetryMiddleware(max_retries=sc["retries"], initial_delay=0.0, jitter=False, backoff_factor=0.0,
                                     on_failure="continue"),
        "limit": ToolCallLimitMiddleware(run_limit=sc["tool_limit"], exit_behavior="continue"),
        "hitl": HumanInTheLoopMiddleware(interrupt_on={"t1": True}),
        "model_limit": ModelCallLimitMiddleware(run_limit=sc["model_limit"], exit_behavior="end"),
        "model_retry": ModelRetryMiddleware(max_retries=2, initial_delay=0.0, jitter=False, backoff_factor=0.0),
        "answerer": Answerer(),
        "rebuilder": Rebuilder(),
        # Answers a tool's exception with a message, wherever it is listed (the guard's own refusals are
        # ToolMessages, never exceptions, so it never sees them).
        "tool_error": ToolErrorMiddleware(lambda exc, request: f"tool error: {exc}"),
    }
    return [made[k] for k in sc["order"]]


def script(turns: list[list[tuple[str, str, int]]], *, unique_in_message: bool,
           malformed: list[bool] | None = None) -> list[AIMessage]:
    out = []
    for k, calls in enumerate(turns):
        if malformed and malformed[k]:
            out.append(AIMessage("", invalid_tool_calls=[
                {"name": "t0", "args": "{x:", "id": f"bad{k}", "error": "not JSON", "type": "invalid_tool_call"}]))
        tool_calls, seen = [], Counter()
        for n, cid, x in calls:
            seen[cid] += 1
            if unique_in_message and seen[cid] > 1:
                cid = f"{cid}{seen[cid]}"
            tool_calls.append({"name": n, "args": {"x": x}, "id": cid, "type": "tool_call"})
        out.append(AIMessage("plan", tool_calls=tool_calls))
    return [*out, AIMessage("final answer")]


def guard_sees_calls_first(order: list[str], gate_at: str) -> bool:
    """Does the guard's gate see a message's calls before every other middleware's after_model?

    Inside the model call it always does; as an after_model hook only when listed last among
    the gates (after_model hooks run last-listed first). Only then can it rename a duplicated
    call id before a call limit or a reviewer answers that id (their answers match calls by
    id, so they would answer both calls at once).
    """
    if gate_at == "model_call":
        return True
    gates = [k for k in order if k in ("guard", "limit", "hitl")]
    return gates[-1] == "guard"


def review(sc: dict[str, Any], interrupt: Any, k: int) -> dict[str, Any]:
    decisions = []
    for i, action in enumerate(interrupt.value["action_requests"]):
        kind = sc["reviews"][(k + i) % len(sc["reviews"])]
        if kind in ("edit", "edit_tool"):
            # x=3: what RefusesThree refuses, so an edit that skipped the re-gate would show
            name = "t2" if kind == "edit_tool" else action["name"]
            decisions.append({"type": "edit", "edited_action": {"name": name, "args": {"x": 3}}})
        else:
            decisions.append({"type": kind, **({"message": "no"} if kind == "reject" else {})})
    return {"decisions": decisions}


def run_once(sc: dict[str, Any], mode: str) -> None:
    runs: Counter = Counter()
    xs: Counter = Counter()  # runs by their argument x
    sink = MemoryLogSink()
    # With tool_errors="raise" and no retry middleware a failing tool ends the run with its
    # exception (as without the guard); keep those runs comparable by failing nothing then.
    fail_runs = sc["fail_runs"] if (sc["tool_errors"] == "message" or "retry" in sc["order"]
                                    or "tool_error" in sc["order"]) else {}
    oracle = RefusesThree() if sc["oracle"] == "refuses_three" else AcceptAll()
    guard = BudgetGuard(oracle, Market([PricedTool(n, p) for n, p in sc["prices"].items()]), sc["budget"],
                        log_sink=sink, tool_errors=sc["tool_errors"], gate_at=sc["gate_at"])
    dup_ids = guard_sees_calls_first(sc["order"], sc["gate_at"])
    failures = sc["model_failures"] if "model_retry" in sc["order"] else set()
    model = ScriptedToolModel(messages=iter(script(sc["turns"], unique_in_message=not dup_ids,
                                                   malformed=sc["malformed"])), bound=[], fail_on=failures,
                              executions=[])
    agent = create_agent(model, make_tools(fail_runs, runs, xs), middleware=build_stack(sc, guard),
                         checkpointer=InMemorySaver())
    config = {"configurable": {"thread_id": f"prop-{mode}"}, "recursion_limit": 200}

    async def drive_async() -> dict[str, Any]:
        out = await agent.ainvoke({"messages": [("user", "go")]}, config)
        k = 0
        while out.get("__interrupt__"):
            out = await agent.ainvoke(Command(resume=review(sc, out["__interrupt__"][0], k)), config)
            k += 1
        return out

    if mode == "sync":
        out = agent.invoke({"messages": [("user", "go")]}, config)
        k = 0
        while out.get("__interrupt__"):
            out = agent.invoke(Command(resume=review(sc, out["__interrupt__"][0], k)), config)
            k += 1
    else:
        out = asyncio.run(drive_async())

    ledger = guard.ledger(out)
    expected = sum(runs[n] * sc["prices"][n] for n in NAMES)
    assert abs(ledger.spent - expected) < 1e-9, (ledger.spent, dict(runs))
    assert ledger.spent <= sc["budget"] + 1e-9
    assert ledger.reserved == 0
    assert abs(ledger.remaining - max(0.0, sc["budget"] - ledger.spent)) < 1e-9
    assert_each_call_answered_once(out["messages"])
    assert_one_record_per_call(out["messages"], sink.records)
    # The gate saw every call, whatever wraps it (a message rebuilt after the gate included).
    never_gated = [m for m in out["messages"] if isinstance(m, ToolMessage) and "never approved it" in str(m.content)]
    assert not never_gated, never_gated
    if "model_limit" not in sc["order"]:
        # Nothing ends the run early: malformed replies went back to the model, failed model
        # executions were retried, and the script's final answer was reached.
        assert out["messages"][-1].content == "final answer", out["messages"][-1]
    if sc["oracle"] == "refuses_three":
        assert xs[3] == 0, "a call the oracle refuses ran (an edit must be re-gated)"
    executions = [r for r in sink.records if r.execution > 0]
    assert len(executions) == sum(runs.values())
    assert abs(sum(r.charged for r in sink.records) - ledger.spent) < 1e-9
    assert all(r.spent <= sc["budget"] + 1e-9 for r in sink.records)
    assert len(guard.episodes) == 0  # the episode's working state was dropped at the end
    if "answerer" in sc["order"] and runs["t3"]:
        raise AssertionError("the custom middleware answers t3 itself; the tool must never run")
    event(f"ids duplicated inside a message: {dup_ids}")
    event(f"gate at: {sc['gate_at']}")
    if sc["oracle"] == "refuses_three" and any(r.reason == "refuses_three" for r in sink.records):
        event("the oracle refused a call for its own reason")
    if any(r.decision == "invalid" and r.call_id.startswith("bad") for r in sink.records):
        event("a reply of malformed calls only")
    if failures:
        event("the model failed and was retried")
    if "tool_error" in sc["order"] and any("tool error:" in str(m.content) for m in out["messages"]
                                           if isinstance(m, ToolMessage)):
        event("a tool's error answered by ToolErrorMiddleware")
    if "rebuilder" in sc["order"] and sc["gate_at"] == "model_call" and \
            sc["order"].index("rebuilder") < sc["order"].index("guard"):
        event("the model's message rebuilt after the gate")
    if any(r.decision == "answered" for r in sink.records):
        event("a call was answered before the guard's gate")
    if any(r.reason == "over_budget" for r in sink.records):
        event("a run was refused for budget")
    if sum(runs.values()) > len({(r.call_id, r.step) for r in executions}):
        event("a call ran more than once (retry)")


@settings(max_examples=EXAMPLES, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(scenario())
def test_money_invariants_hold_for_every_composition_sync_and_async(sc):
    run_once(sc, "sync")
    run_once(sc, "async")
