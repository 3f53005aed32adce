"""`intent compare RUN A B`: two methods of one bench run, task by task (eval/compare.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from eval.compare import compare_methods, render_markdown
from eval.results import EpisodeResult, ResultStore
from intent.errors import UsageError
from intent.logs import JsonlLogSink, StepRecord

ROOT = Path(__file__).resolve().parents[1]


def _record(method: str, task: str, step: int, tool: str, decision: str, **kw) -> StepRecord:
    fields = dict(task_id=f"{method}:{task}:0", step=step, call_id=f"{task}-{step}-{tool}", tool=tool,
                  decision=decision, status="ok" if decision == "accept" else "rejected", spent=0.0, remaining=50.0,
                  budget=50.0)
    fields.update(kw)
    return StepRecord(**fields)


def _episode(method: str, task: str, **kw) -> EpisodeResult:
    fields = dict(method=method, task_id=task, seed=0, group="2-need", budget=50.0, answered=True)
    fields.update(kw)
    return EpisodeResult(**fields)


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    """t1: tracker passes, intent refused twice (once for risk alone) then answered wrong.
    t2: intent passes, tracker overspent. t3: both pass (a tie)."""
    store = ResultStore(tmp_path / "episodes.jsonl")
    store.append(_episode("tracker", "t1", passed=1.0, cost=30.0))
    store.append(_episode("intent", "t1", passed=0.0, cost=12.0))
    store.append(_episode("tracker", "t2", passed=1.0, cost=55.0))  # over budget: scores 0
    store.append(_episode("intent", "t2", passed=1.0, cost=40.0))
    store.append(_episode("tracker", "t3", passed=1.0, cost=20.0))
    store.append(_episode("intent", "t3", passed=1.0, cost=20.0))
    store.append(_episode("prompt", "t1", passed=1.0, cost=20.0))
    log = JsonlLogSink(tmp_path / "logs.jsonl")
    for rec in [
        _record("tracker", "t1", 0, "a", "accept", execution=1, artifact={"z": 0}),
        _record("tracker", "t1", 1, "a", "accept", execution=1, artifact={"z": 1}),
        _record("intent", "t1", 0, "a", "reject", reason="plan_over_budget", oracle_usage={"best_case_over": 0.0}),
        _record("intent", "t1", 1, "b", "reject", reason="plan_over_budget", oracle_usage={"best_case_over": 1.0}),
        _record("intent", "t1", 2, "c", "accept", execution=1, artifact={"z": 0}),
        _record("intent", "t1", 2, "c", "invalid", reason="duplicate_call", status="invalid"),  # merged: not shown
        _record("tracker", "t2", 0, "a", "accept", execution=1, artifact={"z": 1}),
        _record("tracker", "t2", 1, "d", "reject", reason="over_budget"),
        _record("intent", "t2", 0, "a", "accept", execution=1, artifact={"z": 1}),
        _record("intent", "t2", 0, "a", "accept", execution=0, status="released"),  # not a run
        _record("tracker", "t1", 1, "llm", "accept", execution=1, artifact={"z": 1}, kind="model"),  # not a tool
    ]:
        log.write(rec)
    return tmp_path


def test_pairs_tasks_and_explains_each_side(run_dir: Path) -> None:
    out = compare_methods(run_dir, "tracker", "intent")
    assert (out["tasks"], out["a_wins"], out["b_wins"], out["ties"]) == (3, 1, 1, 1)
    assert out["pr"] == {"tracker": pytest.approx(200 / 3), "intent": pytest.approx(200 / 3)}
    side = out["where_a_wins"]  # t1: tracker wins, intent's episode explains it
    assert side["loser_endings"]["answered, judged wrong"] == 1
    assert side["loser_refusals_by_reason"] == {
        "plan_over_budget (plan fits at face value: risk only)": 1, "plan_over_budget (over at face value)": 1}
    assert side["loser"]["calls_run"] == 1 and side["loser"]["calls_failed"] == 1 and side["loser"]["refusals"] == 2
    assert side["winner"]["calls_run"] == 2 and side["winner"]["calls_failed"] == 1 and side["winner"]["refusals"] == 0
    other = out["where_b_wins"]  # t2: tracker's episode is over budget
    assert other["loser_endings"]["over budget"] == 1
    assert other["loser_refusals_by_reason"] == {"over_budget": 1}
    assert other["winner"]["calls_run"] == 1  # the released reservation is not a run
    assert "winner_calls_by_tier" not in side  # no run_config.json: no market to read tiers from
    example = out["examples"]["a_wins"][0]
    assert example["task"] == "t1"
    assert example["loser_calls"] == ("t0: a refused (plan_over_budget, risk only) / "
                                      "t1: b refused (plan_over_budget, over at face value) / t2: c failed")
    text = render_markdown(out)
    assert "tracker scores higher on 1, intent on 1, equal on 1" in text


@pytest.mark.parametrize(("a", "b", "needle"), [
    ("tracker", "mco", "method 'mco' has no episodes"),
    ("tracker", "tracker", "two different methods"),
])
def test_bad_methods_are_named(run_dir: Path, a: str, b: str, needle: str) -> None:
    with pytest.raises(UsageError, match=needle) as info:
        compare_methods(run_dir, a, b)
    if b == "mco":
        assert "intent, prompt, tracker" in str(info.value)  # the methods the run does have


def test_not_a_run_directory(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="no episodes.jsonl"):
        compare_methods(tmp_path, "tracker", "intent")


def test_a_real_run_through_the_command_line(tmp_path: Path) -> None:
    """A small synthetic-v2 bench run, then `intent compare` on it: the tiers come from the regenerated tasks."""
    out = tmp_path / "run"
    env_python = sys.executable
    bench = [env_python, "-m", "intent.cli", "bench", "--market", "synthetic-v2", "--agent", "sim-llm", "--tasks",
             "12", "--methods", "raw,tracker", "--workers", "1", "--no-progress", "--out", str(out)]
    subprocess.run(bench, cwd=ROOT, check=True, capture_output=True, text=True)
    done = subprocess.run([env_python, "-m", "intent.cli", "compare", str(out), "tracker", "raw", "--show", "1"],
                          cwd=ROOT, check=True, capture_output=True, text=True)
    assert "# tracker vs raw, task by task" in done.stdout
    summary = json.loads((out / "compare-tracker-raw.json").read_text())
    assert (out / "compare-tracker-raw.png").stat().st_size > 0
    assert summary["tasks"] == 12 and summary["market"] == "synthetic-v2"
    runs = {m: [r for r in ResultStore(out / "episodes.jsonl").load() if r.method == m] for m in ("tracker", "raw")}
    checked = 0
    for key, winner, loser in (("where_a_wins", "tracker", "raw"), ("where_b_wins", "raw", "tracker")):
        side = summary[key]
        if not side["tasks"]:
            continue
        won = {e["task"] for e in summary["examples"][key.replace("where_", "")]}
        # Every run call of the winning episodes has a tier from the task (none left unknown).
        n_calls = sum(r.n_calls for r in runs[winner] if r.task_id in won)
        assert sum(side["winner_calls_by_tier"].values()) == n_calls
        checked += 1
    assert checked  # at least one side won a task (else the check above never ran)


def test_method_names_with_colons_and_slashes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A method may be named after its model (openai:gpt-x, intent/minilm): the files get a safe name (`_` for
    each unsafe character, then `~` and a digest of the name), the tables the real one, and the guard log's episode ids (method:task:seed) still
    find their episodes."""
    from eval.compare import main

    a, b = "openai:gpt-x", "intent/minilm"
    store = ResultStore(tmp_path / "episodes.jsonl")
    store.append(_episode(a, "t1", passed=1.0, cost=10.0))
    store.append(_episode(b, "t1", passed=0.0, cost=10.0))
    log = JsonlLogSink(tmp_path / "logs.jsonl")
    log.write(_record(a, "t1", 0, "x", "accept", execution=1, artifact={"z": 1}))
    log.write(_record(b, "t1", 0, "x", "reject", reason="over_budget"))
    assert main([str(tmp_path), a, b]) == 0
    import zlib

    digest = {m: f"{zlib.crc32(m.encode()):08x}" for m in (a, b, "openai/gpt-x")}
    stem = tmp_path / f"compare-openai_gpt-x~{digest[a]}-intent_minilm~{digest[b]}"
    assert {p.name for p in tmp_path.glob("compare-*")} == {stem.name + ext for ext in (".md", ".json", ".png")}
    assert "# openai:gpt-x vs intent/minilm, task by task" in stem.with_suffix(".md").read_text()
    assert "# openai:gpt-x vs intent/minilm" in capsys.readouterr().out
    summary = json.loads(stem.with_suffix(".json").read_text())
    assert (summary["a"], summary["b"], summary["a_wins"]) == (a, b, 1)
    side = summary["where_a_wins"]
    assert side["winner"]["calls_run"] == 1 and side["loser_refusals_by_reason"] == {"over_budget": 1}
    # Two names written alike in a file name (':' and '/' both '_') keep files of their own.
    store.append(_episode("openai/gpt-x", "t1", passed=0.0, cost=10.0))
    assert main([str(tmp_path), "openai/gpt-x", b]) == 0
    assert (tmp_path / f"compare-openai_gpt-x~{digest['openai/gpt-x']}-intent_minilm~{digest[b]}.md").exists()
    assert "# openai:gpt-x vs" in stem.with_suffix(".md").read_text()  # not overwritten
    assert len(list(tmp_path.glob("compare-*"))) == 6


