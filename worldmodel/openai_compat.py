"""World models behind any OpenAI-compatible server (vLLM in production, llama.cpp, a test stub).

``OpenAICompatibleWorldModel(base_url, model, *, timeout=30, retries=2, max_concurrency=8,
temperature=1.0, max_tokens=512)``. The prompts are :mod:`worldmodel.formats`'s, so a model
trained by ``intent train worldmodel`` and served with ``intent serve worldmodel DIR`` answers
in the format it was trained on. Errors (connection, timeout after the retries, HTTP errors,
replies without content) raise :class:`~worldmodel.protocols.ModelError`.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping
from typing import Any

from worldmodel.formats import world_model_messages
from worldmodel.protocols import ModelError

__all__ = ["OpenAICompatibleWorldModel"]


class OpenAICompatibleWorldModel:
    name = "openai_compatible"

    def __init__(self, base_url: str, model: str, *, api_key: str = "EMPTY", timeout: float = 30.0,
                 retries: int = 2, max_concurrency: int = 8, temperature: float = 1.0, max_tokens: int = 512,
                 backoff: float = 0.5, transport: Any = None) -> None:
        import httpx

        if not base_url.startswith(("http://", "https://")):
            raise ValueError(f"base_url must start with http:// or https://, got {base_url!r}")
        if retries < 0 or max_concurrency < 1 or timeout <= 0:
            raise ValueError("retries must be >= 0, max_concurrency >= 1 and timeout > 0")
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

    def simulate(self, tool: str, args: Mapping[str, Any], *, satisfied: bool | None = None) -> str:
        return self.simulate_with_usage(tool, args, satisfied=satisfied)[0]

    def simulate_with_usage(self, tool: str, args: Mapping[str, Any], *, satisfied: bool | None = None
                            ) -> tuple[str, int]:
        body = {
            "model": self.model,
            "messages": world_model_messages(tool, args, satisfied),
            "temperature": self.temperature,
            "max_tokens": self.max_tokens,
        }
        last: Exception | None = None
        for attempt in range(self.retries + 1):
            try:
                with self._slots:
                    response = self._client.post("/chat/completions", json=body)
                if response.status_code >= 500 or response.status_code == 429:
                    raise ModelError(f"world model server answered HTTP {response.status_code}")
                if response.status_code >= 400:
                    raise ModelError(f"world model request rejected: HTTP {response.status_code}: "
                                     f"{response.text[:200]}")  # not retried: the request itself is wrong
                return self._parse(response)
            except ModelError as exc:
                if "rejected" in str(exc) or "malformed" in str(exc):
                    raise
                last = exc
            except self._httpx.HTTPError as exc:  # connect errors, timeouts
                last = ModelError(f"world model server {self.base_url} failed: {type(exc).__name__}: {exc}")
            if attempt < self.retries:
                time.sleep(self.backoff * (2 ** attempt))
        raise last if isinstance(last, ModelError) else ModelError(str(last))

    @staticmethod
    def _parse(response: Any) -> tuple[str, int]:
        try:
            data = response.json()
            content = data["choices"][0]["message"]["content"]
        except (ValueError, KeyError, IndexError, TypeError) as exc:
            raise ModelError(f"malformed world model reply (no choices[0].message.content): "
                             f"{response.text[:200]!r}") from exc
        if not isinstance(content, str):
            raise ModelError(f"malformed world model reply: content is {type(content).__name__}")
        tokens = int((data.get("usage") or {}).get("total_tokens") or 0)
        return content, tokens
