"""The lean path (intent/lean_path.py) against the general code it stands in for.

Each scenario runs twice, the lean path on and off (``lean_path.ENABLED``), with a clock that ticks per
call (so decision and tool times are the same number in both when both read the clock alike), and
the two runs must agree on everything a user can see: every step's state update and the state after
it (messages and the ledger channel), the ledger, every log record, what the oracle is told, what the
model is shown, how many times the guard read its clock. Message ids are the only names made at random (an
AIMessage's when the model gives none): they are compared by their place in the history.

A last test checks that the lean path is taken in the common turn, so that it cannot rot into a
path nothing uses while the differential tests pass on the general code alone.
"""

from __future__ import annotations

import asyncio
import itertools
import json
from typing import Any

import pytest
from langchain.agents import create_agent
from langchain_core.messages import AIMessage, HumanMessage, ToolMessage
from langchain_core.tools import tool
from langgraph.checkpoint.memory import InMemorySaver

from intent import AcceptAll, BudgetGuard, Market, PricedTool
from intent import lean_path, lean_tool, testing
from intent.logs import MemoryLogSink
from intent.oracle import PLAN_OVER_BUDGET, Decision, Oracle
from tests.fakes import ScriptedToolModel, ai, call


@tool
def fetch(q: str) -> str:
    """Fetch a page."""
    return f"page {q}"


@tool
def search(q: str) -> str:
    """Search the web."""
    return f"results for {q}"


@tool(response_format="content_and_artifact")
def billed(q: str) -> tuple[str, dict[str, Any]]:
    """A tool whose provider bills less than its quote."""
    return f"billed {q}", {"intent_billed": 0.25}


@tool
def broken(q: str) -> str:
    """A tool that raises."""
    raise RuntimeError("upstream 503")


TOOLS = [fetch, search, billed, broken]
PRICED = [PricedTool("fetch", 1.0), PricedTool("search", 2.0), PricedTool("billed", 1.0), PricedTool("broken", 0.5),
          PricedTool("banned_one", 1.0)]
# A market with a banned tool hides it from the model at every step (the general _prepare); one without does not.
MARKETS = {"plain": Market(PRICED), "with_ban": Market(PRICED, banned=["banned_one", "broken"])}


class Recording(ScriptedToolModel):
    """The scripted model, also keeping what each call was shown (the request the guard shaped)."""

    seen: list = []

    def _generate(self, messages: Any, *args: Any, **kwargs: Any) -> Any:
        self.seen.append([(m.type, m.content) for m in messages])
        return super()._generate(messages, *args, **kwargs)