def test_a_torn_last_line_is_skipped_never_cut_from_the_file(run_dir: Path) -> None:
    """compare only reads a run (maybe one still running, or resumed later): a torn last line of episodes.jsonl is
    skipped with a warning, and the file stays byte for byte as it was (the resumed run repairs it)."""
    episodes = run_dir / "episodes.jsonl"
    with open(episodes, "a", encoding="utf-8") as fh:
        fh.write('{"method": "tracker", "task_')  # a crash (or a live writer) in the middle of a line
    before = episodes.read_bytes()
    with pytest.warns(UserWarning, match=r"episodes.jsonl:8: torn last line skipped"):
        out = compare_methods(run_dir, "tracker", "intent")
    assert episodes.read_bytes() == before
    assert (out["tasks"], out["a_wins"], out["b_wins"], out["ties"]) == (3, 1, 1, 1)


def test_a_resumed_episode_counts_its_last_attempt_only(run_dir: Path) -> None:
    """A resumed run re-runs a crashed episode under the same id: episodes.jsonl holds both results and the guard
    log both attempts' calls, the second starting again at step 0. The episode is its last attempt, not the sum."""
    store = ResultStore(run_dir / "episodes.jsonl")
    store.append(_episode("intent", "t4", passed=0.0, cost=30.0, error="RuntimeError: endpoint down"))
    store.append(_episode("tracker", "t4", passed=0.0, cost=20.0))
    store.append(_episode("intent", "t4", passed=1.0, cost=8.0))  # the resumed run's attempt
    log = JsonlLogSink(run_dir / "logs.jsonl")
    for rec in [
        _record("intent", "t4", 0, "a", "accept", execution=1, artifact={"z": 0}),  # attempt 1, crashed
        _record("intent", "t4", 1, "b", "accept", execution=1, artifact={"z": 0}),
        _record("intent", "t4", 2, "c", "reject", reason="over_budget"),
        _record("tracker", "t4", 0, "a", "accept", execution=1, artifact={"z": 0}),
        _record("intent", "t4", 0, "a", "accept", execution=1, artifact={"z": 1}),  # attempt 2: step 0 again
    ]:
        log.write(rec)
    # t5: the first attempt crashed in its first step, after its call ran (same step, same call id, again).
    store.append(_episode("intent", "t5", passed=0.0, cost=5.0, error="RuntimeError: endpoint down"))
    store.append(_episode("tracker", "t5", passed=0.0, cost=20.0))
    store.append(_episode("intent", "t5", passed=1.0, cost=5.0))
    for rec in [_record("intent", "t5", 0, "a", "accept", execution=1, artifact={"z": 0}),
                _record("intent", "t5", 0, "a", "accept", execution=1, artifact={"z": 1})]:
        log.write(rec)
    # t6: one attempt that proposes a refused call again, same id, at later steps (DFSDT's backtracking does):
    # not a new attempt.
    store.append(_episode("intent", "t6", passed=1.0, cost=5.0))
    store.append(_episode("tracker", "t6", passed=0.0, cost=20.0))
    for rec in [_record("intent", "t6", 0, "a", "accept", execution=1, artifact={"z": 1}),
                *(_record("intent", "t6", step, "b", "reject", reason="over_budget", call_id="t6-b") for step in (1, 2)),
                _record("intent", "t6", 3, "c", "accept", execution=1, artifact={"z": 1})]:
        log.write(rec)
    out = compare_methods(run_dir, "tracker", "intent")
    assert (out["tasks"], out["a_wins"], out["b_wins"]) == (6, 1, 4)
    t5 = next(e for e in out["examples"]["b_wins"] if e["task"] == "t5")
    assert t5["winner_calls"] == "t0: a ok"
    t6 = next(e for e in out["examples"]["b_wins"] if e["task"] == "t6")
    assert t6["winner_calls"] == "t0: a ok / t1: b refused (over_budget) / t2: b refused (over_budget) / t3: c ok"
    example = next(e for e in out["examples"]["b_wins"] if e["task"] == "t4")
    assert example["winner_calls"] == "t0: a ok" and example["winner_spent"] == 8.0
    side = out["where_b_wins"]  # t2, t4, t5: intent ran one call and refused none; t6: two run, two refused
    assert (side["winner"]["calls_run"], side["winner"]["refusals"], side["winner"]["calls_failed"]) == (1.25, 0.5, 0)


