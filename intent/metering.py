"""One guarded tool call at the tool step: every run of the tool is priced, reserved and charged.

The guard cannot know where it sits in a middleware stack. A retry middleware inside it
calls the tool several times through one ``wrap_tool_call``; a retry middleware outside
calls the guard several times; a reviewer's edit inside it swaps the tool. So the guard
hands the rest of the chain a :class:`MeteredTool` (in ``request.tool`` and in
``request.runtime.tools``, where HumanInTheLoopMiddleware resolves a redirected tool): the
charge happens where the tool really runs, whatever wraps it.

Per run: validate the model's arguments, re-price from the current market, re-ask the
oracle if the call was edited, reserve (the first run uses the gate's reservation, each
further run a new one under ``key#n``), run, and commit what the provider billed.
A run that does not fit is answered with a refusal ToolMessage and never runs.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal, NamedTuple

from langchain_core.messages import AIMessage, AnyMessage, ToolMessage
from langchain_core.tools import ToolException
from langgraph.errors import GraphBubbleUp, ParentCommand
from langgraph.types import Command

from intent import feedback as fb
from intent.errors import InvalidBillError

PAYMENT_REQUIRED = "payment_required"  # a tool answered with its price instead of serving the call
from intent.ledger import BudgetExceededError, BudgetLedger
from intent.lifecycle import episode_of, follow
from intent.market import UnpricedToolError, payment_required
from intent.nesting import _CURRENT, close_carves, draws_on_store, enter_spending, spending_scope
from intent.off_loop import off_loop
from intent.messages import (
    argument_problem,
    billed_amount,
    call_key,
    find_call,
    is_result_list,
    json_artifact,
    messages_of,
    model_args,
    raised_bill,
    result_message,
    text_of,
    turns_before,
    with_update,
)
from intent.oracle import (
    BAD_ARGUMENTS,
    BANNED_TOOL,
    OVER_BUDGET,
    UNKNOWN_TOOL,
    UNPRICED_TOOL,
    Decision,
    DecisionContext,
    InvalidDecisionError,
    Outcome,
    Proposal,
)
from intent.state import LEDGER_KEY, channel_of, missing_channel_error, task_free_ns
from intent.tool_body import WatchedBody, as_message, watched
from intent.top_ups import channel_base

if TYPE_CHECKING:
    from langgraph.prebuilt.tool_node import ToolCallRequest

    from intent.episodes import Episode
    from intent.guard import BudgetGuard

__all__ = ["CallRun", "MeteredTool", "open_call"]

REFUSED_RUN = "refused_run"
ANSWERED_WITHOUT_RUN = "answered_without_run"
CANCELLED = "cancelled"
CANCELLED_BEFORE_RUN = "cancelled_before_run"  # the run was cancelled before the tool's body started
RAISED_BEFORE_RUN = "raised_before_run"  # a validator of the tool's own raised on the arguments (not charged)
LATE_BILL = "late_bill"  # what a cancelled sync tool's thread billed above its charge, when it ended
NOT_GATED = "not_gated"  # a refusal at the tool step of a call the gate never decided (added after it)
ORACLE_BUG = "oracle_bug"  # the oracle crashed deciding an edited call again: not run (the bug is raised after)
# Set on an exception an oracle raised that is not a recoverable failure (intent.guard marks it), so that the
# tool step, where an edited call is re-gated, treats it as the oracle's bug even with tool_errors="message".
ORACLE_BUG_MARK = "_intent_oracle_bug"


def is_oracle_bug(exc: BaseException) -> bool:
    return bool(getattr(exc, ORACLE_BUG_MARK, False))


_NO_LEASE = contextlib.nullcontext()  # reusable: entering it does nothing


def _copy_with(obj: Any, **changes: Any) -> Any:
    """``dataclasses.replace(obj, **changes)`` for the request and runtime of every tool call, by
    copying the instance's ``__dict__``: ``replace`` reads the fields and runs ``__init__`` (for
    ``ToolCallRequest``, a ``__setattr__`` per field that imports ``warnings`` and checks
    ``hasattr`` twice), about 5 us per call. Falls back to ``replace`` for a class with a
    ``__post_init__`` or without a ``__dict__``, where a copy would skip what ``__init__`` does."""
    cls = type(obj)
    fields = _copyable_fields(cls)
    if fields is None or not hasattr(obj, "__dict__") or not changes.keys() <= fields.keys():
        return dataclasses.replace(obj, **changes)
    new = object.__new__(cls)
    new.__dict__.update(obj.__dict__)
    new.__dict__.update(changes)
    return new


@functools.lru_cache(maxsize=64)
def _copyable_fields(cls: type) -> Any:
    """The dataclass fields of ``cls`` when :func:`_copy_with` may copy its instances (a dataclass
    without a ``__post_init__``), else ``None``. Read once per class (two tool-call classes, in
    practice): looking for a missing ``__post_init__`` on a class raises and clears an
    AttributeError inside ``hasattr`` on every call."""
    fields = getattr(cls, "__dataclass_fields__", None)
    return None if fields is None or hasattr(cls, "__post_init__") else fields


def _lease(ledger: Any, charge_id: str) -> Any:
    """A context manager that renews ``charge_id``'s lease in the ledger's shared budget store while
    the call runs (a no-op without a store: the common case, so nothing is made for it)."""
    shared = ledger.shared
    if shared is None:
        return _NO_LEASE
    from intent.stores import LeaseKeeper

    store, key, run_id = shared
    entry = ledger.get(charge_id)
    return LeaseKeeper(store, key, entry.store_id if entry and entry.store_id else f"{run_id}/{charge_id}")


def _handled(body: WatchedBody | None) -> BaseException | None:
    """What a watched body raised when its tool still answered (LangChain's ``handle_tool_error``)."""
    if body is not None and body.finished and isinstance(body.result, Exception):
        return body.result
    return None


def open_call(guard: BudgetGuard, request: ToolCallRequest) -> CallRun | ToolMessage:
    """The metered run of ``request``'s call, or a refusal if the gate never reserved it."""
    call = request.tool_call
    cid, name = call["id"], call["name"]
    state = request.state
    channel = channel_of(state)
    messages = messages_of(state)  # a dict, or a Pydantic model / dataclass state
    index, ai = find_call(messages, cid)
    if not channel or ai is None or not channel.get("episode_id"):
        if not channel and ai is not None:
            _check_channel_kept(guard, request, call_key(ai, index, cid))
        return ToolMessage(fb.not_gated(name), tool_call_id=cid, name=name, status="error")
    # (A fork or replay of the thread runs on its checkpoint's ledger: intent.lineage.)
    config = getattr(request.runtime, "config", None)
    episode = follow(guard, guard.episodes.get(str(episode_of(channel, config)), channel), channel, config)
    key = call_key(ai, index, cid)
    decisions = channel.get("decisions") or {}
    if key not in decisions and key not in episode.ledger:
        key = _rebuilt_call_key(episode, channel, messages, index, ai, cid) or key
    meta = dict(decisions.get(key) or {})
    if meta and not meta.get("accept", True):
        # The gate refused it; the answer is given here, where exactly one answer is given.
        return ToolMessage(str(meta.get("feedback") or fb.generic_rejection(name)), tool_call_id=cid, name=name,
                           status="error", artifact={"intent_reason": meta.get("reason", "")})
    if key not in episode.ledger:
        # A call the gate never decided: a middleware added it to the model's message, or gave it another id,
        # after the gate (an after_model hook rewriting the calls). Refused here, unrun and free; this refusal
        # is the call's one answering log record (the gate wrote none for it), as for every other refusal: once,
        # though a resume runs the step again.
        text = fb.not_gated(name)
        proposed = next((c for c in ai.tool_calls if c.get("id") == cid), call)
        if episode.first_record(NOT_GATED, key):
            guard.records.refusal(
                episode.ledger, episode_id=episode.episode_id,
                step=turns_before(messages, index, channel.get("turns")), query=episode.task(channel, messages),
                reasoning=text_of(ai), call_id=cid, tool=name, args=dict(proposed.get("args") or {}), price=None,
                kind="invalid", reason=NOT_GATED, text=text,
                market_version=guard.market_for(episode.episode_id, channel).version)
        return ToolMessage(text, tool_call_id=cid, name=name, status="error", artifact={"intent_reason": NOT_GATED})
    return CallRun(guard, episode, key, request, meta, messages, ai, channel)


def _check_channel_kept(guard: BudgetGuard, request: ToolCallRequest, key: str) -> None:
    """A call the gate reserved that reaches the tools with no ledger channel in state: the graph's state
    schema lacks the channel (LangGraph drops the keys a schema lacks). A configuration error, said as one,
    rather than every call refused as never approved. (Known only when the run has a thread id: without
    one the episode's name was in the channel too.)"""
    config = getattr(request.runtime, "config", None) or {}
    thread = (config.get("configurable") or {}).get("thread_id") if isinstance(config, Mapping) else None
    episode = guard.episodes.peek(str(thread)) if thread is not None else None
    if episode is not None and key in episode.ledger:
        raise missing_channel_error()


def _rebuilt_call_key(episode: Episode, channel: Mapping[str, Any], messages: Sequence[AnyMessage], index: int,
                      ai: AIMessage, cid: str) -> str | None:
    """The gated call that a middleware outside the guard re-made after the gate: it returned the
    model's message rebuilt, with another id (or none, and add_messages gave it one), so the message
    the gate decided never reached the history.

    The running call takes over the call of the same id in the last message the gate decided when
    that message is nowhere in the history and the running call's message sits where the gated one
    would have (the same place in the history, the latest AIMessage). A later message the guard
    never saw that reuses the id (a cache outside the guard answering a model step itself) sits
    further on, and is refused as never approved. The metered run re-gates the call if its tool or
    arguments changed, as it does a reviewer's edit. The gated call must not have run yet (a history
    cut down by a summariser can put a later message in that same place), unless this very call took
    it over before: an outer retry.
    """
    taken = episode.rebuilt.get((str(ai.id), cid))
    if taken is not None:
        return taken
    turns = channel.get("turns") or {}
    last_id = turns.get("last_id")
    if not last_id or ai.id == last_id or turns.get("at") != index:
        return None
    if any(isinstance(m, AIMessage) for m in messages[index + 1:]):
        return None  # not the latest turn's message
    if any(getattr(m, "id", None) == last_id for m in messages):
        return None  # the gated message is in the history: this is another message
    key = f"{last_id}:{cid}"
    if key not in (channel.get("decisions") or {}):
        return None
    gated = episode.ledger.get(key)
    if gated is not None and not (gated.status == "reserved" and gated.execution == 0):
        return None  # the gated call has run (or was released): this message is a later one
    with episode.lock:
        episode.rebuilt[(str(ai.id), cid)] = key
    return key


class MeteredTool:
    """A tool whose every run goes through :class:`CallRun` (everything else is the tool's own)."""

    __slots__ = ("_run", "_tool")

    def __init__(self, tool: Any, run: CallRun) -> None:
        self._tool = tool
        self._run = run

    def __getattr__(self, name: str) -> Any:
        return getattr(self._tool, name)

    def invoke(self, input: Any, config: Any = None, **kwargs: Any) -> Any:  # noqa: A002 - BaseTool's name
        return self._run.execute(self._tool, input, config, kwargs)

    async def ainvoke(self, input: Any, config: Any = None, **kwargs: Any) -> Any:  # noqa: A002
        return await self._run.aexecute(self._tool, input, config, kwargs)

    def __repr__(self) -> str:
        return f"MeteredTool({self._tool!r})"


@functools.cache
def _tool_call_request() -> type:
    from langgraph.prebuilt.tool_node import ToolCallRequest

    return ToolCallRequest


@functools.cache
def _metered_request_class() -> type:
    """``ToolCallRequest`` whose ``override(tool=...)`` meters the tool it is given (made once, on first use:
    langgraph.prebuilt is not imported with intent)."""
    base = _tool_call_request()

    class MeteredToolCallRequest(base):  # type: ignore[misc, valid-type]
        """The request the guard hands the rest of the chain: a tool put in with ``override`` runs metered
        (priced, re-gated if it is not the approved tool, reserved and charged), like ``request.tool``."""

        def override(self, **overrides: Any) -> Any:
            run = self.__dict__.get("_intent_run")
            tool = overrides.get("tool")
            if run is not None and tool is not None and not isinstance(tool, MeteredTool):
                overrides["tool"] = MeteredTool(tool, run)
            new = super().override(**overrides)
            if run is not None:
                new.__dict__["_intent_run"] = run
            return new

    return MeteredToolCallRequest


@functools.cache
def _fast_classes() -> tuple[type | None, type, type | None]:
    """``ToolCallRequest``, its metered subclass and ``ToolRuntime``, each ``None`` where
    :meth:`CallRun.metered_request`'s direct copy would not equal :func:`_copy_with`'s (a class
    with a ``__post_init__``, or whose fields are not the ones copied)."""
    from langgraph.prebuilt.tool_node import ToolRuntime

    request = _tool_call_request()
    fields = _copyable_fields(request)
    runtime_fields = _copyable_fields(ToolRuntime)
    # (``__dictoffset__``: instances with a ``__dict__``, which the direct copy reads, as _copy_with requires.)
    return (request if fields is not None and {"tool", "runtime"} <= fields.keys() and request.__dictoffset__
            else None,
            _metered_request_class(),
            ToolRuntime if runtime_fields is not None and "tools" in runtime_fields and ToolRuntime.__dictoffset__
            else None)


def _metered_tools(tools: Sequence[Any], run: CallRun) -> _MeteredTools:
    """``_MeteredTools(tools, run)`` without a Python ``__init__`` (list's own, in C, fills it)."""
    metered = _MeteredTools(tools)
    metered._run = run
    return metered


class _MeteredTools(list):  # type: ignore[type-arg]
    """``runtime.tools`` as a middleware inside the guard sees it (HumanInTheLoopMiddleware
    picks a reviewer's redirected tool from there): each tool metered, wrapped when read, so
    an agent with fifty tools does not pay fifty wrappers on every call. A list of the tools
    themselves underneath, so that LangChain serialising the runtime (with a tool's input) sees
    the ``list[BaseTool]`` it declares instead of warning."""

    _run: CallRun  # set by _metered_tools, which makes them

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, slice):
            return [MeteredTool(t, self._run) for t in super().__getitem__(index)]
        return MeteredTool(super().__getitem__(index), self._run)

    def __iter__(self) -> Iterator[Any]:
        run = self._run
        return (MeteredTool(t, run) for t in super().__iter__())

    def pop(self, index: Any = -1) -> Any:
        return MeteredTool(super().pop(index), self._run)

    def __reversed__(self) -> Iterator[Any]:
        run = self._run
        return (MeteredTool(t, run) for t in super().__reversed__())

    # Every way of getting the tools out gives metered ones, once (a copy of metered tools is not
    # wrapped again): a plain list of them.
    def _metered(self) -> list[Any]:
        return list(self.__iter__())

    def copy(self) -> list[Any]:
        return self._metered()

    def __copy__(self) -> list[Any]:
        return self._metered()

    def __deepcopy__(self, memo: dict[int, Any]) -> list[Any]:
        return self._metered()  # the tools themselves are not copied (nor is the run that meters them)

    def __add__(self, other: Any) -> list[Any]:
        return self._metered() + list(other)

    def __radd__(self, other: Any) -> list[Any]:
        return list(other) + self._metered()

    def __mul__(self, n: Any) -> list[Any]:
        return self._metered() * n

    __rmul__ = __mul__

    def __repr__(self) -> str:
        return f"MeteredTools({list(super().__iter__())!r})"


