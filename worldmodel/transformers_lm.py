"""A world model from a Hugging Face causal LM directory, in-process (CPU here, GPU in production).

``TransformersWorldModel(model_dir, *, device="cpu", max_new_tokens=256, temperature=1.0)``;
``simulate(..., temperature=t)`` overrides the temperature for one call (0: greedy decoding).
Uses the tokenizer's chat template when it has one (the format ``intent train worldmodel``
trains on), else the plain prompt of :mod:`worldmodel.formats`.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from worldmodel.formats import (
    check_format_version,
    world_model_messages,
    world_model_prompt,
)
from worldmodel.protocols import ModelError

__all__ = ["TransformersWorldModel", "prompt_ids", "render_prompt"]


def render_prompt(tokenizer: Any, tool: str, args: Mapping[str, Any] | str, satisfied: bool | None) -> str:
    """The exact text the causal LM sees before the observation (shared with training)."""
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(world_model_messages(tool, args, satisfied), tokenize=False,
                                             add_generation_prompt=True)
    return world_model_prompt(tool, args, satisfied) + "\n"


def prompt_ids(tokenizer: Any, tool: str, args: Mapping[str, Any] | str, satisfied: bool | None) -> list[int]:
    """The prompt's token ids, the same for training, in-process inference and the trainer's samples:
    :func:`render_prompt` tokenized without the tokenizer's own special tokens. A chat template writes its
    start token itself, and vLLM's chat endpoint adds none on top of it (``add_special_tokens`` is false
    there by default), so a served model sees these ids too. (Was: inference added them, a second start
    token after a Llama template's, ``[CLS] ... [SEP]`` around a BERT-tokenizer prompt: not what it was
    trained on.)"""
    return tokenizer(render_prompt(tokenizer, tool, args, satisfied), add_special_tokens=False)["input_ids"]


class TransformersWorldModel:
    name = "transformers"

    def __init__(self, model_dir: str | Path, *, device: str = "cpu", max_new_tokens: int = 256,
                 temperature: float = 1.0, seed: int = 0) -> None:
        try:
            import torch
            from transformers import AutoModelForCausalLM, AutoTokenizer
        except ImportError as exc:  # pragma: no cover
            raise ImportError("TransformersWorldModel needs torch and transformers: `make install`") from exc
        path = Path(model_dir)
        if not (path / "config.json").exists():
            raise FileNotFoundError(f"{path} is not a Hugging Face model directory (no config.json)")
        check_format_version(path)
        from worldmodel.hf_progress import hide_hf_progress_bars_off_a_tty

        hide_hf_progress_bars_off_a_tty()  # transformers' "Loading weights" bar, in a benchmark's log
        self._torch = torch
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.model = AutoModelForCausalLM.from_pretrained(path).to(device).eval()
        self.device, self.max_new_tokens, self.temperature = device, max_new_tokens, temperature
        self._generator = torch.Generator(device="cpu").manual_seed(seed)
        self._lock = threading.Lock()

    def fork(self, seed: int) -> TransformersWorldModel:
        """A view sharing the weights (and their lock) with its own sampling stream: one per episode,
        so that sampled rollouts do not depend on which thread reached the model first."""
        import copy

        twin = copy.copy(self)
        twin._generator = self._torch.Generator(device="cpu").manual_seed(seed)
        return twin

    def simulate(self, tool: str, args: Mapping[str, Any], *, satisfied: bool | None = None,
                 temperature: float | None = None) -> str:
        return self.simulate_with_usage(tool, args, satisfied=satisfied, temperature=temperature)[0]

    def simulate_with_usage(self, tool: str, args: Mapping[str, Any], *, satisfied: bool | None = None,
                            temperature: float | None = None) -> tuple[str, int]:
        """``temperature`` is this call's sampling temperature (None: the one set at construction; 0: greedy)."""
        torch = self._torch
        t = self.temperature if temperature is None else float(temperature)
        ids = torch.tensor([prompt_ids(self.tokenizer, tool, args, satisfied)], device=self.device)
        enc = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
        sample = t > 0
        try:
            with self._lock, torch.no_grad():
                torch.manual_seed(int(torch.randint(0, 2**31 - 1, (1,), generator=self._generator)))
                out = self.model.generate(
                    **enc, max_new_tokens=self.max_new_tokens, do_sample=sample,
                    temperature=t if sample else None, top_p=None, top_k=None,
                    pad_token_id=self.tokenizer.pad_token_id or self.tokenizer.eos_token_id,
                )
        except RuntimeError as exc:
            raise ModelError(f"transformers world model failed: {exc}") from exc
        new = out[0, enc["input_ids"].shape[1]:]
        return self.tokenizer.decode(new, skip_special_tokens=True).strip(), int(out.shape[1])
