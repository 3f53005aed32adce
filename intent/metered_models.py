"""Models that other middleware call, charged to the same budget: ``guard.metered_model(model)``.

SummarizationMiddleware's summariser, LLMToolSelectorMiddleware's selector, LLMToolEmulator's
model, or a middleware of your own call a model of their own, outside the agent's model call
that the guard wraps, so their tokens would escape the budget. Give them a metered copy::

    summariser = guard.metered_model(ChatOpenAI(model="gpt-4o-mini"))
    agent = create_agent(model, tools, middleware=[
        SummarizationMiddleware(model=summariser, trigger=("tokens", 4000)), guard.middleware()])

Each execution of the copy is priced as the agent's own model is (:mod:`intent.model_meter`:
the worst case reserved before it runs, the usage committed after it, released when it fails
unbilled, one log record each, ``unpriced_model`` and ``missing_usage`` applied), in the
episode of the graph run it is called in:

* inside the guard's model step (a middleware listed after the guard), the step's episode;
* inside one of the guard's tool runs (a tool that calls the model, or a sub-agent the tool starts:
  deepagents' ``task``), the tool call's episode;
* otherwise the episode is the one the running task's state names (its ledger channel, read with
  :func:`intent.state.read_ledger_channel`); a process that has not seen the thread yet loads
  it from that state first, so a thread resumed in another process, where the summariser runs
  before the guard's first hook, keeps what it spent before;
* a state with no ledger yet is a new episode: the thread's (``thread_id``), which the guard's
  own first model step then continues. A run with neither a thread nor a ledger (no
  ``thread_id``, before the guard's first model step: a selector listed before the guard, a
  summariser on a long first input) cannot be placed;
* where the state cannot be read (a LangGraph without the task-local reader, a graph without the
  guard's ledger channel), the thread's episode as this process loaded it from state; otherwise it
  cannot be placed.

A call that does not fit, or cannot be placed, is not made: :class:`MeteredModelRefused` is
raised from the model's ``invoke``. It is a non-retryable ``langchain_core`` ``ModelError``, so a
middleware's ``with_retry`` does not retry it, and the run stops with it (SummarizationMiddleware
does not catch its model's errors). A charge goes into graph state with the writes of the task that
made it (LangGraph's task-local writer, as ``langgraph.graph.message.push_message`` uses), so a run
that dies after that task keeps it; a charge paid from a tool call's episode (inside a tool run)
reaches the parent's state at the parent guard's next hook.

Inside a guard's model step with a price table the step's meter charges every chat-model run, and this
callback defers to it (a copy used as the agent's model, another guard's copy, a parent's copy in a
sub-agent: each charged once, by the step); the step also drops it from the agent's model copy it meters
(``replaced_by_guard_meter``), for runs in a thread that did not carry the context.

An async call of the copy (``ainvoke``, ``astream``, ``astream_events``) whose guard may wait on a shared budget
store runs on a copy of it that also carries the callback's async twin (:class:`intent.model_meter._AsyncMeterCallback`,
the one the guard's model step uses), ahead of it: the twin places and reserves the run, and commits it, in a worker
thread (:mod:`intent.off_loop`), and the callback, called next, finds it begun. A blocking ``invoke`` (a sync
callback manager, even inside an async step) gets no twin: the callback meters it inline, as without a store.
"""

from __future__ import annotations

import asyncio
import functools
import threading
import weakref
from collections.abc import Mapping
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any, NamedTuple

from langchain_core.callbacks import BaseCallbackHandler
from langchain_core.exceptions import ModelError
from langchain_core.messages import BaseMessage

from intent import dropped_streams
from intent.episodes import RUNNING_EPISODE
from intent.model_meter import (
    MAX_TOKEN_KEYS,
    _AsyncMeterCallback,
    METERED_MODEL,
    ModelCallMeter,
    ModelCallRefused,
    _batch_of,
    callback_handlers,
    is_output_event,
    partial_output,
    signalling_limiter,
    step_meter,
)
from intent.nesting import current_parent
from intent.off_loop import off_loop
from intent.state import (branch_of, branch_stamp, current_config, read_ledger_channel, read_state_messages, task_of,
                          write_ledger_update)
