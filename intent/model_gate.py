"""The guard's model step: each request's worst case priced before anything runs.

:class:`ModelGate` is what ``BudgetGuard.wrap_model_call`` does when a price table is given:
a request whose worst case does not fit is not made (the agent ends with a final message
saying why, or a human is asked: :mod:`intent.human`); otherwise the rest of the chain runs with the step's
meter on every chat-model run inside it (:mod:`intent.model_meter`), and the charges go back to graph state
with the response (``ExtendedModelResponse`` with a ``Command`` update of the ledger channel).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any

from langchain_core.messages import AIMessage
from langgraph.types import Command

from intent import feedback as fb
from intent.human import HumanTopUps
from intent.messages import turns_before
from intent.off_loop import off_loop
from intent.model_meter import MODEL_OVER_BUDGET, MODEL_UNPRICED, ModelCallMeter, ModelCallRefused
from intent.pricing import UnpricedModelError
from intent.state import LEDGER_KEY, channel_of, current_config
from intent.top_ups import channel_base

if TYPE_CHECKING:
    from intent.guard import BudgetGuard

__all__ = ["HUMAN_DENIED", "MAX_ASKS", "ModelGate"]

HUMAN_DENIED = "human_denied"
MAX_ASKS = 3  # per call: after three top-ups that still do not make it fit, the refusal stands


class ModelGate:
    def __init__(self, guard: BudgetGuard) -> None:
        self.guard = guard

    def open(self, request: Any) -> tuple[ModelCallMeter, Any] | Any:
        """Price the request's worst case; a request that does not fit is answered here."""
        config = current_config()
        state = request.state or {}
        channel = channel_of(state)
        episode = self.guard.episodes.get(self.guard.episode_id(state, config), channel)
        messages = list(request.messages)
        step = turns_before(messages, len(messages), (channel or {}).get("turns"))  # the turn this call makes
        meter = ModelCallMeter(self.guard, episode, step=step, query=episode.task(channel, messages),
                               model=request.model, request_tail=messages[-1] if messages else None)
        settings = meter.request_settings(request.model_settings or {})
        prompt = [request.system_message, *messages] if request.system_message is not None else messages
        tools = _tool_schemas(request.tools or [])
        max_tokens = meter.max_tokens_of(settings or request.model_settings or {}, meter.model)
        ledger = episode.ledger
        try:
            name, _price, worst = meter.worst_case(prompt, tools, max_tokens, meter.default_name,
                                                   meter.completions_of(settings or request.model_settings or {},
                                                                        meter.model))
        except UnpricedModelError as exc:
            self.guard.records.model_refusal(ledger, episode_id=episode.episode_id, step=step, query=meter.query,
                                       model=meter.default_name or "", price=None, reason=MODEL_UNPRICED,
                                       text=str(exc))
            return self.stopped(meter, fb.model_unpriced(meter.default_name or "", str(exc)))
        humans = HumanTopUps(self.guard, episode)  # see intent.human: replay-safe top-ups
        try:
            refusal = self._fit_or_ask(meter, humans, name, worst, step)
        except BaseException:
            humans.rollback()
            raise
        humans.log()
        if refusal is not None:
            return self.stopped(meter, refusal)
        return meter, (request.override(model_settings=settings) if settings is not None else request)

    def _fit_or_ask(self, meter: ModelCallMeter, humans: HumanTopUps, name: str, worst: float,
                    step: int) -> str | None:
        """``None`` when the worst case fits (after a human's top-up, maybe); else the refusal text."""
        episode, ledger = meter.episode, meter.episode.ledger
        asked = 0
        while episode.stopped_reason or not ledger.fits(worst, "model"):
            if episode.stopped_reason:
                return episode.stopped_reason
            if self.guard.on_over_budget != "ask" or not self.guard.enforce or asked >= MAX_ASKS:
                if not self.guard.enforce:
                    return None
                text = fb.model_over_budget(name, worst, ledger.remaining_for("model"), ledger.budget)
                self.guard.records.model_refusal(ledger, episode_id=episode.episode_id, step=step, query=meter.query,
                                                 model=name, price=worst, reason=MODEL_OVER_BUDGET, text=text)
                return text
            shortfall = max(0.0, worst - ledger.remaining_for("model"))
            text = fb.model_over_budget(name, worst, ledger.remaining_for("model"), ledger.budget)
            action, _amount = humans.ask(None, None, f"top-up:model:{episode.episode_id}:{step}:{asked}", shortfall,
                                         kind="model", model=name, price=worst, text=text)
            asked += 1
            if action == "deny":
                self.guard.records.model_refusal(ledger, episode_id=episode.episode_id, step=step, query=meter.query,
                                                 model=name, price=worst, reason=HUMAN_DENIED, text=text)
                return text
        return None

    def update(self, meter: ModelCallMeter) -> Command:
        ledger = meter.episode.ledger
        entries = {e.call_id: ledger.get(e.call_id) for e in meter.entries}
        update = channel_base(meter.episode) | {
            "entries": {cid: e.to_dict() for cid, e in entries.items() if e is not None}}
        tops = ledger.top_ups
        if tops:
            update["top_ups"] = tops
            update["top_up_by"] = ledger.approved_by
        return Command(update={LEDGER_KEY: update})

    def stopped(self, meter: ModelCallMeter, text: str) -> Any:
        from langchain.agents.middleware.types import ExtendedModelResponse, ModelResponse

        message = AIMessage(content=text, response_metadata={"intent_stop": MODEL_OVER_BUDGET})
        return ExtendedModelResponse(model_response=ModelResponse(result=[message]), command=self.update(meter))

    def close(self, meter: ModelCallMeter, response: Any) -> Any:
        from langchain.agents.middleware.types import ExtendedModelResponse, ModelResponse

        if isinstance(response, AIMessage):
            response = ModelResponse(result=[response])
        meter.abandon()  # executions the step went on without (cancelled by their caller)
        meter.settle(getattr(response, "result", []) or [])
        return ExtendedModelResponse(model_response=response, command=self.update(meter))

    def wrap(self, request: Any, handler: Callable[[Any], Any]) -> Any:
        """Charge every execution of the agent's model; a call that does not fit is not made."""
        opened = self.open(request)
        if not isinstance(opened, tuple):
            return opened
        meter, metered = opened
        try:
            with meter.metering() as step:  # every chat-model execution inside, whatever the model
                response = handler(metered.override(model=meter.instrument(metered.model, step)))
        except ModelCallRefused as exc:  # a retry inside the guard that no longer fits
            meter.abandon()  # another call already sent (asyncio.gather) was billed
            return self.stopped(meter, fb.model_refused(str(exc)))
        except BaseException:
            # Cancelled from outside (a timeout around ainvoke: LangChain reports no error for the
            # requests in flight), an interrupt, a crash: requests already sent were billed; charged.
            meter.abandon()
            raise
        return self.close(meter, response)

    async def awrap(self, request: Any, handler: Callable[[Any], Awaitable[Any]]) -> Any:
        """Async twin of :meth:`wrap_model_call`. With a shared budget store, pricing the request (what is left
        there) and closing the step (its charges) run in a thread, not on the event loop (intent.off_loop)."""
        on_store = self.guard.reaches_store()
        opened = await off_loop(self.open, request) if on_store else self.open(request)
        if not isinstance(opened, tuple):
            return opened
        meter, metered = opened
        try:
            # (On a store, each execution's reservation and commit run in a thread too: model_meter's async twin.)
            with meter.metering(on_store=on_store) as step:  # every chat-model execution inside, whatever the model
                response = await handler(metered.override(model=meter.instrument(metered.model, step)))
        except ModelCallRefused as exc:
            if on_store:
                await off_loop(meter.abandon)
                return await off_loop(self.stopped, meter, fb.model_refused(str(exc)))
            meter.abandon()
            return self.stopped(meter, fb.model_refused(str(exc)))
        except BaseException:
            if on_store:
                await off_loop(meter.abandon)
            else:
                meter.abandon()
            raise
        return await off_loop(self.close, meter, response) if on_store else self.close(meter, response)


def _tool_schemas(tools: Sequence[Any]) -> list[Any]:
    from langchain_core.utils.function_calling import convert_to_openai_tool

    out = []
    for t in tools:
        try:
            out.append(t if isinstance(t, dict) else convert_to_openai_tool(t))
        except (TypeError, ValueError):
            out.append({"name": getattr(t, "name", str(t)), "description": getattr(t, "description", "")})
    return out
