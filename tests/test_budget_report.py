"""The budget report (`intent report`) and the README's offline example."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from intent.cli import main
from intent.logs import JsonlLogSink, StepRecord
from intent.report import budget_report

ROOT = Path(__file__).resolve().parent.parent


def rec(task: str, **kw) -> StepRecord:
    base = dict(task_id=task, step=0, call_id=kw.pop("call_id", "c"), tool=kw.pop("tool", "search"),
                decision=kw.pop("decision", "accept"), status=kw.pop("status", "ok"))
    return StepRecord(**base, **kw)


def write_log(path: Path) -> None:
    sink = JsonlLogSink(path)
    t = 0.0

    def put(r: StepRecord) -> None:
        nonlocal t
        t += 1
        sink.write(r.model_copy(update={"timestamp": t}))

    # episode A: budget 1.0, a model call, two tools, a refusal, a top-up by alice, a sub-agent carve
    put(rec("A", tool="gpt-x", kind="model", charged=0.003, execution=1, tokens={"input": 1000, "output": 100},
            spent=0.003, remaining=0.997, budget=1.0))
    put(rec("A", tool="search", price=0.2, charged=0.2, execution=1, spent=0.203, remaining=0.797, budget=1.0))
    put(rec("A", tool="fetch", price=0.5, charged=0.5, execution=1, spent=0.703, remaining=0.297, budget=1.0))
    put(rec("A", tool="fetch", price=0.5, decision="reject", status="rejected", reason="over_budget",
            spent=0.703, remaining=0.297, budget=1.0))
    put(rec("A", tool="", decision="top_up", price=0.25, approved_by="alice", reason="top_up for fetch",
            spent=0.703, remaining=0.547, budget=1.25))
    put(rec("A", tool="sub-agent:B", kind="sub_agent", charged=0.1, execution=1, spent=0.803, remaining=0.447,
            budget=1.25))
    # episode B: the sub-agent's own records (its spend is A's sub_agent charge)
    put(rec("B", tool="search", price=0.08, charged=0.08, execution=1, spent=0.08, remaining=0.02, budget=0.1))
    put(rec("B", tool="gpt-x", kind="model", charged=0.02, execution=1, tokens={"input": 10, "output": 5},
            spent=0.1, remaining=0.0, budget=0.1))
    put(rec("B", tool="gpt-x", kind="model", decision="reject", status="rejected", reason="model_over_budget",
            price=0.01, spent=0.1, remaining=0.0, budget=0.1))


def test_report_sums_spend_by_tool_and_model_counting_each_dollar_once(tmp_path):
    log = tmp_path / "run" / "logs" / "log.jsonl"
    log.parent.mkdir(parents=True)
    write_log(log)
    report = budget_report(log)
    assert report.spent == pytest.approx(0.803)  # A's spend; B's is inside A's sub-agent charge
    assert report.budget == pytest.approx(1.25) and report.left == pytest.approx(0.447)
    kinds = report.spent_by_kind()
    assert kinds["tool"] == pytest.approx(0.78) and kinds["model"] == pytest.approx(0.023)
    assert kinds["sub_agent"] == pytest.approx(0.1)
    assert kinds["tool"] + kinds["model"] == pytest.approx(report.spent)
    assert report.by_item[("tool", "search")]["runs"] == 2
    assert report.by_item[("model", "gpt-x")]["input"] == 1010
    assert report.refusals == {"over_budget": {"count": 1, "price": 0.5},
                               "model_over_budget": {"count": 1, "price": 0.01}}
    assert report.top_ups == [{"episode": "A", "amount": 0.25, "approved_by": "alice",
                               "reason": "top_up for fetch"}]
    b = next(e for e in report.episodes if e.episode == "B")
    assert b.parent == "A" and b.spent == pytest.approx(0.1)
    for e in report.episodes:  # Σ charged of an episode == its last record's spend
        assert e.spent == pytest.approx({"A": 0.803, "B": 0.1}[e.episode])
    md = report.to_markdown()
    assert "| over_budget | 1 | 0.5 |" in md and "| A | 0.25 | alice |" in md
    assert "| model | gpt-x | 0.023 | 2 | 1010 | 105 | 0 |" in md

    # a run directory: nested logs are found; other JSONL files are skipped
    (tmp_path / "run" / "results.jsonl").write_text(json.dumps({"not": "a record"}) + "\n")
    assert budget_report(tmp_path / "run").spent == pytest.approx(0.803)


def test_report_writes_markdown_json_and_a_png(tmp_path):
    log = tmp_path / "log.jsonl"
    write_log(log)
    written = budget_report(log).write(tmp_path / "out")
    png = tmp_path / "out" / "budget_report.png"
    assert png in written and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    data = json.loads((tmp_path / "out" / "budget_report.json").read_text())
    assert data["totals"]["spent"] == pytest.approx(0.803)


def test_cli_prints_the_report_and_names_bad_input(tmp_path, capsys):
    log = tmp_path / "log.jsonl"
    write_log(log)
    assert main(["report", str(log)]) == 0
    assert "## Spend by tool and by model" in capsys.readouterr().out
    assert main(["report", str(tmp_path / "missing.jsonl")]) == 2
    assert "does not exist" in capsys.readouterr().err
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["report", str(empty)]) == 2
    assert "holds no guard log" in capsys.readouterr().err


def test_the_readme_example_runs_offline_and_never_overspends(capsys):
    spec = importlib.util.spec_from_file_location("unified_budget_example", ROOT / "examples" / "unified_budget.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.main() == 0
    out = capsys.readouterr().out
    assert "alice approves a top-up" in out and "reserved 0.000000" in out
    assert "| sub_agent |" in out and "| unified-demo | 0.1 | alice |" in out
