#!/usr/bin/env bash
# The OpenAI API with real clients against a real local cluster (decode worker, prefill worker,
# router as separate processes):
#   1. the official `openai` npm SDK (openai_sdk_test.mjs): completions and chat, streaming and
#      not, n > 1, stop strings, usage, logprobs, error classes;
#   1b. structured outputs (structured_outputs_test.mjs): every constrained output of
#      tests/structured_outputs/cases.json parses and validates; tools without
#      --enable-auto-tool-choice is a 400;
#   1c. tool calls (tool_calls_test.mjs) through two more routers, --tool-call-parser hermes and
#      llama3_json: tool_choice required, named and auto (forced), streaming and not;
#   2. curl -N: the exact SSE framing;
#   3. greedy parity: HTTP completions equal `duet generate` for the same prompt_token_ids;
#   4. a second router with --api-key, --max-concurrent-requests 1 and no queue
#      (--max-queued-requests 0): AuthenticationError and
#      RateLimitError (in the SDK test);
#   5. a router whose workers are all down: InternalServerError with status 503;
#   6. a router whose decode worker sends a message it cannot parse (FAULT_ROUTER_BINARY):
#      InternalServerError 500, and once the stream has started, an SSE error event (curl sees
#      the framing, the SDK raises it);
#   7. a router with --ssl-certfile/--ssl-keyfile (certificates from MAKE_TEST_CERTS): the SDK
#      over HTTPS (tls_sdk_test.mjs, NODE_EXTRA_CA_CERTS), curl --cacert with SSE, and plain HTTP
#      on the TLS port a clear 400 that leaves the router serving.
# Usage: run.sh DUET_BINARY MODEL_DIR FAULT_ROUTER_BINARY MAKE_TEST_CERTS
set -euo pipefail
DUET=$1
MODEL=$2
FAULT_ROUTER_BIN=${3:?run.sh: the fault router binary is required}
MAKE_TEST_CERTS=${4:?run.sh: the make_test_certs binary is required}
HERE=$(cd "$(dirname "$0")" && pwd)
NODE_DIR=$HERE/../node
TMP=$(mktemp -d)
PIDS=()
cleanup() {
  for pid in "${PIDS[@]}"; do kill "$pid" 2>/dev/null || true; done
  for pid in "${PIDS[@]}"; do wait "$pid" 2>/dev/null || true; done
  rm -rf "$TMP"
}
trap cleanup EXIT

if [[ ! -d $NODE_DIR/node_modules/openai ]]; then
  echo "openai_api: tests/node/node_modules/openai is missing (run npm ci in tests/node)" >&2
  exit 1
fi

# start NAME PATTERN CMD...: runs CMD with stdout to $TMP/NAME.out, waits for PATTERN<port>.
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
    if ! kill -0 "${PIDS[-1]}" 2>/dev/null; then break; fi
    sleep 0.1
  done
  echo "openai_api: $name did not start" >&2
  cat "$TMP/$name.err" >&2
  return 1
}

start decode "DUET_READY port=" "$DUET" decode-worker --model "$MODEL" --backend cpu --port 0
DECODE_PORT=$PORT
start prefill "DUET_READY port=" "$DUET" prefill-worker --model "$MODEL" --backend cpu --port 0
PREFILL_PORT=$PORT
ROUTER="$DUET router"
# shellcheck disable=SC2086
start router "DUET_HTTP_READY port=" $ROUTER --model "$MODEL" --port 0 --http-port 0 \
  --prefill "127.0.0.1:$PREFILL_PORT" --decode "127.0.0.1:$DECODE_PORT"
HTTP_PORT=$PORT
# shellcheck disable=SC2086
start router_auth "DUET_HTTP_READY port=" $ROUTER --model "$MODEL" --port 0 --http-port 0 \
  --prefill "127.0.0.1:$PREFILL_PORT" --decode "127.0.0.1:$DECODE_PORT" --api-key test-key \
  --max-concurrent-requests 1 --max-queued-requests 0
