"""BTP's tool-usage planner: a bounded knapsack over call quotas, solved exactly, with traceback.

The problem (BTP paper, Eqs. 5-7 and Algorithm 1)::

    maximise    sum_i f_i * v_i
    subject to  sum_i f_i * c_i <= R          (R = B - c_s, the capacity)
                0 <= f_i <= F_i,  f_i integer

where ``c_i`` is a tool's price, ``v_i`` its expected value in [0, 1] and ``F_i`` its frequency
cap. :func:`plan_quotas` returns the optimal ``f`` per tool; :func:`plan_quotas_detailed` also
returns the objective, the real cost and the scale used.

Integer scaling of prices
-------------------------
The DP runs over integer cost units. Prices and the capacity are read as the decimal numbers
that ``repr`` shows (``0.1`` is 1/10, not the nearest binary float), and scaled by ``lambda``:

* If every price has **at most two decimals**, ``lambda = 100``. Scaling is then exact and the
  plan is optimal for the real problem (``QuotaPlan.exact`` is True). The capacity may have any
  number of decimals: with integer costs, ``sum w <= lambda R`` holds exactly when
  ``sum w <= floor(lambda R)``. Only the prices of tools that could be planned count, so a tool
  with cap 0, value 0 or a price above the capacity never forces the inexact path.
* If the prices have ``d > 2`` decimals and ``10**d`` is no larger than the default scale
  below, ``lambda = 10**d``, and scaling is still exact.
* Otherwise, and always when ``precision`` is given, ``lambda = 10**precision``. As in the
  paper's Appendix A.1, every price is rounded **up**, ``c~_i = ceil(lambda c_i) / lambda``,
  and the capacity **down**, ``R~ = floor(lambda R) / lambda``. The plan is exact anyway when
  the prices have at most ``precision`` decimals.

The bound (Appendix A.1, Eqs. 8-15): let N be the largest number of calls a plan can make.
Here ``N = the sum of the caps of the tools that could be planned`` (price in (0, R],
value > 0). Set ``lambda = (N + 1) / eps``. Then ``R - R~ < eps / (N + 1)``
and ``0 <= c~_i - c_i < eps / (N + 1)``. So for every sequence of at most N calls
``a_1..a_N``::

    | (R~ - sum_j c~_{a_j}) - (R - sum_j c_{a_j}) | < eps        (paper, Eq. 15)

In fact ``0 <= (R - sum c) - (R~ - sum c~) < eps``. The rounded problem only ever *under*-states
what is left. Two consequences follow:

1. Every plan that is feasible after rounding is feasible for the real prices. The returned plan
   never exceeds R.
2. Every plan whose real cost is ``<= R - eps`` is feasible after rounding. So
   ``OPT(R - eps) <= total_value <= OPT(R)``. The plan is exact except that it may miss plans
   that use the last ``eps`` of the budget.

With ``lambda = 10**p`` the guarantee is ``eps = (N + 1) / 10**p``. This value is reported as
``QuotaPlan.epsilon``, and it is 0 when scaling is exact. When ``precision`` is None, the default
is the smallest ``p`` with ``eps <= DEFAULT_EPSILON`` (0.01, one cent, the resolution of the
two-decimal case). If that default would make the DP table larger than ``MAX_UNITS`` cost units,
``p`` is lowered until the table fits, and the larger ``eps`` is still reported exactly. An
explicit ``precision`` is used as given. ValueError is raised if the table then needs more than
``MAX_UNITS`` units. The table is never longer than the cost of every allowed call, so a huge
budget costs nothing.

Tie-breaking (deterministic)
----------------------------
Values are compared exactly after they are quantised to multiples of ``1e-11``
(``round(v * 10**11)``). So values with up to 11 decimals tie exactly as decimals, and
``0.1 + 0.2`` ties with ``0.3``. Among plans with the maximal quantised value, the plan returned:

1. has the **lowest total cost** in scaled units. As in BTP's code, the capacity used is the
   smallest ``j`` whose table entry reaches the optimum (the DP stores "best value with cost
   <= j").
2. then, among those, calls **later tools as little as possible**, in the order the prices
   mapping gives. The count of the last tool is minimised first, then the count of the one
   before it, and so on. So earlier tools are preferred, and the solution is the
   reverse-lexicographic minimum of the count vector. The DP only takes an item when it
   *strictly* improves the value, which is BTP's "ties keep the earlier choice" rule.

   Example: prices ``{a: 3, b: 2, c: 1}``, values ``{a: .3, b: .2, c: .1}``, caps 2 and
   capacity 4. The plans a+c, b+b and b+c+c all have value 0.4 and cost 4. The rule first
   minimises c, which leaves only b+b, so the answer is ``{a: 0, b: 2, c: 0}``. With the
   mapping ordered c, b, a it minimises a, then b, and the answer is ``{c: 2, b: 1, a: 0}``.

Special cases
-------------
* A price greater than the capacity gives quota 0.
* A capacity below every price gives all quotas 0. This is not an error.
* A tool with value 0, or cap 0, gets quota 0. It never strictly improves the value.
* A tool with **price 0 and value > 0 gets its full cap**, because it costs nothing. BTP's own
  code could never select it: its traceback tests "cost taken > 0". We deviate because a free
  useful call is part of every optimal plan. A price-0 tool with value 0 gets 0.

Implementation: binary splitting of each cap into chunks of size 1, 2, 4, ... and the rest.
This gives O(sum_i log F_i) 0/1 items. The ``capacity <= j`` DP is vectorised with numpy, and
all costs are divided by their gcd first. The traceback uses one bit-packed decision row per
item. The 20-tool, caps <= 5, B = 50, two-decimal case takes well under a millisecond. See
``python -m baselines.btp.bench_knapsack``.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping
from dataclasses import dataclass
from decimal import ROUND_CEILING, ROUND_FLOOR, Decimal

import numpy as np

from intent.errors import UsageError

__all__ = ["DEFAULT_EPSILON", "MAX_UNITS", "QuotaPlan", "plan_quotas", "plan_quotas_detailed"]

DEFAULT_EPSILON = 0.01
"""The target for the paper's error bound ``eps`` when ``precision`` is None and scaling is not exact."""

