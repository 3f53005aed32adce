"""BTP's planner: the bounded knapsack over call quotas, exact, with traceback.

maximise   sum_i f_i * v_i
subject to sum_i f_i * c_i <= capacity,  0 <= f_i <= cap_i,  f_i integer.

Real-valued prices are turned into integers as in the BTP paper's Appendix A.1: with N the
largest possible number of calls (sum of the caps) and a tolerance eps, lambda = (N + 1) / eps,
every price is rounded **up** (ceil(lambda c) / lambda) and the capacity **down**
(floor(lambda R) / lambda). A plan feasible for the rounded problem is therefore feasible for
the real prices, and the rounded problem loses at most eps of capacity: any plan whose real
cost is <= R - eps is feasible after rounding. When every price and the capacity have at most
two decimals the scale is exactly 100 and the answer is exact for the real problem.

Ties are broken deterministically: among plans of maximal value the one of **lowest (scaled)
cost** is returned, and among those the DP keeps earlier choices (a later tool, in the order
the prices are given, is only added when it strictly improves the value).
A tool with price 0 and a positive value gets its full cap (it costs nothing).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from decimal import Decimal

import numpy as np

__all__ = ["QuotaPlan", "plan_quotas", "plan_quotas_detailed"]


@dataclass(frozen=True)
class QuotaPlan:
    quotas: dict[str, int]
    total_value: float
    total_cost: float
    scale: float
    exact: bool


def _decimals(x: float) -> int:
    d = Decimal(repr(float(x))).normalize()
    return max(0, -d.as_tuple().exponent)


def _check(prices: Mapping[str, float], values: Mapping[str, float], caps: Mapping[str, int], capacity: float) -> None:
    for name, src in (("values", values), ("caps", caps)):
        unknown = sorted(set(src) - set(prices))
        if unknown:
            raise ValueError(f"unknown tool {unknown[0]!r} in {name}: it has no price; give every tool a price")
        missing = sorted(set(prices) - set(src))
        if missing:
            raise ValueError(f"tool {missing[0]!r} has a price but no entry in {name}; give every tool a value and a cap")
    for t, c in prices.items():
        if isinstance(c, bool) or not isinstance(c, (int, float)) or not math.isfinite(c) or c < 0:
            raise ValueError(f"prices[{t!r}]={c!r} must be a finite number >= 0")
    for t, v in values.items():
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0.0 <= v <= 1.0:
            raise ValueError(f"values[{t!r}]={v!r} is outside [0, 1]; BTP values are expected usefulness in [0, 1]")
    for t, f in caps.items():
        if isinstance(f, bool) or not isinstance(f, int) or f < 0:
            raise ValueError(f"caps[{t!r}]={f!r} must be an integer >= 0")
    if isinstance(capacity, bool) or not isinstance(capacity, (int, float)) or not math.isfinite(capacity):
        raise ValueError(f"capacity={capacity!r} must be a finite number")


def plan_quotas_detailed(prices: Mapping[str, float], values: Mapping[str, float], caps: Mapping[str, int],
                         capacity: float, *, epsilon: float = 0.01) -> QuotaPlan:
    _check(prices, values, caps, capacity)
    names = list(prices)
    quotas = {t: 0 for t in names}
    if capacity < 0:
        return QuotaPlan(quotas, 0.0, 0.0, 1.0, True)
    exact = all(_decimals(c) <= 2 for c in prices.values()) and _decimals(capacity) <= 2
    if exact:
        scale = 100.0
    else:
        if not epsilon > 0:
            raise ValueError(f"epsilon must be > 0, got {epsilon}")
        scale = (sum(caps.values()) + 1) / epsilon
    cap_units = int(math.floor(capacity * scale + 1e-9)) if exact else int(math.floor(capacity * scale))
    items: list[tuple[str, int, int, float]] = []  # (tool, units per call, count in this chunk, value per call)
    for t in names:
        cap, v, c = caps[t], float(values[t]), float(prices[t])
        if cap == 0 or v <= 0:
            continue
        w = int(round(c * scale)) if exact else int(math.ceil(c * scale - 1e-12))
        if w == 0:
            quotas[t] = cap  # free and useful: take every allowed call
            continue
        if w > cap_units:
            continue
        k, left = 1, min(cap, cap_units // w)
        while left > 0:  # binary splitting: chunks 1, 2, 4, ... cover every count <= cap
            take = min(k, left)
            items.append((t, w, take, v))
            left -= take
            k *= 2
    best = np.zeros(cap_units + 1)
    taken = np.zeros((len(items), cap_units + 1), dtype=bool)
    for i, (_, w, k, v) in enumerate(items):
        size = w * k
        if size > cap_units:
            continue
        cand = best[:-size] + v * k
        better = cand > best[size:] + 1e-12  # strictly better: ties keep the earlier choice
        taken[i, size:] = better
        best[size:] = np.where(better, cand, best[size:])
    top = float(best[-1])
    j = int(np.flatnonzero(best >= top - 1e-12)[0])  # the smallest capacity reaching the optimum
    for i in range(len(items) - 1, -1, -1):
        if taken[i, j]:
            t, w, k, _ = items[i]
            quotas[t] += k
            j -= w * k
    total_cost = sum(quotas[t] * float(prices[t]) for t in names)
    total_value = sum(quotas[t] * float(values[t]) for t in names)
    return QuotaPlan(quotas, total_value, total_cost, scale, exact)


def plan_quotas(prices: Mapping[str, float], values: Mapping[str, float], caps: Mapping[str, int],
                capacity: float) -> dict[str, int]:
    """Call quotas per tool: the bounded-knapsack optimum (see the module docstring)."""
    return plan_quotas_detailed(prices, values, caps, capacity).quotas
