"""A world model from StableToolBench's ``template_response`` schemas (simulated, deterministic).

It fills the response schema of the called API (the same filler as the benchmark's
schema-simulated environment, ``eval.stabletoolbench``), inside StableToolBench's
``{"error": "", "response": ...}`` envelope. ``satisfied=False`` returns an error envelope.
It predicts the *shape* of a response, never its content — which is what a rollout needs to
elicit the agent's plan (the paper, section 3.1).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from typing import Any

__all__ = ["SchemaWorldModel"]


class SchemaWorldModel:
    name = "schema"

    def __init__(self, apis: Iterable[Any]) -> None:
        from eval.stabletoolbench import SchemaSimulator  # the benchmark's filler: one definition

        self._simulator = SchemaSimulator(list(apis))

    def simulate(self, tool: str, args: Mapping[str, Any], *, satisfied: bool | None = None) -> str:
        if satisfied is False:
            return json.dumps({"error": "simulated failure: the call did not return what was needed", "response": ""})
        return self._simulator.call(tool, dict(args)).observation
