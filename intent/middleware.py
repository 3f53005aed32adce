"""The guard as a LangChain v1 ``AgentMiddleware``, with three hooks.

* ``wrap_model_call``, around each model call:

  - before it: release reservations another middleware answered (a call limit, a human's
    reject, a jump), start a new episode's oracle (so a plan is in force before the first
    call), hide tools the market banned or the oracle removed, add the oracle's prompt notes;
    with ``model_prices``, reserve the model execution's worst case;
  - after it: charge the model's usage, then **gate** the new message's tool calls as one
    batch, and return the decisions and reservations with the response as a state update
    (``ExtendedModelResponse``), so the tool step reads them from graph state;

* ``wrap_tool_call``: run an accepted call with a metered tool, charging every run;
* ``after_agent``: nothing stays reserved; the episode's working state is dropped.

Why the gate is inside the model call and not an ``after_model`` hook: each node hook adds a
graph step to every turn (about 0.1 ms per tool call here, more than the guard's own code),
and inside the model call the gate sees the calls before any other middleware's
``after_model`` (a call limit, a reviewer) in every order of the middleware list.

Every hook has its async twin, so ``agent.ainvoke`` works with async oracles. This module
knows the guard only through these methods, so it does not import :mod:`intent.guard`.
"""

from __future__ import annotations

import inspect
import uuid
from collections.abc import Awaitable, Callable, Generator
from typing import TYPE_CHECKING, Annotated, Any

from langchain.agents.middleware import AgentMiddleware, AgentState, ModelRequest, ModelResponse
from langchain.agents.middleware.types import ExtendedModelResponse, hook_config
from langchain_core.messages import AIMessage, SystemMessage, ToolMessage
from langgraph.types import Command, Overwrite
from typing_extensions import NotRequired

from intent import feedback as fb
from intent import lean_path, lifecycle
from intent.episodes import RUNNING_EPISODE
from intent.ledger import merge_ledger_states
from intent.messages import provider_run, tool_name, turns_before
from intent.off_loop import off_loop
from intent.state import LEDGER_KEY, LedgerAggregate, LedgerChannel, current_config

if TYPE_CHECKING:
    from langgraph.prebuilt.tool_node import ToolCallRequest
    from langgraph.runtime import Runtime

    from intent.guard import BudgetGuard

__all__ = ["BudgetGuardAfterModelMiddleware", "BudgetGuardMiddleware", "BudgetState"]


class BudgetState(AgentState):
    """Agent state with the guard's ledger channel (merged by charge id)."""

    intent_ledger: NotRequired[Annotated[LedgerChannel | None, merge_ledger_states, LedgerAggregate]]


# A reply of malformed calls only is sent back to the model with the errors, inside the same model
# step, at most this many times: there is no after_model hook to jump from (the jump_to a model
# step writes is gone once another middleware's after_model hook runs). ModelCallLimitMiddleware
# counts the step once.
MAX_MALFORMED_REASKS = 3


