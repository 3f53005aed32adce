"""Simulated tool execution for synthetic tasks, with exact ground truth.

``SyntheticEnvironment(task, seed).call(tool, args)`` returns an :class:`Observation`. Every
random draw is a hash of ``(task.seed, episode seed, tool, k, purpose)`` where ``k`` is how
many times this tool was called before in the episode, so runs reproduce exactly while a
retry of a flaky tool (next ``k``) gets fresh luck. Whether a call succeeds does not depend
on the arguments' *text*, only on their quality (see :mod:`.world`): the same draw is
compared with ``base_success`` and with ``q ** arg_sensitivity``, so better arguments never
turn a success into a failure. The payload text may depend on the arguments (which wrong
entity comes back, which error message).

Outcomes of a call to a task tool that is on the market:

* service failure (probability ``1 - base_success``): an error text ("503 Service
  Unavailable", "429 Too Many Requests: rate limit exceeded", "504 Gateway Timeout: upstream
  timeout", ...) or, one time in four, a valid JSON payload about the wrong entity;
* service up: each covered need is satisfied with probability ``q ** arg_sensitivity``;
  a satisfied need gets a JSON payload with plausible fields for the need's entity, an
  unsatisfied one a payload about another entity (the one the arguments named, or a fuzzy
  mismatch), or "400 Bad Request" when its identifying arguments are missing altogether.

Unknown tools get "404 Not Found", removed tools "410 Gone", banned tools "403 Forbidden";
none of these satisfies anything. A need with prerequisites (``Need.requires``, market v2) is
satisfied only if they were all satisfied by earlier calls; otherwise the call's answer for it
is "400 Bad Request: the arguments ... come from the result of ...". ``step`` (calls made so far, all kinds) decides which
market events have happened: an event with ``at_step = s`` is in force from the call with
index ``s`` (0-based) on.
"""

from __future__ import annotations

import hashlib
import json
import random
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from intent.errors import UsageError
from intent.market import Market

from .domains import DOMAINS
from .world import Task, ToolSpec, arg_quality

__all__ = ["CallRecord", "EpisodeTruth", "Observation", "SyntheticEnvironment", "judge", "task_solved"]

ENVIRONMENT_LABEL = "synthetic (simulated)"

_ERRORS = (
    "503 Service Unavailable",
    "429 Too Many Requests: rate limit exceeded, retry later",
    "504 Gateway Timeout: upstream timeout",
    "500 Internal Server Error",
    "502 Bad Gateway: upstream connection reset",
)
_IRRELEVANT_SHARE = 0.25


@dataclass(frozen=True, slots=True)
class Observation:
    """What the agent sees after a call.

    ``success`` is true iff the call satisfied at least one of the task's needs; ``satisfied``
    lists them. ``kind`` is ``ok``, ``error``, ``irrelevant``, ``bad_args``, ``unknown_tool`` or
    ``unavailable`` (removed or banned), for logs and tests.
    """

    text: str
    success: bool
    satisfied: frozenset[str]
    environment: str = ENVIRONMENT_LABEL
    tool: str = ""
    call_index: int = -1
    kind: str = "ok"


@dataclass(frozen=True, slots=True)
class CallRecord:
    """One executed call in an episode, as the ground truth sees it."""

    step: int
    tool: str
    args: str  # canonical JSON of the arguments
    call_index: int
    kind: str
    satisfied: frozenset[str]


@dataclass(frozen=True, slots=True)
class EpisodeTruth:
    """Which needs are satisfied so far, and the calls that got there (immutable)."""

    needs: frozenset[str]
    satisfied: frozenset[str] = frozenset()
    calls: tuple[CallRecord, ...] = ()

    def with_call(self, record: CallRecord) -> EpisodeTruth:
        return replace(self, satisfied=self.satisfied | record.satisfied, calls=(*self.calls, record))

    @property
    def missing(self) -> frozenset[str]:
        return self.needs - self.satisfied


def task_solved(truth: EpisodeTruth) -> bool:
    """Exact: every need of the task has been satisfied by some call."""
    return truth.needs <= truth.satisfied


