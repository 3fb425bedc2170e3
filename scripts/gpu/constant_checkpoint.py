"""A copy of a safetensors checkpoint whose every weight holds one value (1e-3), for measuring how
much of a step's time the card's power cap takes: the same work on operands that barely switch draws
far less power (docs/BENCHMARKS.md, "What limits the step: the power cap").

    python3 scripts/gpu/constant_checkpoint.py SRC_DIR DST_DIR
"""
import os
import shutil
import sys

import torch
from safetensors.torch import load_file, save_file


def main(src, dst):
    os.makedirs(dst, exist_ok=True)
    for name in sorted(os.listdir(src)):
        path = os.path.join(src, name)
        if name.endswith(".safetensors"):
            tensors = load_file(path)
            save_file({k: torch.full_like(v, 1e-3) for k, v in tensors.items()}, os.path.join(dst, name),
                      metadata={"format": "pt"})
        elif os.path.isfile(path):
            shutil.copy(path, dst)


if __name__ == "__main__":
    main(*sys.argv[1:3])
