"""The StableToolBench market under the guard, and the study pipeline end to end (tiny)."""

from __future__ import annotations

import json

import pytest

from eval.runner import BenchConfig, run_benchmark
from eval.stabletoolbench import StbDataError, resolve_root


def _stb_available() -> bool:
    try:
        resolve_root(None)
    except StbDataError:
        return False
    return True


@pytest.mark.slow
@pytest.mark.skipif(not _stb_available(), reason="StableToolBench data not found (../shared/stabletoolbench)")
def test_stabletoolbench_market_end_to_end(tmp_path):
    cfg = BenchConfig(market="stabletoolbench", methods=["raw", "tracker"], tasks=18, out=str(tmp_path),
                      reference="raw")
    summary = run_benchmark(cfg, progress=False)
    assert "proxy" in summary["config"]["judge"] and "not SoPR" in summary["config"]["judge"]
    assert "schema-environment responses (simulated)" in summary["config"]["market_label"]
    # The budgets bind (Raw overspends on some queries); the guarded tracker never does.
    assert summary["methods"]["raw"]["overspend_tasks"] > 0
    assert summary["methods"]["tracker"]["overspend_tasks"] == 0
    assert set(summary["groups"]["raw"]) <= {"G1_instruction", "G1_category", "G1_tool", "G2_instruction",
                                             "G2_category", "G3_instruction"}
    assert len(summary["groups"]["raw"]) == 6  # the subset keeps every group
    prices = json.loads((tmp_path / "prices.json").read_text())
    assert len(prices["prices"]) == 2470 and prices["meta"]["budget"] == 50  # 2,479 APIs, 2,470 distinct names
    assert 0 < json.loads((tmp_path / "retrieval.json").read_text())["recall_at_k"] <= 1


@pytest.mark.slow
def test_study_pipeline_end_to_end(tmp_path):
    from eval.study import StudyConfig, run_study

    cfg = StudyConfig(out=str(tmp_path), predictor="hashed", main_tasks=12, sweep_tasks=8, price_scales=(0.5, 1.0), budget_scales=(1.0,),
                      gammas=(0.5, 1.5), fractions=(0.5, 1.0), event_rates=(0.0,),
                      main_methods=("raw", "prompt", "tracker", "intent"), progress=False, stb_tasks=12,
                      options={"oracle_train_tasks": 30})
    summary = run_study(cfg)
    report = (tmp_path / "report.md").read_text()
    for needle in ("simulated behaviour model", "paper PR", "## INTENT ablations", "reliability.png", "proxy" if False
                   else "exact ground truth"):
        assert needle in report
    for png in ("relevant_price_scale", "budget_scale", "gamma", "oracle_fraction", "event_rate", "reliability"):
        assert (tmp_path / f"{png}.png").stat().st_size > 1000
    main = summary["main"]["methods"]
    assert main["raw"]["overspend_tasks"] > 0 and main["intent"]["overspend_tasks"] == 0
    if "methods" in summary["stabletoolbench"]:
        stb = summary["stabletoolbench"]["methods"]
        assert "Group-wise PR (proxy)" in report
        assert stb["raw"]["overspend_tasks"] > 0 and stb["intent"]["overspend_tasks"] == 0
    assert set(summary["sweeps"]["gamma"]) == {"0.5", "1.5"}
    cal = summary["calibration"]
    assert cal["split"]["by"] == "task" and cal["split"]["test_examples"] > 0 and cal["temperature"] > 0
    assert {"hashed", "tool_frequency", "tool_token_frequency"} <= set(cal["scores"]) and "AUROC" in report
    assert (tmp_path / "p_histogram.png").stat().st_size > 1000
    assert set(summary["fraction_auroc"]) == {"0.5", "1"} and "training calls | AUROC" in report
    assert "INTENT's blacklist: " in report


def test_the_study_says_whether_the_blacklist_fired():
    from eval.study import blacklist_line

    fired = blacklist_line({"intent": {"below_delta_rate": 0.052, "blacklisted_per_task": 0.5},
                            "intent-no-blacklist": {}})
    assert "5.2% of its predicted steps had p < delta, 0.50 tools hidden per task." in fired
    assert "never fired" not in fired
    silent = blacklist_line({"intent": {"below_delta_rate": 0.0, "blacklisted_per_task": 0.0},
                             "intent-no-blacklist": {}})
    assert "never fired, so intent-no-blacklist makes the same decisions" in silent
    assert "not measured" in blacklist_line({"intent": {}})


@pytest.mark.skipif(not _stb_available(), reason="StableToolBench data not found (../shared/stabletoolbench)")
def test_a_fractional_budget_is_the_one_the_prices_file_records(tmp_path):
    # --budget 12.5 wrote "budget": 12 into OUT/prices.json (int(budget)), and --budget 0.5, a valid
    # budget, stopped the run with "budget must be a positive integer, got 0".
    import json

    from eval.stb_market import StableToolBenchMarket

    for budget, scale in ((12.5, 1.0), (0.5, 1.0), (50.0, 0.5)):
        out = tmp_path / f"{budget}-{scale}"
        market = StableToolBenchMarket(limit=2, out=out, budget=budget, budget_scale=scale)
        recorded = json.loads((out / "prices.json").read_text())["meta"]["budget"]
        assert recorded == market.budget == budget * scale


def test_a_study_with_a_negative_seed_is_refused_before_its_out_directory_is_made(tmp_path):
    # Was: OUT made, then the first run refused --seed -1: an empty OUT left behind.
    from eval.study import StudyConfig, run_study
    from intent.errors import UsageError

    with pytest.raises(UsageError, match=r"^--seed must be an integer >= 0, got -1$"):
        run_study(StudyConfig(out=str(tmp_path / "study"), seed=-1, progress=False))
    assert not (tmp_path / "study").exists()