def _args_of(tool: Any, tool_input: Any) -> Any:
    """The model's arguments of a run: what LangGraph injected (a ToolRuntime, the state) left out, so
    that records, re-gates and oracles see what the model proposed."""
    # ``type(...) is dict`` first: the usual input, without an ABC isinstance check.
    mapping = type(tool_input) is dict or isinstance(tool_input, Mapping)
    if mapping and tool_input.get("type") == "tool_call":
        return model_args(tool, tool_input.get("args") or {})
    return model_args(tool, tool_input) if mapping else {"input": tool_input}


class _Regate(NamedTuple):
    """An edited call's run waiting for the oracle (:meth:`CallRun._admit`): the context it is asked
    with (its ``price`` the run's) and the market version the run was priced at."""

    ctx: DecisionContext
    version: int


def _tool_error_answer(exc: ToolException, flag: Any) -> str:
    """What a tool with ``handle_tool_error=flag`` answers for ``exc`` (LangChain's rule, in
    ``langchain_core.tools.base._handle_tool_error``): the exception's message, the flag's text, or the flag's
    answer to it."""
    if isinstance(flag, bool):
        content = exc.args[0] if exc.args else "Tool execution error"
    elif isinstance(flag, str):
        content = flag
    else:
        content = flag(exc)
    return content if isinstance(content, str) else str(content)