class _Step:
    """One model step of the middleware: the model's replies, what the gate wrote, and the one
    response and state update the step returns."""

    def __init__(self, state: Any, settled: dict[str, Any] | None, *, overwrite: bool = False) -> None:
        self.state = state
        # The step's ledger replaces the channel in graph state instead of merging into it (a
        # sub-agent's first step on a copy of its parent's state: intent.guard.inherits_parent_ledger).
        self.overwrite = overwrite
        self.updates: list[dict[str, Any] | None] = [settled]  # settling, each model charge, each gate
        self.earlier: list[Any] = []  # malformed replies asked again, with the gate's answers to them
        self.response: ModelResponse | None = None
        self.ai: AIMessage | None = None  # the reply the gate saw (None: no calls, or not gating here)
        self.asked_again = 0

    def open(self, result: Any, *, gate: bool) -> dict[str, Any] | None:
        """Take the model's result; return the state the gate reads (as after this step), or
        ``None`` when there is nothing to gate."""
        if isinstance(result, AIMessage):
            response = ModelResponse(result=[result])
        elif isinstance(result, ExtendedModelResponse):
            response = result.model_response
            if result.command is not None:
                self.updates.append(result.command.update if isinstance(result.command.update, dict) else None)
        else:
            response = result
        self.response = response
        ai = None  # the last AIMessage of the reply (a loop, not next(<genexpr>): no generator per model call)
        for m in reversed(response.result):
            if isinstance(m, AIMessage):
                ai = m
                break
        self.ai = None
        if ai is None:
            return None
        if not ai.id:
            # The gate keys each call by its message's id (a reused call id in a later message is a
            # new call), and turns are counted on from a message's id; add_messages would give it
            # one only after this step.
            ai.id = f"lc_{uuid.uuid4()}"
        messages = [*(self.state.get("messages") or []), *self.earlier, *response.result]
        index = len(messages) - len(response.result) + response.result.index(ai)
        channel = self.channel()
        gated_here = gate and bool(ai.tool_calls or ai.invalid_tool_calls)
        if channel and not gated_here:
            # Every reply is counted as it is made: here when no gate in this step counts it (a
            # reply without calls, or an after_model gate that another middleware's jump to the end
            # may skip), so that turn numbers go on from it when a summariser removes older turns
            # (intent.messages.turns_before); an after_model gate numbers the reply by it.
            turns = channel.get("turns")
            step = turns_before(messages, index, turns)
            if gate:  # a reply without calls: no gate will see it
                counted = {"count": step + 1, "total": step + 1, "last_id": ai.id, "at": index}
            else:  # left for this step's after_model gate, which may see it rebuilt (or not at all)
                counted = {k: v for k, v in (turns or {}).items() if k != "pending"} | {
                    "total": step + 1, "pending": {"at": index, "step": step}}
            if counted != turns:
                # Never a channel of turns alone: on an episode's first counted turn the channel is
                # written whole (its settling may be in an attempt an outer retry dropped).
                self.updates.append({LEDGER_KEY: {"turns": counted} if turns else
                                     merge_ledger_states(channel, {"turns": counted})})
        if not gated_here:
            return None
        self.ai = ai
        return {**self.state, "messages": messages, LEDGER_KEY: channel}

    def channel(self) -> dict[str, Any] | None:
        """The ledger channel as this step has it so far: state's, with what settling, the model's
        charges and the gates of earlier replies (malformed ones asked again) wrote."""
        written = _ledger_of(self.updates)
        state = self.state.get(LEDGER_KEY)
        return merge_ledger_states(state, written) if written else state

    def _only_malformed(self) -> bool:
        return self.ai is not None and bool(self.ai.invalid_tool_calls) and not self.ai.tool_calls

    def ask_again(self) -> list[Any] | None:
        """A reply of malformed calls only, below the cap: keep it and the gate's answers (in order,
        before the next reply) and return them, for the model's next request. ``None``: done."""
        if not self._only_malformed() or self.asked_again >= MAX_MALFORMED_REASKS:
            return None
        assert self.response is not None
        answers = self.updates[-1].pop("messages", []) if self.updates[-1] else []
        shown = [*self.response.result, *answers]
        self.earlier += shown
        self.asked_again += 1
        return shown

    def close(self) -> Any:
        """The response (earlier malformed replies and their answers first, the gate's copy of the
        message in place of the model's) and one state update."""
        assert self.response is not None
        response, ai = self.response, self.ai
        update: dict[str, Any] = {}
        extra: list[Any] = []
        for part in self.updates:
            for key, value in (part or {}).items():
                if key not in (LEDGER_KEY, "messages"):
                    update[key] = value  # anything else a part writes passes through unchanged
            for m in (part or {}).get("messages") or ():
                if isinstance(m, AIMessage) and ai is not None and m.id == ai.id:
                    response = ModelResponse(result=[m if r is ai else r for r in response.result],
                                             structured_response=response.structured_response)
                else:
                    extra.append(m)
        if self.earlier:
            response = ModelResponse(result=[*self.earlier, *response.result],
                                     structured_response=response.structured_response)
        ledger = _ledger_of(self.updates)
        if ledger:
            update[LEDGER_KEY] = Overwrite(ledger) if self.overwrite else ledger
        if extra:
            update["messages"] = extra
        if self._only_malformed():
            # Still malformed after the re-asks: back to the model when no other after_model hook
            # runs in between (the agent loop would end otherwise).
            update["jump_to"] = "model"
        return ExtendedModelResponse(model_response=response, command=Command(update=update)) if update else response


def _ledger_of(updates: list[dict[str, Any] | None]) -> dict[str, Any] | None:
    parts = []
    for update in updates:  # (a loop, not a list comprehension: no function made twice per model step)
        if update and update.get(LEDGER_KEY):
            parts.append(update[LEDGER_KEY])
    if len(parts) == 1:
        return parts[0]  # one writer this step (the common case): nothing to merge
    merged: dict[str, Any] | None = None
    for part in parts:
        merged = merge_ledger_states(merged, part)
    return merged


