"""The budget report (`intent report`): exact sums from a guard log, its files, the CLI, the README example."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from intent.cli import main
from intent.logs import JsonlLogSink, StepRecord, read_log
from intent.report import _money, budget_report

ROOT = Path(__file__).resolve().parent.parent
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def rec(task: str, **kw) -> StepRecord:
    base = dict(task_id=task, step=0, call_id=kw.pop("call_id", "c"), tool=kw.pop("tool", "search"),
                decision=kw.pop("decision", "accept"), status=kw.pop("status", "ok"))
    return StepRecord(**base, **kw)


def write_log(path: Path) -> None:
    """Two episodes whose spent / remaining / budget fields are what a ledger would have written."""
    sink = JsonlLogSink(path)
    t = 0.0

    def put(r: StepRecord) -> None:
        nonlocal t
        t += 1
        sink.write(r.model_copy(update={"timestamp": t}))

    # episode A: budget 1.0; a model call, two tool runs, a refusal, a released reservation, a top-up by
    # alice, and the carve its sub-agent (episode B) spent
    put(rec("A", tool="gpt-x", kind="model", charged=0.003, execution=1, tokens={"input": 1000, "output": 100},
            spent=0.003, remaining=0.997, budget=1.0))
    put(rec("A", tool="search", price=0.2, charged=0.2, execution=1, spent=0.203, remaining=0.797, budget=1.0))
    put(rec("A", tool="fetch", price=0.5, charged=0.5, execution=1, spent=0.703, remaining=0.297, budget=1.0))
    put(rec("A", tool="fetch", price=0.5, decision="reject", status="rejected", reason="over_budget",
            spent=0.703, remaining=0.297, budget=1.0))
    put(rec("A", tool="search", price=0.2, status="released", reason="answered_from_cache",
            spent=0.703, remaining=0.297, budget=1.0))
    put(rec("A", tool="", decision="top_up", price=0.25, approved_by="alice", reason="top_up for fetch",
            spent=0.703, remaining=0.547, budget=1.25))
    put(rec("A", tool="sub-agent:B", kind="sub_agent", charged=0.1, execution=1, spent=0.803, remaining=0.447,
            budget=1.25))
    # episode B: the sub-agent's own records (their spend is A's sub_agent charge)
    put(rec("B", tool="search", price=0.08, charged=0.08, execution=1, spent=0.08, remaining=0.02, budget=0.1))
    put(rec("B", tool="gpt-x", kind="model", charged=0.02, execution=1,
            tokens={"input": 10, "output": 5, "cache_write": 8},
            spent=0.1, remaining=0.0, budget=0.1))
    put(rec("B", tool="gpt-x", kind="model", decision="reject", status="rejected", reason="model_over_budget",
            price=0.01, spent=0.1, remaining=0.0, budget=0.1))


@pytest.fixture
def log(tmp_path: Path) -> Path:
    path = tmp_path / "log.jsonl"
    write_log(path)
    return path


def test_totals_count_each_dollar_once(log):
    report = budget_report(log)
    assert report.spent == pytest.approx(0.803)  # A's spend; B's is inside A's sub-agent charge
    assert report.budget == pytest.approx(1.25) and report.left == pytest.approx(0.447)
    assert report.topped_up == pytest.approx(0.25) and report.overrun == 0
    kinds = report.spent_by_kind()
    assert kinds == pytest.approx({"tool": 0.78, "model": 0.023, "sub_agent": 0.1})
    assert kinds["tool"] + kinds["model"] == pytest.approx(report.spent)


def test_spend_by_tool_and_model_with_runs_and_tokens(log):
    report = budget_report(log)
    items = report.by_item
    assert set(items) == {("tool", "search"), ("tool", "fetch"), ("model", "gpt-x"), ("sub_agent", "sub-agent:B")}
    assert items[("tool", "search")]["spent"] == pytest.approx(0.28)
    assert items[("tool", "search")]["runs"] == 2  # the released reservation never ran
    assert items[("tool", "fetch")]["spent"] == pytest.approx(0.5) and items[("tool", "fetch")]["runs"] == 1
    gpt = items[("model", "gpt-x")]
    assert gpt["spent"] == pytest.approx(0.023) and gpt["runs"] == 2
    assert (gpt["input"], gpt["output"], gpt["cached"], gpt["cache_write"]) == (1010, 105, 0, 8)
    a = next(e for e in report.episodes if e.episode == "A")  # and per episode
    assert a.by_item[("tool", "search")]["spent"] == pytest.approx(0.2)
    assert a.by_kind == pytest.approx({"tool": 0.7, "model": 0.003, "sub_agent": 0.1})


def test_refusals_by_reason_and_top_ups_with_approver(log):
    report = budget_report(log)
    assert report.refusals == {"over_budget": {"count": 1, "price": 0.5},
                               "model_over_budget": {"count": 1, "price": 0.01}}
    assert report.top_ups == [{"episode": "A", "amount": 0.25, "approved_by": "alice", "reason": "top_up for fetch"}]
    by_episode = {e.episode: e for e in report.episodes}
    assert (by_episode["A"].refused, by_episode["B"].refused) == (1, 1)
    assert by_episode["B"].parent == "A" and by_episode["A"].parent == ""
    assert by_episode["B"].left == 0 and by_episode["A"].left == pytest.approx(0.447)


def test_each_episodes_charged_adds_up_to_its_last_records_spent(log):
    last_spent = {r.task_id: r.spent for r in read_log(log)}  # log order: the last record wins
    report = budget_report(log)
    assert {e.episode: e.spent for e in report.episodes} == pytest.approx(last_spent)


def test_markdown_has_the_tables_with_the_numbers(log):
    md = budget_report(log).to_markdown()
    assert "| 2 | 1 | 1.25 | 0.803 | 0.447 | 0.25 | 0 | 0.78 | 0.023 | 0 | 0.1 |" in md  # totals
    assert "| model | gpt-x | 0.023 | 2 | 0 | 1010 | 105 | 0 | 8 |" in md
    assert "| tool | search | 0.28 | 2 | 0 |  |  |  |  |" in md
    assert "| sub_agent | sub-agent:B | 0.1 | 1 | 0 |  |  |  |  |" in md
    assert "| over_budget | 1 | 0.5 |" in md and "| model_over_budget | 1 | 0.01 |" in md
    assert "| A | 0.25 | alice | top_up for fetch |" in md
    assert "| A | - | 1.25 | 0.803 | 0.447 | 0.7 | 0.003 | 0 | 0.1 | 0.25 | 1 |" in md
    assert "| B | A | 0.1 | 0.1 | 0 | 0.08 | 0.02 | 0 | 0 | 0 | 1 |" in md


def test_free_text_does_not_break_a_table():
    records = [rec("E", tool="", decision="top_up", price=1.0, approved_by="bob", reason="needs a|b\nsoon",
                   spent=0.0, remaining=2.0, budget=2.0)]
    md = budget_report(records).to_markdown()
    assert "| E | 1 | bob | needs a\\|b soon |" in md


def test_money_has_six_significant_digits_and_no_exponent():
    assert _money(0.1 + 0.2) == "0.3"
    assert _money(1234567.0) == "1234570"
    assert _money(1.23e-5) == "0.0000123"
    assert _money(2 / 3) == "0.666667"
    assert _money(-1e-17) == "0" and _money(-0.0) == "0"


def test_plot_writes_a_png_even_for_many_episodes(tmp_path, log):
    png = budget_report(log).plot(tmp_path / "plot.png")
    assert png.stat().st_size > 1000 and png.read_bytes()[:8] == PNG_MAGIC
    many = [rec(f"ep{i}", price=1.0, charged=float(i), execution=1, spent=float(i), remaining=100.0 - i,
                budget=100.0) for i in range(1, 46)]
    big = budget_report(many).plot(tmp_path / "many.png")
    assert big.read_bytes()[:8] == PNG_MAGIC


def test_out_writes_markdown_json_and_png(tmp_path, log):
    report = budget_report(log, out=tmp_path / "out")
    out = tmp_path / "out"
    assert (out / "budget_report.md").read_text() == report.to_markdown()
    assert (out / "budget_report.png").read_bytes()[:8] == PNG_MAGIC
    data = json.loads((out / "budget_report.json").read_text())
    assert data["totals"]["spent"] == pytest.approx(0.803) and data["totals"]["left"] == pytest.approx(0.447)
    assert {r["reason"]: r["count"] for r in data["refusals"]} == {"over_budget": 1, "model_over_budget": 1}


def test_a_run_directory_reads_nested_logs_and_skips_other_jsonl(tmp_path):
    run = tmp_path / "run"
    write_log(run / "workers" / "w0" / "log.jsonl")  # JsonlLogSink makes the directories
    (run / "results.jsonl").write_text(json.dumps({"not": "a record"}) + "\n")
    # A benchmark's oracle_data/: the oracle models' training logs (another agent, other tasks) are not the
    # run's spending (they were added to it).
    write_log(run / "oracle_data" / "logs.jsonl")
    report = budget_report(run)
    assert report.spent == pytest.approx(0.803)
    assert report.sources == [str(run / "workers" / "w0" / "log.jsonl")]
    assert report.skipped == [f"{run / 'oracle_data' / 'logs.jsonl'} (the oracle models' training logs)",
                              f"{run / 'results.jsonl'} (not a guard log)"]
    (run / "oracle_data" / "logs.jsonl").unlink()
    (run / "results.jsonl").unlink()
    (run / "workers" / "w0" / "log.jsonl").unlink()
    with pytest.raises(ValueError, match=f"{run}.*holds no guard log.*jsonl"):
        budget_report(run)


def test_cli_prints_the_report_and_writes_files(tmp_path, log, capsys):
    assert main(["report", str(log)]) == 0
    out = capsys.readouterr().out
    assert out == budget_report(log).to_markdown()
    assert "## Spend by tool and by model" in out and "| over_budget | 1 | 0.5 |" in out
    assert main(["report", str(log), "--out", str(tmp_path / "rep")]) == 0
    out = capsys.readouterr().out
    for name in ("budget_report.md", "budget_report.json", "budget_report.png"):
        assert f"wrote {tmp_path / 'rep' / name}" in out and (tmp_path / "rep" / name).stat().st_size > 0


def test_cli_exits_2_naming_bad_input(tmp_path, capsys):
    assert main(["report", str(tmp_path / "missing.jsonl")]) == 2
    assert "missing.jsonl does not exist" in capsys.readouterr().err
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["report", str(empty)]) == 2
    assert f"{empty} holds no guard log" in capsys.readouterr().err
    other = tmp_path / "other.jsonl"
    other.write_text('{"a": 1}\n')  # said "schema_version None is not one of ...; written by another version"
    assert main(["report", str(other)]) == 2
    assert "other.jsonl:1: not a guard log record" in capsys.readouterr().err
    db = tmp_path / "nosuch.db"  # a report only reads: a mistyped store path created an empty database
    assert main(["report", "--store", f"sqlite:///{db}", "--key", "team/1"]) == 2
    assert "no SQLite database at" in capsys.readouterr().err and not db.exists()
    # A log or --out beside --store was ignored without a word (the store's report was printed).
    assert main(["report", str(tmp_path / "run.jsonl"), "--store", f"sqlite:///{db}", "--key", "team/1"]) == 2
    assert f"drop the source {tmp_path / 'run.jsonl'}, or drop --store" in capsys.readouterr().err
    assert main(["report", "--store", f"sqlite:///{db}", "--key", "team/1", "--out", str(tmp_path / "rep")]) == 2
    assert "drop --out, or drop --store" in capsys.readouterr().err


def test_importing_the_report_loads_neither_matplotlib_nor_torch():
    code = "import sys, intent.report; print(sorted(m for m in ('matplotlib', 'torch') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT).stdout
    assert out.strip() == "[]"


def test_the_readme_example_runs_offline_and_never_overspends(capsys):
    spec = importlib.util.spec_from_file_location("unified_budget_example", ROOT / "examples" / "unified_budget.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.main() == 0
    out = capsys.readouterr().out
    assert "alice approves a top-up" in out and "reserved 0.000000" in out
    assert "| sub_agent |" in out and "| unified-demo | 0.1 | alice |" in out


def test_episodes_that_spent_more_than_their_budget_are_named(tmp_path):
    # A soft guard's log (enforce=False: Raw, Prompt) showed "overrun 0" for an episode that spent 275 of 105.
    sink = JsonlLogSink(tmp_path / "log.jsonl")
    sink.write(rec("R", tool="search", price=275.0, charged=275.0, execution=1, spent=275.0, remaining=0.0,
                   budget=105.0))
    sink.write(rec("S", tool="search", price=5.0, charged=5.0, execution=1, spent=5.0, remaining=100.0, budget=105.0))
    report = budget_report(tmp_path / "log.jsonl")
    assert [(e.episode, e.over_budget) for e in report.episodes] == [("R", 170.0), ("S", 0.0)]
    assert "Over budget: 1 episode spent 170 more than their budgets" in report.to_markdown()


def test_runs_in_different_directories_are_different_episodes_even_with_the_same_ids(tmp_path):
    # A study's sweep folders (main/, budget-0.5/) reuse episode ids: merged by id, each episode showed both
    # runs' spend, and an enforcing run's episodes were reported over budget.
    root = tmp_path / "study"
    write_log(root / "main" / "logs.jsonl")
    write_log(root / "budget-0.5" / "logs.jsonl")
    report = budget_report(root)
    assert report.spent == pytest.approx(2 * 0.803)
    names = sorted(e.episode for e in report.episodes)
    assert names == ["budget-0.5/A", "budget-0.5/B", "main/A", "main/B"]
    assert all(e.over_budget == 0 for e in report.episodes)
    parents = {e.episode: e.parent for e in report.episodes}
    assert parents["main/B"] == "main/A" and parents["budget-0.5/B"] == "budget-0.5/A"  # within its directory
    assert sorted(t["episode"] for t in report.top_ups) == ["budget-0.5/A", "main/A"]


def test_one_episodes_records_in_two_logs_of_one_directory_merge(tmp_path):
    # Two processes of one thread, each with its own log file in the same run directory: one episode.
    run = tmp_path / "run"
    sink_a, sink_b = JsonlLogSink(run / "a.jsonl"), JsonlLogSink(run / "b.jsonl")
    sink_a.write(rec("E", price=2.0, charged=2.0, execution=1, spent=2.0, remaining=8.0, budget=10.0, timestamp=1.0))
    sink_b.write(rec("E", price=3.0, charged=3.0, execution=1, spent=5.0, remaining=5.0, budget=10.0, timestamp=2.0))
    report = budget_report(run)
    assert [(e.episode, e.spent, e.left) for e in report.episodes] == [("E", 5.0, 5.0)]
