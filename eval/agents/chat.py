"""A real LangChain chat model as the benchmark agent (OpenAI, vLLM, llama.cpp server, ...).

``--agent openai:gpt-4.1-mini`` uses ``langchain.chat_models.init_chat_model``;
``--base-url http://127.0.0.1:8000/v1`` points it at any OpenAI-compatible server. Before any
episode runs, the endpoint is checked (``GET /models``) and so is the model name: a wrong URL
or a model the server does not serve fails in seconds with one line, never with a table of
failed episodes. An ``openai:`` agent with neither ``--base-url`` nor ``OPENAI_API_KEY`` fails
the same way. ``max_tokens`` (``--max-tokens``, default 512) caps each reply of the agent;
``rollout_max_tokens`` (``--rollout-max-tokens``) caps the replies INTENT's and MCO's rollouts
ask of the same model (:func:`with_reply_cap`).
"""

from __future__ import annotations

import os
from typing import Any

from intent.errors import UsageError
from worldmodel.endpoints import EndpointError, check_endpoint, check_model

__all__ = ["DEFAULT_MAX_TOKENS", "EndpointError", "chat_agent_factory", "check_endpoint", "check_model",
           "check_rollout_max_tokens", "with_reply_cap"]

DEFAULT_MAX_TOKENS = 512
OPENAI_URL = "https://api.openai.com/v1"


def check_rollout_max_tokens(value: Any) -> None:
    """``--rollout-max-tokens``: absent, or an integer >= 16 (a tool call needs a few dozen tokens)."""
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 16:
        raise UsageError(f"--rollout-max-tokens must be an integer >= 16 (tokens per rollout reply of the agent's "
                         f"model), got {value!r}; without a cap rollouts use the agent's own --max-tokens")


def with_reply_cap(model: Any, cap: int) -> Any:
    """A copy of a LangChain chat model whose replies stop at ``cap`` tokens.

    Why: a rollout needs the agent's next calls, not the whole reply. A 0.5B model on a CPU wrote
    300-400 tokens per reply (the same call over and over), about 40 s each, so one gate decision
    took 3 s to 8.5 minutes. The complete calls before the cut count; a reply cut before its first
    complete call truncates the rollout there and is counted (``rollouts_capped``), not read as an answer.
    """
    check_rollout_max_tokens(cap)
    fields = getattr(type(model), "model_fields", {})
    if "max_tokens" not in fields:
        raise UsageError(f"--rollout-max-tokens caps a chat model's replies, but the agent's model "
                         f"{type(model).__name__} has no max_tokens setting; use it with --agent openai:NAME, "
                         "or leave it out")
    own = getattr(model, "max_tokens", None)
    # Never above the agent's own cap: a rollout predicts the agent's replies, which stop there.
    return model.model_copy(update={"max_tokens": min(cap, own) if isinstance(own, int) else cap})


def chat_agent_factory(spec: str, options: dict[str, Any] | None = None) -> Any:
    """Build the agent factory for a chat model spec such as ``openai:gpt-4.1-mini``.

    ``options``: ``base_url``, ``api_key``, ``max_tokens`` (default 512), ``temperature`` (0),
    ``timeout`` (120 s per request).
    """
    options = dict(options or {})
    if ":" not in spec or not spec.split(":", 1)[1].strip():
        raise UsageError(f"--agent {spec!r} is not 'sim', 'sim-llm' or a 'provider:model' spec such as "
                         "openai:gpt-4.1-mini")
    provider, name = (part.strip() for part in spec.split(":", 1))
    max_tokens = options.get("max_tokens", DEFAULT_MAX_TOKENS)
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise UsageError(f"--max-tokens must be an integer >= 1, got {max_tokens!r}")
    kwargs: dict[str, Any] = {"temperature": options.get("temperature", 0.0), "max_tokens": max_tokens}
    base_url = options.get("base_url")
    api_key = options.get("api_key") or os.environ.get("OPENAI_API_KEY")
    if base_url:
        api_key = api_key or "EMPTY"
        check_model(base_url, name, api_key=api_key, max_tokens=max_tokens)
        kwargs.update(base_url=base_url, api_key=api_key, timeout=options.get("timeout", 120))
    elif provider == "openai":
        if not api_key:
            raise EndpointError(f"--agent {spec} needs OPENAI_API_KEY in the environment, or --base-url URL of an "
                                "OpenAI-compatible server (vLLM, llama.cpp: http://127.0.0.1:8000/v1)")
        check_model(os.environ.get("OPENAI_BASE_URL") or OPENAI_URL, name, api_key=api_key,
                    url_flag="OPENAI_BASE_URL (or --base-url)")
        kwargs["timeout"] = options.get("timeout", 120)
    from langchain.chat_models import init_chat_model

    try:
        model = init_chat_model(spec, **kwargs)
    except ImportError as exc:
        raise UsageError(f"--agent {spec!r} needs its provider package ({exc}); "
                         "`make install` includes langchain-openai") from exc

    def build(env: Any, seed: int) -> Any:
        return model

    return build