def test_a_newest_attempt_still_running_is_not_shown_with_the_last_result(run_dir: Path) -> None:
    """A run still going (or dead in it) has logged a newest attempt whose result is not saved yet. Its calls were
    shown with the previous attempt's result; they are that attempt's calls, and a warning says so."""
    store = ResultStore(run_dir / "episodes.jsonl")
    store.append(_episode("intent", "t4", passed=0.0, cost=10.0, error="RuntimeError: endpoint down"))
    store.append(_episode("tracker", "t4", passed=1.0, cost=20.0))
    log = JsonlLogSink(run_dir / "logs.jsonl")
    for rec in [
        _record("intent", "t4", 0, "a", "accept", execution=1, artifact={"z": 0}),  # attempt 1: crashed, saved
        _record("intent", "t4", 1, "b", "reject", reason="over_budget"),
        _record("tracker", "t4", 0, "a", "accept", execution=1, artifact={"z": 1}),
        _record("intent", "t4", 0, "c", "accept", execution=1, artifact={"z": 1}),  # attempt 2: running
    ]:
        log.write(rec)
    with pytest.warns(UserWarning, match="1 episode.s. have a newest attempt with no result yet"):
        out = compare_methods(run_dir, "tracker", "intent")
    t4 = next(e for e in out["examples"]["a_wins"] if e["task"] == "t4")
    assert t4["loser_calls"] == "t0: a failed / t1: b refused (over_budget)"


