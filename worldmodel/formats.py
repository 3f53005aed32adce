"""The single definition of the prompts and serialisations that training and inference share.

Change a format here and both the training data builders (``training/``) and the inference
backends (``worldmodel/``) follow; :data:`FORMAT_VERSION` is saved with every trained model so
that a mismatch is detected at load time. :func:`canonical_args` (the arguments in the prompts) is
:func:`intent.model_protocols.canonical_args`, the oracles' cache key.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

# The canonical arguments are also the oracles' cache key, so they are defined in intent (which imports nothing
# above it) and shown in the prompts from there.
from intent.model_protocols import canonical_args

FORMAT_VERSION = 1

WORLD_MODEL_SYSTEM = (
    "You simulate the response of a tool (an API) to a call. Reply with the tool's raw output only: "
    "no explanations, no markdown."
)


def world_model_prompt(tool: str, args: Mapping[str, Any] | str, satisfied: bool | None = None) -> str:
    """The user turn of the world model. ``satisfied`` adds the z condition (conditional generator)."""
    lines = [f"Tool: {tool}", f"Arguments: {canonical_args(args)}"]
    if satisfied is True:
        lines.append("Condition: the call succeeds and returns what the caller needs.")
    elif satisfied is False:
        lines.append("Condition: the call fails or returns something the caller cannot use.")
    lines.append("Output:")
    return "\n".join(lines)


def world_model_messages(tool: str, args: Mapping[str, Any] | str, satisfied: bool | None = None) -> list[dict[str, str]]:
    return [
        {"role": "system", "content": WORLD_MODEL_SYSTEM},
        {"role": "user", "content": world_model_prompt(tool, args, satisfied)},
    ]


def predictor_text(reasoning: str, tool: str, args: Mapping[str, Any] | str, *, max_reasoning_chars: int = 1200) -> str:
    """The intention predictor's input: the reasoning (what the agent wants) and the call."""
    reasoning = " ".join((reasoning or "").split())[:max_reasoning_chars]
    return f"Intention: {reasoning}\nCall: {tool}({canonical_args(args)})"


# The intention predictor's classes, by index: its head's logit 1 is the call satisfying the intention
# (z = 1), which EncoderIntentionPredictor reads. Saved as the exported config's id2label/label2id so that a
# text-classification pipeline and the Hub's widget name them (was: LABEL_0 / LABEL_1).
PREDICTOR_LABELS = ("not_satisfied", "satisfied")


def check_format_version(model_dir: Any, *, record: str = "report.json") -> None:
    """Refuse a trained world-model directory whose ``record`` (written by ``intent train worldmodel``)
    names another :data:`FORMAT_VERSION`: it was trained on other prompts than this code sends. A
    directory without the record (a base model, an export from before it was recorded) is accepted."""
    import json
    from pathlib import Path

    from intent.errors import UsageError

    path = Path(model_dir) / record
    if not path.is_file():
        return
    try:
        version = json.loads(path.read_text()).get("format_version", FORMAT_VERSION)
    except (ValueError, AttributeError):
        return  # not our record; the model itself is checked by whoever loads it
    if version != FORMAT_VERSION:
        raise UsageError(f"{path}: format_version {version} != {FORMAT_VERSION}: this world model was trained on the "
                         "prompts of another version of worldmodel/formats.py; retrain it (intent train worldmodel)")


JUDGE_SYSTEM = (
    "You judge whether a tool call satisfied the intention the agent stated before making it. "
    "Answer with one word, YES or NO, then a short reason."
)


def judge_prompt(reasoning: str, tool: str, args: Mapping[str, Any] | str, observation: str,
                 *, max_observation_chars: int = 2000) -> str:
    return (
        f"Agent's reasoning: {reasoning}\nTool call: {tool}({canonical_args(args)})\n"
        f"Tool output: {observation[:max_observation_chars]}\n"
        "Did the output satisfy the intention of the call? Answer YES or NO."
    )


_YES_NO = re.compile(r"\b(YES|NO)\b", re.I)


def parse_judge(text: str) -> int | None:
    """1 for YES, 0 for NO, None when the reply says neither."""
    m = _YES_NO.search(text or "")
    return None if m is None else int(m.group(1).upper() == "YES")
