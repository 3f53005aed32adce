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
from intent.errors import UsageError
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
        try:
            self.send_response(200)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the "slow" mode's client timed out and left, as the test means it to (no traceback in the log)


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
    # The client gave up on its retry after 0.2 s; on a loaded machine the server's thread may
    # not have read that request yet, so wait (bounded) until it has, then count.
    deadline = time.monotonic() + 10.0
    while _Handler.hits < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
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


@pytest.mark.parametrize("temperature", [0.0, 1.0, 0.5])
def test_a_replayed_failure_stays_about_the_entity_it_was_about(temperature):
    # A logged failure that answered about the wrong city, re-targeted at the call's arguments, read as the
    # right answer: MCO's rollouts then saw cheap unreliable providers succeed far more than they do.
    logs = [{"decision": "accept", "status": "ok", "tool": "weather_lite", "z": 0,
             "observation": json.dumps({"city": "Lima", "temp_c": 14})}]
    wm = ReplayWorldModel(logs, temperature=temperature, seed=0)
    assert json.loads(wm.simulate("weather_lite", {"city": "Oslo"}))["city"] == "Lima"
    assert json.loads(wm.simulate("weather_lite", {"city": "Oslo"}, satisfied=False))["city"] == "Lima"
    ok = ReplayWorldModel([{**logs[0], "z": 1, "observation": json.dumps({"city": "Paris", "temp_c": 21})}],
                          temperature=temperature)
    assert json.loads(ok.simulate("weather_lite", {"city": "Oslo"}))["city"] == "Oslo"  # a success is grounded


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


# ------------------------------------------------------------------ replay: nested payloads, temperature
def _composite_record():
    """A real composite ("bundle") observation of the synthetic executor, as the guard logs it."""
    from eval.synthetic import SyntheticEnvironment, generate_tasks

    for task in generate_tasks(20, 0):
        for spec in task.tools:
            if len(spec.covers) < 2:
                continue
            args = {k: v for n in sorted(spec.covers) for k, v in task.canonical_args[n].items()}
            env = SyntheticEnvironment(task, 0)
            for _ in range(6):
                obs = env.call(spec.name, args)
                if obs.kind == "ok" and len(obs.satisfied) == len(spec.covers):
                    record = {"decision": "accept", "status": "ok", "tool": spec.name, "observation": obs.text,
                              "artifact": {"z": 1}, "args": args}
                    return record, task, spec
    raise AssertionError("no successful composite call in the first 20 synthetic tasks")


def test_replayed_composite_observation_reads_as_success_for_new_arguments():
    from eval.agents.simulated import NeedView, looks_successful
    from eval.synthetic.domains import DOMAINS

    record, task, spec = _composite_record()
    assert "results" in json.loads(record["observation"])  # nested: one sub-payload per need
    new_args, needs = {}, []
    for n in sorted(spec.covers):
        need = task.need(n)
        other = next(e for e in DOMAINS[need.domain].entities if dict(e) != task.canonical_args[n])
        new_args.update(other)
        needs.append(NeedView(n, need.domain, dict(other), (spec.name,)))
    wm = ReplayWorldModel([record])
    text = wm.simulate(spec.name, new_args, satisfied=True)
    assert all(looks_successful(n, text) for n in needs), text
    # every field named like an argument, at any depth, now holds the new argument
    def fields(node):
        if isinstance(node, dict):
            for k, v in node.items():
                yield from ([(k, v)] if not isinstance(v, (dict, list)) else fields(v))
        elif isinstance(node, list):
            for v in node:
                yield from fields(v)

    named = [(k, v) for k, v in fields(json.loads(text)) if k in new_args]
    assert named and all(v == new_args[k] for k, v in named)


def test_retargeting_recurses_into_lists_and_keeps_sub_objects():
    wm = ReplayWorldModel([{"decision": "accept", "status": "ok", "tool": "t", "artifact": {"z": 1},
                            "observation": json.dumps({"items": [{"city": "Bergen"}, {"city": "Rome", "n": 1}],
                                                       "city": {"name": "Bergen"}})}])
    out = json.loads(wm.simulate("t", {"city": "Oslo"}))
    assert out == {"items": [{"city": "Oslo"}, {"city": "Oslo", "n": 1}], "city": {"name": "Bergen"}}


def _replay_with_candidates(n=8, temperature=0.0):
    records = [{"decision": "accept", "status": "ok", "tool": "a", "artifact": {"z": 1},
                "observation": json.dumps({"id": i})} for i in range(n)]
    return ReplayWorldModel(records, temperature=temperature, seed=7)


