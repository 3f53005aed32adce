"""MCO and INTENT: decision arithmetic, caches, blacklist, feedback, failures, concurrency."""

from __future__ import annotations

import threading
from typing import Any

import pytest
from fakes import ScriptedToolModel
from hypothesis import given, settings
from hypothesis import strategies as st
from langchain_core.messages import AIMessage, HumanMessage

from intent import AcceptAll, Decision, DecisionContext, Market, PricedTool, Proposal
from intent.conformance import check_oracle
from intent.oracles import IntentOracle, MCOOracle, args_match
from intent.policy import AgentPolicy
from worldmodel.protocols import ModelError

MARKET = Market([PricedTool("a", 10), PricedTool("b", 20), PricedTool("c", 5)])


class RecordingWM:
    def __init__(self, fail: bool = False):
        self.calls, self.fail = [], fail

    def simulate(self, tool, args, *, satisfied=None):
        self.calls.append((tool, satisfied))
        if self.fail:
            raise ModelError("world model down")
        return '{"ok": true}'


class TablePredictor:
    def __init__(self, table, default=1.0):
        self.table, self.default, self.batches = table, default, 0

    def predict(self, reasoning, tool, args):
        return self.table.get(tool, self.default)

    def predict_batch(self, items):
        self.batches += 1
        return [self.table.get(t, self.default) for _, t, _ in items]


class NoPolicy(ScriptedToolModel):
    def invoke(self, *a, **k):
        raise AssertionError("the policy must not be called here")


def policy(*replies):
    return AgentPolicy(ScriptedToolModel(messages=iter(list(replies)), bound=[]))


def tc(name, cid="x", **args):
    return {"name": name, "args": args, "id": cid, "type": "tool_call"}


def ctx(tool="a", remaining=50.0, episode="e1", args=None, price=None, step=0):
    args = args or {"q": 1}
    prop = Proposal(f"{episode}-{tool}", tool, args, f"I need {tool}")
    return DecisionContext(episode, "q", prop, MARKET.price(tool) if price is None else price, 50.0, 50 - remaining,
                           remaining, MARKET, step=step,
                           history=[HumanMessage("q"), AIMessage(f"I need {tool}", tool_calls=[tc(tool, prop.call_id, **args)])],
                           batch=(prop,))


def test_intent_decision_arithmetic_and_trace_feedback():
    pred = TablePredictor({"a": 0.5, "b": 0.8})
    wm = RecordingWM()
    accept = IntentOracle(policy(AIMessage("then b", tool_calls=[tc("b", q=2)]), AIMessage("done")), wm, pred, gamma=0.5)
    d = accept.decide(ctx())
    assert d.accept and [s.expected_cost for s in d.trace] == [20.0, 25.0]
    assert d.usage["risk_cost"] == pytest.approx(22.5) and pred.batches == 2  # one batched call per simulated turn
    assert all(z is True for _, z in wm.calls)  # the ideal trajectory: conditional generator, z = 1
    reject = IntentOracle(policy(AIMessage("then b", tool_calls=[tc("b", q=2)]), AIMessage("done")),
                          RecordingWM(), pred, gamma=1.2)
    d = reject.decide(ctx())
    assert not d.accept and d.reason == "plan_over_budget"
    assert "1 | a | 10 | 0.50 | 20" in d.feedback and "2 | b | 20 | 0.80 | 25" in d.feedback
    assert "q" not in d.feedback.split("Predicted tool trace:")[1].replace("p_success", "")  # no arguments
    assert '"ok"' not in d.feedback  # no simulated contents


def test_the_immediate_price_must_fit():
    oracle = IntentOracle(policy(AIMessage("done")), RecordingWM(), TablePredictor({}), gamma=0.1)
    assert not oracle.decide(ctx("b", remaining=15)).accept


def test_rollout_cache_hit_pop_and_miss_clear():
    oracle = IntentOracle(policy(AIMessage("", tool_calls=[tc("b", q=2)]), AIMessage("", tool_calls=[tc("c", q=3)]),
                                 AIMessage("done")), RecordingWM(), TablePredictor({}))
    assert oracle.decide(ctx("a")).accept
    assert [s.tool for s in oracle.memory.rollout("e1")] == ["b", "c"]
    oracle._policy = AgentPolicy(NoPolicy(messages=iter([]), bound=[]))
    hit = oracle.decide(ctx("b", remaining=40, args={"q": 2}))
    assert hit.accept and hit.reason == "cache_hit" and [s.tool for s in oracle.memory.rollout("e1")] == ["c"]
    # A miss clears the cache and simulates again: the policy is called, and its AssertionError
    # is a bug, not an unavailable model, so it leaves decide() instead of becoming a fallback.
    with pytest.raises(AssertionError, match="must not be called"):
        oracle.decide(ctx("a", remaining=20))
    assert oracle.memory.rollout("e1") == []


