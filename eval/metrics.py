"""Benchmark metrics, following the INTENT paper (section 4.1) with every choice written down.

Per method, over its episodes:

* **PR** pass rate: mean of ``passed * 1[cost <= B]`` x 100 (a solution must be feasible; a
  judge's Unsure counts 0.5). Missing answers count as failures.
* **OR** budget-optimal pass rate: tasks solved (as in PR) *among the tasks that are solvable
  under the same budget*, divided by the number of solvable tasks, x 100. Synthetic market: an
  episode is solvable when a policy that knows every call's realised outcome can solve it within
  budget (exact, :func:`eval.synthetic.clairvoyant_plan`), so a clairvoyant agent scores 100.
  StableToolBench: the paper's exhaustive search (see ``eval.stabletoolbench``). ``None`` where
  solvability is unknown. Counting only solved tasks that are solvable keeps OR <= 100; the
  paper's wording ("the number of tasks solved by the agent and the total number of tasks that
  are solvable") and its Table 1 (OR / PR = 0.82 on every row) count *every* solved task. The two
  agree unless a task is solved that the solvability search missed: impossible on the synthetic
  markets (a solved episode is solvable by construction), possible on StableToolBench, where
  ``solved_not_solvable`` counts such episodes (their scores summed), so a reader sees when they differ.
* **decision_regret** (synthetic market, enforcing methods): per gate decision, the optimal
  success probability ``V*(needs left, budget left)`` minus the value of the decision taken
  (exact DP, :mod:`eval.optimal`), averaged per episode, then over episodes. 0 for ``optimal``.
  The agent-independent measure of an oracle. A crashed episode's decisions up to the crash count;
  one that crashed before any decision has no regret, and then ``decision_regret_n`` (episodes the
  mean is over) is below ``n`` and the table's Regret cell says so (``0.012 (n=5/6)``).
* A **crashed** episode (an exception in the harness, agent or oracle) counts as failed and
  infeasible, and is listed by task id under ``crashed``.
* **WR** win rate against a named reference method, x 100: a task is a win when the method's
  score is higher than the reference's on the same task and seed, or both pass equally and the
  method spent less. Two failures are a tie, never a win (as in StableToolBench's SoWR, which
  reports ties separately).
* **FR** feasible rate: share of tasks with cost <= budget, x 100.
* **AC** average cost per task; **AP** average price per executed call (all calls pooled).
* **time_ratio**: the method's end-to-end wall time over Raw's, both measured in this run with
  the same worker count; **latency_ratio**: mean per-task wall time (under that concurrency)
  over Raw's; **token_ratio**: agent + oracle tokens over Raw's.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from eval.results import EpisodeResult

__all__ = ["compute_metrics", "group_pass_rates", "paired_pr_differences"]


def _regret_split(rs: list[Any]) -> dict[str, float | None]:
    """Decision regret pooled over every audited decision, by kind: what the acceptances lost and
    what the rejections lost, and the share of decisions that were rejections."""
    sums = {k: sum(float(r.extra.get(k, 0.0) or 0.0) for r in rs)
            for k in ("regret_accept_sum", "regret_accept_n", "regret_reject_sum", "regret_reject_n")}
    n = sums["regret_accept_n"] + sums["regret_reject_n"]
    if not n:
        return {}
    by_reason: dict[str, list[float]] = {}
    for r in rs:
        for reason, (total, count) in (r.extra.get("regret_by_reason") or {}).items():
            acc = by_reason.setdefault(reason, [0.0, 0])
            acc[0] += float(total)
            acc[1] += int(count)
    by_n = sum(c for _, c in by_reason.values())
    return {
        # reason -> mean regret and the share of the decisions with a recorded reason that had it
        # (episodes saved before reasons were recorded have none and are left out of this split)
        "regret_by_reason": {k: {"regret": round(t / c, 5), "share": round(c / by_n, 4)}
                             for k, (t, c) in sorted(by_reason.items()) if c},
        "regret_per_accept": round(sums["regret_accept_sum"] / sums["regret_accept_n"], 5) if sums["regret_accept_n"] else None,
        "regret_per_reject": round(sums["regret_reject_sum"] / sums["regret_reject_n"], 5) if sums["regret_reject_n"] else None,
        "reject_share": round(sums["regret_reject_n"] / n, 4),
    }


def _pct(x: float) -> float:
    return round(100.0 * x, 2)


def compute_metrics(
    results: Iterable[EpisodeResult],
    *,
    reference: str | None = "prompt",
    ratio_base: str = "raw",
    e2e_seconds: Mapping[str, float] | None = None,
) -> dict[str, dict[str, Any]]:
    by_method: dict[str, list[EpisodeResult]] = defaultdict(list)
    for r in results:
        by_method[r.method].append(r)
    ref_index = {(r.task_id, r.seed): r for r in by_method.get(reference or "", [])}
    out: dict[str, dict[str, Any]] = {}
    for method, rs in by_method.items():
        n = len(rs)
        solvable = [r for r in rs if r.solvable]
        known = any(r.solvable is not None for r in rs)
        calls = sum(r.n_calls for r in rs)
        wins = 0
        compared = 0
        for r in rs:
            ref = ref_index.get((r.task_id, r.seed))
            if ref is None:
                continue
            compared += 1
            wins += r.score > ref.score or (r.score == ref.score > 0 and r.cost < ref.cost)
        regrets = [r.extra["decision_regret"] for r in rs if r.extra.get("decision_regret") is not None]
        latencies = [r.wall_s for r in rs]
        decisions = [d for r in rs for d in r.decision_ms]
        out[method] = {
            "n": n,
            "PR": _pct(sum(r.score for r in rs) / n) if n else None,
            "PR_std_over_judge_runs": _run_std(rs),
            "OR": _pct(sum(r.score for r in solvable) / len(solvable)) if known and solvable else None,
            # Solved on tasks counted unsolvable: left out of OR's numerator, counted in the paper's.
            "solved_not_solvable": round(sum(r.score for r in rs if r.solvable is False), 3) if known else None,
            "WR": _pct(wins / compared) if compared and method != reference else None,
            "FR": _pct(sum(r.feasible for r in rs) / n) if n else None,
            "AC": round(sum(r.cost for r in rs) / n, 3) if n else None,
            "AP": round(sum(r.price_sum for r in rs) / calls, 3) if calls else None,
            "e2e_s": round((e2e_seconds or {}).get(method, sum(latencies)), 4),
            "latency_s": round(statistics.fmean(latencies), 5) if latencies else None,
            "tokens": sum(r.agent_tokens + r.oracle_tokens for r in rs),
            "oracle_tokens": sum(r.oracle_tokens for r in rs),
            "calls_per_task": round(calls / n, 3) if n else None,
            "rejections_per_task": round(sum(r.n_rejected for r in rs) / n, 3) if n else None,
            "oracle_errors": sum(r.oracle_errors for r in rs),
            "decision_ms_mean": round(statistics.fmean(decisions), 4) if decisions else None,
            "decision_ms_p95": round(_quantile(decisions, 0.95), 4) if decisions else None,
            "overspend_tasks": sum(not r.feasible for r in rs),
            # Failed but within budget with >= 20% of it unspent: the agent stopped while it could still pay.
            "failed_with_budget_left": _pct(sum(r.feasible and r.score == 0 and r.cost <= 0.8 * r.budget for r in rs)
                                            / max(1, sum(r.feasible and r.score == 0 for r in rs))),
            **_oracle_stats(rs, len(decisions)),
            "opened_with_rejection": _pct(sum(bool(r.extra.get("opened_with_rejection")) for r in rs) / n) if n else None,
            "decision_regret": round(statistics.fmean(regrets), 5) if regrets else None,
            # Episodes the mean is over, and crashed ones without a regret (crashed before any decision):
            # the table marks Regret "n=k/n" then.
            "decision_regret_n": len(regrets),
            "decision_regret_crashed_without": sum(r.crashed and r.extra.get("decision_regret") is None for r in rs),
            **_regret_split(rs),
            "proposed_calls": sum(r.proposed_calls for r in rs),
            "answered_calls": sum(r.answered_calls for r in rs),
            "episode_errors": sum(r.crashed for r in rs),
            # Ended because the agent model's context was full (no answer; not a crash).
            "context_full": sum(bool(r.extra.get("context_full")) for r in rs),
            # Ended at the real-LLM agent's --max-turns model calls (no answer; not a crash).
            "turn_limit": sum(bool(r.extra.get("turn_limit")) for r in rs),
            "crashed": sorted(r.task_id for r in rs if r.crashed),
        }
    base = out.get(ratio_base)
    for m in out.values():
        for key, src in (("time_ratio", "e2e_s"), ("latency_ratio", "latency_s"), ("token_ratio", "tokens")):
            b = base.get(src) if base else None
            m[key] = round(m[src] / b, 3) if b else None
    return out


def _oracle_stats(rs: Sequence[EpisodeResult], decisions: int) -> dict[str, Any]:
    """Per-decision cost of a planning oracle, from the usage its decisions reported."""
    sums: dict[str, float] = defaultdict(float)
    for r in rs:
        for key, value in (r.extra.get("oracle_usage") or {}).items():
            sums[key] += value
    if not sums or not decisions:
        return {}
    hits = sums.get("cache_hit", 0.0) + sums.get("last_call_hit", 0.0)
    return {
        "rollout_steps_per_decision": round(sums.get("rollout_steps", 0.0) / decisions, 3),
        "policy_tokens": int(sums.get("policy_tokens", 0.0)),
        "world_model_tokens": int(sums.get("world_model_tokens", 0.0)),
        "cache_hit_rate": round(hits / decisions, 4),
        "model_errors": int(sums.get("model_error", 0.0)),
        # rollouts that ended on a reply cut by --rollout-max-tokens before a whole call
        "rollouts_capped": int(sums.get("rollout_capped", 0.0)),
        # INTENT's blacklist: the share of predicted steps with p < delta, and tools hidden per episode.
        "below_delta_rate": (round(sums.get("below_delta", 0.0) / sums["predictor_items"], 4)
                             if sums.get("predictor_items") else None),
        "blacklisted_per_task": round(sums.get("blacklisted", 0.0) / len(rs), 3) if "blacklisted" in sums else None,
        "planning_ms_per_task": round(sums.get("planning_ms", 0.0) / len(rs), 3) if "planning_ms" in sums else None,
    }


def _run_std(rs: Sequence[EpisodeResult]) -> float | None:
    """SoPR's spread: the standard deviation over judge runs of each run's pass rate (x 100). A crashed
    episode was never judged and scores 0 in every run (as in PR); without it a single crash dropped the spread."""
    judged = [r for r in rs if not r.crashed]
    runs = [r.extra.get("judge_runs") for r in judged]
    if not judged or any(not x for x in runs):
        return None
    k = min(len(x) for x in runs)
    per_run = [sum((x[i] if r.feasible else 0.0) for x, r in zip(runs, judged)) / len(rs) for i in range(k)]
    mean = sum(per_run) / k
    return round(100 * (sum((p - mean) ** 2 for p in per_run) / k) ** 0.5, 2)


def group_pass_rates(results: Iterable[EpisodeResult]) -> dict[str, dict[str, float]]:
    """PR per (method, group), e.g. StableToolBench's six groups."""
    acc: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for r in results:
        acc[r.method][r.group or "all"].append(r.score)
    return {m: {g: _pct(sum(v) / len(v)) for g, v in sorted(gs.items())} for m, gs in acc.items()}


