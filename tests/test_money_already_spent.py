"""Money already spent (a model answer nobody metered, an oracle's decision, a late bill) is recorded,
whatever the budget has left: refusing to record it would crash the run and forget the charge.

Found by charging the oracle's tokens without a per-decision bound (``intent bench --charge-oracle``
without ``--oracle-max-tokens``): once one decision overran the budget, the next one's charge raised
``BudgetExceededError ... costs 0 but only 0 ... left`` and the episode crashed.
"""

from __future__ import annotations

import pytest
from fakes import priced_tools
from langchain.agents import create_agent
from langchain_core.messages import HumanMessage

from intent import BudgetGuard, Decision, Market, MemoryLogSink, ModelPrice, Oracle, PricedTool
from intent.ledger import BudgetLedger
from intent.stores import open_store
from intent.testing import RunCounter, ai, assert_each_call_answered_once, call, scripted


def test_a_charge_already_spent_is_recorded_after_an_overrun_took_the_budget():
    ledger = BudgetLedger(10.0)
    ledger.charge_now("oracle-1", "judge", 12.0, kind="oracle")  # 10 fitted, 2 over
    ledger.charge_now("oracle-2", "judge", 1.0, kind="oracle")  # nothing left: all of it over
    ledger.charge_now("model-1", "gpt", 0.5, kind="model")
    assert ledger.spent == pytest.approx(13.5) and ledger.reserved == 0
    assert ledger.overrun == pytest.approx(3.5)
    # idempotent by id, as reserve + commit are
    assert ledger.charge_now("oracle-2", "judge", 1.0, kind="oracle").amount == 1.0
    assert ledger.spent == pytest.approx(13.5)


def test_a_model_answer_is_charged_on_a_ledger_a_tools_overrun_halted():
    ledger = BudgetLedger(10.0)
    ledger.reserve("t1", "tool", 1.0)
    ledger.commit("t1", 3.0)  # the provider billed above its quote: no further spending
    assert ledger.halted and ledger.remaining == pytest.approx(7.0)
    entry = ledger.charge_now("model-1", "gpt", 0.25, kind="model")  # but this money is spent already
    assert entry.status == "committed" and ledger.spent == pytest.approx(3.25)
    assert not ledger.fits(0.1)  # still halted for new spending


def test_money_already_spent_reaches_the_shared_store_after_an_overrun(store_url, budget_key):
    store = open_store(store_url)
    store.create_budget(budget_key, 1.0)
    ledger = BudgetLedger(5.0)
    ledger.share(store, budget_key, "run-a")
    ledger.charge_now("oracle-1", "judge", 1.5, kind="oracle")  # the team's 1.0 and 0.5 more
    ledger.charge_now("model-1", "gpt", 0.25, kind="model")  # the store has nothing left
    assert store.spent(budget_key) == pytest.approx(1.75) == pytest.approx(ledger.spent)
    assert store.reserved(budget_key) == 0 and ledger.reserved == 0
    # A hold of money not yet spent is still refused there.
    from intent.ledger import BudgetExceededError
    with pytest.raises(BudgetExceededError):
        store.reserve(budget_key, "run-b/t", 0.1, run_id="run-b")


class _DearThinking(Oracle):
    """Accepts every call, having spent 100,000 input tokens (0.1 at 1 per million) deciding."""

    def __init__(self) -> None:
        self.asked: list[str] = []

    def decide(self, ctx):
        self.asked.append(ctx.proposal.tool)
        return Decision.accepted(input_tokens=100_000, output_tokens=0)


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_an_unbounded_paid_oracle_overruns_by_one_decision_at_most(mode):
    """``charge_oracle`` without ``oracle_max_tokens``: the oracle is charged after it decides. It is not
    asked about a call the budget cannot pay (the guard refuses it whatever the oracle says), so after the
    one decision that overran, no decision is bought and the run ends normally."""
    import asyncio

    oracle, runs, sink = _DearThinking(), RunCounter(), MemoryLogSink()
    guard = BudgetGuard(oracle, Market([PricedTool("search", 0.02), PricedTool("fetch", 0.05)]), 0.15,
                        model_prices={"judge": ModelPrice(1.0, 2.0)}, charge_oracle=True, oracle_model="judge",
                        charge_models=False, log_sink=sink)
    msgs = [ai(call("fetch", q="1")), ai(call("search", q="2")), ai(call("fetch", q="3")),
            ai(call("search", q="4")), ai(text="done")]
    agent = create_agent(scripted(msgs), priced_tools(runs), middleware=[guard.middleware()])
    inp = {"messages": [HumanMessage("go")]}
    out = agent.invoke(inp) if mode == "sync" else asyncio.run(agent.ainvoke(inp))
    ledger = guard.ledger(out)
    # fetch: oracle 0.1, fetch 0.05 -> 0.15 spent; search: 0.02 does not fit the 0 left -> not asked.
    assert oracle.asked == ["fetch"]
    assert dict(runs.items()) == {"fetch": 1}
    assert ledger.spent == pytest.approx(0.15) and ledger.reserved == 0 and ledger.overrun == 0
    assert [r.reason for r in sink.records if r.kind == "tool" and r.decision == "reject"] == ["over_budget"] * 3
    assert_each_call_answered_once(out["messages"])

    # A dearer oracle overruns by its one decision, and only that one.
    oracle2, runs2 = _DearThinking(), RunCounter()
    guard2 = BudgetGuard(oracle2, Market([PricedTool("search", 0.02), PricedTool("fetch", 0.05)]), 0.12,
                         model_prices={"judge": ModelPrice(1.0, 2.0)}, charge_oracle=True, oracle_model="judge",
                         charge_models=False)
    agent2 = create_agent(scripted(msgs), priced_tools(runs2), middleware=[guard2.middleware()])
    out2 = agent2.invoke(inp) if mode == "sync" else asyncio.run(agent2.ainvoke(inp))
    ledger2 = guard2.ledger(out2)
    # fetch fits the 0.12 when asked; the oracle's 0.1 leaves 0.02 < 0.05: fetch refused. search (0.02)
    # fits the 0.02 left: asked, the oracle's 0.1 overruns by 0.08; every later call is refused unasked.
    assert oracle2.asked == ["fetch", "search"] and dict(runs2.items()) == {}
    assert ledger2.spent == pytest.approx(0.2) and ledger2.overrun == pytest.approx(0.2 - 0.12)
    assert_each_call_answered_once(out2["messages"])