@pytest.mark.parametrize("kind", ["intent", "mco"])
def test_a_cached_plan_whose_next_call_no_longer_fits_is_dropped_not_followed(kind):
    # The plan a -> b -> c is cached when a is accepted. When b (30) no longer fits, that is a miss: the whole
    # plan goes. Only its head was popped, so the rest (c) stayed cached, and a later c was accepted from it
    # unchecked, though c simulated alone is over what is left.
    def make(steps: list[AIMessage]) -> IntentOracle | MCOOracle:
        if kind == "intent":
            return IntentOracle(policy(*steps), RecordingWM(), TablePredictor({"c": 0.05}), gamma=1.0,
                                blacklist=False, last_call_cache=False)
        return MCOOracle(policy(*steps), RecordingWM())

    market = Market([PricedTool("a", 5.0), PricedTool("b", 30.0), PricedTool("c", 4.0)])

    def at(tool: str, remaining: float) -> DecisionContext:
        prop = Proposal(f"e1-{tool}", tool, {}, f"I need {tool}")
        return DecisionContext("e1", "q", prop, market.price(tool), 100.0, 100.0 - remaining, remaining, market,
                               step=0, history=[HumanMessage("q"), AIMessage(prop.reasoning, tool_calls=[
                                   tc(tool, prop.call_id)])], batch=(prop,))

    oracle = make([AIMessage("", tool_calls=[tc("b", "x1")]), AIMessage("", tool_calls=[tc("c", "x2")]),
                   AIMessage("done")])
    assert oracle.decide(at("a", 200.0)).accept
    assert [s.tool for s in oracle.memory.rollout("e1")] == ["b", "c"]
    oracle._policy = AgentPolicy(ScriptedToolModel(messages=iter([AIMessage("done")]), bound=[]))
    assert not oracle.decide(at("b", 20.0)).accept  # 30 > 20 left
    assert oracle.memory.rollout("e1") == [], "a miss empties the cache"
    oracle._policy = AgentPolicy(ScriptedToolModel(messages=iter([AIMessage("done")] * 2), bound=[]))
    decided = oracle.decide(at("c", 20.0))
    assert decided.reason != "cache_hit"
    if kind == "intent":  # gamma * 4 / 0.05 = 80 > 20: the simulation refuses what the stale plan let through
        assert not decided.accept


class _Seeing(AgentPolicy):
    """A policy that records what it is shown at each simulated turn, then plays ``replies``."""

    def __init__(self, *replies: AIMessage) -> None:
        super().__init__(ScriptedToolModel(messages=iter(list(replies)), bound=[]))
        self.seen: list[tuple[list[str], str | None]] = []

    def next_action(self, history: Any, *, visible: Any = None, notes: str | None = None) -> Any:
        self.seen.append(([str(m.content) for m in history if m.type == "tool"], notes))
        return super().next_action(history, visible=visible, notes=notes)


@pytest.mark.parametrize("kind", ["intent", "mco"])
def test_a_rollout_shows_the_simulated_agent_its_budget_going_down(kind):
    # The real agent sees, after each tool result and in its system notes, what it has spent (the oracle's
    # result note and prompt notes). The simulated agent saw neither move: it never ran out of money.
    seeing = _Seeing(AIMessage("", tool_calls=[tc("b", "x1", q=2)]), AIMessage("done"))
    oracle = (IntentOracle(seeing, RecordingWM(), TablePredictor({}), gamma=0.1) if kind == "intent"
              else MCOOracle(seeing, RecordingWM()))
    oracle.decide(ctx("a", remaining=45.0))  # budget 50, 5 spent: a (10) then b (20)
    (first_results, first_notes), (second_results, second_notes) = seeing.seen
    assert first_results[-1].endswith("[Budget status] spent 15 of 50; 35 left.")
    assert "[Budget status] spent 15 of 50; 35 left." in (first_notes or "")
    assert second_results[-1].endswith("[Budget status] spent 35 of 50; 15 left.")
    assert "[Budget status] spent 35 of 50; 15 left." in (second_notes or "")
    quiet = _Seeing(AIMessage("done"))
    (IntentOracle(quiet, RecordingWM(), TablePredictor({}), show_market=False) if kind == "intent"
     else MCOOracle(quiet, RecordingWM(), show_market=False)).decide(ctx("a", remaining=45.0))
    assert quiet.seen == [(['{"ok": true}'], None)], "a method that shows no market shows none in its rollouts"


@pytest.mark.parametrize("kind", ["intent", "mco"])
def test_a_later_call_of_a_batch_is_simulated_after_the_calls_accepted_before_it(kind):
    # The agent proposes a and b in parallel; a (10) is accepted, then b is decided. Both run: the paper's
    # agent would propose b after seeing a's result. The rollout for b left a out, so the simulated agent,
    # not seeing a's result, planned a again and the plan paid for it twice (a's money is already held).
    seeing = _Seeing(AIMessage("done"))
    oracle = (IntentOracle(seeing, RecordingWM(), TablePredictor({}), gamma=1.0) if kind == "intent"
              else MCOOracle(seeing, RecordingWM()))
    base = _turn(["a", "b"], 1, step=0, remaining=35.0)  # budget 50, 5 spent before the turn, a's 10 held
    decided = oracle.decide(DecisionContext(base.episode_id, base.query, base.proposal, base.price, base.budget,
                                            5.0, 35.0, MARKET, step=0, history=base.history, batch=base.batch,
                                            batch_index=1, accepted_before=base.batch[:1], held=10.0))
    (results, notes), = seeing.seen
    assert len(results) == 2, "the simulated agent sees a's result and b's"
    assert results[0].endswith("[Budget status] spent 15 of 50; 35 left.")  # a ran: 5 + 10
    assert results[1].endswith("[Budget status] spent 35 of 50; 15 left.")  # then b: + 20
    assert "spent 35 of 50; 15 left." in (notes or "")
    assert [s.tool for s in decided.trace] == ["b"], "a is not part of b's plan: its money is held already"
    assert decided.accept


def test_the_gate_tells_an_oracle_which_calls_of_its_batch_it_accepted_before():
    from intent import BudgetGuard, Oracle
    from intent.testing import GuardDriver, ai, call

    class RejectsB(Oracle):
        def __init__(self) -> None:
            self.seen: list[tuple[Any, ...]] = []

        def decide(self, ctx: DecisionContext) -> Decision:
            self.seen.append((ctx.tool, [p.tool for p in ctx.accepted_before], ctx.held, ctx.remaining))
            return Decision.rejected("not b", reason="plan_over_budget") if ctx.tool == "b" else Decision.accepted()

    oracle = RejectsB()
    driver = GuardDriver(BudgetGuard(oracle, MARKET, 50.0))
    driver.step(ai(call("a", q=1), call("b", q=1), call("c", q=1)))
    driver.step(ai(call("c", q=2)))
    assert oracle.seen == [("a", [], 0.0, 50.0), ("b", ["a"], 10.0, 40.0), ("c", ["a"], 10.0, 40.0),
                           ("c", [], 0.0, 35.0)]