class _Spy:
    """Records what the wrapped world model returned, at which temperature it was asked."""

    def __init__(self, model):
        self.model, self.seen = model, []

    def simulate(self, tool, args, *, satisfied=None, temperature=None):
        text = self.model.simulate(tool, args, satisfied=satisfied, temperature=temperature)
        self.seen.append((temperature, text))
        return text


def _mco_observations(world_model, temperature, decisions=25):
    from langchain_core.messages import AIMessage, HumanMessage

    from intent import DecisionContext, Market, PricedTool, Proposal
    from intent.oracles import MCOOracle
    from intent.policy import AgentPolicy
    from intent.testing import ScriptedToolModel

    market = Market([PricedTool("a", 10)])
    spy = _Spy(world_model)
    policy = AgentPolicy(ScriptedToolModel(messages=iter([AIMessage("done")] * decisions), bound=[]))
    oracle = MCOOracle(policy, spy, temperature=temperature, rollout_cache=False)
    for i in range(decisions):
        prop = Proposal(f"c{i}", "a", {"q": 1}, "need a")
        call = {"name": "a", "args": {"q": 1}, "id": f"c{i}", "type": "tool_call"}
        ctx = DecisionContext(f"e{i}", "q", prop, 10.0, 50.0, 0.0, 50.0, market, step=0,
                              history=[HumanMessage("q"), AIMessage("need a", tool_calls=[call])], batch=(prop,))
        assert oracle.decide(ctx).accept
    return oracle, spy.seen


def test_mco_samples_the_world_model_at_its_own_temperature():
    # The world model is built deterministic (T = 0); MCO at T = 1 must still sample.
    oracle, seen = _mco_observations(_replay_with_candidates(temperature=0.0), temperature=1.0)
    assert oracle.temperature_applied and {t for t, _ in seen} == {1.0}
    assert len({text for _, text in seen}) > 1
    # ...and a world model built to sample (T = 1) is deterministic under MCO at T = 0.
    oracle, seen = _mco_observations(_replay_with_candidates(temperature=1.0), temperature=0.0)
    assert {t for t, _ in seen} == {0.0} and len({text for _, text in seen}) == 1


def test_mco_sampling_reproduces_per_episode_fork():
    base = _replay_with_candidates(temperature=0.0)
    _, a = _mco_observations(base.fork(123), temperature=1.0)
    _, b = _mco_observations(base.fork(123), temperature=1.0)
    _, c = _mco_observations(base.fork(124), temperature=1.0)
    assert a == b and a != c


def test_mco_leaves_a_model_without_temperature_alone():
    from intent.oracles import MCOOracle

    class Plain:
        def simulate(self, tool, args, *, satisfied=None):
            return "{}"

    plain = Plain()
    oracle = MCOOracle(lambda ctx: None, plain, temperature=1.0)
    assert oracle.world_model is plain and not oracle.temperature_applied
    from worldmodel.protocols import AtTemperature, simulate_counted

    with pytest.raises(TypeError, match="temperature"):
        simulate_counted(plain, "t", {}, satisfied=None, temperature=0.5)
    with pytest.raises(TypeError, match="temperature"):
        AtTemperature(plain, 0.5)


def test_replay_temperature_sharpens_and_flattens():
    records = [{"decision": "accept", "status": "ok", "tool": "a", "artifact": {"z": 1},
                "observation": json.dumps({"v": "common" if i < 4 else "rare"})} for i in range(5)]
    wm = ReplayWorldModel(records, seed=1)
    cold = [wm.simulate("a", {}, temperature=0.05) for _ in range(200)]
    hot = [wm.simulate("a", {}, temperature=50.0) for _ in range(400)]
    assert all("common" in t for t in cold)  # weight 4 ** 20 vs 1
    assert 0.35 < sum("rare" in t for t in hot) / len(hot) < 0.65  # nearly uniform over the two
    with pytest.raises(ValueError, match="temperature"):
        wm.simulate("a", {}, temperature=-1)


def test_openai_compatible_world_model_passes_the_call_temperature():
    import httpx

    bodies = []

    def handler(request):
        bodies.append(json.loads(request.content))
        return httpx.Response(200, json={"choices": [{"message": {"content": "ok"}}]})

    wm = OpenAICompatibleWorldModel("http://wm.test/v1", "wm", temperature=1.0, transport=httpx.MockTransport(handler))
    wm.simulate("t", {}, temperature=0.25)
    wm.simulate("t", {})
    assert [b["temperature"] for b in bodies] == [0.25, 1.0]


