"""Remote tool environments: an OpenAI-compatible simulator (MirrorAPI style) and a running
StableToolBench server. Both need ``httpx`` (the ``openai`` / ``dev`` extras).

MirrorAPI protocol (``server/main_mirrorapi.py``): the user prompt is
``API doc:\\n{api_doc}\\n\\nRequest:\\n{request}`` (Python ``str()`` of both dicts) with
``api_doc = {api_name, api_description, required_parameters, optional_parameters,
tool_description, tool_name, tool_category}``; sampling temperature 0.1, max_tokens 2048,
seed 42; the answer is parsed to ``{error, response}`` with a regex fallback. The system prompt
below paraphrases upstream ``SFT_SYSTEM``; pass ``system_prompt=`` to use the exact text your
MirrorAPI checkpoint was trained with. Tool descriptions are not in the query files: pass
``tool_descriptions={standard_tool_name: text}`` if you have them (default ``""``).

Server protocol (``rapidapi.py`` ``_step``): ``POST .../virtual`` with
``{category, tool_name, api_name, tool_input, strip, toolbench_key}`` where ``tool_name`` is the
standardized tool name and ``api_name`` the standardized API name; the JSON answer is returned as
``json.dumps(answer)`` with the client's status codes (timeout 5, HTTP != 200 or non-JSON 12,
known server errors 6..11, otherwise 0).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from typing import Any

from intent.errors import UsageError

from .env_base import (
    ERROR_STATUS_CODES,
    PARSE_ERROR,
    BaseToolEnvironment,
    ToolResult,
    envelope,
    parse_tool_input,
)
from .loader import StbApi
from .naming import standardize, standardize_category
from .payload import canonical_arguments

__all__ = ["MIRROR_SYSTEM_PROMPT", "OpenAICompatibleSimulator", "ServerEnvironment", "parse_simulator_output"]

FAILED_TO_GENERATE = "Failed to generate fake response"

MIRROR_SYSTEM_PROMPT = """\
Imagine you are an API Server inside a specialized tool that offers a set of distinct APIs. \
Understand what each API does from its documentation. For every API call you receive, work out \
what the input is asking for and write a JSON response that matches what this API would return. \
The JSON scheme is:
{
    "error": "",
    "response": ""
}

Keep the error field empty, meaning the request was processed. Put in the response field the \
content that this API would produce for the given input: meaningful, practical and directly \
about what the API is for. Keep the JSON valid and write nothing outside the JSON object; it must \
parse directly as JSON.
Note that:
- your response should carry rich information that depends on the input parameters.
- your response must be useful and have practical content.

API calls can fail (invalid parameters, authentication or server problems). Even then, produce \
a response that reflects what the API is meant to return and explain the expected output for \
the given input.
"""


def _httpx() -> Any:
    try:
        import httpx
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError(
            "httpx is needed for the MirrorAPI / server environments: run `make install` or "
            "`pip install -e .[openai]`"
        ) from exc
    return httpx


def _strip_fences(text: str) -> str:
    if "```" in text:
        text = text.replace("```json", "").replace("```", "").strip()
    return text


_COT_PATTERN = re.compile(
    r'"mechanism_of_the_api"\s*:\s*"(.*?)",\s*"error"\s*:\s*"(.*?)",\s*"response"\s*:\s*"(.*)', re.DOTALL
)
_PLAIN_PATTERN = re.compile(r'"error":\s*"([^"]*)",\s*"response":\s*"(.*)', re.DOTALL)


def parse_simulator_output(text: str) -> tuple[str, Any] | None:
    """``(error, response)`` from a simulator answer: JSON first, then upstream's regex fallback."""
    text = _strip_fences(text or "")
    try:
        data = json.loads(text)
    except ValueError:
        data = None
    if isinstance(data, dict):
        if "error" not in data and "response" not in data:
            return None
        err = data.get("error", "")
        return ("" if err is None else str(err) if not isinstance(err, str) else err), data.get("response", "")
    pattern = _COT_PATTERN if "mechanism_of_the_api" in text else _PLAIN_PATTERN
    m = pattern.search(text)
    if not m:
        return None
    groups = m.groups()
    return groups[-2], groups[-1]


class _HttpEnvironment(BaseToolEnvironment):
    def __init__(self, apis: Iterable[StbApi], timeout: float, client: Any | None, **kwargs: Any) -> None:
        super().__init__(apis, **kwargs)
        if timeout <= 0:
            raise UsageError(f"timeout must be > 0 seconds (per request), got {timeout}")
        self.timeout = timeout
        self._client = client
        self._owns_client = client is None

    @property
    def client(self) -> Any:
        if self._client is None:
            self._client = _httpx().Client(timeout=self.timeout)
        return self._client

    def close(self) -> None:
        if self._owns_client and self._client is not None:
            self._client.close()
            self._client = None

    def __enter__(self) -> _HttpEnvironment:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _post(self, url: str, body: dict[str, Any], headers: dict[str, str]) -> tuple[Any | None, ToolResult | None]:
        """POST JSON; returns (parsed JSON, None) or (None, an error ToolResult with client codes)."""
        httpx = _httpx()
        try:
            resp = self.client.post(url, json=body, headers=headers, timeout=self.timeout)
        except httpx.TimeoutException:
            err = "Timeout error..."
            return None, self._result(envelope(err, ""), 5, err)
        except httpx.HTTPError as exc:
            err = f"request invalid, data error. {type(exc).__name__}"
            return None, self._result(envelope(err, ""), 12, err)
        if resp.status_code != 200:
            err = f"request invalid, data error. status_code={resp.status_code}"
            return None, self._result(envelope(err, ""), 12, err)
        try:
            return resp.json(), None
        except ValueError:
            err = "request invalid, data error"
            return None, self._result(envelope(err, ""), 12, err)


