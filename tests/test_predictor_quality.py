"""The light intention predictor against counting baselines, by-task splits, and the report's metrics."""

from __future__ import annotations

import json
import random
import zlib

import numpy as np
import pytest

from intent.logs import StepRecord
from training.predictor_report import auroc, predictor_report, split_tasks
from worldmodel.predictors import EmpiricalMeanPredictor, HashedLogisticPredictor, ToolTokenFrequencyPredictor

ENTITIES = [f"city{i}" for i in range(12)]


def _good(tool: str, entity: str) -> bool:
    # Which provider is reliable depends on the entity (as market v2's regions): per-tool counting cannot see it.
    return (zlib.crc32(entity.encode()) % 2 == 0) == (tool == "weather_plus_forecast")


def _records(n_tasks: int, seed: int) -> list[StepRecord]:
    rng = random.Random(seed)
    out = []
    for t in range(n_tasks):
        entity = rng.choice(ENTITIES)
        for step in range(3):
            tool = rng.choice(["weather_plus_forecast", "weather_standard_forecast", "weather_free_forecast"])
            p = 0.15 if tool == "weather_free_forecast" else (0.9 if _good(tool, entity) else 0.3)
            z = int(rng.random() < p)
            out.append(StepRecord(task_id=f"t{t}", step=step, call_id=f"t{t}-{step}", query="q",
                                  reasoning=f"I need the weather in {entity}", tool=tool, args={"city": entity},
                                  price=10.0, decision="accept", status="ok", artifact={"z": z},
                                  spent=10.0, remaining=40.0, budget=50.0))
    return out


def test_hashed_predictor_learns_provider_by_argument_beyond_counting(tmp_path):
    report = predictor_report(_records(400, 0), seed=0, out=tmp_path)
    s = report["scores"]
    assert report["split"]["test_examples"] >= 200
    assert s["hashed"]["auroc"] >= max(s["tool_frequency"]["auroc"], s["tool_token_frequency"]["auroc"]) + 0.1
    fit = report["split"]["fit"]  # scaling never makes the held-out training tasks worse
    assert fit["dev_ece"] <= fit["dev_ece_unscaled"] + 1e-12 and fit["dev_nll"] <= fit["dev_nll_unscaled"] + 1e-12
    for name in ("predictor_report.json", "split.json", "reliability.png", "p_histogram.png"):
        assert (tmp_path / name).stat().st_size > 0
    split = json.loads((tmp_path / "split.json").read_text())
    assert split["by"] == "task" and not set(split["train"]) & set(split["test"])


def test_a_negative_seed_is_refused_naming_the_flag(tmp_path):
    # Was: numpy's "expected non-negative integer" traceback out of `intent train report --seed -1`.
    from intent.errors import UsageError

    with pytest.raises(UsageError, match=r"--seed must be an integer >= 0, got -1"):
        predictor_report(_records(40, 0), seed=-1, out=tmp_path)


def test_fit_holds_out_tasks_not_records():
    recs = _records(60, 1)
    items = [(r.reasoning, r.tool, r.args) for r in recs]
    labels = [r.artifact["z"] for r in recs]
    model = HashedLogisticPredictor(seed=0).fit(items, labels, groups=[r.task_id for r in recs])
    assert model.split["by"] == "task" and model.split["dev_tasks"] == 12
    assert model.split["dev_examples"] == 36  # 12 whole tasks of 3 calls: no task is split across train and dev
    assert model.split["l2"] in model.l2_grid
    with pytest.raises(ValueError, match="one entry per call"):
        HashedLogisticPredictor().fit(items, labels, groups=["t0"])


def test_split_tasks_is_disjoint_and_refuses_too_few_tasks():
    train, test = split_tasks([f"t{i % 50}" for i in range(500)], seed=3)
    assert len(test) == 10 and len(train) == 40 and not train & test
    with pytest.raises(ValueError, match="at least 5"):
        split_tasks(["a", "b"], seed=0)


def test_auroc_matches_a_pairwise_count_with_ties():
    rng = np.random.default_rng(0)
    p = rng.integers(0, 5, 200) / 4.0  # many ties
    y = (rng.random(200) < 0.3 + 0.4 * p).astype(int)
    pos, neg = p[y == 1], p[y == 0]
    pairwise = ((pos[:, None] > neg[None, :]).sum() + 0.5 * (pos[:, None] == neg[None, :]).sum()) / (len(pos) * len(neg))
    assert auroc(p.tolist(), y.tolist()) == pytest.approx(pairwise)
    assert np.isnan(auroc([0.1, 0.2], [1, 1]))


def test_counting_baselines():
    recs = _records(100, 2)
    freq = EmpiricalMeanPredictor(recs, prior_strength=0.0)
    tok = ToolTokenFrequencyPredictor(recs, prior_strength=0.0)
    assert freq.predict("", "weather_free_forecast", {}) < 0.3
    # An unseen tool sharing the tier word "free" inherits its low frequency (per-tool counting cannot).
    assert tok.predict("", "news_free_headlines", {}) < freq.predict("", "news_free_headlines", {})


