"""The one registry of benchmark methods, by name.

Built-in methods come from the modules that define them (:mod:`eval.baseline_methods`,
:mod:`eval.oracle_methods`, :mod:`eval.optimal`), each a tuple ``METHODS`` of
:class:`~eval.method_spec.MethodSpec`. Other packages add methods through the entry-point
group ``intent.methods`` (each entry point names a ``MethodSpec`` or an iterable of them)::

    [project.entry-points."intent.methods"]
    my-oracle = "my_package.bench:METHODS"

or, in-process, with :func:`register`. A name is taken once: a plugin cannot silently replace
a built-in method.
"""

from __future__ import annotations

import difflib
import threading
from collections.abc import Iterable
from importlib.metadata import entry_points

from eval import baseline_methods, optimal, oracle_methods
from eval.method_spec import SYSTEM_PROMPT, EpisodeLoop, MethodContext, MethodSpec
from intent.errors import UsageError

__all__ = ["SYSTEM_PROMPT", "EpisodeLoop", "MethodContext", "MethodSpec", "available_methods", "get_method",
           "register"]

ENTRY_POINT_GROUP = "intent.methods"

_REGISTRY: dict[str, MethodSpec] = {}
_lock = threading.Lock()
_plugins_loaded = False


def register(spec: MethodSpec, *, replace: bool = False) -> None:
    """Add a method. ``replace=True`` is needed to swap out one that is already registered."""
    if not isinstance(spec, MethodSpec):
        raise TypeError(f"register() takes a MethodSpec, got {type(spec).__name__}")
    with _lock:
        if spec.name in _REGISTRY and not replace and _REGISTRY[spec.name] is not spec:
            raise UsageError(f"method {spec.name!r} is already registered; pass replace=True to replace it")
        _REGISTRY[spec.name] = spec


def _register_all(specs: Iterable[MethodSpec]) -> None:
    for spec in specs:
        register(spec)


_register_all((*baseline_methods.METHODS, *oracle_methods.METHODS, *optimal.METHODS))


def _load_plugins() -> None:
    global _plugins_loaded
    if _plugins_loaded:
        return
    _plugins_loaded = True
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        loaded = ep.load()
        _register_all([loaded] if isinstance(loaded, MethodSpec) else loaded)


def available_methods() -> list[str]:
    _load_plugins()
    return sorted(_REGISTRY)


def get_method(name: str) -> MethodSpec:
    _load_plugins()
    try:
        return _REGISTRY[name]
    except KeyError:
        # Names are lower case and matched exactly (they name result rows and run files); a near miss
        # ("MCO", "intnet") is named as the likely intended method.
        close = [m for m in _REGISTRY if m.lower() == name.strip().lower()] or difflib.get_close_matches(
            name.strip().lower(), list(_REGISTRY), n=1, cutoff=0.75)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise UsageError(f"unknown method {name!r}{hint} Choose from {', '.join(sorted(_REGISTRY))}") from None
