"""A world model that replays past observations of the same tool from ``intent.logs`` data.

The fast, model-free option: ``simulate(tool, args, satisfied=z)`` samples an observation this
tool really returned before, keeping only those whose label z matches when ``satisfied`` is
given. With ``ground=True`` a JSON payload not labelled a failure (z = 0) is re-targeted at the call's
arguments, at every depth: a key of any nested object that is also an argument takes the argument's value (a
bundle's ``{"source": ..., "results": {"weather": {"city": ...}, ...}}`` is about the city
asked for, not the logged one), which is what a conditional generator does. An argument is written as the tool's successful answers
write it, learned from the same log: a value seen as an argument of a labelled success (z = 1) takes the
value that success returned under its key (``"tor"`` -> ``"Toronto"``: the environment answers about the
entity, not the typed text); an unseen value that is one of the values successes returned under that key is
kept (``"York"``, not ``"New York"``), and one that begins some of them takes the most frequent of those
(``"toro"`` -> ``"Toronto"``; ``"ont"``, only inside it, is not completed). Otherwise the argument is echoed
as given. Without this, an ideal (z = 1) observation of a half-typed call named the half-typed text, and an
agent that checks the answer is about its entity read the simulated success as a failure.

``temperature`` (set here, or per call: ``simulate(..., temperature=t)``) 0 picks
deterministically per (tool, arguments); t > 0 samples a distinct logged observation with
probability proportional to ``count ** (1 / t)``: t = 1 is the log's own frequencies, t < 1
sharpens towards the most frequent observation, t > 1 flattens towards uniform.
"""

from __future__ import annotations

import json
import math
import random
import threading
import zlib
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from intent.errors import UsageError
from intent.logs import label_of  # the project's one label extraction (public here too, as it always was)
from worldmodel.formats import canonical_args

__all__ = ["ReplayWorldModel", "label_of"]


class ReplayWorldModel:
    name = "replay"

    def __init__(self, records: Iterable[Any], *, labeler: Callable[[Any], int | None] = label_of,
                 temperature: float = 0.0, seed: int = 0, ground: bool = True) -> None:
        from intent.feedback import without_result_note

        self._by_tool: dict[str, list[tuple[str, int | None]]] = defaultdict(list)
        aliases: dict[tuple[str, str], Counter[str]] = defaultdict(Counter)
        vocabulary: dict[str, Counter[str]] = defaultdict(Counter)
        for r in records:
            get = r.get if isinstance(r, Mapping) else lambda k, d=None, r=r: getattr(r, k, d)
            if get("decision") != "accept" or get("status") not in ("ok", "error") or not get("observation"):
                continue
            obs = without_result_note(str(get("observation")))
            z = labeler(r)
            self._by_tool[str(get("tool"))].append((obs, z))
            if z == 1:
                _learn_values(obs, get("args"), aliases, vocabulary)
        for pool in self._by_tool.values():  # the log's order (thread interleaving) must not matter
            pool.sort(key=lambda item: (item[0], -1 if item[1] is None else item[1]))
        # Most frequent first, ties by the value itself: independent of the log's order.
        self._aliases = {k: _most_common(c) for k, c in aliases.items()}
        self._vocabulary = {k: sorted(c.items(), key=lambda kv: (-kv[1], kv[0])) for k, c in vocabulary.items()}
        self.temperature = temperature
        self.ground = ground
        self._rng = random.Random(seed)
        self._lock = threading.Lock()
        self.fallbacks = 0

    def fork(self, seed: int) -> ReplayWorldModel:
        """A view on the same observations with its own random stream.

        Sampling (temperature > 0) from one shared stream would make results depend on how
        concurrent episodes interleave; one fork per episode keeps every run reproducible.
        """
        twin = object.__new__(ReplayWorldModel)
        twin._by_tool, twin.temperature, twin.ground = self._by_tool, self.temperature, self.ground
        twin._aliases, twin._vocabulary = self._aliases, self._vocabulary
        twin._rng, twin._lock, twin.fallbacks = random.Random(seed), threading.Lock(), 0
        return twin

    @property
    def tools(self) -> list[str]:
        return sorted(self._by_tool)

    def __len__(self) -> int:
        return sum(len(v) for v in self._by_tool.values())

    def simulate(self, tool: str, args: Mapping[str, Any], *, satisfied: bool | None = None,
                 temperature: float | None = None) -> str:
        t = self.temperature if temperature is None else float(temperature)
        if not t >= 0:
            raise UsageError(f"temperature must be >= 0, got {temperature!r}")
        pool = self._by_tool.get(tool, [])
        if satisfied is not None:
            pool = [p for p in pool if p[1] == int(satisfied)]
        if not pool:
            with self._lock:
                self.fallbacks += 1
            payload = {"tool": tool, **dict(args)} if satisfied is not False else {"error": "no result"}
            return json.dumps(payload)
        if t <= 0:
            text, z = pool[zlib.crc32(f"{tool}|{canonical_args(args)}".encode()) % len(pool)]
        elif t == 1:
            # Uniform over the logged entries is sampling by the log's frequencies (one draw).
            with self._lock:
                text, z = pool[self._rng.randrange(len(pool))]
        else:
            counts: dict[tuple[str, int | None], int] = {}
            for entry in pool:  # the pool is sorted, so this order is reproducible
                counts[entry] = counts.get(entry, 0) + 1
            distinct = list(counts)
            # In log space: count ** (1 / t) overflows for small t.
            logw = [math.log(counts[o]) / t for o in distinct]
            top = max(logw)
            with self._lock:
                text, z = self._rng.choices(distinct, weights=[math.exp(w - top) for w in logw])[0]
        # A failure stays as it was logged: re-targeted at the call's arguments, a payload about the wrong
        # entity would read as the right answer (a failure turned into a success).
        return self._ground(text, args) if self.ground and z != 0 else text

    def _ground(self, text: str, args: Mapping[str, Any]) -> str:
        try:
            payload = json.loads(text)
        except json.JSONDecodeError:
            return text
        if not isinstance(payload, (dict, list)):
            return text
        return json.dumps(_retarget(payload, {k: self.as_answered(k, v) for k, v in args.items()}))

    def as_answered(self, key: str, value: Any) -> Any:
        """``value`` of argument ``key`` as the logged successes write it (see the module docstring)."""
        if not isinstance(value, str):  # numbers and structures are echoed as given
            return value
        typed = _norm(value)
        if not typed:
            return value
        seen = self._aliases.get((key, typed))
        if seen is not None:
            return seen
        return self._completed(key, typed, value)

    def _completed(self, key: str, typed: str, value: str) -> str:
        """``typed`` completed to a value successes returned under ``key``, or ``value`` as given."""
        vocabulary = self._vocabulary.get(key, ())
        # A whole known value is its own entity: "York" is not the more frequent "New York" it is part of,
        # nor the more frequent "Yorkshire" it begins.
        for known, _ in vocabulary:
            if _norm(known) == typed:
                return known
        # Half-typing writes the start of a name: "tor" is Toronto; "ont", only inside it, is not.
        for known, _ in vocabulary:  # most frequent first
            if _norm(known).startswith(typed):
                return known
        return value


