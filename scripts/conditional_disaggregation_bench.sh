#!/usr/bin/env bash
# Conditional disaggregation on the local CPU cluster (docs/BENCHMARKS.md): `duet serve` with the
# bundled model (router, 1 prefill and 1 decode worker sharing the machine's cores, as the roles
# share one GPU), once per router setting, each with the same closed-loop duet-bench run; prints
# duet-bench's throughput and latencies and where the requests were prefilled
# (duet:router_prefills_total{worker_role}, the warm-up request included).
#
#   scripts/conditional_disaggregation_bench.sh [ROUNDS] [duet-bench flags...]
# Settings, in this order each round: off (every prompt to the prefill worker), local (every prompt
# of up to 1024 tokens prefilled by the decode worker), busy (only while the prefill worker has 256
# prompt tokens or more in hand). ROUNDS (default 2) rounds, the seed changing per round. Needs
# build/bin/duet and build/bin/duet-bench.
set -euo pipefail
cd "$(dirname "$0")/.."
ROUNDS=${1:-2}
shift || true
BENCH_FLAGS=(--input-len 128 --output-len 64 --num-prompts 96 --max-concurrency 16 "$@")
OUT=$(mktemp -d)
SERVE_PID=""
stop() { [[ -z $SERVE_PID ]] || { kill -INT "$SERVE_PID" 2>/dev/null; wait "$SERVE_PID" || true; }; SERVE_PID=""; }
trap 'stop; rm -rf "$OUT"' EXIT

run() {  # NAME SEED [serve flags...]
  local name=$1 seed=$2
  shift 2
  build/bin/duet serve --model models/tiny-code-llama --grpc-port 0 --http-port 0 "$@" >"$OUT/$name.out" 2>"$OUT/$name.log" &
  SERVE_PID=$!
  local port="" http=""
  for _ in $(seq 1 240); do
    port=$(sed -n 's/^DUET_READY grpc_port=//p' "$OUT/$name.out")
    [[ -n $port ]] && break
    kill -0 "$SERVE_PID" 2>/dev/null || break
    sleep 0.5
  done
  [[ -n $port ]] || { echo "$name: serve did not start"; tail -5 "$OUT/$name.log"; exit 1; }
  http=$(sed -n 's/^DUET_HTTP_READY port=//p' "$OUT/$name.out")
  build/bin/duet-bench --backend duet-grpc --base-url "127.0.0.1:$port" --tokenizer models/tiny-code-llama \
    --dataset random --ignore-eos --seed "$seed" "${BENCH_FLAGS[@]}" >"$OUT/$name.bench" 2>&1
  local where
  where=$(curl -s "127.0.0.1:$http/metrics" | sed -n 's/^duet:router_prefills_total{.*worker_role="\([a-z]*\)"} /\1=/p' | tr '\n' ' ')
  awk -v name="$name" -v where="$where" '
    /^Successful requests/ {ok = $NF} /^Failed requests/ {failed = $NF}
    /^Output token throughput/ {tput = $NF} /^Median TTFT/ {ttft = $NF} /^P99 TTFT/ {ttft99 = $NF}
    /^Median TPOT/ {tpot = $NF} /^P99 TPOT/ {tpot99 = $NF}
    END {printf "%-8s ok %s failed %s  out tok/s %s  TTFT med/p99 %s/%s ms  TPOT med/p99 %s/%s ms  prefilled on: %s\n",
         name, ok, failed, tput, ttft, ttft99, tpot, tpot99, where}' "$OUT/$name.bench"
  stop
}

for round in $(seq 1 "$ROUNDS"); do
  run off "$round"
  run local "$round" --local-prefill-max-tokens 1024
  run busy "$round" --local-prefill-max-tokens 1024 --local-prefill-queue-tokens 256
done
