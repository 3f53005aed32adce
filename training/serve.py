"""``intent serve worldmodel DIR``: the vLLM OpenAI-compatible server for a trained directory.

vLLM lives in its own virtual environment (it pins transformers < 5.20): see
``scripts/vllm_smoke.sh``. ``--print`` only prints the command.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import sys
from pathlib import Path

from intent.errors import UsageError

__all__ = ["serve", "vllm_command"]


def vllm_command(model_dir: str | Path, *, host: str = "127.0.0.1", port: int = 8000, dtype: str = "bfloat16",
                 python: str = "python", gpu_memory_utilization: float | None = None) -> list[str]:
    """The server command; the served model name (last) is the directory's name.

    ``gpu_memory_utilization``: on vLLM's CPU build the share of host memory vLLM reserves (0.4
    here: 0.2 leaves no room for the KV cache; the default 0.92 fails at start unless 92% of the
    host's memory is free, see vllm/v1/worker/cpu_worker.py).
    """
    if isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65535:
        # vLLM would take minutes to load the model before its socket refused it.
        raise UsageError(f"--port must be a TCP port, 1 to 65535, got {port!r}")
    path = Path(model_dir)
    name = path.name or Path(os.path.abspath(path)).name  # "." or "..": the directory's own name, never ""
    mem = ["--gpu-memory-utilization", str(gpu_memory_utilization)] if gpu_memory_utilization else []
    return [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(path), "--host", host,
            "--port", str(port), "--dtype", dtype, *mem, "--served-model-name", name]


def _vllm_python() -> str | None:
    """The vLLM environment's python: $INTENT_VLLM_PYTHON, else ``.venv-vllm`` here or at the project's root."""
    given = os.environ.get("INTENT_VLLM_PYTHON")
    if given:
        return given
    for root in (Path.cwd(), Path(__file__).resolve().parents[1]):
        if (root / ".venv-vllm" / "bin" / "python").exists():
            return str(root / ".venv-vllm" / "bin" / "python")
    return None


def serve(model_dir: str | Path, *, print_only: bool = False, python: str | None = None, **kw: object) -> int:
    config = Path(model_dir) / "config.json"
    if not config.exists():
        raise FileNotFoundError(f"{model_dir} is not an exported model directory (no config.json)")
    try:
        architectures = json.loads(config.read_text()).get("architectures") or []
    except (json.JSONDecodeError, AttributeError) as exc:
        raise UsageError(f"{config} is not a model's config.json ({exc}); pass an exported model directory") from exc
    if any("SequenceClassification" in a for a in architectures):
        raise UsageError(f"{model_dir} is a classifier ({architectures[0]}: the intention predictor), not a generator; "
                         "vLLM serves the world model: `intent serve worldmodel DIR/worldmodel`")
    from worldmodel.formats import check_format_version

    check_format_version(model_dir)  # trained on other prompts than the OpenAI-compatible client sends
    python = python or _vllm_python()
    if python is None and not print_only:
        raise FileNotFoundError("no vLLM environment: build it with scripts/vllm_venv.sh (it makes .venv-vllm), or "
                                "set INTENT_VLLM_PYTHON to a python that has vllm")
    cmd = vllm_command(model_dir, python=python or ".venv-vllm/bin/python", **kw)  # type: ignore[arg-type]
    print(shlex.join(cmd))  # quoted: a path with a space survives a paste into a shell
    if print_only:
        return 0
    if shutil.which(python) is None and not Path(python).exists():
        raise FileNotFoundError(f"{python} not found; build the vLLM environment with scripts/vllm_venv.sh or set "
                                "INTENT_VLLM_PYTHON")
    os.execvp(cmd[0], cmd)
    return 1  # pragma: no cover


if __name__ == "__main__":  # pragma: no cover
    sys.exit(serve(sys.argv[1]))
