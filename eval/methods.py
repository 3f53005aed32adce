"""The methods the benchmark compares, by name. Each builds a fresh oracle per episode.

A method is a :class:`MethodSpec`: a name, whether the guard's hard gate is on, and a
factory ``build(ctx) -> Oracle``. Later modules add themselves with :func:`register`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from intent.oracle import Oracle

__all__ = ["MethodContext", "MethodSpec", "available_methods", "get_method", "register"]


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
    name: str
    enforce: bool
    build: Callable[[MethodContext], Oracle]
    description: str = ""
    episode: EpisodeLoop | None = None


def _raw(ctx: MethodContext) -> Oracle:
    from baselines.raw import RawOracle

    return RawOracle()


def _prompt(ctx: MethodContext) -> Oracle:
    from baselines.prompt import PromptOracle

    return PromptOracle()


def _tracker(ctx: MethodContext) -> Oracle:
    from baselines.prompt import PromptOracle

    return PromptOracle()


_REGISTRY: dict[str, MethodSpec] = {
    "raw": MethodSpec("raw", False, _raw, "no cost information, no gate (soft)"),
    "prompt": MethodSpec("prompt", False, _prompt, "prices and budget status in the prompt, no gate (soft)"),
    "tracker": MethodSpec("tracker", True, _tracker, "Prompt with the guard's hard gate on (production tracker)"),
}


def register(spec: MethodSpec) -> None:
    _REGISTRY[spec.name] = spec


def available_methods() -> list[str]:
    _load_plugins()
    return sorted(_REGISTRY)


def get_method(name: str) -> MethodSpec:
    _load_plugins()
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown method {name!r}; choose from {', '.join(sorted(_REGISTRY))}") from None


def _load_plugins() -> None:
    """Modules that define more methods register them on import."""
    import importlib

    for module in ("baselines.registry", "eval.oracle_methods"):
        try:
            importlib.import_module(module)
        except ModuleNotFoundError as exc:
            if exc.name not in (module, module.rsplit(".", 1)[0]):
                raise
