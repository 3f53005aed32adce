"""What the guard does with a tool's arguments: the tool's own validators, injected arguments.

Money is counted outside the guard: each tool counts its own runs.
"""

from __future__ import annotations

import warnings
from typing import Annotated, Any

import pytest
from langchain.agents import create_agent
from langchain.tools import ToolRuntime
from langchain_core.messages import AIMessage, ToolMessage
from langchain_core.tools import StructuredTool
from langgraph.prebuilt import InjectedState
from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from intent import AcceptAll, BudgetGuard, Decision, JsonlLogSink, Market, MemoryLogSink, PricedTool
from intent.logs import read_log_rows
from intent.testing import ai, assert_each_call_answered_once, call, scripted


class _Positive(BaseModel):
    n: int

    @field_validator("n")
    @classmethod
    def _positive(cls, n: int) -> int:
        if n < 0:
            raise ValueError("n must be at least 0")
        return n


class _OneOf(BaseModel):
    a: str | None = None
    b: str | None = None

    @model_validator(mode="after")
    def _exactly_one(self) -> _OneOf:
        if (self.a is None) == (self.b is None):
            raise ValueError("give exactly one of a or b")
        return self


class _Forbid(BaseModel):
    model_config = ConfigDict(extra="forbid")
    x: int


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True)
    x: int


class _Aliased(BaseModel):
    x: int = Field(alias="X")


def _run(tool: StructuredTool, script: list[AIMessage], *, price: float = 5.0, budget: float = 20.0,
         oracle: Any = None, log_sink: Any = None) -> tuple[BudgetGuard, dict[str, Any]]:
    guard = BudgetGuard(oracle or AcceptAll(), Market([PricedTool(tool.name, price)]), budget,
                        log_sink=log_sink or MemoryLogSink())
    out = create_agent(scripted(script), [tool], middleware=[guard.middleware()]).invoke(
        {"messages": [("user", "go")]})
    return guard, out


@pytest.mark.parametrize(("schema", "bad", "good", "why"), [
    (_Positive, {"n": -1}, {"n": 2}, "n must be at least 0"),
    (_OneOf, {"a": "x", "b": "y"}, {"a": "x"}, "give exactly one of a or b"),
    # The schema the model sees (tool_call_schema) drops args_schema's extra="forbid", strict=True and aliases:
    # LangChain rejected such a call while parsing its input, the body never ran, and the run was charged.
    (_Forbid, {"x": 1, "y": 2}, {"x": 1}, "y: Extra inputs are not permitted"),
    (_Strict, {"x": "1"}, {"x": 1}, "x: Input should be a valid integer"),
    (_Aliased, {"x": 1}, {"X": 1}, "X: Field required"),
], ids=["field_validator", "model_validator", "extra_forbid", "strict", "alias"])
def test_arguments_the_tools_own_schema_rejects_are_refused_before_any_money_moves(schema, bad, good, why):
    runs: list[dict[str, Any]] = []

    def f(**kwargs: Any) -> str:
        runs.append(kwargs)
        return "ok"

    tool = StructuredTool.from_function(f, name="f", description="f", args_schema=schema)
    guard, out = _run(tool, [ai(call("f", **bad), call("f", **good)), AIMessage("done")])
    ledger = guard.ledger(out)
    assert len(runs) == 1  # only the good call ran
    assert ledger.spent == 5.0 and ledger.reserved == 0
    assert_each_call_answered_once(out["messages"])
    refusal = next(m for m in out["messages"] if isinstance(m, ToolMessage) and m.status == "error")
    assert why in str(refusal.content) and "no charge" in str(refusal.content)


class _AskCounter(AcceptAll):
    def __init__(self) -> None:
        self.asked: list[tuple[str, dict[str, Any]]] = []

    def decide(self, ctx: Any) -> Decision:
        self.asked.append((ctx.tool, dict(ctx.args)))
        return Decision.accepted()


class _WithRuntimeInSchema(BaseModel):
    """Like LangChain's shell tool: the injected runtime is declared in the schema the model sees."""

    command: str
    runtime: Any = None