def test_last_call_cache_accepts_a_repeated_rejected_call_once():
    oracle = IntentOracle(policy(AIMessage("done")), RecordingWM(), TablePredictor({"a": 0.1}), gamma=1.0,
                          blacklist=False)
    first = oracle.decide(ctx("a", remaining=50))
    assert not first.accept  # 10 / 0.1 = 100 > 50
    again = oracle.decide(ctx("a", remaining=50, step=1))  # proposed again at the next turn
    assert again.accept and again.reason == "last_call_cache"
    assert not oracle.memory.is_last_rejected("e1", "a", {"q": 1})


def _turn(tools, index, *, step, remaining=50.0, episode="e1"):
    """The gate's context for call ``index`` of a turn (model step ``step``) proposing ``tools`` in parallel."""
    props = tuple(Proposal(f"{episode}-{step}-{t}", t, {"q": 1}, f"I need {' and '.join(tools)}") for t in tools)
    prop = props[index]
    return DecisionContext(episode, "q", prop, MARKET.price(prop.tool), 50.0, 50 - remaining, remaining, MARKET,
                           step=step, history=[HumanMessage("q"), AIMessage(prop.reasoning, tool_calls=[
                               tc(p.tool, p.call_id, **p.args) for p in props])], batch=props, batch_index=index)


def test_last_call_cache_matches_a_repeat_tolerantly_as_algorithm_3_does():
    # Algorithm 3, line 4: a_t ≈ ā, the rollout cache's tolerance (args_match). An exact match only let a
    # repeat that retyped an argument's case or spacing be simulated (and refused) again.
    def fresh() -> IntentOracle:
        return IntentOracle(policy(*[AIMessage("done") for _ in range(4)]), RecordingWM(),
                            TablePredictor({"a": 0.1}), gamma=1.0, blacklist=False)

    def at(step: int, **args: Any) -> DecisionContext:
        return ctx("a", args=args, step=step)

    oracle = fresh()
    assert not oracle.decide(at(0, q="Toronto", year="2024")).accept
    again = oracle.decide(at(1, q=" toronto", year="2025"))  # one of two arguments the same: tolerated
    assert again.accept and again.reason == "last_call_cache"
    assert not oracle.memory.is_last_rejected("e1", "a", {"q": "Toronto", "year": "2024"}), "used once"
    other = fresh()
    assert not other.decide(at(0, q="Toronto", year="2024")).accept
    assert other.decide(at(1, q="Paris", year="2025")).reason == "plan_over_budget"  # nothing the same


def test_last_call_cache_holds_every_call_rejected_in_a_parallel_turn():
    # Algorithm 3 has one action per step: the rejected one is "the last rejected". In a turn of two
    # parallel calls both rejected, the second's rejection replaced the first's, so the agent insisting on
    # both next turn got neither through the last-call cache (each rejection replaced the other again).
    oracle = IntentOracle(policy(*[AIMessage("done") for _ in range(4)]), RecordingWM(),
                          TablePredictor({"a": 0.1, "b": 0.1}), gamma=1.0, blacklist=False)
    assert not oracle.decide(_turn(["a", "b"], 0, step=0)).accept
    assert not oracle.decide(_turn(["a", "b"], 1, step=0)).accept
    again = [oracle.decide(_turn(["a", "b"], i, step=1)) for i in (0, 1)]
    assert [(d.accept, d.reason) for d in again] == [(True, "last_call_cache")] * 2


def test_last_call_cache_keeps_a_rejection_when_a_later_call_of_the_turn_is_accepted():
    # a is rejected, c (same turn) is simulated and accepted: that acceptance used to clear a's rejection
    # (Algorithm 3, line 41, is about a later step's acceptance), so a proposed again was simulated again.
    oracle = IntentOracle(policy(*[AIMessage("done") for _ in range(3)]), RecordingWM(),
                          TablePredictor({"a": 0.1, "c": 1.0}), gamma=1.0, blacklist=False)
    assert not oracle.decide(_turn(["a", "c"], 0, step=0)).accept
    assert oracle.decide(_turn(["a", "c"], 1, step=0)).accept
    again = oracle.decide(_turn(["a"], 0, step=1, remaining=45.0))
    assert again.accept and again.reason == "last_call_cache"


def test_last_call_cache_serves_a_call_repeated_after_another_rejected_call_of_the_next_turn():
    # a is rejected; next turn the agent proposes b and a in parallel: b's rejection used to replace a's
    # before a was decided, so a was simulated (and rejected) again.
    oracle = IntentOracle(policy(*[AIMessage("done") for _ in range(4)]), RecordingWM(),
                          TablePredictor({"a": 0.1, "b": 0.1}), gamma=1.0, blacklist=False)
    assert not oracle.decide(_turn(["a"], 0, step=0)).accept
    assert not oracle.decide(_turn(["b", "a"], 0, step=1)).accept
    again = oracle.decide(_turn(["b", "a"], 1, step=1))
    assert again.accept and again.reason == "last_call_cache"


