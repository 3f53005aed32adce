"""Tool environments for cost-augmented StableToolBench.

* :class:`SchemaSimulator` (``environment = "schema-simulated"``): offline, deterministic per
  (function, canonical args). It reproduces StableToolBench's *shape* (envelope, error paths,
  name resolution, truncation), never the content of real responses.
* :class:`OpenAICompatibleSimulator` (MirrorAPI style) and :class:`ServerEnvironment` (a running
  StableToolBench ``/virtual`` server) live in :mod:`.remote_env` and are re-exported here.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from .env_base import (
    PARSE_ERROR,
    BaseToolEnvironment,
    ToolEnvironment,
    ToolResult,
    envelope,
    finish_step,
    parse_tool_input,
    truncate_observation,
)
from .loader import StbApi
from .naming import standardize
from .payload import PayloadFiller
from .remote_env import OpenAICompatibleSimulator, ServerEnvironment

__all__ = [
    "OpenAICompatibleSimulator",
    "SchemaSimulator",
    "ServerEnvironment",
    "ToolEnvironment",
    "ToolResult",
    "finish_step",
    "missing_argument_error",
    "truncate_observation",
    "unexpected_argument_error",
]

SCHEMA_SIMULATED = "schema-simulated"


def _import_line(api: StbApi) -> str:
    return f"Function executing from toolenv.tools.{api.category}.{standardize(api.tool_name)}.api import {api.pure_api_name} error..."


def unexpected_argument_error(api: StbApi, name: str) -> str:
    """The Python error text StableToolBench shows for an unknown keyword argument."""
    return f"{_import_line(api)}\n{api.pure_api_name}() got an unexpected keyword argument '{name}'"


def missing_argument_error(api: StbApi, names: list[str]) -> str:
    """Python's ``missing N required positional argument(s)`` text for the missing parameters."""
    quoted = [f"'{n}'" for n in names]
    if len(quoted) == 1:
        listed = quoted[0]
    elif len(quoted) == 2:
        listed = f"{quoted[0]} and {quoted[1]}"
    else:
        listed = ", ".join(quoted[:-1]) + f", and {quoted[-1]}"
    plural = "argument" if len(names) == 1 else "arguments"
    return f"{_import_line(api)}\n{api.pure_api_name}() missing {len(names)} required positional {plural}: {listed}"


class SchemaSimulator(BaseToolEnvironment):
    """Offline simulator: fills ``template_response`` deterministically (SIMULATED content)."""

    environment = SCHEMA_SIMULATED

    def __init__(self, apis: Iterable[StbApi], filler: PayloadFiller | None = None, **kwargs: Any) -> None:
        super().__init__(apis, **kwargs)
        self.filler = filler or PayloadFiller()

    def _call_api(self, api: StbApi, arguments: str | Mapping[str, Any]) -> ToolResult:
        args = parse_tool_input(arguments)
        if args is None:
            return self._result(envelope(PARSE_ERROR, ""), 0, PARSE_ERROR)
        accepted = [p.schema_name for p in (*api.required, *api.optional)]
        for name in args:
            if name not in accepted:
                err = unexpected_argument_error(api, str(name))
                return self._result(envelope(err, ""), 0, err)
        missing = [p.schema_name for p in api.required if p.schema_name not in args]
        if missing:
            err = missing_argument_error(api, missing)
            return self._result(envelope(err, ""), 0, err)
        response = self.filler.fill(api.function_name, api.api_name, api.template_response, args)
        return self._result(envelope("", response), 0, "")