MAX_UNITS = 4_000_000
"""The largest DP table, in scaled cost units, before the gcd reduction."""

VALUE_SCALE = 10**11
"""Values are quantised to multiples of 1e-11 so that optimality and ties are exact integer comparisons."""

_MAX_PRECISION = 12


@dataclass(frozen=True)
class QuotaPlan:
    """The planner's answer.

    ``quotas`` has every priced tool, in the order of ``prices``. ``total_value`` is
    ``sum f * v`` and ``total_cost`` is ``sum f * price``, both in real units. ``scale`` is the
    ``lambda`` the prices were multiplied by. ``exact`` is True when scaling lost nothing.
    ``epsilon`` is the paper's bound for this plan: 0 when exact, else ``(N + 1) / scale``.
    """

    quotas: dict[str, int]
    total_value: float
    total_cost: float
    scale: int
    exact: bool = True
    epsilon: float = 0.0


def _dec(x: float) -> Decimal:
    """The decimal that ``repr`` shows for x (so ``0.1`` is exactly one tenth)."""
    if isinstance(x, numbers.Integral):
        return Decimal(int(x))
    return Decimal(repr(float(x)))


def _decimals(x: float) -> int:
    exp = _dec(x).normalize().as_tuple().exponent
    assert isinstance(exp, int)  # finite numbers only (checked before)
    return max(0, -exp)


def _is_real(x: object) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