def _quantile(values: Sequence[float], q: float) -> float:
    s = sorted(values)
    if not s:
        return 0.0
    k = (len(s) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def _paired(results: Iterable[EpisodeResult], base: str, value: Callable[[EpisodeResult], float | None], *,
            seed: int, resamples: int, tag: str) -> dict[str, tuple[list[float], list[float]]]:
    """Per method: its task-by-task differences from ``base`` (tasks where both have a value)
    and the sorted means of ``resamples`` seeded bootstrap resamples of them."""
    import random

    by_method: dict[str, dict[tuple[str, int], float]] = defaultdict(dict)
    for r in results:
        v = value(r)
        if v is not None:
            by_method[r.method][(r.task_id, r.seed)] = float(v)
    ref = by_method.get(base)
    if not ref:
        return {}
    out: dict[str, tuple[list[float], list[float]]] = {}
    for method, values in by_method.items():
        if method == base:
            continue
        keys = sorted(k for k in values if k in ref)
        if not keys:
            continue
        diffs = [values[k] - ref[k] for k in keys]
        rng = random.Random(f"{seed}:{method}:{base}{tag}")
        n = len(diffs)
        out[method] = (diffs, sorted(sum(diffs[rng.randrange(n)] for _ in range(n)) / n for _ in range(resamples)))
    return out


def paired_pr_differences(results: Iterable[EpisodeResult], base: str, *, seed: int = 0, resamples: int = 2000
                          ) -> dict[str, dict[str, Any]]:
    """Each method's PR minus ``base``'s on the same tasks, with a paired bootstrap 95% interval.

    Paired over tasks (both methods ran the same task with the same seed), so the interval is
    much narrower than two independent PR intervals; the resampling is seeded, so the same
    results give the same interval. Methods without ``base`` on a task skip that task.
    """
    out: dict[str, dict[str, Any]] = {}
    for method, (diffs, means) in _paired(results, base, lambda r: r.score, seed=seed, resamples=resamples,
                                          tag="").items():
        out[method] = {
            "base": base, "n": len(diffs), "diff": _pct(sum(diffs) / len(diffs)),
            "ci95": [_pct(means[int(0.025 * resamples)]), _pct(means[int(0.975 * resamples) - 1])],
            "better": sum(d > 0 for d in diffs), "worse": sum(d < 0 for d in diffs),
        }
    return out


def paired_regret_differences(results: Iterable[EpisodeResult], base: str, *, seed: int = 0,
                              resamples: int = 2000) -> dict[str, dict[str, Any]]:
    """Each method's decision regret minus ``base``'s on the same tasks (the table's Regret is the
    mean of the episodes' regrets), with a paired bootstrap 95% interval; lower is better. Tasks
    where either method made no audited decision are left out."""
    out: dict[str, dict[str, Any]] = {}
    for method, (diffs, means) in _paired(results, base, lambda r: r.extra.get("decision_regret"), seed=seed,
                                          resamples=resamples, tag=":regret").items():
        out[method] = {
            "base": base, "n": len(diffs), "diff": round(sum(diffs) / len(diffs), 5),
            "ci95": [round(means[int(0.025 * resamples)], 5), round(means[int(0.975 * resamples) - 1], 5)],
            "lower": sum(d < 0 for d in diffs), "higher": sum(d > 0 for d in diffs),
        }
    return out
