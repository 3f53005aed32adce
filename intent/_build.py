"""Fast construction of the frozen, slotted dataclasses the guard makes on every tool call.

A frozen dataclass's ``__init__`` sets each field with ``object.__setattr__(self, name, value)``
(its own ``__setattr__`` refuses), which costs several times a plain attribute store: under
callgrind an 11-field :class:`~intent.ledger.LedgerEntry` took about 16,000 instructions to
make, the same fields stored into a plain slotted object about 3,000. The guard makes a
few of these per tool call (ledger entries, the oracle's context, proposal and decision).

:func:`builder` returns a function with the class's own signature that stores the fields into
an instance of a plain twin class with the same slots, then makes it an instance of the class
itself (``__class__`` assignment: the two layouts are the same). The result is an ordinary
instance of the class (equal, hashed and printed as one built by ``cls(...)``, and frozen);
only the way it was filled differs. Used for classes without ``__post_init__`` only (that is
checked), so nothing ``__init__`` does is skipped.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, TypeVar

__all__ = ["builder"]

T = TypeVar("T")

_MISSING = object()


def builder(cls: type[T]) -> Callable[..., T]:
    """A function ``build(*args, **kwargs)`` making ``cls(*args, **kwargs)`` the cheap way
    (``cls`` itself when the cheap way does not apply to it)."""
    slots = cls.__dict__.get("__slots__")
    params = [f for f in dataclasses.fields(cls) if f.init]  # type: ignore[arg-type]
    if (slots is None or cls.__bases__ != (object,) or hasattr(cls, "__post_init__")
            or tuple(slots) != tuple(f.name for f in dataclasses.fields(cls))  # type: ignore[arg-type]
            or len(params) != len(slots)):
        return cls
    twin = type(f"_{cls.__name__}Parts", (), {"__slots__": tuple(slots)})
    names = [f.name for f in params]
    env: dict[str, Any] = {"_new": object.__new__, "_twin": twin, "_cls": cls, "_set": object.__setattr__,
                           "_MISSING": _MISSING}
    args, body = [], []
    for f in params:
        if f.default is not dataclasses.MISSING:
            env[f"_d_{f.name}"] = f.default
            args.append(f"{f.name}=_d_{f.name}")
        elif f.default_factory is not dataclasses.MISSING:
            env[f"_f_{f.name}"] = f.default_factory
            args.append(f"{f.name}=_MISSING")
            body.append(f"    if {f.name} is _MISSING: {f.name} = _f_{f.name}()")
        else:
            args.append(f.name)
    body += ["    self = _new(_twin)", *(f"    self.{n} = {n}" for n in names),
             "    _set(self, '__class__', _cls)", "    return self"]
    src = f"def build({', '.join(args)}):\n" + "\n".join(body) + "\n"
    exec(src, env)  # noqa: S102 - generated from the dataclass's own fields, as dataclasses does
    build = env["build"]
    build.__qualname__ = build.__name__ = f"build_{cls.__name__}"
    build.__doc__ = f"``{cls.__name__}(...)``, made the cheap way (intent._build)."
    return build