from intent.top_ups import channel_base

if TYPE_CHECKING:
    from intent.episodes import Episode
    from intent.guard import BudgetGuard

__all__ = ["METERED_MODEL", "MeteredModelCallback", "MeteredModelRefused", "Placement", "episode_of_run",
           "metered_copy"]



# The runs an agenerate call of a metered copy has started (see _watched_class).
_STARTED: ContextVar[list[Any] | None] = ContextVar("intent_metered_runs_started", default=None)


class _StreamStart(list[tuple[Any, Any, Any]]):
    """The runs a v3 stream's start began; ``over`` once the start is: the producer task, which inherits this
    context, may start runs of its own (a model calling another), watched as any other."""

    over = False


# The (callback, run id) pairs an astream_events(version="v3") stream's start has begun: watched by the
# stream's producer task, not by the task reading the stream (see _producer_watched).
_STREAM_STARTING: ContextVar[_StreamStart | None] = ContextVar("intent_v3_stream_starting", default=None)


class MeteredModelRefused(ModelCallRefused, ModelError):
    """An execution of a metered model that the budget does not cover, or that no episode can pay
    for; it is not made. Not retryable (``is_retryable``): LangChain's retries give up at once."""

    is_retryable = False


class Placement(NamedTuple):
    """Where a metered execution is paid from."""

    episode: Episode
    channel: Mapping[str, Any] | None  # the episode's ledger channel as the running task's state has it
    in_state: bool  # the running task's graph state holds this episode's ledger: its charges go there too


def episode_of_run(guard: BudgetGuard, config: Mapping[str, Any] | None) -> Placement:
    """The episode the running graph task spends from, its ledger channel as state has it, and
    whether that state is the episode's.

    Raises :class:`MeteredModelRefused` when no episode can be named (see the module's doc).
    """
    thread_id = ((config or {}).get("configurable") or {}).get("thread_id")
    readable, channel = read_ledger_channel(config)
    running = RUNNING_EPISODE.get()
    if running is not None and running[0] is guard:
        # Inside this guard's model step (a middleware listed after it): the step's episode, named
        # even on a run's first step, when state does not name it yet.
        episode = guard.episodes.peek(running[1])
        if episode is not None:
            same = channel is not None and guard.episode_of(channel, config) == running[1]
            return Placement(episode, channel if same else None, readable)
    parent = current_parent()
    if parent is not None and parent.guard is guard:
        # Inside one of this guard's tool runs (a tool calling the model, a sub-agent started by the
        # tool, with or without a guard of its own): the tool call's episode pays. Its ledger is in the
        # parent's graph state, not this task's: the parent's next hook writes the charge there.
        return Placement(parent.episode, None, False)
    if channel and parent is not None and channel.get("episode_id") in (parent.episode.episode_id,
                                                                         parent.episode.source or None):
        # A sub-agent's state copied from its parent's, before this guard's first step replaced the
        # ledger (intent.guard.BudgetGuard.inherits_parent_ledger): not this guard's ledger.
        channel = None
    # In a part of the graph run as a subgraph (maybe one of parallel branches of the thread: a Send fan-out),
    # an episode its siblings ended in this step of the top graph is taken up, not made afresh with the whole
    # budget; the execution is a visitor of it while it runs (MeteredModelCallback), so that no branch's
    # settling releases its reservation.
    branch = branch_of(config)
    revive: dict[str, Any] = {"stamp": branch_stamp(config, branch)} if branch else {}
    if channel and channel.get("episode_id"):
        episode = guard.episodes.get(str(guard.episode_of(channel, config)), channel, **revive)
        episode.ledger.catch_up(channel)  # kept here from an earlier run while another process spent
        return Placement(episode, channel, True)
    if readable and thread_id is not None:
        # No ledger in state yet: a new episode, named as the guard's first model step will name it
        # (a sub-agent's after the call that started it), so that step continues it.
        return Placement(guard.episodes.get(guard.episode_id(None, config), **revive), None, True)
    if not readable and thread_id is not None:
        episode = guard.episodes.peek(str(thread_id))
        if episode is not None and episode.synced:  # loaded from state here: its spending is known
            return Placement(episode, None, False)
    if config is None:
        where = "outside a graph run"
    elif thread_id is None:
        where = ("in a run without a thread_id before the guard's first model step (the episode has no name "
                 "yet); invoke with config={'configurable': {'thread_id': ...}}")
    else:
        where = (f"in thread {thread_id!r}, whose graph state this LangGraph does not let a model callback "
                 "read, before the guard loaded it in this process")
    raise MeteredModelRefused(f"a model metered by the guard was called {where}: no budget can pay for it, so "
                              "it is not made")