class EveryOther(Oracle):
    """Rejects every second call it is asked about, with a note (a rejection the lean gate applies)."""

    name = "every_other"

    def __init__(self, note_chars: int = 0) -> None:
        self.note_chars = note_chars  # padding, so that a cap on refusal notes has something to cut
        self.asked = 0
        self.contexts: list[tuple[Any, ...]] = []

    def decide(self, ctx: Any) -> Decision:
        self.asked += 1
        # What the oracle is told must be the same both ways (history by content, not by object).
        self.contexts.append((ctx.episode_id, ctx.query, ctx.tool, dict(ctx.args), ctx.price, ctx.budget, ctx.spent,
                              ctx.remaining, ctx.step, len(ctx.history), len(ctx.batch), ctx.batch_index))
        if self.asked % 2 == 0:
            note = f"not {ctx.tool} now"
            return Decision.rejected(note + " (a long reason)" * (self.note_chars // 16), reason=PLAN_OVER_BUDGET)
        return Decision.accepted()


def _turns(kind: str) -> list[AIMessage]:
    one = [ai(call("fetch", q=str(i))) for i in range(4)]
    if kind == "common":
        return [*one, ai(text="done")]
    if kind == "mixed":  # one-call replies between replies the lean gate leaves to the general one
        bad = AIMessage(content="", invalid_tool_calls=[{"name": "fetch", "args": "{oops", "id": "bad1",
                                                         "error": "not JSON", "type": "invalid_tool_call"}])
        return [ai(call("fetch", q="a")), ai(call("search", q="b"), call("fetch", q="c")), ai(call("search", q="d")),
                bad, ai(call("nope", q="e")), ai(call("banned_one", q="f")), ai(call("billed", q="g")),
                ai(call("fetch", q="h"), call("fetch", q="h")), ai(call("broken", q="i")), ai(call("fetch", q="j")),
                ai(text="done")]
    raise AssertionError(kind)


def _run(kind: str, *, lean: bool, oracle: str = "accept", budget: float = 30.0, thread: bool = False,
         use_async: bool = False, runs: int = 1, market: str | Market = "plain", enforce: bool = True,
         feedback_chars: int | None = None, monkeypatch: pytest.MonkeyPatch, log: bool = True,
         lean_tool_run: bool | None = None, tools: list[Any] | None = None, turns: Any = None,
         middleware: Any = None, tool_errors: str = "message") -> dict[str, Any]:
    """One scenario's run. ``lean``: the lean path (lean_path.ENABLED); ``lean_tool_run``: the lean tool run
    (lean_tool.ENABLED; as ``lean`` when not given). ``log``: a log sink (the lean tool run is made only
    without one). ``tools``, ``turns`` (a function of the kind), ``middleware`` (a function of the guard's
    middleware, returning the agent's list) and ``tool_errors``: tests/test_lean_tool.py's scenarios."""
    monkeypatch.setattr(lean_path, "ENABLED", lean)
    monkeypatch.setattr(lean_tool, "ENABLED", lean if lean_tool_run is None else lean_tool_run)
    monkeypatch.setattr(testing, "_ids", itertools.count())  # the same call ids both ways
    ticks = itertools.count()
    sink = MemoryLogSink()
    the_oracle = {"accept": AcceptAll, "every_other": EveryOther, "every_other_long": lambda: EveryOther(600)}[oracle]()
    guard = BudgetGuard(the_oracle, MARKETS[market] if isinstance(market, str) else market, budget,
                        log_sink=sink if log else None, tool_errors=tool_errors, enforce=enforce,
                        feedback_chars=feedback_chars, clock=lambda: float(next(ticks)))
    script = [m for _ in range(runs) for m in (turns or _turns)(kind)]
    model = Recording(messages=iter(script), bound=[], seen=[], fail_on=set(), executions=[])
    agent = create_agent(model, tools or TOOLS,
                         middleware=middleware(guard.middleware()) if middleware else [guard.middleware()],
                         checkpointer=InMemorySaver() if thread else None)
    config = {"configurable": {"thread_id": "t-lean"}} if thread else None
    out: Any = None
    steps: list[Any] = []  # every step's state update and the state after it, in order

    async def stream(start: Any) -> list[Any]:
        return [chunk async for chunk in agent.astream(start, config, stream_mode=["updates", "values"])]

    for r in range(runs):
        start = {"messages": [HumanMessage(f"task {r}")]} if thread or out is None else {
            "messages": [*out["messages"], HumanMessage(f"task {r}")], "intent_ledger": out["intent_ledger"]}
        chunks = (asyncio.run(stream(start)) if use_async
                  else list(agent.stream(start, config, stream_mode=["updates", "values"])))
        steps += chunks
        out = [chunk for mode, chunk in chunks if mode == "values"][-1]
    return {**_seen(out, guard, sink, the_oracle, steps), "model": (model.bound, model.seen), "clock_reads": next(ticks)}


def _seen(out: dict[str, Any], guard: BudgetGuard, sink: MemoryLogSink, oracle: Any, steps: list[Any]
          ) -> dict[str, Any]:
    """Everything the run shows, as JSON text, with the random message ids named by their place."""
    names: dict[str, str] = {}
    for i, m in enumerate(out["messages"]):
        if isinstance(m, AIMessage):
            if m.id:
                names[m.id] = f"<ai {i}>"
            for j, c in enumerate([*m.tool_calls, *m.invalid_tool_calls]):  # (call ids come from a global counter)
                if c.get("id"):
                    names[c["id"]] = f"<call {i}.{j}>"
    names[str(out["intent_ledger"]["episode_id"])] = "<episode>"  # (named at random without a thread id)
    longest_first = sorted(names, key=len, reverse=True)

    def text(value: Any) -> str:
        s = json.dumps(value, sort_keys=True, default=repr)
        for old in longest_first:
            s = s.replace(old, names[old])
        return s

    messages = [text({"type": m.type, "content": m.content, "name": getattr(m, "name", None),
                      "tool_calls": getattr(m, "tool_calls", None), "tool_call_id": getattr(m, "tool_call_id", None),
                      "status": getattr(m, "status", None), "artifact": getattr(m, "artifact", None),
                      "additional_kwargs": m.additional_kwargs,
                      "invalid_tool_calls": getattr(m, "invalid_tool_calls", None)})
                for m in out["messages"]]
    # (Sorted, and without tool_ms, spent and remaining: the two calls of one message run in parallel threads, which
    # read the clock, commit and log in either order, both ways. The ledger and the order of everything else are
    # compared step by step below.)
    records = sorted(text(r.model_dump(exclude={"timestamp", "tool_ms", "spent", "remaining"})) for r in sink.records)

    def shown(value: Any) -> Any:  # a step's update or state, messages by what they say (not their random ids)
        if isinstance(value, dict):
            return {k: shown(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [shown(v) for v in value]
        if hasattr(value, "content") and hasattr(value, "type"):
            return {"type": value.type, "content": value.content, "tool_calls": getattr(value, "tool_calls", None),
                    "tool_call_id": getattr(value, "tool_call_id", None), "status": getattr(value, "status", None),
                    "artifact": getattr(value, "artifact", None), "ai_id": value.id if value.type == "ai" else None}
        return value

    ledger = guard.ledger(out)
    return {"messages": messages, "channel": text(out["intent_ledger"]), "ledger": text(ledger.to_state()),
            "totals": (ledger.spent, ledger.reserved, ledger.remaining, ledger.budget), "records": records,
            "oracle": text(getattr(oracle, "contexts", None)),
            "steps": _by_superstep([(mode, text(shown(chunk))) for mode, chunk in steps]),
            "tool_messages": [m for m, raw in zip(messages, out["messages"]) if isinstance(raw, ToolMessage)]}


def _by_superstep(chunks: list[tuple[str, str]]) -> list[Any]:
    """The updates of each graph step (sorted: the parallel calls of one message finish in any order) and
    the state after it."""
    out: list[Any] = []
    updates: list[str] = []
    for mode, chunk in chunks:
        if mode == "updates":
            updates.append(chunk)
        else:
            out.append((sorted(updates), chunk))
            updates = []
    return [*out, sorted(updates)]


SCENARIOS = [
    pytest.param(dict(kind="common"), id="common"),
    pytest.param(dict(kind="common", thread=True, runs=2), id="common-checkpointed-two-runs"),
    pytest.param(dict(kind="common", runs=2), id="common-two-runs-state-carried"),
    pytest.param(dict(kind="common", budget=2.5), id="over-budget"),
    pytest.param(dict(kind="common", oracle="every_other"), id="oracle-rejects"),
    pytest.param(dict(kind="common", budget=2.5, enforce=False), id="over-budget-not-enforced"),
    pytest.param(dict(kind="common", market="with_ban"), id="common-a-tool-banned"),
    pytest.param(dict(kind="mixed"), id="mixed"),
    pytest.param(dict(kind="mixed", market="with_ban"), id="mixed-a-tool-banned"),
    pytest.param(dict(kind="mixed", oracle="every_other", budget=6.0, thread=True, market="with_ban"),
                 id="mixed-rejects-tight"),
    pytest.param(dict(kind="common", use_async=True), id="common-async"),
    # A cap on refusal notes: the general gate shortens them (and the request); the lean gate must not skip that.
    pytest.param(dict(kind="common", oracle="every_other_long", feedback_chars=240), id="rejects-notes-capped"),
    pytest.param(dict(kind="mixed", oracle="every_other", budget=6.0, feedback_chars=240, thread=True),
                 id="mixed-rejects-tight-notes-capped"),
    pytest.param(dict(kind="mixed", oracle="every_other", use_async=True, thread=True), id="mixed-async"),
]


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_the_lean_path_and_the_general_code_agree(scenario: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    lean = _run(**scenario, lean=True, monkeypatch=monkeypatch)
    general = _run(**scenario, lean=False, monkeypatch=monkeypatch)
    for part in ("channel", "ledger", "totals", "records", "tool_messages", "messages", "oracle", "steps", "model",
                 "clock_reads"):
        assert lean[part] == general[part], part
    assert lean["records"] and lean["tool_messages"]


def test_the_lean_path_is_taken_in_the_common_turn(monkeypatch: pytest.MonkeyPatch) -> None:
    taken = {"prepared": 0, "decided": 0, "open_call": 0}
    for name in taken:
        original = getattr(lean_path, name)

        def counting(*args: Any, _original: Any = original, _name: str = name, **kwargs: Any) -> Any:
            result = _original(*args, **kwargs)
            taken[_name] += result is not None
            return result

        monkeypatch.setattr(lean_path, name, counting)
    seen = _run("common", lean=True, monkeypatch=monkeypatch)
    # Four one-call turns and a last reply: every model step after the run's first is prepared the lean way,
    # the three one-call replies among them are gated the lean way, and so is every tool step after the first
    # (which takes state into the episode made before state had a channel: EpisodeRegistry.get, synced).
    assert taken == {"prepared": 4, "decided": 3, "open_call": 3}
    assert len(seen["tool_messages"]) == 4