def test_last_call_cache_one_call_per_turn_is_algorithm_3():
    # One call per turn, as in the paper: a later turn's simulated acceptance forgets the rejection,
    # a later turn's rejection replaces it, and a hit is used once.
    oracle = IntentOracle(policy(*[AIMessage("done") for _ in range(6)]), RecordingWM(),
                          TablePredictor({"a": 0.1, "b": 0.1, "c": 1.0}), gamma=1.0,
                          blacklist=False)
    assert not oracle.decide(_turn(["a"], 0, step=0)).accept
    assert oracle.decide(_turn(["c"], 0, step=1)).accept  # simulated: the rejection of a is forgotten
    assert oracle.decide(_turn(["a"], 0, step=2)).reason == "plan_over_budget"
    assert not oracle.decide(_turn(["b"], 0, step=3)).accept  # replaces a
    assert oracle.decide(_turn(["a"], 0, step=4)).reason == "plan_over_budget"
    assert oracle.decide(_turn(["a"], 0, step=5)).reason == "last_call_cache"
    assert not oracle.memory.is_last_rejected("e1", "a", {"q": 1})


def test_blacklist_hides_low_probability_tools():
    oracle = IntentOracle(policy(AIMessage("", tool_calls=[tc("b")]), AIMessage("done")), RecordingWM(),
                          TablePredictor({"b": 0.05}), delta=0.1)
    oracle.decide(ctx("a"))
    assert oracle.visible_tools(MARKET, "e1") == ["a", "c"]
    assert oracle.visible_tools(MARKET, "other-episode") is None
    off = IntentOracle(policy(AIMessage("", tool_calls=[tc("b")]), AIMessage("done")), RecordingWM(),
                       TablePredictor({"b": 0.05}), blacklist=False)
    off.decide(ctx("a"))
    assert off.visible_tools(MARKET, "e1") is None


def test_no_trace_and_no_rollout_and_stochastic_switches():
    no_trace = IntentOracle(policy(AIMessage("", tool_calls=[tc("b")]), AIMessage("done")), RecordingWM(),
                            TablePredictor({}), gamma=5, trace_feedback=False)
    d = no_trace.decide(ctx())
    assert not d.accept and "Predicted tool trace" not in d.feedback and "|" not in d.feedback
    no_rollout = IntentOracle(AgentPolicy(NoPolicy(messages=iter([]), bound=[])), RecordingWM(),
                              TablePredictor({"a": 0.25}), gamma=1.0, lookahead=False)
    d = no_rollout.decide(ctx("a", remaining=45))  # 10 / 0.25 = 40 <= 45
    assert d.accept and len(d.trace) == 1
    wm = RecordingWM()
    IntentOracle(policy(AIMessage("done")), wm, TablePredictor({}), stochastic=True).decide(ctx())
    assert wm.calls and all(z is None for _, z in wm.calls)


def test_mco_compares_the_simulated_total_with_what_is_left():
    wm = RecordingWM()
    plan = (AIMessage("", tool_calls=[tc("b")]), AIMessage("", tool_calls=[tc("c")]), AIMessage("done"))
    d = MCOOracle(policy(*plan), wm, max_depth=5).decide(ctx("a", remaining=35))
    assert d.accept and sum(s.price for s in d.trace) == 35 and all(z is None for _, z in wm.calls)
    d = MCOOracle(policy(*plan), RecordingWM(), max_depth=5).decide(ctx("a", remaining=34))
    assert not d.accept and "1. a(" in d.feedback and "3. c(" in d.feedback  # simulated actions, with args
    truncated = MCOOracle(policy(AIMessage("", tool_calls=[tc("b")]), AIMessage("", tool_calls=[tc("b")])),
                          RecordingWM(), max_depth=2).decide(ctx("a"))
    assert truncated.usage["rollout_turns"] == 2


@pytest.mark.parametrize("policy_kind", ["accept_if_fits", "reject"])
def test_model_failure_falls_back_visibly(policy_kind):
    oracle = IntentOracle(policy(AIMessage("done")), RecordingWM(fail=True), TablePredictor({}),
                          on_model_error=policy_kind)
    d = oracle.decide(ctx("a", remaining=50))
    assert d.reason == "oracle_error" and d.usage["model_error"] == 1
    assert d.accept == (policy_kind == "accept_if_fits")
    assert not oracle.decide(ctx("b", remaining=15)).accept  # never accepts what does not fit


def test_two_episodes_in_parallel_never_share_caches():
    script = [AIMessage("", tool_calls=[tc("b")]), AIMessage("done")] * 50
    oracle = IntentOracle(AgentPolicy(ScriptedToolModel(messages=iter(script), bound=[])), RecordingWM(),
                          TablePredictor({"c": 0.01}))
    barrier = threading.Barrier(2)
    results = {}

    def run(eid, tool):
        barrier.wait()
        for _ in range(10):
            oracle.decide(ctx(tool, episode=eid))
        results[eid] = (oracle.memory.rollout(eid), oracle.memory.blacklist(eid))

    threads = [threading.Thread(target=run, args=("ep-A", "a")), threading.Thread(target=run, args=("ep-B", "c"))]
    [t.start() for t in threads]
    [t.join() for t in threads]
    assert "c" in results["ep-B"][1] and "c" not in results["ep-A"][1]


def test_args_match_is_tolerant():
    assert args_match({"city": "Oslo", "day": "mon"}, {"city": "oslo ", "day": "tue"})
    assert not args_match({"city": "Oslo", "day": "mon"}, {"city": "Bergen", "day": "tue"})


class WildPredictor:
    def __init__(self, values, fail):
        self.values, self.fail, self.i = values, fail, 0

    def predict(self, r, t, a):
        self.i += 1
        if self.fail and self.i % 3 == 0:
            raise ModelError("predictor timeout")
        return self.values[self.i % len(self.values)]


class AlwaysAnswers(ScriptedToolModel):
    def invoke(self, messages, *a, **k):
        return AIMessage("done")