class MeteredModelCallback(BaseCallbackHandler):
    """Reserves each execution before it runs and charges it after, in the running episode.

    Runs in line with the model (``run_inline``) and its refusal propagates (``raise_error``).
    """

    raise_error = True
    run_inline = True
    replaced_by_guard_meter = True  # intent.model_meter.ModelCallMeter.instrument drops it

    def __init__(self, guard: BudgetGuard, model: Any) -> None:
        self.guard, self.model = guard, model
        # By the execution's run id: its meter, the task's config when the charge goes into its state, and the
        # graph task visiting the episode while it runs.
        self._meters: dict[Any, tuple[ModelCallMeter, Mapping[str, Any] | None, str]] = {}
        # By run id, for an async call: the asyncio task that made it, and the done-callback put on it.
        self._callers: dict[Any, tuple[asyncio.Task[Any], Any]] = {}
        self._lock = threading.Lock()
        # Runs the async twin claimed (claim) and begins: the sync start that follows the twin's skips them once.
        self._claimed: set[Any] = set()
        # Its async twin, on the runs of an async call when the guard's budget may wait on a store (_twinned).
        self.twin = _AsyncMeterCallback(self)

    def on_chat_model_start(self, serialized: dict[str, Any], messages: list[list[BaseMessage]], *, run_id: Any,
                            metadata: dict[str, Any] | None = None, **kwargs: Any) -> None:
        if step_meter() is not None:
            # Inside a guard's model step with a price table (a middleware listed after that guard, the
            # agent's own model, a sub-agent's model): the step's meter charges every execution there,
            # once, to the step's episode (a sub-agent's carve). Another guard's copy is paid there too.
            return
        with self._lock:
            if run_id in self._claimed:
                self._claimed.discard(run_id)
                return  # begun by the async twin, in a worker thread (an async call on a store, see _twinned)
            reused = run_id in self._meters
        if reused:
            # A run_id the caller passed in config, of an execution still open (a stream kept or dropped unread):
            # skipped, this execution went unmetered and its end closed the other one's charge.
            raise MeteredModelRefused(f"run_id {run_id} is already the id of an execution of this metered model "
                                      "that has not ended; pass a fresh run_id in the config (or none)")
        self.begin(run_id, [m for batch in messages for m in batch], serialized, metadata, kwargs)
        self.begun(run_id)

    # ----------------------------------------- what the async twin calls (intent.model_meter.TwinnedCallback)
    def claim(self, run_id: Any) -> bool:
        with self._lock:
            if step_meter() is not None or run_id in self._meters or run_id in self._claimed:
                return False  # (a reused run_id: refused by the sync start, next)
            self._claimed.add(run_id)
            return True

    def begin(self, run_id: Any, flat: list[BaseMessage], serialized: dict[str, Any],
              metadata: dict[str, Any] | None, kwargs: Mapping[str, Any], completion: bool = False) -> Any:
        """Place the run and reserve its worst case (raises :class:`MeteredModelRefused`); may wait on the
        store. Returns the execution now before its rate limiter, if any (``ModelCallMeter.start``)."""
        try:
            return self._begin(run_id, flat, serialized, metadata, kwargs, completion)
        except BaseException:
            with self._lock:
                self._claimed.discard(run_id)  # (refused: no sync start follows the twin's)
            raise

    def _begin(self, run_id: Any, flat: list[BaseMessage], serialized: dict[str, Any],
               metadata: dict[str, Any] | None, kwargs: Mapping[str, Any], completion: bool) -> Any:
        dropped_streams.settle()
        config = current_config()
        episode, channel, in_state = episode_of_run(self.guard, config)
        source = str((metadata or {}).get("lc_source") or "")  # LangChain's middleware name their calls
        turns = (channel or {}).get("turns") or {}
        meter = ModelCallMeter(self.guard, episode, step=int(turns.get("total") or 0),
                               query=episode.task(channel, (read_state_messages(config) if in_state else None) or flat),
                               model=self.model,
                               charge_reason=f"{METERED_MODEL}:{source}" if source else METERED_MODEL)
        # The graph task calling the model visits the episode while the execution runs (before the reservation,
        # which is then tagged with the task), so that no branch's settling releases what it holds.
        task = task_of(config)
        if task:
            episode.visit(task)
        batch = _batch_of(kwargs)
        try:
            waiting = meter.start(run_id, flat, kwargs.get("invocation_params") or {}, metadata, serialized,
                                  own=True, batch=batch, completion=completion)
        except BaseException as exc:
            if task:
                episode.unvisit(task)
            if batch is not None:
                self._release_batch(batch)  # a multi-prompt generate() sends none of its prompts now
            if isinstance(exc, ModelCallRefused) and not isinstance(exc, MeteredModelRefused):
                raise MeteredModelRefused(str(exc)) from exc  # logged by meter.start; re-raised as non-retryable
            raise
        with self._lock:
            self._meters[run_id] = (meter, config if in_state else None, task)
        started = _STARTED.get()
        if started is not None:
            started.append(run_id)  # for agenerate's cancellation (_watched_class)
        return waiting

    def begun(self, run_id: Any) -> None:
        """Watch the task that made the call (on its loop, if any)."""
        meter = self._meter_of(run_id)
        if meter is None:
            return  # (ended already)
        starting = _STREAM_STARTING.get()
        if starting is not None and not starting.over:
            # A v3 event stream's run: its producer task, made once this start is over, runs it and reports
            # its end, possibly after the reader (this task) is done (_producer_watched).
            starting.append((self, run_id, meter))
            return
        try:
            caller = asyncio.current_task()
        except RuntimeError:  # no event loop in this thread: a sync call, which ends or errs in its callbacks
            caller = None
        if caller is not None:
            # The fallback for a cancellation agenerate does not see (astream cancelled before LangChain's
            # try, waiting on a rate limiter): a run still open when the task that made it is done.
            self.watch(run_id, meter, caller)

    def _meter_of(self, run_id: Any) -> ModelCallMeter | None:
        with self._lock:
            return self._meters.get(run_id, (None, None, ""))[0]

    def watch(self, run_id: Any, meter: ModelCallMeter, task: asyncio.Task[Any], *, queue: bool = False) -> None:
        """Charge the run (its execution ``meter``: a later execution under the same run id is not this one) as a
        cancelled one if it is still open when ``task``, which runs it, is done; with ``queue``, at the next metered
        run or guard hook instead (:mod:`intent.dropped_streams`)."""
        done = functools.partial(self._stream_done if queue else self._caller_done, run_id, meter)
        task.add_done_callback(done)
        with self._lock:
            self._callers[run_id] = (task, done)

    def is_open(self, run_id: Any) -> bool:
        return run_id in self._meters

    def not_sent(self, run_id: Any, exc: BaseException) -> None:
        with self._lock:
            self._claimed.discard(run_id)  # (the twin's start cancelled: no sync start follows it)
        meter, _, task = self._take(run_id)
        if meter is None:
            return
        try:
            meter.not_sent(run_id, exc)  # released: nothing to write into state
        finally:
            if task:
                meter.episode.unvisit(task)

    def _forget_caller(self, run_id: Any) -> None:
        """The run is over: its caller's done-callback goes (a long-lived task calling the model many times
        does not collect one per call)."""
        with self._lock:
            caller, done = self._callers.pop(run_id, (None, None))
        if caller is None or caller.done():
            return  # (a done task has run its callbacks: nothing to remove, and its loop may be closed by now)
        loop = caller.get_loop()
        try:
            on_loop = asyncio.get_running_loop() is loop
        except RuntimeError:
            on_loop = False
        if on_loop:
            caller.remove_done_callback(done)
        else:  # (ended by the async twin in a worker thread: the task is its loop's to touch)
            loop.call_soon_threadsafe(caller.remove_done_callback, done)

    def _caller_done(self, run_id: Any, meter: ModelCallMeter, _caller: Any) -> None:
        # Charged as a cancelled call is; the task's writes are over: the guard's next settle writes it to state.
        # This runs on the event loop: a guard that reaches a store charges it at the next safe point, off the loop
        # (its commit would hold up every task on the loop while it waits on the store).
        if self.guard.reaches_store():
            if self._meter_of(run_id) is meter:
                dropped_streams.queue([(self, run_id, meter)])
            return
        self._cancelled(run_id, write=False, meter=meter)

    def _stream_done(self, run_id: Any, meter: ModelCallMeter, _producer: Any) -> None:
        # A v3 stream's producer is done with the run still open: LangChain closes a run whose producer it
        # cancelled before it ran (aclose's on_llm_error, which comes after this callback, through the twin, off
        # the loop for a store); one it did not close is charged at the next safe point, not here on the loop.
        if self._meter_of(run_id) is meter:
            dropped_streams.queue([(self, run_id, meter)])

    def _release_batch(self, batch: Any) -> None:
        """The runs of a multi-prompt ``generate()`` started before one of its prompts was refused: not sent."""
        with self._lock:
            runs = [(rid, m, t) for rid, (m, _, t) in self._meters.items()]
        for rid, meter, task in runs:
            if meter.release_batch(batch):
                self._take(rid)
                if task:
                    meter.episode.unvisit(task)

    def _take(self, run_id: Any, only: ModelCallMeter | None = None
              ) -> tuple[ModelCallMeter | None, Mapping[str, Any] | None, str]:
        """The run's meter, config and visiting task, no longer open (nor watched by its caller's task); with
        ``only``, just when the open execution under ``run_id`` is that one (a run id may be given again once its
        first execution has ended: a watch or queued entry of the first must leave the second alone)."""
        with self._lock:
            open_now = self._meters.get(run_id)
            if open_now is not None and only is not None and open_now[0] is not only:
                return None, None, ""  # (a later execution's: its caller's watch is its own too)
            taken = self._meters.pop(run_id, (None, None, ""))
        self._forget_caller(run_id)
        return taken

    def _cancelled(self, run_id: Any, *, write: bool = True, meter: ModelCallMeter | None = None) -> None:
        """Charge the open execution ``run_id`` (only when it is ``meter``, if given) as a cancelled one."""
        meter, config, task = self._take(run_id, only=meter)
        if meter is None:
            return  # ended or failed in its callbacks (or the run id is a later execution's now)
        try:
            # The request reached the provider, which bills what it generated (unknown): the reserved worst
            # case is charged (intent.model_meter).
            meter.error(run_id, asyncio.CancelledError("the model call was cancelled"))
        finally:
            if task:
                meter.episode.unvisit(task)
        # Without a task's writes to carry it (write=False: that task is over), the guard's next settle writes it to
        # state, and if the run has ended meanwhile (its episode dropped here), the thread's next run here takes it
        # in (_write's post_late). Without this a charge made after the run (a dropped stream collected later) was
        # released there as unused.
        self._write(meter, config if write else None)

    def _write(self, meter: ModelCallMeter, config: Mapping[str, Any] | None) -> None:
        """The execution's charge into the running task's writes, when that task's state holds the episode; and
        kept for the thread's next run here (post_late), in case the run has ended or ends before its next settle."""
        charge = meter.entries[-1] if meter.entries else None
        if charge is None or charge.status != "committed":
            return
        if config is not None:
            write_ledger_update(config, {**channel_base(meter.episode),
                                         "entries": {charge.call_id: charge.to_dict()}})
        # The run's end may come after the task that started it, or the whole run, is over (an astream_events v3
        # stream's producer finishing, or cancelled as asyncio.run ends, an astream read on after the run): that
        # task's writes are then dropped by LangGraph without a word, and the thread's next run, made again from
        # state, released the reservation as unused. A copy state has already is a no-op there.
        self.guard.episodes.post_late(meter.episode, charge)

    def on_llm_new_token(self, token: str, *, run_id: Any, **kwargs: Any) -> None:
        with self._lock:
            meter = self._meters.get(run_id, (None, None, ""))[0]
        if meter is not None:
            meter.streamed(run_id)

    def on_stream_event(self, event: Any, *, run_id: Any, **kwargs: Any) -> None:
        if is_output_event(event):
            self.on_llm_new_token("", run_id=run_id)

    def on_llm_end(self, response: Any, *, run_id: Any, **kwargs: Any) -> None:
        meter, config, task = self._take(run_id)
        if meter is None:
            return
        generations = getattr(response, "generations", None) or []
        try:
            meter.end(run_id, getattr(generations[0][0], "message", None) if generations and generations[0] else None)
        finally:
            if task:
                meter.episode.unvisit(task)
        # The money is spent: the charge goes into the running task's writes now, so a run that dies before
        # the guard's next hook still has it in graph state (the task's other writes, the summary itself,
        # land with it).
        self._write(meter, config)

    def on_llm_error(self, error: BaseException, *, run_id: Any, **kwargs: Any) -> None:
        meter, config, task = self._take(run_id)
        if meter is None:
            return
        try:
            meter.error(run_id, error, partial_output(kwargs.get("response")))
        finally:
            if task:
                meter.episode.unvisit(task)
        # Output generated before the failure (a stream that broke off) is billed: written as a finished
        # run's charge is. A plain failure is released, never written (state never held it).
        self._write(meter, config)


