"""Shared tool-environment plumbing: results, Finish, name resolution, argument parsing, truncation.

Faithful to StableToolBench's client (``rapidapi.py``) and server:

* ``Finish`` is handled first (codes 3 give_answer, 4 give_up_and_restart, 2 malformed);
* any other name resolves to the **first** function whose name ``endswith(action_name)``;
  no match -> ``{"error": "No such function name: X", "response": ""}`` with code 1;
* arguments: a JSON string is parsed, ``""`` means ``{}``, a dict is used as is; anything
  else -> ``{"error": "Tool input parse error...\\n", "response": ""}``;
* observations longer than 1024 characters are cut to 1024 plus ``"..."``.

Status codes follow the client: errors the client does not map (parse errors, Python errors
returned by the server) keep code 0; :attr:`ToolResult.ok` is the success test to use.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from intent.errors import UsageError

from .loader import StbApi
from .schemas import FINISH_NAME

__all__ = [
    "ERROR_STATUS_CODES",
    "MAX_OBSERVATION_LENGTH",
    "PARSE_ERROR",
    "BaseToolEnvironment",
    "ToolEnvironment",
    "ToolResult",
    "envelope",
    "finish_step",
    "parse_tool_input",
    "truncate_observation",
]

MAX_OBSERVATION_LENGTH = 1024
PARSE_ERROR = "Tool input parse error...\n"
#: Server ``error`` strings that the client maps to a status code (anything else -> 0).
ERROR_STATUS_CODES: dict[str, int] = {
    "API not working error...": 6,
    "Unauthorized error...": 7,
    "Unsubscribed error...": 8,
    "Too many requests error...": 9,
    "Rate limit per minute error...": 10,
    "Message error...": 11,
}


@dataclass(frozen=True)
class ToolResult:
    observation: str
    status_code: int
    error: str = ""
    environment: str = "schema-simulated"

    @property
    def ok(self) -> bool:
        """A successful API call: status 0 and an empty ``error`` field."""
        return self.status_code == 0 and self.error == ""


@runtime_checkable
class ToolEnvironment(Protocol):
    environment: str

    def call(self, function_name: str, arguments: str | Mapping[str, Any]) -> ToolResult: ...


def truncate_observation(observation: str, max_length: int = MAX_OBSERVATION_LENGTH) -> str:
    """Upstream ``step``: ``obs[:max_length] + "..."`` when longer than ``max_length``."""
    return observation[:max_length] + "..." if len(observation) > max_length else observation


def envelope(error: str = "", response: Any = "") -> str:
    """The serialized ``{"error", "response"}`` observation (``json.dumps`` defaults, like the client)."""
    return json.dumps({"error": error, "response": response})


def parse_tool_input(arguments: str | Mapping[str, Any] | None) -> dict[str, Any] | None:
    """The server's parsing rule; ``None`` means a parse error. Non-object JSON is a parse error
    too (it could never be passed as keyword arguments)."""
    if arguments is None:
        return {}
    if isinstance(arguments, Mapping):
        return dict(arguments)
    if isinstance(arguments, str):
        if arguments == "":
            return {}
        try:
            parsed = json.loads(arguments)
        except (ValueError, TypeError):
            return None
        return parsed if isinstance(parsed, dict) else None
    return None


def finish_step(arguments: str | Mapping[str, Any]) -> tuple[str, int]:
    """Upstream handling of the ``Finish`` call -> (observation, code)."""
    if isinstance(arguments, Mapping):
        data: dict[str, Any] = dict(arguments)
    else:
        text = arguments or ""
        try:
            loaded = json.loads(text, strict=False)
            data = loaded if isinstance(loaded, dict) else {}
        except ValueError:
            data = {}
            marker = '"return_type": "'
            if marker in text:
                if '"return_type": "give_answer"' in text:
                    data["return_type"] = "give_answer"
                elif '"return_type": "give_up_and_restart"' in text:
                    data["return_type"] = "give_up_and_restart"
                else:
                    start = text.find(marker) + len(marker)
                    data["return_type"] = text[start : text.find('",')]
            fmarker = '"final_answer": "'
            if fmarker in text:
                data["final_answer"] = text[text.find(fmarker) + len(fmarker) :]
    if "return_type" not in data:
        return '{error:"must have "return_type""}', 2
    if data["return_type"] == "give_up_and_restart":
        return '{"response":"chose to give up and restart"}', 4
    if data["return_type"] == "give_answer":
        if "final_answer" not in data:
            return '{error:"must have "final_answer""}', 2
        return '{"response":"successfully giving the final answer."}', 3
    return '{error:""return_type" is not a valid choice"}', 2


class BaseToolEnvironment(ABC):
    """Finish handling, name resolution and truncation; subclasses implement :meth:`_call_api`."""

    environment: str = "unknown"

    def __init__(self, apis: Iterable[StbApi], max_observation_length: int = MAX_OBSERVATION_LENGTH) -> None:
        self.apis: tuple[StbApi, ...] = tuple(apis)
        if max_observation_length < 1:
            raise UsageError(f"max_observation_length must be >= 1 (characters kept of an observation), got "
                             f"{max_observation_length}")
        self.max_observation_length = max_observation_length

    @property
    def function_names(self) -> tuple[str, ...]:
        return tuple(a.function_name for a in self.apis)

    def resolve(self, action_name: str) -> StbApi | None:
        """The first API whose function name ends with ``action_name`` (upstream rule)."""
        for api in self.apis:
            if api.function_name.endswith(action_name):
                return api
        return None

    def call(self, function_name: str, arguments: str | Mapping[str, Any] = "") -> ToolResult:
        if function_name == FINISH_NAME:
            obs, code = finish_step(arguments)
            return self._result(obs, code, "" if code in (3, 4) else obs)
        api = self.resolve(function_name)
        if api is None:
            error = f"No such function name: {function_name}"
            return self._result(envelope(error, ""), 1, error)
        return self._call_api(api, arguments)

    @abstractmethod
    def _call_api(self, api: StbApi, arguments: str | Mapping[str, Any]) -> ToolResult: ...

    def _result(self, observation: str, status_code: int, error: str = "") -> ToolResult:
        return ToolResult(
            observation=truncate_observation(observation, self.max_observation_length),
            status_code=status_code,
            error=error,
            environment=self.environment,
        )