class LoopPolicyModel(ScriptedToolModel):
    def invoke(self, messages, *a, **k):
        return AIMessage("more", tool_calls=[tc("pricey", "p"), tc("cheap", "c")])


@settings(max_examples=40, deadline=None)
@given(values=st.lists(st.floats(0, 1), min_size=1, max_size=5), fail=st.booleans(), gamma=st.floats(0.01, 2),
       kind=st.sampled_from(["intent", "mco", "intent-norollout"]), budget=st.integers(0, 60))
def test_no_oracle_lets_the_guard_overspend(values, fail, gamma, kind, budget):
    def factory():
        pol = AgentPolicy(LoopPolicyModel(messages=iter([]), bound=[]))
        if kind == "mco":
            return MCOOracle(pol, RecordingWM(fail=fail), max_depth=3)
        return IntentOracle(pol, RecordingWM(fail=fail and len(values) % 2 == 0), WildPredictor(values, fail),
                            gamma=gamma, max_depth=3, lookahead=kind == "intent")

    check_oracle(factory, budget=float(budget))


def test_check_oracle_refuses_a_factory_that_makes_no_oracle_in_one_line():
    # Was: AttributeError: 'NotAnOracle' object has no attribute 'decide', from inside the suite.
    from intent.errors import UsageError

    class NotAnOracle:
        pass

    with pytest.raises(UsageError, match=r"^check_oracle's factory made NotAnOracle .*no decide\(ctx\) method"):
        check_oracle(NotAnOracle)


# The conformance checks must be able to fail: each guard below is broken on purpose.
def test_conformance_fails_a_guard_that_overspends(monkeypatch):
    import functools

    import intent.testing as testing
    from intent import AcceptAll, BudgetGuard

    # The suite lives in intent.testing (intent.conformance re-exports it).
    monkeypatch.setattr(testing, "BudgetGuard", functools.partial(BudgetGuard, enforce=False))
    with pytest.raises(AssertionError, match="overspent"):
        check_oracle(AcceptAll)


def test_conformance_fails_a_guard_that_charges_nothing(monkeypatch):
    from intent import AcceptAll, BudgetLedger

    commit = BudgetLedger.commit
    monkeypatch.setattr(BudgetLedger, "commit", lambda self, call_id, amount=None: commit(self, call_id, 0.0))
    with pytest.raises(AssertionError, match="but the ledger charged 0"):
        check_oracle(AcceptAll)


def test_conformance_fails_a_guard_that_keeps_unused_reservations(monkeypatch):
    from intent import AcceptAll, BudgetLedger

    monkeypatch.setattr(BudgetLedger, "release", lambda self, call_id: self.get(call_id))
    with pytest.raises(AssertionError, match="still reserved"):
        check_oracle(AcceptAll)


def test_conformance_fails_a_guard_that_answers_a_call_twice(monkeypatch):
    from intent import AcceptAll, BudgetGuard

    wrap = BudgetGuard.wrap_tool_call

    def twice(self, request, handler):
        from langgraph.types import Command

        out = wrap(self, request, handler)
        # A second answer of its own (a message of its own id: the messages channel keeps one per id).
        if not isinstance(out, Command):  # a refusal is a bare ToolMessage
            return Command(update={"messages": [out, out.model_copy(update={"id": None})]})
        out.update["messages"] = [*out.update["messages"], *(m.model_copy(update={"id": None})
                                                             for m in out.update["messages"])]
        return out

    monkeypatch.setattr(BudgetGuard, "wrap_tool_call", twice)
    with pytest.raises(AssertionError, match="has 2 ToolMessages"):
        check_oracle(AcceptAll)


@pytest.mark.parametrize("wrong", ["adecide", "visible_tools", "prompt_notes", "result_note"])
def test_conformance_fails_an_oracle_whose_hooks_return_what_the_guard_cannot_use(wrong):
    # Each passed check_oracle and then misbehaved under create_agent: an adecide returning a str raised
    # only under ainvoke, visible_tools returning "search" was split into letters, a float prompt note
    # failed pydantic validation.
    from intent import AcceptAll

    class Wrong(AcceptAll):
        pass

    bad = {"adecide": lambda self, ctx: _coro("accept"), "visible_tools": lambda self, market, eid: "cheap",
           "prompt_notes": lambda self, *a: 1.5, "result_note": lambda self, outcome: ["a note"]}
    setattr(Wrong, wrong, bad[wrong])
    with pytest.raises(AssertionError, match=wrong):
        check_oracle(Wrong)


async def _coro(value):
    return value


def test_conformance_of_the_shipped_oracles():
    from baselines.bats import BATSOracle
    from baselines.prompt import PromptOracle
    from baselines.raw import RawOracle
    from intent import AcceptAll

    def answers():  # the agent always answers: a policy that never runs out of replies
        return AgentPolicy(AlwaysAnswers(messages=iter([]), bound=[]))

    for factory in (AcceptAll, RawOracle, PromptOracle, BATSOracle,
                    lambda: IntentOracle(answers(), RecordingWM(), TablePredictor({})),
                    lambda: MCOOracle(answers(), RecordingWM())):
        check_oracle(factory)
    assert isinstance(AcceptAll().decide(ctx()), Decision)


def _tool_dict(name, *keys):
    return {"name": name, "description": name, "parameters": {"type": "object",
                                                              "properties": {k: {"type": "string"} for k in keys}}}