def test_split_grows_the_test_side_to_the_example_target():
    ids = [f"t{i // 3}" for i in range(300)]  # 100 tasks of 3 examples
    _, test = split_tasks(ids, seed=0, test_fraction=0.2, min_test_examples=90)
    assert len(test) == 30
    _, capped = split_tasks(ids, seed=0, test_fraction=0.2, min_test_examples=10_000)
    assert len(capped) == 50  # never more than half of the tasks


def test_a_temperature_that_hurts_the_held_out_tasks_is_not_kept(monkeypatch):
    import worldmodel.calibration as calibration

    recs = _records(200, 4)
    items = [(r.reasoning, r.tool, r.args) for r in recs]
    labels = [r.artifact["z"] for r in recs]
    monkeypatch.setattr(calibration, "fit_temperature", lambda logits, y, **kw: 20.0)  # flattens every p to ~0.5
    model = HashedLogisticPredictor(seed=0).fit(items, labels, groups=[r.task_id for r in recs])
    assert model.temperature == 1.0 and model.split["dev_nll"] == model.split["dev_nll_unscaled"]


def test_auroc_grows_with_the_training_fraction():
    from training.predictor_report import auroc_by_fraction

    curve = auroc_by_fraction(_records(400, 5), [1 / 32, 1.0], seed=0, min_test_examples=200)
    small, full = curve["0.03125"], curve["1"]
    assert small["train_tasks"] < full["train_tasks"] and full["auroc"] > small["auroc"] + 0.05


def test_ece_floor_is_the_noise_of_a_calibrated_predictor():
    from training.predictor_report import ece_floor

    p = np.random.default_rng(0).uniform(0.1, 0.9, 500).tolist()
    small, large = ece_floor(p[:100], seed=0), ece_floor(p, seed=0)
    assert 0 < large < small  # more examples, less noise
    assert ece_floor([0.0] * 50 + [1.0] * 50) == 0.0  # certain predictions have no sampling noise


def test_no_temperature_from_too_few_held_out_calls(monkeypatch):
    import worldmodel.calibration as calibration

    recs = _records(200, 6)
    items = [(r.reasoning, r.tool, r.args) for r in recs]
    labels = [r.artifact["z"] for r in recs]
    groups = [r.task_id for r in recs]
    monkeypatch.setattr(calibration, "fit_temperature", lambda logits, y, **kw: 0.9)
    monkeypatch.setattr(calibration, "ece", lambda p, y, n_bins=10: 0.0)

    def fit(min_examples):
        calls = iter([0.1, 0.9] + [0.5] * 10)  # the scaled NLL (asked first) beats the unscaled one
        monkeypatch.setattr(calibration, "nll", lambda p, y: next(calls))
        return HashedLogisticPredictor(seed=0, l2=1e-3, min_calibration_examples=min_examples).fit(
            items, labels, groups=groups)

    assert fit(0).temperature == 0.9  # a temperature that helps on enough held-out calls is kept
    few = fit(10_000)  # ... and refused when they are too few
    assert few.temperature == 1.0 and 0 < few.split["dev_examples"] < 10_000


def test_learned_predictors_fall_back_to_counting_when_logs_hold_one_label(tmp_path):
    from eval.oracle_methods import OracleResources
    from eval.runner import BenchConfig

    recs = [r.model_copy(update={"artifact": {"z": 1}}) for r in _records(20, 7)]
    for choice in ("encoder", "auto"):
        res = OracleResources(BenchConfig(out=str(tmp_path), options={"predictor": choice}), agent_factory=None)
        model = res._build("predictor", recs)
        assert isinstance(model, EmpiricalMeanPredictor) and any("only z=1" in n for n in res.notes)
        assert isinstance(res._build("predictor_encoder", recs), EmpiricalMeanPredictor)


def _miscalibrated(n_tasks: int, seed: int) -> tuple[list, list[int], list[str]]:
    """Calls whose success needs two name tokens *together* (alpha and beta: 0.9, else 0.15).
    A logistic model adds the tokens' weights, so it ranks the calls right but puts the calls with
    one of the two in the middle: too high there, too low for the pairs. One temperature cannot
    fix both ends; an isotonic map can. Each tool name is near-unique (a serial number), so the
    whole-name feature cannot learn each tool's rate."""
    rng = random.Random(seed)
    items, labels, groups = [], [], []
    for t in range(n_tasks):
        for step in range(4):
            a, b = rng.choice(["alpha", "gamma"]), rng.choice(["beta", "delta"])
            tool = f"{a}_svc{rng.randrange(100_000)}_{b}"  # no bigram holds both tokens
            items.append(("call the service", tool, {}))
            labels.append(int(rng.random() < (0.9 if (a, b) == ("alpha", "beta") else 0.15)))
            groups.append(f"t{seed}-{t}")
    return items, labels, groups


