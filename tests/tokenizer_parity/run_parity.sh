#!/usr/bin/env bash
# Tokenizer parity: compares `duet tokenize` with a reference tokenizer on corpus.jsonl.
#
#   tests/tokenizer_parity/run_parity.sh <duet-binary> <tokenizer-dir> [corpus.jsonl]
#
# The reference is HF `tokenizers` (hf_reference.py) when python can import it, else
# @lenml/tokenizers (reference_ids.mjs; needs `npm install` in tests/node). Set
# PARITY_REFERENCE=hf or PARITY_REFERENCE=transformersjs to choose. Exits non-zero on any mismatch.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
if [[ $# -lt 2 || $# -gt 3 ]]; then
  echo "usage: $0 <duet-binary> <tokenizer-dir> [corpus.jsonl]" >&2
  exit 2
fi
duet="$1"
model_dir="$2"
corpus="${3:-$here/corpus.jsonl}"
[[ -x "$duet" ]] || { echo "not an executable: $duet" >&2; exit 2; }
[[ -f "$model_dir/tokenizer.json" ]] || { echo "no tokenizer.json in $model_dir" >&2; exit 2; }

reference="${PARITY_REFERENCE:-}"
if [[ -z "$reference" ]]; then
  if python3 -c "import tokenizers" 2>/dev/null; then reference=hf; else reference=transformersjs; fi
fi

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
case "$reference" in
  hf) python3 "$here/hf_reference.py" "$model_dir" "$corpus" "$work/expected.jsonl" ;;
  transformersjs) node "$here/reference_ids.mjs" "$model_dir" "$corpus" "$work/expected.jsonl" ;;
  *) echo "PARITY_REFERENCE must be hf or transformersjs" >&2; exit 2 ;;
esac

"$duet" tokenize --model "$model_dir" --input "$corpus" --output "$work/actual.jsonl"

echo "reference: $reference; tokenizer: $model_dir"
node "$here/compare_ids.mjs" "$corpus" "$work/expected.jsonl" "$work/actual.jsonl"
