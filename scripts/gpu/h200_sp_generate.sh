#!/usr/bin/env bash
# One call on the GPU machine: `duet generate --backend cuda` on long prompts with sequence-parallel
# prefill three ways (one rank; virtual ranks; a group of executors on --devices), greedy, the
# outputs compared. The virtual ranks and the group run the same kernels on the same rows, so
# their tokens must be equal; against one rank, bf16 rounding of a different summation order may
# flip a near tie of the random-weight model (the agreement is printed). Then the cluster
# (`duet serve`: router, a prefill worker whose group of 2 ranks shares the GPU, a decode worker)
# on the same prompts over HTTP: its text must equal duet generate's with the same group.
#
#   here:   TARGETS="duet" BUNDLE_DIR=.devbundle/gen scripts/gpu/make_bundle.sh
#           cp models/tiny-code-llama/{config.json,tokenizer.json,tokenizer_config.json} .devbundle/gen/
#           mv models /tmp/duet-models-hold
#   device: BUNDLE_DIR=.devbundle/gen bash scripts/gpu/h200_sp_generate.sh      (carry .devbundle/gen)
set -uo pipefail
OUT=${OUT:-/tmp/duet-sp-generate-out}
BUNDLE_DIR=${BUNDLE_DIR:-.devbundle/gen}
mkdir -p "$OUT"
tar -xJf "$BUNDLE_DIR/bundle.tar.xz" -C /tmp || exit 1
source /tmp/devbundle/env.sh
MODEL=/tmp/tiny-random
python3 scripts/gpu/random_tiny_model.py "$BUNDLE_DIR/config.json" "$MODEL" 2>&1 | grep -v Warning | tail -1
cp "$BUNDLE_DIR/tokenizer.json" "$BUNDLE_DIR/tokenizer_config.json" "$MODEL/"
python3 - <<'PY' > /tmp/sp_in.jsonl
import json, random
random.seed(7)
for i, n in enumerate([1500, 3001, 4000, 700]):
    ids = [random.randrange(3, 8000) for _ in range(n)]
    print(json.dumps({"id": f"p{i}", "prompt_token_ids": ids, "max_tokens": 24, "temperature": 0, "ignore_eos": True}))
PY
run() {  # name, flags...
  local name=$1; shift
  duet generate --model "$MODEL" --backend cuda --input /tmp/sp_in.jsonl --output "$OUT/$name.jsonl" \
    --max-num-batched-tokens 8192 --sp-min-tokens 1024 "$@" > "$OUT/$name.log" 2>&1
  echo "$name: exit $?"
}
run one_rank
run virtual3 --sp-ranks 3
run group3 --sp-ranks 3 --devices 0,0,0
run group2_nccl --sp-ranks 2 --devices 0,0 --sp-transport nccl  # must fail: NCCL takes a GPU per rank
tail -2 "$OUT/group2_nccl.log"
python3 - "$OUT" <<'PY'
import json, sys
out = sys.argv[1]
def load(name):
    rows = {}
    for line in open(f"{out}/{name}.jsonl"):
        r = json.loads(line)
        rows[r["id"]] = r
    return rows
one, virt, group = load("one_rank"), load("virtual3"), load("group3")
def ids(r):
    for key in ("output_token_ids", "token_ids"):
        if key in r: return r[key]
    return r["outputs"][0]["token_ids"] if "outputs" in r else r.get("text")
print(f"{'prompt':>7} {'tokens':>6} {'group==virtual':>15} {'agree with one rank':>20}")
ok = True
for k in sorted(one):
    a, b, c = ids(one[k]), ids(virt[k]), ids(group[k])
    same = b == c
    ok &= same
    agree = next((i for i, (x, y) in enumerate(zip(a, c)) if x != y), len(c))
    n = len(json.loads(open('/tmp/sp_in.jsonl').readlines()[int(k[1:])])["prompt_token_ids"])
    print(f"{k:>7} {n:>6} {str(same):>15} {agree:>14} of {len(c)}")
print("group == virtual on every prompt:", ok)
PY

echo "== duet serve --prefill-sp-ranks 2 --devices 0,0"
run group2 --sp-ranks 2 --devices 0,0
duet serve --model "$MODEL" --backend cuda --gpu-memory-utilization 0.5 --max-num-batched-tokens 8192 \
  --prefill-sp-ranks 2 --devices 0,0 --sp-min-tokens 1024 --grpc-port 50151 --http-port 8151 > "$OUT/serve.log" 2>&1 &
SERVE=$!
for _ in $(seq 120); do curl -sf localhost:8151/health > /dev/null && break; sleep 1; done
python3 - "$OUT" <<'PY'
import json, sys, urllib.request
out = sys.argv[1]
# The HTTP API returns text: greedy tokens equal give equal text.
want = {json.loads(l)["id"]: json.loads(l)["text"] for l in open(f"{out}/group2.jsonl")}
same = 0
rows = [json.loads(l) for l in open("/tmp/sp_in.jsonl")]
for r in rows:
    body = {"model": "tiny-random", "prompt": r["prompt_token_ids"], "max_tokens": 24, "temperature": 0,
            "ignore_eos": True}
    req = urllib.request.Request("http://localhost:8151/v1/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    reply = json.load(urllib.request.urlopen(req, timeout=120))
    choice = reply["choices"][0]
    got = choice["text"]
    ok = got == want[r["id"]]
    same += ok
    print(f"{r['id']}: {len(r['prompt_token_ids'])} prompt tokens, cluster == duet generate (group of 2): {ok}")
print(f"cluster equal on {same} of {len(rows)} prompts")
PY
grep -E "sequence-parallel|error|ERROR" "$OUT/serve.log" | head -5
kill -TERM $SERVE; wait $SERVE
