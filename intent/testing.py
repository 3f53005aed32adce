"""Test doubles shipped with the library, shared by users' tests and ours.

* :class:`ScriptedToolModel` / :func:`scripted`, :func:`call`, :func:`ai`: a chat model that
  plays a fixed list of AIMessages with tool calls (``bind_tools`` records what it was shown);
* :class:`ReactiveToolModel`: a chat model whose every reply is computed from the conversation so far
  (``reply(messages, info) -> AIMessage``), for agents whose next step depends on what came back;
* :class:`BilledChatModel` and :class:`ModelRuns`: a chat model that reports token usage and
  counts its executions outside the guard (for checking model charges against what really ran);
* :class:`RunCounter`: real executions counted by name inside the tools (or models) themselves,
  thread-safe (a ``Counter``); :class:`CountingTool` is a stand-in tool that counts into one;
* :class:`RecordingOracle`: an oracle that records every context it is asked about (and every
  episode start) and answers with a fixed decision (accept) or a callable's;
* :class:`SwapModel`: a middleware that runs another model in the agent's place (a router's pick);
* :class:`GuardDriver`: drives a guard's gate and tool step without a graph, as the
  middleware does (before the model, gate, every call's tool step, state merged);
* :func:`assert_each_call_answered_once`: every proposed call has exactly one ToolMessage;
* :func:`check_oracle`: the conformance checks every oracle must pass.

A shared-budget store of your own has its suite beside the stores: ``check_budget_store`` and the
``ManualClock`` it moves leases with (:mod:`intent.stores.conformance`; both re-exported by
:mod:`intent.conformance`).
"""

from __future__ import annotations

import itertools
import json
import threading
import uuid
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from langchain.agents.middleware import AgentMiddleware
from langchain_core.language_models import BaseChatModel
from langchain_core.language_models.fake_chat_models import GenericFakeChatModel
from langchain_core.messages import AIMessage, AIMessageChunk, AnyMessage, BaseMessage, HumanMessage, ToolMessage
from langchain_core.outputs import ChatGeneration, ChatGenerationChunk, ChatResult
from langgraph.graph.message import add_messages
from langgraph.types import Command
from pydantic import ConfigDict, Field

from intent.errors import UsageError
from intent.guard import BudgetGuard
from intent.ledger import BudgetLedger, merge_ledger_states
from intent.market import Market, PricedTool
from intent.messages import tool_name
from intent.oracle import Decision, DecisionContext, EpisodeInfo, Oracle, Outcome, Proposal
from intent.state import LEDGER_KEY

