"""The schema-simulated environment seen as a world model: an **upper bound that leaks**.

It answers a call exactly as the benchmark's schema-simulated environment
(:class:`~eval.stabletoolbench.environment.SchemaSimulator`) does, so an oracle using it
knows the environment's responses before the call is made: no learned world model can do
better. It is part of the environment, not a world model built from logs, which is why it
lives here and not in ``worldmodel/``. The benchmark uses it only when asked
(``options["world_model"] == "schema"``) and then labels the results
:data:`SCHEMA_WORLD_MODEL_LABEL`. ``satisfied=False`` returns an error envelope.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from typing import Any

from .environment import SchemaSimulator
from .loader import StbApi

__all__ = ["SCHEMA_WORLD_MODEL_LABEL", "SchemaWorldModel"]

SCHEMA_WORLD_MODEL_LABEL = "world model = environment simulator (upper bound, leaks)"


class SchemaWorldModel:
    """``leaks=False`` when the episodes run against another environment (MirrorAPI, a server):
    the schema filler then knows response shapes only, and its label says so."""

    name = "schema"

    def __init__(self, apis: Iterable[StbApi], *, leaks: bool = True) -> None:
        self._simulator = SchemaSimulator(list(apis))
        self.label = (SCHEMA_WORLD_MODEL_LABEL if leaks else
                      "world model = template_response schema filler (response shapes only; not the environment)")

    def simulate(self, tool: str, args: Mapping[str, Any], *, satisfied: bool | None = None) -> str:
        if satisfied is False:
            return json.dumps({"error": "simulated failure: the call did not return what was needed", "response": ""})
        return self._simulator.call(tool, dict(args)).observation
