"""Which world model the oracles use on StableToolBench: the replay model by default, the
environment's own simulator only when asked, and then labelled as a leaking upper bound."""

from __future__ import annotations

import json

import pytest

from eval.method_spec import MethodContext
from eval.oracle_methods import _world_model
from eval.stabletoolbench import StbDataError, resolve_root
from eval.stabletoolbench.schema_world_model import SCHEMA_WORLD_MODEL_LABEL, SchemaWorldModel
from worldmodel.replay import ReplayWorldModel


class _Resources:
    """OracleResources' interface as ``_world_model`` uses it: models by (key, fold), cross_fit."""

    cross_fit = True

    def __init__(self):
        self.asked = []
        self.replay = ReplayWorldModel([{"decision": "accept", "status": "ok", "tool": "t", "artifact": {"z": 1},
                                         "observation": json.dumps({"x": 1})}], temperature=1.0)

    def get(self, key, fold):
        self.asked.append((key, fold))
        return self.replay


@pytest.fixture(scope="module")
def stb_env(tmp_path_factory):
    try:
        resolve_root()
    except StbDataError as exc:
        pytest.skip(f"StableToolBench data not available: {exc}")
    from eval.stb_market import StableToolBenchMarket

    market = StableToolBenchMarket(limit=2, out=tmp_path_factory.mktemp("stb"))
    return market.episode(market.tasks()[0], 0)


def test_default_is_the_replay_model_from_other_queries(stb_env):
    assert stb_env.schema_world_model is not None  # the simulator exists, and must not be used by default
    res = _Resources()
    model = _world_model(MethodContext(env=stb_env, seed=0, resources=res), "world_model", 1)
    assert isinstance(model, ReplayWorldModel) and model is not stb_env.schema_world_model
    assert res.asked == [("world_model", 1)]  # the other fold's logs
    assert "replay" in res.world_model_label and "other queries" in res.world_model_label


def test_the_environment_simulator_only_when_asked_and_labelled(stb_env):
    res = _Resources()
    model = _world_model(MethodContext(env=stb_env, seed=0, options={"world_model": "schema"}, resources=res),
                         "world_model", 0)
    assert model is stb_env.schema_world_model and res.asked == []
    assert res.world_model_label == SCHEMA_WORLD_MODEL_LABEL
    assert "environment simulator" in SCHEMA_WORLD_MODEL_LABEL and "upper bound, leaks" in SCHEMA_WORLD_MODEL_LABEL


def test_bad_world_model_choices_are_refused(stb_env):
    from eval.markets import SyntheticBenchMarket

    with pytest.raises(ValueError, match=r"world_model.*'replay'.*'schema'"):
        _world_model(MethodContext(env=stb_env, seed=0, options={"world_model": "oracle"}, resources=_Resources()),
                     "world_model", 0)
    market = SyntheticBenchMarket(2, 0)
    synthetic = market.episode(market.tasks()[0], 0)
    with pytest.raises(ValueError, match="no simulator"):
        _world_model(MethodContext(env=synthetic, seed=0, options={"world_model": "schema"}, resources=_Resources()),
                     "world_model", None)


def test_schema_world_model_says_whether_it_leaks(stb_env):
    apis = []
    assert SchemaWorldModel(apis).label == SCHEMA_WORLD_MODEL_LABEL
    assert "leaks" not in SchemaWorldModel(apis, leaks=False).label
    # it answers exactly as the environment: that is the leak
    tool = stb_env.tools[0]
    args = {k: "x" for k in tool.args_schema["required"]} if isinstance(tool.args_schema, dict) else {}
    assert stb_env.schema_world_model.simulate(tool.name, args) == tool.invoke(args)


def test_a_fold_without_other_fold_logs_is_said_not_labelled_a_replay_of_other_queries(stb_env, tmp_path):
    # With --tasks 1 every oracle was built from zero records; results.json still said "replay of logged
    # observations from other queries (cross-fitted by query fold)" and the only note was
    # "the oracle logs hold only z=? labels".
    from eval.runner import BenchConfig, run_benchmark

    cfg = BenchConfig(market="stabletoolbench", methods=["raw", "intent", "btp"], tasks=1, out=str(tmp_path),
                      reference="raw", options={"solvability": False})
    notes = run_benchmark(cfg, progress=False)["config"]["oracle_notes"]
    assert any("no logs of the other fold" in n and "all 1 logged task(s)" in n for n in notes), notes
    assert not any("z=?" in n for n in notes), notes
