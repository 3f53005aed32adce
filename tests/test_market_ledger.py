import json
import math
import threading

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from intent import BudgetExceededError, BudgetLedger, LedgerError, Market, MarketError, PricedTool
from intent.ledger import merge_ledger_states
from intent.market import InvalidPriceError, UnpricedToolError


# ------------------------------------------------------------------ market
@pytest.mark.parametrize("bad", [-1.0, math.nan, math.inf, -math.inf, "12", None, True])
def test_bad_prices_name_the_tool(bad):
    with pytest.raises(InvalidPriceError, match="price of tool 'x'"):
        PricedTool("x", bad)


def test_duplicate_tool_names_rejected():
    with pytest.raises(MarketError, match="duplicate tool name 'a'"):
        Market([PricedTool("a", 1), PricedTool("a", 2)])


def test_unpriced_tool_message_names_tool_and_fix():
    m = Market([PricedTool("a", 1)])
    with pytest.raises(UnpricedToolError, match="'b' has no price.*default_price"):
        m.price("b")
    assert Market([PricedTool("a", 1)], default_price=7).price("b") == 7


def test_updates_make_new_versions_and_leave_old_snapshot_alone():
    m0 = Market([PricedTool("a", 10), PricedTool("b", 5)])
    m1 = m0.with_price("a", 20)
    m2 = m1.ban("b")
    m3 = m2.without("a").with_tool(PricedTool("c", 1))
    assert (m0.version, m1.version, m2.version, m3.version) == (0, 1, 2, 4)
    assert m0.price("a") == 10 and m1.price("a") == 20
    assert not m2.is_available("b") and m1.is_available("b")
    assert m3.names == ("b", "c")
    assert Market.from_dict(json.loads(json.dumps(m2.to_dict()))) == m2
    with pytest.raises(MarketError, match="not on the market"):
        m0.with_price("zzz", 1)


def test_bad_budget_rejected():
    for bad in (-1, math.nan, math.inf):
        with pytest.raises(InvalidPriceError, match="budget"):
            BudgetLedger(bad)


# ------------------------------------------------------------------ ledger
def test_reserve_commit_release_are_idempotent():
    led = BudgetLedger(10)
    led.reserve("c1", "a", 6)
    led.reserve("c1", "a", 6)
    assert led.reserved == 6
    with pytest.raises(BudgetExceededError, match="only 4 of the budget 10"):
        led.reserve("c2", "a", 5)
    led.commit("c1")
    led.commit("c1")
    assert (led.spent, led.reserved, led.remaining) == (6, 0, 4)
    led.release("c1")  # a committed charge is never released
    assert led.spent == 6
    led.reserve("c3", "b", 4)
    led.release("c3")
    with pytest.raises(LedgerError, match="released"):
        led.commit("c3")
    with pytest.raises(LedgerError, match="never reserved"):
        led.commit("nope")


def test_allow_overspend_records_it():
    led = BudgetLedger(5, allow_overspend=True)
    led.reserve("c", "a", 8)
    led.commit("c")
    assert led.overspent == 3 and led.remaining == 0


def test_threads_never_overspend():
    led = BudgetLedger(100)
    def worker(k):
        for i in range(200):
            try:
                led.reserve(f"{k}-{i}", "t", 1.5)
                led.commit(f"{k}-{i}")
            except BudgetExceededError:
                pass
    ts = [threading.Thread(target=worker, args=(k,)) for k in range(8)]
    [t.start() for t in ts]
    [t.join() for t in ts]
    assert led.spent <= 100 and led.spent == 1.5 * len(led)


ops = st.lists(
    st.tuples(st.sampled_from(["reserve", "commit", "release"]), st.integers(0, 6), st.integers(0, 30)),
    max_size=40,
)


@settings(max_examples=150, deadline=None)
@given(budget=st.integers(0, 60), ops=ops)
def test_invariant_and_state_roundtrip(budget, ops):
    led = BudgetLedger(budget)
    for op, k, amount in ops:
        cid = f"c{k}"
        try:
            if op == "reserve":
                led.reserve(cid, "t", amount)
            elif op == "commit":
                led.commit(cid)
            else:
                led.release(cid)
        except LedgerError:
            pass
        assert led.spent + led.reserved <= budget + 1e-9
    again = BudgetLedger.from_state(json.loads(json.dumps(led.to_state())))
    assert again.snapshot() == led.snapshot()


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 5), st.sampled_from(["reserved", "released", "committed"])), max_size=20),
       st.randoms())
def test_reducer_is_order_independent_and_idempotent(updates, rnd):
    states = [
        {"budget": 10.0, "entries": {f"c{k}": {"call_id": f"c{k}", "tool": "t", "amount": 1.0, "status": s,
                                              "seq": k, "market_version": 0}}}
        for k, s in updates
    ]
    def fold(seq):
        acc = None
        for s in seq:
            acc = merge_ledger_states(acc, s)
        return acc
    a = fold(states)
    shuffled = list(states)
    rnd.shuffle(shuffled)
    b = fold(shuffled + states)  # replays change nothing
    assert (a or {}).get("entries") == (b or {}).get("entries")