def metered_copy(guard: BudgetGuard, model: Any) -> Any:
    """A copy of ``model`` (a chat model, or a ``"provider:model"`` string as ``init_chat_model`` takes)
    with :class:`MeteredModelCallback`; a model without an output bound gets the guard's
    ``max_output_tokens``, so the worst case reserved is also the provider's limit."""
    from intent.errors import GuardConfigError

    if isinstance(model, str):
        from langchain.chat_models import init_chat_model

        try:
            model = init_chat_model(model)
        except (ValueError, ImportError) as exc:  # an unknown provider, or its package not installed
            raise GuardConfigError(f"metered_model could not make a chat model of {model!r}: {exc}; pass a chat "
                                   "model, or a 'provider:model' string init_chat_model takes ('openai:gpt-4o-mini')"
                                   ) from exc
    from langchain_core.language_models import BaseChatModel

    if not isinstance(model, BaseChatModel):  # a completion model's runs start with on_llm_start: not metered here
        raise GuardConfigError(f"metered_model needs a LangChain chat model (a BaseChatModel) or a 'provider:model' "
                               f"string, got {type(model).__name__}")
    update: dict[str, Any] = {}
    fields = type(model).model_fields
    bound_keys = [k for k in MAX_TOKEN_KEYS if k in fields]
    if bound_keys and not any(getattr(model, k, None) for k in bound_keys):
        update[bound_keys[0]] = guard.max_output_tokens
    update["callbacks"] = [*callback_handlers(model), MeteredModelCallback(guard, model)]
    update |= signalling_limiter(model)  # a run cancelled while its rate limiter holds it was never sent
    copy = model.model_copy(update=update)
    # Its class's agenerate watched for cancellation (_watched_class), in a subclass of the
    # same name: copies LangChain makes of it (bind_tools, with_structured_output) keep it.
    object.__setattr__(copy, "__class__", _watched_class(type(model)))
    return copy


