"""BTP's knapsack planner (baselines.btp.knapsack): brute-force optimality, tie-breaking, scaling, validation."""

from __future__ import annotations

import itertools
import math
from fractions import Fraction

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from baselines.btp.knapsack import QuotaPlan, plan_quotas, plan_quotas_detailed


def brute_force(prices, values, caps, capacity):
    """The unique plan under the documented rule, by enumeration in exact arithmetic.

    Rule: maximise the value, then minimise the cost, then minimise the count of the last tool, then of the one
    before it, and so on (the reverse-lexicographic minimum).
    """
    names = list(prices)
    p = {t: Fraction(str(prices[t])) for t in names}
    v = {t: Fraction(str(values[t])) for t in names}
    cap = Fraction(str(capacity))
    best_key, best = None, None
    for counts in itertools.product(*[range(caps[t] + 1) for t in names]):
        cost = sum((c * p[t] for c, t in zip(counts, names)), Fraction(0))
        if cost > cap:
            continue
        value = sum((c * v[t] for c, t in zip(counts, names)), Fraction(0))
        key = (-value, cost, tuple(reversed(counts)))
        if best_key is None or key < best_key:
            best_key, best = key, dict(zip(names, counts))
    return best, -best_key[0], best_key[1]


int_price = st.integers(0, 30)
cents_price = st.integers(0, 3000).map(lambda c: c / 100)
two_dp_value = st.integers(0, 100).map(lambda c: c / 100)


@settings(max_examples=300, deadline=None)
@given(data=st.data(), n=st.integers(1, 5), two_dp=st.booleans())
def test_matches_brute_force_including_the_tie_break(data, n, two_dp):
    names = [f"t{i}" for i in range(n)]
    price = cents_price if two_dp else int_price
    prices = {t: data.draw(price, label=f"price {t}") for t in names}
    values = {t: data.draw(st.one_of(st.sampled_from([0.0, 0.1, 0.2, 0.3, 0.5, 1.0]), two_dp_value)) for t in names}
    caps = {t: data.draw(st.integers(0, 3)) for t in names}  # includes zero caps
    capacity = data.draw(cents_price if two_dp else st.integers(0, 40), label="capacity")  # prices may exceed it

    plan = plan_quotas_detailed(prices, values, caps, capacity)
    expected, value, cost = brute_force(prices, values, caps, capacity)

    q = plan.quotas
    assert list(q) == names  # every tool, in the given order
    assert all(0 <= q[t] <= caps[t] for t in names)
    assert sum(q[t] * Fraction(str(prices[t])) for t in names) <= Fraction(str(capacity))  # feasible
    assert plan.exact and plan.scale == 100 and plan.epsilon == 0.0
    assert math.isclose(plan.total_value, float(value), abs_tol=1e-9)
    assert math.isclose(plan.total_cost, float(cost), abs_tol=1e-9)
    assert q == expected  # optimal, cheapest among optima, fewest calls of later tools
    assert all(q[t] == 0 for t in names if prices[t] > capacity)
    assert plan_quotas(prices, values, caps, capacity) == q  # deterministic
    assert plan_quotas(dict(prices), dict(values), dict(caps), capacity) == q


@settings(max_examples=150, deadline=None)
@given(data=st.data(), n=st.integers(1, 4))
def test_real_valued_prices_respect_the_paper_bound(data, n):
    names = [f"t{i}" for i in range(n)]
    prices = {t: data.draw(st.floats(0.01, 12.0, allow_nan=False)) for t in names}
    values = {t: data.draw(st.floats(0.0, 1.0, allow_nan=False)) for t in names}
    caps = {t: data.draw(st.integers(0, 3)) for t in names}
    capacity = data.draw(st.floats(0.0, 20.0, allow_nan=False))
    precision = data.draw(st.sampled_from([None, 1, 2, 3]))

    plan = plan_quotas_detailed(prices, values, caps, capacity, precision=precision)
    q = plan.quotas
    # feasible for the real prices, always (prices rounded up, capacity down)
    assert sum(q[t] * Fraction(str(prices[t])) for t in names) <= Fraction(str(capacity))
    assert all(0 <= q[t] <= caps[t] for t in names)
    opt = lambda r: float(brute_force(prices, values, caps, r)[1]) if r >= 0 else 0.0  # noqa: E731
    assert plan.total_value <= opt(capacity) + 1e-9
    if not plan.exact:
        n_calls = sum(caps[t] for t in names if values[t] > 0 and 0 < prices[t] <= capacity)
        assert plan.epsilon == pytest.approx((n_calls + 1) / plan.scale)
    # OPT(R - eps) <= value: every plan that leaves eps of the budget unused is reachable after rounding
    assert plan.total_value >= opt(capacity - plan.epsilon) - 1e-9


