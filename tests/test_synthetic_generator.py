"""Synthetic market: generator determinism, structure invariants, input validation, events."""

from __future__ import annotations

import pytest

from eval.synthetic import (
    DOMAIN_NAMES,
    SIMULATED_LABEL,
    MarketEvent,
    apply_event,
    generate_tasks,
)
from intent.market import Market, MarketError


@pytest.fixture(scope="module")
def tasks():
    return generate_tasks(200, 0, event_rate=0.3)


def test_label():
    assert "simulated" in SIMULATED_LABEL


def test_same_seed_same_tasks():
    assert generate_tasks(25, 7, event_rate=0.5) == generate_tasks(25, 7, event_rate=0.5)


def test_different_seed_different_tasks():
    a, b = generate_tasks(25, 7), generate_tasks(25, 8)
    assert a != b
    assert sum(x == y for x, y in zip(a, b)) == 0
    assert [t.query for t in a] != [t.query for t in b]


def test_prefix_stable():
    assert generate_tasks(5, 3) == generate_tasks(12, 3)[:5]


def test_fixed_budget_and_scale():
    assert {t.budget for t in generate_tasks(20, 1, budget=50)} == {50}
    base = generate_tasks(30, 1)
    tight = generate_tasks(30, 1, budget_scale=0.5)
    assert sum(t.budget for t in tight) < sum(t.budget for t in base)
    assert [t.query for t in tight] == [t.query for t in base]  # same tasks, other budgets


def test_structure_invariants(tasks):
    n_needs = set()
    for t in tasks:
        assert 1 <= len(t.needs) <= 4
        n_needs.add(len(t.needs))
        assert len({n.domain for n in t.needs}) == len(t.needs)
        assert isinstance(t.budget, int) and t.budget >= 1
        for need in t.needs:
            tiers = {p.tier for p in t.providers(need.id) if len(p.covers) == 1}
            assert {"cheap", "mid", "premium"} <= tiers, (t.task_id, need.id)
            # canonical values appear verbatim in the query
            for value in t.canonical_args[need.id].values():
                assert value in t.query
            assert set(t.canonical_args[need.id]) == set(need.arg_keys)
        for tool in t.tools:
            assert isinstance(tool.price, int) and tool.price >= 1
            assert 0.0 <= tool.base_success <= 1.0
            if tool.tier == "cheap":
                assert 5 <= tool.price <= 12 and 0.25 <= tool.base_success <= 0.5
            elif tool.tier == "mid":
                assert 12 <= tool.price <= 25 and 0.6 <= tool.base_success <= 0.8
            elif tool.tier == "premium":
                assert 25 <= tool.price <= 45 and 0.9 <= tool.base_success <= 0.98
            elif tool.tier == "composite":
                assert len(tool.covers) >= 2
                mids = sum(min(p.price for p in t.providers(n) if p.tier == "mid") for n in tool.covers)
                assert tool.price < mids
            else:
                assert tool.tier == "distractor" and not tool.covers
        assert any(tool.tier == "distractor" for tool in t.tools)
        m = t.market()
        assert isinstance(m, Market) and m.version == 0
        assert len(set(m.names)) == len(m.names) == len(t.tools)
        assert all(float(m.price(x.name)) == x.price and m.get(x.name).description for x in t.tools)
    assert n_needs == {1, 2, 3, 4}
    assert len({t.query for t in tasks}) > 150
    assert any(len(t.needs) >= 2 and any(x.tier == "composite" for x in t.tools) for t in tasks)


def test_query_reads_naturally(tasks):
    t = next(t for t in tasks if len(t.needs) == 2)
    assert " and " in t.query and t.query[-1] in "?."


def test_event_rate(tasks):
    assert all(not t.events for t in generate_tasks(50, 2))
    assert all(t.events for t in generate_tasks(30, 2, event_rate=1.0))
    with_events = [t for t in tasks if t.events]
    assert 0.15 < len(with_events) / len(tasks) < 0.45
    kinds = {e.kind for t in with_events for e in t.events}
    assert kinds == {"price_change", "remove", "ban"}
    for t in with_events:
        assert 1 <= len(t.events) <= 2
        assert len({e.tool for e in t.events}) == len(t.events)
        final = t.market_at(10**6)
        for need in t.needs:  # every need keeps an available provider
            assert any(final.is_available(p.name) and p.name in final for p in t.providers(need.id))


def test_events_apply():
    t = generate_tasks(1, 0)[0]
    m0 = t.market()
    tool = t.tools[0]
    m1 = apply_event(m0, MarketEvent(2, "price_change", tool.name, tool.price + 7))
    assert m1.version == m0.version + 1 and m1.price(tool.name) == tool.price + 7
    assert m0.price(tool.name) == tool.price  # snapshots are immutable
    m2 = apply_event(m1, MarketEvent(3, "ban", tool.name))
    assert not m2.is_available(tool.name) and tool.name in m2 and m2.version == 2
    m3 = apply_event(m0, MarketEvent(1, "remove", tool.name))
    assert tool.name not in m3 and not m3.is_available(tool.name)
    with pytest.raises(MarketError):
        apply_event(m3, MarketEvent(4, "ban", tool.name))


def test_market_at_steps():
    t = next(t for t in generate_tasks(40, 5, event_rate=1.0) if t.events)
    e = t.events[0]
    assert e.tool in t.market_at(e.at_step - 1) and t.market_at(e.at_step - 1).is_available(e.tool)
    after = t.market_at(e.at_step)
    if e.kind == "price_change":
        assert after.price(e.tool) == e.new_price
    else:
        assert not after.is_available(e.tool)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"n": 0, "seed": 0}, "n"),
        ({"n": 2.5, "seed": 0}, "n"),
        ({"n": 3, "seed": "0"}, "seed"),
        ({"n": 3, "seed": 1.0}, "seed"),
        ({"n": 3, "seed": True}, "seed"),
        ({"n": 3, "seed": 0, "event_rate": 1.5}, "event_rate"),
        ({"n": 3, "seed": 0, "event_rate": -0.1}, "event_rate"),
        ({"n": 3, "seed": 0, "budget": 0}, "budget"),
        ({"n": 3, "seed": 0, "domains": ["weather", "astrology"]}, "domains"),
        ({"n": 3, "seed": 0, "domains": []}, "domains"),
        ({"n": 3, "seed": 0, "max_needs": 5}, "max_needs"),
        ({"n": 3, "seed": 0, "budget_scale": 0}, "budget_scale"),
    ],
)
def test_bad_input(kwargs, field):
    with pytest.raises(ValueError, match=field):
        generate_tasks(**kwargs)


def test_bad_event():
    with pytest.raises(ValueError, match="new_price"):
        MarketEvent(1, "price_change", "x")
    with pytest.raises(ValueError, match="kind"):
        MarketEvent(1, "explode", "x")  # type: ignore[arg-type]


def test_domain_restriction():
    ts = generate_tasks(30, 4, domains=("weather", "finance"))
    assert all({n.domain for n in t.needs} <= {"weather", "finance"} for t in ts)
    assert max(len(t.needs) for t in ts) <= 2
    assert set(DOMAIN_NAMES) >= {"weather", "finance", "news", "geo", "sports", "travel"}