_WATCHED: dict[type, type] = {}
_WATCHED_CLASSES: set[type] = set()
_WATCHED_LOCK = threading.Lock()


def _twinned(model: Any) -> Any:
    """``model`` for an async call: a copy whose runs also carry the async twin of each of its metered
    callbacks whose guard may wait on a shared budget store (ahead of it: see
    :class:`intent.model_meter._TwinnedMeterCallback`), so that their reservations and commits run in a worker
    thread; ``model`` itself when there is none, or inside a guard's model step (which meters the call)."""
    if step_meter() is not None:
        return model
    handlers = callback_handlers(model)
    if any(isinstance(h, _AsyncMeterCallback) for h in handlers):
        return model  # twinned already (astream falling back to ainvoke)
    twins = [h.twin for h in handlers if isinstance(h, MeteredModelCallback) and h.guard.reaches_store()]
    return model.model_copy(update={"callbacks": [*twins, *handlers]}) if twins else model


async def _cancelled_runs(model: Any, run_ids: list[Any]) -> None:
    """Charge the runs a cancelled async call started and no callback finished (as a cancelled model call
    is), each by every guard's handler that metered it (a copy of another guard's copy has two); off the
    loop when that guard may wait on a store (off_loop: a second cancellation still waits for it)."""
    for handler in callback_handlers(model):
        if isinstance(handler, MeteredModelCallback):
            for run_id in run_ids:
                if handler.guard.reaches_store():
                    await off_loop(handler._cancelled, run_id)
                else:
                    handler._cancelled(run_id)


