"""results.md names the ``intent bench`` command that reproduces its numbers (eval/bench_command.py)."""

from __future__ import annotations

import shlex
from dataclasses import asdict

import pytest

from eval.bench_command import bench_command
from eval.cli import bench_config
from intent.cli import build_parser


def _config(argv: list[str]):
    return bench_config(build_parser().parse_args(argv))


def _as_summary_config(config) -> dict:
    return {**asdict(config), "methods": list(config.methods)}  # as run_benchmark records it


ARGVS = [
    ["bench", "--tasks", "3"],
    ["bench", "--market", "synthetic-v2", "--agent", "sim-llm", "--methods", "tracker,mco,intent", "--tasks", "100",
     "--workers", "1", "--seed", "7", "--out", "runs/x y", "--charge-oracle", "500", "--oracle-max-tokens", "20000",
     "--oracle-tasks", "40", "--gamma", "0.25", "--delta", "0.05", "--predictor", "encoder", "--encoder-epochs", "0",
     "--paired-with", "tracker,mco", "--reference", "tracker", "--event-rate", "0.3", "--budget", "40.5",
     "--max-depth", "3", "--rollout-max-tokens", "64", "--feedback-chars", "300",
     "--allow-code-change"],
    ["bench", "--market", "stabletoolbench", "--agent", "openai:qwen", "--base-url", "http://127.0.0.1:8000/v1",
     "--max-tokens", "256", "--max-turns", "12", "--methods", "raw,btp,mco", "--groups", "G1_instruction,G2_category", "--no-solvability",
     "--stb-env", "mirror", "--stb-env-url", "http://h:1/v1", "--stb-env-model", "mirror", "--retriever", "tfidf",
     "--judge", "sopr", "--judge-url", "http://j/v1", "--judge-model", "gpt-4.1-mini", "--judge-runs", "2",
     "--oracle-logs", "logs a.jsonl", "--world-model", "schema"],
]


@pytest.mark.parametrize("argv", ARGVS)
def test_the_written_command_runs_the_same_configuration(argv):
    config = _config(argv)
    command = bench_command(_as_summary_config(config))
    assert command is not None and command.startswith("intent bench ")
    again = _config(shlex.split(command)[1:])
    assert again == config


def test_a_configuration_no_flag_gives_has_no_command():
    from eval.runner import BenchConfig

    assert bench_command(_as_summary_config(BenchConfig(budget_scale=0.5))) is None
    assert bench_command(_as_summary_config(BenchConfig(options={"plugin_knob": 1}))) is None


def test_results_md_names_the_command(tmp_path):
    from intent.cli import main

    out = tmp_path / "run"
    assert main(["bench", "--tasks", "2", "--methods", "raw,tracker", "--seed", "3", "--no-progress",
                 "--out", str(out)]) == 0
    lines = [line for line in (out / "results.md").read_text().splitlines() if line.startswith("- command: `")]
    assert len(lines) == 1
    command = lines[0].removeprefix("- command: `").removesuffix("`")
    # The reference the run resolved (raw: the first method) is written out.
    assert _config(shlex.split(command)[1:]) == _config(["bench", "--tasks", "2", "--methods", "raw,tracker",
                                                          "--seed", "3", "--out", str(out), "--reference", "raw"])
