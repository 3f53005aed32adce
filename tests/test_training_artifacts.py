"""Trained artefacts as a user loads them back: the saved predictor scores as the trainer measured it,
the world model's directory says which prompt format it was trained on, bad base models and recipes
are one-line errors, and a predictor trained on the evaluated tasks is refused by the benchmark."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from training.data import load_records, triples

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from test_training import logs, tiny_lm  # noqa: E402,F401  (module fixtures reused)


@pytest.mark.slow
@pytest.mark.ml
def test_the_saved_predictor_scores_the_test_split_as_the_trainer_reported(logs, tmp_path):
    # Was: trained (and its temperature fitted) on inputs cut to --max-length (default 128), but loaded by
    # EncoderIntentionPredictor with max_length=256: long inputs were scored on tokens the model never saw,
    # so the oracle's p differed from what report.json / calibration.json measured.
    from worldmodel.calibration import nll
    from worldmodel.predictors import EncoderIntentionPredictor
    from training.train_intention import train_predictor

    tri = triples(load_records(logs))
    out = tmp_path / "pred"
    report = train_predictor(tri, out, max_steps=2, batch_size=8, max_length=16,
                             progress=False)
    test_tasks = set(json.loads((out / "split.json").read_text())["tasks"]["test"])
    test = [t for t in tri if t.task_id in test_tasks]
    for calibrated, key in ((True, "test_calibrated"), (False, "test_uncalibrated")):
        model = EncoderIntentionPredictor(out, calibrated=calibrated)
        probs = model.predict_batch([(t.reasoning, t.tool, t.args) for t in test])
        assert nll(probs, [t.z for t in test]) == pytest.approx(report[key]["nll"], rel=1e-5)
        assert model.max_length == 16
    assert json.loads((out / "calibration.json").read_text())["max_length"] == 16
