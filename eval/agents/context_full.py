"""The benchmark's real-LLM agent stops when its context is full, instead of crashing the episode.

A small model's history outgrows its context window after enough turns of tool results and refusal
notes (Qwen2.5-Coder-0.5B, 8,192 tokens: a tracker episode died on the server's HTTP 400 after 459 s,
its spend within budget). A real agent cannot go on at that point either, so the episode ends there
without an answer: it fails, its spend counts as usual (within budget or not), and it is listed as
``context_full``, not as a crash. Any other model error still crashes the episode.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from langchain.agents.middleware import AgentMiddleware
from langchain_core.messages import AIMessage

from intent.errors import UsageError, is_context_overflow

__all__ = ["CONTEXT_FULL", "PromptDoesNotFitError", "StopWhenContextFull", "ended_on_full_context"]

CONTEXT_FULL = "intent_context_full"  # response_metadata flag on the empty final message


class PromptDoesNotFitError(UsageError):
    """The episode's first model call does not fit the model's context: a configuration error
    (the reply cap, the tools' schemas or the system prompt are too large for the model), not a
    history that grew too long."""


def _stop(request: Any, exc: Exception) -> AIMessage:
    if not any(isinstance(m, AIMessage) for m in getattr(request, "messages", None) or []):
        raise PromptDoesNotFitError(
            f"the episode's first model call does not fit the model's context ({exc}); lower --max-tokens, "
            "or serve the model with a longer context (vLLM: --max-model-len)") from exc
    return AIMessage(content="", response_metadata={CONTEXT_FULL: True, "error": f"{type(exc).__name__}: {exc}"[:300]})


class StopWhenContextFull(AgentMiddleware):
    """Outermost around the model call: a context overflow after the first turn becomes an empty
    final message; one on the first call is a configuration error and is raised."""

    def wrap_model_call(self, request: Any, handler: Callable[[Any], Any]) -> Any:
        try:
            return handler(request)
        except Exception as exc:
            if not is_context_overflow(exc):
                raise
            return _stop(request, exc)

    async def awrap_model_call(self, request: Any, handler: Callable[[Any], Awaitable[Any]]) -> Any:
        try:
            return await handler(request)
        except Exception as exc:
            if not is_context_overflow(exc):
                raise
            return _stop(request, exc)


def ended_on_full_context(messages: list[Any]) -> bool:
    last = messages[-1] if messages else None
    return isinstance(last, AIMessage) and bool((last.response_metadata or {}).get(CONTEXT_FULL))
