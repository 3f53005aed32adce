"""Metering the agent's model calls: reserve a worst case before each execution, commit the
real cost from ``usage_metadata`` after it.

The guard wraps each model request (``wrap_model_call``) with a :class:`ModelCallMeter`:

* :meth:`ModelCallMeter.precheck` prices the request's worst case before anything runs; a
  call that does not fit is not made (the guard answers with a final message, or asks a
  human with an interrupt);
* :meth:`ModelCallMeter.metering` runs the rest of the chain with a callback
  (:class:`_MeterCallback`) that LangChain adds to every run started inside it (a configure hook
  on a context variable), so **every chat-model execution inside the guard's model step** is
  metered, whatever model it is: the agent's model, each retry a ModelRetryMiddleware placed inside
  the guard makes, a fallback or a routed model that a middleware inside the guard swaps in, a model
  such a middleware calls. ``on_chat_model_start`` prices that model's own worst case and reserves
  it (or refuses by raising :class:`ModelCallRefused`: the model is not called),
  ``on_llm_end`` commits the cost of the reported usage, ``on_llm_error`` releases (a failed
  request that returned no usage is not billed by providers; the record says so); in an async step on a
  shared budget store, an async twin of that callback (:class:`_AsyncMeterCallback`) does the reserving and
  committing in a worker thread (:mod:`intent.off_loop`), so a wait on the store does not stall the loop (the
  same twin serves a ``guard.metered_model`` copy's callback outside the step: :mod:`intent.metered_models`);
* :meth:`ModelCallMeter.settle` charges a response that no metered execution produced (a model
  called outside LangChain, or in a thread that did not carry the context) from its usage, after
  the fact.

Worst case = prompt tokens × input price + ``max_tokens`` × output price (× the completions asked for,
``n`` / ``candidate_count``). Prompt tokens are
the prompt's UTF-8 bytes plus a per-message allowance (``prompt_tokens="bytes"``, default: a
byte-level BPE token is at least one byte, so this never undercounts text) and
:data:`MEDIA_PART_TOKENS` per image, audio or file part (an image's bill at the major providers
is below it; audio, video and long documents can cost more: count those with a callable), or the model's own
count (``"model"``: ``get_num_tokens_from_messages``), or a callable. ``max_tokens`` is the
model's (from its invocation parameters); a model without one gets the guard's
``max_output_tokens`` bound into the request, so the bound is also the provider's limit.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import threading
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextvars import ContextVar
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, Protocol

from langchain_core.callbacks import BaseCallbackHandler
from langchain_core.exceptions import ModelError
from langchain_core.messages import AIMessage, BaseMessage, HumanMessage
from langchain_core.rate_limiters import BaseRateLimiter
from langchain_core.tracers.context import register_configure_hook

from intent.ledger import BudgetExceededError, LedgerEntry
from intent.off_loop import off_loop
from intent.pricing import ModelPrice, UnpricedModelError, cost_of_usage, tokens_of

if TYPE_CHECKING:
    from intent.episodes import Episode
    from intent.guard import BudgetGuard

__all__ = ["MAX_TOKEN_KEYS", "MEDIA_PART_TOKENS", "MODEL_OVER_BUDGET", "STEP_METER", "ModelCallMeter", "ModelCallRefused", "PromptTokens",
           "callback_handlers", "count_prompt_tokens", "model_name_of", "step_meter"]

PromptTokens = Literal["bytes", "model"] | Callable[[Sequence[BaseMessage], Sequence[Any]], int]
MODEL_OVER_BUDGET = "model_over_budget"
METERED_MODEL = "metered_model"  # log records' reason: "metered_model:<the middleware's lc_source>"
MODEL_UNPRICED = "unpriced_model"
MODEL_NO_USAGE = "missing_usage"
MODEL_ERROR = "model_error"
AGENT_MODEL_RUN = "intent_agent_model"  # metadata key on the guard's copy of the agent's model
MODEL_CANCELLED = "cancelled"  # a stream stopped early or a cancelled call: charged at its reservation
MODEL_NOT_SENT = "not_sent"  # cancelled while waiting on the model's rate limiter: never sent, released
CACHE_HIT = "cache_hit"  # a response LangChain served from its cache: charged 0
# A request that failed after the model had generated output (a stream that broke off): charged at its
# partial usage when the chunks carried one, else at its reservation (never free).
MODEL_FAILED_MID_STREAM = "failed_mid_stream"
UNMETERED_MODEL_CALL = "unmetered_model_call"
_PER_MESSAGE_TOKENS = 16  # role markers and separators a chat template adds around each message
# What one content part that is not text (an image, audio, a file, given inline or by URL) is counted as,
# on top of its bytes: above what OpenAI (about 2,500 at most), Anthropic (about 1,600) and Gemini (258 per
# 768-pixel tile) bill for one image. Audio, video and long documents can cost more: count those with
# BudgetGuard(prompt_tokens=<callable>).
MEDIA_PART_TOKENS = 6_000
# Content-part types that are media (LangChain's standard blocks, OpenAI's Chat Completions and Responses,
# Anthropic's, Gemini's): every other part (text, reasoning, tool calls, server tool results...) is text,
# counted by its bytes.
_MEDIA_PARTS = frozenset({"image", "image_url", "input_image", "audio", "input_audio", "video", "file",
                          "input_file", "document", "media", "file_data", "inline_data"})
MAX_TOKEN_KEYS = ("max_tokens", "max_completion_tokens", "max_output_tokens", "num_predict", "max_new_tokens")
# How many completions one request asks for (OpenAI's n, Gemini's candidate_count): each is billed its own output.
COMPLETION_KEYS = ("n", "candidate_count")
_MODEL_KEYS = ("model_name", "model", "model_id")


def callback_handlers(model: Any) -> list[Any]:
    """A chat model's own callback handlers, whether it holds a list or a callback manager."""
    callbacks = model.callbacks
    return list(callbacks) if isinstance(callbacks, list) else list(getattr(callbacks, "handlers", None) or [])


