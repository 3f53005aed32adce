"""``intent serve worldmodel DIR``: the vLLM OpenAI-compatible server for a trained directory.

vLLM lives in its own virtual environment (it pins transformers < 5.20): see
``scripts/vllm_smoke.sh``. ``--print`` only prints the command.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

__all__ = ["serve", "vllm_command"]


def vllm_command(model_dir: str | Path, *, host: str = "127.0.0.1", port: int = 8000, dtype: str = "bfloat16",
                 python: str = "python") -> list[str]:
    path = Path(model_dir)
    return [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(path), "--host", host,
            "--port", str(port), "--dtype", dtype, "--served-model-name", path.name]


def serve(model_dir: str | Path, *, print_only: bool = False, python: str | None = None, **kw: object) -> int:
    if not (Path(model_dir) / "config.json").exists():
        raise FileNotFoundError(f"{model_dir} is not an exported model directory (no config.json)")
    python = python or os.environ.get("INTENT_VLLM_PYTHON") or (".venv-vllm/bin/python" if
                                                                Path(".venv-vllm/bin/python").exists() else "python")
    cmd = vllm_command(model_dir, python=python, **kw)  # type: ignore[arg-type]
    print(" ".join(cmd))
    if print_only:
        return 0
    if shutil.which(python) is None and not Path(python).exists():
        raise FileNotFoundError(f"{python} not found; build the vLLM environment with scripts/vllm_smoke.sh or set "
                                "INTENT_VLLM_PYTHON")
    os.execvp(cmd[0], cmd)
    return 1  # pragma: no cover


if __name__ == "__main__":  # pragma: no cover
    sys.exit(serve(sys.argv[1]))
