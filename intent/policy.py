"""AgentPolicy: "given this (hypothetical) history, what would the agent do next?"

Rollouts (MCO, INTENT) call the agent's own model on a simulated history. It works over any
LangChain chat model with ``bind_tools`` — which includes the benchmark's simulated agent —
and counts the tokens it spends (``usage_metadata``), so the oracle's cost is reported.
A timeout or an unreachable server (``TimeoutError``, ``ConnectionError``, the httpx / openai
clients' errors) leaves as an :class:`~intent.errors.OracleUnavailableError` subclass, which
the planning oracles' fallback handles; any other exception from the model propagates.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from langchain_core.messages import AIMessage, BaseMessage, SystemMessage

from intent.arguments import is_list_arg
from intent.errors import model_call

__all__ = ["AgentPolicy"]


class AgentPolicy:
    """``replies_capped``: the model's replies are cut shorter than the agent's own (a rollout
    reply cap). A reply cut there before any call is then an unknown rest, not an answer; without
    it, a reply cut by the length limit is what the agent itself would have answered."""

    def __init__(self, model: Any, tools: Sequence[Any] = (), *, system_prompt: str | None = None,
                 replies_capped: bool = False) -> None:
        from intent.errors import GuardConfigError

        if not callable(getattr(model, "invoke", None)):
            raise GuardConfigError(f"AgentPolicy needs a LangChain chat model (with invoke), got "
                                   f"{type(model).__name__} {model!r:.80}; pass the agent's own chat model")
        if not is_list_arg(tools, mapping=True):
            raise GuardConfigError(f"AgentPolicy tools must be a list of the agent's tools, got {type(tools).__name__} "
                                   f"{tools!r:.80}; pass [tool, ...] (or leave it out)")
        self.model = model
        self.tools = list(tools)
        self.system_prompt = system_prompt
        self.replies_capped = replies_capped

    def next_action(self, history: Sequence[BaseMessage], *, visible: Iterable[str] | None = None,
                    notes: str | None = None) -> tuple[AIMessage, int]:
        """The agent's next message on ``history`` and the tokens it cost."""
        allowed = None if visible is None else set(visible)
        tools = [t for t in self.tools if allowed is None or _name(t) in allowed]
        system = "\n\n".join(x for x in (self.system_prompt, notes) if x)
        messages = ([SystemMessage(system)] if system else []) + [m for m in history
                                                                   if not isinstance(m, SystemMessage)]
        bound = self.model.bind_tools(tools) if tools and hasattr(self.model, "bind_tools") else self.model
        with model_call(f"the agent policy's model ({type(self.model).__name__})"):
            reply = bound.invoke(messages)
        if not isinstance(reply, AIMessage):
            reply = AIMessage(str(getattr(reply, "content", reply)))
        tokens = int((reply.usage_metadata or {}).get("total_tokens", 0))
        return reply, tokens


def _name(tool: Any) -> str:
    return tool["name"] if isinstance(tool, dict) else getattr(tool, "name", str(tool))
