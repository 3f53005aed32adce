"""Seeded integer API prices (simulated: StableToolBench and BTP ship no price-sampling code).

``assign_prices`` draws U{low..high} with one ``random.Random(seed)`` walking the *sorted*
distinct function names, so the result depends only on the seed, the range and the set of
names (never on their order). The prices file records the seed, the range and the budget.
"""

from __future__ import annotations

import json
import math
import os
import random
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from intent.errors import UsageError

from .loader import StbApi

__all__ = [
    "DEFAULT_BUDGET",
    "DEFAULT_HIGH",
    "DEFAULT_LOW",
    "PriceFile",
    "assign_prices",
    "price_meta",
    "read_prices",
    "write_prices",
]

DEFAULT_LOW = 5
DEFAULT_HIGH = 50
DEFAULT_BUDGET = 50
_FORMAT = "intent.stabletoolbench.prices/v1"


@dataclass(frozen=True)
class PriceFile:
    prices: dict[str, int]
    meta: dict[str, Any] = field(default_factory=dict)


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _check_range(seed: Any, low: Any, high: Any) -> None:
    if not _is_int(seed):
        raise UsageError(f"price seed must be an integer, got {seed!r}")
    if not (_is_int(low) and _is_int(high)):
        raise UsageError(f"price range bounds must be integers, got low={low!r} high={high!r}")
    if low < 1:
        raise UsageError(f"prices must be positive integers (BTP's knapsack needs cost > 0), got low={low}")
    if low > high:
        raise UsageError(f"empty price range: low={low} > high={high}; give low <= high")


def assign_prices(
    apis_or_names: Iterable[StbApi | str], seed: int, low: int = DEFAULT_LOW, high: int = DEFAULT_HIGH
) -> dict[str, int]:
    """``{function_name: price}`` with prices drawn uniformly from the integers ``low..high``."""
    _check_range(seed, low, high)
    names: set[str] = set()
    for item in apis_or_names:
        if isinstance(item, StbApi):
            names.add(item.function_name)
        elif isinstance(item, str) and item:
            names.add(item)
        else:
            raise UsageError(f"expected StbApi objects or non-empty function names, got {item!r}")
    rng = random.Random(seed)
    return {name: rng.randint(low, high) for name in sorted(names)}


def price_meta(seed: int, low: int = DEFAULT_LOW, high: int = DEFAULT_HIGH, budget: float = DEFAULT_BUDGET,
               **extra: Any) -> dict[str, Any]:
    """The meta block of a prices file: seed, range, budget (plus any extra fields).

    The budget is the run's, a number > 0 (``--budget 12.5`` stays 12.5; an integral one is written
    as an integer). It was required to be an integer, so the benchmark passed ``int(budget)``:
    12.5 was recorded as 12, and 0.5 became 0 and stopped the run.
    """
    _check_range(seed, low, high)
    if isinstance(budget, bool) or not isinstance(budget, int | float) or not math.isfinite(budget) or budget <= 0:
        raise UsageError(f"budget must be a finite number > 0, got {budget!r}")
    if float(budget).is_integer():
        budget = int(budget)
    return {"seed": seed, "range": [low, high], "budget": budget,
            "note": "simulated prices (seeded uniform integers)", **extra}


def _check_meta(meta: Mapping[str, Any], where: str) -> dict[str, Any]:
    missing = [k for k in ("seed", "range", "budget") if k not in meta]
    if missing:
        raise UsageError(f"{where}: price meta is missing {missing}; build it with price_meta(seed, low, high, budget)")
    rng = meta["range"]
    if not (isinstance(rng, list | tuple) and len(rng) == 2):
        raise UsageError(f"{where}: price meta 'range' must be [low, high], got {rng!r}")
    _check_range(meta["seed"], rng[0], rng[1])
    return dict(meta)


def _check_prices(prices: Mapping[str, Any], meta: Mapping[str, Any], where: str) -> dict[str, int]:
    low, high = meta["range"]
    out: dict[str, int] = {}
    for name, price in prices.items():
        if not _is_int(price) or not (low <= price <= high):
            raise UsageError(f"{where}: price of {name!r} is {price!r}, expected an integer in [{low}, {high}]")
        out[str(name)] = price
    return out


def write_prices(path: str | os.PathLike[str], prices: Mapping[str, int], meta: Mapping[str, Any]) -> Path:
    """Write ``{"format", "meta", "prices"}`` as JSON (keys sorted) and return the path."""
    p = Path(path)
    m = _check_meta(meta, str(p))
    checked = _check_prices(prices, m, str(p))
    p.parent.mkdir(parents=True, exist_ok=True)
    payload = {"format": _FORMAT, "meta": m, "prices": dict(sorted(checked.items()))}
    p.write_text(json.dumps(payload, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    return p


def read_prices(path: str | os.PathLike[str]) -> PriceFile:
    """Read and validate a prices file written by :func:`write_prices`."""
    p = Path(path)
    if not p.is_file():
        raise UsageError(f"prices file not found: {p}")
    try:
        data = json.loads(p.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise UsageError(f"malformed prices file {p}: {exc.msg} at line {exc.lineno}") from exc
    if not isinstance(data, dict) or "meta" not in data or "prices" not in data:
        raise UsageError(f"prices file {p} must be an object with 'meta' and 'prices'")
    if not isinstance(data["prices"], dict):
        raise UsageError(f"prices file {p}: 'prices' must be an object")
    meta = _check_meta(data["meta"], str(p))
    return PriceFile(prices=_check_prices(data["prices"], meta, str(p)), meta=meta)
