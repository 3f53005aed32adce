"""A world model that replays past observations of the same tool from ``intent.logs`` data.

The fast, model-free option: ``simulate(tool, args, satisfied=z)`` samples an observation this
tool really returned before, keeping only those whose label z matches when ``satisfied`` is
given. With ``ground=True`` a JSON payload is re-targeted at the call's arguments (keys that
appear in both take the argument's value), which is what a conditional generator does.
``temperature`` 0 picks deterministically per (tool, arguments); > 0 samples.
"""

from __future__ import annotations

import json
import random
import threading
import zlib
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from worldmodel.formats import canonical_args

__all__ = ["ReplayWorldModel", "label_of"]


def label_of(record: Any) -> int | None:
    """The z label of a log record: an annotation (``z``) if present, else the artifact's ground truth."""
    get = record.get if isinstance(record, Mapping) else lambda k, d=None: getattr(record, k, d)
    z = get("z")
    if z is None:
        extra = getattr(record, "model_extra", None) or {}
        z = extra.get("z")
    if z is None:
        artifact = get("artifact") or {}
        z = artifact.get("z") if isinstance(artifact, Mapping) else None
    return None if z is None else int(bool(z))


class ReplayWorldModel:
    name = "replay"

    def __init__(self, records: Iterable[Any], *, labeler: Callable[[Any], int | None] = label_of,
                 temperature: float = 0.0, seed: int = 0, ground: bool = True) -> None:
        self._by_tool: dict[str, list[tuple[str, int | None]]] = defaultdict(list)
        for r in records:
            get = r.get if isinstance(r, Mapping) else lambda k, d=None, r=r: getattr(r, k, d)
            if get("decision") != "accept" or get("status") not in ("ok", "error") or not get("observation"):
                continue
            obs = str(get("observation")).split("\n[Budget status]")[0].split("\n<budget>")[0]
            self._by_tool[str(get("tool"))].append((obs, labeler(r)))
        for pool in self._by_tool.values():  # the log's order (thread interleaving) must not matter
            pool.sort(key=lambda item: (item[0], -1 if item[1] is None else item[1]))
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
        twin._rng, twin._lock, twin.fallbacks = random.Random(seed), threading.Lock(), 0
        return twin

    @property
    def tools(self) -> list[str]:
        return sorted(self._by_tool)

    def __len__(self) -> int:
        return sum(len(v) for v in self._by_tool.values())

    def simulate(self, tool: str, args: Mapping[str, Any], *, satisfied: bool | None = None) -> str:
        pool = self._by_tool.get(tool, [])
        if satisfied is not None:
            pool = [p for p in pool if p[1] == int(satisfied)]
        if not pool:
            with self._lock:
                self.fallbacks += 1
            payload = {"tool": tool, **dict(args)} if satisfied is not False else {"error": "no result"}
            return json.dumps(payload)
        if self.temperature <= 0:
            index = zlib.crc32(f"{tool}|{canonical_args(args)}".encode()) % len(pool)
        else:
            with self._lock:
                index = self._rng.randrange(len(pool))
        text = pool[index][0]
        return self._ground(text, args) if self.ground else text

    @staticmethod
    def _ground(text: str, args: Mapping[str, Any]) -> str:
        try:
            payload = json.loads(text)
        except json.JSONDecodeError:
            return text
        if not isinstance(payload, dict):
            return text
        for key, value in args.items():
            if key in payload:
                payload[key] = value
        return json.dumps(payload)
