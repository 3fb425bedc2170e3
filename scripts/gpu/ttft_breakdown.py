"""Attributes the cluster's time to first token to its parts, from /metrics snapshots taken
before and after one duet-bench run (scripts/gpu/h200_cluster.sh writes them):

  python3 scripts/gpu/ttft_breakdown.py BEFORE_DIR AFTER_DIR [BENCH_JSON]

Each DIR holds router.prom, prefill.prom and decode.prom (the router's HTTP /metrics and each
worker's metrics port). Prints per-request means over the run: the client's TTFT (BENCH_JSON's
mean_ttft_ms), the router's, its waits on ReserveKv, Prefill and the Decode call's first message,
and inside the prefill worker the forward pass (scheduled to first token) and the wait for the
KV transfer after it. What no histogram covers (the router's own work, gRPC hops, the prefill
worker's queue) is the remainder.
"""
import json
import re
import sys

SAMPLE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+([-+0-9.eE]+|NaN|[+-]Inf)$')


def parse(path):
    sums = {}
    for line in open(path):
        m = SAMPLE.match(line.strip())
        if not m:
            continue
        name, labels, value = m.group(1), m.group(2) or "", float(m.group(3))
        labels = ",".join(sorted(l for l in labels.strip("{}").split(",") if l and not l.startswith("le=")))
        key = (name, labels)
        sums[key] = sums.get(key, 0.0) + value
    return sums


def mean_ms(before, after, name, label_filter=""):
    def total(snapshot, suffix):
        return sum(v for (n, l), v in snapshot.items() if n == name + suffix and label_filter in l)
    count = total(after, "_count") - total(before, "_count")
    if count <= 0:
        return None, 0
    return 1e3 * (total(after, "_sum") - total(before, "_sum")) / count, int(count)


def main(before_dir, after_dir, bench_json=None):
    rows = []
    if bench_json:
        j = json.load(open(bench_json))
        rows.append(("client TTFT (duet-bench mean)", j.get("mean_ttft_ms"), j.get("completed")))
    parts = [
        ("router TTFT", "router", "duet:time_to_first_token_seconds", ""),
        ("  router: ReserveKv round trip", "router", "duet:router_worker_call_seconds", 'call="reserve_kv"'),
        ("  router: Prefill round trip", "router", "duet:router_worker_call_seconds", 'call="prefill"'),
        ("    prefill worker: scheduled to first token", "prefill", "duet:request_prefill_time_seconds", ""),
        ("    prefill worker: KV transfer wait after it", "prefill", "duet:kv_transfer_wait_seconds", ""),
        ("  router: Decode start to first message", "router", "duet:router_worker_call_seconds",
         'call="decode_first_message"'),
    ]
    snapshots = {}
    for role in ("router", "prefill", "decode"):
        try:
            snapshots[role] = (parse(f"{before_dir}/{role}.prom"), parse(f"{after_dir}/{role}.prom"))
        except OSError:
            snapshots[role] = ({}, {})
    for label, role, name, label_filter in parts:
        value, count = mean_ms(*snapshots[role], name, label_filter)
        rows.append((label, value, count))
    for label, value, count in rows:
        shown = "n/a" if value is None else f"{value:8.2f} ms"
        print(f"{label:<48} {shown:>12}  ({count} requests)")


if __name__ == "__main__":
    main(*sys.argv[1:])
