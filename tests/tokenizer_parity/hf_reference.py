#!/usr/bin/env python3
"""Reference token ids from Hugging Face `tokenizers` for a JSONL corpus.

Usage: hf_reference.py <tokenizer-dir-or-tokenizer.json> <corpus.jsonl> <out.jsonl>

Each corpus line is {"text": ...}; each output line is {"ids": [...]}, the ids of
Tokenizer.from_file(path).encode(text, add_special_tokens=False). Save the output as
expected/<name>.hf.jsonl to make it the reference of frontend/tokenizer/tokenizer_parity_test.cpp.
"""
import json
import os
import sys

from tokenizers import Tokenizer


def main():
    if len(sys.argv) != 4:
        sys.exit(__doc__)
    path, corpus_path, out_path = sys.argv[1:]
    if os.path.isdir(path):
        path = os.path.join(path, "tokenizer.json")
    tokenizer = Tokenizer.from_file(path)
    with open(corpus_path, encoding="utf-8") as corpus, open(out_path, "w", encoding="utf-8") as out:
        for line in corpus:
            if not line.strip():
                continue
            text = json.loads(line)["text"]
            ids = tokenizer.encode(text, add_special_tokens=False).ids
            out.write(json.dumps({"ids": ids}, separators=(",", ":")) + "\n")


if __name__ == "__main__":
    main()
