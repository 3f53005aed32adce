"""World models behind any OpenAI-compatible server (vLLM in production, llama.cpp, a test stub).

``OpenAICompatibleWorldModel(base_url, model, *, timeout=30, retries=2, max_concurrency=8,
temperature=1.0, max_tokens=512)``; ``simulate(..., temperature=t)`` overrides the temperature for
one request (how MCO samples at its own setting). The prompts are :mod:`worldmodel.formats`'s, so a model
trained by ``intent train worldmodel`` and served with ``intent serve worldmodel DIR`` answers
in the format it was trained on.

Every error is a :class:`~worldmodel.protocols.ModelError` and also says whether an oracle may
fall back on it (:mod:`intent.errors`):

* :class:`WorldModelTimeout` (an :class:`~intent.errors.OracleTimeoutError`): no answer in
  ``timeout`` seconds, after the retries;
* :class:`WorldModelUnreachable` (a :class:`~intent.errors.ModelUnreachableError`): connection
  refused or dropped, or HTTP 5xx / 429, after the retries;
* :class:`MalformedWorldModelReply` (a :class:`~intent.errors.MalformedModelOutputError`): a
  reply without ``choices[0].message.content`` (not retried);
* :class:`WorldModelRequestRejected` (a :class:`~intent.errors.ModelRequestError`, *not*
  recoverable): any other HTTP 4xx, i.e. a wrong model name, path or key (not retried).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Mapping
from typing import Any

from intent.errors import UsageError
from intent.errors import (
    ContextOverflowError,
    MalformedModelOutputError,
    ModelRequestError,
    ModelUnreachableError,
    OracleTimeoutError,
    says_context_overflow,
)
from worldmodel.formats import world_model_messages
from worldmodel.protocols import ModelError

__all__ = [
    "ChatRetriesExhausted",
    "MalformedWorldModelReply",
    "OpenAICompatibleWorldModel",
    "WorldModelRequestRejected",
    "WorldModelTimeout",
    "WorldModelUnreachable",
]


class WorldModelTimeout(ModelError, OracleTimeoutError):
    """The server did not answer within the timeout, after the retries (recoverable)."""


class WorldModelUnreachable(ModelError, ModelUnreachableError):
    """The server could not be reached, dropped the connection, or answered 5xx / 429 (recoverable)."""


class MalformedWorldModelReply(ModelError, MalformedModelOutputError):
    """The server answered without ``choices[0].message.content`` (recoverable)."""


class WorldModelContextOverflow(ModelError, ContextOverflowError):
    """The prompt is longer than the served model's context (HTTP 400 saying so): recoverable."""


class WorldModelRequestRejected(ModelError, ModelRequestError):
    """HTTP 4xx (not 429): the request itself is wrong (model name, path, key). Not recoverable."""


class ChatRetriesExhausted(Exception):
    """Every attempt of :func:`post_chat` failed transiently; ``detail`` says how the last did, ``timed_out``
    whether it was a timeout. Callers raise their own documented error from it."""

    def __init__(self, detail: str, *, timed_out: bool, attempts: int) -> None:
        super().__init__(detail)
        self.detail, self.timed_out, self.attempts = detail, timed_out, attempts


def post_chat(client: Any, body: Mapping[str, Any], *, retries: int, backoff: float,
              slots: Any = None) -> Any:
    """POST ``body`` to an OpenAI-compatible ``/chat/completions`` through the httpx ``client``. A timeout, a
    refused or dropped connection, HTTP 5xx or 429 is asked again ``retries`` times (pauses of ``backoff``
    doubling), then :class:`ChatRetriesExhausted`; any other response (2xx, or a 4xx: the request itself is
    wrong, asking again gives the same) is returned for the caller to read. ``slots``: a semaphore held
    around each request (bounded concurrency)."""
    import httpx

    for attempt in range(retries + 1):
        try:
            with slots if slots is not None else contextlib.nullcontext():
                response = client.post("/chat/completions", json=body)
        except httpx.TimeoutException as exc:
            detail, timed_out = f"{type(exc).__name__}: no answer within the timeout ({exc})", True
        except httpx.TransportError as exc:  # connect / read / write errors, dropped connections
            detail, timed_out = f"{type(exc).__name__}: {exc}", False
        else:
            if response.status_code < 500 and response.status_code != 429:
                return response
            detail, timed_out = f"answered HTTP {response.status_code}", False
        if attempt < retries:
            time.sleep(backoff * (2 ** attempt))
    raise ChatRetriesExhausted(detail, timed_out=timed_out, attempts=retries + 1)