def test_an_injected_runtime_the_schema_declares_is_not_an_edit_and_stays_out_of_records(tmp_path):
    runs: list[str] = []

    def shell(command: str, runtime: ToolRuntime) -> str:
        assert runtime is not None  # LangGraph injected it
        runs.append(command)
        return "ran"

    tool = StructuredTool.from_function(shell, name="shell", description="run", args_schema=_WithRuntimeInSchema)
    oracle = _AskCounter()
    path = tmp_path / "log.jsonl"
    guard, out = _run(tool, [ai(call("shell", command="ls")), AIMessage("done")], oracle=oracle,
                      log_sink=JsonlLogSink(path))
    assert runs == ["ls"]
    assert oracle.asked == [("shell", {"command": "ls"})]  # gated once: not re-gated as an edited call
    records = list(read_log_rows(path))
    assert [r["args"] for r in records if r["execution"] == 1] == [{"command": "ls"}]
    assert guard.ledger(out).spent == 5.0


def test_a_tool_taking_a_tool_runtime_logs_to_a_jsonl_sink_with_the_models_arguments_only(tmp_path):
    runs: list[int] = []

    def lookup(x: int, runtime: ToolRuntime) -> str:
        runs.append(x)
        return f"found {x}"

    tool = StructuredTool.from_function(lookup, name="lookup", description="look up")
    path = tmp_path / "log.jsonl"
    guard, out = _run(tool, [ai(call("lookup", x=3)), AIMessage("done")], log_sink=JsonlLogSink(path))
    assert runs == [3]
    records = list(read_log_rows(path))
    assert [r["args"] for r in records] == [{"x": 3}]
    assert guard.ledger(out).spent == 5.0


class _InjectedInSchemaOnly(BaseModel):
    """An InjectedState declared only in args_schema (the function takes a plain dict), with a validator."""

    state: Annotated[dict, InjectedState]
    city: str

    @field_validator("city")
    @classmethod
    def _known(cls, city: str, info: ValidationInfo) -> str:
        if city == "Atlantis":
            raise ValueError("no such city")
        assert "messages" in info.data["state"]  # reads the injected value: a KeyError without it
        return city


@pytest.mark.parametrize(("city", "runs_expected", "spent"), [("Paris", ["Paris"], 5.0), ("Atlantis", [], 0.0)])
def test_a_validated_schema_with_an_argument_langgraph_injects_judges_only_the_models_arguments(city, runs_expected,
                                                                                                spent):
    # The injected `state` is not the model's: its absence at the guard's check refused every call
    # ("state: Field required"), and a validator reading it crashed the run.
    runs: list[str] = []

    def weather(city: str, state: dict) -> str:
        runs.append(city)
        return "sunny"

    tool = StructuredTool.from_function(weather, name="weather", description="w", args_schema=_InjectedInSchemaOnly)
    guard, out = _run(tool, [ai(call("weather", city=city)), AIMessage("done")])
    assert runs == runs_expected and guard.ledger(out).spent == spent
    assert_each_call_answered_once(out["messages"])


def test_a_tool_taking_a_tool_runtime_raises_no_serializer_warning():
    # The runtime's tools, metered by the guard, were not the list[BaseTool] it declares: pydantic warned
    # on every call of such a tool.
    def lookup(x: int, runtime: ToolRuntime) -> str:
        return f"found {x} among {len(runtime.tools)} tools"

    tool = StructuredTool.from_function(lookup, name="lookup", description="look up")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        guard, out = _run(tool, [ai(call("lookup", x=3)), AIMessage("done")])
    assert not [w for w in caught if "serializ" in str(w.message).lower()]
    assert guard.ledger(out).spent == 5.0 and "among 1 tools" in str(out["messages"][-2].content)


class _Trip(BaseModel):
    from_: str = Field(alias="from")

    @field_validator("from_")
    @classmethod
    def _known(cls, value: str) -> str:
        if value == "Atlantis":
            raise ValueError("no such city")
        return value