def test_intent_alternatives_list_affordable_same_argument_tools_by_expected_cost():
    market = Market([PricedTool("a", 10), PricedTool("b", 20), PricedTool("c", 5), PricedTool("d", 8),
                     PricedTool("e", 60)])
    tools = [_tool_dict("a", "q"), _tool_dict("b", "q"), _tool_dict("c", "q"), _tool_dict("d", "other"),
             _tool_dict("e", "q")]
    # a: 10 / 0.5 = 20; b: 20 / 0.9 = 22.2; c: 5 / 0.1 = 50; d takes other arguments; e does not fit.
    pred = TablePredictor({"a": 0.5, "b": 0.9, "c": 0.1, "d": 0.99, "e": 0.99})

    def oracle(n):
        model = ScriptedToolModel(messages=iter([AIMessage("done")]), bound=[])
        return IntentOracle(AgentPolicy(model, tools), RecordingWM(), pred, gamma=5.0, alternatives=n)

    prop = Proposal("e1-a", "a", {"q": 1}, "I need a")
    context = DecisionContext("e1", "q", prop, 10.0, 50.0, 0.0, 50.0, market, step=0,
                              history=[HumanMessage("q"), AIMessage("I need a", tool_calls=[tc("a", "e1-a", q=1)])],
                              batch=(prop,))
    d = oracle(2).decide(context)
    assert not d.accept
    alts = d.feedback.split("Alternatives for the rejected call")[1]
    assert "1 | b | 20 | 0.90 | 22" in alts and "2 | c | 5 | 0.10 | 50" in alts
    assert "| d |" not in alts and "| e |" not in alts and "| a |" not in alts
    assert "Alternatives" not in oracle(0).decide(context).feedback  # off by default in the paper's INTENT
    with pytest.raises(ValueError, match="alternatives"):
        IntentOracle(policy(), RecordingWM(), pred, alternatives=-1)


def test_intent_blacklists_inside_the_rollout_as_in_algorithm_3():
    tools = [_tool_dict("a", "q"), _tool_dict("b", "q"), _tool_dict("c", "q")]
    model = ScriptedToolModel(messages=iter([AIMessage("try c", tool_calls=[tc("c", q=3)]), AIMessage("done")]),
                              bound=[])
    pred = TablePredictor({"a": 0.9, "b": 0.9, "c": 0.05})
    oracle = IntentOracle(AgentPolicy(model, tools), RecordingWM(), pred, gamma=0.5, delta=0.1)
    d = oracle.decide(ctx())
    # c scored below delta on turn 2: hidden from the policy on turn 3 of the same rollout.
    assert model.bound == [["a", "b", "c"], ["a", "b"]]
    assert d.usage["blacklisted"] == 1 and d.usage["below_delta"] == 1
    assert oracle.visible_tools(MARKET, "e1") == ["a", "b"]
    off = ScriptedToolModel(messages=iter([AIMessage("try c", tool_calls=[tc("c", q=3)]), AIMessage("done")]),
                            bound=[])
    IntentOracle(AgentPolicy(off, tools), RecordingWM(), pred, gamma=0.5, delta=0.1, blacklist=False).decide(ctx())
    assert off.bound == [["a", "b", "c"], ["a", "b", "c"]]


def _plan_a_then_b(gamma=0.5, predictor=None, **switches):
    return IntentOracle(policy(AIMessage("then b", tool_calls=[tc("b", q=2)]), AIMessage("done")),
                        RecordingWM(), predictor or TablePredictor({}), gamma=gamma, **switches)


def test_ideal_plan_must_fit_refuses_a_plan_whose_best_case_is_over_budget():
    # Plan a (10) then b (20): 30 if both work the first time, with 25 left. The risk-adjusted
    # cost with p = 1 and gamma = 0.5 is 15, so the paper's test alone accepts it.
    paper = _plan_a_then_b().decide(ctx(remaining=25))
    assert paper.accept and paper.usage["plan_price"] == 30 and paper.usage["risk_cost"] == pytest.approx(15)
    assert paper.usage["best_case_over"] == 1.0
    oracle = _plan_a_then_b(ideal_plan_must_fit=True)
    fit = oracle.decide(ctx(remaining=25))
    assert not fit.accept and fit.reason == "plan_over_budget" and fit.usage["best_case_over"] == 1.0
    assert "even if every call works the first time, your current plan costs 30, which would exceed it." in fit.feedback
    assert "risk-adjusted" not in fit.feedback  # the risk-adjusted cost (15) fits: not a reason here
    assert "1 | a | 10 | 1.00 | 10" in fit.feedback  # the trace is still the paper's feedback
    # A rejection like any other: the agent proposing the same call again (next turn) is let through (the
    # paper's last-call cache), without simulating.
    assert oracle.memory.is_last_rejected("e1", "a", {"q": 1})
    oracle._policy = AgentPolicy(NoPolicy(messages=iter([]), bound=[]))
    again = oracle.decide(ctx(remaining=25, step=1))
    assert again.accept and again.reason == "last_call_cache"
    # With the plan inside the budget at face value the switch changes nothing.
    ok = _plan_a_then_b(ideal_plan_must_fit=True).decide(ctx(remaining=30))
    assert ok.accept and ok.usage["best_case_over"] == 0.0