__all__ = [
    "BilledChatModel",
    "CountingTool",
    "GuardDriver",
    "ModelRuns",
    "ReactiveToolModel",
    "RecordingOracle",
    "RunCounter",
    "ScriptedToolModel",
    "SwapModel",
    "TurnInfo",
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
    ``fail_on`` lists the executions (1-based, failed ones counted) that raise ``ConnectionError``
    instead of answering, as a provider's hiccup would; ``executions`` counts them all.
    """

    bound: list = []
    model_name: str = "scripted-model"  # what a model-price table prices it as
    fail_on: set = set()
    executions: list = []

    def bind_tools(self, tools: Sequence[Any], **kwargs: Any) -> ScriptedToolModel:
        # A dict schema may carry its name at the top, under "function" (OpenAI's form) or as a title
        # (what with_structured_output passes), or not at all.
        self.bound.append(sorted(_schema_name(t) for t in tools))
        return self

    def _generate(self, *args: Any, **kwargs: Any) -> Any:
        self.executions.append(len(self.executions) + 1)
        if len(self.executions) in self.fail_on:
            raise ConnectionError(f"provider hiccup (scripted failure of execution {len(self.executions)})")
        return super()._generate(*args, **kwargs)

    def _stream(self, messages: Any, stop: Any = None, run_manager: Any = None, **kwargs: Any) -> Any:
        # GenericFakeChatModel's stream cuts the content into word chunks and drops the message's tool calls,
        # so a streamed agent (stream_mode="messages") saw no call and ended. One chunk carries the whole
        # message instead, its calls as tool-call chunks (malformed ones with their raw arguments).
        message = self._generate(messages, stop=stop, run_manager=run_manager, **kwargs).generations[0].message
        calls = [{"name": c["name"], "args": json.dumps(c["args"]), "id": c["id"], "index": i,
                  "type": "tool_call_chunk"} for i, c in enumerate(message.tool_calls)]
        calls += [{"name": c.get("name"), "args": c.get("args"), "id": c.get("id"), "index": len(calls) + i,
                   "type": "tool_call_chunk"} for i, c in enumerate(message.invalid_tool_calls)]
        chunk = AIMessageChunk(content=message.content, id=message.id, tool_call_chunks=calls,
                               usage_metadata=message.usage_metadata, response_metadata=message.response_metadata,
                               additional_kwargs=message.additional_kwargs)
        if run_manager is not None:
            run_manager.on_llm_new_token(chunk.content if isinstance(chunk.content, str) else "",
                                         chunk=ChatGenerationChunk(message=chunk))
        yield ChatGenerationChunk(message=chunk)


class ModelRuns:
    """Executions of :class:`BilledChatModel` models, counted outside the guard: ``(model name, tokens
    in, tokens out)`` in order. Thread-safe. Not a dict, so that a model's pydantic field holds this
    very object (pydantic copies a dict)."""

    def __init__(self) -> None:
        self.log: list[tuple[str, int, int]] = []
        self._lock = threading.Lock()

    def hit(self, name: str, tokens_in: int, tokens_out: int) -> None:
        with self._lock:
            self.log.append((name, tokens_in, tokens_out))

    def names(self) -> list[str]:
        with self._lock:
            return [name for name, _, _ in self.log]

    def cost(self, prices: Any) -> float:
        """What the executions cost at ``prices`` (``{name: ModelPrice}``): what a provider billed."""
        with self._lock:
            return sum(prices[name].cost(i, o) for name, i, o in self.log)


class BilledChatModel(BaseChatModel):
    """A chat model whose executions are billed: it answers ``text`` reporting ``tokens`` (in, out) as
    ``usage_metadata`` and its name in ``response_metadata``, and logs each execution in ``runs``.

    ``fail``: raises ``ConnectionError`` before anything is generated (providers do not bill that; not
    logged). ``refuse``: answers with a refusal content block (billed). Streams three chunks, the usage
    on the last; the execution is logged (billed) when the stream starts.
    """

    model_config = ConfigDict(arbitrary_types_allowed=True)

    model_name: str
    runs: ModelRuns
    text: str = "done"
    tokens: tuple[int, int] = (10, 100)
    fail: bool = False
    refuse: bool = False

    @property
    def _llm_type(self) -> str:
        return "billed-fake"

    def bind_tools(self, tools: Sequence[Any], **kwargs: Any) -> BilledChatModel:
        return self

    def _usage(self) -> dict[str, int]:
        i, o = self.tokens
        return {"input_tokens": i, "output_tokens": o, "total_tokens": i + o}

    def _generate(self, messages: Any, stop: Any = None, run_manager: Any = None, **kwargs: Any) -> ChatResult:
        if self.fail:
            raise ConnectionError(f"{self.model_name} is down")
        self.runs.hit(self.model_name, *self.tokens)
        content: Any = [{"type": "refusal", "refusal": "no"}] if self.refuse else self.text
        return ChatResult(generations=[ChatGeneration(message=AIMessage(
            content, usage_metadata=self._usage(), response_metadata={"model_name": self.model_name}))])

    def _stream(self, messages: Any, stop: Any = None, run_manager: Any = None, **kwargs: Any) -> Any:
        if self.fail:
            raise ConnectionError(f"{self.model_name} is down")
        self.runs.hit(self.model_name, *self.tokens)
        for k in range(3):
            extra: dict[str, Any] = {"usage_metadata": self._usage()} if k == 2 else {}
            yield ChatGenerationChunk(message=AIMessageChunk(content=f"{self.text} {k} ", **extra))


class SwapModel(AgentMiddleware):
    """A middleware that runs ``model`` in place of the agent's (a router's pick, a custom fallback)."""

    def __init__(self, model: Any) -> None:
        super().__init__()
        self.model = model

    def wrap_model_call(self, request: Any, handler: Any) -> Any:
        return handler(request.override(model=self.model))

    async def awrap_model_call(self, request: Any, handler: Any) -> Any:
        return await handler(request.override(model=self.model))


class RunCounter(Counter[str]):
    """Real executions counted by name where they happen: inside the tools' bodies (or by
    :class:`ReactiveToolModel`, under its ``model_name``), never inferred from the guard's records.

    A ``Counter``, so ``runs == {"a": 2}``, ``runs["b"]`` (0 when it never ran) and ``runs.total()``
    work; :meth:`hit` counts under a lock (ToolNode runs parallel calls on threads). Pass the same
    object to every tool, or model, that should count into it::

        runs = RunCounter()

        def a(x: int = 0) -> str:
            runs.hit("a")
            return f"a={x}"
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._lock = threading.Lock()

    def hit(self, name: str) -> int:
        """Count one execution of ``name``; returns how many ``name`` has had, this one included."""
        with self._lock:
            self[name] += 1
            return self[name]


