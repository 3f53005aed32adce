"""Rollouts price a turn's identical calls once, as the guard charges them once.

bench-llm with a 0.5B model: the agent repeats a call up to 16 times in one reply. The guard
merges those copies (``merge_identical_calls``, default on), but INTENT's rollouts priced each
copy: a first-turn rollout of 8 turns had 132 steps and a risk-adjusted cost of 5,964 against a
budget of 33, so nearly every call was refused.
"""

from __future__ import annotations

from langchain_core.messages import AIMessage, HumanMessage

from intent import DecisionContext, Market, PricedTool, Proposal
from intent.oracles import IntentOracle, MCOOracle
from intent.policy import AgentPolicy
from intent.rollout import simulate_rollout
from intent.testing import ai, call, scripted

MARKET = Market([PricedTool("a", 10.0), PricedTool("b", 7.0)])


class CountingWM:
    def __init__(self) -> None:
        self.calls: list[str] = []

    def simulate(self, tool, args, *, satisfied=None):
        self.calls.append(tool)
        return '{"ok": true}'


class OnePredictor:
    def predict(self, reasoning, tool, args):
        return 1.0


def _ctx(remaining: float) -> DecisionContext:
    prop = Proposal("p-a", "a", {"x": 1}, "I need a")
    return DecisionContext("e1", "q", prop, 10.0, 50.0, 50.0 - remaining, remaining, MARKET, step=0,
                           history=[HumanMessage("q"), AIMessage("I need a", tool_calls=[
                               {"name": "a", "args": {"x": 1}, "id": "p-a", "type": "tool_call"}])],
                           batch=(prop,))


def _repeating_policy() -> AgentPolicy:
    # One reply with b(y=2) five times (keys in another order once) and b(y=3) once, then an answer.
    copies = [call("b", y=2, z=0) for _ in range(4)] + [{**call("b", z=0, y=2)}, call("b", y=3, z=0)]
    return AgentPolicy(scripted([ai(*copies), AIMessage("done")]))


def test_identical_calls_of_a_simulated_turn_are_simulated_and_priced_once():
    wm = CountingWM()
    out = simulate_rollout(_ctx(50.0), _repeating_policy(), wm, satisfied=True, max_depth=4)
    assert [(s.tool, s.args) for s in out.steps] == [("a", {"x": 1}), ("b", {"y": 2, "z": 0}), ("b", {"y": 3, "z": 0})]
    assert out.total_price == 24.0 and wm.calls == ["a", "b", "b"] and out.answered


def test_without_merging_every_copy_is_priced():
    out = simulate_rollout(_ctx(50.0), _repeating_policy(), CountingWM(), satisfied=True, max_depth=4,
                           merge_identical_calls=False)
    assert out.total_price == 10.0 + 6 * 7.0


def test_the_planning_oracles_accept_a_plan_whose_copies_alone_would_not_fit():
    # a + b(2) + b(3) = 24 fits 30; priced per copy (a + 6 b = 52) it would not.
    for build in (lambda p, merge: MCOOracle(p, CountingWM(), max_depth=4, merge_identical_calls=merge),
                  lambda p, merge: IntentOracle(p, CountingWM(), OnePredictor(), max_depth=4, gamma=1.0,
                                                merge_identical_calls=merge)):
        merged = build(_repeating_policy(), True).decide(_ctx(30.0))
        copies = build(_repeating_policy(), False).decide(_ctx(30.0))
        assert merged.accept and len(merged.trace) == 3, merged
        assert not copies.accept and len(copies.trace) == 7, copies


def test_a_rollout_reply_cut_by_its_cap_before_any_call_is_not_an_answer():
    # --rollout-max-tokens: a reply that stops on its length with no whole call says nothing about
    # what the agent does next; the rollout is truncated there, and the oracles count it.
    cut = AIMessage('{"name": "b", "argu', response_metadata={"finish_reason": "length"})
    capped = AgentPolicy(scripted([cut]), replies_capped=True)
    out = simulate_rollout(_ctx(50.0), capped, CountingWM(), satisfied=True, max_depth=4)
    assert out.capped and out.truncated and not out.answered
    done = simulate_rollout(_ctx(50.0), AgentPolicy(scripted([AIMessage("done")]), replies_capped=True), CountingWM(),
                            satisfied=True, max_depth=4)
    assert done.answered and not done.capped
    d = MCOOracle(AgentPolicy(scripted([cut]), replies_capped=True), CountingWM(), max_depth=4).decide(_ctx(50.0))
    assert d.usage["rollout_capped"] == 1.0
    # Cut at the agent's own limit (no shorter rollout cap), the reply is what the agent answers.
    own = simulate_rollout(_ctx(50.0), AgentPolicy(scripted([cut])), CountingWM(), satisfied=True, max_depth=4)
    assert own.answered and not own.capped and not own.truncated


def test_a_guard_and_its_oracle_must_merge_identical_calls_alike():
    import pytest

    from intent import BudgetGuard
    from intent.errors import GuardConfigError

    oracle = MCOOracle(_repeating_policy(), CountingWM(), merge_identical_calls=True)
    with pytest.raises(GuardConfigError, match="merge_identical_calls=False but the oracle MCOOracle"):
        BudgetGuard(oracle, MARKET, 50.0, merge_identical_calls=False)
    BudgetGuard(MCOOracle(_repeating_policy(), CountingWM(), merge_identical_calls=False), MARKET, 50.0,
                merge_identical_calls=False)
