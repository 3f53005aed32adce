"""Fill StableToolBench ``template_response`` schemas with deterministic, plausible values.

SIMULATED: the values are made up. They are deterministic per (function name, canonical
arguments) and echo argument values where a response key matches an argument name; they are
never meaningful for the query (that is what upstream's cache / real API / GPT supplied).

Template grammar (from the query files): leaves ``"str" | "int" | "float" | "bool" |
"NoneType" | "empty list"``; lists hold a single element, either ``{..., "_list_length": n}``
or ``"list of <type> with length n"``. 149 APIs have a JSON *string* cut at 1000 characters:
:func:`recover_truncated_json` keeps the longest prefix that closes into valid JSON, otherwise
the template is treated as free text. ``{}`` or no template -> a generic payload.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import json
import random
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from intent.errors import UsageError

from .naming import param_name

__all__ = [
    "PayloadFiller",
    "TemplateKind",
    "canonical_arguments",
    "classify_template",
    "recover_truncated_json",
]

_LIST_OF = re.compile(r"^list of (\w+) with length (\d+)$")
_LEAVES = frozenset({"str", "int", "float", "bool", "NoneType", "empty list"})
_WORDS = (
    "alpha", "amber", "atlas", "beacon", "cedar", "delta", "ember", "falcon", "harbor", "iris",
    "juniper", "kepler", "lumen", "maple", "nova", "orbit", "pioneer", "quartz", "raven", "sierra",
    "summit", "terra", "umbra", "vertex", "willow", "zenith", "coral", "meadow", "aurora", "cobalt",
)
_SENTENCE = (
    "the", "latest", "data", "shows", "a", "steady", "trend", "with", "several", "notable", "updates",
    "for", "this", "item", "including", "details", "on", "availability", "and", "recent", "activity",
)
_COUNTRIES = ("United States", "Germany", "Japan", "Brazil", "India", "France", "Canada", "Spain")
_CITIES = ("New York", "Berlin", "Tokyo", "Sao Paulo", "Mumbai", "Paris", "Toronto", "Madrid")


def canonical_arguments(args: Mapping[str, Any]) -> str:
    """The cache key of a call: ``json.dumps(args, sort_keys=True)`` (non-JSON values via ``str``)."""
    return json.dumps(args, sort_keys=True, ensure_ascii=False, default=str)


# --------------------------------------------------------------------------- template kinds


@dataclass(frozen=True)
class TemplateKind:
    """``kind`` is one of ``schema`` (dict/list grammar), ``recovered`` (from a cut JSON string),
    ``text`` (a string that is not JSON) or ``generic`` (``{}`` or no template)."""

    kind: str
    schema: Any = None


def recover_truncated_json(s: str) -> Any | None:
    """Parse ``s``; if it was cut mid-way, keep the longest prefix that closes into valid JSON."""
    try:
        return json.loads(s)
    except (ValueError, TypeError):
        pass
    stack: list[str] = []
    cuts: list[tuple[int, tuple[str, ...]]] = []
    openings: list[tuple[int, tuple[str, ...]]] = []
    in_str = esc = False
    for i, ch in enumerate(s):
        if in_str:
            if esc:
                esc = False
            elif ch == "\\":
                esc = True
            elif ch == '"':
                in_str = False
            continue
        if ch == '"':
            in_str = True
        elif ch in "{[":
            stack.append(ch)
            openings.append((i + 1, tuple(stack)))
        elif ch in "}]":
            if stack:
                stack.pop()
            cuts.append((i + 1, tuple(stack)))
        elif ch == ",":
            cuts.append((i, tuple(stack)))
    # Prefer cuts after complete values; cutting right after an opening bracket (which adds an
    # empty container) is the last resort.
    for pos, open_ in [*reversed(cuts), *reversed(openings)]:
        closing = "".join("}" if c == "{" else "]" for c in reversed(open_))
        try:
            return json.loads(s[:pos] + closing)
        except ValueError:
            continue
    return None


def classify_template(template: Any) -> TemplateKind:
    if template is None or template == {} or template == []:
        return TemplateKind("generic")
    if isinstance(template, dict | list):
        return TemplateKind("schema", template)
    if isinstance(template, str):
        rec = recover_truncated_json(template)
        if isinstance(rec, dict | list) and rec:
            return TemplateKind("recovered", rec)
        return TemplateKind("text", template)
    return TemplateKind("generic")


# --------------------------------------------------------------------------- filling


def _seed(function_name: str, canonical: str) -> int:
    digest = hashlib.sha256(f"{function_name}\x00{canonical}".encode()).digest()
    return int.from_bytes(digest[:8], "big")


class PayloadFiller:
    """Builds the simulated ``response`` for one API call. Stateless apart from its limits."""

    def __init__(self, max_list_items: int = 8, max_depth: int = 12) -> None:
        if max_list_items < 0 or max_depth < 1:
            raise UsageError(f"max_list_items must be >= 0 and max_depth >= 1, got {max_list_items} and {max_depth}")
        self.max_list_items = max_list_items
        self.max_depth = max_depth

    def fill(self, function_name: str, api_name: str, template: Any, args: Mapping[str, Any]) -> Any:
        rng = random.Random(_seed(function_name, canonical_arguments(args)))
        echo = _echo_table(args)
        kind = classify_template(template)
        if kind.kind in ("schema", "recovered"):
            return self._node(kind.schema, "", rng, echo, 0)
        if kind.kind == "text":
            return self._text(api_name, args, rng)
        return self._generic(api_name, args, rng, echo)

    # -- structure
    def _node(self, node: Any, key: str, rng: random.Random, echo: dict[str, Any], depth: int) -> Any:
        if depth > self.max_depth:
            return None
        if isinstance(node, dict):
            return {
                k: self._node(v, k, rng, echo, depth + 1) for k, v in node.items() if k != "_list_length"
            }
        if isinstance(node, list):
            if not node:
                return []
            first = node[0]
            if isinstance(first, dict):
                n = first.get("_list_length", 1)
                n = n if isinstance(n, int) and not isinstance(n, bool) and n >= 0 else 1
                return [self._node(first, key, rng, echo, depth + 1) for _ in range(min(n, self.max_list_items))]
            if isinstance(first, str) and (m := _LIST_OF.match(first)):
                leaf, n = m.group(1), int(m.group(2))
                return [self._list_item(leaf, key, rng) for _ in range(min(n, self.max_list_items))]
            return [self._node(x, key, rng, echo, depth + 1) for x in node[: self.max_list_items]]
        if isinstance(node, str):
            return self._leaf(node if node in _LEAVES else "str", key, rng, echo)
        return node  # a literal number / bool / null in a recovered template

    def _list_item(self, leaf: str, key: str, rng: random.Random) -> Any:
        if leaf == "list":
            return [self._leaf("str", key, rng, {}) for _ in range(2)]
        if leaf == "dict":
            return {"key": self._word(rng), "value": self._word(rng)}
        return self._leaf(leaf if leaf in _LEAVES else "str", key, rng, {})

    # -- leaves
    def _leaf(self, leaf: str, key: str, rng: random.Random, echo: dict[str, Any]) -> Any:
        k = key.lower()
        hit = echo.get(k, echo.get(param_name(key), _MISSING)) if key else _MISSING
        if leaf == "NoneType":
            return None
        if leaf == "empty list":
            return []
        if leaf == "bool":
            return bool(hit) if isinstance(hit, bool) else rng.random() < 0.5
        if leaf == "int":
            if hit is not _MISSING:
                try:
                    return int(float(hit))
                except (TypeError, ValueError):
                    pass
            return self._int(k, rng)
        if leaf == "float":
            if hit is not _MISSING:
                try:
                    return float(hit)
                except (TypeError, ValueError):
                    pass
            return self._float(k, rng)
        if hit is not _MISSING:
            return hit if isinstance(hit, str) else json.dumps(hit, ensure_ascii=False, default=str)
        return self._str(k, rng)

    @staticmethod
    def _word(rng: random.Random) -> str:
        return rng.choice(_WORDS)

    def _str(self, k: str, rng: random.Random) -> str:
        token = f"{rng.getrandbits(40):010x}"
        if any(t in k for t in ("url", "link", "href", "image", "website", "logo", "thumb", "avatar", "icon", "photo")):
            return f"https://example.com/{k or 'item'}/{token}"
        if "email" in k:
            return f"{self._word(rng)}.{token[:4]}@example.com"
        if any(t in k for t in ("date", "time", "created", "updated", "published", "timestamp")) or k.endswith("_at"):
            day = _dt.date(2020, 1, 1) + _dt.timedelta(days=rng.randrange(1500))
            return f"{day.isoformat()}T{rng.randrange(24):02d}:{rng.randrange(60):02d}:00Z"
        if k == "id" or k.endswith("id") or "uuid" in k or k.endswith("_key") or k == "key":
            return token
        if "phone" in k:
            return f"+1-555-{rng.randrange(1000):03d}-{rng.randrange(10000):04d}"
        if "country" in k:
            return rng.choice(_COUNTRIES)
        if "city" in k:
            return rng.choice(_CITIES)
        if "currency" in k:
            return rng.choice(("USD", "EUR", "JPY", "GBP"))
        if "lang" in k:
            return rng.choice(("en", "de", "fr", "es"))
        if "status" in k or k == "state":
            return rng.choice(("active", "ok", "completed", "pending"))
        if any(t in k for t in ("desc", "text", "content", "summary", "bio", "message", "comment", "body")):
            return self._sentence(rng, 8 + rng.randrange(8))
        if any(t in k for t in ("name", "title", "label", "author", "artist", "user")):
            return f"{self._word(rng).title()} {self._word(rng).title()}"
        return f"{self._word(rng)}_{token[:6]}"

    @staticmethod
    def _int(k: str, rng: random.Random) -> int:
        if "year" in k:
            return 1990 + rng.randrange(35)
        if any(t in k for t in ("count", "total", "num", "views", "followers", "likes")):
            return rng.randrange(10000)
        if any(t in k for t in ("page", "rank", "position", "index")):
            return 1 + rng.randrange(20)
        return rng.randrange(1000)

    @staticmethod
    def _float(k: str, rng: random.Random) -> float:
        if "lat" in k:
            return round(rng.uniform(-90, 90), 6)
        if "lon" in k or "lng" in k:
            return round(rng.uniform(-180, 180), 6)
        if any(t in k for t in ("score", "rating", "ratio", "prob", "confidence")):
            return round(rng.random(), 3)
        return round(rng.uniform(0, 1000), 2)

    @staticmethod
    def _sentence(rng: random.Random, n: int) -> str:
        words = [rng.choice(_SENTENCE) for _ in range(n)]
        return " ".join(words).capitalize() + "."

    # -- templates without a usable schema
    def _text(self, api_name: str, args: Mapping[str, Any], rng: random.Random) -> str:
        shown = ", ".join(f"{k}={v}" for k, v in sorted(args.items())) or "no arguments"
        return f"{api_name} ({shown}): {self._sentence(rng, 20 + rng.randrange(20))}"

    def _generic(self, api_name: str, args: Mapping[str, Any], rng: random.Random, echo: dict[str, Any]) -> dict:
        n = 1 + rng.randrange(3)
        results = [
            {
                "id": f"{rng.getrandbits(40):010x}",
                "name": self._str("name", rng),
                "description": self._sentence(rng, 10 + rng.randrange(10)),
                "value": self._float("value", rng),
                "updated_at": self._str("updated_at", rng),
            }
            for _ in range(n)
        ]
        return {"status": "success", "api": api_name, "query": dict(args), "results": results, "total": n}


class _Missing:
    pass


_MISSING: Any = _Missing()


def _echo_table(args: Mapping[str, Any]) -> dict[str, Any]:
    """Argument values by lower-cased name and by standardised name (for key matching)."""
    out: dict[str, Any] = {}
    for k, v in args.items():
        out.setdefault(str(k).lower(), v)
        out.setdefault(param_name(str(k)), v)
    return out