@dataclass(frozen=True)
class TurnInfo:
    """What :class:`ReactiveToolModel` tells its ``reply`` besides the messages.

    ``tools``: the names of the tools (or structured-output schemas) bound to this copy of the model,
    in the order given; ``execution``: this execution's number (1-based) under ``model_name`` in the
    model's ``runs``, failed ones included; ``model_name``: the model's."""

    tools: tuple[str, ...]
    execution: int
    model_name: str | None


class ReactiveToolModel(BaseChatModel):
    """A chat model that answers from the conversation so far: each execution calls
    ``reply(messages, info)`` with the messages it was given and a :class:`TurnInfo`, and answers
    what it returns (an ``AIMessage``, or a ``str`` for a plain answer). Use it where a fixed list
    (:class:`ScriptedToolModel`) cannot say the next step: a call per tool result, per fan-out branch,
    per human message, a tool selector answering with the schema it was bound, an emulated tool.

    * ``model_name`` names it as a price table does (``None``: a model without a name, as a custom one may be);
    * ``usage=(input_tokens, output_tokens)`` is reported as ``usage_metadata`` by every reply that has none;
    * tool calls without an id get a fresh one (as providers give ids);
    * ``runs``: every execution is counted there under ``model_name`` (``"reactive-fake"`` without one)
      before ``reply`` is called (a fresh
      :class:`RunCounter` by default; pass one to share it between models, or to keep it across copies);
    * ``fail_on``: the executions (numbered as in ``runs``) that raise ``ConnectionError`` instead of
      answering, as a provider's hiccup would; ``reply`` may raise too;
    * ``bind_tools`` returns a copy that knows the tools' names (``info.tools``) and binds the non-``None``
      keyword arguments as a provider's model does; every call's names are appended to ``bound``.

    Sync and async (``ainvoke`` runs the same ``reply`` on an executor thread); streamed, it yields the
    whole reply as one chunk (BaseChatModel's fallback), its tool calls included. ::

        def reply(messages, info):
            results = [m for m in messages if isinstance(m, ToolMessage)]
            return AIMessage("done") if len(results) >= 3 else ai(call("search", q=len(results)))

        model = ReactiveToolModel(reply=reply, usage=(10, 5))
    """

    model_config = ConfigDict(arbitrary_types_allowed=True)

    reply: Callable[[list[BaseMessage], TurnInfo], AIMessage | str]
    model_name: str | None = "reactive-model"
    usage: tuple[int, int] | None = None
    fail_on: frozenset[int] = frozenset()
    # Any: pydantic would copy a Counter (a dict) or a list given here, and the caller's object must be the one counted.
    runs: Any = Field(default_factory=RunCounter)
    tools: tuple[str, ...] = ()
    bound: Any = Field(default_factory=list)

    @property
    def _llm_type(self) -> str:
        return "reactive-fake"

    def bind_tools(self, tools: Sequence[Any], **kwargs: Any) -> Any:
        names = tuple(_bound_name(t) for t in tools)
        self.bound.append(sorted(names))
        copy = self.model_copy(update={"tools": names})
        extra = {k: v for k, v in kwargs.items() if v is not None}
        return copy.bind(**extra) if extra else copy

    def _generate(self, messages: list[BaseMessage], stop: Any = None, run_manager: Any = None,
                  **kwargs: Any) -> ChatResult:
        execution = self.runs.hit(self.model_name or self._llm_type)
        if execution in self.fail_on:
            raise ConnectionError(f"provider hiccup (scripted failure of execution {execution})")
        answer = self.reply(list(messages), TurnInfo(self.tools, execution, self.model_name))
        if isinstance(answer, str):
            answer = AIMessage(answer)
        if not isinstance(answer, AIMessage):
            raise TypeError(f"ReactiveToolModel's reply returned {type(answer).__name__}; return an AIMessage or a str")
        update: dict[str, Any] = {}
        if any(not c.get("id") for c in answer.tool_calls):
            update["tool_calls"] = [c if c.get("id") else {**c, "id": f"call_{next(_ids)}"} for c in answer.tool_calls]
        if self.usage is not None and answer.usage_metadata is None:
            i, o = self.usage
            update["usage_metadata"] = {"input_tokens": i, "output_tokens": o, "total_tokens": i + o}
        if update:
            answer = answer.model_copy(update=update)
        return ChatResult(generations=[ChatGeneration(message=answer)])


