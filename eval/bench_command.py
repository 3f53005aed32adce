"""The ``intent bench`` command that reproduces a run, written from its configuration into ``results.md``
(every number in a report names the command that produced it)."""

from __future__ import annotations

import shlex
from collections.abc import Mapping
from typing import Any

# BenchConfig.options key -> the flag that sets it (eval/cli.py builds options from these flags).
_VALUE_FLAGS = {
    "base_url": "--base-url", "max_tokens": "--max-tokens", "stb_path": "--stb-path", "gamma": "--gamma",
    "delta": "--delta", "predictor": "--predictor", "encoder_epochs": "--encoder-epochs",
    "charge_oracle": "--charge-oracle", "oracle_max_tokens": "--oracle-max-tokens", "feedback_chars": "--feedback-chars",
    "rollout_max_tokens": "--rollout-max-tokens", "max_turns": "--max-turns", "max_depth": "--max-depth",
    "judge_runs": "--judge-runs", "oracle_train_tasks": "--oracle-tasks", "stb_env": "--stb-env",
    "stb_env_url": "--stb-env-url", "stb_env_model": "--stb-env-model", "retriever": "--retriever",
    "oracle_logs": "--oracle-logs", "predictor_dir": "--predictor-dir", "judge": "--judge", "judge_url": "--judge-url",
    "judge_model": "--judge-model", "world_model": "--world-model",
}
_LIST_FLAGS = {"groups": "--groups", "paired_with": "--paired-with"}


def bench_command(config: Mapping[str, Any]) -> str | None:
    """The command line, or ``None`` when the run was configured in Python with settings no flag gives
    (the study's budget scales, a plugin's own options)."""
    if config.get("budget_scale", 1.0) != 1.0 or config.get("relevant_price_scale", 1.0) != 1.0:
        return None
    argv = ["intent", "bench", "--market", str(config["market"]), "--agent", str(config["agent"]),
            "--methods", ",".join(config["methods"]), "--tasks", str(config["tasks"]),
            "--workers", str(config["workers"]), "--seed", str(config["seed"]), "--out", str(config["out"])]
    if config.get("reference"):
        argv += ["--reference", str(config["reference"])]
    if config.get("event_rate"):
        argv += ["--event-rate", repr(config["event_rate"])]
    if config.get("budget") is not None:
        argv += ["--budget", repr(config["budget"])]
    for key, value in (config.get("options") or {}).items():
        if key in _VALUE_FLAGS:
            argv += [_VALUE_FLAGS[key], repr(value) if isinstance(value, float) else str(value)]
        elif key in _LIST_FLAGS:
            argv += [_LIST_FLAGS[key], ",".join(map(str, value))]
        elif key == "solvability" and value is False:
            argv.append("--no-solvability")
        elif key == "allow_code_change" and value is True:
            argv.append("--allow-code-change")
        else:
            return None
    return shlex.join(argv)