def _validate(prices: Mapping[str, float], values: Mapping[str, float], caps: Mapping[str, int], capacity: float,
              precision: int | None) -> dict[str, int]:
    for name, arg in (("prices", prices), ("values", values), ("caps", caps)):
        if not isinstance(arg, Mapping):
            raise UsageError(f"{name} must be a mapping from tool name to number, got {type(arg).__name__}")
    for t, c in prices.items():
        if not _is_real(c) or not math.isfinite(c) or c < 0:
            raise UsageError(f"prices[{t!r}]={c!r} is invalid: a price must be a finite number >= 0 (the cost of "
                             "one call)")
    if not _is_real(capacity) or not math.isfinite(capacity) or capacity < 0:
        raise UsageError(f"capacity={capacity!r} is invalid: the capacity (R = B - c_s, the budget left to plan) "
                         "must be a finite number >= 0")
    for name, src in (("values", values), ("caps", caps)):
        for t in src:
            if t not in prices:
                raise UsageError(f"unknown tool {t!r} in {name}: it has no price; add it to prices or drop it "
                                 f"from {name}")
        for t in prices:
            if t not in src:
                hint = "a value in [0, 1] (0 never plans it)" if name == "values" else "a cap >= 0 (0 never plans it)"
                raise UsageError(f"tool {t!r} is missing from {name}: give every priced tool {hint}")
    for t, v in values.items():
        if not _is_real(v) or not 0.0 <= v <= 1.0:  # NaN fails the comparison too
            raise UsageError(f"values[{t!r}]={v!r} is outside [0, 1]; BTP values are expected success-weighted "
                             "usefulness in [0, 1]")
    int_caps: dict[str, int] = {}
    for t, f in caps.items():
        if isinstance(f, bool) or not isinstance(f, numbers.Integral):
            if _is_real(f) and math.isfinite(f) and float(f).is_integer():
                f = int(f)
            else:
                raise UsageError(f"caps[{t!r}]={f!r} is not an integer: caps are maximum call counts (integers >= 0)")
        if f < 0:
            raise UsageError(f"caps[{t!r}]={f!r} is negative: caps are maximum call counts (integers >= 0); use 0 to "
                             "forbid a tool")
        int_caps[t] = int(f)
    if precision is not None and (isinstance(precision, bool) or not isinstance(precision, numbers.Integral)
                                  or not 0 <= precision <= _MAX_PRECISION):
        raise UsageError(f"precision={precision!r} is invalid: give an integer number of decimals in "
                         f"[0, {_MAX_PRECISION}], or None for the default")
    return int_caps


def _choose_precision(prices: Mapping[str, float], capacity: float, n_calls: int, reach: float,
                      precision: int | None) -> tuple[int, bool]:
    """(p, exact): the scale is 10**p; exact when every number has at most p decimals.

    ``reach`` = min(capacity, the cost of every allowed call) sizes the DP table.
    """
    # Only the prices of tools that could be planned matter. The capacity's decimals never do:
    # with integer costs, sum w <= lambda R holds exactly when sum w <= floor(lambda R).
    decimals = max([0, *(_decimals(c) for c in prices.values())])
    if precision is not None:
        return int(precision), decimals <= precision
    if decimals <= 2:
        return 2, True
    p_bound = max(2, math.ceil(math.log10((n_calls + 1) / DEFAULT_EPSILON) - 1e-12))
    if decimals <= p_bound and reach * 10**decimals <= MAX_UNITS:
        return decimals, True
    p = p_bound
    while p > 0 and reach * 10**p > MAX_UNITS:
        p -= 1
    return p, False