class RecordingOracle(Oracle):
    """An oracle that records what the guard asks it and answers as told.

    * :attr:`contexts`: every :class:`~intent.oracle.DecisionContext` it decided on, in order (sync and
      async: ``adecide`` is ``decide``); :attr:`episodes`: every :class:`~intent.oracle.EpisodeInfo` it was
      started with; :attr:`ended`: the episode ids its ``end`` hook was given (with ``end_hook=True``);
      :attr:`calls`: all of them in the order they came, as ``("start", info)``, ``("decide", ctx)``,
      ``("end", episode_id)``. Appended under a lock (parallel calls and fan-out branches decide on threads);
    * ``decision``: the :class:`~intent.oracle.Decision` for every call (accept by default), or a callable
      ``ctx -> Decision`` (which may raise, as a failing oracle does);
    * ``end_hook``: whether it has the optional ``end(episode_id)`` hook. Off by default: an oracle with one
      is started again when a fan-out branch revives an episode it was told ended, so recording it changes
      what the guard does. Its other hooks are :class:`~intent.oracle.Oracle`'s no-ops.

    It passes :func:`check_oracle`. ::

        oracle = RecordingOracle()
        guard = BudgetGuard(oracle, market, 10.0)
        ...
        assert [c.tool for c in oracle.contexts] == ["search", "fetch"]
    """

    name = "recording"

    def __init__(self, decision: Decision | Callable[[DecisionContext], Decision] | None = None, *,
                 end_hook: bool = False) -> None:
        self.decision = Decision.accepted() if decision is None else decision
        self.contexts: list[DecisionContext] = []
        self.episodes: list[EpisodeInfo] = []
        self.ended: list[str] = []
        self.calls: list[tuple[str, Any]] = []
        self._lock = threading.Lock()
        if not end_hook:
            self.end = None  # type: ignore[method-assign,assignment] # the guard looks for a callable end

    def decide(self, ctx: DecisionContext) -> Decision:
        with self._lock:
            self.contexts.append(ctx)
            self.calls.append(("decide", ctx))
        return self.decision(ctx) if callable(self.decision) else self.decision

    def start(self, episode: EpisodeInfo) -> None:
        with self._lock:
            self.episodes.append(episode)
            self.calls.append(("start", episode))

    def end(self, episode_id: str) -> None:
        with self._lock:
            self.ended.append(episode_id)
            self.calls.append(("end", episode_id))


def _bound_name(tool: Any) -> str:
    """A bound tool's or schema's name, as a provider sends it (a pydantic schema's class name too)."""
    name = _schema_name(tool)
    if not name:
        from langchain_core.utils.function_calling import convert_to_openai_tool

        name = convert_to_openai_tool(tool)["function"]["name"]
    return name


