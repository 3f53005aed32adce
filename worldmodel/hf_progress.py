"""Hugging Face libraries' own progress bars, off when nobody watches them.

transformers draws tqdm bars while it loads and saves weights ("Loading weights", "Writing model
shards"), and huggingface_hub while it downloads. In a log file they are carriage-return noise
between the project's progress lines (:mod:`intent.progress`: a bar on a TTY, otherwise a line at
least every 10 s with an ETA), so off a TTY they are turned off. The project's own lines do not go
through these libraries and are kept.
"""

from __future__ import annotations

import functools
import sys
from typing import TextIO

__all__ = ["hide_gguf_conversion_bar_off_a_tty", "hide_hf_progress_bars_off_a_tty"]


def hide_hf_progress_bars_off_a_tty(stream: TextIO | None = None) -> bool:
    """Turn transformers' and huggingface_hub's progress bars off (for the whole process) when ``stream``
    (default: stderr, where tqdm draws) is not a terminal. Never turns them on: a user's
    ``HF_HUB_DISABLE_PROGRESS_BARS=1`` stays in force on a TTY. Returns whether they were turned off."""
    if (stream or sys.stderr).isatty():
        return False
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()  # huggingface_hub's too (it calls disable_progress_bars())
    return True


def hide_gguf_conversion_bar_off_a_tty(stream: TextIO | None = None) -> bool:
    """Turn off, as :func:`hide_hf_progress_bars_off_a_tty` does the others, transformers' GGUF loader's bar
    ("Converting and de-quantizing GGUF tensors...", drawn converting the default world-model base): that loader
    draws with tqdm directly, past transformers' switch. Returns whether it is off."""
    if (stream or sys.stderr).isatty():
        return False
    from transformers import modeling_gguf_pytorch_utils as gguf_utils

    if not getattr(gguf_utils.tqdm, "intent_quiet", False):
        quiet = functools.partial(gguf_utils.tqdm, disable=True)
        quiet.intent_quiet = True  # type: ignore[attr-defined]  # (once: a second call finds it quiet)
        gguf_utils.tqdm = quiet
    return True