class ModelCallRefused(BudgetExceededError, ModelError):
    """A model execution that the budget does not cover (raised inside the model's invoke). Not
    retryable (``is_retryable``): LangChain's model retries give up at once instead of asking again."""

    is_retryable = False


def _model_name_of(obj: Any) -> str | None:
    for key in _MODEL_KEYS:
        value = obj.get(key) if isinstance(obj, Mapping) else getattr(obj, key, None)
        if isinstance(value, str) and value:
            return value
    return None


def _batch_of(kwargs: Mapping[str, Any]) -> Any:
    """A run's multi-prompt ``generate()``, or ``None`` for a single prompt. LangChain gives a batch no
    id, but passes every run of one ``generate``/``agenerate`` the same ``invocation_params`` dict (a new
    one per call): that object names the batch (compared by identity, and kept alive with the run)."""
    size = kwargs.get("batch_size")
    params = kwargs.get("invocation_params")
    return params if isinstance(size, int) and size > 1 and isinstance(params, dict) else None


def model_name_of(model: Any) -> str | None:
    """A chat model's name: its ``model_name``/``model``/``model_id``, else the name LangChain reports
    for it to tracers (``ls_model_name``)."""
    name = _model_name_of(model)
    if name is None and callable(getattr(model, "_get_ls_params", None)):
        try:
            name = model._get_ls_params().get("ls_model_name") or None
        except (TypeError, ValueError, AttributeError):  # a model whose tracer params need arguments
            return None
    return name if isinstance(name, str) else None


def count_prompt_tokens(messages: Sequence[BaseMessage], tools: Sequence[Any] = ()) -> int:
    """An upper bound on the prompt's tokens: its UTF-8 bytes and a per-message allowance, and
    :data:`MEDIA_PART_TOKENS` more for each part that is not text (an image, audio, a file): one given
    by URL is a few bytes here but hundreds or thousands of tokens at the provider."""
    total = 0
    for m in messages:
        content = m.content if isinstance(m.content, str) else json.dumps(m.content, default=str)
        total += len(content.encode("utf-8")) + _PER_MESSAGE_TOKENS
        if not isinstance(m.content, str):
            total += MEDIA_PART_TOKENS * sum(1 for part in m.content
                                             if isinstance(part, Mapping) and part.get("type") in _MEDIA_PARTS)
        calls = getattr(m, "tool_calls", None)
        if calls:
            total += len(json.dumps(calls, default=str).encode("utf-8"))
    if tools:
        total += len(json.dumps(list(tools), default=str).encode("utf-8"))
    return total


@dataclass
class _Execution:
    charge_id: str
    model: str
    price: ModelPrice
    reason: str  # of its charge's log record
    batch: Any = None  # the multi-prompt generate() that started it (its invocation_params dict), if any
    position: int = 0  # its place among that batch's runs, in start order (a sync batch sends in order)
    completion: bool = False  # a completion (non-chat) model's run
    generated: bool = False  # it has streamed output (on_llm_new_token): a failure after that is billed
    usage: Any = None  # the usage its streamed chunks reported so far (a failure after them is billed at it)
    # Its answer may be the step's response: a run of the agent's model, or one given the request's own
    # prompt (a fallback, a routed model), not a side call on a prompt of its own.
    answers: bool = False
    # Where it is with its model's rate limiter (a guard's copy of the model signals it, see
    # SentSignal): "waiting" while blocked in acquire, "passed" once through; None: no signal.
    limiter: str | None = None


def _positive_ints(source: Any, keys: Sequence[str]) -> list[int]:
    """The positive integers ``source`` (a mapping, or a model's attributes) sets under ``keys``, in their order."""
    found = []
    for k in keys:
        v = source.get(k) if isinstance(source, Mapping) else getattr(source, k, None)
        if isinstance(v, int) and not isinstance(v, bool) and v > 0:
            found.append(v)
    return found


