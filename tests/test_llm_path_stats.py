"""`make bench-llm`'s pieces that need no server: the vLLM command the scripts build, the /metrics
and parser-log readers, and the per-method call statistics from the guard's log."""

from __future__ import annotations

import json
import subprocess
import warnings
from dataclasses import asdict
from pathlib import Path

import pytest

from eval.agents.llm_bench import (method_stats, parse_log_totals, parse_metrics, proposal_stats, server_stats,
                                   stats_table)
from eval.results import EpisodeResult, ResultsFormatError, ResultStore
from intent.errors import LogFormatError, UsageError
from intent.logs import StepRecord

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
    assert n == 3  # the torn row is not counted: the next method's read (skip=3) sees it once it is whole
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


def _rec(episode, step, call_id, tool, args, decision="accept", reason="accepted", **kw):
    fields = dict(task_id=episode, step=step, call_id=call_id, tool=tool, args=args, decision=decision, reason=reason,
                  status={"accept": "ok", "invalid": "invalid", "reject": "rejected"}[decision],
                  execution=int(decision == "accept"), spent=0.0, remaining=50.0, budget=50.0)
    return StepRecord(**{**fields, **kw}).model_dump_json()


def _write(path, records, end="\n"):
    path.write_text("\n".join(records) + end, encoding="utf-8")
    return path


def test_duplicates_are_counted_per_model_turn_and_per_method(tmp_path):
    lines = [
        _rec("raw:t1:0", 0, "a", "quote", {"s": "ACME"}),
        _rec("raw:t1:0", 0, "b", "quote", {"s": "ACME"}, "invalid", "duplicate_call"),
        _rec("raw:t1:0", 0, "a", "quote", {"s": "ACME"}, execution=2),  # a retried run: the same proposal
        _rec("raw:t1:0", 0, "c", "quote", {"s": "HOOLI"}),
        _rec("raw:t1:0", 1, "d", "quote", {"s": "ACME"}),  # a later turn: not a duplicate
        _rec("raw:t1:0", 1, "e", "made_up_tool", {}, "invalid", "unknown_tool"),
        _rec("tracker:t1:0", 0, "f", "quote", {"s": "ACME"}),
        _rec("raw:t1:1", 0, "g", "quote", {"s": "ACME"}),  # another seed
        _rec("raw:t1:0", 1, "m", "qwen", {}, kind="model"),  # the agent's model call: no tool call proposed
    ]
    log = _write(tmp_path / "logs.jsonl", lines)
    assert proposal_stats(log, "raw", 0, ["t1"]) == {"proposals": 5, "duplicates": 1, "invalid": 1}
    assert proposal_stats(log, "tracker", 0, ["t1"]) == {"proposals": 1, "duplicates": 0, "invalid": 0}


def test_a_method_whose_name_starts_another_keeps_its_own_calls(tmp_path):
    # Episode ids are method:task:seed, and a method may hold ':' (openai:gpt-x): matched by prefix 'intent:' and
    # suffix ':0', intent took in the calls of intent:fit (and of a task 'fit:t1' it never ran).
    log = _write(tmp_path / "logs.jsonl", [
        _rec("intent:t1:0", 0, "a", "quote", {"s": "ACME"}),
        _rec("intent-fit:t1:0", 0, "b", "quote", {"s": "ACME"}),
        _rec("intent:fit:t1:0", 0, "c", "quote", {"s": "ACME"}),
        _rec("intent:fit:t1:0", 0, "d", "quote", {"s": "HOOLI"}),
    ])
    assert proposal_stats(log, "intent", 0, ["t1"])["proposals"] == 1
    assert proposal_stats(log, "intent-fit", 0, ["t1"])["proposals"] == 1
    assert proposal_stats(log, "intent:fit", 0, ["t1"])["proposals"] == 2