def test_tie_break_prefers_cheaper_then_fewer_calls_of_later_tools():
    assert plan_quotas({"a": 10, "b": 5}, {"a": 0.5, "b": 0.5}, {"a": 1, "b": 1}, 10) == {"a": 0, "b": 1}
    assert plan_quotas({"a": 5, "b": 5}, {"a": 0.5, "b": 0.5}, {"a": 1, "b": 1}, 5) == {"a": 1, "b": 0}
    assert plan_quotas({"b": 5, "a": 5}, {"a": 0.5, "b": 0.5}, {"a": 1, "b": 1}, 5) == {"b": 1, "a": 0}
    # a+c, b+b and b+c+c all give 0.4 at cost 4: minimise c first, then b -> b+b
    prices, values, caps = {"a": 3, "b": 2, "c": 1}, {"a": 0.3, "b": 0.2, "c": 0.1}, {"a": 2, "b": 2, "c": 2}
    assert plan_quotas(prices, values, caps, 4) == {"a": 0, "b": 2, "c": 0}
    reordered = {"c": 1, "b": 2, "a": 3}  # now a is the last tool: a = 0, then b as small as possible
    assert plan_quotas(reordered, values, caps, 4) == {"c": 2, "b": 1, "a": 0}
    # decimal ties are exact: 0.1 + 0.2 ties with 0.3, and the cheaper plan wins
    assert plan_quotas({"x": 2, "y": 2, "z": 3}, {"x": 0.1, "y": 0.2, "z": 0.3}, {"x": 1, "y": 1, "z": 1}, 4) == \
        {"x": 0, "y": 0, "z": 1}


def test_zero_price_takes_full_cap_when_useful():
    q = plan_quotas({"free": 0, "paid": 5, "free_useless": 0.0}, {"free": 0.2, "paid": 0.5, "free_useless": 0.0},
                    {"free": 3, "paid": 1, "free_useless": 4}, 4)
    assert q == {"free": 3, "paid": 0, "free_useless": 0}


def test_capacity_below_every_price_and_zero_capacity_plan_nothing():
    assert plan_quotas({"a": 10, "b": 20}, {"a": 1, "b": 1}, {"a": 2, "b": 2}, 5) == {"a": 0, "b": 0}
    plan = plan_quotas_detailed({"a": 1.5}, {"a": 1.0}, {"a": 2}, 0)
    assert plan == QuotaPlan({"a": 0}, 0.0, 0.0, 100, True, 0.0)
    assert plan_quotas({}, {}, {}, 10) == {}


def test_large_budget_takes_everything_useful():
    q = plan_quotas({"a": 3.25, "b": 7, "c": 1}, {"a": 0.4, "b": 0.9, "c": 0.0}, {"a": 5, "b": 2, "c": 3}, 1e9)
    assert q == {"a": 5, "b": 2, "c": 0}


def test_typical_bench_instance():
    rng = np.random.default_rng(0)
    names = [f"tool_{i}" for i in range(20)]
    prices = {t: int(rng.integers(100, 5001)) / 100 for t in names}
    values = {t: float(rng.random()) for t in names}
    caps = {t: int(rng.integers(0, 6)) for t in names}
    plan = plan_quotas_detailed(prices, values, caps, 50)
    assert plan.exact and plan.scale == 100 and plan.total_cost <= 50
    assert plan.total_value > 0