class ModelCallMeter:
    """The money side of one model request of one episode (all its executions)."""

    def __init__(self, guard: BudgetGuard, episode: Episode, *, step: int, query: str, model: Any,
                 charge_reason: str = "accepted", request_tail: BaseMessage | None = None) -> None:
        self.guard, self.episode, self.step, self.query, self.model = guard, episode, step, query, model
        self.charge_reason = charge_reason  # the reason of its charges' log records
        self.default_name = model_name_of(model)
        self.request_tail = request_tail  # the model request's last message (see _Execution.answers)
        self._open: dict[Any, _Execution] = {}
        self.executions: list[_Execution] = []
        self.entries: list[LedgerEntry] = []
        self._metered_ids: set[str] = set()  # ids of the messages metered executions produced
        self._metered: list[BaseMessage] = []  # and the messages themselves (an answer may have no id)
        self._refused_batches: list[Any] = []  # multi-prompt generate() calls with a refused prompt
        # The messages of runs that answer the request (_Execution.answers): a copy of one that a middleware
        # rebuilt is that run's answer, paid (settle).
        self._metered_answers: list[BaseMessage] = []
        # Multi-prompt generate() calls with a failed prompt: (batch, its position, the exception). A sync
        # batch stops there: the prompts started before it were sent (billed, results dropped), later not.
        self._failed_batches: list[tuple[Any, int, BaseException]] = []
        self._lock = threading.Lock()

    # ----------------------------------------------------------- pricing
    def price_of(self, name: str | None) -> tuple[str, ModelPrice]:
        """The price a call of ``name`` is reserved at, by the guard's ``unpriced_model`` policy."""
        found = self.guard.model_prices.find(name)
        if found is not None:
            return found
        if self.guard.unpriced_model == "worst_case":
            worst = self.guard.model_prices.most_expensive()
            if worst is not None:
                return name or "unknown-model", worst
        raise UnpricedModelError(
            f"model {name if name else '(one without a model_name)'} has no price in model_prices ({sorted(self.guard.model_prices.names)}); add "
            "ModelPrice(input_per_mtok=..., output_per_mtok=...) for it, or pass unpriced_model='worst_case'")

    def worst_case(self, messages: Sequence[BaseMessage], tools: Sequence[Any], max_tokens: int | None,
                   name: str | None, completions: int = 1) -> tuple[str, ModelPrice, float]:
        model_name, price = self.price_of(name)
        how = self.guard.prompt_tokens
        if how == "bytes":
            prompt = count_prompt_tokens(messages, tools)
        elif how == "model":
            prompt = int(self.model.get_num_tokens_from_messages(list(messages), tools=list(tools) or None))
        else:
            prompt = int(how(messages, tools))
        out = self.guard.max_output_tokens if max_tokens is None else int(max_tokens)
        # The prompt is billed once, each completion's output on its own.
        return model_name, price, price.worst_case(prompt, out * max(1, completions))

    # ------------------------------------------------------- the request
    def request_settings(self, model_settings: Mapping[str, Any]) -> dict[str, Any] | None:
        """``max_tokens`` to bind when neither the model nor the request sets an output bound."""
        if any(k in model_settings for k in MAX_TOKEN_KEYS):
            return None
        if any(getattr(self.model, k, None) for k in MAX_TOKEN_KEYS):
            return None
        return {**model_settings, "max_tokens": self.guard.max_output_tokens}

    def max_tokens_of(self, params: Mapping[str, Any], *sources: Any) -> int | None:
        """The output bound of a run: its invocation parameters', else the first of ``sources``
        (mappings or models) that has one; ``None`` when none does."""
        for source in (params, *sources):
            found = _positive_ints(source, MAX_TOKEN_KEYS)
            if found:
                return found[0]
        return None

    @staticmethod
    def completions_of(params: Mapping[str, Any], *sources: Any) -> int:
        """How many completions a run asks for (``n``, ``candidate_count``): its invocation parameters', else
        the first of ``sources`` that sets one; 1 when none does."""
        for source in (params, *sources):
            found = _positive_ints(source, COMPLETION_KEYS)
            if found:
                return max(found)  # (a model class may declare both, one left at its default 1)
        return 1

    def instrument(self, model: Any, handler: _MeterCallback) -> Any:
        """A copy of the agent's model carrying the step's ``handler`` itself, so that its executions are
        metered even in a thread that did not copy the context (LangChain adds a configure-hook handler
        only once to a run, so they are not metered twice). A ``guard.metered_model`` copy used as the
        agent's model gives up its own callback here (charged once)."""
        handlers = [h for h in callback_handlers(model) if not getattr(h, "replaced_by_guard_meter", False)]
        # (An async twin goes first: a callback manager runs its handlers in their order, see _TwinnedMeterCallback.)
        twin = [handler.twin] if isinstance(handler, _TwinnedMeterCallback) else []
        # Its runs say they are the agent's model's (LangChain passes a model's metadata to its run's
        # callbacks, not to runs started inside it): its attributes give their name and output bound.
        return model.model_copy(update={"callbacks": [*handlers, *twin, handler],
                                        "metadata": {**(model.metadata or {}), AGENT_MODEL_RUN: True},
                                        **signalling_limiter(model)})

    @contextlib.contextmanager
    def metering(self, *, on_store: bool = False) -> Iterator[_MeterCallback]:
        """Meter every chat-model execution started inside the block (see the module's doc); yields
        the step's callback (for :meth:`instrument`). ``on_store``: an async step on a shared budget store,
        whose executions' reservations and commits run in a worker thread (:class:`_AsyncMeterCallback`)."""
        if not on_store:
            handler = _MeterCallback(self)
            token = STEP_METER.set(handler)
            try:
                yield handler
            finally:
                # A task the step started and left running keeps this context: its model calls after the
                # step are not the step's (they are unmetered, or metered by a guard.metered_model copy).
                handler.closed = True
                STEP_METER.reset(token)
            return
        twinned = _TwinnedMeterCallback(self)
        async_token, token = ASYNC_STEP_METER.set(twinned.twin), STEP_METER.set(twinned)
        try:
            yield twinned
        finally:
            twinned.closed = True
            STEP_METER.reset(token)
            ASYNC_STEP_METER.reset(async_token)

    # ------------------------------------------------------ one execution
    def start(self, run_id: Any, messages: Sequence[BaseMessage], params: Mapping[str, Any],
              metadata: Mapping[str, Any] | None = None, serialized: Mapping[str, Any] | None = None, *,
              own: bool | None = None, batch: Any = None, completion: bool = False) -> _Execution | None:
        """Reserve one execution's worst case, or raise :class:`ModelCallRefused`. ``own``: the run is
        of this meter's model (default: its metadata says so, see :meth:`instrument`); ``batch``: the
        multi-prompt ``generate`` it belongs to (:func:`_batch_of`), whose other runs are not sent yet
        when this one is refused. Returns the execution now before its model's rate limiter (set in
        :data:`AWAITING_LIMITER` here too), ``None`` for a batch's."""
        tools = params.get("tools") or ()
        if batch is not None and any(b is batch for b in self._refused_batches):
            # A prompt of this batch was refused: LangChain's async completion models start each prompt's
            # run in a task of its own, so some start after that; none of them is sent.
            raise ModelCallRefused("another prompt of the same batch was refused; this one is not sent")
        if own is None:
            own = bool((metadata or {}).get(AGENT_MODEL_RUN))
        # The model that runs (a fallback or a routed model, maybe): its own name, price and output bound
        # (its invocation parameters', else its constructor's arguments as LangChain serialises them); the
        # meter's model's attributes only for its own runs. Another model without a name is refused as
        # unpriced (unpriced_model="refuse"), not priced as the agent's; one without a bound is reserved
        # at the guard's max_output_tokens.
        named = _model_name_of(params) or (metadata or {}).get("ls_model_name")
        model_name = named or (self.default_name if own else None)
        # LangChain also reports a model's own bound to tracers (ls_max_tokens, from its attributes).
        reported_bound = {"max_tokens": (metadata or {}).get("ls_max_tokens")}
        max_tokens = self.max_tokens_of(params, (serialized or {}).get("kwargs") or {}, reported_bound,
                                        *([self.model] if own else []))
        completions = self.completions_of(params, (serialized or {}).get("kwargs") or {},
                                          *([self.model] if own else []))
        try:
            tail = self.request_tail
            answers = own or bool(tail is not None and messages and (messages[-1] is tail or (
                type(messages[-1]) is type(tail) and messages[-1].content == tail.content)))
            return self._reserve_run(run_id, messages, tools, max_tokens, model_name, metadata, batch, completion,
                                     answers, completions)
        except ModelCallRefused:
            if batch is not None:
                with self._lock:
                    self._refused_batches.append(batch)
                self.release_batch(batch)  # generate() starts every prompt's run before sending any
            raise

    def _reserve_run(self, run_id: Any, messages: Sequence[BaseMessage], tools: Any, max_tokens: int | None,
                     model_name: str | None, metadata: Mapping[str, Any] | None, batch: Any,
                     completion: bool, answers: bool, completions: int = 1) -> _Execution | None:
        ledger = self.episode.ledger
        try:
            name, price, amount = self.worst_case(messages, tools, max_tokens, model_name, completions)
        except UnpricedModelError as exc:
            self.guard.records.model_refusal(ledger, episode_id=self.episode.episode_id, step=self.step,
                                             query=self.query, model=model_name or "",
                                             price=None, reason=MODEL_UNPRICED, text=str(exc))
            raise ModelCallRefused(str(exc)) from exc
        charge_id = f"model:{self.episode.episode_id}:{self.step}:{uuid.uuid4().hex[:10]}"
        with self.episode.lock:
            if self.episode.stopped_reason:
                raise ModelCallRefused(self.episode.stopped_reason)
            try:
                entry = ledger.reserve(charge_id, name, amount, kind="model", execution=1)
            except BudgetExceededError as exc:
                self.guard.records.model_refusal(ledger, episode_id=self.episode.episode_id, step=self.step,
                                                 query=self.query, model=name, price=amount,
                                                 reason=MODEL_OVER_BUDGET, text=str(exc))
                raise ModelCallRefused(str(exc)) from exc
        # A model a middleware calls names its call (LangChain's lc_source): its charge says so.
        source = (metadata or {}).get("lc_source")
        with self._lock:
            position = sum(1 for e in self.executions if batch is not None and e.batch is batch)
            ex = _Execution(charge_id, name, price, f"{METERED_MODEL}:{source}" if source else self.charge_reason,
                            batch, position, completion, answers=answers)
            self._open[run_id] = ex
            self.executions.append(ex)
            self.entries.append(entry)
        if batch is None:
            # LangChain acquires the model's rate limiter right after this callback, in the same context:
            # a SentSignal there tells this run's cancellation while it waits from one after it was sent.
            # (A batch's prompts acquire in tasks of their own, in no known order: not signalled, charged.)
            AWAITING_LIMITER.set(ex)
            return ex
        return None

    def not_sent(self, run_id: Any, exc: BaseException) -> None:
        """Release an execution whose start was cancelled after its reservation was made: LangChain sends
        nothing for it (nor reports an error: its start callback raised)."""
        ex = self._open.get(run_id)
        if ex is not None:
            ex.limiter = "waiting"  # (before its limiter, so not sent: what error() releases, not charges)
            self.error(run_id, exc)

    def release_batch(self, batch: Any) -> int:
        """Release the open runs of one multi-prompt ``generate()`` whose requests were not sent (started in
        this meter; :mod:`intent.metered_models` asks each meter of a batch); returns how many."""
        with self._lock:
            runs = [self._open.pop(rid) for rid, ex in list(self._open.items()) if ex.batch is batch]
        for ex in runs:
            self._released(ex, ModelCallRefused("not sent: another prompt of the same batch failed or was refused"))
        return len(runs)

    def end(self, run_id: Any, message: BaseMessage | None) -> None:
        with self._lock:
            ex = self._open.pop(run_id, None)
        if ex is None:
            return
        ledger = self.episode.ledger
        usage = getattr(message, "usage_metadata", None) if message is not None else None
        reported = (getattr(message, "response_metadata", None) or {}).get("model_name") if message is not None \
            else None
        name, price = ex.model, ex.price
        if reported and reported != name:
            found = self.guard.model_prices.find(reported)
            if found is not None:
                name, price = reported, found[1]
        reason = ex.reason
        tokens: dict[str, int] = {}
        if usage and usage.get("total_cost") == 0:
            # Served from LangChain's cache (it zeroes the cost of a cache hit): no provider call.
            billed, reason = 0.0, CACHE_HIT
            tokens = tokens_of(usage)
        elif usage:
            billed: float | None = cost_of_usage(price, usage)
            tokens = tokens_of(usage)
        else:
            # No usage: never free. The reserved worst case is charged; with "refuse" the
            # episode also makes no further model call.
            billed, reason = None, MODEL_NO_USAGE
            if self.guard.missing_usage == "refuse":
                with self.episode.lock:
                    self.episode.stopped_reason = (
                        f"a response of model {name!r} carried no usage_metadata, so its cost is unknown; "
                        "missing_usage='refuse' stops further model calls")
        entry = ledger.commit(ex.charge_id, billed)
        with self._lock:
            self.entries.append(entry)
            if message is not None:
                self._metered.append(message)
                if ex.answers:
                    self._metered_answers.append(message)
                if getattr(message, "id", None):
                    self._metered_ids.add(message.id)
        self.guard.records.model_charge(ledger, entry, episode_id=self.episode.episode_id, step=self.step,
                                        query=self.query, model=name, tokens=tokens, reason=reason)

    def streamed(self, run_id: Any, usage: Any = None) -> None:
        """The run has streamed a token: it has been served, at least in part. ``usage``: the chunk's, if it
        reported one (added up over the chunks, as LangChain adds a stream's chunks)."""
        ex = self._open.get(run_id)
        if ex is not None:
            ex.generated = True
            if usage:
                from langchain_core.messages.ai import add_usage

                with self._lock:
                    ex.usage = add_usage(ex.usage, usage) if ex.usage else usage

    def error(self, run_id: Any, exc: BaseException, partial: BaseMessage | None = None) -> None:
        """``partial``: what the model had generated before it failed (LangChain passes a stream's
        chunks so far to ``on_llm_error``); such a request was served, at least in part, and billed."""
        with self._lock:
            ex = self._open.pop(run_id, None)
        if ex is None:
            return
        seen = None
        if ex.batch is not None:
            with self._lock:
                seen = next((p for b, p, e in self._failed_batches if b is ex.batch and e is exc), None)
                if seen is None and not any(b is ex.batch for b, _, _ in self._failed_batches):
                    self._failed_batches.append((ex.batch, ex.position, exc))
        if not isinstance(exc, Exception):
            if ex.limiter == "waiting":
                # Cancelled while the model's rate limiter held it: the request never left the process.
                self._released(ex, exc, reason=MODEL_NOT_SENT)
                return
            # Not a failure of the request but its caller stopping: a stream its reader stopped early, a
            # call cancelled by a timeout, Ctrl-C. The request reached the provider, which bills what it
            # generated; how much is unknown, so the reserved worst case is charged (never free).
            self._charged(ex, MODEL_CANCELLED)
            return
        if partial is not None or ex.generated:
            # Output was generated before the failure (a connection that dropped mid-stream): the provider
            # bills it. At its usage when a chunk reported one, else at the reserved worst case. (A model
            # streamed inside invoke reports no partial output with its error, only its chunks as they came.)
            usage = getattr(partial, "usage_metadata", None) or ex.usage
            billed = cost_of_usage(ex.price, usage) if usage else None
            ledger = self.episode.ledger
            entry = ledger.commit(ex.charge_id, billed)
            with self._lock:
                self.entries.append(entry)
            self.guard.records.model_charge(ledger, entry, episode_id=self.episode.episode_id, step=self.step,
                                            query=self.query, model=ex.model,
                                            tokens=tokens_of(usage) if usage else {}, reason=MODEL_FAILED_MID_STREAM)
            return
        if seen is not None and ex.completion:
            # A completion model's batch ends every run with the one exception: the runs before the
            # failing prompt were sent and billed, and which they are cannot be told: charged.
            self._charged(ex, MODEL_CANCELLED)
            return
        self._released(ex, exc)

    def _charged(self, ex: _Execution, reason: str) -> None:
        ledger = self.episode.ledger
        entry = ledger.commit(ex.charge_id)
        with self._lock:
            self.entries.append(entry)
        self.guard.records.model_charge(ledger, entry, episode_id=self.episode.episode_id, step=self.step,
                                        query=self.query, model=ex.model, tokens={}, reason=reason)

    def _released(self, ex: _Execution, exc: BaseException, reason: str = MODEL_ERROR) -> None:
        ledger = self.episode.ledger
        entry = ledger.release(ex.charge_id)
        if entry is not None:
            with self._lock:
                self.entries.append(entry)
            self.guard.records.model_refusal(ledger, episode_id=self.episode.episode_id, step=self.step,
                                             query=self.query, model=ex.model, price=entry.amount,
                                             reason=reason, text=f"{type(exc).__name__}: {exc}", status="error",
                                             decision="accept")

    # ------------------------------------------------------ after the chain
    def settle(self, messages: Sequence[BaseMessage]) -> None:
        """Charge a response no metered execution produced (its model ran outside the step's context,
        or outside LangChain), from its usage, after the fact."""
        direct: list[BaseMessage] = []  # metered answers in the response as themselves
        unmetered: list[AIMessage] = []
        for m in messages:
            if not isinstance(m, AIMessage) or not m.usage_metadata:
                continue
            # A message a metered execution produced is paid: matched by id, or as that very message
            # when it has no id (a side call's answer is not the response).
            if m.id and m.id in self._metered_ids:
                direct.extend(x for x in self._metered if getattr(x, "id", None) == m.id)
            elif not m.id and any(m is x for x in self._metered):
                direct.append(m)
            else:
                unmetered.append(m)
        # A copy of a metered answer (same usage, same reported model) that a middleware rebuilt, with a new
        # id or none: the agent's own answer, or a fallback's or a routed model's (not a side call's, whose
        # answer the middleware consumed). Each metered answer is matched once.
        twins = [x for x in self._metered_answers if not any(x is d for d in direct)]
        for m in unmetered:
            twin = next((x for x in twins if getattr(x, "usage_metadata", None) == m.usage_metadata
                         and (x.response_metadata or {}).get("model_name")
                         == (m.response_metadata or {}).get("model_name")), None)
            if twin is not None:
                twins.remove(twin)
                continue
            name = (m.response_metadata or {}).get("model_name") or self.default_name
            ledger = self.episode.ledger
            model, price = self._price_after_the_fact(name)
            cost = cost_of_usage(price, m.usage_metadata)
            charge_id = f"model:{self.episode.episode_id}:{self.step}:{uuid.uuid4().hex[:10]}"
            with self.episode.lock:  # the money was spent
                entry = ledger.charge_now(charge_id, model, cost, kind="model")
            self.entries.append(entry)
            self.guard.records.model_charge(
                ledger, entry, episode_id=self.episode.episode_id, step=self.step, query=self.query, model=model,
                tokens=tokens_of(m.usage_metadata), reason=UNMETERED_MODEL_CALL)

    def _price_after_the_fact(self, name: str | None) -> tuple[str, ModelPrice]:
        """The price of an answer already paid for to the provider: its model's, else the dearest in the
        table (an upper bound: the money is spent, and refusing now would only crash the run after it, as
        a provider that reports a versioned name the table lacks would). ``UnpricedModelError`` only when
        the table is empty."""
        found = self.guard.model_prices.find(name)
        if found is not None:
            return found
        worst = self.guard.model_prices.most_expensive()
        if worst is None:
            return self.price_of(name)  # raises, naming the model
        return name or "unknown-model", worst

    def abandon(self) -> None:
        """End executions that never ended: each one's request was sent (its run started), and a provider
        bills it whether or not anyone reads the answer (the step went on without it, or stopped: a
        crash, an interrupt, whose re-run sends a new request), so its reserved worst case is charged;
        a prompt of a failed batch after the failure was never sent and is released."""
        with self._lock:
            open_runs, self._open = list(self._open.values()), {}
            failed = list(self._failed_batches)
        for ex in open_runs:
            stop = next((p for b, p, _ in failed if b is ex.batch), None) if ex.batch is not None else None
            if stop is not None and ex.position >= stop:
                # A batch that failed at ``stop``: a prompt after it never was sent.
                self._released(ex, ModelCallRefused("not sent: an earlier prompt of its batch failed"))
            elif ex.limiter == "waiting":
                self._released(ex, ModelCallRefused("not sent: still waiting on the model's rate limiter"),
                               reason=MODEL_NOT_SENT)
            else:
                self._charged(ex, MODEL_CANCELLED)