def test_an_episode_a_resumed_run_re_ran_counts_by_its_last_attempt(tmp_path):
    # episodes.jsonl keeps the last attempt's result; its calls must be that attempt's, not the sum of all.
    store = ResultStore(tmp_path / "episodes.jsonl")
    for task, error in (("t1", "RuntimeError: endpoint down"), ("t1", ""), ("t2", "RuntimeError: endpoint down"),
                        ("t2", "")):
        store.append(EpisodeResult("raw", task, 0, budget=50.0, error=error))
    _write(tmp_path / "logs.jsonl", [
        _rec("raw:t1:0", 0, "a", "quote", {"s": "ACME"}),  # t1, attempt 1: three turns, then a crash
        _rec("raw:t1:0", 1, "b", "quote", {"s": "ACME"}),
        _rec("raw:t1:0", 2, "c", "made_up_tool", {}, "invalid", "unknown_tool"),
        _rec("raw:t1:0", 0, "a", "quote", {"s": "HOOLI"}),  # attempt 2: step 0 again
        _rec("raw:t2:0", 0, "x", "quote", {"s": "ACME"}),  # t2, attempt 1 crashed in its first turn
        _rec("raw:t2:0", 0, "x", "quote", {"s": "ACME"}),  # attempt 2: the same call logged again
        _rec("raw:t2:0", 0, "y", "quote", {"s": "ACME"}),
    ])
    assert proposal_stats(tmp_path / "logs.jsonl", "raw", 0, ["t1"]) == {"proposals": 1, "duplicates": 0, "invalid": 0}
    assert proposal_stats(tmp_path / "logs.jsonl", "raw", 0, ["t2"]) == {"proposals": 2, "duplicates": 1, "invalid": 0}
    s = method_stats(tmp_path, "raw", 0, {})
    assert (s["episodes"], s["crashed"], s["proposed_calls"], s["duplicate_calls"]) == (2, 0, 3, 1)


def _good_rows(name):
    if name == "logs.jsonl":
        return [_rec("raw:t1:0", step, f"c{step}", "quote", {"s": "ACME"}) for step in range(3)]
    if name == "episodes.jsonl":
        return [json.dumps(asdict(EpisodeResult("raw", f"t{i}", 0)), sort_keys=True) for i in range(3)]
    return [json.dumps({"calls": 1, "malformed": 0}) for _ in range(3)]  # the tool parser's log


def _read(tmp_path, name):
    """What make bench-llm reads from the file ``name`` of a run directory."""
    if name == "parse.jsonl":
        return parse_log_totals(tmp_path / name)
    if name == "logs.jsonl":
        return proposal_stats(tmp_path / name, "raw", 0, ["t1"])
    return method_stats(tmp_path, "raw", 0, {})


@pytest.mark.parametrize("name", ["logs.jsonl", "episodes.jsonl", "parse.jsonl"])
def test_a_corrupt_line_in_the_middle_is_an_error_naming_file_and_line(tmp_path, name):
    # Skipped, it made the figures quietly smaller; a crash tears at most the last line, so this is damage.
    rows = _good_rows(name)
    rows[1] = rows[1][:25]
    _write(tmp_path / name, rows)
    with pytest.raises(ResultsFormatError if name == "episodes.jsonl" else LogFormatError, match=rf"{name}:2: "):
        _read(tmp_path, name)


@pytest.mark.parametrize("name", ["logs.jsonl", "episodes.jsonl", "parse.jsonl"])
def test_a_torn_last_line_is_skipped(tmp_path, name):
    # A last line without its newline is a write cut short (a crash, or a writer mid-line): read what is whole.
    rows = _good_rows(name)
    _write(tmp_path / name, [*rows, rows[0][:25]], end="")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # ResultStore.load(repair=False) says it skipped the line
        out = _read(tmp_path, name)
    if name == "parse.jsonl":
        assert out == (3, {"replies": 3, "calls": 3, "malformed": 0, "duplicates": 0, "unknown": 0,
                           "malformed_replies": 0})
    elif name == "logs.jsonl":
        assert out == {"proposals": 3, "duplicates": 0, "invalid": 0}
    else:
        assert out["episodes"] == 3
    assert (tmp_path / name).read_text(encoding="utf-8").endswith(rows[0][:25])  # read only: the file is untouched


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
    store = ResultStore(tmp_path / "episodes.jsonl")
    for i in range(2):
        store.append(EpisodeResult("intent", f"t{i}", 0, agent_tokens=100, wall_s=10.0))
    # The metrics as the runner computes them (names and units included): 2 episodes, 4 decisions.
    from eval.metrics import compute_metrics

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


