"""Hugging Face transformers side of the H200 run (scripts/gpu/h200_run.sh).

1. Makes a random-weight Llama-3-8B-shaped bf16 checkpoint (save_pretrained, safetensors).
2. Writes reference logits of transformers' float32 forward on the same (bf16-valued) weights
   for a few random token sequences: tokens.json + logits.f32 ([num_seqs, len, vocab] float32).
3. With --timings-only (a separate run, so that the timings have the GPU to themselves): loads the
   checkpoint written by 1 and measures transformers (eager and sdpa, bf16) decode ms/step at the
   given batch sizes over a context of --context tokens, and single-sequence prefill ms, into
   timings.json.
"""
import argparse
import json
import os
import statistics
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM


def make_checkpoint(out_dir, layers, long_context=False):
    """Llama-3-8B's shape with random weights; long_context: Llama-3.1's RoPE scaling and 131,072
    positions (written into config.json after saving, in whichever RoPE key this transformers uses)."""
    config = LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=layers,
                         num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=128256,
                         max_position_embeddings=8192, rope_theta=500000.0, rms_norm_eps=1e-5,
                         tie_word_embeddings=False, bos_token_id=128000, eos_token_id=128001)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.eval()
    model.save_pretrained(out_dir, safe_serialization=True, max_shard_size="5GB")
    if long_context:
        make_long_context(os.path.join(out_dir, "config.json"))
    return model


def make_long_context(config_path):
    """Rewrites a saved Llama config for Llama-3.1's RoPE scaling and 131,072 positions, in whichever
    RoPE key this transformers used. The weights do not change (make_checkpoint's are seeded), so a
    long-context copy of a checkpoint can link the short one's weights."""
    with open(config_path) as f:
        saved = json.load(f)
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
    saved["max_position_embeddings"] = 131072
    if isinstance(saved.get("rope_parameters"), dict):
        saved["rope_parameters"].update(scaling)
    else:
        saved["rope_scaling"] = scaling
    with open(config_path, "w") as f:
        json.dump(saved, f, indent=2)


def set_attention(model, impl):
    if hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation(impl)
    else:
        model.config._attn_implementation = impl


@torch.no_grad()
def reference_logits(model, out_dir, num_seqs, length):
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, model.config.vocab_size, (num_seqs, length), generator=gen)
    set_attention(model, "eager")
    # transformers' own bf16 forward: the error a bf16 implementation is expected to have.
    model(ids.cuda()).logits.float().cpu().contiguous().numpy().tofile(os.path.join(out_dir, "logits_bf16.f32"))
    model.float()
    logits = model(ids.cuda()).logits.float().cpu().contiguous()
    model.to(torch.bfloat16)
    with open(os.path.join(out_dir, "tokens.json"), "w") as f:
        json.dump({"sequences": ids.tolist()}, f)
    logits.numpy().tofile(os.path.join(out_dir, "logits.f32"))


def cuda_time(fn, reps):
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


@torch.no_grad()
def timings(model, batches, context, prefills, steps):
    vocab = model.config.vocab_size
    out = {}
    for impl in ("eager", "sdpa"):
        set_attention(model, impl)
        res = {"decode_ms": {}, "prefill_ms": {}}
        for n in prefills:
            ids = torch.randint(0, vocab, (1, n), device="cuda")
            model(ids[:, :64], logits_to_keep=1)  # warm-up
            res["prefill_ms"][n] = 1e3 * cuda_time(lambda: model(ids, logits_to_keep=1), 3)
        for b in batches:
            ids = torch.randint(0, vocab, (b, context), device="cuda")
            o = model(ids, use_cache=True, logits_to_keep=1)
            past, nxt = o.past_key_values, o.logits[:, -1].argmax(-1, keepdim=True)
            times = []
            for i in range(steps):
                torch.cuda.synchronize()
                t = time.perf_counter()
                o = model(nxt, past_key_values=past, use_cache=True)
                past, nxt = o.past_key_values, o.logits[:, -1].argmax(-1, keepdim=True)
                torch.cuda.synchronize()
                times.append(time.perf_counter() - t)
            res["decode_ms"][b] = 1e3 * statistics.median(times[2:])
            del past, o
            torch.cuda.empty_cache()
        out[impl] = res
        print(f"transformers {impl}: {json.dumps(res)}", flush=True)
    return out


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--ref-seqs", type=int, default=2)
    p.add_argument("--ref-len", type=int, default=64)
    p.add_argument("--timings-only", action="store_true", help="time transformers on the checkpoint in --out")
    p.add_argument("--checkpoint-only", action="store_true", help="write the checkpoint, no reference logits")
    p.add_argument("--batches", default="1,8,32,128")
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--prefills", default="1024,8192")
    p.add_argument("--steps", type=int, default=8)
    a = p.parse_args()
    if a.timings_only:
        model = LlamaForCausalLM.from_pretrained(a.out, dtype=torch.bfloat16, device_map="cuda").eval()
        res = timings(model, [int(x) for x in a.batches.split(",")], a.context,
                      [int(x) for x in a.prefills.split(",")], a.steps)
        with open(os.path.join(a.out, "timings.json"), "w") as f:
            json.dump(res, f)
        return
    t = time.time()
    model = make_checkpoint(a.out, a.layers)
    print(f"checkpoint written to {a.out} in {time.time() - t:.0f} s", flush=True)
    if a.checkpoint_only:
        return
    t = time.time()
    reference_logits(model, a.out, a.ref_seqs, a.ref_len)
    print(f"float32 reference logits in {time.time() - t:.0f} s", flush=True)


if __name__ == "__main__":
    main()
