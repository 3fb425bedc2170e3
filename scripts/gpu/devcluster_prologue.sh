# Sourced by the GPU scripts that run the cluster bundle of scripts/gpu/make_cluster_bundle.sh
# (carried as .devcluster/bundle.tar.xz): $OUT (the caller's default unless the device tool set
# it), the bundle's programs and libraries on the path, $MODEL, the GPU's name in $OUT/gpu.txt, and
# llama8b_checkpoint: the random-weight Llama-3-8B-shaped checkpoint in $MODEL (kept from an earlier
# run on the machine) with the bundle's Llama-3 tokenizer.
mkdir -p "$OUT"
tar -xJf .devcluster/bundle.tar.xz -C /tmp || exit 1
source /tmp/devbundle/env.sh
MODEL=/tmp/llama8b
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
llama8b_checkpoint() {
  [[ -f $MODEL/config.json ]] || python3 -c "
import sys; sys.path.insert(0, 'scripts/gpu')
from hf_reference import make_checkpoint
make_checkpoint('$MODEL', 32)" 2>&1 | grep -v Warning | tail -2
  cp /tmp/devbundle/tokenizer.json /tmp/devbundle/tokenizer_config.json "$MODEL/"
}
