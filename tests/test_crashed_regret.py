"""A crashed episode's decision regret: its decisions up to the crash count, and the table says over how
many episodes Regret is when a crashed one has none (Regret averaged only the episodes that did not crash,
so an oracle that crashes on hard tasks looked better)."""

from __future__ import annotations

from eval.report import markdown_table
from eval.results import ResultStore
from eval.runner import BenchConfig, run_benchmark, sim_agent_factory

CRASH_AFTER = {"syn-7-0004": 3, "syn-7-0003": 1}  # model calls before the crash (the first: before any decision)


def _crashing_factory():
    base = sim_agent_factory()

    def factory(env, seed):
        model = base(env, seed)
        if env is not None and env.task_id in CRASH_AFTER:
            limit, calls = CRASH_AFTER[env.task_id], {"n": 0}

            class Crashy(type(model)):
                def _generate(self, *a, **k):
                    calls["n"] += 1
                    if calls["n"] >= limit:
                        raise RuntimeError("boom")
                    return super()._generate(*a, **k)

            model.__class__ = Crashy
        return model

    return factory


def test_regret_counts_decisions_up_to_a_crash_and_says_over_how_many_episodes(tmp_path):
    summary = run_benchmark(BenchConfig(methods=("raw", "tracker"), tasks=6, workers=1, seed=7, out=str(tmp_path)),
                            agent_factory=_crashing_factory(), progress=False)
    row = summary["methods"]["tracker"]
    assert row["episode_errors"] == 2
    eps = ResultStore(tmp_path / "episodes.jsonl").load(repair=False)
    late = next(e for e in eps if e.method == "tracker" and e.task_id == "syn-7-0004")
    assert late.error and late.extra.get("decisions_audited", 0) > 0
    assert late.extra["decision_regret"] is not None  # its decisions before the crash were audited
    early = next(e for e in eps if e.method == "tracker" and e.task_id == "syn-7-0003")
    assert early.error and early.extra.get("decision_regret") is None
    assert row["decision_regret_crashed_without"] == 1
    n_regret = row["decision_regret_n"]
    assert n_regret < row["n"]
    assert f"(n={n_regret}/{row['n']})" in markdown_table(summary)
    assert f"(n={n_regret}/{row['n']})" in (tmp_path / "results.md").read_text()