async def _watched_stream(model: Any, stream: Any) -> Any:
    """``stream`` (the twinned copy's astream), whose runs a cancellation before LangChain's own handling (while
    the model's rate limiter holds the request) leaves open: charged (or released, never sent) here."""
    started: list[Any] = []
    try:
        while True:
            token = _STARTED.set(started)  # (set and reset in one step of the consumer: one context)
            try:
                chunk = await anext(stream)
            except StopAsyncIteration:
                return
            finally:
                _STARTED.reset(token)
            yield chunk
    except asyncio.CancelledError:
        await _cancelled_runs(model, started)
        raise
    finally:
        await stream.aclose()


def _producer_watched(stream: Any) -> Any:
    """``stream`` (an ``astream_events(version="v3")`` stream) with its runs watched by its producer task.

    The stream starts its run when first read, then generates and reports the run's end in a producer task of
    its own: the end may come after the reader has seen the last event and its task is done, so the task that
    started the run says nothing about it. A stream of another shape (a LangChain without ``set_start`` or
    ``_producer_task``) keeps the reader's task as the watch."""
    start = getattr(stream, "_ensure_started", None)
    if start is None or not hasattr(stream, "_producer_task") or not callable(getattr(stream, "set_start", None)):
        return stream

    async def ensure_started() -> None:
        begun = _StreamStart()
        token = _STREAM_STARTING.set(begun)
        try:
            await start()
        except BaseException as exc:
            # A later start callback failed (or the start was cancelled): no producer, nothing sent.
            for handler, run_id, _ in begun:
                if handler.guard.reaches_store():
                    await off_loop(handler.not_sent, run_id, exc)
                else:
                    handler.not_sent(run_id, exc)
            raise
        finally:
            begun.over = True
            _STREAM_STARTING.reset(token)
        producer = stream._producer_task
        for handler, run_id, meter in begun:
            handler.watch(run_id, meter, producer, queue=True)

    stream.set_start(ensure_started)
    return stream