class _MeterCallback(BaseCallbackHandler):
    """Runs inside the model's invoke, in line, and its exceptions propagate (a refusal)."""

    raise_error = True
    run_inline = True

    def __init__(self, meter: ModelCallMeter) -> None:
        self.meter = meter
        self.closed = False  # the step has ended (ModelCallMeter.metering)

    def on_chat_model_start(self, serialized: dict[str, Any], messages: list[list[BaseMessage]], *, run_id: Any,
                            metadata: dict[str, Any] | None = None, **kwargs: Any) -> None:
        if self.closed:
            return
        flat = [m for batch in messages for m in batch]
        self.meter.start(run_id, flat, kwargs.get("invocation_params") or {}, metadata, serialized,
                         batch=_batch_of(kwargs))

    def on_llm_start(self, serialized: dict[str, Any], prompts: list[str], *, run_id: Any,
                     metadata: dict[str, Any] | None = None, **kwargs: Any) -> None:
        # A completion (non-chat) model inside the step: priced on its prompts like a chat model; its
        # generations carry no usage_metadata, so it is charged its reserved worst case (never free).
        if self.closed:
            return
        self.meter.start(run_id, [HumanMessage(p) for p in prompts], kwargs.get("invocation_params") or {}, metadata,
                         serialized, batch=_batch_of(kwargs), completion=True)

    def on_llm_new_token(self, token: str, *, run_id: Any, chunk: Any = None, **kwargs: Any) -> None:
        message = getattr(chunk, "message", None)
        self.meter.streamed(run_id, getattr(message, "usage_metadata", None))

    def on_stream_event(self, event: Any, *, run_id: Any, **kwargs: Any) -> None:
        # stream_events(version="v3") streams without on_llm_new_token: output has come once a block has.
        if is_output_event(event):
            self.meter.streamed(run_id)

    def on_llm_end(self, response: Any, *, run_id: Any, **kwargs: Any) -> None:
        message = None
        generations = getattr(response, "generations", None) or []
        if generations and generations[0]:
            message = getattr(generations[0][0], "message", None)
        self.meter.end(run_id, message)

    def on_llm_error(self, error: BaseException, *, run_id: Any, **kwargs: Any) -> None:
        self.meter.error(run_id, error, partial_output(kwargs.get("response")))


