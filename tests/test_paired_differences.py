"""Paired PR differences with a bootstrap interval: the comparison a user picks an oracle from."""

from __future__ import annotations

from eval.metrics import paired_pr_differences
from eval.report import paired_lines
from eval.results import EpisodeResult


def _r(method, task, passed, cost=10.0):
    return EpisodeResult(method=method, task_id=f"t{task}", seed=0, passed=passed, answered=True, budget=50.0,
                         cost=cost)


def test_paired_difference_counts_tasks_and_brackets_the_mean():
    results = [_r("tracker", i, float(i % 4 == 0)) for i in range(200)]
    results += [_r("intent", i, float(i % 4 == 0 or i % 10 == 1)) for i in range(200)]  # 20 more passes
    results += [_r("worse", i, float(i % 8 == 0)) for i in range(200)]  # 25 fewer
    out = paired_pr_differences(results, "tracker", seed=0)
    assert set(out) == {"intent", "worse"}
    assert out["intent"]["diff"] == 10.0 and out["intent"]["better"] == 20 and out["intent"]["worse"] == 0
    lo, hi = out["intent"]["ci95"]
    assert 0 < lo < 10.0 < hi < 20
    assert out["worse"]["diff"] == -12.5 and out["worse"]["ci95"][1] < 0
    assert paired_pr_differences(results, "tracker", seed=0) == out  # seeded: same results, same interval
    assert paired_pr_differences(results, "missing") == {}
    text = "\n".join(paired_lines({"paired": {"tracker": out}}))
    assert "| intent | +10.00 |" in text and "tracker" in text


def test_only_shared_tasks_are_paired():
    results = [_r("tracker", i, 1.0) for i in range(10)] + [_r("intent", i, 0.0) for i in range(5, 15)]
    out = paired_pr_differences(results, "tracker")
    assert out["intent"]["n"] == 5
    # The table says how many tasks the difference rests on.
    assert "| intent | -100.00 | [-100.00, -100.00] | 5 | 0 | 5 |" in "\n".join(paired_lines({"paired": {"tracker": out}}))


def _rr(method, task, regret):
    r = _r(method, task, 0.0)
    r.extra["decision_regret"] = regret
    return r


def test_paired_regret_difference_pairs_tasks_with_a_decision_and_brackets_the_mean():
    from eval.metrics import paired_regret_differences
    from eval.report import paired_regret_lines

    results = [_rr("mco", i, 0.10) for i in range(100)]
    results += [_rr("intent", i, 0.10 + (0.05 if i % 5 == 0 else 0.0)) for i in range(100)]  # 20 tasks worse
    results += [_rr("tracker", i, None) for i in range(100)]  # no audited decision: not paired
    out = paired_regret_differences(results, "mco", seed=0)
    assert set(out) == {"intent"}
    got = out["intent"]
    assert got["n"] == 100 and got["higher"] == 20 and got["lower"] == 0
    assert abs(got["diff"] - 0.01) < 1e-9
    lo, hi = got["ci95"]
    assert 0 < lo < 0.01 < hi
    assert paired_regret_differences(results, "mco", seed=0) == out
    text = "\n".join(paired_regret_lines({"paired_regret": {"mco": out}}))
    assert "| intent | +0.010 |" in text and "mco" in text
