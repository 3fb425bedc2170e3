"""The final table of scripts/gpu/h200_cluster.sh: the cluster's duet-bench runs, the engine alone
(`duet generate`) on the same requests, and the ratios the cluster is held to.

  python3 scripts/gpu/cluster_table.py OUT_DIR ENGINE_SEQS

OUT_DIR holds duet-bench's --result-json files (conc1.json, ..., rateinf.json) and duet generate's
outputs on the requests duet-bench --save-requests wrote: engine_batch.jsonl (all submitted at
once, ENGINE_SEQS at a time) and engine_prefill.jsonl (--max-num-seqs 1: each prompt alone).
Missing files leave their rows empty rather than failing the table.
"""
import json
import os
import statistics
import sys

LLAMA_CPP_64 = 6016  # llama.cpp output tok/s, 64 sequences of 512 + 128 tokens, H200 (DESIGN.md)
RUNS = ["conc1_short", "conc1", "conc8", "conc32", "conc64", "rate4", "rate16", "rate64", "rateinf"]


def load_json(path):
    return json.load(open(path)) if os.path.exists(path) else None


def load_jsonl(path):
    if not os.path.exists(path):
        return None
    rows = [json.loads(line) for line in open(path) if line.strip()]
    return sorted(rows, key=lambda r: int(r["id"]) if r["id"].isdigit() else r["id"])


def engine_batch(rows):
    """Output tok/s of the whole batch: its tokens over submission to the last finish."""
    tokens = sum(len(r["token_ids"]) for r in rows)
    wall = max(r["e2e_latency_s"] for r in rows)
    return tokens, wall, tokens / wall if wall > 0 else 0.0


def engine_steady(rows):
    """Output tok/s of the batch's steady window, as duet-bench's: from the first request's end to
    the last request's admission (its first scheduling), with each request's tokens spaced evenly
    from its first token to its end (duet generate records no per-token times)."""
    begin = min(r["e2e_latency_s"] for r in rows)
    end = max(r["queue_time_s"] for r in rows)
    if end <= begin:
        return None
    tokens = 0
    for r in rows:
        n, first, last = len(r["token_ids"]), r["time_to_first_token_s"], r["e2e_latency_s"]
        times = [first + (last - first) * k / (n - 1) for k in range(n)] if n > 1 else [first]
        tokens += sum(begin <= t <= end for t in times)
    return tokens / (end - begin)


def engine_prefill_ms(rows):
    """Median time from a request's scheduling to its first token; with --max-num-seqs 1 each
    request's prefill step runs alone (its queueing behind the previous request left out)."""
    return statistics.median(1e3 * (r["time_to_first_token_s"] - r["queue_time_s"]) for r in rows)


def ratio_row(label, value, target, fmt="{:.2f}"):
    shown = "n/a" if value is None else fmt.format(value)
    return f"{label:<52} {shown:>8}   target {target}"


def main(out, engine_seqs):
    runs = {name: load_json(os.path.join(out, name + ".json")) for name in RUNS}
    batch = load_jsonl(os.path.join(out, "engine_batch.jsonl"))
    prefill = load_jsonl(os.path.join(out, "engine_prefill.jsonl"))

    print(f"{'run':>8} {'done':>5} {'fail':>4} {'req/s':>7} {'out tok/s':>9} {'TTFT med':>8} {'TTFT p99':>8} "
          f"{'TPOT med':>8} {'TPOT p99':>8} {'ITL p99':>7} {'E2EL med':>8}")
    for name, j in runs.items():
        if j is None:
            continue
        print(f"{name:>8} {j['completed']:>5} {j['failed']:>4} {j['request_throughput']:>7.2f} "
              f"{j['output_throughput']:>9.0f} {j['median_ttft_ms']:>8.1f} {j['p99_ttft_ms']:>8.1f} "
              f"{j['median_tpot_ms']:>8.2f} {j['p99_tpot_ms']:>8.2f} {j['p99_itl_ms']:>7.2f} "
              f"{j['median_e2el_ms']:>8.0f}")
    missing = [name for name, j in runs.items() if j is None]
    if missing:
        print("no result:", " ".join(missing))

    engine_tps = engine_steady_tps = prefill_ms = None
    if batch:
        tokens, wall, engine_tps = engine_batch(batch)
        engine_steady_tps = engine_steady(batch)
        print(f"engine alone, {len(batch)} requests at once, {engine_seqs} at a time: {tokens} tokens in "
              f"{wall:.2f} s = {engine_tps:.0f} out tok/s; steady window "
              f"{'n/a' if engine_steady_tps is None else f'{engine_steady_tps:.0f}'} out tok/s")
        c64 = runs["conc64"]
        if c64 is not None:
            # The same requests: the lengths the cluster reported for its first requests.
            n = min(len(batch), len(c64["input_lens"]))
            same = all(len(r["prompt_token_ids"]) == i and len(r["token_ids"]) == o
                       for r, i, o in zip(batch, c64["input_lens"], c64["output_lens"]))
            print(f"  prompt and output lengths {'equal' if same else 'DIFFER from'} conc64's for its first {n}")
    else:
        print("engine alone: no result (engine_batch.jsonl)")
    if prefill:
        prefill_ms = engine_prefill_ms(prefill)
        print(f"engine alone, one {len(prefill[0]['prompt_token_ids'])}-token prompt at a time: prefill "
              f"(scheduled to first token) median {prefill_ms:.1f} ms of {len(prefill)}")
    else:
        print("engine prefill: no result (engine_prefill.jsonl)")

    c64 = runs["conc64"] or {}
    c64_tps = c64.get("output_throughput")
    c64_steady = c64.get("steady_output_throughput") or None  # 0: no window
    if c64_steady:
        print(f"cluster at 64 streams, steady window (first end to last send, "
              f"{c64['steady_window_s']:.1f} s): {c64_steady:.0f} out tok/s")
    c1_ttft = runs["conc1"]["median_ttft_ms"] if runs["conc1"] else None
    print(ratio_row("cluster out tok/s at 64 streams / engine alone",
                    c64_tps / engine_tps if c64_tps is not None and engine_tps else None, ">= 0.9"))
    print(ratio_row(f"cluster out tok/s at 64 streams / {LLAMA_CPP_64} (llama.cpp)",
                    c64_tps / LLAMA_CPP_64 if c64_tps is not None else None, ">= 1.0"))
    print(ratio_row("  the same, steady windows (ramp and drain left out)",
                    c64_steady / engine_steady_tps if c64_steady and engine_steady_tps else None, ">= 0.9"))
    print(ratio_row(f"  steady window / {LLAMA_CPP_64} (llama.cpp's steady decode)",
                    c64_steady / LLAMA_CPP_64 if c64_steady else None, ">= 1.0"))
    print(ratio_row("cluster TTFT median at 1 stream - engine prefill",
                    c1_ttft - prefill_ms if c1_ttft is not None and prefill_ms is not None else None,
                    "<= 3 ms", "{:.1f} ms"))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