class TwinnedCallback(Protocol):
    """What a sync metering callback gives its async twin (:class:`_AsyncMeterCallback`): the step's
    (:class:`_TwinnedMeterCallback`) and a ``guard.metered_model`` copy's
    (:class:`intent.metered_models.MeteredModelCallback`). :meth:`begin`, :meth:`not_sent` and the sync
    ``on_llm_end``/``on_llm_error`` may wait on the store: the twin calls them in a worker thread; the others
    are called on the loop."""

    def claim(self, run_id: Any) -> bool:
        """Whether the twin starts ``run_id`` (then the sync callback, called next for the same start, skips it)."""

    def begin(self, run_id: Any, messages: list[BaseMessage], serialized: dict[str, Any],
              metadata: dict[str, Any] | None, kwargs: Mapping[str, Any], completion: bool) -> _Execution | None:
        """Reserve the run (what the sync ``on_chat_model_start`` does); the execution now before its rate
        limiter (:data:`AWAITING_LIMITER`), if any. Raises a refusal."""

    def begun(self, run_id: Any) -> None:
        """On the loop, after :meth:`begin` returned (what needs the caller's task)."""

    def is_open(self, run_id: Any) -> bool:
        """Whether ``run_id`` was begun and has not ended."""

    def not_sent(self, run_id: Any, exc: BaseException) -> None:
        """Release ``run_id``, begun but cancelled before its request was sent."""

    def on_llm_end(self, response: Any, *, run_id: Any, **kwargs: Any) -> None: ...

    def on_llm_error(self, error: BaseException, *, run_id: Any, **kwargs: Any) -> None: ...