def test_isotonic_map_is_monotone_and_pools_small_blocks():
    from worldmodel.calibration import apply_isotonic, fit_isotonic

    rng = np.random.default_rng(0)
    p = rng.uniform(0, 1, 2000)
    y = (rng.uniform(0, 1, 2000) < 0.3 + 0.4 * (p > 0.5)).astype(int)  # a step, not the identity
    xs, ys = fit_isotonic(p, y, min_block=50)
    assert xs == sorted(xs) and ys == sorted(ys) and len(xs) <= 2000 // 50
    mapped = apply_isotonic([0.1, 0.4, 0.6, 0.9], xs, ys)
    assert abs(mapped[0] - 0.3) < 0.08 and abs(mapped[3] - 0.7) < 0.08  # the step's two levels, not p itself
    with pytest.raises(ValueError, match="both classes"):
        fit_isotonic([0.2, 0.4], [1, 1])


def test_isotonic_calibration_is_kept_when_it_wins_out_of_sample_and_lowers_test_ece():
    from worldmodel.calibration import ece, sigmoid

    items, labels, groups = _miscalibrated(700, 0)
    test_items, test_labels, _ = _miscalibrated(500, 1)
    model = HashedLogisticPredictor(seed=0).fit(items, labels, groups=groups)
    assert model.calibration_kind == "isotonic" and model.split["calibration"] == "isotonic"
    assert model.split["isotonic_min_block"] in model.isotonic_blocks
    assert model.split["dev_ece_isotonic_crossfit"] < model.split["dev_ece_unscaled"]
    calibrated = model.predict_batch(test_items)
    temperature_only = sigmoid(np.asarray(model.logits(test_items)) / model.temperature)
    assert ece(calibrated, test_labels, 15) < ece(temperature_only, test_labels, 15) - 0.02
    model.calibrated = False  # the "Uncalibrated" ablation: the raw logistic p
    assert model.predict_batch(test_items) == [float(p) for p in sigmoid(np.asarray(model.logits(test_items)))]


def test_isotonic_calibration_that_does_not_win_out_of_sample_is_not_kept(monkeypatch):
    import worldmodel.calibration as calibration

    items, labels, groups = _miscalibrated(700, 0)
    # A map that sends every p to 0.5 loses to the logistic p on the other half of the held-out tasks.
    monkeypatch.setattr(calibration, "apply_isotonic", lambda p, xs, ys: np.full(len(p), 0.5))
    model = HashedLogisticPredictor(seed=0).fit(items, labels, groups=groups)
    assert model.isotonic is None and model.calibration_kind != "isotonic"


def test_no_isotonic_map_from_too_few_held_out_calls():
    items, labels, groups = _miscalibrated(700, 0)  # ~560 held-out calls: enough for the default
    few = HashedLogisticPredictor(seed=0, min_isotonic_examples=10_000).fit(items, labels, groups=groups)
    assert few.isotonic is None and "dev_ece_isotonic_crossfit" not in few.split
    assert HashedLogisticPredictor(seed=0).fit(items, labels, groups=groups).isotonic is not None


def _tool_only_records(n_tasks: int, seed: int) -> list[StepRecord]:
    # Success depends on the tool alone: counting per tool is all there is to learn.
    rng = random.Random(seed)
    out = []
    for t in range(n_tasks):
        for step in range(3):
            tool = rng.choice(["weather_plus_forecast", "weather_free_forecast"])
            z = int(rng.random() < (0.8 if tool == "weather_plus_forecast" else 0.3))
            out.append(StepRecord(task_id=f"t{t}", step=step, call_id=f"t{t}-{step}", query="q",
                                  reasoning="I need the weather", tool=tool, args={"city": rng.choice(ENTITIES)},
                                  price=10.0, decision="accept", status="ok", artifact={"z": z},
                                  spent=10.0, remaining=40.0, budget=50.0))
    return out


def test_a_missed_target_is_reported_with_its_gap_and_what_was_tried(tmp_path):
    from eval.study import predictor_lines

    missed = predictor_report(_tool_only_records(400, 1), seed=0, out=tmp_path / "missed")
    assert not missed["targets_met"]
    text = "\n".join(predictor_lines(missed))
    assert "**Gap**" in text and f"{missed['auroc_gain_over_best_baseline']:+.3f}" in text
    tried = missed["tried"]
    assert any("hashed logistic" in t for t in tried) and any("temperature scaling" in t for t in tried)
    assert any("encoder" in t for t in tried)
    assert all(f"- {t}" in text for t in tried)

    met = {**missed, "targets": dict.fromkeys(missed["targets"], True), "targets_met": True}
    assert "**Gap**" not in "\n".join(predictor_lines(met))
