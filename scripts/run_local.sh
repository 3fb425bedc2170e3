#!/usr/bin/env bash
# README command 1: install everything, build, and run the bundled model on a sample prompt.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install_deps.sh
scripts/build.sh
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cat > "$work/in.jsonl" <<'JSON'
{"id": "sample", "prompt": "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n", "max_tokens": 96, "temperature": 0}
JSON
build/bin/duet generate --model models/tiny-code-llama --input "$work/in.jsonl" --output "$work/out.jsonl"
node -e '
const fs = require("fs");
const prompt = JSON.parse(fs.readFileSync(process.argv[1], "utf8").split("\n")[0]).prompt;
const row = JSON.parse(fs.readFileSync(process.argv[2], "utf8").split("\n")[0]);
console.log(`--- prompt ---\n${prompt}--- completion (${row.finish_reason}, ${row.token_ids.length} tokens) ---\n${row.text}`);
' "$work/in.jsonl" "$work/out.jsonl"
