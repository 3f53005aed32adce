"""Test doubles shipped with the library, shared by users' tests and ours.

* :class:`ScriptedToolModel` / :func:`scripted`, :func:`call`, :func:`ai`: a chat model that
  plays a fixed list of AIMessages with tool calls (``bind_tools`` records what it was shown);
* :class:`GuardDriver`: drives a guard's gate and tool step without a graph, as the
  middleware does (before the model, gate, every call's tool step, state merged);
* :func:`assert_each_call_answered_once`: every proposed call has exactly one ToolMessage;
* :func:`check_oracle`: the conformance checks every oracle must pass.
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from langchain_core.language_models.fake_chat_models import GenericFakeChatModel
from langchain_core.messages import AIMessage, AnyMessage, HumanMessage, ToolMessage
from langgraph.types import Command

from intent.ledger import BudgetLedger, merge_ledger_states
from intent.state import LEDGER_KEY

__all__ = [
    "GuardDriver",
    "ScriptedToolModel",
    "ai",
    "assert_each_call_answered_once",
    "assert_one_record_per_call",
    "call",
    "check_oracle",
    "scripted",
]


class ScriptedToolModel(GenericFakeChatModel):
    """GenericFakeChatModel plays a fixed list of AIMessages; it lacks bind_tools, so add it.

    ``bound`` records the tool names of every bind_tools call (what the model was shown).
    """

    bound: list = []
    model_name: str = "scripted-model"  # what a model-price table prices it as

    def bind_tools(self, tools: Sequence[Any], **kwargs: Any) -> ScriptedToolModel:
        self.bound.append(sorted(t["name"] if isinstance(t, dict) else t.name for t in tools))
        return self


def scripted(messages: Iterable[AIMessage], *, model_name: str = "scripted-model") -> ScriptedToolModel:
    return ScriptedToolModel(messages=iter(list(messages)), bound=[], model_name=model_name)


_ids = itertools.count()


def call(name: str, **args: Any) -> dict[str, Any]:
    """A tool call with a fresh id."""
    return {"name": name, "args": args, "id": f"call_{next(_ids)}", "type": "tool_call"}


def ai(*calls: dict[str, Any], text: str = "", usage: tuple[int, int] | None = None,
       model_name: str | None = None) -> AIMessage:
    """An AIMessage with tool calls; ``usage=(input_tokens, output_tokens)`` makes it report usage
    as a provider does (``usage_metadata``, and ``response_metadata["model_name"]``)."""
    extra: dict[str, Any] = {}
    if usage is not None:
        extra["usage_metadata"] = {"input_tokens": usage[0], "output_tokens": usage[1],
                                   "total_tokens": usage[0] + usage[1]}
    if model_name is not None:
        extra["response_metadata"] = {"model_name": model_name}
    return AIMessage(content=text, tool_calls=list(calls), **extra)


def assert_each_call_answered_once(messages: Sequence[AnyMessage]) -> None:
    """Every tool call of every AIMessage has exactly one ToolMessage with its id, after it and
    before the next AIMessage; no ToolMessage answers nothing."""
    ai_idx = [i for i, m in enumerate(messages) if isinstance(m, AIMessage)]
    for k, i in enumerate(ai_idx):
        end = ai_idx[k + 1] if k + 1 < len(ai_idx) else len(messages)
        answers = [m.tool_call_id for m in messages[i + 1:end] if isinstance(m, ToolMessage)]
        ids = [c["id"] for c in messages[i].tool_calls]  # type: ignore[union-attr]
        assert len(ids) == len(set(ids)), f"AIMessage #{k} has duplicate tool call ids {ids}"
        for cid in ids:
            n = answers.count(cid)
            assert n == 1, f"tool call {cid!r} of AIMessage #{k} has {n} ToolMessages"
        stray = set(answers) - set(ids)
        assert not stray, f"ToolMessages after AIMessage #{k} answer no call of it: {sorted(stray)}"


def assert_one_record_per_call(messages: Sequence[AnyMessage], records: Sequence[Any]) -> None:
    """Every tool call of every AIMessage has exactly one log record that answers for it: its
    refusal, its first run, its reservation released unused, or ``answered`` (another middleware
    answered it before the guard's gate). A retry's run (``execution > 1``) and a retry refused
    after a run are further records of the same call, not second answers.

    Calls are told apart by (model turn, id), so an id reused in a later message is a new call;
    the turn is the AIMessage's index among the AIMessages, the records' ``step``."""
    turns = [m for m in messages if isinstance(m, AIMessage)]
    proposed = Counter((step, c["id"]) for step, m in enumerate(turns) for c in m.tool_calls)
    answers: Counter[tuple[int, str]] = Counter()
    ran: set[tuple[int, str]] = set()
    for r in records:
        key = (r.step, r.call_id)
        if r.kind != "tool" or r.decision == "top_up" or key not in proposed:
            continue
        if r.execution == 1 or (r.execution == 0 and key not in ran):
            answers[key] += 1
        if r.execution >= 1:
            ran.add(key)
    wrong = {f"turn {step} {cid}": answers[(step, cid)] for step, cid in proposed if answers[(step, cid)] != 1}
    assert not wrong, f"calls without exactly one answering record ({{call: records}}): {wrong}"


class GuardDriver:
    """Drive a guard without a graph: ``step(ai_message)`` gates its calls, runs each one's
    tool step with ``run_tool`` as the innermost handler, merges every update into
    :attr:`state`, and returns the ToolMessages. ``finish()`` ends the episode.
    """

    def __init__(self, guard: Any, *, thread_id: str = "driver", query: str = "go",
                 tools: dict[str, Any] | None = None) -> None:
        self.guard = guard
        self.config = {"configurable": {"thread_id": thread_id}}
        self.state: dict[str, Any] = {"messages": [HumanMessage(query)], LEDGER_KEY: None}
        self.tools = tools or {}

    def apply(self, update: Any) -> list[AnyMessage]:
        """Merge a node's output (a state update, a ``Command`` or a bare ``ToolMessage``)."""
        if isinstance(update, ToolMessage):
            update = {"messages": [update]}
        if isinstance(update, Command):
            update = update.update
        if not update:
            return []
        if LEDGER_KEY in update:
            self.state[LEDGER_KEY] = merge_ledger_states(self.state[LEDGER_KEY], update[LEDGER_KEY])
        messages = list(update.get("messages", []))
        self.state["messages"] = [*self.state["messages"], *messages]
        return messages

    def step(self, message: AIMessage, run_tool: Callable[[Any], Any] | None = None) -> list[ToolMessage]:
        from langgraph.prebuilt.tool_node import ToolCallRequest

        self.apply(self.guard.prepare(self.state, self.config))
        self.state["messages"] = [*self.state["messages"], message]
        answered = [m for m in self.apply(self.guard.gate(self.state, self.config)) if isinstance(m, ToolMessage)]
        done = {m.tool_call_id for m in answered}
        last = next(m for m in reversed(self.state["messages"]) if isinstance(m, AIMessage))
        handler = run_tool or self._run
        for c in last.tool_calls:
            if c["id"] in done:
                continue
            request = ToolCallRequest(tool_call=c, tool=self.tools.get(c["name"]) or _Echo(c["name"]),
                                      state=dict(self.state), runtime=None)
            answered += [m for m in self.apply(self.guard.wrap_tool_call(request, handler))
                         if isinstance(m, ToolMessage)]
        return answered

    @staticmethod
    def _run(request: Any) -> ToolMessage:
        c = request.tool_call
        out = request.tool.invoke({**c, "type": "tool_call"})
        return out if isinstance(out, ToolMessage) else ToolMessage(str(out), tool_call_id=c["id"], name=c["name"])

    def finish(self) -> None:
        self.apply(self.guard.finish(self.state, self.config))

    @property
    def ledger(self) -> BudgetLedger:
        return self.guard.ledger(self.state)


class _Echo:
    """A stand-in tool that returns its arguments (used when the driver has no real tool)."""

    def __init__(self, name: str) -> None:
        self.name = name

    def invoke(self, tool_input: Any, config: Any = None, **_: Any) -> ToolMessage:
        args = tool_input.get("args", {}) if isinstance(tool_input, dict) else tool_input
        return ToolMessage(str(args), tool_call_id=tool_input["id"], name=self.name)


def check_oracle(factory: Callable[[], Any], *, budget: float = 30.0) -> None:
    """The conformance checks every oracle must pass (see :mod:`intent.conformance`)."""
    from intent.conformance import check_oracle as _check

    _check(factory, budget=budget)
