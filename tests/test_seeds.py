"""`intent seeds`: one method against two others over several bench runs, read from each run's results.json."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from eval.seeds import main
from intent.errors import UsageError


def _run(root: Path, seed: int, d_pr: float, ci: list[float], d_regret: float, rci: list[float], *,
         market: str = "synthetic-v2", methods: tuple[str, ...] = ("tracker", "mco", "intent")) -> Path:
    run = root / f"s{seed}"
    run.mkdir()
    pr = {"tracker": 30.0 + seed, "mco": 31.0 + seed, "intent": 30.0 + seed + d_pr}
    results = {
        "config": {"market": market, "agent": "sim-llm", "tasks": 500, "seed": seed},
        "methods": {m: {"PR": pr[m], "decision_regret": {"tracker": 0.18, "mco": 0.14, "intent": 0.12}[m]}
                    for m in methods},
        "paired": {"tracker": {"intent": {"diff": d_pr, "ci95": ci}}},
        "paired_regret": {"mco": {"intent": {"diff": d_regret, "ci95": rci}}},
    }
    (run / "results.json").write_text(json.dumps(results))
    return run


def test_the_table_and_its_counts_come_from_each_runs_results(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    runs = [_run(tmp_path, 0, 3.0, [0.0, 5.8], -0.015, [-0.025, -0.006]),
            _run(tmp_path, 11, 5.0, [1.2, 8.6], -0.026, [-0.035, -0.016]),
            _run(tmp_path, 12, 2.2, [-0.4, 4.8], 0.004, [-0.002, 0.011])]
    out = tmp_path / "out"
    assert main([*map(str, runs), "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "| 11 | 41.0 | 42.0 | 46.0 | +5.0 [+1.2, +8.6] | 0.18 / 0.14 / 0.12 | -0.026 [-0.035, -0.016] |" in text
    assert "mean +3.40 points; at least +5 on 1 of 3 runs; interval above 0 on 1 of 3." in text
    assert "decision regret: interval below 0 on 2 of 3 runs." in text
    assert {p.name for p in out.iterdir()} == {"seeds-intent.md", "seeds-intent.json", "seeds-intent.png"}
    assert json.loads((out / "seeds-intent.json").read_text())["rows"][2]["d_regret"] == 0.004


def test_runs_that_cannot_be_read_together_are_refused_by_name(tmp_path: Path) -> None:
    one = _run(tmp_path, 0, 3.0, [0.0, 5.8], -0.015, [-0.025, -0.006])
    other_market = _run(tmp_path, 1, 1.0, [-1.0, 3.0], -0.01, [-0.02, 0.0], market="synthetic")
    with pytest.raises(UsageError, match="differ in market, agent or task count"):
        main([str(one), str(other_market), "--out", str(tmp_path / "o")])
    no_mco = _run(tmp_path, 2, 1.0, [-1.0, 3.0], -0.01, [-0.02, 0.0], methods=("tracker", "intent"))
    with pytest.raises(UsageError, match=r"s2: method 'mco' is not in this run"):
        main([str(no_mco), "--out", str(tmp_path / "o")])
    with pytest.raises(UsageError, match=r"nowhere has no results.json"):
        main([str(tmp_path / "nowhere")])
    with pytest.raises(UsageError, match="must differ"):
        main([str(one), "--base", "intent"])


def test_a_missing_regret_figure_names_the_bases_the_runner_computes_and_those_present(tmp_path: Path) -> None:
    # The error said to add the method to --methods, which cannot help: the runner computes decision-regret
    # differences only against tracker and mco (eval/runner.py _regret_bases).
    run = _run(tmp_path, 0, 3.0, [0.0, 5.8], -0.015, [-0.025, -0.006])
    results = json.loads((run / "results.json").read_text())
    results["methods"]["prompt"] = {"PR": 25.0, "decision_regret": None}
    (run / "results.json").write_text(json.dumps(results))
    with pytest.raises(UsageError) as err:
        main([str(run), "--regret-base", "prompt", "--out", str(tmp_path / "o")])
    text = str(err.value)
    assert "--regret-base 'prompt'" in text and "only against tracker and mco" in text
    assert "this run has regret figures against: mco" in text
    assert "'prompt' in --methods" not in text  # the old advice, which computed nothing more


def test_the_same_run_twice_or_two_runs_of_one_seed_are_refused_by_path(tmp_path: Path) -> None:
    one = _run(tmp_path, 0, 3.0, [0.0, 5.8], -0.015, [-0.025, -0.006])
    with pytest.raises(UsageError, match=rf"{one} is given twice"):
        main([str(one), str(tmp_path / "." / "s0"), "--out", str(tmp_path / "o")])
    again = tmp_path / "again"
    again.mkdir()
    (again / "s0").mkdir()
    (again / "s0" / "results.json").write_text((one / "results.json").read_text())
    with pytest.raises(UsageError, match=rf"{one} and {again / 's0'} are both seed 0"):
        main([str(one), str(again / "s0"), "--out", str(tmp_path / "o")])


def test_a_method_without_a_pr_is_shown_as_a_dash(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    # A method that ran no episode has PR None in results.json: the table raised TypeError formatting it.
    run = _run(tmp_path, 0, 3.0, [0.0, 5.8], -0.015, [-0.025, -0.006])
    results = json.loads((run / "results.json").read_text())
    results["methods"]["mco"]["PR"] = None
    results["methods"]["mco"]["decision_regret"] = None
    (run / "results.json").write_text(json.dumps(results))
    assert main([str(run), "--out", str(tmp_path / "o")]) == 0
    assert "| 0 | 30.0 | – | 33.0 | +3.0 [+0.0, +5.8] | 0.18 / – / 0.12 |" in capsys.readouterr().out