def _settled_when_dropped(stream: Any) -> Any:
    """``stream`` (a sync ``stream_events(version="v3")`` stream) whose runs, if its reader drops it before they
    end, are charged as cancelled ones when Python collects it.

    The stream runs its model only as it is read, and reports the run's end with its last event; dropped before
    that, the run would stay open, its reservation held for good. The stream is in a reference cycle (its pump
    refers to it), so it is collected by Python's cyclic garbage collector, not at once: the charge lands at the
    next metered run or guard hook after that (:mod:`intent.dropped_streams`), and the guard's next step writes it
    to state (a reader that reads to the end, or ``stream.output``, is
    charged at once, what the provider reported)."""
    start = getattr(stream, "_ensure_started", None)
    if start is None or not callable(getattr(stream, "set_start", None)):
        return stream
    begun = _StreamStart()

    def ensure_started() -> None:
        if begun.over:
            start()  # (started: returns at once)
            return
        token = _STREAM_STARTING.set(begun)
        try:
            start()
        except BaseException as exc:
            for handler, run_id, _ in begun:  # a later start callback failed: nothing was sent
                handler.not_sent(run_id, exc)
            raise
        finally:
            begun.over = True
            _STREAM_STARTING.reset(token)

    stream.set_start(ensure_started)
    weakref.finalize(stream, dropped_streams.queue, begun)  # (charged at the next safe point: dropped_streams)
    return stream


