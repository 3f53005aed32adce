#!/usr/bin/env bash
# `make bench-llm`: the benchmark with a real LLM agent behind a local OpenAI-compatible server.
#
#   scripts/bench_llm.sh                                   # Qwen2.5-Coder-0.5B on vLLM's CPU build
#   MODEL=runs/models/my-model TASKS=20 scripts/bench_llm.sh
#   BASE_URL=http://127.0.0.1:8080/v1 SERVED_NAME=qwen scripts/bench_llm.sh   # use a running server
#
# 1. Unless BASE_URL is given, start vLLM with scripts/serve_llm.sh --background (or reuse the server
#    already serving MODEL on PORT); a server this script started is stopped at the end.
# 2. `intent probe`: does the served model produce well-formed tool calls? (stops below PROBE_MIN_RATE)
# 3. python -m eval.agents.llm_bench: per market, each of METHODS one at a time, then the table and
#    the LLM stats (malformed/duplicate/invalid-call rates, tokens, s/episode, server tok/s) into
#    OUT/<market>/results.json and OUT/<market>/llm_stats.json.
#
# Environment (defaults): MODEL (runs/models/qwen2.5-coder-0.5b-instruct), SERVED_NAME (MODEL's basename),
# METHODS (raw,prompt,tracker,intent), MARKETS (synthetic,stabletoolbench), TASKS (10 synthetic tasks),
# STB_TASKS (5 queries), ORACLE_TASKS (10: tasks the Prompt agent runs first to collect INTENT's oracle logs),
# MAX_TOKENS (512 per agent reply), ROLLOUT_MAX_TOKENS (160 per reply in INTENT's/MCO's rollouts),
# MAX_DEPTH (8: model turns per INTENT/MCO rollout; 3 on a CPU), REQUEST_TIMEOUT (600 s per agent request), MAX_TURNS (30 model calls per episode), FEEDBACK_CHARS (1500: refusal notes per turn), ORACLE_LOGS (none;
# MARKET=PATH[,MARKET=PATH] reuses an earlier run's OUT/<market>/oracle_data/logs.jsonl, a bare PATH only with
# one market), WORKERS (2), SEED (0), OUT (runs/bench-llm/<served name>), PORT (8000),
# BASE_URL (none: start a server), PROBE_MIN_RATE (0.5), KEEP_SERVER (0: stop a server we started),
# ALLOW_CODE_CHANGE (unset; 1: resume OUT/<market> though other code wrote its episodes).
# GPU: the same command; scripts/vllm_venv.sh installs plain vLLM there and GPU_MEM defaults to 0.9, e.g.
#   make bench-llm MODEL=Qwen/Qwen2.5-7B-Instruct TASKS=100
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
MAIN_PY=${MAIN_PY:-$ROOT/.venv/bin/python}
MODEL=${MODEL:-runs/models/qwen2.5-coder-0.5b-instruct}
PORT=${PORT:-8000}
export PORT
STATE_DIR=${STATE_DIR:-$ROOT/runs/llm}
export STATE_DIR
DEFAULT_MODEL=runs/models/qwen2.5-coder-0.5b-instruct
if [ -n "${SERVED_NAME:-}" ]; then NAME=$SERVED_NAME
elif [ -d "$MODEL" ] || [ "$MODEL" = "$DEFAULT_MODEL" ]; then NAME=$(basename "$MODEL")
else NAME=$MODEL; fi  # a hub id; scripts/serve_llm.sh checks it
OUT=${OUT:-runs/bench-llm/$NAME}
[ -x "$MAIN_PY" ] || { echo "error: $MAIN_PY not found; run make install first" >&2; exit 2; }

STARTED=0
if [ -z "${BASE_URL:-}" ]; then
  BASE_URL=http://127.0.0.1:$PORT/v1
  pidfile=$STATE_DIR/vllm-$PORT.pid
  had_pid=$([ -f "$pidfile" ] && echo 1 || echo 0)
  SERVED_NAME=$NAME "$ROOT/scripts/serve_llm.sh" --background "$MODEL"
  if [ "$had_pid" = 0 ] && [ -f "$pidfile" ]; then STARTED=1; fi
  export INTENT_TOOL_PARSE_LOG=${INTENT_TOOL_PARSE_LOG:-$STATE_DIR/toolparse-$PORT.jsonl}
fi
cleanup() {
  if [ "$STARTED" = 1 ] && [ "${KEEP_SERVER:-0}" != 1 ]; then "$ROOT/scripts/serve_llm.sh" --stop; fi
}
trap cleanup EXIT

mkdir -p "$OUT"
"$MAIN_PY" -m intent.cli probe --base-url "$BASE_URL" --model "$NAME" --min-rate "${PROBE_MIN_RATE:-0.5}" \
  --json "$OUT/probe.json"
"$MAIN_PY" -m eval.agents.llm_bench --base-url "$BASE_URL" --model "$NAME" \
  --markets "${MARKETS:-synthetic,stabletoolbench}" --methods "${METHODS:-raw,prompt,tracker,intent}" \
  --tasks "${TASKS:-10}" --stb-tasks "${STB_TASKS:-5}" --oracle-tasks "${ORACLE_TASKS:-10}" \
  --max-tokens "${MAX_TOKENS:-512}" --workers "${WORKERS:-2}" --seed "${SEED:-0}" --out "$OUT" \
  --feedback-chars "${FEEDBACK_CHARS:-1500}" --rollout-max-tokens "${ROLLOUT_MAX_TOKENS:-160}" \
  --request-timeout "${REQUEST_TIMEOUT:-600}" --max-turns "${MAX_TURNS:-30}" ${MAX_DEPTH:+--max-depth "$MAX_DEPTH"} ${ORACLE_LOGS:+--oracle-logs "$ORACLE_LOGS"} \
  ${INTENT_TOOL_PARSE_LOG:+--parse-log "$INTENT_TOOL_PARSE_LOG"} ${ALLOW_CODE_CHANGE:+--allow-code-change}