def _older_refusals_shortened(messages: list[Any]) -> list[Any]:
    """The request's messages with the guard's refusals of earlier turns cut to their first lines
    (``feedback_chars``): the agent still sees that they were refused and why, not every plan
    again. The latest turn's refusals stay whole. ``messages`` itself if nothing changes."""
    last_ai = max((i for i, m in enumerate(messages) if isinstance(m, AIMessage)), default=-1)
    out = None
    for i in range(last_ai):
        m = messages[i]
        if (isinstance(m, ToolMessage) and isinstance(m.artifact, dict) and "intent_reason" in m.artifact
                and isinstance(m.content, str) and len(m.content) > fb.SHORT_FEEDBACK_CHARS):
            if out is None:
                out = list(messages)
            out[i] = m.model_copy(update={"content": fb.shortened(m.name or "", m.content,
                                                                  why="an earlier refusal, shortened")})
    return messages if out is None else out


class _RunningEpisode:
    """While a settled model step runs, :data:`intent.episodes.RUNNING_EPISODE` names its episode, for
    a metered model called inside the chain (a tool selector listed after the guard) on a run's first
    step, when state does not name it yet. Only a guard that made a metered model pays for this."""

    __slots__ = ("_token", "_value")

    def __init__(self, guard: Any, state: Any, config: Any) -> None:
        self._value = (guard, guard.episode_id(state, config)) if guard.made_metered_models else None
        self._token: Any = None

    def __enter__(self) -> None:
        if self._value is not None:
            self._token = RUNNING_EPISODE.set(self._value)

    def __exit__(self, *exc: object) -> None:
        if self._token is not None:
            RUNNING_EPISODE.reset(self._token)


# What a guard that made no metered model enters instead (nothing to name): made once, never changed.
_NOT_RUNNING = object.__new__(_RunningEpisode)
_NOT_RUNNING._value = _NOT_RUNNING._token = None


