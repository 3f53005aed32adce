"""Is an OpenAI-compatible endpoint there, and does it serve the model? Checked before any work starts.

:func:`check_endpoint` and :func:`check_model` ask the server's ``GET /models`` (standard library only):
a wrong URL, a server that is down, a wrong key or a model the server does not serve fails in seconds
with one line (an :class:`EndpointError`, a :class:`~intent.errors.UsageError` naming the URL and the
flag that gave it), never after an hour of failed requests. The benchmark's chat agents
(:mod:`eval.agents.chat`), the StableToolBench mirror environment and the LLM judge of ``intent train
annotate`` (:mod:`training.annotate`) all check their endpoint here, next to the world model that
talks to the same kind of server (:mod:`worldmodel.openai_compat`).
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any

from intent.errors import UsageError

__all__ = ["EndpointError", "check_endpoint", "check_model"]


class EndpointError(UsageError):
    """An OpenAI-compatible endpoint cannot be reached or does not answer like one."""


def check_endpoint(base_url: str, *, api_key: str | None = None, timeout: float = 5.0,
                   url_flag: str = "--base-url") -> list[str]:
    """Return the model ids the server lists; raise :class:`EndpointError` naming the URL (and the flag
    that gave it, ``url_flag``) otherwise."""
    return [m.get("id", "") for m in _model_cards(base_url, api_key=api_key, timeout=timeout, url_flag=url_flag)]


def _model_cards(base_url: str, *, api_key: str | None, timeout: float,
                 url_flag: str = "--base-url") -> list[dict[str, Any]]:
    if not str(base_url).startswith(("http://", "https://")):
        raise EndpointError(f"{url_flag} {base_url!r} is not an http(s) URL; give the server's /v1 root, e.g. "
                            "http://127.0.0.1:8000/v1")
    url = base_url.rstrip("/") + "/models"
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {api_key or 'EMPTY'}"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:  # noqa: S310 - user-given URL
            data = json.loads(response.read().decode() or "{}")
    except urllib.error.HTTPError as exc:
        hint = "check the API key (OPENAI_API_KEY)" if exc.code in (401, 403) else f"is {url_flag} the server's /v1 root?"
        raise EndpointError(f"{url} answered HTTP {exc.code} {exc.reason}; {hint}") from exc
    except (urllib.error.URLError, TimeoutError, OSError) as exc:
        raise EndpointError(f"cannot reach the OpenAI-compatible endpoint {url}: {exc}; "
                            f"check {url_flag} and that the server is running") from exc
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise EndpointError(f"{url} did not answer with JSON; is {url_flag} the server's /v1 root?") from exc
    if not isinstance(data, dict) or not isinstance(data.get("data", []), list):
        raise EndpointError(f"{url} did not answer with an OpenAI model list; is {url_flag} the server's /v1 root?")
    return [m for m in data.get("data", []) if isinstance(m, dict)]


def check_model(base_url: str, model: str, *, api_key: str | None = None, timeout: float = 5.0,
                flag: str = "--agent openai:", max_tokens: int | None = None, url_flag: str = "--base-url") -> list[str]:
    """Check that ``base_url`` answers and serves ``model``; return the served ids.

    With ``max_tokens``: a server that says its context length (vLLM's ``max_model_len``) must
    leave room for a prompt besides the reply cap. vLLM refuses such a request with the same
    "maximum context length" error as a full history, so without this check every episode would
    end at its first call as if its context had filled up.
    """
    cards = _model_cards(base_url, api_key=api_key, timeout=timeout, url_flag=url_flag)
    served = [c.get("id", "") for c in cards]
    if model not in served:
        listed = ", ".join(served[:10]) + (" ..." if len(served) > 10 else "") if served else "none"
        raise EndpointError(f"model {model!r} is not served at {base_url.rstrip('/')} (it serves: {listed}); "
                            f"pass {flag}<one of those>")
    context = next((c.get("max_model_len") for c in cards if c.get("id") == model), None)
    if max_tokens is not None and isinstance(context, int) and not isinstance(context, bool) and max_tokens >= context:
        raise EndpointError(f"--max-tokens {max_tokens} leaves no room for a prompt: {model!r} is served with a "
                            f"context of {context} tokens (max_model_len); pass --max-tokens below it (e.g. "
                            f"{max(1, context // 16)}) or serve the model with a longer context")
    return served
