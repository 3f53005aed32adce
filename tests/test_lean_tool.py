"""The lean tool run (intent/lean_tool.py) against the general code it stands in for.

The scenarios of tests/test_lean_path.py and more, aimed at the tool step (retries inside and outside the
guard, a tool that raises, bills, bills above its quote, answers with a Command or handles its own error,
arguments the tool's schema rejects, a call edited or redirected inside the guard, an async agent), run with
no log sink (the lean tool run is made only without one) and with :data:`intent.lean_tool.ENABLED` on and
off, the lean model step on both times; and once more with all the general code. Every step's state update
and the state after it, the ledger and the answers must be the same (``_run`` and ``_seen`` of
tests/test_lean_path.py). The last tests check that the lean tool run is taken in the common turn and
how often it hands a run to the general code, so that it cannot rot into a path nothing uses.
"""

from __future__ import annotations

import itertools
import json
import time
from typing import Annotated, Any

import pytest
from langchain.agents.middleware import AgentMiddleware, ToolRetryMiddleware
from langchain_core.messages import AIMessage, HumanMessage, ToolMessage
from langchain_core.tools import InjectedToolCallId, StructuredTool, ToolException, tool
from langgraph.types import Command

from intent import AcceptAll, BudgetGuard, Market, PricedTool, lean_path, lean_tool, testing
from intent.metering import CallRun
from intent.nesting import current_parent
from tests.fakes import ScriptedToolModel, ai, call
from tests.test_lean_path import MARKETS, PRICED, TOOLS, _run
from tests.test_lean_path import SCENARIOS as MODEL_STEP_SCENARIOS

_FAILED: dict[str, int] = {}  # flaky's failures so far, by argument (cleared before each run)


@tool
def flaky(q: str) -> str:
    """Fails the first time it is asked about each q."""
    if not _FAILED.get(q):
        _FAILED[q] = 1
        raise RuntimeError(f"upstream 503 for {q}")
    return f"flaky {q}"


def _handles(exc: ToolException) -> str:
    return f"handled: {exc}"


def _handled(q: str) -> str:
    raise ToolException(f"no {q}")


handled = StructuredTool.from_function(_handled, name="handled", handle_tool_error=_handles,
                                       description="A tool that turns its error into its answer.")


@tool(response_format="content_and_artifact")
def overrun(q: str) -> tuple[str, dict[str, Any]]:
    """A tool whose provider bills above its quote (spending stops after it)."""
    return f"overrun {q}", {"intent_billed": 3.0}


@tool
def commander(q: str, tool_call_id: Annotated[str, InjectedToolCallId]) -> Command:
    """A tool answering with a Command (and an injected argument)."""
    return Command(update={"messages": [ToolMessage(f"commanded {q}", tool_call_id=tool_call_id)]})


@tool
def peek(q: str) -> str:
    """Reads its own call's charges while it runs, as the ledger writes them to state (what a sub-agent started
    inside the call reads of its parent's ledger: intent.nesting)."""
    parent = current_parent()
    ledger = parent.episode.ledger
    mine = {cid: d for cid, d in ledger.unseen_in({}).items() if cid.startswith(parent.key)}
    return json.dumps({"q": q, "running": [(d["status"], d["execution"], d["amount"]) for d in mine.values()]})


TOOL_TOOLS = [*TOOLS, flaky, handled, overrun, commander, peek]
TOOL_MARKET = Market([*PRICED, PricedTool("flaky", 1.0), PricedTool("handled", 0.5), PricedTool("overrun", 1.0),
                      PricedTool("commander", 0.5), PricedTool("peek", 0.5)])


class Edit(AgentMiddleware):
    """Inside the guard: edits the arguments of the calls to fetch with q="edit me", and sends the calls to
    fetch with q="redirect" to search (a reviewer's edit; the guard re-gates both)."""

    def wrap_tool_call(self, request: Any, handler: Any) -> Any:
        c = request.tool_call
        if c["name"] == "fetch" and c["args"].get("q") == "edit me":
            request = request.override(tool_call={**c, "args": {"q": "edited"}})
        elif c["name"] == "fetch" and c["args"].get("q") == "redirect":
            request = request.override(tool=next(t for t in request.runtime.tools if t.name == "search"))
        return handler(request)


class Late(AgentMiddleware):
    """Inside the guard: holds the calls to fetch with q="late" back until the other call of their message (a
    tool billed above its quote) has been charged (its overrun is in the live ledger), so that it has when they
    reach the guard's run, however the two threads are scheduled."""

    def __init__(self, guard: BudgetGuard) -> None:
        super().__init__()
        self.guard = guard

    def _overrun_charged(self) -> bool:
        return any((e := self.guard.episodes.peek(i)) is not None and e.ledger.overrun > 0
                   for i in self.guard.episodes.ids())

    def wrap_tool_call(self, request: Any, handler: Any) -> Any:
        if request.tool_call["args"].get("q") == "late":
            deadline = time.monotonic() + 30
            while not self._overrun_charged():
                assert time.monotonic() < deadline, "the overrun was never charged"
                time.sleep(0.005)
        return handler(request)