def test_scaling_choice_and_reported_bound():
    three = plan_quotas_detailed({"a": 0.125, "b": 0.3}, {"a": 0.5, "b": 0.9}, {"a": 3, "b": 2}, 1)
    assert three.exact and three.scale == 1000  # three decimals: still exact at 10**3
    third = plan_quotas_detailed({"a": 1 / 3, "b": 0.7071}, {"a": 0.5, "b": 0.9}, {"a": 3, "b": 2}, 1.5)
    # N = 5 calls, default eps <= 0.01 -> smallest p with 6 / 10**p <= 0.01 is p = 3
    assert not third.exact and third.scale == 1000 and third.epsilon == pytest.approx(6 / 1000)
    assert third.quotas == {"a": 2, "b": 1} and third.total_cost <= 1.5
    coarse = plan_quotas_detailed({"a": 1 / 3}, {"a": 0.5}, {"a": 3}, 1.0, precision=1)
    # ceil(3.33..) = 4 tenths per call, floor(10) tenths of capacity: only 2 calls fit although 3 * (1/3) = 1
    assert coarse.quotas == {"a": 2} and coarse.epsilon == pytest.approx(0.4)
    # the capacity's decimals and unplannable tools never force the inexact path
    odd = plan_quotas_detailed({"a": 2.5, "b": 1 / 3}, {"a": 0.5, "b": 0.5}, {"a": 2, "b": 0}, 5.123456)
    assert odd.exact and odd.scale == 100 and odd.quotas == {"a": 2, "b": 0}
    fine = plan_quotas_detailed({"a": 0.5, "b": 0.25}, {"a": 0.5, "b": 0.1}, {"a": 2, "b": 1}, 1.25, precision=4)
    assert fine.exact and fine.scale == 10_000 and fine.quotas == {"a": 2, "b": 1}


def test_numpy_scalars_and_integral_float_caps_are_accepted():
    q = plan_quotas({"a": np.float64(2.5), "b": np.int64(3)}, {"a": np.float32(0.5), "b": 0.25},
                    {"a": np.int64(2), "b": 1.0}, np.float64(5.5))
    assert q == {"a": 2, "b": 0}  # a+a: value 1.0 at cost 5.0 beats a+b: 0.75 at 5.5


BASE = dict(prices={"a": 1.0, "b": 2.0}, values={"a": 0.5, "b": 0.5}, caps={"a": 1, "b": 1}, capacity=5.0)


@pytest.mark.parametrize("change,match", [
    (dict(values={"a": 1.3, "b": 0.5}),
     r"values\['a'\]=1.3 is outside \[0, 1\]; BTP values are expected success-weighted usefulness in \[0, 1\]"),
    (dict(values={"a": -0.1, "b": 0.5}), r"values\['a'\]=-0.1 is outside \[0, 1\]"),
    (dict(values={"a": float("nan"), "b": 0.5}), r"values\['a'\]=nan is outside"),
    (dict(prices={"a": -1.0, "b": 2.0}), r"prices\['a'\]=-1.0 is invalid: a price must be a finite number >= 0"),
    (dict(prices={"a": float("nan"), "b": 2.0}), r"prices\['a'\]=nan is invalid"),
    (dict(prices={"a": float("inf"), "b": 2.0}), r"prices\['a'\]=inf is invalid"),
    (dict(capacity=float("nan")), r"capacity=nan is invalid"),
    (dict(capacity=float("inf")), r"capacity=inf is invalid"),
    (dict(capacity=-1), r"capacity=-1 is invalid"),
    (dict(caps={"a": -1, "b": 1}), r"caps\['a'\]=-1 is negative"),
    (dict(caps={"a": 1.5, "b": 1}), r"caps\['a'\]=1.5 is not an integer"),
    (dict(caps={"a": 1, "b": 1, "zz": 1}), r"unknown tool 'zz' in caps: it has no price"),
    (dict(values={"a": 0.5, "b": 0.5, "zz": 0.1}), r"unknown tool 'zz' in values: it has no price"),
    (dict(caps={"a": 1}), r"tool 'b' is missing from caps"),
    (dict(values={"b": 0.5}), r"tool 'a' is missing from values"),
])
def test_validation_errors_name_the_field_and_the_fix(change, match):
    args = {**BASE, **change}
    with pytest.raises(ValueError, match=match):
        plan_quotas(**args)


def test_bad_precision():
    with pytest.raises(ValueError, match=r"precision=-1 is invalid"):
        plan_quotas(**BASE, precision=-1)
    with pytest.raises(ValueError, match=r"MAX_UNITS"):
        plan_quotas({"a": 1 / 3, "b": 1 / 7}, {"a": 1.0, "b": 1.0}, {"a": 10**6, "b": 10**6}, 1000.0, precision=7)


def test_bench_module_runs(capsys):
    from baselines.btp.bench_knapsack import bench

    out = bench(5, 1)
    assert out["instances"] == 5 and out["exact"] and out["scale"] == 100
