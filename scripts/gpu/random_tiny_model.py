"""Writes a Llama checkpoint with random bf16 weights (seed 0) in the shape of CONFIG (a config.json)
to OUT_DIR, for GPU runs where the bundled model's weights are left behind to keep the carry small.

    python3 scripts/gpu/random_tiny_model.py CONFIG OUT_DIR
"""
import sys

import torch
from transformers import LlamaConfig, LlamaForCausalLM


def main():
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    config = LlamaConfig.from_pretrained(sys.argv[1])
    torch.manual_seed(0)
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(sys.argv[2], safe_serialization=True)


if __name__ == "__main__":
    main()