def _late_inside(guard: Any) -> list[Any]:
    return [guard, Late(guard.guard)]


def _retry_inside(guard: Any) -> list[Any]:
    return [guard, ToolRetryMiddleware(max_retries=2, initial_delay=0.0, jitter=False, backoff_factor=0.0)]


def _retry_outside(guard: Any) -> list[Any]:
    return [ToolRetryMiddleware(max_retries=2, initial_delay=0.0, jitter=False, backoff_factor=0.0), guard]


def _edited_inside(guard: Any) -> list[Any]:
    return [guard, Edit()]


def _tool_turns(kind: str) -> list[AIMessage]:
    if kind == "flaky":  # each flaky call fails once: a retry runs it again (paid again)
        return [ai(call("fetch", q="a")), ai(call("flaky", q="b")), ai(call("fetch", q="c")),
                ai(call("flaky", q="d"), call("fetch", q="e")), ai(call("flaky", q="f")), ai(text="done")]
    if kind == "tools":  # every way a tool answers
        return [ai(call("fetch", q="a")), ai(call("billed", q="b")), ai(call("broken", q="c")),
                ai(call("handled", q="d")), ai(call("commander", q="e")), ai(call("fetch", q=7)),
                ai(call("fetch", q="f"), call("search", q="g")), ai(call("search", q="h")),
                ai(call("overrun", q="i")), ai(call("fetch", q="j")), ai(text="done")]
    if kind == "halts":  # the overrun stops spending: the late call, reserved at the gate, does not run
        return [ai(call("fetch", q="a")), ai(call("overrun", q="b"), call("fetch", q="late")), ai(text="done")]
    if kind == "peeks":
        return [ai(call("fetch", q="a")), ai(call("peek", q="b")), ai(call("peek", q="c")), ai(text="done")]
    if kind == "edits":
        # (The first tool step of a run is the general code's: the edits come later. Under every_other, the oracle
        # accepts "edit me" at the gate and refuses it when asked again at the tool step, and so "redirect".)
        return [ai(call("fetch", q="a")), ai(call("fetch", q="b")), ai(call("fetch", q="edit me")),
                ai(call("fetch", q="redirect")), ai(call("fetch", q="c")), ai(text="done")]
    raise AssertionError(kind)


def _turns(kind: str) -> list[AIMessage]:
    from tests.test_lean_path import _turns as model_turns

    return _tool_turns(kind) if kind in ("flaky", "tools", "edits", "halts", "peeks") else model_turns(kind)


# The lean path's scenarios (but the banned tool of "common-a-tool-banned", which this test's market has not),
# then the tool step's own.
SCENARIOS = [
    *(p for p in MODEL_STEP_SCENARIOS if p.id != "common-a-tool-banned"),
    pytest.param(dict(kind="tools"), id="every-answer"),
    pytest.param(dict(kind="tools", budget=8.0, thread=True), id="every-answer-tight"),
    pytest.param(dict(kind="tools", use_async=True), id="every-answer-async"),
    pytest.param(dict(kind="halts", middleware=_late_inside), id="an-overrun-halts-a-call-of-its-message"),
    pytest.param(dict(kind="peeks"), id="a-tool-reads-its-charge-while-it-runs"),
    pytest.param(dict(kind="flaky", middleware=_retry_inside), id="retry-inside-the-guard"),
    pytest.param(dict(kind="flaky", middleware=_retry_inside, budget=6.5), id="retry-inside-over-budget"),
    pytest.param(dict(kind="flaky", middleware=_retry_outside, tool_errors="raise"), id="retry-outside-the-guard"),
    pytest.param(dict(kind="flaky", middleware=_retry_inside, use_async=True), id="retry-inside-async"),
    pytest.param(dict(kind="flaky"), id="tool-fails-answered-as-a-message"),
    pytest.param(dict(kind="edits", middleware=_edited_inside), id="edited-and-redirected-inside"),
    pytest.param(dict(kind="edits", middleware=_edited_inside, oracle="every_other"), id="edited-regate-rejects"),
]

# (clock_reads: how many times the guard read its clock, which a guard's clock may count)
PARTS = ("channel", "ledger", "totals", "records", "tool_messages", "messages", "oracle", "steps", "model",
         "clock_reads")


