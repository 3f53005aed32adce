"""`make bench-llm`'s pieces that need no server: the vLLM command the scripts build, the /metrics
and parser-log readers, and the per-method call statistics from the guard's log."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from eval.agents.llm_bench import parse_log_totals, parse_metrics, proposal_stats, server_stats, stats_table

ROOT = Path(__file__).resolve().parents[1]

METRICS = """# HELP vllm:generation_tokens_total Number of generation tokens processed.
# TYPE vllm:generation_tokens_total counter
vllm:generation_tokens_total{engine="0",model_name="qwen"} 1200.0
vllm:prompt_tokens_total{engine="0",model_name="qwen"} 9000.0
vllm:prefix_cache_hits_total{engine="0",model_name="qwen"} 6000.0
vllm:prefix_cache_queries_total{engine="0",model_name="qwen"} 9000.0
vllm:request_success_total{engine="0",finished_reason="stop",model_name="qwen"} 7.0
vllm:request_success_total{engine="0",finished_reason="length",model_name="qwen"} 3.0
python_gc_objects_collected_total{generation="0"} 123.0
"""


def test_metrics_are_summed_over_labels_and_turned_into_rates():
    after = parse_metrics(METRICS)
    assert after["vllm:request_success_total"] == 10.0 and "python_gc_objects_collected_total" not in after
    before = {"vllm:generation_tokens_total": 200.0, "vllm:prompt_tokens_total": 1000.0,
              "vllm:prefix_cache_hits_total": 2000.0, "vllm:prefix_cache_queries_total": 5000.0}
    s = server_stats(before, after, seconds=100.0)
    assert s["server_gen_tok_s"] == 10.0 and s["server_total_tok_s"] == 90.0
    assert s["prefix_cache_hit_pct"] == 100.0 and s["server_requests"] == 10 and s["length_capped_pct"] == 30.0
    assert server_stats(before, {}, 100.0) == {}  # no /metrics (llama.cpp without --metrics): no numbers


def test_parser_log_totals_start_after_the_skipped_lines(tmp_path):
    log = tmp_path / "parse.jsonl"
    rows = [{"calls": 1, "malformed": 0, "duplicates": 0, "unknown": 0},
            {"calls": 5, "malformed": 1, "duplicates": 4, "unknown": 1},
            {"calls": 0, "malformed": 2, "duplicates": 0, "unknown": 0}]
    log.write_text("\n".join(json.dumps(r) for r in rows) + "\n{torn")
    n, totals = parse_log_totals(log, skip=1)
    assert n == 4
    assert totals == {"replies": 2, "calls": 5, "malformed": 3, "duplicates": 4, "unknown": 1, "malformed_replies": 2}
    assert parse_log_totals(tmp_path / "missing.jsonl") == (0, {"replies": 0, "calls": 0, "malformed": 0,
                                                                "duplicates": 0, "unknown": 0, "malformed_replies": 0})


def test_a_row_holding_a_unicode_line_separator_is_one_row(tmp_path):
    # str.splitlines cut it at U+2028 (json.dumps leaves it unescaped with ensure_ascii=False): one row read
    # as two broken ones, its counts lost, and the line count (the next skip) off by one.
    log = tmp_path / "parse.jsonl"
    log.write_text(json.dumps({"calls": 2, "malformed": 1, "note": "a\u2028b"}, ensure_ascii=False) + "\n"
                   + json.dumps({"calls": 1}) + "\n", encoding="utf-8")
    n, totals = parse_log_totals(log)
    assert n == 2 and totals["replies"] == 2 and totals["calls"] == 3 and totals["malformed"] == 1
    (tmp_path / "empty.jsonl").write_text("")
    assert parse_log_totals(tmp_path / "empty.jsonl")[0] == 0


def _rec(episode, step, call_id, tool, args, decision="accept", reason="accepted"):
    return json.dumps({"task_id": episode, "step": step, "call_id": call_id, "tool": tool, "args": args,
                       "decision": decision, "reason": reason})


def test_duplicates_are_counted_per_model_turn_and_per_method(tmp_path):
    log = tmp_path / "logs.jsonl"
    lines = [
        _rec("raw:t1:0", 0, "a", "quote", {"s": "ACME"}),
        _rec("raw:t1:0", 0, "b", "quote", {"s": "ACME"}, "invalid", "duplicate_call"),
        _rec("raw:t1:0", 0, "b", "quote", {"s": "ACME"}, "invalid", "duplicate_call"),  # same call id: one proposal
        _rec("raw:t1:0", 0, "c", "quote", {"s": "HOOLI"}),
        _rec("raw:t1:0", 1, "d", "quote", {"s": "ACME"}),  # a later turn: not a duplicate
        _rec("raw:t1:0", 1, "e", "made_up_tool", {}, "invalid", "unknown_tool"),
        _rec("tracker:t1:0", 0, "f", "quote", {"s": "ACME"}),
        _rec("raw:t1:1", 0, "g", "quote", {"s": "ACME"}),  # another seed
    ]
    log.write_text("\n".join(lines) + "\n")
    assert proposal_stats(log, "raw", 0) == {"proposals": 5, "duplicates": 1, "invalid": 1}
    assert proposal_stats(log, "tracker", 0) == {"proposals": 1, "duplicates": 0, "invalid": 0}


def test_stats_table_has_a_row_per_method_and_dashes_for_missing_numbers():
    table = stats_table({"raw": {"PR": 0.0, "duplicate_call_pct": 80.8}, "tracker": {}})
    lines = table.splitlines()
    assert len(lines) == 4 and lines[2].startswith("| raw | 0.0 |") and "80.8" in lines[2]
    assert lines[3].count("| - ") == 21


# -- the serving command -------------------------------------------------------------------------------

def _fake_install(tmp_path: Path, device: str) -> Path:
    venv = tmp_path / f"venv-{device}"
    (venv / "bin").mkdir(parents=True)
    (venv / ".installed").write_text(device + "\n")
    return venv


def _model_dir(tmp_path: Path, template: str) -> Path:
    model = tmp_path / "tiny-model"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text("{}")
    (model / "chat_template.jinja").write_text(template)
    return model


def _print_cmd(venv: Path, model: str, tmp_path: Path) -> subprocess.CompletedProcess:
    env = {"PATH": "/usr/bin:/bin", "VLLM_VENV": str(venv), "STATE_DIR": str(tmp_path / "state"), "PORT": "8123"}
    return subprocess.run(["bash", str(ROOT / "scripts" / "serve_llm.sh"), "--print", model], capture_output=True,
                          text=True, env=env, timeout=60)


def test_serve_script_command_on_cpu(tmp_path):
    model = _model_dir(tmp_path, "{%- if tools %}...{%- endif %}")
    out = _print_cmd(_fake_install(tmp_path, "cpu"), str(model), tmp_path)
    assert out.returncode == 0, out.stderr
    cmd = out.stdout.split()
    flag = {k: cmd[cmd.index(k) + 1] for k in ("--gpu-memory-utilization", "--max-model-len", "--tool-call-parser",
                                                "--tool-parser-plugin", "--served-model-name", "--port", "--model")}
    assert cmd[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
    assert flag["--gpu-memory-utilization"] == "0.4" and flag["--max-model-len"] == "8192"
    assert flag["--tool-call-parser"] == "intent_lenient" and "--enable-auto-tool-choice" in cmd
    assert Path(flag["--tool-parser-plugin"]) == ROOT / "intent_vllm" / "vllm_plugin.py"
    assert Path(flag["--tool-parser-plugin"]).exists()
    assert flag["--served-model-name"] == "tiny-model" and flag["--port"] == "8123"
    assert "warning" not in out.stderr


def test_serve_script_on_gpu_reserves_more_memory_and_warns_about_a_template_without_tools(tmp_path):
    model = _model_dir(tmp_path, "{{ messages }}")
    out = _print_cmd(_fake_install(tmp_path, "gpu"), str(model), tmp_path)
    assert out.returncode == 0, out.stderr
    assert "--gpu-memory-utilization 0.9" in out.stdout
    assert "does not mention tools" in out.stderr


@pytest.mark.parametrize("model", ["no-such-dir", "./relative"])
def test_serve_script_rejects_a_model_that_is_neither_a_dir_nor_a_hub_id(tmp_path, model):
    out = _print_cmd(_fake_install(tmp_path, "cpu"), model, tmp_path)
    assert out.returncode == 2 and "neither a model directory nor a hub id" in out.stderr


def test_vllm_smoke_command_sets_the_memory_share():
    from training.serve import vllm_command

    cmd = vllm_command("runs/wm", port=8123, gpu_memory_utilization=0.4)
    assert cmd[cmd.index("--gpu-memory-utilization") + 1] == "0.4"
    assert cmd[-2:] == ["--served-model-name", "wm"]
    smoke = (ROOT / "scripts" / "vllm_smoke.sh").read_text()
    assert "gpu_memory_utilization=float(sys.argv[4])" in smoke and "GPU_MEM=${GPU_MEM:-0.4}" in smoke


def test_oracle_log_collection_prints_a_heartbeat_until_complete(tmp_path, capsys):
    import time

    from eval.agents.llm_bench import _CollectionHeartbeat

    data = tmp_path / "oracle_data"
    data.mkdir()
    (data / "logs.jsonl").write_text('{"task_id": "prompt:a:1"}\n{"task_id": "prompt:a:1"}\n{"task_id": "prompt:b:1"}\n')
    out = ""
    with _CollectionHeartbeat(tmp_path, "intent", 10, every_s=0.05):
        deadline = time.monotonic() + 20  # a loaded CI machine may delay the heartbeat thread
        while "episodes with tool calls" not in out and time.monotonic() < deadline:
            time.sleep(0.05)
            out += capsys.readouterr().out
    out += capsys.readouterr().out
    assert "intent needs oracle logs: the Prompt agent first runs 10 tasks" in out
    assert "2 episodes with tool calls so far" in out
    (data / "COMPLETE").write_text("ok\n")
    with _CollectionHeartbeat(tmp_path, "intent", 10, every_s=0.05):
        time.sleep(0.2)
    assert capsys.readouterr().out == ""  # logs already collected: nothing to wait for


def test_oracle_logs_say_which_market_they_belong_to():
    # A synthetic run's logs would give StableToolBench's oracles a world model of tools it does not have.
    from eval.agents.llm_bench import oracle_logs_by_market

    assert oracle_logs_by_market(None, ["synthetic", "stabletoolbench"]) == {}
    assert oracle_logs_by_market("a.jsonl", ["synthetic"]) == {"synthetic": "a.jsonl"}
    assert oracle_logs_by_market("synthetic=a.jsonl", ["synthetic", "stabletoolbench"]) == {"synthetic": "a.jsonl"}
    assert oracle_logs_by_market("synthetic=a.jsonl, stabletoolbench=b.jsonl", ["synthetic", "stabletoolbench"]) == {
        "synthetic": "a.jsonl", "stabletoolbench": "b.jsonl"}
    with pytest.raises(ValueError, match="several markets.*--oracle-logs synthetic=a.jsonl"):
        oracle_logs_by_market("a.jsonl", ["synthetic", "stabletoolbench"])
    with pytest.raises(ValueError, match="'cosmic=a.jsonl' is not MARKET=PATH"):
        oracle_logs_by_market("cosmic=a.jsonl", ["synthetic"])


def test_llm_stats_show_the_planning_oracles_cost(tmp_path):
    # With a real model INTENT's rollouts call it too: tokens per episode, seconds per decision, cache hits.
    from eval.agents.llm_bench import method_stats, stats_table

    rows = [{"method": "intent", "seed": 0, "task_id": f"t{i}", "agent_tokens": 100, "wall_s": 10.0} for i in range(2)]
    (tmp_path / "episodes.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    # The metrics as the runner computes them (names and units included): 2 episodes, 4 decisions.
    from eval.metrics import compute_metrics
    from eval.results import EpisodeResult

    results = [EpisodeResult("intent", f"t{i}", 0, budget=10.0, cost=5.0, oracle_tokens=4500,
                             decision_ms=[4300.0, 4300.0],
                             extra={"oracle_usage": {"cache_hit": float(i), "rollout_capped": 1.0}})
               for i in range(2)]
    metrics = compute_metrics(results)["intent"]
    s = method_stats(tmp_path, "intent", 0, metrics)
    assert (s["oracle_tokens_per_episode"], s["decision_s_mean"], s["oracle_cache_hit_pct"]) == (4500, 4.3, 25.0)
    table = stats_table({"intent": s, "tracker": method_stats(tmp_path, "tracker", 0, {"PR": 0.0})})
    header, _, intent, tracker = table.splitlines()
    assert "oracle tok/ep | s/decision | plan cache% | capped rollouts |" in header
    assert intent.endswith("| 4500 | 4.3 | 25.0 | 2 |") and tracker.endswith("| - | - | - | - |")
