"""--max-depth: MCO's and INTENT's rollout horizon reaches the oracle, is checked before any episode,
belongs to a run directory's configuration and is printed with the table.

bench-llm on a CPU needed it: a 0.5B model's INTENT decision took ~45 s at the paper's 8 turns."""

from __future__ import annotations

import json

import pytest

from eval.runner import BenchConfig, run_benchmark
from intent.logs import read_log


def _rollout_turns(out):
    return [r.oracle_usage["rollout_turns"] for r in read_log(out / "logs.jsonl")
            if r.oracle == "intent" and r.oracle_usage.get("rollout_turns")]


def test_the_rollout_horizon_reaches_intent_and_is_printed(tmp_path):
    deep, shallow = tmp_path / "deep", tmp_path / "shallow"
    common = dict(methods=["intent"], tasks=3, workers=1, seed=0, options={"oracle_train_tasks": 20})
    run_benchmark(BenchConfig(out=str(deep), **common), progress=False)
    run_benchmark(BenchConfig(out=str(shallow), **{**common, "options": {"oracle_train_tasks": 20, "max_depth": 1}}),
                  progress=False)
    assert max(_rollout_turns(deep)) > 1  # the default horizon lets a rollout go on
    assert _rollout_turns(shallow) and max(_rollout_turns(shallow)) == 1
    assert "rollouts cut at 1 model turns" in (shallow / "results.md").read_text()
    assert "rollouts cut at" not in (deep / "results.md").read_text()
    assert json.loads((shallow / "results.json").read_text())["config"]["rollout_depth"] == 1


@pytest.mark.parametrize("bad", [0, -2, "3", 2.5, True])
def test_a_bad_horizon_is_refused_before_any_episode(tmp_path, bad):
    with pytest.raises(ValueError, match="--max-depth must be an integer >= 1"):
        run_benchmark(BenchConfig(tasks=1, methods=["intent"], out=str(tmp_path), options={"max_depth": bad}),
                      progress=False)
    assert not (tmp_path / "episodes.jsonl").exists()


def test_a_run_directory_refuses_another_horizon(tmp_path):
    run_benchmark(BenchConfig(tasks=1, methods=["raw"], out=str(tmp_path), options={"max_depth": 3}), progress=False)
    with pytest.raises(ValueError, match="max_depth"):
        run_benchmark(BenchConfig(tasks=1, methods=["raw"], out=str(tmp_path), options={"max_depth": 4}),
                      progress=False)


def test_the_default_horizon_given_or_left_out_is_one_configuration(tmp_path):
    run_benchmark(BenchConfig(tasks=1, methods=["raw"], out=str(tmp_path), options={"max_depth": 8}), progress=False)
    run_benchmark(BenchConfig(tasks=1, methods=["raw"], out=str(tmp_path)), progress=False)  # the same: no error
    with pytest.raises(ValueError, match=r"'max_depth': \(None, 2\)"):
        run_benchmark(BenchConfig(tasks=1, methods=["raw"], out=str(tmp_path), options={"max_depth": 2}),
                      progress=False)