class BudgetGuardMiddleware(AgentMiddleware):
    """The guard's middleware with the gate inside the model call (``gate_at="model_call"``)."""

    state_schema = BudgetState
    gates_in_model_call = True

    def __init__(self, guard: BudgetGuard) -> None:
        super().__init__()
        self.guard = guard

    @property
    def name(self) -> str:
        return "BudgetGuard"

    # --------------------------------------------------------- end of run
    def after_agent(self, state: BudgetState, runtime: Runtime) -> dict[str, Any] | None:
        return self.guard.finish(state, current_config())

    async def aafter_agent(self, state: BudgetState, runtime: Runtime) -> dict[str, Any] | None:
        if self.guard.reaches_store():  # releasing what is left held (closing a carve) reaches the store: off the loop
            return await off_loop(self.guard.finish, state, current_config())
        return self.guard.finish(state, current_config())

    # ---------------------------------------------------------- model call
    def _prepare(self, request: ModelRequest, config: Any, episode_id: str) -> ModelRequest:
        state = request.state
        visible = self.guard.visible_tool_names(state, config, episode_id=episode_id)
        overrides: dict[str, Any] = {}
        if visible is not None:
            # A provider's server-side tool (web search, tool search) is not priced and never gated: hiding
            # banned tools must not unbind it (tools deferred behind a tool search would be unreachable).
            overrides["tools"] = [t for t in request.tools if provider_run(t) or tool_name(t) in visible]
        messages = request.messages
        if self.guard.feedback_chars is not None:
            messages = _older_refusals_shortened(messages)
            if messages is not request.messages:
                overrides["messages"] = messages
        notes = self.guard.system_notes(state, config)
        if notes and self.guard.notes_at == "end":
            # After the conversation, not in the system prompt: the notes change every turn, and
            # a changing prefix defeats the server's prefix cache. Not written to graph state.
            overrides["messages"] = [*messages, SystemMessage(content=notes)]
        elif notes:
            base = request.system_prompt or ""
            overrides["system_message"] = SystemMessage(content=f"{base}\n\n{notes}".strip())
        return request.override(**overrides) if overrides else request

    def _settled_request(self, request: ModelRequest, config: Any) -> tuple[ModelRequest, Any, dict[str, Any] | None]:
        """Settle before the model call; the request's state then carries what settling wrote
        (a new episode's id, above all), so the model meter finds the same episode. Returns the
        request, the episode and what settling wrote."""
        episode, settled = lifecycle.prepared(self.guard, request.state, config, offered=request.tools)
        if settled and settled.get(LEDGER_KEY):
            state = request.state
            channel = merge_ledger_states(state.get(LEDGER_KEY), settled[LEDGER_KEY])
            if isinstance(state, dict) and not state.get(LEDGER_KEY):
                # A run's first step, without a thread: the new episode's name exists only in this
                # step's update until the step ends. An outer middleware that runs the step again (a
                # model retry) passes this same state object, so the name is kept in it, and the
                # retry finds its episode instead of opening another. (The dict is this task's own
                # copy of the state; nothing else reads it.)
                state[LEDGER_KEY] = channel
            else:
                request = request.override(state={**state, LEDGER_KEY: channel})
        return request, episode, settled

    def _model_step(self, request: ModelRequest, config: Any, io: list[Any], episode: Any = None
                    ) -> Generator[tuple[str, Any], None, None]:
        """One model step, written once for the sync and async hooks: yields ``("model", request)``
        for each model call and ``("gate", (state, episode))`` for each gate, reads their results from
        ``io[0]`` (where the driver puts them before going on), and leaves the step's response there.
        ``episode``: the step was prepared the lean way (:mod:`intent.lean_path`) and its first reply,
        which the lean gate did not take, is in ``io[0]`` already: the step goes on from it.

        (Results passed in ``io``, not sent, and the generator ends without a value: the driver advances it
        with ``next(run, None)``, which sees its end without the StopIteration a ``send`` raises there, an
        exception raised and caught on every model step.)"""
        replied = episode is not None
        if replied:
            step = _Step(request.state, None)  # settled the lean way: nothing written
        else:
            state = request.state
            overwrite = self.guard.inherits_parent_ledger(state)
            if overwrite:  # a sub-agent's first step, on a copy of its parent's state: not our ledger
                request = request.override(state={**state, LEDGER_KEY: None})
                state = request.state
            request, episode, settled = self._settled_request(request, config)
            step = _Step(state, settled, overwrite=overwrite)
        while True:
            if replied:
                replied = False
            else:
                yield "model", self._prepare(request, config, episode.episode_id)
            gated_state = step.open(io[0], gate=self.gates_in_model_call)
            if gated_state is not None:
                yield "gate", (gated_state, episode)
                step.updates.append(io[0])
            shown = step.ask_again()
            if shown is None:
                io[0] = step.close()
                return
            # The next reply's charge and turn go on from what this step wrote (the turn counted).
            request = request.override(messages=[*request.messages, *shown],
                                       state={**request.state, LEDGER_KEY: step.channel()})

    def wrap_model_call(self, request: ModelRequest, handler: Callable[[ModelRequest], ModelResponse]) -> Any:
        guard, config = self.guard, current_config()
        io: list[Any] = [None]
        token = None
        # The common step (a run under way, nothing to settle, a reply of one call) the lean way, with no
        # generator: intent.lean_path checks it is that step before anything changes. Its guard meters no
        # model and made no metered model (checked), so the model is called as the general driver calls it.
        lean = lean_path.prepared(guard, request, config) if self.gates_in_model_call else None
        if lean is not None:
            request, episode, model_request = lean
            io[0] = handler(model_request if model_request is not None
                            else self._prepare(request, config, episode.episode_id))
            gate = lean_path.gate_one(guard, request.state, episode, io[0])
            if gate is not None:
                return lean_path.decided(guard, episode, gate, guard.decide(gate.ctx))
            run = self._model_step(request, config, io, episode)  # any other reply: the general step goes on
            following = next(run, None)
        else:
            run = self._model_step(request, config, io)
            following = next(run)  # a model call, always first
            # _RunningEpisode's work without a `with`: for a guard that made no metered model (the usual case) a
            # `with` on a no-op context manager would cost two Python method calls on every model step.
            if guard.made_metered_models:
                token = RUNNING_EPISODE.set((guard, guard.episode_id(following[1].state, config)))
        try:
            while following is not None:  # None: the step has ended, its response in io[0]
                kind, arg = following
                if kind == "model":  # every execution of the model reserved and charged, with model_prices
                    io[0] = guard.wrap_model_call(arg, handler) if guard.meters_models else handler(arg)
                else:
                    io[0] = guard.gate(arg[0], config, settle=False, episode=arg[1])
                following = next(run, None)
            return io[0]
        finally:
            if token is not None:
                RUNNING_EPISODE.reset(token)

    async def awrap_model_call(
        self, request: ModelRequest, handler: Callable[[ModelRequest], Awaitable[ModelResponse]]
    ) -> Any:
        guard, config = self.guard, current_config()
        io: list[Any] = [None]
        lean = lean_path.prepared(guard, request, config) if self.gates_in_model_call else None
        if lean is not None:  # (as wrap_model_call)
            request, episode, model_request = lean
            io[0] = await handler(model_request if model_request is not None
                                  else self._prepare(request, config, episode.episode_id))
            gate = lean_path.gate_one(guard, request.state, episode, io[0])
            if gate is not None:
                return lean_path.decided(guard, episode, gate, await guard.adecide(gate.ctx))
            run = self._model_step(request, config, io, episode)
            following = next(run, None)
            running: Any = _NOT_RUNNING
            on_store = False
        else:
            run = self._model_step(request, config, io)
            # With a shared store, the step's own work between the model and the gate (settling what the last
            # step left held, first of all) reaches the store: run in a thread, not on the event loop
            # (intent.off_loop). (No lean path takes a guard with a store.)
            # (A sub-agent without a store carving from a parent's guard that has one reaches it too: guard.reaches_store.)
            on_store = guard.reaches_store()
            following = next(run) if not on_store else await off_loop(next, run)
            running = _RunningEpisode(guard, following[1].state, config) if guard.made_metered_models else _NOT_RUNNING
        with running:
            while following is not None:
                kind, arg = following
                if kind == "model":
                    io[0] = await guard.awrap_model_call(arg, handler) if guard.meters_models else await handler(arg)
                else:
                    io[0] = await guard.agate(arg[0], config, settle=False, episode=arg[1])
                following = next(run, None) if not on_store else await off_loop(next, run, None)
            return io[0]

    # ---------------------------------------------------------- tool calls
    def wrap_tool_call(self, request: ToolCallRequest, handler: Callable[[ToolCallRequest], Any]) -> Any:
        return self.guard.wrap_tool_call(request, handler)

    async def awrap_tool_call(
        self, request: ToolCallRequest, handler: Callable[[ToolCallRequest], Awaitable[Any]]
    ) -> Any:
        return await self.guard.awrap_tool_call(request, handler)