class _TwinnedMeterCallback(_MeterCallback):
    """The step's callback when the step is async and its budget is in a shared store: an execution's
    reservation and its commit may wait on the store (a row lock, a failover), so under an async callback
    manager they run in a worker thread, awaited by its :class:`_AsyncMeterCallback` ``twin``.

    Both are on every run started in the step, the twin first. LangChain's async manager awaits a
    handler's coroutine methods and calls its other methods, one handler after the other, in their order:
    the twin's coroutine reserves (or commits), and this callback, called next, finds the run claimed (or
    no longer open) and does nothing. A sync manager (a model invoked synchronously inside the step) calls
    this callback's methods inline and runs the twin's coroutines only after every handler, where they find
    the run taken: the sync work is this callback's, and a refusal propagates from it (LangChain only logs
    what an async handler raises under a sync manager). Each start is claimed once (:meth:`claim`); an end
    or an error acts on a run still open, which only the first takes."""

    def __init__(self, meter: ModelCallMeter) -> None:
        super().__init__(meter)
        self._claimed: set[Any] = set()
        self.twin = _AsyncMeterCallback(self)

    def claim(self, run_id: Any) -> bool:
        """Whether the caller is the first of the two to start ``run_id`` in the step (then it reserves it)."""
        if self.closed:
            return False
        with self.meter._lock:
            if run_id in self._claimed:
                return False
            self._claimed.add(run_id)
            return True

    def begin(self, run_id: Any, messages: list[BaseMessage], serialized: dict[str, Any],
              metadata: dict[str, Any] | None, kwargs: Mapping[str, Any], completion: bool) -> _Execution | None:
        return self.meter.start(run_id, messages, kwargs.get("invocation_params") or {}, metadata, serialized,
                                batch=_batch_of(kwargs), completion=completion)

    def begun(self, run_id: Any) -> None:
        pass

    def is_open(self, run_id: Any) -> bool:
        return run_id in self.meter._open

    def not_sent(self, run_id: Any, exc: BaseException) -> None:
        self.meter.not_sent(run_id, exc)

    def on_chat_model_start(self, serialized: dict[str, Any], messages: list[list[BaseMessage]], *, run_id: Any,
                            **kwargs: Any) -> None:
        if self.claim(run_id):
            super().on_chat_model_start(serialized, messages, run_id=run_id, **kwargs)

    def on_llm_start(self, serialized: dict[str, Any], prompts: list[str], *, run_id: Any, **kwargs: Any) -> None:
        if self.claim(run_id):
            super().on_llm_start(serialized, prompts, run_id=run_id, **kwargs)


