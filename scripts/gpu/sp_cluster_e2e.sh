#!/usr/bin/env bash
# Sourced by h200_sp_scaling.sh (after devcluster_prologue.sh; $MODEL the long-context checkpoint):
# the cluster end to end with sequence-parallel prefill (issue 21) — `duet serve` with a router, a
# prefill worker whose group spans P GPUs and a decode worker on a GPU of its own
# (--decode-devices), serving CLUSTER_TOKENS-token prompts over gRPC (duet-bench, greedy,
# --ignore-eos), one at a time. Prints each request's TTFT and tokens, and fails the call's
# summary line if any request failed.
#   3+ GPUs: P = the largest power of two <= GPUs - 1 on GPUs 0..P-1 (NCCL), the decode worker on
#            the last GPU; 2 GPUs: the group on both, the decode worker beside rank 1;
#   1 GPU:   a dry run of the same plumbing: a group of 2 on the one GPU (peer copies) beside the
#            decode worker, CLUSTER_TOKENS 16384 unless given.
#   CLUSTER_TOKENS=131072 (default with 2+ GPUs) CLUSTER_PROMPTS=2
sp_cluster_e2e() {
  local gpus=$1 p=2 devices transport=nccl decode_dev=() tokens prompts=${CLUSTER_PROMPTS:-2} dir=$OUT/cluster
  mkdir -p "$dir"
  if ((gpus >= 3)); then
    while ((p * 2 <= gpus - 1)); do p=$((p * 2)); done
    devices=$(seq -s, 0 $((p - 1))); decode_dev=(--decode-devices $((gpus - 1)))
  elif ((gpus == 2)); then
    devices=0,1; decode_dev=(--decode-devices 1)
  else
    devices=0,0; transport=peer
  fi
  tokens=${CLUSTER_TOKENS:-$((gpus > 1 ? 131072 : 16384))}
  # One step takes the whole prompt (sequence-parallel prefill needs it whole); room for the
  # generated tokens past the prompt.
  local limit=$((tokens + 256))
  echo "== the cluster end to end: prefill group of $p on GPUs $devices ($transport), decode worker ${decode_dev[*]:-on GPU 0}, ${tokens}-token prompts"
  duet serve --model "$MODEL" --backend cuda --prefill-sp-ranks $p --devices "$devices" --sp-transport $transport \
    "${decode_dev[@]}" --max-model-len $limit --max-num-batched-tokens $limit --decode-max-num-batched-tokens 2048 \
    --max-num-seqs 8 --no-enable-prefix-caching --grpc-port 0 --http-port -1 > "$dir/serve.out" 2> "$dir/serve.log" &
  local serve_pid=$! port
  port=$(serve_port "$dir/serve.out" $serve_pid 300)
  if [[ -z $port ]]; then
    echo "serve did not start"; grep -E "ERROR|error" "$dir/serve.log" | head -5; kill $serve_pid 2>/dev/null; return 1
  fi
  grep -E "CUDA_VISIBLE_DEVICES|sequence-parallel" "$dir/serve.log" | sed 's/^.*\] /  /' | head -4
  local common=(--backend duet-grpc --base-url 127.0.0.1:$port --tokenizer "$MODEL" --dataset random --output-len 16
                --ignore-eos --max-concurrency 1 --request-rate inf)
  duet-bench "${common[@]}" --input-len 4096 --num-prompts 1 --seed 300 > "$dir/warmup.log" 2>&1
  duet-bench "${common[@]}" --input-len "$tokens" --num-prompts "$prompts" --seed 301 \
    --result-json "$dir/e2e.json" > "$dir/e2e.log" 2>&1
  echo "duet-bench exit $?"
  python3 - "$dir/e2e.json" "$tokens" <<'PY'
import json, sys
j, tokens = json.load(open(sys.argv[1])), int(sys.argv[2])  # tokens: the asked prompt length
for i, (n, out, ttft, err) in enumerate(zip(j["input_lens"], j["output_lens"], j["ttfts"], j["errors"])):
    print(f"  request {i}: {n} prompt tokens, {out} generated, TTFT {ttft * 1e3:.0f} ms{', error: ' + err if err else ''}")
ok = j["failed"] == 0 and j["completed"] > 0 and all(out == 16 for out in j["output_lens"])
print(f"cluster served {j['completed']} of {j['completed'] + j['failed']} {tokens}-token prompts end to end: {'yes' if ok else 'NO'}")
PY
  kill -TERM $serve_pid; wait $serve_pid
}
