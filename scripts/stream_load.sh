#!/usr/bin/env bash
# Router and workers under many concurrent streams (tiny model, CPU backend): per process, the
# thread count and memory (Threads, VmRSS, VmHWM from /proc/PID/status) idle and at the peak of
# the load. The servers come from --bin (e.g. an older build, to compare); the load is duet-bench
# (--bench): every request at once, each stream long enough that all are open together.
#
#   scripts/stream_load.sh [--bin build/bin] [--bench build/bin/duet-bench] [--streams 1000]
#                          [--output-len 200] [--input-len 16] [--label after]
#
# Prints one markdown table row per process: label | process | threads idle → peak |
# VmRSS idle → peak MiB | VmHWM MiB; then the peaks of streams open at the router (running +
# waiting) and of requests in the decode worker's batch, sampled every 0.5 s.
set -euo pipefail
cd "$(dirname "$0")/.."

BIN=build/bin BENCH=build/bin/duet-bench STREAMS=1000 OUTPUT_LEN=200 INPUT_LEN=16 LABEL=run
MODEL=models/tiny-code-llama
while [ $# -gt 0 ]; do
  case "$1" in
    --bin) BIN=$2; shift 2 ;;
    --bench) BENCH=$2; shift 2 ;;
    --streams) STREAMS=$2; shift 2 ;;
    --output-len) OUTPUT_LEN=$2; shift 2 ;;
    --input-len) INPUT_LEN=$2; shift 2 ;;
    --label) LABEL=$2; shift 2 ;;
    *) echo "unknown argument $1" >&2; exit 2 ;;
  esac
done

WORK=$(mktemp -d /tmp/stream_load.XXXXXX)
PIDS=()
cleanup() {
  for pid in "${PIDS[@]}"; do kill -TERM "$pid" 2>/dev/null || true; done
  for pid in "${PIDS[@]}"; do wait "$pid" 2>/dev/null || true; done
  rm -rf "$WORK"
}
trap cleanup EXIT

# start NAME ARGS...: runs "$BIN/duet" ARGS in the background, waits for DUET_READY, sets PORT.
start() {
  local name=$1; shift
  "$BIN/duet" "$@" > "$WORK/$name.out" 2> "$WORK/$name.err" &
  PIDS+=($!)
  eval "${name}_pid=$!"
  for _ in $(seq 1 600); do
    PORT=$(sed -n 's/^DUET_READY port=\([0-9]*\)$/\1/p' "$WORK/$name.out")
    [ -n "$PORT" ] && return 0
    kill -0 "${PIDS[-1]}" 2>/dev/null || { echo "$name failed to start:" >&2; cat "$WORK/$name.err" >&2; exit 1; }
    sleep 0.1
  done
  echo "$name did not become ready" >&2; exit 1
}

SEQS=$((STREAMS + 24))
start prefill prefill-worker --model "$MODEL" --backend cpu --port 0 --max-num-seqs "$SEQS"
prefill_port=$PORT
start decode decode-worker --model "$MODEL" --backend cpu --port 0 --max-num-seqs "$SEQS" --kv-cache-gib 2 \
  --metrics-port 0
decode_port=$PORT
decode_metrics=$(sed -n 's/^DUET_METRICS_READY port=\([0-9]*\)$/\1/p' "$WORK/decode.out")
start router router --model "$MODEL" --port 0 --prefill "127.0.0.1:$prefill_port" \
  --decode "127.0.0.1:$decode_port" --max-concurrent-requests "$((STREAMS * 2))" --kv-lease-ms 600000 \
  --metrics-port 0
router_port=$PORT
router_metrics=$(sed -n 's/^DUET_METRICS_READY port=\([0-9]*\)$/\1/p' "$WORK/router.out")

field() { awk -v k="$2:" '$1 == k { print $2 }' "/proc/$1/status" 2>/dev/null || echo 0; }
# gauge PORT NAME...: the sum of the named gauges on that /metrics port.
gauge() {
  local port=$1; shift
  curl -s "http://127.0.0.1:$port/metrics" |
    awk -v names=" $* " '{ split($1, n, "{") } index(names, " " n[1] " ") { v += $NF } END { printf "%d", v }'
}

sleep 2
declare -A idle_threads idle_rss peak_threads peak_rss
for name in router prefill decode; do
  pid_var=${name}_pid
  idle_threads[$name]=$(field "${!pid_var}" Threads)
  idle_rss[$name]=$(field "${!pid_var}" VmRSS)
  peak_threads[$name]=${idle_threads[$name]}
  peak_rss[$name]=${idle_rss[$name]}
done

"$BENCH" --backend duet-grpc --base-url "127.0.0.1:$router_port" --tokenizer "$MODEL" --dataset random \
  --input-len "$INPUT_LEN" --output-len "$OUTPUT_LEN" --ignore-eos --num-prompts "$STREAMS" \
  --request-rate inf --max-concurrency "$STREAMS" > "$WORK/bench.out" 2>&1 &
bench_pid=$!
peak_open=0 peak_decoding=0
while kill -0 "$bench_pid" 2>/dev/null; do
  for name in router prefill decode; do
    pid_var=${name}_pid
    t=$(field "${!pid_var}" Threads); r=$(field "${!pid_var}" VmRSS)
    [ "${t:-0}" -gt "${peak_threads[$name]}" ] && peak_threads[$name]=$t
    [ "${r:-0}" -gt "${peak_rss[$name]}" ] && peak_rss[$name]=$r
  done
  # Open streams: waiting in the router plus those at the decode worker (each role counts its own).
  n=$(( $(gauge "$router_metrics" duet:num_requests_waiting) + $(gauge "$decode_metrics" duet:num_requests_running duet:num_requests_waiting) ))
  [ "$n" -gt "$peak_open" ] && peak_open=$n
  n=$(gauge "$decode_metrics" duet:num_requests_running)
  [ "$n" -gt "$peak_decoding" ] && peak_decoding=$n
  sleep 0.5
done
wait "$bench_pid" || { echo "duet-bench failed:" >&2; tail -20 "$WORK/bench.out" >&2; exit 1; }

mib() { awk -v k="$1" 'BEGIN { printf "%.0f", k / 1024 }'; }
for name in router prefill decode; do
  pid_var=${name}_pid
  echo "| $LABEL | $name | ${idle_threads[$name]} → ${peak_threads[$name]} |" \
       "$(mib "${idle_rss[$name]}") → $(mib "${peak_rss[$name]}") | $(mib "$(field "${!pid_var}" VmHWM)") |"
done
echo "peak streams open at the router: $peak_open of $STREAMS; peak requests in the decode batch: $peak_decoding"
grep -E "Successful requests|Failed requests|Benchmark duration" "$WORK/bench.out" || tail -5 "$WORK/bench.out"
