"""``tool_errors="message"``: the tool's own errors answered with what the call cost; anything else
raised inside the guard (another middleware's bug or failure) is not the tool's error and propagates.

Money is counted outside the guard: the tool counts its own runs.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from langchain.agents import create_agent
from langchain.agents.middleware import AgentMiddleware
from langchain_core.messages import AIMessage, ToolMessage
from langchain_core.tools import StructuredTool

from intent import AcceptAll, BudgetGuard, Market, PricedTool
from intent.testing import ai, assert_each_call_answered_once, call, scripted


class ProviderDown(RuntimeError):
    pass


def _agent(runs: list[int], *, raise_in_tool: BaseException | None = None, inner: list[Any] = ()):
    def a(x: int = 0) -> str:
        runs.append(x)
        if raise_in_tool is not None:
            raise raise_in_tool
        return "ok"

    guard = BudgetGuard(AcceptAll(), Market([PricedTool("a", 5.0)]), 20.0, tool_errors="message")
    agent = create_agent(scripted([ai(call("a", x=1)), AIMessage("done")]),
                         [StructuredTool.from_function(a, name="a", description="a")],
                         middleware=[guard.middleware(), *inner])
    return guard, agent


def _go(agent: Any, use_async: bool) -> Any:
    inp, config = {"messages": [("user", "go")]}, {"configurable": {"thread_id": "t"}}
    return asyncio.run(agent.ainvoke(inp, config)) if use_async else agent.invoke(inp, config)


@pytest.mark.parametrize("use_async", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize(("billed", "says"), [(None, "The call was charged 5."), (0.0, "It cost nothing.")],
                         ids=["charged", "not_billed"])
def test_a_tools_own_error_is_answered_with_what_the_call_cost(use_async, billed, says):
    runs: list[int] = []
    exc = ProviderDown("quota")
    if billed is not None:
        exc.intent_billed = billed  # the provider did not bill the failed call
    guard, agent = _agent(runs, raise_in_tool=exc)
    out = _go(agent, use_async)
    answer = next(m for m in out["messages"] if isinstance(m, ToolMessage))
    assert runs == [1] and answer.status == "error"
    assert str(answer.content) == f"Error: a failed (ProviderDown: quota). {says}"
    assert guard.ledger(out).spent == (5.0 if billed is None else 0.0)
    assert_each_call_answered_once(out["messages"])


class _Classifier(AgentMiddleware):
    """A middleware inside the guard whose own service fails before the tool runs."""

    def wrap_tool_call(self, request: Any, handler: Any) -> Any:
        raise ProviderDown("classifier down")

    async def awrap_tool_call(self, request: Any, handler: Any) -> Any:
        raise ProviderDown("classifier down")


@pytest.mark.parametrize("use_async", [False, True], ids=["sync", "async"])
def test_another_middlewares_failure_inside_the_guard_is_not_answered_as_the_tools(use_async):
    # It was answered "Error: a failed (...classifier down). The call was charged." with nothing run
    # or charged.
    runs: list[int] = []
    guard, agent = _agent(runs, inner=[_Classifier()])
    with pytest.raises(ProviderDown, match="classifier down"):
        _go(agent, use_async)
    assert runs == []
    assert guard.episodes.peek("t").ledger.spent == 0


class _Wraps(AgentMiddleware):
    """Inside the guard: turns the tool's error into its own, chained (``from``) or not."""

    def __init__(self, chained: bool) -> None:
        super().__init__()
        self.chained = chained

    def wrap_tool_call(self, request: Any, handler: Any) -> Any:
        try:
            return handler(request)
        except ProviderDown as exc:
            if self.chained:
                raise RuntimeError("wrapped") from exc
            raise RuntimeError("the middleware's own bug")  # noqa: B904 - deliberately not chained


@pytest.mark.parametrize("chained", [True, False], ids=["raise_from", "raised_while_handling"])
def test_only_an_explicitly_chained_exception_is_answered_as_the_tools(chained):
    runs: list[int] = []
    guard, agent = _agent(runs, raise_in_tool=ProviderDown("quota"), inner=[_Wraps(chained)])
    if chained:
        out = _go(agent, False)
        answer = next(m for m in out["messages"] if isinstance(m, ToolMessage))
        assert answer.status == "error" and "charged 5" in str(answer.content)
        assert guard.ledger(out).spent == 5.0
    else:
        with pytest.raises(RuntimeError, match="own bug"):  # it was answered as the tool's error
            _go(agent, False)
        assert guard.episodes.peek("t").ledger.spent == 5.0
    assert runs == [1]
