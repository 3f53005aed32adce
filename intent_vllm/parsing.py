"""Lenient tool-call parsing for small models: pure Python, no vLLM needed.

Small instruct models rarely write their calls exactly as the chat template asks. Qwen2.5-Coder-0.5B,
served with its own template, writes a ```json fenced block without ``<tool_call>`` tags, repeats the
same call several times, and adds text after it; vLLM's stock ``hermes`` parser then returns no call
at all. :func:`parse_tool_calls` accepts, in order of appearance:

* ``<tool_call> {...} </tool_call>`` (an unclosed tag runs to the end of the text),
* fenced code blocks (```json, ```tool_call or a bare ```) holding a call object or a list of them,
* any other complete JSON object ``{"name": ..., "arguments": {...}}`` in the text.

A call object is ``{"name": str, "arguments": {...}}``; ``"parameters"`` is accepted for
``"arguments"``, arguments given as a JSON string are decoded, ``{"function": {...}}`` wrappers are
unwrapped, and a known tool (``tool_names``) may omit its arguments. Invalid JSON never raises: a
``<tool_call>`` tag or a fenced block that looked like a call but does not parse counts as
``malformed`` and stays in the content. The result also counts duplicate calls (same name and
arguments as an earlier call in the same reply) and names that are not among ``tool_names``;
duplicates and unknown names are still returned (the budget guard decides about them).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

__all__ = ["ParseResult", "ParsedCall", "parse_tool_calls"]

_TAG = re.compile(r"<tool_call>(.*?)(?:</tool_call>|\Z)", re.DOTALL)
# ```json ... ``` (also ```JSON, ```tool_call, a bare ```); an unclosed fence runs to the end.
_FENCE = re.compile(r"```[ \t]*([A-Za-z_]*)[ \t]*\n?(.*?)(?:```|\Z)", re.DOTALL)
# The start of something that was meant to be a call object.
_ATTEMPT = re.compile(r"\{\s*\"(?:name|function)\"\s*:")
_TRAILING_COMMA = re.compile(r",\s*([}\]])")
_MISSING = object()


@dataclass(frozen=True)
class ParsedCall:
    name: str
    arguments: dict[str, Any]

    @property
    def key(self) -> str:
        return self.name + "\x00" + json.dumps(self.arguments, sort_keys=True, ensure_ascii=False)


@dataclass
class ParseResult:
    calls: list[ParsedCall] = field(default_factory=list)
    content: str | None = None  # the text without the parsed calls; None when nothing is left
    malformed: int = 0  # call attempts (tags, fenced blocks, '{"name": ...' starts) that did not parse
    duplicates: int = 0  # calls equal to an earlier call of the same reply
    unknown: list[str] = field(default_factory=list)  # call names not among tool_names (when given)

    @property
    def attempted(self) -> bool:
        return bool(self.calls) or self.malformed > 0

    def stats(self) -> dict[str, Any]:
        return {"calls": len(self.calls), "malformed": self.malformed, "duplicates": self.duplicates,
                "unknown": len(self.unknown)}


def parse_tool_calls(text: str | None, tool_names: Iterable[str] | None = None) -> ParseResult:
    """Every tool call in a model reply, leniently; never raises on malformed text."""
    text = text or ""
    names = set(tool_names) if tool_names is not None else None
    found: list[tuple[int, ParsedCall]] = []
    spans: list[tuple[int, int]] = []  # consumed by parsed calls (removed from the content)
    covered: list[tuple[int, int]] = []  # tags and fences, parsed or not (not rescanned for bare objects)
    malformed = 0

    containers = [(m.start(), m.end(), m.group(1), True) for m in _TAG.finditer(text)]
    for m in _FENCE.finditer(text):
        if not any(s <= m.start() < e for s, e, _, _ in containers):
            containers.append((m.start(), m.end(), m.group(2), m.group(1).lower() in ("", "json", "tool_call")))
    for start, end, body, call_like in sorted(containers, key=lambda c: c[0]):
        covered.append((start, end))
        calls = _calls_in(body, names)
        if not calls:
            # A tag is always an attempt; a JSON fence only when it looks like a call.
            if text.startswith("<tool_call>", start) or (call_like and _failed_attempt(body, names)):
                malformed += 1
            continue
        found.extend((start, c) for c in calls)
        spans.append((start, end))

    for start, end, value in _json_values(text, skip=list(covered)):
        calls = list(_calls_from(value, names))
        if calls:
            found.extend((start, c) for c in calls)
            spans.append((start, end))
        elif _near_call(value, names):
            malformed += 1
        covered.append((start, end))  # complete JSON: its '{"name":' starts are not truncated calls
    # What is left of '{"name": ...' outside anything parsed: a truncated or invalid call.
    malformed += sum(1 for m in _ATTEMPT.finditer(text) if not _inside(m.start(), covered))

    found.sort(key=lambda item: item[0])
    result = ParseResult(calls=[c for _, c in found], malformed=malformed)
    seen: set[str] = set()
    for call in result.calls:
        if call.key in seen:
            result.duplicates += 1
        seen.add(call.key)
        if names is not None and call.name not in names:
            result.unknown.append(call.name)
    rest, last = [], 0
    for start, end in sorted(spans):
        rest.append(text[last:start])
        last = max(last, end)
    rest.append(text[last:])
    content = re.sub(r"\n{3,}", "\n\n", "".join(rest)).strip()
    result.content = content or None
    return result


def _inside(pos: int, spans: list[tuple[int, int]]) -> bool:
    return any(s <= pos < e for s, e in spans)


def _near_call(value: Any, names: set[str] | None) -> bool:
    """Shaped like a call (a tool's name, or a name with arguments) but not a valid one."""
    if isinstance(value, list):
        return any(_near_call(v, names) for v in value)
    if not isinstance(value, dict):
        return False
    if isinstance(value.get("function"), dict):
        return True
    name = value.get("name")
    return isinstance(name, str) and (("arguments" in value or "parameters" in value)
                                      or (names is not None and name in names))


def _failed_attempt(body: str, names: set[str] | None) -> bool:
    stripped = body.strip()
    for candidate in (stripped, _TRAILING_COMMA.sub(r"\1", stripped)):
        try:
            return _near_call(json.loads(candidate), names)
        except ValueError:
            continue
    return bool(_ATTEMPT.search(body))


def _calls_in(body: str, names: set[str] | None) -> list[ParsedCall]:
    """The calls inside a tag or fence body: one JSON value, several, or a value with trailing commas."""
    stripped = body.strip()
    if stripped.startswith("```"):  # a fence inside a tag
        inner = _FENCE.match(stripped)
        stripped = inner.group(2).strip() if inner else stripped
    for candidate in (stripped, _TRAILING_COMMA.sub(r"\1", stripped)):
        try:
            calls = list(_calls_from(json.loads(candidate), names))
        except ValueError:
            continue
        if calls:
            return calls
    return [c for _, _, v in _json_values(stripped) for c in _calls_from(v, names)]


def _json_values(text: str, skip: list[tuple[int, int]] | None = None) -> Iterator[tuple[int, int, Any]]:
    """Complete JSON objects or arrays in ``text`` (outermost first), as (start, end, value)."""
    decoder = json.JSONDecoder()
    i, n = 0, len(text)
    while i < n:
        ch = text[i]
        if ch in "{[" and not (skip and _inside(i, skip)):
            try:
                value, end = decoder.raw_decode(text, i)
            except ValueError:
                i += 1
                continue
            yield i, end, value
            i = end
        else:
            i += 1


def _calls_from(value: Any, names: set[str] | None) -> Iterator[ParsedCall]:
    if isinstance(value, list):
        for item in value:
            if isinstance(item, dict):
                yield from _calls_from(item, names)
        return
    if not isinstance(value, dict):
        return
    if isinstance(value.get("function"), dict) and "name" not in value:
        yield from _calls_from(value["function"], names)
        return
    name = value.get("name")
    if not isinstance(name, str) or not name.strip():
        return
    args = value.get("arguments", value.get("parameters", _MISSING))
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except ValueError:
            return
    if args is _MISSING:
        # {"name": "Alice"} is data, not a call, unless it names one of the tools.
        if names is None or name not in names:
            return
        args = {}
    if isinstance(args, dict):
        yield ParsedCall(name.strip(), args)
