"""The oracle setup is timed apart whatever the order of --methods; an interrupted phase keeps its time
and the world model's label; a refused configuration leaves the directory unlocked."""

from __future__ import annotations

import json
import time

import pytest

import eval.runner as runner
from eval.oracle_methods import OracleResources
from eval.results import ResultStore
from eval.runner import BenchConfig, run_benchmark
from intent.errors import UsageError


def _slow_collection(monkeypatch: pytest.MonkeyPatch, seconds: float) -> None:
    original = OracleResources._load_or_collect

    def slow(self: OracleResources) -> list:
        time.sleep(seconds)
        return original(self)

    monkeypatch.setattr(OracleResources, "_load_or_collect", slow)


@pytest.mark.parametrize("methods", [["intent", "raw"], ["raw", "intent"]])
def test_oracle_log_collection_is_timed_whatever_method_comes_first(tmp_path, monkeypatch, methods):
    # The warm-up episode ran the first listed method with the oracle resources: with an oracle method
    # first, the collection happened there, untimed, and oracle_data_collection_s read 0.0.
    _slow_collection(monkeypatch, 0.3)
    summary = run_benchmark(BenchConfig(tasks=2, methods=methods, out=str(tmp_path), workers=1,
                                        options={"oracle_train_tasks": 4}), progress=False)
    timing = json.loads((tmp_path / "timing.json").read_text())
    assert timing["oracle_data_collection"] >= 0.3
    assert summary["config"]["oracle_data_collection_s"] >= 0.3
    assert "oracle_models" in timing and summary["config"]["oracle_models_s"] >= 0.0


def test_the_warm_up_episode_never_touches_the_oracle_resources(tmp_path, monkeypatch):
    warm_ups: list[tuple[str, object]] = []
    original = runner.run_episode

    def spy(spec, env, seed, factory, *, log_sink=None, options=None, resources=None, **more):
        if log_sink is None:
            warm_ups.append((spec.name, resources))
        return original(spec, env, seed, factory, log_sink=log_sink, options=options, resources=resources, **more)

    monkeypatch.setattr(runner, "run_episode", spy)
    run_benchmark(BenchConfig(tasks=2, methods=["intent", "tracker"], out=str(tmp_path), workers=1,
                              options={"oracle_train_tasks": 4}), progress=False)
    # (the oracle logs' collection runs Prompt episodes with a log sink; the warm-up has none)
    assert warm_ups == [("raw", None)]


def _interrupt(monkeypatch: pytest.MonkeyPatch, method: str, after: int) -> None:
    """Ctrl-C in ``method``'s phase once ``after`` of its episodes ran (the warm-up not counted)."""
    original = runner.run_episode
    calls = {"n": 0}

    def run(spec, env, seed, factory, *, log_sink=None, options=None, resources=None, **more):
        if spec.name == method and log_sink is not None:
            calls["n"] += 1
            if calls["n"] > after:
                raise KeyboardInterrupt
            time.sleep(0.05)
        return original(spec, env, seed, factory, log_sink=log_sink, options=options, resources=resources, **more)

    monkeypatch.setattr(runner, "run_episode", run)


def test_an_interrupted_phase_keeps_the_time_of_the_episodes_it_saved(tmp_path, monkeypatch):
    cfg = BenchConfig(tasks=4, methods=["raw"], out=str(tmp_path), workers=1)
    _interrupt(monkeypatch, "raw", after=2)
    with pytest.raises(KeyboardInterrupt):
        run_benchmark(cfg, progress=False)
    saved = ResultStore(tmp_path / "episodes.jsonl").load(repair=False)
    assert len(saved) == 2
    first = json.loads((tmp_path / "timing.json").read_text())["raw"]
    assert first >= 0.1  # two saved episodes of >= 0.05 s each
    monkeypatch.undo()
    summary = run_benchmark(cfg, progress=False)
    assert summary["methods"]["raw"]["n"] == 4
    assert summary["methods"]["raw"]["e2e_s"] >= round(first, 4)


def test_the_world_model_label_is_saved_before_the_run_completes(tmp_path, monkeypatch):
    cfg = BenchConfig(tasks=2, methods=["intent", "raw"], out=str(tmp_path), workers=1,
                      options={"oracle_train_tasks": 4})
    _interrupt(monkeypatch, "raw", after=0)
    with pytest.raises(KeyboardInterrupt):
        run_benchmark(cfg, progress=False)
    context = json.loads((tmp_path / "oracle_context.json").read_text())
    assert context["world_model"].startswith("world model = replay")


def test_a_refused_world_model_does_not_lock_the_directory(tmp_path):
    with pytest.raises(UsageError, match="--world-model schema"):
        run_benchmark(BenchConfig(tasks=2, methods=["intent"], out=str(tmp_path), workers=1,
                                  options={"world_model": "schema", "oracle_train_tasks": 4}), progress=False)
    assert not (tmp_path / "run_config.json").exists()


def test_a_method_listed_twice_is_refused(tmp_path):
    with pytest.raises(UsageError, match="--methods names tracker more than once"):
        run_benchmark(BenchConfig(tasks=2, methods=["raw", "tracker", "tracker"], out=str(tmp_path)), progress=False)
    assert not (tmp_path / "run_config.json").exists()


@pytest.mark.parametrize("methods", [["intent", "raw"], ["raw", "intent"]])
def test_the_oracle_setup_shows_its_progress_before_any_method_phase(tmp_path, capsys, methods):
    # With an oracle method listed first, the logs' collection and the models' building ran inside that method's
    # phase (after the warm-up), with no line of their own: a long silent stretch, then a method's bar.
    run_benchmark(BenchConfig(tasks=2, methods=methods, out=str(tmp_path), workers=1,
                              options={"oracle_train_tasks": 4}), progress=True)
    out = capsys.readouterr()
    lines = [line.strip() for line in (out.out + out.err).splitlines() if line.strip()]

    def first(prefix: str) -> int:
        return next(i for i, line in enumerate(lines) if line.startswith(prefix))

    setup = max(first("oracle logs"), first("oracle models"))
    assert setup < first("intent ") and setup < first("raw ")