AUTH_PORT=$PORT
for parser in hermes llama3_json; do
  # shellcheck disable=SC2086
  start "router_$parser" "DUET_HTTP_READY port=" $ROUTER --model "$MODEL" --port 0 --http-port 0 \
    --prefill "127.0.0.1:$PREFILL_PORT" --decode "127.0.0.1:$DECODE_PORT" --enable-auto-tool-choice \
    --tool-call-parser "$parser"
  declare "TOOLS_PORT_$parser=$PORT"
done
# Port 1 refuses connections: no worker is ever up.
# shellcheck disable=SC2086
start router_down "DUET_HTTP_READY port=" $ROUTER --model "$MODEL" --port 0 --http-port 0 \
  --prefill 127.0.0.1:1 --decode 127.0.0.1:1
DOWN_PORT=$PORT
start router_fault "DUET_HTTP_READY port=" "$FAULT_ROUTER_BIN" --model "$MODEL"
FAULT_PORT=$PORT
mkdir "$TMP/pki"
"$MAKE_TEST_CERTS" "$TMP/pki"
# shellcheck disable=SC2086
start router_tls "DUET_HTTP_READY port=" $ROUTER --model "$MODEL" --port 0 --http-port 0 \
  --prefill "127.0.0.1:$PREFILL_PORT" --decode "127.0.0.1:$DECODE_PORT" \
  --ssl-certfile "$TMP/pki/server.pem" --ssl-keyfile "$TMP/pki/server.key"
TLS_PORT=$PORT
BASE=http://127.0.0.1:$HTTP_PORT
MODEL_NAME=$(basename "$MODEL")
echo "openai_api: router HTTP on $HTTP_PORT, auth router on $AUTH_PORT"

for _ in $(seq 1 100); do
  [[ $(curl -s -o /dev/null -w '%{http_code}' "$BASE/health") == 200 ]] && break
  sleep 0.1
done

# 1. The official SDK.
OPENAI_BASE_URL=$BASE/v1 OPENAI_AUTH_BASE_URL=http://127.0.0.1:$AUTH_PORT/v1 \
  OPENAI_DOWN_BASE_URL=http://127.0.0.1:$DOWN_PORT/v1 OPENAI_FAULT_BASE_URL=http://127.0.0.1:$FAULT_PORT/v1 \
  MODEL_NAME=$MODEL_NAME NODE_DEPS_DIR=$NODE_DIR node "$HERE/openai_sdk_test.mjs"

# 1b. Structured outputs through the SDK: every constrained output parses and validates.
OPENAI_BASE_URL=$BASE/v1 MODEL_NAME=$MODEL_NAME NODE_DEPS_DIR=$NODE_DIR \
  CASES=$HERE/../structured_outputs/cases.json node "$HERE/structured_outputs_test.mjs"

# 1c. Tool calls through the SDK, both formats.
OPENAI_HERMES_BASE_URL=http://127.0.0.1:$TOOLS_PORT_hermes/v1 \
  OPENAI_LLAMA_BASE_URL=http://127.0.0.1:$TOOLS_PORT_llama3_json/v1 MODEL_NAME=$MODEL_NAME NODE_DEPS_DIR=$NODE_DIR \
  node "$HERE/tool_calls_test.mjs"

# 2. curl -N: exact SSE framing.
curl -sN "$BASE/v1/completions" -H 'Content-Type: application/json' \
  -d "{\"model\":\"$MODEL_NAME\",\"prompt\":\"def fib(n):\",\"max_tokens\":5,\"temperature\":0,\"ignore_eos\":true,\"stream\":true,\"stream_options\":{\"include_usage\":true}}" \
  >"$TMP/sse.txt"
python3 - "$TMP/sse.txt" <<'PY'
import json, sys
raw = open(sys.argv[1], 'rb').read().decode()
assert raw.endswith("data: [DONE]\n\n"), repr(raw[-80:])
events = raw.split("\n\n")
assert events[-1] == "", "the stream must end with a blank line"
events = events[:-1]
for e in events:
    assert e.startswith("data: ") and "\n" not in e, repr(e)