def _schema_name(tool: Any) -> str:
    return str(tool_name(tool) or (tool.get("title") if isinstance(tool, dict) else None) or "")


def scripted(messages: Iterable[AIMessage], *, model_name: str = "scripted-model",
             fail_on: Iterable[int] = ()) -> ScriptedToolModel:
    return ScriptedToolModel(messages=iter(list(messages)), bound=[], model_name=model_name, fail_on=set(fail_on),
                             executions=[])


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
    """Every tool call of every AIMessage, malformed ones included (the guard answers those with
    an error), has exactly one ToolMessage with its id, after it and before the next AIMessage;
    no ToolMessage answers nothing."""
    ai_idx = [i for i, m in enumerate(messages) if isinstance(m, AIMessage)]
    for k, i in enumerate(ai_idx):
        end = ai_idx[k + 1] if k + 1 < len(ai_idx) else len(messages)
        answers = [m.tool_call_id for m in messages[i + 1:end] if isinstance(m, ToolMessage)]
        ids = [c["id"] for c in [*messages[i].tool_calls, *messages[i].invalid_tool_calls]]  # type: ignore[union-attr]
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
    the turn is the AIMessage's index among the AIMessages, the records' ``step`` (so ``messages``
    is the whole history, not one a summariser rewrote)."""
    turns = [m for m in messages if isinstance(m, AIMessage)]
    proposed = Counter((step, c["id"]) for step, m in enumerate(turns) for c in [*m.tool_calls, *m.invalid_tool_calls])
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
        # As the graph's messages channel does: a message with an id already there replaces it (the gate's
        # copy of a message it rewrote: merged or renamed calls).
        self.state["messages"] = add_messages(self.state["messages"], messages)
        return messages

    def step(self, message: AIMessage, run_tool: Callable[[Any], Any] | None = None) -> list[ToolMessage]:
        from langgraph.prebuilt.tool_node import ToolCallRequest

        self.apply(self.guard.prepare(self.state, self.config))
        # With an id, as the guard's middleware gives a model's message (the gate keys calls by it, and merges
        # identical calls and renames reused ids only in a message that has one).
        self.state["messages"] = add_messages(self.state["messages"], [message if message.id else message.model_copy(
            update={"id": f"lc_{uuid.uuid4()}"})])
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


# ------------------------------------------------------------------ check_oracle
# The conformance suite every oracle must pass (documented in :mod:`intent.conformance`).
_EPS = 1e-9


class CountingTool:
    """A stand-in tool that counts its real executions by name (what the guard cannot fake): into a
    :class:`RunCounter` (its own lock), or a plain ``Counter`` under ``lock``."""

    def __init__(self, name: str, runs: Counter[str], lock: threading.Lock | None = None) -> None:
        self.name = name
        self.runs = runs
        self._lock = lock or threading.Lock()

    def invoke(self, tool_input: Any, config: Any = None, **_: Any) -> ToolMessage:
        if isinstance(self.runs, RunCounter):
            self.runs.hit(self.name)
        else:
            with self._lock:
                self.runs[self.name] += 1
        call_id = tool_input["id"] if isinstance(tool_input, dict) and "id" in tool_input else ""
        return ToolMessage(f"{self.name} ran", tool_call_id=call_id, name=self.name)


def _run_coroutine(coro: Any) -> Any:
    """Run ``coro`` to its end, also from inside a running event loop (on a thread of its own)."""
    import asyncio
    from concurrent.futures import ThreadPoolExecutor

    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    with ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, coro).result()


def _check_hook_result(hook: str, value: Any) -> None:
    """What the guard does with each hook's result, as types: a wrong one crashes a run, or worse, passes."""
    if hook == "visible_tools":
        assert value is None or (isinstance(value, (list, tuple, set, frozenset)) and all(
            isinstance(n, str) for n in value)), (
            f"visible_tools() returned {value!r:.80}; return None (every tool) or a list of tool names")
    elif hook in ("prompt_notes", "result_note"):
        assert value is None or isinstance(value, str), f"{hook}() returned {type(value).__name__}; return a str or None"