assert LEDGER_KEY in BudgetState.__annotations__  # the channel name and the state schema agree


def _presign(cls: type) -> None:
    """Give each ``wrap_*`` hook a precomputed ``__signature__``.

    ``create_agent`` wraps every ``wrap_model_call`` / ``wrap_tool_call`` in a LangSmith ``traceable``
    span, whose wrapper calls ``inspect.signature`` on the hook at every call, traced or not: a large
    part of what the span costs when tracing is off. ``inspect.signature`` returns a function's ``__signature__`` when it has one
    (PEP 362), so computing it once takes that off every model and tool call. The signature is the
    function's own: nothing else changes.
    """
    for name in ("wrap_model_call", "awrap_model_call", "wrap_tool_call", "awrap_tool_call"):
        fn = cls.__dict__.get(name)
        if fn is not None and "__signature__" not in vars(fn):
            fn.__signature__ = inspect.signature(fn)


def _jump_if_only_invalid(state: dict[str, Any], update: dict[str, Any] | None) -> dict[str, Any] | None:
    """A message with only malformed calls has no tool_calls, so the agent loop would end;
    send it back to the model with the error messages instead."""
    messages = state.get("messages") or []
    last = messages[-1] if messages else None
    if update and isinstance(last, AIMessage) and last.invalid_tool_calls and not last.tool_calls:
        return {**update, "jump_to": "model"}
    return update


class BudgetGuardAfterModelMiddleware(BudgetGuardMiddleware):
    """The guard's middleware with the gate in an ``after_model`` hook (``gate_at="after_model"``).

    The model's message is checkpointed before the gate runs, so an interrupt in the gate (a
    human asked for a top-up: ``on_over_budget="ask"``) or a crash of the oracle resumes by
    gating the same message again, without asking the model again. One more graph step per turn.
    """

    gates_in_model_call = False

    @property
    def name(self) -> str:
        return "BudgetGuard"

    @hook_config(can_jump_to=["model"])
    def after_model(self, state: BudgetState, runtime: Runtime) -> dict[str, Any] | None:
        # wrap_model_call settled this step already
        return _jump_if_only_invalid(state, self.guard.gate(state, current_config(), settle=False))

    @hook_config(can_jump_to=["model"])
    async def aafter_model(self, state: BudgetState, runtime: Runtime) -> dict[str, Any] | None:
        return _jump_if_only_invalid(state, await self.guard.agate(state, current_config(), settle=False))


_presign(BudgetGuardMiddleware)