payloads = [json.loads(e[6:]) for e in events[:-1]]
assert events[-1] == "data: [DONE]"
assert all(p["object"] == "text_completion" for p in payloads)
usage = payloads[-1]
assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 5, usage
assert payloads[-2]["choices"][0]["finish_reason"] == "length", payloads[-2]
print(f"openai_api: curl SSE framing ok ({len(events)} events)")
PY
# An error before the stream starts is a JSON error with its status, not an event stream.
code=$(curl -s -o "$TMP/err.json" -w '%{http_code}' "$BASE/v1/completions" -H 'Content-Type: application/json' \
  -d '{"prompt":"x","stream":true,"max_tokens":-1}')
[[ $code == 400 ]] || { echo "expected 400, got $code" >&2; exit 1; }
grep -q '"error"' "$TMP/err.json"
# Garbage and a huge body: clear 4xx, server stays healthy.
code=$(curl -s -o /dev/null -w '%{http_code}' "$BASE/v1/completions" -H 'Content-Type: application/json' -d '{"prompt":')
[[ $code == 400 ]] || { echo "malformed JSON: expected 400, got $code" >&2; exit 1; }
head -c 9000000 /dev/zero | tr '\0' 'a' >"$TMP/huge.txt"
code=$(curl -s -o /dev/null -w '%{http_code}' "$BASE/v1/completions" -H 'Content-Type: application/json' \
  --data-binary "@$TMP/huge.txt")
[[ $code == 413 ]] || { echo "huge body: expected 413, got $code" >&2; exit 1; }
[[ $(curl -s -o /dev/null -w '%{http_code}' "$BASE/health") == 200 ]]
# No worker up: 503 on /health and on a completion.
[[ $(curl -s -o /dev/null -w '%{http_code}' "http://127.0.0.1:$DOWN_PORT/health") == 503 ]]
code=$(curl -s -o "$TMP/down.json" -w '%{http_code}' "http://127.0.0.1:$DOWN_PORT/v1/completions" \
  -H 'Content-Type: application/json' -d '{"prompt":"x","max_tokens":2}')
[[ $code == 503 ]] || { echo "workers down: expected 503, got $code" >&2; exit 1; }
# A failure after the stream started: 200, the chunks so far, an error event, then [DONE].
curl -sN --max-time 20 "http://127.0.0.1:$FAULT_PORT/v1/completions" -H 'Content-Type: application/json' \
  -d '{"prompt":"x","max_tokens":8,"stream":true}' >"$TMP/fault_sse.txt"
python3 - "$TMP/fault_sse.txt" <<'PY'
import json, sys
raw = open(sys.argv[1], 'rb').read().decode()
assert raw.endswith("data: [DONE]\n\n"), repr(raw[-200:])
events = [e[6:] for e in raw.split("\n\n")[:-1]]
payloads = [json.loads(e) for e in events[:-1]]
assert [p["choices"][0]["text"] for p in payloads[:-1]] == ["t0 ", "t1 "], payloads
error = payloads[-1]["error"]
assert error["type"] == "server_error" and "not a valid duet.v1.GenerateResponse" in error["message"], error
print("openai_api: curl SSE error event ok")
PY
echo "openai_api: curl error cases ok"

# 7. HTTPS: the SDK (trusting the test CA), curl's SSE framing, plain HTTP on the TLS port.
OPENAI_TLS_BASE_URL=https://localhost:$TLS_PORT/v1 OPENAI_BASE_URL=$BASE/v1 MODEL_NAME=$MODEL_NAME \
  NODE_DEPS_DIR=$NODE_DIR NODE_EXTRA_CA_CERTS=$TMP/pki/ca.pem node "$HERE/tls_sdk_test.mjs"
curl -sN --cacert "$TMP/pki/ca.pem" "https://127.0.0.1:$TLS_PORT/v1/completions" -H 'Content-Type: application/json' \
  -d "{\"model\":\"$MODEL_NAME\",\"prompt\":\"def fib(n):\",\"max_tokens\":4,\"temperature\":0,\"ignore_eos\":true,\"stream\":true}" \
  >"$TMP/tls_sse.txt"