def judge(truth: EpisodeTruth, answered: bool) -> bool:
    """The pass/fail verdict: an answer was given and every need was satisfied."""
    return bool(answered) and task_solved(truth)


def _canonical_json(args: Mapping[str, Any]) -> str:
    try:
        return json.dumps(args, sort_keys=True, ensure_ascii=False, default=str)
    except (TypeError, ValueError):
        return repr(sorted(args.items(), key=lambda kv: str(kv[0])))


@dataclass
class SyntheticEnvironment:
    """One episode of ``task``; ``seed`` is the episode seed. Mutable: one per episode."""

    task: Task
    seed: int = 0
    _counts: dict[str, int] = field(default_factory=dict, init=False, repr=False)
    _step: int = field(default=0, init=False)
    _truth: EpisodeTruth = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if not isinstance(self.task, Task):
            raise UsageError(f"task must be a synthetic Task, got {type(self.task).__name__}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise UsageError(f"seed must be an int, got {type(self.seed).__name__} {self.seed!r}; e.g. seed=0")
        self._truth = EpisodeTruth(self.task.need_ids)

    # ------------------------------------------------------------------ state
    @property
    def truth(self) -> EpisodeTruth:
        return self._truth

    @property
    def step(self) -> int:
        """How many calls have been made in this episode."""
        return self._step

    @property
    def market(self) -> Market:
        """The market in force for the next call (events with ``at_step <= step`` applied)."""
        return self.task.market_at(self._step)

    def reset(self) -> None:
        self._counts.clear()
        self._step = 0
        self._truth = EpisodeTruth(self.task.need_ids)

    # ------------------------------------------------------------------ randomness
    def _u(self, tool: str, index: int, *purpose: object) -> float:
        key = repr((self.task.seed, self.seed, tool, index, purpose)).encode()
        return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "big") / 2.0**64

    def _facts(self, domain: str, entity: Mapping[str, str]) -> dict[str, Any]:
        """Plausible, stable facts about an entity (same across tools, calls and episodes)."""
        key = repr((self.task.seed, domain, sorted(entity.items()))).encode()
        rng = random.Random(int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "big"))
        if domain not in DOMAINS:  # hand-made tasks may use their own domains
            return {**entity, "value": round(rng.uniform(0, 100), 3)}
        return DOMAINS[domain].payload(rng, entity)

    def _other_entity(self, domain: str, avoid: Mapping[str, str], u: float) -> dict[str, str]:
        if domain not in DOMAINS:
            return {k: f"other-{int(u * 1000)}" for k in avoid} or {"id": f"other-{int(u * 1000)}"}
        pool = [e for e in DOMAINS[domain].entities if dict(e) != dict(avoid)]
        return dict(pool[int(u * len(pool)) % len(pool)])

    # ------------------------------------------------------------------ calls
    def call(self, tool: str, args: Mapping[str, Any] | None = None) -> Observation:
        """Run one call (see the module docstring for the outcome model)."""
        step = self._step
        market = self.market
        self._step += 1
        if args is None:
            args = {}
        if not isinstance(args, Mapping):
            return self._record(step, tool, "{}", -1, "bad_args", frozenset(),
                                f"400 Bad Request: arguments must be a JSON object, got {type(args).__name__}")
        args_json = _canonical_json(args)
        spec = self.task.tool(tool) if isinstance(tool, str) else None
        if spec is None:
            return self._record(step, str(tool), args_json, -1, "unknown_tool", frozenset(),
                                f"404 Not Found: unknown tool {tool!r}")
        if tool not in market:
            return self._record(step, tool, args_json, -1, "unavailable", frozenset(),
                                f"410 Gone: tool {tool!r} has been removed from the market")
        if not market.is_available(tool):
            return self._record(step, tool, args_json, -1, "unavailable", frozenset(),
                                f"403 Forbidden: tool {tool!r} is banned and cannot be called")
        index = self._counts.get(tool, 0)
        self._counts[tool] = index + 1
        kind, satisfied, text = self._execute(spec, args, args_json, index)
        return self._record(step, tool, args_json, index, kind, satisfied, text)

    def _record(self, step: int, tool: str, args_json: str, index: int, kind: str,
                satisfied: frozenset[str], text: str) -> Observation:
        self._truth = self._truth.with_call(CallRecord(step, tool, args_json, index, kind, satisfied))
        return Observation(text, bool(satisfied), satisfied, ENVIRONMENT_LABEL, tool, index, kind)

    def _execute(self, spec: ToolSpec, args: Mapping[str, Any], args_json: str,
                 index: int) -> tuple[str, frozenset[str], str]:
        task = self.task
        service_up = self._u(spec.name, index, "service") < spec.base_success
        needs = [task.need(n) for n in sorted(spec.covers)]
        if not needs:  # distractor: answers about whatever it was asked, satisfies nothing
            if not service_up:
                return "error", frozenset(), _ERRORS[int(self._u(spec.name, index, "err") * len(_ERRORS))]
            dom = spec.domain
            keys = DOMAINS[dom].arg_keys if dom in DOMAINS else tuple(sorted(str(k) for k in args))
            entity = {k: str(args[k]) for k in keys if k in args}
            if not keys or len(entity) < len(keys):
                entity = self._other_entity(dom, {}, self._u(spec.name, index, "entity", args_json))
            body = {"source": spec.name, **self._facts(dom, entity)}
            return "irrelevant", frozenset(), json.dumps(body, ensure_ascii=False)
        if not service_up:
            if self._u(spec.name, index, "form") < _IRRELEVANT_SHARE:
                n = needs[0]
                wrong = self._other_entity(n.domain, task.canonical_args[n.id], self._u(spec.name, index, "entity", args_json))
                body = {"source": spec.name, **self._facts(n.domain, wrong)}
                return "irrelevant", frozenset(), json.dumps(body, ensure_ascii=False)
            return "error", frozenset(), _ERRORS[int(self._u(spec.name, index, "err") * len(_ERRORS))]

        satisfied: set[str] = set()
        parts: dict[str, Any] = {}
        missing_all: list[str] = []
        for n in needs:
            canonical = task.canonical_args[n.id]
            if n.requires and not set(n.requires) <= self._truth.satisfied:
                # A sequential dependency (market v2): this need's argument is another need's
                # result, which the episode has not obtained yet, so the call cannot satisfy it.
                first = ", ".join(task.need(r).description for r in n.requires if r not in self._truth.satisfied)
                missing_all.append(f"the arguments for {n.description} come from the result of {first}; "
                                   "look that up first")
                parts[n.domain] = {"error": f"400 Bad Request: {missing_all[-1]}"}
                continue
            q = arg_quality(args, canonical)
            if self._u(spec.name, index, "need", n.id) < q ** spec.arg_sensitivity:
                satisfied.add(n.id)
                parts[n.domain] = self._facts(n.domain, canonical)
                continue
            given = {k: str(args[k]) for k in n.arg_keys if k in args and str(args[k]).strip()}
            if not given:
                keys = ", ".join(repr(k) for k in n.arg_keys)
                missing_all.append(f"missing required argument(s) {keys}")
                parts[n.domain] = {"error": f"400 Bad Request: missing required argument(s) {keys}"}
                continue
            if len(given) == len(n.arg_keys) and q == 0.0:
                entity = given  # the arguments named another entity: that is what comes back
            else:  # partial or fuzzy match that resolved to the wrong entity
                entity = self._other_entity(n.domain, canonical, self._u(spec.name, index, "entity", args_json))
            facts = self._facts(n.domain, entity)
            parts[n.domain] = facts if entity is given else {**facts, "match": "fuzzy"}
        if len(needs) == 1:
            only = parts[needs[0].domain]
            if not satisfied and missing_all:
                return "bad_args", frozenset(), f"400 Bad Request: {missing_all[0]}"
            body = {"source": spec.name, **only}
        else:
            if not satisfied and len(missing_all) == len(needs):
                return "bad_args", frozenset(), "400 Bad Request: " + "; ".join(missing_all)
            body = {"source": spec.name, "results": parts}
        kind = "ok" if satisfied else "irrelevant"
        return kind, frozenset(satisfied), json.dumps(body, ensure_ascii=False)
