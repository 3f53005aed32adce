"""World-model and predictor backends: conformance, the OpenAI-compatible client, replay, calibration."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest

from worldmodel.calibration import ece, fit_temperature, nll, reliability_bins, sigmoid
from worldmodel.conformance import check_predictor, check_world_model
from worldmodel.formats import canonical_args, parse_judge, predictor_text, world_model_prompt
from worldmodel.openai_compat import OpenAICompatibleWorldModel
from worldmodel.predictors import EmpiricalMeanPredictor, HashedLogisticPredictor, OptimisticPredictor
from worldmodel.protocols import ModelError
from worldmodel.replay import ReplayWorldModel, label_of

RECORDS = [
    {"decision": "accept", "status": "ok", "tool": "get_weather", "observation": '{"city": "Bergen", "t": 3}',
     "artifact": {"z": 1}, "reasoning": "weather", "args": {"city": "Bergen"}},
    {"decision": "accept", "status": "ok", "tool": "get_weather", "observation": "503 Service Unavailable",
     "artifact": {"z": 0}, "reasoning": "weather", "args": {"city": "Oslo"}},
    {"decision": "reject", "status": "rejected", "tool": "get_weather", "observation": "", "artifact": None},
]


class _Handler(BaseHTTPRequestHandler):
    mode = "ok"
    hits = 0

    def log_message(self, *a):
        pass

    def do_POST(self):
        type(self).hits += 1
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        mode = type(self).mode
        if mode == "slow":
            time.sleep(1.0)
        if mode == "flaky" and type(self).hits == 1:
            self.send_response(503)
            self.end_headers()
            return
        if mode == "bad_request":
            self.send_response(400)
            self.end_headers()
            self.wfile.write(b"bad")
            return
        payload = ({"nothing": "here"} if mode == "malformed" else
                   {"choices": [{"message": {"content": "SIM:" + body["messages"][-1]["content"][:20]}}],
                    "usage": {"total_tokens": 42}})
        data = json.dumps(payload).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


@pytest.fixture()
def server():
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    _Handler.hits = 0
    yield f"http://127.0.0.1:{srv.server_address[1]}/v1"
    srv.shutdown()


def test_openai_compatible_world_model_happy_path_and_conformance(server):
    _Handler.mode = "ok"
    wm = OpenAICompatibleWorldModel(server, "wm", timeout=2, retries=0)
    text, tokens = wm.simulate_with_usage("get_weather", {"city": "Oslo"}, satisfied=True)
    assert text.startswith("SIM:Tool: get_weather") and tokens == 42
    check_world_model(wm)


def test_openai_compatible_errors(server):
    _Handler.mode = "malformed"
    with pytest.raises(ModelError, match="malformed"):
        OpenAICompatibleWorldModel(server, "wm", retries=2, backoff=0).simulate("t", {})
    assert _Handler.hits == 1  # a malformed reply is not retried
    _Handler.mode, _Handler.hits = "slow", 0
    with pytest.raises(ModelError, match="failed"):
        OpenAICompatibleWorldModel(server, "wm", timeout=0.2, retries=1, backoff=0).simulate("t", {})
    assert _Handler.hits == 2  # one retry after the timeout
    _Handler.mode, _Handler.hits = "flaky", 0
    assert OpenAICompatibleWorldModel(server, "wm", retries=1, backoff=0).simulate("t", {}).startswith("SIM:")
    _Handler.mode = "bad_request"
    with pytest.raises(ModelError, match="HTTP 400"):
        OpenAICompatibleWorldModel(server, "wm", retries=3, backoff=0).simulate("t", {})
    with pytest.raises(ModelError, match="failed"):
        OpenAICompatibleWorldModel("http://127.0.0.1:9/v1", "wm", timeout=0.5, retries=0).simulate("t", {})
    with pytest.raises(ValueError, match="http"):
        OpenAICompatibleWorldModel("localhost:8000", "wm")


def test_replay_world_model_filters_by_z_and_grounds():
    wm = ReplayWorldModel(RECORDS)
    assert json.loads(wm.simulate("get_weather", {"city": "Oslo"}, satisfied=True)) == {"city": "Oslo", "t": 3}
    assert wm.simulate("get_weather", {"city": "Oslo"}, satisfied=False) == "503 Service Unavailable"
    assert "tool" in json.loads(wm.simulate("unseen", {"a": 1}, satisfied=True)) and wm.fallbacks == 1
    assert len(wm) == 2 and label_of(RECORDS[0]) == 1
    check_world_model(wm)
    check_world_model(ReplayWorldModel(RECORDS, temperature=1.0, seed=3))


def test_predictors_conform_and_learn():
    check_predictor(OptimisticPredictor())
    emp = EmpiricalMeanPredictor(RECORDS, prior_strength=0.0)
    assert emp.predict("", "get_weather", {}) == 0.5 and emp.predict("", "unseen", {}) == 0.5
    check_predictor(emp)
    rng = np.random.default_rng(0)
    items, labels = [], []
    for i in range(400):
        good = rng.random() < 0.5
        tool = "pro_lookup" if good else "free_lookup"
        items.append((f"I need item {i % 7}", tool, {"q": f"v{i % 5}"}))
        labels.append(int(rng.random() < (0.9 if good else 0.2)))
    model = HashedLogisticPredictor(epochs=200).fit(items, labels)
    assert model.predict("I need item 1", "pro_lookup", {"q": "v1"}) > model.predict("I need item 1", "free_lookup",
                                                                                      {"q": "v1"})
    check_predictor(model)
    with pytest.raises(ValueError, match="one class"):
        HashedLogisticPredictor().fit(items[:5], [1] * 5)


def test_temperature_scaling_lowers_nll_on_a_miscalibrated_set():
    rng = np.random.default_rng(1)
    true_logits = rng.normal(0, 1.5, 4000)
    labels = (rng.random(4000) < sigmoid(true_logits)).astype(int)
    overconfident = true_logits * 4.0
    t = fit_temperature(overconfident, labels)
    assert 3.0 < t < 5.5
    assert nll(sigmoid(overconfident / t), labels) < nll(sigmoid(overconfident), labels)
    with pytest.raises(ValueError, match="both classes"):
        fit_temperature([0.1, 0.2], [1, 1])


def test_ece_on_a_hand_checked_example():
    # bins of width 0.5: [0, .5) holds p=.2,.4 (conf .3, acc .5); [.5, 1] holds p=.6,.8,1.0 (conf .8, acc 2/3)
    probs, labels = [0.2, 0.4, 0.6, 0.8, 1.0], [0, 1, 1, 0, 1]
    assert ece(probs, labels, n_bins=2) == pytest.approx(2 / 5 * 0.2 + 3 / 5 * (0.8 - 2 / 3))
    assert [n for *_, n in reliability_bins(probs, labels, 2)] == [2, 3]


def test_formats_are_shared_and_stable():
    assert canonical_args({"b": 1, "a": "x"}) == '{"a":"x","b":1}' == canonical_args('{"b": 1, "a": "x"}')
    assert "Condition: the call succeeds" in world_model_prompt("t", {}, True)
    assert "Condition" not in world_model_prompt("t", {}, None)
    assert predictor_text("  I  need\nx ", "t", {"a": 1}) == 'Intention: I need x\nCall: t({"a":1})'
    assert (parse_judge("YES, it did"), parse_judge("no."), parse_judge("maybe")) == (1, 0, None)
