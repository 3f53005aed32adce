"""The table's numbers against the INTENT paper's definitions (section 4.1), on episodes run through the harness.

AP is "the average per-call price of selected tools": what the guard charged for the oracle's own tokens
(``--charge-oracle``) is money spent (it is in AC) but no tool call. The pooled regret split ("every audited
decision") includes the decisions of a crashed episode, as the table's Regret does.
"""

from __future__ import annotations

import dataclasses
import threading

import pytest

from eval.markets import SyntheticBenchMarket
from eval.method_spec import MethodSpec
from eval.methods import get_method
from eval.metrics import compute_metrics
from eval.results import EpisodeResult
from eval.runner import run_episode, sim_agent_factory
from intent.oracle import Decision, DecisionContext, Oracle


class _ThinkingAcceptAll(Oracle):
    """Accepts every call, reporting tokens of its own for each decision (what a planning oracle does)."""

    name = "thinking"

    def decide(self, ctx: DecisionContext) -> Decision:
        return Decision.accepted(tokens=2000)


def _counting_tools(env):
    """The episode's tools, each run counted inside the tool with the price it runs at (static market)."""
    ran = {"calls": 0, "money": 0.0}
    lock = threading.Lock()

    def counting(tool):
        fn = tool.func

        def run(*args, **kwargs):
            with lock:
                ran["calls"] += 1
                ran["money"] += env.market.price(tool.name)
            return fn(*args, **kwargs)

        return tool.model_copy(update={"func": run})

    return dataclasses.replace(env, tools=[counting(t) for t in env.tools]), ran


def test_the_oracles_charged_tokens_are_spent_money_but_no_tool_call():
    market = SyntheticBenchMarket(4, 0)
    spec = MethodSpec("thinking", True, lambda ctx: _ThinkingAcceptAll())
    checked = 0
    for task in market.tasks():
        env, ran = _counting_tools(market.episode(task, 0))
        # 2000 tokens at 500 per million: 1.0 of the market's money per decision, held before it.
        result = run_episode(spec, env, 0, sim_agent_factory(),
                             options={"charge_oracle": 500.0, "oracle_max_tokens": 2000})
        assert not result.error, result.error
        if not ran["calls"]:
            continue
        checked += 1
        assert result.extra["oracle_charged"] > 0  # the oracle was paid from the budget ...
        assert result.cost == pytest.approx(ran["money"] + result.extra["oracle_charged"])  # ... and AC sees it
        assert result.n_calls == ran["calls"]  # ... but its charges are no tool calls
        assert result.price_sum == pytest.approx(ran["money"])  # ... nor tool prices (AP)
    assert checked >= 2


CRASH_TASK, CRASH_AFTER = "syn-7-0004", 3  # model calls before the crash (tests/test_crashed_regret.py's case)


def _crashing_factory():
    base = sim_agent_factory()

    def factory(env, seed):
        model = base(env, seed)
        calls = {"n": 0}

        class Crashy(type(model)):
            def _generate(self, *a, **k):
                calls["n"] += 1
                if calls["n"] >= CRASH_AFTER:
                    raise RuntimeError("boom")
                return super()._generate(*a, **k)

        model.__class__ = Crashy
        return model

    return factory


def test_a_crashed_episodes_decisions_count_in_the_pooled_regret_split_as_in_regret():
    market = SyntheticBenchMarket(6, 7)
    task = next(t for t in market.tasks() if market.task_id(t) == CRASH_TASK)
    result = run_episode(get_method("tracker"), market.episode(task, 7), 7, _crashing_factory())
    assert result.error and result.extra["decisions_audited"] > 0
    row = compute_metrics([result])["tracker"]
    assert row["decision_regret"] is not None  # the table's Regret counts the decisions before the crash ...
    # ... and so does the split pooled over every audited decision (it was empty: the crash dropped them).
    assert row.get("reject_share") is not None
    assert row["regret_per_accept"] is not None


def _episode(method: str, task: str, *, passed: float, cost: float, budget: float = 50.0, error: str = "",
             solvable: bool | None = True) -> EpisodeResult:
    return EpisodeResult(method=method, task_id=task, seed=0, passed=passed, cost=cost, budget=budget, error=error,
                         solvable=solvable, answered=not error)


def test_feasible_is_within_the_budget_inclusive_with_float_sums_and_a_crash_is_a_failure():
    assert _episode("m", "a", passed=1.0, cost=50.0).feasible  # exactly B is within budget (sum COST <= B)
    assert _episode("m", "a", passed=1.0, cost=0.1 + 0.2, budget=0.3).feasible  # 0.30000000000000004
    assert not _episode("m", "a", passed=1.0, cost=50.001).feasible
    rs = [_episode("m", "a", passed=1.0, cost=50.0), _episode("m", "b", passed=1.0, cost=51.0),
          _episode("m", "c", passed=0.0, cost=12.0, error="RuntimeError: boom"), _episode("m", "d", passed=0.0, cost=7.0)]
    row = compute_metrics(rs, reference=None)["m"]
    assert row["PR"] == 25.0  # b overspent: solved but no reward; c crashed: a failure
    assert row["FR"] == 50.0  # the crash counts as infeasible, as the README says
    assert row["AC"] == pytest.approx((50 + 51 + 12 + 7) / 4, abs=1e-3)  # over every task, crashed and failed too
    assert row["crashed"] == ["c"]


def test_or_counts_solved_tasks_among_the_solvable_and_says_how_many_solved_ones_it_leaves_out():
    # The paper's OR is solved / solvable (its Table 1 has OR / PR = 0.82 on every row); ours counts only the
    # solved tasks that are solvable (OR <= 100), and says what that leaves out: here 1.5 of a solved task.
    rs = [_episode("m", "a", passed=1.0, cost=10.0), _episode("m", "b", passed=0.0, cost=10.0),
          _episode("m", "c", passed=1.0, cost=10.0, solvable=False),
          _episode("m", "d", passed=0.5, cost=10.0, solvable=False)]
    row = compute_metrics(rs, reference=None)["m"]
    assert row["OR"] == 50.0
    assert row["solved_not_solvable"] == 1.5
    unknown = compute_metrics([_episode("m", "a", passed=1.0, cost=1.0, solvable=None)], reference=None)["m"]
    assert unknown["OR"] is None and unknown["solved_not_solvable"] is None


def test_the_sopr_spread_over_judge_runs_counts_a_crashed_episode_as_unsolved_in_every_run():
    # StableToolBench: per judge run, the pass rate over the queries; the spread is over runs. A crashed
    # episode was never judged: Unsolved (0) in each run, as in PR, not a reason to drop the spread.
    judged = [_episode("m", "a", passed=2 / 3, cost=10.0), _episode("m", "b", passed=1.0, cost=10.0)]
    judged[0].extra["judge_runs"] = [1.0, 0.0, 1.0]
    judged[1].extra["judge_runs"] = [1.0, 1.0, 1.0]
    crashed = _episode("m", "c", passed=0.0, cost=3.0, error="RuntimeError: the agent crashed")
    row = compute_metrics([*judged, crashed], reference=None)["m"]
    # Runs: (1 + 1 + 0) / 3, (0 + 1 + 0) / 3, (1 + 1 + 0) / 3 -> population std 15.71 points.
    assert row["PR_std_over_judge_runs"] == pytest.approx(15.71, abs=0.01)
    assert row["PR"] == pytest.approx(55.56, abs=0.01)
