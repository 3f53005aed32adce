"""StableToolBench / ToolBench name standardisation, reimplemented from the notes.

Upstream rules (toolbench/utils.py, identical in server/utils.py):

* ``standardize``: regex-replace ``[^\\u4e00-\\u9fa5^a-z^A-Z^0-9^_]`` with ``_``. Every ``^``
  after the first one is a *literal* inside the class, so ``^`` survives, as do CJK
  ideographs. Then collapse runs of ``_``, lowercase, strip ``_`` on both ends (an empty
  string is returned as is) and prefix ``get_`` if the result starts with a digit.
* ``change_name``: a handful of Python keywords / builtins become ``is_<name>``.
* ``standardize_category``: space, comma and ``/`` become ``_``; then ``__`` -> ``_`` once.
* function name: ``(change_name(standardize(api_name)) + "_for_" + standardize(tool_name))[-64:]``
  (the truncation keeps the *last* 64 characters, so a name can start mid-word).
"""

from __future__ import annotations

import re

__all__ = [
    "CHANGED_NAMES",
    "MAX_FUNCTION_NAME_LENGTH",
    "change_name",
    "function_name",
    "param_name",
    "pure_api_name",
    "standardize",
    "standardize_category",
]

#: Names that upstream renames to ``is_<name>``.
CHANGED_NAMES: frozenset[str] = frozenset({"from", "class", "return", "false", "true", "id", "and"})
#: OpenAI function names are cut to their last 64 characters.
MAX_FUNCTION_NAME_LENGTH = 64

# The ``^`` characters after the first are literals: this is the upstream quirk, kept on purpose.
_DISALLOWED = re.compile("[^\\u4e00-\\u9fa5^a-z^A-Z^0-9^_]")
_UNDERSCORE_RUNS = re.compile(r"(_)\1+")


def standardize(s: str) -> str:
    """Standardise a raw tool / API / parameter name exactly like ToolBench."""
    out = _DISALLOWED.sub("_", s)
    out = _UNDERSCORE_RUNS.sub("_", out).lower()
    out = out.strip("_")
    if not out:
        return out
    if out[0].isdigit():
        out = "get_" + out
    return out


def change_name(n: str) -> str:
    """``from``/``class``/``return``/``false``/``true``/``id``/``and`` -> ``is_<n>``."""
    return "is_" + n if n in CHANGED_NAMES else n


def standardize_category(s: str) -> str:
    """Category folder name: space, comma and ``/`` -> ``_``, then one pass of ``__`` -> ``_``."""
    out = s.replace(" ", "_").replace(",", "_").replace("/", "_")
    # Upstream loops while spaces/commas remain; after the replace above none can remain.
    return out.replace("__", "_")


def pure_api_name(api_name: str) -> str:
    """``change_name(standardize(api_name))``: the API part of a function name (untruncated)."""
    return change_name(standardize(api_name))


def param_name(name: str) -> str:
    """Parameter names in the schema are ``change_name(standardize(name))``."""
    return change_name(standardize(name))


def function_name(tool_name: str, api_name: str) -> str:
    """The OpenAI function name the agent sees for (raw tool name, raw API name)."""
    name = pure_api_name(api_name) + "_for_" + standardize(tool_name)
    return name[-MAX_FUNCTION_NAME_LENGTH:]