def _success(tool: str, args: dict, observation: dict, z: int = 1) -> dict:
    return {"decision": "accept", "status": "ok", "tool": tool, "z": z, "args": args,
            "observation": json.dumps(observation)}


def test_an_ideal_observation_names_the_entity_not_the_half_typed_argument():
    """The synthetic environment answers a half-typed call that succeeds about the entity (its canonical facts).
    An ideal (z = 1) replayed observation must too: the LLM-like agent checks that the answer is about its entity,
    and read a replay that echoed "tor" as a failure, so INTENT's ideal trajectory retried other providers."""
    from eval.agents.simulated import NeedView, looks_successful

    logs = [
        _success("travel_plus_flights", {"origin": "tor", "destination": "Chicago"},
                 {"source": "travel_plus_flights", "origin": "Toronto", "destination": "Chicago", "fare": 120}),
        _success("travel_standard_flights", {"origin": "Lima", "destination": "Paris"},
                 {"source": "travel_standard_flights", "origin": "Lima", "destination": "Paris", "fare": 300}),
        # A failure teaches nothing about how successes write an argument.
        _success("travel_plus_flights", {"origin": "osl", "destination": "Rome"},
                 {"source": "travel_plus_flights", "origin": "Lima", "destination": "Rome", "fare": 80}, z=0),
    ]
    wm = ReplayWorldModel(logs)
    need = NeedView("n1", "cheapest fare from Toronto to Chicago", {"origin": "Toronto", "destination": "Chicago"},
                    ("travel_plus_flights",))
    seen = wm.simulate("travel_plus_flights", {"origin": "tor", "destination": "Chicago"}, satisfied=True)
    assert json.loads(seen)["origin"] == "Toronto" and looks_successful(need, seen)
    # An unseen half-typed value completes to the value successes returned under that key.
    assert json.loads(wm.simulate("travel_standard_flights", {"origin": "toro", "destination": "Chicago"},
                                  satisfied=True))["origin"] == "Toronto"
    # A whole value, another entity, is echoed as asked (a success is about what was asked for).
    assert json.loads(wm.simulate("travel_plus_flights", {"origin": "Oslo", "destination": "Paris"},
                                  satisfied=True))["origin"] == "Oslo"
    assert wm.as_answered("origin", "osl") == "osl"  # the failure's argument was not learned
    assert wm.as_answered("fare", 5) == 5  # not a string: as given
    assert wm.fork(1).as_answered("origin", "tor") == "Toronto"


def test_a_half_typed_value_completes_only_as_a_prefix_and_a_known_value_stays_itself():
    """Completion stands for half-typing: "new" is the start of "New York", "ork" is no start of anything, and
    "York", a value the successes themselves returned, is its own entity (not the more frequent "New York" it is
    part of, nor the more frequent "Yorkshire" it begins)."""
    logs = [_success("weather", {"city": "new y"}, {"city": "New York", "temp": 20})] * 3
    logs += [_success("weather", {"city": "yorksh"}, {"city": "Yorkshire", "temp": 15})] * 2
    logs += [_success("weather", {"city": "yo"}, {"city": "York", "temp": 14})]
    wm = ReplayWorldModel(logs)
    assert wm.as_answered("city", "York") == "York"  # a whole known value: kept
    assert wm.as_answered("city", "york") == "York"  # ... written as the successes write it
    assert wm.as_answered("city", "ork") == "ork"  # only inside "New York" and "York": not completed
    assert wm.as_answered("city", "shire") == "shire"
    assert wm.as_answered("city", "new") == "New York"  # a prefix: completed
    assert wm.as_answered("city", "yorks") == "Yorkshire"
    assert wm.as_answered("city", "yo") == "York"  # the alias a success taught
    assert json.loads(wm.simulate("weather", {"city": "York"}, satisfied=True))["city"] == "York"


@pytest.mark.parametrize("check,cls", [(check_world_model, ReplayWorldModel), (check_predictor, OptimisticPredictor)])
def test_a_conformance_check_given_the_class_names_the_fix(check, cls):
    # check_oracle takes a factory (the class): the same habit here gave a bare TypeError from inside
    # ("simulate() missing 1 required positional argument: 'args'").
    with pytest.raises(UsageError, match=rf"takes the .* itself, got the class {cls.__name__}; pass {cls.__name__}\("):
        check(cls)
