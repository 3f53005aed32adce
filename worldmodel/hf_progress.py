"""Hugging Face libraries' own progress bars, off when nobody watches them.

transformers draws tqdm bars while it loads and saves weights ("Loading weights", "Writing model
shards"), and huggingface_hub while it downloads. In a log file they are carriage-return noise
between the project's progress lines (:mod:`intent.progress`: a bar on a TTY, otherwise a line at
least every 10 s with an ETA), so off a TTY they are turned off. The project's own lines do not go
through these libraries and are kept.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from typing import TextIO

__all__ = ["gguf_conversion_bar_off_a_tty", "hide_hf_progress_bars_off_a_tty"]


def hide_hf_progress_bars_off_a_tty(stream: TextIO | None = None) -> bool:
    """Turn transformers' and huggingface_hub's progress bars off (for the whole process) when ``stream``
    (default: stderr, where tqdm draws) is not a terminal. Never turns them on: a user's
    ``HF_HUB_DISABLE_PROGRESS_BARS=1`` stays in force on a TTY. Returns whether they were turned off."""
    if (stream or sys.stderr).isatty():
        return False
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()  # huggingface_hub's too (it calls disable_progress_bars())
    return True


@contextlib.contextmanager
def gguf_conversion_bar_off_a_tty(stream: TextIO | None = None) -> Iterator[None]:
    """transformers' GGUF loader draws its own tqdm bar ("Converting and de-quantizing GGUF tensors..."),
    which its progress-bar switch does not reach (it calls tqdm directly): off a TTY, it is drawn disabled
    while this block runs. (Was: that bar, carriage returns and all, in the log of every world-model
    training on the default base.)"""
    if (stream or sys.stderr).isatty():
        yield
        return
    import functools

    from transformers import modeling_gguf_pytorch_utils as gguf_utils

    drawn = getattr(gguf_utils, "tqdm", None)
    if drawn is None:  # another transformers version: nothing of ours to turn off
        yield
        return
    gguf_utils.tqdm = functools.partial(drawn, disable=True)
    try:
        yield
    finally:
        gguf_utils.tqdm = drawn