def _marked(rec: StepRecord, attempt: int) -> StepRecord:
    """A record as the runner writes it now: marked with its attempt number (eval/episode_log.py)."""
    return rec.model_copy(update={"attempt": attempt})


def test_an_episodes_calls_are_those_of_the_attempt_whose_result_is_shown(run_dir: Path) -> None:
    """Attempts matched to results by count went wrong when an attempt logged no tool record (a crash at its first
    model call saves a result but logs nothing), and a real model's fresh call ids hid a re-run from step 0. The
    runner now numbers each attempt, in its result and its records; compare selects the shown result's records by
    that number."""
    store = ResultStore(run_dir / "episodes.jsonl")
    log = JsonlLogSink(run_dir / "logs.jsonl")
    # t4: attempt 1 ran calls and crashed; attempt 2 crashed at its first model call (no record): the result shown
    # is attempt 2's, with no calls. By count, attempt 1's calls were shown beside it.
    store.append(_episode("intent", "t4", passed=0.0, cost=10.0, error="RuntimeError: endpoint down",
                          extra={"attempt": 1}))
    log.write(_marked(_record("intent", "t4", 0, "a", "accept", execution=1, artifact={"z": 1}), 1))
    store.append(_episode("intent", "t4", passed=0.0, cost=0.0, error="RuntimeError: endpoint down",
                          extra={"attempt": 2}))
    store.append(_episode("tracker", "t4", passed=1.0, cost=20.0, extra={"attempt": 1}))
    # t5: attempt 1 crashed at its first model call (a result, no record); attempt 3 is running (records, no
    # result). By count, the running attempt's calls were shown beside the crash's result, with no warning.
    store.append(_episode("intent", "t5", passed=0.0, cost=0.0, error="RuntimeError: endpoint down",
                          extra={"attempt": 1}))
    store.append(_episode("tracker", "t5", passed=1.0, cost=20.0, extra={"attempt": 1}))
    log.write(_marked(_record("intent", "t5", 0, "c", "accept", execution=1, artifact={"z": 1}), 3))
    # t6 (a served model: call ids chatcmpl-tool-<uuid>): attempt 1 crashed after step 0, attempt 2 ran from step 0
    # again with new ids. The step heuristic read both as one attempt.
    store.append(_episode("intent", "t6", passed=0.0, cost=5.0, error="RuntimeError: endpoint down",
                          extra={"attempt": 1}))
    store.append(_episode("intent", "t6", passed=1.0, cost=5.0, extra={"attempt": 2}))
    store.append(_episode("tracker", "t6", passed=0.0, cost=20.0, extra={"attempt": 1}))
    for attempt, step, tool, uid in ((1, 0, "a", "11"), (1, 0, "b", "12"), (2, 0, "d", "21"), (2, 1, "e", "22")):
        log.write(_marked(_record("intent", "t6", step, tool, "accept", execution=1, artifact={"z": 1},
                                  call_id=f"chatcmpl-tool-{uid}"), attempt))
    with pytest.warns(UserWarning, match="1 episode.s. have a newest attempt with no result yet"):
        out = compare_methods(run_dir, "tracker", "intent")
    a_wins = {e["task"]: e for e in out["examples"]["a_wins"]}
    assert a_wins["t4"]["loser_calls"] == "(no calls)"
    assert a_wins["t5"]["loser_calls"] == "(no calls)"
    t6 = next(e for e in out["examples"]["b_wins"] if e["task"] == "t6")
    assert t6["winner_calls"] == "t0: d ok / t1: e ok"
