"""What a public-API argument must look like, for the checks at the API's boundary (their errors name the argument
and the fix where they are raised).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from typing import Any


def is_list_arg(value: Any, *, mapping: bool = False) -> bool:
    """Whether ``value`` can stand for a list argument (tools, tool names): an iterable, but not a string (read
    letter by letter) nor, unless ``mapping``, a mapping (read by its keys)."""
    if isinstance(value, (str, bytes)) or (not mapping and isinstance(value, Mapping)):
        return False
    return isinstance(value, Iterable)


def is_path_arg(value: Any) -> bool:
    """Whether ``value`` can be a file path argument: a non-empty str or an ``os.PathLike``."""
    return isinstance(value, (str, os.PathLike)) and bool(str(value))