def check_oracle(factory: Callable[[], Any], *, budget: float = 30.0) -> None:
    if not callable(factory) or (not isinstance(factory, type) and hasattr(factory, "decide")):  # an oracle itself
        raise UsageError(f"check_oracle takes a factory that makes the oracle (called once per episode it drives), "
                         f"got {type(factory).__name__} {factory!r:.60}; pass the class, or lambda: MyOracle(...)")
    market = Market([PricedTool("cheap", 4), PricedTool("mid", 11), PricedTool("pricey", 26)])
    oracle = factory()
    if not callable(getattr(oracle, "decide", None)):
        raise UsageError(f"check_oracle's factory made {type(oracle).__name__} {oracle!r:.60}, which has no decide(ctx) "
                         "method: an oracle decides each priced call (subclass intent.Oracle, or write "
                         "decide(self, ctx) -> Decision)")
    ctx = DecisionContext("conf-1", "q", Proposal("c0", "cheap", {"x": 1}, "I need x"), 4.0, budget, 0.0, budget,
                          market, step=0, history=[HumanMessage("q"), AIMessage("I need x", tool_calls=[
                              {"name": "cheap", "args": {"x": 1}, "id": "c0", "type": "tool_call"}])],
                          batch=(Proposal("c0", "cheap", {"x": 1}, "I need x"),))
    if hasattr(oracle, "start"):
        oracle.start(EpisodeInfo("conf-1", "q", budget, market))
    decision = oracle.decide(ctx)
    assert isinstance(decision, Decision), f"decide() returned {type(decision).__name__}, not Decision"
    adecide = getattr(oracle, "adecide", None)
    if callable(adecide):
        answer = _run_coroutine(adecide(ctx))
        assert isinstance(answer, Decision), f"adecide() returned {type(answer).__name__}, not Decision"
    outcome = Outcome("conf-1", ctx.proposal, 4.0, "ok", "{}", 4.0, budget - 4, budget)
    for hook, args in (("visible_tools", (market, "conf-1")), ("prompt_notes", (market, "conf-1", 0.0, budget, budget)),
                       ("result_note", (outcome,)), ("observe", (outcome,))):
        fn = getattr(oracle, hook, None)
        if callable(fn):
            _check_hook_result(hook, fn(*args))

    # Adversarial episode: every turn proposes all three tools in parallel (41 > budget when
    # budget = 30), 8 turns, through the guard's real gate and tool step, as the middleware
    # drives them. The tools count their own runs.
    runs = RunCounter()
    tools = {name: CountingTool(name, runs) for name in market.names}
    guard = BudgetGuard(factory(), market, budget)
    driver = GuardDriver(guard, thread_id="conf-2", query="spend it all", tools=tools)

    def answered_elsewhere(request: Any) -> ToolMessage:
        # Stands for a middleware inside the guard that answers without running the tool:
        # the guard must not charge it and must give its reservation back.
        c = request.tool_call
        if c["name"] == "cheap":
            return ToolMessage("served from a cache", tool_call_id=c["id"], name=c["name"])
        return GuardDriver._run(request)

    for turn in range(8):
        calls = [{"name": n, "args": {"x": turn}, "id": f"t{turn}-{n}", "type": "tool_call"} for n in market.names]
        driver.step(AIMessage("buy everything", tool_calls=calls), run_tool=answered_elsewhere if turn % 2 else None)
        ran = sum(runs[n] * market.price(n) for n in market.names)  # the market never changes here
        assert ran <= budget + _EPS, (
            f"turn {turn}: the tools ran for {ran:g} ({dict(runs)}) but the budget is {budget:g}: overspent")
        spent = driver.ledger.spent
        assert abs(spent - ran) <= _EPS, (
            f"turn {turn}: the tools ran for {ran:g} ({dict(runs)}) but the ledger charged {spent:g}")
    driver.finish()
    ledger = driver.ledger
    assert ledger.reserved <= _EPS, f"{ledger.reserved:g} still reserved after the episode ended"
    assert_each_call_answered_once(driver.state["messages"])