def test_ideal_plan_must_fit_keeps_the_papers_risk_test_and_its_words():
    # p = 0.5 for both: 30 at face value, risk-adjusted gamma * (20 + 40). With 29 left both tests
    # refuse, and the rejection gives both reasons.
    half = TablePredictor({}, default=0.5)
    both = _plan_a_then_b(predictor=half, ideal_plan_must_fit=True).decide(ctx(remaining=29))
    assert not both.accept and ("even if every call works the first time, your current plan costs 30; risk-adjusted "
                                "cost of your current plan (gamma=0.5): 30.00, which would exceed it too.") in both.feedback
    assert _plan_a_then_b(predictor=half, ideal_plan_must_fit=True).decide(ctx(remaining=30)).accept  # 30 <= 30 both ways
    # With 30 left and gamma = 0.6 only the paper's risk test refuses: its words alone.
    only_risk = _plan_a_then_b(gamma=0.6, predictor=half, ideal_plan_must_fit=True).decide(ctx(remaining=30))
    assert not only_risk.accept and "even if every call works" not in only_risk.feedback
    assert "risk-adjusted cost of your current plan (gamma=0.6): 36.00, which would exceed it." in only_risk.feedback
    # Off (Algorithm 3 as published): the rejection's words are the paper's alone, even with the plan
    # over the budget at face value.
    paper = _plan_a_then_b(gamma=1.2).decide(ctx(remaining=25))
    assert not paper.accept and paper.feedback.startswith(
        "Budget check failed: the call was not executed and cost nothing.\nRemaining budget: 25; risk-adjusted "
        "cost of your current plan (gamma=1.2): 36.00, which would exceed it.\nPay attention to the predicted success "
        "probabilities: some tools may have a much lower chance than you expected; try to avoid them in your next "
        "attempt.\nPredicted tool trace:")


def _denied_run(calls: list[str]) -> tuple[list[str], dict[str, int]]:
    """INTENT under a guard that asks a human for a top-up when a call is refused as over budget; the human
    denies every time. Returns the tools asked about and each tool's runs."""
    from collections import Counter

    from langchain.agents import create_agent
    from langchain_core.tools import StructuredTool
    from langgraph.checkpoint.memory import InMemorySaver
    from langgraph.types import Command

    from intent import BudgetGuard, MemoryLogSink
    from intent.testing import ai, call, scripted

    runs: Counter[str] = Counter()

    def a(q: int = 0) -> str:
        runs["a"] += 1
        return "ran a"

    def b(q: int = 0) -> str:
        runs["b"] += 1
        return "ran b"

    oracle = IntentOracle(policy(*[AIMessage("done") for _ in range(20)]), RecordingWM(),
                          TablePredictor({"a": 0.1, "b": 0.1}), gamma=1.0, blacklist=False)
    guard = BudgetGuard(oracle, MARKET, 50.0, on_over_budget="ask", log_sink=MemoryLogSink())
    agent = create_agent(scripted([ai(*[call(n, q=1) for n in calls]), AIMessage("end")]),
                         [StructuredTool.from_function(a, description="a"),
                          StructuredTool.from_function(b, description="b")],
                         middleware=[guard.middleware()], checkpointer=InMemorySaver())
    config = {"configurable": {"thread_id": "t"}}
    out = agent.invoke({"messages": [HumanMessage("go")]}, config)
    asked = []
    for _ in range(6):
        if "__interrupt__" not in out:
            break
        asked.append(out["__interrupt__"][0].value["tool"])
        out = agent.invoke(Command(resume={"action": "deny"}), config)
    return asked, dict(runs)


@pytest.mark.parametrize("calls", [["a"], ["a", "b"]], ids=["one_call", "parallel_calls"])
def test_a_call_the_human_denied_a_top_up_for_does_not_run_through_the_last_call_cache(calls):
    # On resume the gate runs again and the oracle decides the call again in the same turn: that is not the
    # agent proposing it again, so INTENT's last-call cache must not let it through unsimulated (final review:
    # the denied call ran; the same with the single-slot cache before parallel turns were held).
    asked, runs = _denied_run(calls)
    assert asked and asked[0] == "a"
    assert runs == {}, f"ran {runs} although the human denied (asked {asked})"


# ------------------------------------------------- intent.testing's doubles: RecordingOracle, ReactiveToolModel
def _recording_agent(oracle: Any, model: Any, runs: Any) -> Any:
    from langchain.agents import create_agent
    from langchain_core.tools import StructuredTool

    from intent import BudgetGuard

    def tool(name: str) -> Any:
        def fn(x: int = 0) -> str:
            runs.hit(name)
            return f"{name}={x}"

        return StructuredTool.from_function(fn, name=name, description=f"Tool {name}.")

    guard = BudgetGuard(oracle, Market([PricedTool("a", 1.0), PricedTool("b", 2.0)]), 10.0)
    return guard, create_agent(model, [tool("a"), tool("b")], middleware=[guard.middleware()])


def _invoke(agent: Any, text: str, use_async: bool) -> Any:
    import asyncio

    inp = {"messages": [HumanMessage(text)]}
    return asyncio.run(agent.ainvoke(inp)) if use_async else agent.invoke(inp)


@pytest.mark.parametrize("use_async", [False, True])
def test_the_recording_oracle_records_what_it_is_asked_and_accepts_by_default(use_async):
    from intent.testing import RecordingOracle, RunCounter, ai, call, scripted

    oracle, runs = RecordingOracle(), RunCounter()
    _, agent = _recording_agent(oracle, scripted([ai(call("a", x=1), call("b", x=2)), ai(call("a", x=3)),
                                                  AIMessage("done")]), runs)
    _invoke(agent, "the task", use_async)
    assert runs == {"a": 2, "b": 1}  # all accepted
    assert [(c.tool, dict(c.args), c.query, c.step) for c in oracle.contexts] == [
        ("a", {"x": 1}, "the task", 0), ("b", {"x": 2}, "the task", 0), ("a", {"x": 3}, "the task", 1)]
    assert [(e.query, e.budget) for e in oracle.episodes] == [("the task", 10.0)]
    assert [hook for hook, _ in oracle.calls] == ["start", "decide", "decide", "decide"]
    assert oracle.calls[1][1] is oracle.contexts[0] and oracle.calls[0][1] is oracle.episodes[0]
    check_oracle(RecordingOracle)
    check_oracle(lambda: RecordingOracle(end_hook=True))


