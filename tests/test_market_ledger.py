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


def test_an_entry_changed_by_the_ledger_keeps_every_other_field():
    # The ledger copies entries with its own fast replace; a field added to LedgerEntry and
    # forgotten there would be silently reset on the next commit.
    import dataclasses

    from intent.ledger import LedgerEntry, _evolve

    values = {"call_id": "m:c1", "tool": "t", "amount": 2.0, "status": "reserved", "seq": 3, "market_version": 4,
              "tool_call_id": "c1", "execution": 1, "overrun": 0.5, "kind": "model", "store_id": "s"}
    assert set(values) == {f.name for f in dataclasses.fields(LedgerEntry)}, "a new LedgerEntry field: add it here and to _evolve"
    entry = LedgerEntry(**values)
    assert _evolve(entry) == entry
    new_values = {"call_id": "m:c2", "tool": "u", "amount": 3.0, "status": "committed", "market_version": 5,
                  "execution": 2, "overrun": 1.5, "store_id": "s2"}
    for name, value in new_values.items():
        assert dataclasses.asdict(_evolve(entry, **{name: value})) == {**values, name: value}, name
    with pytest.raises(TypeError, match="seq"):
        _evolve(entry, seq=9)


def test_ledger_state_merge_keeps_first_budget_unions_ids_and_takes_the_latest_market():
    left = {"episode_id": "e", "budget": 10.0, "entries": {"a": {"status": "reserved"}},
            "decisions": {"a": {"accept": True}}, "top_ups": {"t1": 1.0}, "market_version": 1, "market": {"v": 1}}
    right = {"episode_id": "other", "budget": 99.0, "entries": {"a": {"status": "committed"}, "b": {"status": "reserved"}},
             "decisions": {"b": {"accept": False}}, "top_ups": None, "market_version": 2, "market": {"v": 2},
             "caps": {"tools": 5.0}}
    merged = merge_ledger_states(left, right)
    assert merged["episode_id"] == "e" and merged["budget"] == 10.0
    assert merged["entries"] == {"a": {"status": "committed"}, "b": {"status": "reserved"}}
    assert merged["decisions"] == {"a": {"accept": True}, "b": {"accept": False}}
    assert merged["top_ups"] == {"t1": 1.0} and merged["caps"] == {"tools": 5.0}
    assert merged["market_version"] == 2 and merged["market"] == {"v": 2}
    # The inputs are checkpointed values: never changed in place.
    assert left["entries"] == {"a": {"status": "reserved"}} and left["decisions"] == {"a": {"accept": True}}
    # A status never moves back, and an update with no entries keeps them all.
    assert merge_ledger_states(merged, {"entries": {"a": {"status": "reserved"}}})["entries"]["a"]["status"] == "committed"
    assert merge_ledger_states(merged, {"entries": None})["entries"] == merged["entries"]
