"""The guard as a LangChain v1 ``AgentMiddleware``.

* ``before_model``: release reservations another middleware answered, write charges state
  has not seen, start a new episode's oracle (so a plan is in force before the first call);
* ``wrap_model_call``: hide tools the market banned or the oracle removed, add the
  oracle's prompt notes (prices, quotas, guidelines) to the system message; with
  ``model_prices``, reserve each model execution's worst case and charge its usage;
* ``after_model``: gate the new message's tool calls as one batch;
* ``wrap_tool_call``: run an accepted call with a metered tool, charging every run;
* ``after_agent``: nothing stays reserved; the episode's working state is dropped.

Every hook has its async twin, so ``agent.ainvoke`` works with async oracles. This module
knows the guard only through these methods, so it does not import :mod:`intent.guard`.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Annotated, Any

from langchain.agents.middleware import AgentMiddleware, AgentState, ModelRequest, ModelResponse
from langchain.agents.middleware.types import hook_config
from langchain_core.messages import AIMessage, SystemMessage, ToolMessage
from typing_extensions import NotRequired

from intent import feedback as fb
from intent.ledger import merge_ledger_states
from intent.state import LEDGER_KEY, LedgerChannel, current_config

if TYPE_CHECKING:
    from langgraph.prebuilt.tool_node import ToolCallRequest
    from langgraph.runtime import Runtime

    from intent.guard import BudgetGuard

__all__ = ["BudgetGuardMiddleware", "BudgetState"]


class BudgetState(AgentState):
    """Agent state with the guard's ledger channel (merged by charge id)."""

    intent_ledger: NotRequired[Annotated[LedgerChannel | None, merge_ledger_states]]


def _jump_if_only_invalid(state: dict[str, Any], update: dict[str, Any] | None) -> dict[str, Any] | None:
    """A message with only malformed calls has no tool_calls, so the agent loop would end;
    send it back to the model with the error messages instead."""
    messages = state.get("messages") or []
    last = messages[-1] if messages else None
    if update and isinstance(last, AIMessage) and last.invalid_tool_calls and not last.tool_calls:
        return {**update, "jump_to": "model"}
    return update


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


class BudgetGuardMiddleware(AgentMiddleware):
    state_schema = BudgetState

    def __init__(self, guard: BudgetGuard) -> None:
        super().__init__()
        self.guard = guard

    @property
    def name(self) -> str:
        return "BudgetGuard"

    # ------------------------------------------------------ model boundary
    def before_model(self, state: BudgetState, runtime: Runtime) -> dict[str, Any] | None:
        return self.guard.prepare(state, current_config())

    async def abefore_model(self, state: BudgetState, runtime: Runtime) -> dict[str, Any] | None:
        return self.guard.prepare(state, current_config())

    def after_agent(self, state: BudgetState, runtime: Runtime) -> dict[str, Any] | None:
        return self.guard.finish(state, current_config())

    async def aafter_agent(self, state: BudgetState, runtime: Runtime) -> dict[str, Any] | None:
        return self.guard.finish(state, current_config())

    # ---------------------------------------------------------- model call
    def _prepare(self, request: ModelRequest) -> ModelRequest:
        state = request.state
        config = current_config()
        visible = self.guard.visible_tool_names(state, config)
        overrides: dict[str, Any] = {}
        if visible is not None:
            overrides["tools"] = [
                t for t in request.tools if (t.get("name") if isinstance(t, dict) else t.name) in visible
            ]
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

    def wrap_model_call(self, request: ModelRequest, handler: Callable[[ModelRequest], ModelResponse]) -> Any:
        if self.guard.meters_models:  # every execution of the model reserved and charged
            return self.guard.wrap_model_call(self._prepare(request), handler)
        return handler(self._prepare(request))

    async def awrap_model_call(
        self, request: ModelRequest, handler: Callable[[ModelRequest], Awaitable[ModelResponse]]
    ) -> Any:
        if self.guard.meters_models:
            return await self.guard.awrap_model_call(self._prepare(request), handler)
        return await handler(self._prepare(request))

    # ---------------------------------------------------------------- gate
    @hook_config(can_jump_to=["model"])
    def after_model(self, state: BudgetState, runtime: Runtime) -> dict[str, Any] | None:
        # before_model settled this step already
        return _jump_if_only_invalid(state, self.guard.gate(state, current_config(), settle=False))

    @hook_config(can_jump_to=["model"])
    async def aafter_model(self, state: BudgetState, runtime: Runtime) -> dict[str, Any] | None:
        return _jump_if_only_invalid(state, await self.guard.agate(state, current_config(), settle=False))

    # ---------------------------------------------------------- tool calls
    def wrap_tool_call(self, request: ToolCallRequest, handler: Callable[[ToolCallRequest], Any]) -> Any:
        return self.guard.wrap_tool_call(request, handler)

    async def awrap_tool_call(
        self, request: ToolCallRequest, handler: Callable[[ToolCallRequest], Awaitable[Any]]
    ) -> Any:
        return await self.guard.awrap_tool_call(request, handler)


assert LEDGER_KEY in BudgetState.__annotations__  # the channel name and the state schema agree