@pytest.mark.parametrize("value", ["5", "-1"])
def test_a_bad_rollout_cap_is_refused_before_the_server_is_asked(value):
    # The runner refused it only after the model check had reached the server (make bench-llm: after the
    # server's cold start). Port 9 has no server: reaching it would be an EndpointError, not this one.
    from eval.agents.llm_bench import main

    with pytest.raises(UsageError, match="--rollout-max-tokens must be an integer >= 16"):
        main(["--base-url", "http://127.0.0.1:9/v1", "--model", "m", "--rollout-max-tokens", value])


def test_a_served_models_re_run_from_step_0_is_told_apart_by_its_attempt_number(tmp_path):
    # With a served model the call ids are fresh (chatcmpl-tool-<uuid>): attempt 1 crashed after step 0 and
    # attempt 2 started at step 0 again; by steps and ids the two were one attempt (3 proposals, one "duplicate").
    # The runner numbers attempts in the results and the log records; the kept result's attempt is counted.
    store = ResultStore(tmp_path / "episodes.jsonl")
    store.append(EpisodeResult("raw", "t1", 0, budget=50.0, error="RuntimeError: endpoint down", extra={"attempt": 1}))
    store.append(EpisodeResult("raw", "t1", 0, budget=50.0, extra={"attempt": 2}))
    rows = [
        (1, _rec("raw:t1:0", 0, "chatcmpl-tool-a1", "quote", {"s": "ACME"})),  # attempt 1, then a crash
        (2, _rec("raw:t1:0", 0, "chatcmpl-tool-b1", "quote", {"s": "ACME"})),  # attempt 2: step 0 again
        (2, _rec("raw:t1:0", 0, "chatcmpl-tool-b2", "quote", {"s": "HOOLI"})),
        (3, _rec("raw:t1:0", 0, "chatcmpl-tool-c1", "quote", {"s": "ACME"})),  # attempt 3: died, no result
    ]
    _write(tmp_path / "logs.jsonl", [json.dumps({**json.loads(line), "attempt": n}) for n, line in rows])
    s = method_stats(tmp_path, "raw", 0, {})
    assert (s["episodes"], s["crashed"], s["proposed_calls"], s["duplicate_calls"]) == (1, 0, 2, 0)
    # Without the results: the last attempt logged.
    assert proposal_stats(tmp_path / "logs.jsonl", "raw", 0, ["t1"]) == {"proposals": 1, "duplicates": 0,
                                                                          "invalid": 0}


def test_a_top_up_logged_at_step_minus_1_starts_no_attempt_and_is_no_proposal(tmp_path):
    # A budget top-up is a kind="tool" record at step -1: in a log without attempt numbers the step heuristic read
    # the step falling back to -1 as a re-run, and the episode's calls before it were dropped as an older attempt.
    log = _write(tmp_path / "logs.jsonl", [
        _rec("raw:t1:0", 0, "a", "quote", {"s": "ACME"}),
        _rec("raw:t1:0", 1, "b", "quote", {"s": "HOOLI"}),
        StepRecord(task_id="raw:t1:0", step=-1, call_id="top-up-1", tool="", price=10.0, decision="top_up",
                   reason="top_up", status="ok", spent=2.0, remaining=58.0, budget=60.0).model_dump_json(),
        _rec("raw:t1:0", 2, "c", "quote", {"s": "ACME"}),
    ])
    assert proposal_stats(log, "raw", 0, ["t1"]) == {"proposals": 3, "duplicates": 0, "invalid": 0}