def _scenario_run(scenario: dict[str, Any], monkeypatch: pytest.MonkeyPatch, **how: Any) -> dict[str, Any]:
    _FAILED.clear()
    market = TOOL_MARKET if scenario.get("market", "plain") == "plain" else Market(
        TOOL_MARKET.tools, banned=MARKETS[scenario["market"]].banned)
    return _run(**{**scenario, "market": market}, tools=TOOL_TOOLS, turns=_turns, monkeypatch=monkeypatch, **how)


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_the_lean_tool_run_and_the_general_code_agree(scenario: dict[str, Any],
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    lean = _scenario_run(scenario, monkeypatch, lean=True, lean_tool_run=True, log=False)
    general_run = _scenario_run(scenario, monkeypatch, lean=True, lean_tool_run=False, log=False)
    general = _scenario_run(scenario, monkeypatch, lean=False, log=False)  # no lean code at all
    for part in PARTS:
        assert lean[part] == general_run[part], part
        assert lean[part] == general[part], part
    assert lean["tool_messages"] and not lean["records"]


def test_with_a_log_sink_the_general_run_is_taken(monkeypatch: pytest.MonkeyPatch) -> None:
    made = []
    original = lean_tool.call_run
    monkeypatch.setattr(lean_tool, "call_run", lambda *a: made.append(type(r := original(*a))) or r)
    lean = _scenario_run(dict(kind="tools"), monkeypatch, lean=True, lean_tool_run=True, log=True)
    general = _scenario_run(dict(kind="tools"), monkeypatch, lean=False, log=True)
    for part in PARTS:
        assert lean[part] == general[part], part
    assert made and set(made) == {CallRun}


def _raising(lean: bool, lean_tool_run: bool, monkeypatch: pytest.MonkeyPatch) -> tuple[str, Any, Any]:
    """tool_errors="raise": the tool's error leaves the agent, after its run was paid."""
    monkeypatch.setattr(lean_path, "ENABLED", lean)
    monkeypatch.setattr(lean_tool, "ENABLED", lean_tool_run)
    monkeypatch.setattr(testing, "_ids", itertools.count())
    ticks = itertools.count()
    guard = BudgetGuard(AcceptAll(), TOOL_MARKET, 10.0, tool_errors="raise", clock=lambda: float(next(ticks)))
    from langchain.agents import create_agent

    model = ScriptedToolModel(messages=iter([ai(call("fetch", q="a")), ai(call("fetch", q="b")),
                                             ai(call("broken", q="c")), ai(text="done")]))
    agent = create_agent(model, TOOL_TOOLS, middleware=[guard.middleware()])
    with pytest.raises(RuntimeError) as raised:
        agent.invoke({"messages": [HumanMessage("go")]})
    (episode_id,) = guard.episodes.ids()
    ledger = guard.episodes.peek(episode_id).ledger
    entries = [{k: v for k, v in e.to_dict().items() if k not in ("call_id", "tool_call_id")} for e in ledger.entries()]
    return str(raised.value), entries, (ledger.spent, ledger.reserved, ledger.remaining)


def test_a_tool_error_raised_is_paid_alike(monkeypatch: pytest.MonkeyPatch) -> None:
    lean = _raising(True, True, monkeypatch)
    assert lean == _raising(True, False, monkeypatch) == _raising(False, False, monkeypatch)
    assert lean[0] == "upstream 503" and lean[2][0] == 2.5  # two fetches and the broken run, paid


def test_the_lean_tool_run_is_taken_in_the_common_turn(monkeypatch: pytest.MonkeyPatch) -> None:
    counts = {"lean": 0, "general": 0, "finish_lean": 0, "finish_general": 0}
    execute, finish = CallRun.execute, CallRun.finish

    def general_execute(self: Any, *args: Any) -> Any:
        counts["general"] += 1
        return execute(self, *args)

    def general_finish(self: Any, result: Any) -> Any:
        counts["finish_general"] += 1
        return finish(self, result)

    lean_execute, lean_finish = lean_tool.LeanRun.execute, lean_tool.LeanRun.finish

    def counting_execute(self: Any, *args: Any) -> Any:
        counts["lean"] += 1
        return lean_execute(self, *args)

    def counting_finish(self: Any, result: Any) -> Any:
        counts["finish_lean"] += 1
        return lean_finish(self, result)

    monkeypatch.setattr(CallRun, "execute", general_execute)
    monkeypatch.setattr(CallRun, "finish", general_finish)
    monkeypatch.setattr(lean_tool.LeanRun, "execute", counting_execute)
    monkeypatch.setattr(lean_tool.LeanRun, "finish", counting_finish)
    seen = _scenario_run(dict(kind="common"), monkeypatch, lean=True, lean_tool_run=True, log=False)
    # Four calls: the first tool step takes state into the episode (the general open_call, a CallRun); the
    # other three are lean runs, none handed to the general code, and closed the lean way.
    assert counts == {"lean": 3, "general": 1, "finish_lean": 3, "finish_general": 1}
    assert len(seen["tool_messages"]) == 4
    # A retry inside the guard: the second run of each flaky call is reserved again by the general reservation,
    # inside the lean run (no general execute), and closed the lean way (its charges are committed).
    counts.update(lean=0, general=0, finish_lean=0, finish_general=0)
    _scenario_run(dict(kind="flaky", middleware=_retry_inside), monkeypatch, lean=True, lean_tool_run=True,
                  log=False)
    assert counts["general"] == 1 and counts["lean"] >= 6 and counts["finish_general"] == 1