def _norm(value: Any) -> str:
    return " ".join(str(value).lower().split())


def _most_common(counter: Counter[str]) -> str:
    return min(counter.items(), key=lambda kv: (-kv[1], kv[0]))[0]


def _learn_values(observation: str, args: Any, aliases: dict[tuple[str, str], Counter[str]],
                  vocabulary: dict[str, Counter[str]]) -> None:
    """From one labelled success: what it returned under each argument's key, for that argument's value."""
    if not isinstance(args, Mapping) or not args:
        return
    try:
        payload = json.loads(observation)
    except json.JSONDecodeError:
        return
    found: dict[str, set[str]] = defaultdict(set)
    _scalars_under(payload, set(args), found)
    for key, values in found.items():
        typed = args.get(key)
        if not isinstance(typed, str) or not _norm(typed):
            continue
        for v in values:
            vocabulary[key][v] += 1
        if len(values) == 1:  # one answer under this key: it is the argument's entity
            aliases[(key, _norm(typed))][next(iter(values))] += 1


def _scalars_under(node: Any, keys: set[str], found: dict[str, set[str]]) -> None:
    if isinstance(node, dict):
        for k, v in node.items():
            if k in keys and isinstance(v, str):
                found[k].add(v)
            else:
                _scalars_under(v, keys, found)
    elif isinstance(node, list):
        for v in node:
            _scalars_under(v, keys, found)


def _retarget(node: Any, args: Mapping[str, Any]) -> Any:
    """``node`` with every scalar under a key named like an argument set to that argument's value,
    at any depth (objects and lists). Nested objects are recursed into, never replaced: an
    argument never stands for a whole sub-payload."""
    if isinstance(node, dict):
        return {k: args[k] if k in args and not isinstance(v, (dict, list)) else _retarget(v, args)
                for k, v in node.items()}
    if isinstance(node, list):
        return [_retarget(v, args) for v in node]
    return node