class CallRun:
    """The runs of one proposed call within one ``wrap_tool_call`` of the guard."""

    def __init__(
        self, guard: BudgetGuard, episode: Episode, key: str, request: ToolCallRequest, meta: dict[str, Any],
        messages: Sequence[AnyMessage], ai: AIMessage, channel: Mapping[str, Any] | None = None,
    ) -> None:
        self.guard, self.episode, self.key, self.request, self.meta = guard, episode, key, request, meta
        self.channel = channel  # the ledger channel the tool step was given (request.state's), when known
        self.tool_call_id: str = request.tool_call["id"]
        self.name: str = request.tool_call["name"]
        self.messages = messages
        self._ai = ai
        self.last_outcome: Outcome | None = None
        # The (tool, model's arguments) of the latest edited run the oracle accepted on a re-gate: a further run of
        # exactly that call (a retry) is not asked again. A refused re-gate licenses nothing: the next run of the
        # edit (a retry middleware inside the guard, one that retries on an error answer) is re-gated again.
        self.regated: tuple[str, Any] | None = None
        self.refused = False  # a run was refused: its record already says why the reservation went unused
        self.raised: list[BaseException] = []  # what the tool's own runs raised (tool_errors="message" answers those)

    # Read only for a log record or an edited call's re-gate, so not computed on every run.
    @functools.cached_property
    def query(self) -> str:
        return self.episode.task(channel_of(self.request.state), self.messages)

    @functools.cached_property
    def reasoning(self) -> str:
        return text_of(self._ai)

    # ------------------------------------------------------------------ request
    def metered_request(self) -> ToolCallRequest:
        request = self.request
        fast = _fast_classes()
        if type(request) is fast[0]:
            # What the general way below makes of ToolNode's own request and runtime, made directly: the
            # copy is made an instance of the metered class at once (no ``__class__`` assignment, no
            # ``is_dataclass``, no check per copy of what ``_copyable_fields`` says once per class).
            metered = object.__new__(fast[1])
            fields = metered.__dict__
            fields.update(request.__dict__)
            if request.tool is not None:
                fields["tool"] = MeteredTool(request.tool, self)
            runtime = request.runtime
            tools = getattr(runtime, "tools", None)
            if tools and type(runtime) is fast[2]:
                copied = object.__new__(fast[2])
                copied.__dict__.update(runtime.__dict__)
                copied.__dict__["tools"] = _metered_tools(tools, self)
                fields["runtime"] = copied
            elif tools and dataclasses.is_dataclass(runtime):
                fields["runtime"] = _copy_with(runtime, tools=_metered_tools(tools, self))
            fields["_intent_run"] = self
            return metered
        overrides: dict[str, Any] = {}
        if request.tool is not None:
            overrides["tool"] = MeteredTool(request.tool, self)
        runtime = request.runtime
        tools = getattr(runtime, "tools", None)
        if tools and dataclasses.is_dataclass(runtime):
            overrides["runtime"] = _copy_with(runtime, tools=_metered_tools(tools, self))
        # request.override(**overrides), which is dataclasses.replace for these keys (not "state")
        metered = _copy_with(request, **overrides)  # a copy even without overrides: its class changes below
        if type(metered) is _tool_call_request():
            # A middleware inside the guard that hands the tool step a tool of its own (LangChain's
            # dynamic-tool pattern: request.override(tool=added_tool)) gets it metered as well.
            object.__setattr__(metered, "__class__", _metered_request_class())
            metered.__dict__["_intent_run"] = self
        return metered

    # --------------------------------------------------------------- one run
    def _context(self, name: str, args: Mapping[str, Any], price: float) -> DecisionContext:
        ledger = self.episode.ledger
        return DecisionContext(
            episode_id=self.episode.episode_id, query=self.query,
            proposal=Proposal(self.tool_call_id, name, dict(args), self.reasoning), price=price,
            budget=ledger.budget, spent=ledger.spent, remaining=ledger.remaining,
            market=self.guard.market_for(self.episode.episode_id), step=int(self.meta.get("step", -1)),
            history=self.messages,
        )

    def _edited(self, name: str, args: Mapping[str, Any], tool: Any) -> bool:
        """Whether the call about to run is neither the one the gate approved nor one an earlier run's re-gate
        approved (a reviewer's edit, arguments a middleware rewrote)."""
        if "tool" not in self.meta:
            return False
        approved = self.regated
        if approved is not None and name == approved[0] and model_args(tool, args) == approved[1]:
            return False
        if name != self.meta["tool"]:
            return True
        gated = self.meta.get("args") or {}
        return args != gated and model_args(tool, args) != model_args(tool, gated)

    def _price(self, tool: Any, args: Any) -> tuple[float, int] | ToolMessage:
        name = tool.name
        try:
            problem = argument_problem(tool, args)
        except Exception as exc:
            # A validator of the tool's own raised what pydantic does not wrap (a KeyError, a TypeError): the
            # tool's run would raise it before its body starts. As without the guard, and free: a tool that
            # turns its ToolException into an answer (handle_tool_error) answers this one too, as LangChain does
            # when the input is parsed; anything else is raised unchanged (retries and handle_tool_errors see
            # it; tool_errors="message" answers it, charged nothing). The gate's reservation goes back.
            flag = getattr(tool, "handle_tool_error", False)
            if flag and isinstance(exc, ToolException):
                return self._refuse(name, args, None, "invalid", BAD_ARGUMENTS, _tool_error_answer(exc, flag))
            self.raised.append(exc)
            ledger = self.episode.ledger
            with self.episode.lock:
                released = ledger.release_held(self.key)  # None on a retry's run: the first one gave it back
            if released is not None:
                self.guard.records.release(ledger, released, episode_id=self.episode.episode_id, meta=self.meta,
                                           reason=RAISED_BEFORE_RUN)
            raise
        if problem is not None:
            return self._refuse(name, args, None, "invalid", BAD_ARGUMENTS, fb.invalid_call(name, problem))
        market = self.guard.market_for(self.episode.episode_id)
        if name in market.banned:
            return self._refuse(name, args, None, "invalid", BANNED_TOOL, fb.banned_tool(name))
        try:
            return market.price(name), market.version
        except UnpricedToolError as exc:
            reason = UNPRICED_TOOL if name in market else UNKNOWN_TOOL
            return self._refuse(name, args, None, "invalid", reason, fb.unpriced_tool(name, str(exc)))

    def _reserve(self, name: str, args: Any, price: float, version: int) -> str | ToolMessage:
        """Hold the money for the next run. Returns its charge id, or the refusal."""
        episode, ledger = self.episode, self.episode.ledger
        with episode.lock:
            gated = ledger.get(self.key)
            if (gated is not None and gated.status == "reserved" and gated.execution == 0 and ledger.shared is None
                    and len(ledger._by_call.get(self.key, ())) == 1 and abs(price - gated.amount) <= 1e-12
                    and name == gated.tool and not ledger.halted):
                # The first run of a call as the gate reserved it (nearly every run): what the general way below
                # does then (no run before it, the gate's reservation used as it is, no store to refuse the run),
                # without counting the call's charges.
                ledger.mark_run(self.key, 1)
                return self.key
            runs = 0  # (a loop, not sum(<genexpr>): no generator made on every run)
            for e in ledger.charges_of(self.key):
                if e.execution > 0:
                    runs += 1
            gated = ledger.get(self.key)
            shared_refused = False
            try:
                if gated is not None and gated.status == "reserved" and gated.execution == 0:
                    if ledger.halted:
                        # Reserved at the gate, but a call of the same batch has since been billed
                        # above its quote: money already held does not license a run any more.
                        raise BudgetExceededError(f"call {self.key!r}: spending stopped by an overrun")
                    charge_id = self.key
                    if abs(price - gated.amount) > 1e-12 or name != gated.tool:
                        ledger.reprice(charge_id, price, tool=name, market_version=version)
                else:
                    # A charge id of its own: one already in the ledger (a run of this call that never started,
                    # released with its number: a hedged twin cancelled before its body, a run the store had no room
                    # for) would make ``reserve`` return that entry unchanged, released, and the run would go on
                    # holding nothing and fail to commit (LedgerError), unpaid.
                    n = runs + 1
                    while f"{self.key}#{n}" in ledger:
                        n += 1
                    charge_id = f"{self.key}#{n}"
                    ledger.reserve(charge_id, name, price, market_version=version, tool_call_id=self.tool_call_id)
                try:
                    # A shared budget gives the run a store charge of its own, which must still fit there.
                    ledger.mark_run(charge_id, runs + 1)
                except BudgetExceededError:
                    if charge_id != self.key:
                        ledger.release(charge_id)  # this retry's own reservation (the gate's waits for finish)
                    shared_refused = True
                    raise
            except BudgetExceededError:
                if shared_refused:
                    # The shared budget (a store other runs draw on) has no room left for this run.
                    text = fb.over_budget(name, price, ledger.remaining_for("tool"), ledger.budget)
                elif ledger.blocking_overrun > 0:
                    text = fb.overrun_stop(name, ledger.blocking_overrun)
                elif runs:
                    text = fb.retry_over_budget(name, price, ledger.remaining, ledger.budget, runs + 1)
                elif gated is not None and gated.status == "reserved":
                    text = fb.repriced_over_budget(name, gated.amount, price, ledger.remaining + gated.amount,
                                                   ledger.budget)
                else:
                    text = fb.over_budget(name, price, ledger.remaining, ledger.budget)
                return self._refuse(name, args, price, "reject", OVER_BUDGET, text)
            return charge_id

    def _refuse(self, name: str, args: Any, price: float | None, kind: Literal["reject", "invalid"], reason: str,
                text: str, decision: Decision | None = None) -> ToolMessage:
        self.refused = True
        self.guard.records.refusal(
            self.episode.ledger, episode_id=self.episode.episode_id, step=int(self.meta.get("step", -1)),
            query=self.query, reasoning=self.reasoning, call_id=self.tool_call_id, tool=name, args=args, price=price,
            kind=kind, reason=reason, text=text, market_version=self.guard.market_for(self.episode.episode_id).version,
            decision=decision,
        )
        return ToolMessage(text, tool_call_id=self.tool_call_id, name=name, status="error",
                           artifact={"intent_reason": reason})

    def _regate(self, decision: Decision | BaseException, ctx: DecisionContext) -> ToolMessage | None:
        checked = self.guard.check_decision(decision, ctx)  # raises an oracle's crash
        # Only an acceptance marks the edited call as re-gated: a retry middleware inside the guard that
        # swallowed the oracle's crash, or retried its refusal, must not run the call undecided.
        if checked.accept:
            self.regated = (ctx.tool, dict(ctx.args))
            return None
        return self._refuse(ctx.tool, ctx.args, ctx.price, "reject", checked.reason,
                            checked.feedback or fb.generic_rejection(ctx.tool), checked)

    def _oracle_bug(self, exc: Exception, ctx: DecisionContext) -> ToolMessage:
        """The oracle crashed re-gating an edited call (a bug, not a recoverable failure): the call does not
        run, and the bug is raised at the episode's next model step or its end (:meth:`_defer`), not here,
        inside the tool's run, where a retry middleware would take it for the tool's failure."""
        if not (is_oracle_bug(exc) or isinstance(exc, InvalidDecisionError)):
            raise exc
        self._defer(exc)
        return self._refuse(ctx.tool, ctx.args, ctx.price, "reject", ORACLE_BUG, fb.oracle_bug(ctx.tool, exc))

    def _defer(self, exc: BaseException) -> None:
        with self.episode.lock:
            if self.episode.oracle_bug is None:
                self.episode.oracle_bug = exc

    def _admit(self, tool: Any, args: Any) -> str | ToolMessage | _Regate:
        """Price, then reserve: the charge id or the refusal. An edited call is re-gated first: then
        the context for the oracle is returned (a :class:`_Regate`), and :meth:`_admit_decided` goes on
        with the oracle's decision.

        Written once and driven by :meth:`execute` (sync oracle) and :meth:`aexecute` (async oracle).
        (Not a generator: the run of an unedited call, every run but a reviewer's edit, then
        needs no generator nor the StopIteration that ends it.)
        """
        priced = self._price(tool, args)
        if isinstance(priced, ToolMessage):
            return priced
        price, version = priced
        if self._edited(tool.name, args, tool):
            return _Regate(self._context(tool.name, model_args(tool, args), price), version)
        return self._reserve(tool.name, args, price, version)

    def _admit_decided(self, tool: Any, args: Any, regate: _Regate, decision: Decision | BaseException
                       ) -> str | ToolMessage:
        """:meth:`_admit` of an edited call, once the oracle has decided it again."""
        ctx = regate.ctx
        refusal = self._regate(decision, ctx)
        if refusal is not None:
            return refusal
        return self._reserve(tool.name, args, ctx.price, regate.version)

    def execute(self, tool: Any, tool_input: Any, config: Any, kwargs: dict[str, Any]) -> Any:
        args = _args_of(tool, tool_input)
        charge_id = self._admit(tool, args)
        if type(charge_id) is _Regate:
            try:
                charge_id = self._admit_decided(tool, args, charge_id, self.guard.decide(charge_id.ctx))
            except Exception as exc:
                charge_id = self._oracle_bug(exc, charge_id.ctx)
        if isinstance(charge_id, ToolMessage):
            return charge_id
        started = self.guard._clock()
        # A tool that turns its ToolException into a message (handle_tool_error) runs as a copy whose body
        # says what it raised: a bill on that exception is what the run is charged (intent.tool_body).
        body = None
        if getattr(tool, "handle_tool_error", False):
            watch = watched(tool, sync=True)
            if watch is not None:
                tool, body = watch
        out = self._invoke(tool, tool_input, config, kwargs, charge_id, args, started)
        self._charge(charge_id, args, out, started, handled=_handled(body))
        return out

    def _invoke(self, tool: Any, tool_input: Any, config: Any, kwargs: dict[str, Any], charge_id: str, args: Any,
                started: float) -> Any:
        """The sync run of a reserved call: the tool's answer, or what it raised, charged (or aborted) and
        re-raised. The answer itself is charged by the caller (:meth:`execute`, and the lean run's)."""
        try:
            # Sub-agents carve from this call (spending_scope, entered and left here without a `with`: this runs
            # on every tool call); a shared budget's lease is renewed while it runs (no `with` without one).
            scope = enter_spending(self.guard, self.episode, self.key, config)
            try:
                if self.episode.ledger.shared is None:  # (what _lease tells by returning _NO_LEASE)
                    return tool.invoke(tool_input, config, **kwargs)
                with _lease(self.episode.ledger, charge_id):
                    return tool.invoke(tool_input, config, **kwargs)
            finally:
                _CURRENT.reset(scope)
        except ParentCommand as handoff:
            # The body finished and a graph it ran handed control to a graph above (its node returned
            # Command(graph=Command.PARENT)): the run happened, unlike an interrupt's, which re-runs.
            self._charge(charge_id, args, handoff.args[0], started)
            raise
        except GraphBubbleUp:
            self._abort(charge_id)
            raise
        except BaseException as exc:
            self.raised.append(exc)
            self._charge(charge_id, args, exc, started)
            raise

    async def aexecute(self, tool: Any, tool_input: Any, config: Any, kwargs: dict[str, Any]) -> Any:
        ledger = self.episode.ledger
        if draws_on_store(ledger):
            return await self._aexecute_on_store(tool, tool_input, config, kwargs)
        args = _args_of(tool, tool_input)
        charge_id = self._admit(tool, args)
        if type(charge_id) is _Regate:
            try:
                charge_id = self._admit_decided(tool, args, charge_id, await self.guard.adecide(charge_id.ctx))
            except Exception as exc:
                charge_id = self._oracle_bug(exc, charge_id.ctx)
        if isinstance(charge_id, ToolMessage):
            return charge_id
        started = self.guard._clock()
        # A copy of the tool that says whether its body started: a cancelled run is charged by what ran
        # (intent.tool_body).
        watch = watched(tool)
        body = None
        if watch is not None:
            tool, body = watch
        try:
            with spending_scope(self.guard, self.episode, self.key, config), _lease(self.episode.ledger, charge_id):
                out = await tool.ainvoke(tool_input, config, **kwargs)
        except ParentCommand as handoff:
            self._charge(charge_id, args, handoff.args[0], started)  # a handoff: the run happened (execute)
            raise
        except GraphBubbleUp:
            self._abort(charge_id)
            raise
        except asyncio.CancelledError as exc:
            self.raised.append(exc)
            if body is None:
                self._charge(charge_id, args, exc, started)  # money spent is spent: the reservation
            else:
                self._cancelled(body, tool, charge_id, args, exc, started)
            raise
        except BaseException as exc:
            self.raised.append(exc)
            self._charge(charge_id, args, exc, started)
            raise
        self._charge(charge_id, args, out, started, handled=_handled(body))
        return out

    async def _aexecute_on_store(self, tool: Any, tool_input: Any, config: Any, kwargs: dict[str, Any]) -> Any:
        """:meth:`aexecute` on a shared budget store: what reaches the store (the run's reservation, its charge,
        the lease's last renewal) runs in a thread, not on the event loop (intent.off_loop); the tool and the
        oracle run on the loop. The same steps in the same order as :meth:`aexecute`."""
        args = _args_of(tool, tool_input)
        charge_id = await off_loop(self._admit, tool, args)
        if type(charge_id) is _Regate:
            try:
                charge_id = await off_loop(self._admit_decided, tool, args, charge_id,
                                           await self.guard.adecide(charge_id.ctx))
            except Exception as exc:
                charge_id = self._oracle_bug(exc, charge_id.ctx)
        if isinstance(charge_id, ToolMessage):
            return charge_id
        started = self.guard._clock()
        watch = watched(tool)
        body = None
        if watch is not None:
            tool, body = watch
        try:
            with spending_scope(self.guard, self.episode, self.key, config):
                lease = _lease(self.episode.ledger, charge_id)  # (none for a carve's charge: not in the store)
                lease.__enter__()
                try:
                    out = await tool.ainvoke(tool_input, config, **kwargs)
                finally:
                    await off_loop(lease.__exit__, None, None, None)  # joins a renewal that may wait on the store
        except ParentCommand as handoff:
            await off_loop(self._charge, charge_id, args, handoff.args[0], started)
            raise
        except GraphBubbleUp:
            await off_loop(self._abort, charge_id)
            raise
        except asyncio.CancelledError as exc:
            self.raised.append(exc)
            if body is None:
                await off_loop(self._charge, charge_id, args, exc, started)
            else:
                await off_loop(self._cancelled, body, tool, charge_id, args, exc, started)
            raise
        except BaseException as exc:
            self.raised.append(exc)
            await off_loop(self._charge, charge_id, args, exc, started)
            raise
        await off_loop(functools.partial(self._charge, charge_id, args, out, started, handled=_handled(body)))
        return out

    def _cancelled(self, body: WatchedBody, tool: Any, charge_id: str, args: Any, exc: BaseException,
                   started: float) -> None:
        """A run cancelled from outside, charged by what its body did (see :mod:`intent.tool_body`)."""
        with body.lock:  # the body's thread reads `cancelled` under it: the charge below comes first
            body.cancelled = True
            if not body.started:
                self._not_run(charge_id)
            elif body.finished:
                self._charge(charge_id, args, as_message(tool, body.result, self.tool_call_id), started,
                             reason=CANCELLED)
            else:
                self._charge(charge_id, args, exc, started)
                if body.in_thread:
                    body.on_late = functools.partial(self._late_bill, tool, charge_id, args, started)

    def _not_run(self, charge_id: str) -> None:
        """Cancelled before the tool's body started: it never runs, and its reservation goes back."""
        ledger = self.episode.ledger
        with self.episode.lock:
            if charge_id == self.key:
                ledger.mark_run(charge_id, 0)
            released = ledger.release(charge_id)
        if released is not None and charge_id == self.key:
            self.guard.records.release(ledger, released, episode_id=self.episode.episode_id, meta=self.meta,
                                       reason=CANCELLED_BEFORE_RUN)

    def _late_bill(self, tool: Any, charge_id: str, args: Any, started: float, result: Any) -> None:
        """A sync body that went on in its thread after its run was cancelled (and charged its
        reservation) has ended: a bill above that charge is taken as an overrun, and logged."""
        answer = as_message(tool, result, self.tool_call_id)
        try:
            billed = raised_bill(answer) if isinstance(answer, BaseException) else billed_amount(answer, self.tool_call_id)
        except InvalidBillError:
            billed = None  # a malformed bill from a run nobody waits for: the reservation stands
        ledger = self.episode.ledger
        late = ledger.bill_late(charge_id, billed) if billed is not None else None
        if late is None:
            return
        # The run that owed it may have ended (its state written, the episode dropped here): the thread's next
        # run in this process takes it in and writes it to state.
        self.guard.episodes.post_late(self.episode, late)
        status: Literal["ok", "error"] = "error" if isinstance(answer, BaseException) or getattr(
            answer, "status", "success") == "error" else "ok"
        self.guard.records.execution(
            ledger, late, episode_id=self.episode.episode_id, meta=self.meta, query=self.query,
            reasoning=self.reasoning, args=args, observation=fb.billed_after_cancel(self.name, billed),
            status=status, tool_ms=(self.guard._clock() - started) * 1000.0, artifact=None, reason=LATE_BILL)

    def _abort(self, charge_id: str) -> None:
        """An interrupt inside the tool: it did not finish and re-runs on resume."""
        ledger = self.episode.ledger
        if charge_id == self.key:
            ledger.mark_run(charge_id, 0)  # the gate's reservation waits for the re-run
        else:
            ledger.release(charge_id)

    def _charge(self, charge_id: str, args: Any, result: Any, started: float, reason: str | None = None,
                handled: BaseException | None = None) -> None:
        """Commit one run's charge and log it. ``handled``: the exception the tool's body raised when
        the tool answered with a message instead (``handle_tool_error``): its bill, if it has one."""
        tool_ms = (self.guard._clock() - started) * 1000.0
        guard, ledger = self.guard, self.episode.ledger
        message: ToolMessage | None = None
        bad_bill: Exception | None = None
        if isinstance(result, BaseException):
            try:
                billed = raised_bill(result)
            except InvalidBillError as exc:
                bad_bill, billed = exc, None  # the run happened: charge the quote, then fail loudly
            status: Literal["ok", "error"] = "error"
            if isinstance(result, asyncio.CancelledError):
                reason = CANCELLED
        else:
            message = result_message(result, self.tool_call_id)
            # The message's artifact, read once: billed_amount(message) and payment_required(artifact) read it,
            # and an answer without one (every tool call of most agents) needs neither.
            artifact = getattr(message, "artifact", None)
            try:
                billed = billed_amount(message, self.tool_call_id) if artifact is not None else None
                if billed is None and handled is not None:
                    billed = raised_bill(handled)
            except InvalidBillError as exc:
                # The tool's bill is malformed: the run happened, so charge the quote, then fail loudly.
                bad_bill, billed = exc, None
            required = payment_required(artifact, self.name) if artifact is not None else None
            if required is not None:
                # An x402-style "payment required" answer: the call was not served, so it is not
                # billed, and the market learns the tool's price for the calls that follow.
                billed, reason = 0.0, PAYMENT_REQUIRED
                guard.learn_price(self.episode.episode_id, self.name, *required)
            status = "error" if getattr(message, "status", "success") == "error" else "ok"
        entry = ledger.commit(charge_id, billed)
        # What the run returned, as text, is built only for a log record or an oracle that reads it.
        # (guard._has_hook's cached answers read first: False for both on nearly every guard)
        hooks = guard._hooks
        wants_outcome = ((hooks.get("observe") is not False and guard._has_hook("observe"))
                         or (hooks.get("result_note") is not False and guard._has_hook("result_note")))
        if guard.records.sink is not None or wants_outcome:
            if isinstance(result, asyncio.CancelledError):
                observation = fb.cancelled(self.name)
            elif isinstance(result, BaseException):
                observation = fb.tool_raised(self.name, result)
            else:
                observation = text_of(message) if message is not None else text_of(result)
            guard.records.execution(
                ledger, entry, episode_id=self.episode.episode_id, meta=self.meta, query=self.query,
                reasoning=self.reasoning, args=args, observation=observation, status=status, tool_ms=tool_ms,
                artifact=json_artifact(message), reason=reason,
            )
            if wants_outcome:
                snap = ledger.snapshot()
                outcome = Outcome(self.episode.episode_id, Proposal(self.tool_call_id, entry.tool, dict(args), ""),
                                  entry.amount, status, observation, snap["spent"], snap["remaining"], snap["budget"])
                self.last_outcome = outcome
                try:
                    guard._call_hook("observe", outcome)
                except Exception as exc:  # the oracle's bug, not the tool's failure: raised at the next model step
                    self._defer(exc)
        if bad_bill is not None:
            raise bad_bill from (result if isinstance(result, BaseException) else None)

    # ------------------------------------------------------------ the answer
    def _raised_by_the_tool(self, exc: BaseException) -> bool:
        """Whether ``exc`` is (or was raised ``from``) an exception of the tool's own run, not of a
        middleware inside the guard (its bug, or its own failure: a classifier that is down)."""
        seen: set[int] = set()
        cur: BaseException | None = exc
        while cur is not None and id(cur) not in seen:
            if any(cur is r for r in self.raised):
                return True
            seen.add(id(cur))
            # Only an explicit chain (``raise X from the_tools_error``): an exception a middleware raised
            # while handling the tool's error (implicit ``__context__``) is that middleware's own.
            cur = cur.__cause__
        return False

    def failed(self, exc: Exception) -> ToolMessage:
        """Something inside the guard raised: with ``tool_errors="message"``, the tool's own error is
        answered with a message saying what the call cost; anything else is re-raised."""
        if self.guard.tool_errors == "raise" or not self._raised_by_the_tool(exc):
            raise exc
        charged = sum(e.amount for e in self.episode.ledger.charges_of(self.key)
                      if e.status == "committed" and e.execution > 0)
        return ToolMessage(fb.tool_raised(self.name, exc, charged), tool_call_id=self.tool_call_id, name=self.name,
                           status="error")

    def handed_off(self, handoff: ParentCommand) -> ParentCommand:
        """The handoff a run raised (:meth:`execute`), once the call is closed as :meth:`finish` closes it.
        When its command is for the graph this tool step runs in (LangGraph then applies it as the step's
        output), it carries the call's charges, and its answer gets the oracle's note, as a returned
        ``Command`` would; a command for a graph further up goes on unchanged (that graph's state has no
        ledger channel of this episode): its charges stay in the working ledger and the log."""
        command = handoff.args[0]
        config = getattr(self.request.runtime, "config", None) or {}
        here = str((config.get("configurable") or {}).get("checkpoint_ns") or "")
        if isinstance(command, Command) and command.graph and command.graph in (here, task_free_ns(here)):
            return ParentCommand(self.finish(command))
        self.finish(None)
        return handoff

    def finish(self, result: Any) -> Any:
        """The call's answer with every charge of the call, and its unused reservation released."""
        episode, ledger = self.episode, self.episode.ledger
        if episode.carves:  # (close_carves' own test, without the call on every tool call)
            close_carves(episode, self.key)  # a sub-agent that did not end its episode: its spend is kept
        with episode.lock:
            gated = ledger.get(self.key)
            if gated is not None and gated.status == "reserved" and gated.execution == 0:
                released = ledger.release(self.key)
                assert released is not None
                if not self.refused:
                    self.guard.records.release(ledger, released, episode_id=episode.episode_id, meta=self.meta,
                                               reason=ANSWERED_WITHOUT_RUN)
            entries = ledger.charges_of(self.key)
        message = result_message(result, self.tool_call_id)
        if message is None and not isinstance(result, Command) and not is_result_list(result):
            message = ToolMessage(text_of(result), tool_call_id=self.tool_call_id, name=self.name)
        if message is not None and self.last_outcome is not None:
            try:
                note = self.guard._call_hook("result_note", self.last_outcome)
            except Exception as exc:  # raised at the next model step: an outer retry would run the tool again
                note = None
                self._defer(exc)
            if note:
                message = message.model_copy(update={"content": f"{text_of(message)}\n{note}"})
        charges = {}
        for e in entries:  # (a loop, not a dict comprehension: no function made per tool call)
            charges[e.call_id] = ledger.serialized(e)
        written: dict[str, Any] = {"entries": charges}
        seen = self.channel
        if (seen is None or "episode_id" not in seen or "budget" not in seen or "allow_overspend" not in seen
                or type(ledger) is not BudgetLedger or ledger.caps):
            # The channel's fixed keys along with the charges. Left out when the channel the step was given has
            # them: the reducer keeps the first value written of each (merge_ledger_states), and the channel only
            # gains keys, so writing them again changes nothing; a smaller write is a cheaper merge on every call.
            # (A carved ledger's carve id and sub-caps, which merge otherwise, are always written.)
            written = channel_base(episode) | written
        return with_update(result, self.tool_call_id, message, {LEDGER_KEY: written})
