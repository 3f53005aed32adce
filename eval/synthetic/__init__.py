"""Synthetic market: procedurally generated tasks with hidden tool reliabilities.

Everything here is simulated (tools, payloads, failures); the ground truth is exact, so the
pass rate is exact and the budget-optimal bound (OR's denominator) can be computed.
"""

from __future__ import annotations

SIMULATED_LABEL = "synthetic market (simulated tools, exact ground truth)"

from .domains import DOMAIN_NAMES, DOMAINS, Domain  # noqa: E402
from .executor import (  # noqa: E402
    ENVIRONMENT_LABEL,
    CallRecord,
    EpisodeTruth,
    Observation,
    SyntheticEnvironment,
    judge,
    task_solved,
)
from .generator import generate_task, generate_tasks  # noqa: E402
from .generator_v2 import generate_task_v2, generate_tasks_v2  # noqa: E402
from .oracle_bound import DEFAULT_CONFIDENCE, ClairvoyantPlan, OptimalPlan, clairvoyant_plan, PolicySummary, optimal_plan, solvable  # noqa: E402
from .world import (  # noqa: E402
    EVENT_KINDS,
    TIERS,
    MarketEvent,
    Need,
    Task,
    ToolSpec,
    apply_event,
    arg_quality,
    success_probability,
)

__all__ = [
    "DEFAULT_CONFIDENCE",
    "ENVIRONMENT_LABEL",
    "CallRecord",
    "EpisodeTruth",
    "Observation",
    "SyntheticEnvironment",
    "judge",
    "task_solved",
    "DOMAINS",
    "DOMAIN_NAMES",
    "EVENT_KINDS",
    "SIMULATED_LABEL",
    "TIERS",
    "Domain",
    "MarketEvent",
    "Need",
    "ClairvoyantPlan",
    "OptimalPlan",
    "clairvoyant_plan",
    "PolicySummary",
    "Task",
    "ToolSpec",
    "apply_event",
    "arg_quality",
    "generate_task",
    "generate_tasks",
    "generate_task_v2",
    "generate_tasks_v2",
    "optimal_plan",
    "solvable",
    "success_probability",
]