def plan_quotas_detailed(prices: Mapping[str, float], values: Mapping[str, float], caps: Mapping[str, int],
                         capacity: float, *, precision: int | None = None) -> QuotaPlan:
    """Solve BTP's bounded knapsack. See the module docstring for scaling, the bound and tie-breaking.

    Raises ValueError, naming the field and the fix, for these inputs: a price or capacity that
    is negative, NaN or infinite; a value outside [0, 1]; a cap that is negative or not an
    integer; a tool in ``values`` or ``caps`` that has no price; a priced tool missing from
    ``values`` or ``caps``.
    """
    int_caps = _validate(prices, values, caps, capacity, precision)
    names = list(prices)
    quotas = {t: 0 for t in names}
    free = [t for t in names if prices[t] == 0 and values[t] > 0 and int_caps[t] > 0]
    for t in free:  # costs nothing and is worth something: take every allowed call
        quotas[t] = int_caps[t]
    candidates = [t for t in names if prices[t] > 0 and values[t] > 0 and int_caps[t] > 0 and prices[t] <= capacity]
    n_calls = sum(int_caps[t] for t in candidates)
    reach = min(float(capacity), sum(int_caps[t] * float(prices[t]) for t in candidates))
    p, exact = _choose_precision({t: prices[t] for t in candidates}, capacity, n_calls, reach, precision)
    scale = 10**p
    cap_units = int((_dec(capacity) * scale).to_integral_value(rounding=ROUND_FLOOR))
    rounding = ROUND_FLOOR if exact else ROUND_CEILING  # exact: the product is an integer already
    weights = {t: int((_dec(prices[t]) * scale).to_integral_value(rounding=rounding)) for t in candidates}
    candidates = [t for t in candidates if 0 < weights[t] <= cap_units]
    vq = {t: int(round(float(values[t]) * VALUE_SCALE)) for t in candidates}  # <= units * 1e11: no int64 overflow
    candidates = [t for t in candidates if vq[t] > 0]

    if candidates:
        g = 0
        for t in candidates:
            g = math.gcd(g, weights[t])
        # a capacity above the cost of every allowed call binds nothing: shrink the table to that cost
        units = min(cap_units // g, sum(int_caps[t] * (weights[t] // g) for t in candidates))
        if units > MAX_UNITS:
            raise UsageError(f"capacity={capacity} needs a DP table of {units} cost units at scale {scale} (more than "
                             f"MAX_UNITS={MAX_UNITS}); use coarser prices or a lower precision")
        # binary splitting: chunks 1, 2, 4, ..., rest cover every count 0..cap exactly once
        items: list[tuple[str, int, int]] = []  # (tool, weight of the chunk, calls in the chunk)
        for t in candidates:
            w = weights[t] // g
            left = min(int_caps[t], units // w)
            k = 1
            while left > 0:
                take = min(k, left)
                items.append((t, w * take, take))
                left -= take
                k *= 2
        best = np.zeros(units + 1, dtype=np.int64)
        rows: list[np.ndarray] = []
        for t, size, take in items:
            gain = vq[t] * take
            cand = best[: units + 1 - size] + gain
            better = cand > best[size:]  # strictly better only: a tie keeps the earlier choice
            rows.append(np.packbits(better))
            np.copyto(best[size:], cand, where=better)
        top = best[units]
        j = int(np.argmax(best == top))  # best is non-decreasing: the smallest capacity reaching the optimum
        for (t, size, take), row in zip(reversed(items), reversed(rows)):
            if j >= size:
                k = j - size
                if (row[k >> 3] >> (7 - (k & 7))) & 1:
                    quotas[t] += take
                    j -= size

    total_cost = float(sum((_dec(prices[t]) * quotas[t] for t in names), Decimal(0)))
    total_value = float(sum(quotas[t] * float(values[t]) for t in names))
    epsilon = 0.0 if exact else (n_calls + 1) / scale
    return QuotaPlan(quotas, total_value, total_cost, scale, exact, epsilon)


def plan_quotas(prices: Mapping[str, float], values: Mapping[str, float], caps: Mapping[str, int],
                capacity: float, *, precision: int | None = None) -> dict[str, int]:
    """Call quota per tool: the optimum of BTP's bounded knapsack, maximising ``sum f * v``.

    The constraints are ``sum f * price <= capacity`` and ``0 <= f <= cap``. Every tool in
    ``prices`` appears in the result, with 0 when it is not chosen. Ties go to the lower total
    cost, then to fewer calls of later tools. Two-decimal prices are exact; other real prices use
    the paper's conservative scaling, with error bound ``(N + 1) / 10**precision``. See the
    module docstring and :func:`plan_quotas_detailed`.
    """
    return plan_quotas_detailed(prices, values, caps, capacity, precision=precision).quotas