[[ $(tail -c 14 "$TMP/tls_sse.txt") == "data: [DONE]" ]] || { echo "https SSE: no [DONE]" >&2; cat "$TMP/tls_sse.txt" >&2; exit 1; }
grep -q '^data: {.*"text_completion"' "$TMP/tls_sse.txt" || { echo "https SSE: no chunks" >&2; cat "$TMP/tls_sse.txt" >&2; exit 1; }
code=$(curl -s -o "$TMP/plain_on_tls.json" -w '%{http_code}' "http://127.0.0.1:$TLS_PORT/health")
[[ $code == 400 ]] && grep -q 'speaks HTTPS' "$TMP/plain_on_tls.json" \
  || { echo "plain HTTP on the TLS port: expected 400, got $code" >&2; exit 1; }
if curl -s -o /dev/null "https://127.0.0.1:$TLS_PORT/health"; then
  echo "https without the CA must fail verification" >&2
  exit 1
fi
[[ $(curl -s --cacert "$TMP/pki/ca.pem" -o /dev/null -w '%{http_code}' "https://localhost:$TLS_PORT/health") == 200 ]]
echo "openai_api: https ok"
# The version: `duet --version` and GET /version agree; --help shows the defaults.
version=$("$DUET" --version)
[[ $version == "duet $(curl -s "$BASE/version" | python3 -c 'import json,sys; print(json.load(sys.stdin)["version"])')" ]] \
  || { echo "duet --version ($version) and /version disagree" >&2; exit 1; }
help=$("$DUET" serve --help)
[[ $help == *"--grpc-port INT:INT in [0 - 65535]=50051"* ]] || { echo "duet serve --help shows no defaults" >&2; exit 1; }

# 3. Greedy parity with `duet generate` (same prompt_token_ids).
python3 - "$TMP/in.jsonl" "$BASE" <<'PY'
import json, sys, urllib.request
texts = ["def fib(n):", "import os\n", "// quicksort in C\n"]
with open(sys.argv[1], "w") as f:
    for i, t in enumerate(texts):
        r = urllib.request.Request(sys.argv[2] + "/tokenize", json.dumps({"prompt": t}).encode(),
                                   {"Content-Type": "application/json"})
        ids = json.load(urllib.request.urlopen(r))["tokens"]
        f.write(json.dumps({"id": str(i), "prompt_token_ids": ids, "max_tokens": 12, "temperature": 0}) + "\n")
PY
"$DUET" generate --backend cpu --model "$MODEL" --input "$TMP/in.jsonl" --output "$TMP/out.jsonl" >/dev/null 2>"$TMP/generate.err"
python3 - "$TMP/in.jsonl" "$TMP/out.jsonl" "$BASE" "$MODEL_NAME" <<'PY'
import json, sys, urllib.request
inputs = [json.loads(l) for l in open(sys.argv[1])]
outputs = {o["id"]: o for o in map(json.loads, open(sys.argv[2]))}
for req in inputs:
    body = json.dumps({"model": sys.argv[4], "prompt": req["prompt_token_ids"], "max_tokens": req["max_tokens"],
                       "temperature": 0, "logprobs": 0}).encode()
    r = urllib.request.Request(sys.argv[3] + "/v1/completions", body, {"Content-Type": "application/json"})
    got = json.load(urllib.request.urlopen(r))
    want = outputs[req["id"]]
    choice = got["choices"][0]
    assert choice["text"] == want["text"], (choice["text"], want["text"])
    assert choice["finish_reason"] == want["finish_reason"], (choice["finish_reason"], want["finish_reason"])
    assert got["usage"]["completion_tokens"] == len(want["token_ids"]), (got["usage"], want["token_ids"])
print(f"openai_api: greedy parity with duet generate ok ({len(inputs)} prompts)")
PY
echo "openai_api: all passed"