class _AsyncMeterCallback(BaseCallbackHandler):
    """The async twin of a sync metering callback (:class:`TwinnedCallback`: the step's, or a
    ``guard.metered_model`` copy's): reserves and commits an execution in a worker thread
    (:func:`intent.off_loop.off_loop`), awaited in line (``run_inline``: LangChain awaits it in the model
    call's own task and context, where the model's rate limiter then reads :data:`AWAITING_LIMITER`; a
    handler not in line runs in a task of its own). Only the four events that may reach the store are
    coroutines; a streamed token is the sync callback's (no store, no thread per token)."""

    raise_error = True
    run_inline = True

    def __init__(self, sync: TwinnedCallback) -> None:
        self.sync = sync

    async def _start(self, run_id: Any, messages: list[BaseMessage], serialized: dict[str, Any],
                     metadata: dict[str, Any] | None, kwargs: Mapping[str, Any], completion: bool) -> None:
        if not self.sync.claim(run_id):
            return
        try:
            waiting = await off_loop(self.sync.begin, run_id, messages, serialized, metadata, kwargs, completion)
        except asyncio.CancelledError as exc:
            # Cancelled while the reservation was made in its thread (off_loop waited for it): LangChain
            # sends nothing for this run and reports no error for it, so its reservation goes back now.
            await off_loop(self.sync.not_sent, run_id, exc)
            raise
        if waiting is not None:
            AWAITING_LIMITER.set(waiting)  # (set in the thread's copy of the context: set here, in the caller's)
        self.sync.begun(run_id)

    async def on_chat_model_start(self, serialized: dict[str, Any], messages: list[list[BaseMessage]], *,
                                  run_id: Any, metadata: dict[str, Any] | None = None, **kwargs: Any) -> None:
        await self._start(run_id, [m for batch in messages for m in batch], serialized, metadata, kwargs, False)

    async def on_llm_start(self, serialized: dict[str, Any], prompts: list[str], *, run_id: Any,
                           metadata: dict[str, Any] | None = None, **kwargs: Any) -> None:
        await self._start(run_id, [HumanMessage(p) for p in prompts], serialized, metadata, kwargs, True)

    async def on_llm_end(self, response: Any, *, run_id: Any, **kwargs: Any) -> None:
        if self.sync.is_open(run_id):  # (else not metered here: started after the step, or by a sync manager)
            await off_loop(functools.partial(self.sync.on_llm_end, response, run_id=run_id, **kwargs))

    async def on_llm_error(self, error: BaseException, *, run_id: Any, **kwargs: Any) -> None:
        if self.sync.is_open(run_id):
            await off_loop(functools.partial(self.sync.on_llm_error, error, run_id=run_id, **kwargs))


