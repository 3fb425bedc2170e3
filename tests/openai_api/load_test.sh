#!/usr/bin/env bash
# Benchmark (not a ctest): STREAMS (default 1000) concurrent SSE streams against a local CPU
# cluster's OpenAI API; prints the router's peak RSS and thread count.
# Usage: load_test.sh DUET_BINARY MODEL_DIR   (env: STREAMS, MAX_TOKENS)
set -euo pipefail
DUET=$1
MODEL=$2
HERE=$(cd "$(dirname "$0")" && pwd)
STREAMS=${STREAMS:-1000}
TMP=$(mktemp -d)
PIDS=()
cleanup() {
  local rc=$?
  if [[ $rc != 0 ]]; then for f in "$TMP"/*.err; do echo "== $f"; tail -5 "$f"; done; fi
  for pid in "${PIDS[@]}"; do kill "$pid" 2>/dev/null || true; done
  for pid in "${PIDS[@]}"; do wait "$pid" 2>/dev/null || true; done
  rm -rf "$TMP"
}
trap cleanup EXIT
ulimit -n "$(ulimit -Hn)" 2>/dev/null || true

start() {
  local name=$1 pattern=$2
  shift 2
  "$@" >"$TMP/$name.out" 2>"$TMP/$name.err" &
  PIDS+=($!)
  for _ in $(seq 1 600); do
    if grep -q "^DUET_READY port=" "$TMP/$name.out" 2>/dev/null; then
      PORT=$(sed -n "s/^${pattern}\([0-9]*\)$/\1/p" "$TMP/$name.out" | head -1)
      return 0
    fi
    sleep 0.1
  done
  echo "$name did not start" >&2; cat "$TMP/$name.err" >&2; return 1
}
ROUTER="$DUET router"

start decode "DUET_READY port=" "$DUET" decode-worker --model "$MODEL" --backend cpu --port 0 --max-num-seqs 1024
DECODE_PORT=$PORT
start prefill "DUET_READY port=" "$DUET" prefill-worker --model "$MODEL" --backend cpu --port 0
PREFILL_PORT=$PORT
# shellcheck disable=SC2086
start router "DUET_HTTP_READY port=" $ROUTER --model "$MODEL" --port 0 --http-port 0 \
  --prefill "127.0.0.1:$PREFILL_PORT" --decode "127.0.0.1:$DECODE_PORT" --max-concurrent-requests $((STREAMS * 2))
HTTP_PORT=$PORT
ROUTER_PID=${PIDS[2]}
for _ in $(seq 1 100); do
  [[ $(curl -s -o /dev/null -w '%{http_code}' "http://127.0.0.1:$HTTP_PORT/health") == 200 ]] && break
  sleep 0.1
done
BASE_URL=http://127.0.0.1:$HTTP_PORT MODEL_NAME=$(basename "$MODEL") ROUTER_PID=$ROUTER_PID STREAMS=$STREAMS MAX_TOKENS=${MAX_TOKENS:-4} \
  node "$HERE/load_test.mjs"
