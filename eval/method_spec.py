"""What a benchmark method is: a name, whether the guard's hard gate is on, an oracle factory.

The bottom of ``eval``: it imports nothing else from the package, so the modules that define
methods (:mod:`eval.baseline_methods`, :mod:`eval.oracle_methods`, :mod:`eval.optimal`) and the
registry (:mod:`eval.methods`) and the runner all point down to it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from intent.errors import UsageError
from intent.oracle import Oracle

__all__ = ["SYSTEM_PROMPT", "EpisodeLoop", "MethodContext", "MethodSpec"]

# The agent's system prompt in every episode (methods append their own notes to it).
SYSTEM_PROMPT = "You are a tool-using assistant. Answer the user's question using the tools."


@dataclass(frozen=True)
class MethodContext:
    """What a method may use to build its oracle for one episode."""

    env: Any  # eval.markets.EpisodeEnv
    seed: int
    options: dict[str, Any] = field(default_factory=dict)
    model: Any = None  # the agent's chat model (a verifier or policy may reuse it)
    simulated_agent: bool = True
    resources: Any = None  # eval.oracle_methods.OracleResources: logs and oracle models, built lazily


# A custom episode loop (e.g. DFSDT's search): (env, model, guard, episode_id) ->
# (final message list, answer or None, extra diagnostics). It must go through the guard.
EpisodeLoop = Callable[[Any, Any, Any, str], tuple[list[Any], "str | None", dict[str, Any]]]


@dataclass(frozen=True)
class MethodSpec:
    """One method. ``upper_bound`` marks a method that reads the ground truth (never a real oracle)."""

    name: str
    enforce: bool
    build: Callable[[MethodContext], Oracle]
    description: str = ""
    episode: EpisodeLoop | None = None
    upper_bound: bool = False
    needs_oracle_logs: bool = False  # its oracle is built from logs collected before the run (timed apart)


DEFAULT_MAX_DEPTH = 8  # the paper's rollout horizon (model turns)
DEFAULT_GAMMA, DEFAULT_DELTA = 0.5, 0.1  # INTENT's risk factor and blacklist threshold, as the paper fixes them


def positive_int_option(options: dict[str, Any] | None, key: str, default: int, *, flag: str, meaning: str) -> int:
    """``options[key]`` (or ``default``), refused unless an integer >= 1, naming its flag."""
    value = (options or {}).get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise UsageError(f"{flag} must be an integer >= 1 ({meaning}), got {value!r}")
    return value


def rollout_depth(options: dict[str, Any] | None) -> int:
    """MCO's and INTENT's rollout horizon in model turns (``--max-depth``; default 8)."""
    return positive_int_option(options, "max_depth", DEFAULT_MAX_DEPTH, flag="--max-depth",
                               meaning="model turns in each MCO/INTENT rollout")