# The events of LangChain's v3 stream protocol that carry generated output (a block started or grew).
_OUTPUT_EVENTS = frozenset({"content-block-start", "content-block-delta", "content-block-finish"})


def is_output_event(event: Any) -> bool:
    return isinstance(event, Mapping) and event.get("event") in _OUTPUT_EVENTS


def partial_output(response: Any) -> BaseMessage | None:
    """The output a failed run had generated, from the ``response`` LangChain passes to ``on_llm_error``
    (a stream's chunks so far, next to a generation carrying only the error's metadata); ``None``
    when it had generated nothing."""
    for generations in getattr(response, "generations", None) or ():
        for generation in generations or ():
            message = getattr(generation, "message", None)
            if message is None:
                if getattr(generation, "text", ""):  # a completion model's partial text
                    return AIMessage(content=generation.text)
                continue
            if (message.content or getattr(message, "tool_call_chunks", None) or getattr(message, "tool_calls", None)
                    or getattr(message, "usage_metadata", None)):
                return message
    return None


# The meter of the guard's model step running in this context. LangChain adds the handler held
# here to every callback manager configured while it is set (its configure hooks: how LangSmith's
# tracer and collect_runs reach every run), so every chat-model execution started inside the step
# is metered, whatever model a middleware inside the guard calls. Not inheritable: each run's own
# configure adds it (once per run: LangChain skips a handler already there).
STEP_METER: ContextVar[_MeterCallback | None] = ContextVar("intent_model_step_meter", default=None)
# The async twin of the step's callback when the step is async on a shared budget store
# (_TwinnedMeterCallback): added to every run before STEP_METER's handler (its hook is registered first).
ASYNC_STEP_METER: ContextVar[_AsyncMeterCallback | None] = ContextVar("intent_async_step_meter", default=None)
# The run this context started last, whose request LangChain sends once the model's rate limiter lets it.
AWAITING_LIMITER: ContextVar[_Execution | None] = ContextVar("intent_awaiting_limiter", default=None)


class SentSignal(BaseRateLimiter):
    """A model's rate limiter, as the guard's copies of the model carry it: the same limiter (the same
    bucket, shared with every other user of it), which also tells the run being metered whether its
    request got through. LangChain calls ``acquire`` after a run's start callback and before sending: a
    run cancelled while it waits there was never sent, and is released instead of charged."""

    def __init__(self, limiter: BaseRateLimiter) -> None:
        self.limiter = limiter

    def acquire(self, *, blocking: bool = True) -> bool:
        ex = _waiting()
        got = self.limiter.acquire(blocking=blocking)
        _passed(ex, got)
        return got

    async def aacquire(self, *, blocking: bool = True) -> bool:
        ex = _waiting()
        got = await self.limiter.aacquire(blocking=blocking)
        _passed(ex, got)
        return got


def _waiting() -> _Execution | None:
    ex = AWAITING_LIMITER.get()
    if ex is None or ex.limiter is not None:
        return None  # no run of this context is before its limiter (each run is signalled once)
    AWAITING_LIMITER.set(None)
    ex.limiter = "waiting"
    return ex


def _passed(ex: _Execution | None, got: bool) -> None:
    if ex is not None:
        # Not let through (a non-blocking acquire): the caller does not send it; on its next try it is sent.
        ex.limiter = "passed" if got else None
        if not got:
            AWAITING_LIMITER.set(ex)


def signalling_limiter(model: Any) -> dict[str, Any]:
    """The ``model_copy`` update that gives a copy of ``model`` a :class:`SentSignal` (none without a
    rate limiter, or with one already)."""
    limiter = getattr(model, "rate_limiter", None)
    if limiter is None or isinstance(limiter, SentSignal):
        return {}
    return {"rate_limiter": SentSignal(limiter)}
register_configure_hook(ASYNC_STEP_METER, inheritable=False)  # (first: see _TwinnedMeterCallback)
register_configure_hook(STEP_METER, inheritable=False)


def step_meter() -> ModelCallMeter | None:
    """The meter of the guard's model step running in this context (any guard's), if any."""
    handler = STEP_METER.get()
    return handler.meter if handler is not None and not handler.closed else None


class _RefusalLogFilter(logging.Filter):
    """LangChain logs a warning for every exception a callback raises, also for one raised on
    purpose: a model execution the budget does not cover is refused that way, and it is already in
    the guard's log records and the agent's final message, so LangChain's warning is dropped (only
    for the guard's own handlers and refusals)."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        return not (record.msg == "Error in %s.%s callback: %s" and isinstance(args, tuple) and len(args) == 3
                    and args[0] in ("_MeterCallback", "_TwinnedMeterCallback", "_AsyncMeterCallback", "MeteredModelCallback") and "Refused(" in str(args[2]))


logging.getLogger("langchain_core.callbacks.manager").addFilter(_RefusalLogFilter())