class _Temp(BaseModel):
    unit: str

    @field_validator("unit")
    @classmethod
    def _unit(cls, unit: str) -> str:
        if unit not in ("C", "F"):
            raise TypeError("unit must be C or F")  # not a ValueError: pydantic does not wrap it
        return unit


@pytest.mark.parametrize(("schema", "args"), [(_Trip, {"from_": "Paris"})], ids=["aliased_field"])
def test_a_call_the_tool_can_never_take_is_refused_free(schema, args):
    # An aliased field the model fills under its name (the tool needs the alias): it was let through, charged,
    # and failed in the tool.
    runs: list[Any] = []
    tool = StructuredTool.from_function(lambda **kw: runs.append(kw) or "ok", name="t", description="t",
                                        args_schema=schema)
    guard, out = _run(tool, [ai(call("t", **args)), AIMessage("done")])
    assert runs == [] and guard.ledger(out).spent == 0
    assert "no charge" in str(next(m for m in out["messages"] if isinstance(m, ToolMessage)).content)


@pytest.mark.parametrize("how", ["copy", "reversed", "add", "deepcopy", "pop", "plain"])
def test_every_way_of_reading_runtime_tools_gives_tools_metered_once(how):
    # A tool running a sibling through its runtime: copy.copy wrapped the tools twice (charged twice),
    # reversed() / + gave the raw tools (ran free).
    import copy

    runs: list[str] = []

    def inner(x: int = 0) -> str:
        runs.append("inner")
        return "in"

    def outer(x: int, runtime: ToolRuntime) -> str:
        tools = runtime.tools
        pool = {"copy": lambda: copy.copy(tools), "reversed": lambda: list(reversed(tools)),
                "add": lambda: tools + [], "deepcopy": lambda: copy.deepcopy(tools), "pop": lambda: [tools.pop()],
                "plain": lambda: tools}[how]()
        return next(t for t in pool if t.name == "inner").invoke({"x": 1})

    tools = [StructuredTool.from_function(outer, name="outer", description="o"),
             StructuredTool.from_function(inner, name="inner", description="i")]
    guard = BudgetGuard(AcceptAll(), Market([PricedTool("outer", 1.0), PricedTool("inner", 5.0)]), 20.0)
    out = create_agent(scripted([ai(call("outer", x=1)), AIMessage("done")]), tools,
                       middleware=[guard.middleware()]).invoke({"messages": [("user", "go")]})
    assert runs == ["inner"] and guard.ledger(out).spent == 6.0


class _Lookup(BaseModel):
    city: str

    @field_validator("city")
    @classmethod
    def _known(cls, city: str) -> str:
        return {"Paris": "paris-fr"}[city]  # a KeyError on any other city: pydantic does not wrap it


@pytest.mark.parametrize(("schema", "args", "raised"), [(_Temp, {"unit": "kelvin"}, TypeError),
                                                        (_Lookup, {"city": "Rome"}, KeyError)],
                         ids=["type_error", "key_error"])