@pytest.mark.parametrize("use_async", [False, True])
def test_the_recording_oracle_answers_with_its_decision_or_its_callables(use_async):
    from intent.testing import RecordingOracle, RunCounter, ai, call, scripted

    no = Decision.rejected("not this one", reason="not_wanted")
    for oracle, ran in ((RecordingOracle(no), {}),
                        (RecordingOracle(lambda ctx: no if ctx.tool == "b" else Decision.accepted()), {"a": 1})):
        runs = RunCounter()
        _, agent = _recording_agent(oracle, scripted([ai(call("a", x=1), call("b", x=2)), AIMessage("done")]), runs)
        out = _invoke(agent, "go", use_async)
        assert runs == ran and len(oracle.contexts) == 2
        refused = [m for m in out["messages"] if getattr(m, "status", None) == "error"]
        assert len(refused) == 2 - len(ran) and all("not this one" in str(m.content) for m in refused)


def test_the_recording_oracles_end_hook_is_there_only_when_asked_for():
    from intent.testing import RecordingOracle, RunCounter, ai, call, scripted

    assert not callable(getattr(RecordingOracle(), "end", None))  # the guard looks for a callable end
    oracle = RecordingOracle(end_hook=True)
    _, agent = _recording_agent(oracle, scripted([ai(call("a", x=1)), AIMessage("done")]), RunCounter())
    out = agent.invoke({"messages": [HumanMessage("go")]})
    episode = out["intent_ledger"]["episode_id"]
    assert oracle.ended == [episode] and [h for h, _ in oracle.calls] == ["start", "decide", "end"]
    quiet = RecordingOracle()
    _, agent = _recording_agent(quiet, scripted([ai(call("a", x=1)), AIMessage("done")]), RunCounter())
    agent.invoke({"messages": [HumanMessage("go")]})
    assert quiet.ended == [] and [h for h, _ in quiet.calls] == ["start", "decide"]


@pytest.mark.parametrize("use_async", [False, True])
def test_the_reactive_model_answers_from_the_conversation_so_far(use_async):
    from langchain_core.messages import ToolMessage

    from intent.testing import ReactiveToolModel, RecordingOracle, RunCounter, TurnInfo

    seen: list[TurnInfo] = []

    def reply(messages: list, info: TurnInfo) -> Any:
        seen.append(info)
        results = [m for m in messages if isinstance(m, ToolMessage)]
        if len(results) == 2:
            return "done"
        x = int(str(results[-1].content).split("=")[1]) + 1 if results else 1
        return AIMessage("", tool_calls=[{"name": "a", "args": {"x": x}, "id": None}])  # no id: it gets one

    tools_runs, model_runs = RunCounter(), RunCounter()
    model = ReactiveToolModel(reply=reply, model_name="mine", usage=(7, 3), runs=model_runs)
    _, agent = _recording_agent(RecordingOracle(), model, tools_runs)
    out = _invoke(agent, "go", use_async)
    assert out["messages"][-1].content == "done" and tools_runs == {"a": 2}
    assert [m.tool_calls[0]["args"] for m in out["messages"] if isinstance(m, AIMessage) and m.tool_calls] == [
        {"x": 1}, {"x": 2}]  # the second call read the first one's result
    ids = [c["id"] for m in out["messages"] if isinstance(m, AIMessage) for c in m.tool_calls]
    assert len(ids) == 2 and all(ids) and len(set(ids)) == 2
    assert all(m.usage_metadata["input_tokens"] == 7 for m in out["messages"] if isinstance(m, AIMessage))
    assert model_runs == {"mine": 3} and [i.execution for i in seen] == [1, 2, 3]
    assert {i.tools for i in seen} == {("a", "b")} and model.bound == [["a", "b"]] * 3
    chunks = list(model.bind_tools([]).stream([HumanMessage("go")]))
    assert [c["name"] for c in chunks[0].tool_calls] == ["a"]  # streamed, its calls come too


def test_the_reactive_model_fails_the_executions_it_is_told_to_and_binds_what_it_is_given():
    from intent.testing import ReactiveToolModel

    model = ReactiveToolModel(reply=lambda messages, info: f"{info.tools} {info.execution}", fail_on={2})
    assert model.invoke("hi").content == "() 1"
    with pytest.raises(ConnectionError, match="execution 2"):
        model.invoke("hi")
    assert model.invoke("hi").content == "() 3" and model.runs == {"reactive-model": 3}
    bound = model.bind_tools([{"name": "pick", "parameters": {}}], tool_choice="any")
    assert bound.kwargs == {"tool_choice": "any"} and bound.invoke("hi").content == "('pick',) 4"
    with pytest.raises(TypeError, match="AIMessage or a str"):
        ReactiveToolModel(reply=lambda messages, info: 42).invoke("hi")


def test_the_run_counter_counts_by_name_across_threads():
    from concurrent.futures import ThreadPoolExecutor

    from intent.testing import CountingTool, RunCounter

    runs = RunCounter()
    assert runs.hit("a") == 1 and runs.hit("a") == 2 and runs["b"] == 0
    tool = CountingTool("b", runs)
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda i: tool.invoke({"id": f"c{i}", "args": {}}), range(400)))
    assert runs == {"a": 2, "b": 400} and runs.total() == 402


def test_check_oracle_given_an_oracle_instead_of_its_factory_says_so():
    # check_oracle(AcceptAll()) raised "TypeError: 'AcceptAll' object is not callable", naming nothing.
    from intent.errors import UsageError

    for wrong in (AcceptAll(), "AcceptAll", None):
        with pytest.raises(UsageError, match="check_oracle takes a factory"):
            check_oracle(wrong)
    check_oracle(AcceptAll)  # the class is a factory
    check_oracle(lambda: AcceptAll())