class OpenAICompatibleWorldModel:
    name = "openai_compatible"

    def __init__(self, base_url: str, model: str, *, api_key: str = "EMPTY", timeout: float = 30.0,
                 retries: int = 2, max_concurrency: int = 8, temperature: float = 1.0, max_tokens: int = 512,
                 backoff: float = 0.5, transport: Any = None) -> None:
        import httpx

        if not base_url.startswith(("http://", "https://")):
            raise UsageError(f"base_url must start with http:// or https://, got {base_url!r}")
        if retries < 0 or max_concurrency < 1 or timeout <= 0:
            raise UsageError(f"retries must be >= 0, max_concurrency >= 1 and timeout > 0, got {retries}, {max_concurrency} "
                             f"and {timeout}")
        self.base_url = base_url.rstrip("/")
        self.model = model
        self.temperature = temperature
        self.max_tokens = max_tokens
        self.retries = retries
        self.backoff = backoff
        self._httpx = httpx
        self._client = httpx.Client(base_url=self.base_url, timeout=timeout, transport=transport,
                                    headers={"Authorization": f"Bearer {api_key}"})
        self._slots = threading.BoundedSemaphore(max_concurrency)

    def close(self) -> None:
        self._client.close()

    def simulate(self, tool: str, args: Mapping[str, Any], *, satisfied: bool | None = None,
                 temperature: float | None = None) -> str:
        return self.simulate_with_usage(tool, args, satisfied=satisfied, temperature=temperature)[0]

    def simulate_with_usage(self, tool: str, args: Mapping[str, Any], *, satisfied: bool | None = None,
                            temperature: float | None = None) -> tuple[str, int]:
        """``temperature`` is this request's sampling temperature (None: the one set at construction)."""
        body = {
            "model": self.model,
            "messages": world_model_messages(tool, args, satisfied),
            "temperature": self.temperature if temperature is None else float(temperature),
            "max_tokens": self.max_tokens,
        }
        # Raised at once: a 4xx (the request itself is wrong) and a malformed reply (asking again gives the same).
        try:
            response = post_chat(self._client, body, retries=self.retries, backoff=self.backoff, slots=self._slots)
        except ChatRetriesExhausted as exc:
            error = WorldModelTimeout if exc.timed_out else WorldModelUnreachable
            raise error(f"world model server {self.base_url} failed: {exc.detail}") from None
        if response.status_code == 400 and says_context_overflow(response.text):
            raise WorldModelContextOverflow(
                f"world model prompt too long for {self.model!r}: HTTP 400: {response.text[:200]}")
        if response.status_code >= 400:
            raise WorldModelRequestRejected(
                f"world model request rejected: HTTP {response.status_code}: {response.text[:200]}; "
                f"check the model name ({self.model!r}), the base URL ({self.base_url}) and the API key")
        return self._parse(response)

    @staticmethod
    def _parse(response: Any) -> tuple[str, int]:
        try:
            data = response.json()
            content = data["choices"][0]["message"]["content"]
        except (ValueError, KeyError, IndexError, TypeError) as exc:
            raise MalformedWorldModelReply(f"malformed world model reply (no choices[0].message.content): "
                                           f"{response.text[:200]!r}") from exc
        if not isinstance(content, str):
            raise MalformedWorldModelReply(f"malformed world model reply: content is {type(content).__name__}")
        tokens = int((data.get("usage") or {}).get("total_tokens") or 0)
        return content, tokens