def _watched_class(cls: type) -> type:
    """``cls`` with an ``agenerate`` that the copy's :class:`MeteredModelCallback` watches (made once per class)."""
    with _WATCHED_LOCK:
        if cls in _WATCHED_CLASSES:  # a copy of a metered copy
            return cls
        sub = _WATCHED.get(cls)
        if sub is None:
            async def agenerate(self: Any, *args: Any, **kwargs: Any) -> Any:
                # A cancelled call (a timeout around ainvoke) gets neither on_llm_end nor on_llm_error from
                # LangChain: the runs it started and no callback finished are charged here, as a cancelled
                # model call is, while the caller's graph task can still write it.
                started: list[Any] = []
                token = _STARTED.set(started)
                try:
                    return await cls.agenerate(_twinned(self), *args, **kwargs)
                except asyncio.CancelledError:
                    await _cancelled_runs(self, started)
                    raise
                finally:
                    _STARTED.reset(token)

            def astream(self: Any, *args: Any, **kwargs: Any) -> Any:
                twinned = _twinned(self)
                if twinned is self:
                    return cls.astream(self, *args, **kwargs)  # (a cancellation it leaves: _caller_done)
                return _watched_stream(self, cls.astream(twinned, *args, **kwargs))

            members: dict[str, Any] = {"__module__": cls.__module__, "__qualname__": cls.__qualname__,
                                       "__doc__": cls.__doc__, "agenerate": agenerate, "astream": astream}
            if hasattr(cls, "_achat_model_stream_v3"):
                # astream_events(version="v3") starts its run in a stream of its own, which ends it (and closes
                # a cancelled one) in its callbacks: the twin, and a watch on its producer task, are needed.
                # (A LangChain without it: none.)
                async def _achat_model_stream_v3(self: Any, *args: Any, **kwargs: Any) -> Any:
                    return _producer_watched(await cls._achat_model_stream_v3(_twinned(self), *args, **kwargs))

                members["_achat_model_stream_v3"] = _achat_model_stream_v3
            if hasattr(cls, "_chat_model_stream_v3"):
                # stream_events(version="v3"): pulled by its reader, with nothing that ends its run if the reader
                # drops it before its last event (LangChain's sync stream has no close): see _settled_when_dropped.
                def _chat_model_stream_v3(self: Any, *args: Any, **kwargs: Any) -> Any:
                    return _settled_when_dropped(cls._chat_model_stream_v3(self, *args, **kwargs))

                members["_chat_model_stream_v3"] = _chat_model_stream_v3
            try:
                sub = type(cls)(cls.__name__, (cls,), members)
            except TypeError:
                # A class that cannot be subclassed so (an __init_subclass__ with required keywords): unwatched;
                # a cancelled call is then charged when the task that made it is done (_caller_done).
                sub = cls
            _WATCHED[cls] = sub
            _WATCHED_CLASSES.add(sub)
        return sub
