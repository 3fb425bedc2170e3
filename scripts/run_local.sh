#!/usr/bin/env bash
# README command 1: install everything, build, start the local cluster (router + prefill worker
# + decode worker as separate processes) with the bundled model, and send it one request.
# The cluster keeps running until Ctrl-C; set DUET_DEMO_ONLY=1 to stop after the request.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install_deps.sh
scripts/build.sh

GRPC_PORT=${GRPC_PORT:-50051}
build/bin/duet serve --model models/tiny-code-llama --prefill-workers 1 --decode-workers 1 \
  --grpc-port "$GRPC_PORT" > /tmp/duet-serve.$$ &
serve_pid=$!
trap 'kill -TERM $serve_pid 2>/dev/null; wait $serve_pid 2>/dev/null; rm -f /tmp/duet-serve.$$' EXIT
for _ in $(seq 1 300); do
  grep -q DUET_READY /tmp/duet-serve.$$ 2>/dev/null && break
  kill -0 $serve_pid 2>/dev/null || { echo "duet serve failed to start" >&2; exit 1; }
  sleep 0.2
done

echo "--- one request through the cluster (router → prefill → KV over UCX → decode) ---"
prompt=$'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n'
printf '%s' "$prompt"
build/bin/duet complete --address "127.0.0.1:$GRPC_PORT" --prompt "$prompt" --max-tokens 96

if [ "${DUET_DEMO_ONLY:-0}" = 1 ]; then exit 0; fi
echo "The cluster is serving duet.v1.Duet on 127.0.0.1:$GRPC_PORT (gRPC, with reflection). Ctrl-C stops it."
wait $serve_pid