class ServerEnvironment(_HttpEnvironment):
    """Calls a running StableToolBench virtual server (``POST <url>``, ``/virtual`` appended if absent)."""

    environment = "stabletoolbench-server"

    def __init__(
        self,
        url: str,
        apis: Iterable[StbApi],
        toolbench_key: str = "",
        strip: str = "",
        timeout: float = 60.0,
        client: Any | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(apis, timeout, client, **kwargs)
        url = url.rstrip("/")
        self.url = url if url.endswith("/virtual") else url + "/virtual"
        self.toolbench_key = toolbench_key
        self.strip = strip

    def request_body(self, api: StbApi, arguments: str | Mapping[str, Any]) -> dict[str, Any]:
        return {
            "category": api.category,
            "tool_name": standardize(api.tool_name),
            "api_name": api.pure_api_name,
            "tool_input": dict(arguments) if isinstance(arguments, Mapping) else arguments,
            "strip": self.strip,
            "toolbench_key": self.toolbench_key,
        }

    def _call_api(self, api: StbApi, arguments: str | Mapping[str, Any]) -> ToolResult:
        data, failure = self._post(self.url, self.request_body(api, arguments), {"toolbench_key": self.toolbench_key})
        if failure is not None:
            return failure
        if not isinstance(data, dict):
            err = "request invalid, data error"
            return self._result(envelope(err, ""), 12, err)
        error = data.get("error", "")
        error = "" if error is None else str(error)
        return self._result(json.dumps(data), ERROR_STATUS_CODES.get(error, 0), error)


class OpenAICompatibleSimulator(_HttpEnvironment):
    """MirrorAPI-style simulation through any OpenAI-compatible ``/chat/completions`` endpoint.

    SIMULATED responses. Repeated identical calls are answered from an in-memory cache keyed by
    (function, canonical arguments) unless ``cache=False``.
    """

    def __init__(
        self,
        apis: Iterable[StbApi],
        base_url: str,
        model: str,
        api_key: str = "EMPTY",
        timeout: float = 120.0,
        temperature: float = 0.1,
        max_tokens: int = 2048,
        seed: int | None = 42,
        system_prompt: str = MIRROR_SYSTEM_PROMPT,
        tool_descriptions: Mapping[str, str] | None = None,
        cache: bool = True,
        client: Any | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(apis, timeout, client, **kwargs)
        self.url = base_url.rstrip("/") + "/chat/completions"
        self.model = model
        self.api_key = api_key
        self.temperature = temperature
        self.max_tokens = max_tokens
        self.seed = seed
        self.system_prompt = system_prompt
        self.tool_descriptions = dict(tool_descriptions or {})
        self.environment = f"mirrorapi-simulated:{model}"
        self._cache: dict[tuple[str, str], ToolResult] | None = {} if cache else None

    def api_doc(self, api: StbApi) -> dict[str, Any]:
        def raw(params: tuple) -> list[dict[str, Any]]:
            return [{"name": p.name, "type": p.type, "description": p.description, "default": p.default} for p in params]

        std_tool = standardize(api.tool_name)
        return {
            "api_name": api.api_name,
            "api_description": api.description,
            "required_parameters": raw(api.required),
            "optional_parameters": raw(api.optional),
            "tool_description": self.tool_descriptions.get(std_tool, ""),
            "tool_name": std_tool,
            "tool_category": standardize_category(api.category),
        }

    def messages(self, api: StbApi, args: Mapping[str, Any]) -> list[dict[str, str]]:
        request = {k: v for k, v in args.items() if k != "toolbench_key"}
        user = f"API doc:\n{self.api_doc(api)}\n\nRequest:\n{request}"
        return [{"role": "system", "content": self.system_prompt}, {"role": "user", "content": user}]

    def _call_api(self, api: StbApi, arguments: str | Mapping[str, Any]) -> ToolResult:
        args = parse_tool_input(arguments)
        if args is None:
            return self._result(envelope(PARSE_ERROR, ""), 0, PARSE_ERROR)
        key = (api.function_name, canonical_arguments(args))
        if self._cache is not None and key in self._cache:
            return self._cache[key]
        body: dict[str, Any] = {
            "model": self.model,
            "messages": self.messages(api, args),
            "temperature": self.temperature,
            "max_tokens": self.max_tokens,
        }
        if self.seed is not None:
            body["seed"] = self.seed
        data, failure = self._post(self.url, body, {"Authorization": f"Bearer {self.api_key}"})
        if failure is not None:
            return failure
        try:
            content = data["choices"][0]["message"]["content"] or ""
        except (KeyError, IndexError, TypeError):
            err = "request invalid, data error"
            return self._result(envelope(err, ""), 12, err)
        parsed = parse_simulator_output(content)
        if parsed is None or not (parsed[0] or parsed[1]):
            # Upstream's fallback answer; not cached, so a later identical call can retry.
            return self._result(envelope(FAILED_TO_GENERATE, ""), 0, FAILED_TO_GENERATE)
        error, response = parsed
        result = self._result(envelope(error, response), ERROR_STATUS_CODES.get(error, 0), error)
        if self._cache is not None:
            self._cache[key] = result
        return result
