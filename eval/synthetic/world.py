"""The hidden model of the synthetic market (everything here is simulated).

A :class:`Task` holds a query with 1-4 information :class:`Need` s, the tools on offer
(:class:`ToolSpec`, with hidden reliabilities), a budget, the canonical arguments of each
need and the market events that happen during an episode.

Argument quality and success probability
----------------------------------------
For a need ``n`` with canonical arguments ``c`` (key -> value) and a call's arguments ``a``::

    match(x, y) = 1    if norm(x) == norm(y)
                  0.5  if both are non-empty and one contains the other ("the Eiffel Tower" vs "Eiffel Tower")
                  0    otherwise (missing key, other entity)
    q_n(a)      = mean over the keys k of c of match(a.get(k), c[k])            in [0, 1]
    P(call satisfies n) = base_success * q_n(a) ** arg_sensitivity

``norm`` lower-cases, strips and collapses whitespace. Extra keys in ``a`` are ignored.
``arg_sensitivity`` (>= 0) says how brittle a tool is to imperfect arguments: 0 means it
ignores them (``q ** 0 == 1``), 1 is linear, 2 punishes a half-right call down to a quarter.
With the canonical arguments ``q_n = 1`` and the probability is ``base_success``. A call
"works" (the service answers) with probability ``base_success``; given that, each covered
need is satisfied independently with probability ``q_n ** arg_sensitivity``. So with perfect
arguments a composite tool satisfies all the needs it covers at once, or none.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from intent.errors import UsageError
from intent.market import Market, MarketError, PricedTool

__all__ = [
    "EVENT_KINDS",
    "TIERS",
    "EventKind",
    "MarketEvent",
    "Need",
    "Task",
    "Tier",
    "ToolSpec",
    "apply_event",
    "arg_quality",
    "success_probability",
]

Tier = Literal["cheap", "mid", "premium", "composite", "distractor"]
TIERS: tuple[str, ...] = ("cheap", "mid", "premium", "composite", "distractor")
EventKind = Literal["price_change", "remove", "ban"]
EVENT_KINDS: tuple[str, ...] = ("price_change", "remove", "ban")

_WS = re.compile(r"\s+")


def _norm(value: Any) -> str:
    return _WS.sub(" ", str(value).strip().lower())


def _match(given: Any, canonical: Any) -> float:
    if given is None:
        return 0.0
    g, c = _norm(given), _norm(canonical)
    if not g or not c:
        return 1.0 if g == c else 0.0
    if g == c:
        return 1.0
    if g in c or c in g:
        return 0.5
    return 0.0


@dataclass(frozen=True, slots=True)
class Need:
    """One information need of a task, e.g. the weather in Oslo tomorrow."""

    id: str
    domain: str
    description: str
    arg_keys: tuple[str, ...]
    # Sequential dependencies (market v2, CostBench-style): the ids of needs whose result this
    # need takes as an argument. A provider can satisfy this need only once all of them are
    # satisfied (earlier calls); before that the call fails. Empty (v1) = independent.
    requires: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.id, str) or not self.id:
            raise UsageError(f"Need.id must be a non-empty string, got {self.id!r}")
        if not self.arg_keys:
            raise UsageError(f"Need {self.id!r} has no arg_keys; give at least one identifying argument key")
        if isinstance(self.requires, str) or not all(isinstance(r, str) and r for r in self.requires):
            raise UsageError(f"Need {self.id!r}: requires must be a tuple of need ids, got {self.requires!r}")
        if not isinstance(self.requires, tuple):
            object.__setattr__(self, "requires", tuple(self.requires))
        if self.id in self.requires:
            raise UsageError(f"Need {self.id!r}: requires names the need itself")


@dataclass(frozen=True, slots=True)
class ToolSpec:
    """A tool with its hidden reliability.

    ``covers`` are the ids of the needs a successful call satisfies (empty for distractors).
    ``tier`` is ``cheap`` / ``mid`` / ``premium`` for single-need providers, ``composite`` for
    tools covering 2+ needs and ``distractor`` for tools irrelevant to the task.
    ``price`` is an integer >= 1 (a free tool would make retries costless).
    """

    name: str
    domain: str
    covers: frozenset[str]
    tier: Tier
    price: int
    base_success: float
    arg_sensitivity: float
    description: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name.strip():
            raise UsageError(f"ToolSpec.name must be a non-empty string, got {self.name!r}")
        if self.tier not in TIERS:
            raise UsageError(f"ToolSpec {self.name!r}: tier must be one of {TIERS}, got {self.tier!r}")
        if isinstance(self.price, bool) or not isinstance(self.price, int) or self.price < 1:
            raise UsageError(f"ToolSpec {self.name!r}: price must be an int >= 1, got {self.price!r}")
        if not 0.0 <= float(self.base_success) <= 1.0:
            raise UsageError(f"ToolSpec {self.name!r}: base_success must be in [0, 1], got {self.base_success!r}")
        if float(self.arg_sensitivity) < 0.0:
            raise UsageError(f"ToolSpec {self.name!r}: arg_sensitivity must be >= 0, got {self.arg_sensitivity!r}")
        if not isinstance(self.covers, frozenset):
            object.__setattr__(self, "covers", frozenset(self.covers))


@dataclass(frozen=True, slots=True)
class MarketEvent:
    """A mid-episode market change, applied once ``at_step`` calls have been made.

    ``kind`` is ``price_change`` (needs ``new_price``, an int >= 1), ``remove`` (the tool leaves
    the market) or ``ban`` (the tool stays listed but is unavailable).
    """

    at_step: int
    kind: EventKind
    tool: str
    new_price: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.at_step, bool) or not isinstance(self.at_step, int) or self.at_step < 0:
            raise UsageError(f"MarketEvent.at_step must be an int >= 0, got {self.at_step!r}")
        if self.kind not in EVENT_KINDS:
            raise UsageError(f"MarketEvent.kind must be one of {EVENT_KINDS}, got {self.kind!r}")
        if self.kind == "price_change":
            p = self.new_price
            if isinstance(p, bool) or not isinstance(p, int) or p < 1:
                raise UsageError(f"MarketEvent price_change of {self.tool!r} needs new_price as an int >= 1, got {p!r}")
        elif self.new_price is not None:
            raise UsageError(f"MarketEvent {self.kind} of {self.tool!r} takes no new_price; pass new_price=None")


def apply_event(market: Market, event: MarketEvent) -> Market:
    """Return the market snapshot after ``event`` (a new version; ``market`` is unchanged)."""
    if event.tool not in market:
        raise MarketError(
            f"cannot apply {event.kind} event: tool {event.tool!r} is not on the market (version {market.version})"
        )
    if event.kind == "price_change":
        assert event.new_price is not None
        return market.with_price(event.tool, event.new_price)
    if event.kind == "remove":
        return market.without(event.tool)
    return market.ban(event.tool)


def _check_acyclic(task_id: str, requires: Mapping[str, tuple[str, ...]]) -> None:
    # A cycle would make every need on it unreachable; refuse it at construction.
    state: dict[str, int] = {}

    def visit(n: str, path: tuple[str, ...]) -> None:
        if state.get(n) == 2:
            return
        if state.get(n) == 1:
            raise UsageError(f"Task {task_id!r}: need dependencies form a cycle: {' -> '.join((*path, n))}")
        state[n] = 1
        for r in requires.get(n, ()):
            visit(r, (*path, n))
        state[n] = 2

    for n in requires:
        visit(n, ())


def arg_quality(args: Mapping[str, Any] | None, canonical: Mapping[str, Any]) -> float:
    """The argument quality ``q`` in [0, 1] of ``args`` for a need with ``canonical`` arguments."""
    if not canonical:
        return 1.0
    args = args or {}
    return sum(_match(args.get(k), v) for k, v in canonical.items()) / len(canonical)


def success_probability(tool: ToolSpec, quality: float) -> float:
    """``P(call satisfies a covered need) = base_success * quality ** arg_sensitivity``."""
    return float(tool.base_success) * float(quality) ** float(tool.arg_sensitivity)


@dataclass(frozen=True)
class Task:
    """One synthetic task: query, needs, tools (with hidden reliabilities), budget, events.

    ``canonical_args[need_id]`` is the argument dict that identifies the need perfectly; its
    values appear verbatim in ``query``. ``seed`` drives the executor's randomness. Tasks
    compare by value (two generations with one seed are equal) but are not hashable.
    """

    task_id: str
    query: str
    needs: tuple[Need, ...]
    tools: tuple[ToolSpec, ...]
    budget: float  # money; prices are integers, so only floor(budget) of it can be spent
    canonical_args: dict[str, dict[str, str]]
    events: tuple[MarketEvent, ...] = ()
    seed: int = 0

    def __post_init__(self) -> None:
        if (isinstance(self.budget, bool) or not isinstance(self.budget, (int, float)) or not self.budget >= 0
                or self.budget == float("inf")):
            raise UsageError(f"Task {self.task_id!r}: budget must be a finite number >= 0, got {self.budget!r}")
        ids = [n.id for n in self.needs]
        if not ids or len(set(ids)) != len(ids):
            raise UsageError(f"Task {self.task_id!r}: needs must be non-empty with unique ids, got {ids}")
        names = [t.name for t in self.tools]
        if len(set(names)) != len(names):
            dups = sorted({n for n in names if names.count(n) > 1})
            raise UsageError(f"Task {self.task_id!r}: tool names must be unique, duplicated: {dups}")
        known = set(ids)
        for t in self.tools:
            if not t.covers <= known:
                raise UsageError(
                    f"Task {self.task_id!r}: tool {t.name!r} covers unknown needs {sorted(t.covers - known)}"
                )
        for n in self.needs:
            if n.id not in self.canonical_args:
                raise UsageError(f"Task {self.task_id!r}: canonical_args lacks need {n.id!r}")
            if not set(n.requires) <= known:
                raise UsageError(f"Task {self.task_id!r}: need {n.id!r} requires unknown needs "
                                 f"{sorted(set(n.requires) - known)}")
        _check_acyclic(self.task_id, {n.id: n.requires for n in self.needs})
        for e in self.events:
            if e.tool not in names:
                raise UsageError(f"Task {self.task_id!r}: event targets unknown tool {e.tool!r}")

    # ------------------------------------------------------------------ lookups
    @property
    def need_ids(self) -> frozenset[str]:
        return frozenset(n.id for n in self.needs)

    def tool(self, name: str) -> ToolSpec | None:
        for t in self.tools:
            if t.name == name:
                return t
        return None

    def need(self, need_id: str) -> Need:
        for n in self.needs:
            if n.id == need_id:
                return n
        raise KeyError(f"task {self.task_id!r} has no need {need_id!r}")

    def enabled(self, covers: frozenset[str] | set[str], satisfied: frozenset[str] | set[str]) -> frozenset[str]:
        """The needs in ``covers`` a successful call can satisfy now: those whose prerequisites
        (``Need.requires``) are all in ``satisfied``. Without dependencies that is ``covers``."""
        return frozenset(n for n in covers if set(self.need(n).requires) <= set(satisfied))

    @property
    def has_dependencies(self) -> bool:
        return any(n.requires for n in self.needs)

    def providers(self, need_id: str) -> tuple[ToolSpec, ...]:
        """The tools whose success satisfies ``need_id`` (single-need providers and composites)."""
        return tuple(t for t in self.tools if need_id in t.covers)

    # ------------------------------------------------------------------ markets
    def market(self) -> Market:
        """The initial market snapshot (version 0): integer prices and tool descriptions."""
        return Market(PricedTool(t.name, t.price, t.description) for t in self.tools)

    def market_at(self, step: int) -> Market:
        """The market after every event with ``at_step <= step`` (in order) has been applied."""
        m = self.market()
        for e in sorted(self.events, key=lambda e: e.at_step):
            if e.at_step <= step:
                m = apply_event(m, e)
        return m