@pytest.mark.parametrize("use_async", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("logged", [True, False], ids=["logged", "unlogged"])  # unlogged: the lean run (sync)
def test_a_validators_own_exception_reaches_what_is_outside_the_guard_free(schema, args, raised, use_async, logged):
    # A validator's own exception (one pydantic does not wrap) was answered by the guard as a free refusal: a bug
    # in the tool reached the model as the model's mistake, and a retry middleware outside never saw it. Without
    # the guard the run raises it. Now the guard raises it unchanged and charges nothing, whatever retries it.
    import asyncio

    from langchain.agents.middleware import ToolRetryMiddleware

    runs: list[Any] = []

    async def body_async(**kw: Any) -> str:
        runs.append(kw)
        return "ok"

    tool = StructuredTool.from_function(lambda **kw: runs.append(kw) or "ok", coroutine=body_async, name="t",
                                        description="t", args_schema=schema)
    script = [ai(call("t", **args)), AIMessage("done")]

    def go(agent: Any, thread: str) -> dict[str, Any]:
        inputs, config = {"messages": [("user", "go")]}, {"configurable": {"thread_id": thread}}
        return asyncio.run(agent.ainvoke(inputs, config)) if use_async else agent.invoke(inputs, config)

    with pytest.raises(raised):  # the reference: no guard
        go(create_agent(scripted(script), [tool]), "bare")
    sink = MemoryLogSink() if logged else None
    guard = BudgetGuard(AcceptAll(), Market([PricedTool("t", 5.0)]), 20.0, log_sink=sink)
    with pytest.raises(raised):
        go(create_agent(scripted(script), [tool], middleware=[guard.middleware()]), "plain")
    seen: list[BaseException] = []
    retry = ToolRetryMiddleware(max_retries=2, retry_on=lambda exc: seen.append(exc) or True, initial_delay=0,
                                jitter=False, on_failure=lambda exc: f"gave up: {type(exc).__name__}")
    out = go(create_agent(scripted(script), [tool], middleware=[retry, guard.middleware()]), "retried")
    assert runs == []
    assert [type(e) for e in seen] == [raised] * 3  # the retry middleware saw the tool's exception, each time
    assert "gave up" in str(next(m for m in out["messages"] if isinstance(m, ToolMessage)).content)
    assert_each_call_answered_once(out["messages"])
    ledger = guard.ledger(out)
    assert (ledger.spent, ledger.reserved) == (0.0, 0.0)
    if sink is None:
        return
    assert sum(r.charged for r in sink.records) == 0.0
    released = [(r.task_id, r.call_id) for r in sink.records if r.status == "released"
                and r.reason == "raised_before_run"]
    assert sorted(t for t, _ in released) == ["plain", "retried"]  # each call's reservation back once, not per retry


@pytest.mark.parametrize("use_async", [False, True], ids=["sync", "async"])
def test_a_validators_own_exception_is_answered_free_where_the_tool_or_the_guard_answers_errors(use_async):
    # tool_errors="message" (the bench's setting) and a tool's handle_tool_error answer a tool's own errors: the
    # validator's exception crashed the run under both once the guard stopped answering it as a refusal.
    import asyncio

    from langchain_core.tools import ToolException

    class _Handled(BaseModel):
        city: str

        @field_validator("city")
        @classmethod
        def _known(cls, city: str) -> str:
            if city != "Paris":
                raise ToolException(f"unknown city {city}; try Paris")
            return city

    runs: list[Any] = []

    def make(schema: type[BaseModel], **more: Any) -> StructuredTool:
        async def body_async(**kw: Any) -> str:
            runs.append(kw)
            return "ok"

        return StructuredTool.from_function(lambda **kw: runs.append(kw) or "ok", coroutine=body_async, name="t",
                                            description="t", args_schema=schema, **more)

    def answers(tool: StructuredTool, tool_errors: str | None) -> list[tuple[str, str]]:
        guard = None if tool_errors is None else BudgetGuard(AcceptAll(), Market([PricedTool("t", 5.0)]), 20.0,
                                                             tool_errors=tool_errors)
        agent = create_agent(scripted([ai(call("t", city="Rome")), AIMessage("done")]), [tool],
                             middleware=[] if guard is None else [guard.middleware()])
        inputs = {"messages": [("user", "go")]}
        out = asyncio.run(agent.ainvoke(inputs)) if use_async else agent.invoke(inputs)
        assert_each_call_answered_once(out["messages"])
        if guard is not None:
            assert (guard.ledger(out).spent, guard.ledger(out).reserved) == (0.0, 0.0)
        return [(m.status, str(m.content)) for m in out["messages"] if isinstance(m, ToolMessage)]

    handled = make(_Handled, handle_tool_error=True)
    assert answers(handled, None) == [("error", "unknown city Rome; try Paris")]  # the reference: no guard
    assert answers(handled, "raise") == [("error", "unknown city Rome; try Paris")]
    (status, text), = answers(make(_Lookup), "message")
    assert status == "error" and "KeyError" in text and "cost nothing" in text
    assert runs == []
