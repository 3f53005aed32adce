"""A real LangChain chat model as the benchmark agent (OpenAI, vLLM, llama.cpp server, ...).

``--agent openai:gpt-4.1-mini`` uses ``langchain.chat_models.init_chat_model``;
``--base-url http://127.0.0.1:8000/v1`` points it at any OpenAI-compatible server. The
endpoint is checked at startup (``GET /models``), so a wrong URL fails in seconds, not after
an hour of episodes.
"""

from __future__ import annotations

import json
import os
import urllib.error
import urllib.request
from typing import Any

__all__ = ["EndpointError", "chat_agent_factory", "check_endpoint"]


class EndpointError(ValueError):
    """An OpenAI-compatible endpoint cannot be reached or does not answer like one."""


def check_endpoint(base_url: str, *, api_key: str | None = None, timeout: float = 5.0) -> list[str]:
    """Return the model ids the server lists; raise :class:`EndpointError` naming the URL otherwise."""
    url = base_url.rstrip("/") + "/models"
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {api_key or 'EMPTY'}"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:  # noqa: S310 - user-given URL
            data = json.loads(response.read().decode() or "{}")
    except (urllib.error.URLError, TimeoutError, OSError) as exc:
        raise EndpointError(f"cannot reach the OpenAI-compatible endpoint {url}: {exc}; "
                            "check --base-url and that the server is running") from exc
    except json.JSONDecodeError as exc:
        raise EndpointError(f"{url} did not answer with JSON; is --base-url the server's /v1 root?") from exc
    return [m.get("id", "") for m in data.get("data", []) if isinstance(m, dict)]


def chat_agent_factory(spec: str, options: dict[str, Any] | None = None) -> Any:
    """Build the agent factory for a chat model spec such as ``openai:gpt-4.1-mini``."""
    from langchain.chat_models import init_chat_model

    options = dict(options or {})
    kwargs: dict[str, Any] = {"temperature": options.get("temperature", 0.0)}
    base_url = options.get("base_url")
    if base_url:
        api_key = options.get("api_key") or os.environ.get("OPENAI_API_KEY") or "EMPTY"
        check_endpoint(base_url, api_key=api_key)
        kwargs.update(base_url=base_url, api_key=api_key, timeout=options.get("timeout", 120))
    if ":" not in spec:
        raise ValueError(f"--agent {spec!r} is not 'sim' or a 'provider:model' spec such as openai:gpt-4.1-mini")
    try:
        model = init_chat_model(spec, **kwargs)
    except ImportError as exc:
        raise ValueError(f"--agent {spec!r} needs its provider package ({exc}); "
                         "`make install` includes langchain-openai") from exc

    def build(env: Any, seed: int) -> Any:
        return model

    return build
