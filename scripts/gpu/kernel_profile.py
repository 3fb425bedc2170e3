"""Sums one forward pass's kernel times from an Nsight Compute CSV (scripts/gpu/h200_step_profile.sh).

--by-kernel: instead, every metric's median per (kernel, grid) over the CSV's launches (for
throughput sections: which unit limits a kernel).

ncu --metrics gpu__time_duration.sum --csv --print-units base  gives one row per kernel launch.
--last-step: the decode step, found as the period of the launches at the end of the run (the bench
ends with identical decode steps). Otherwise the prefill: with the decode steps at the end left
out, the longest launch sequence repeated at least 4 times in a row (the bench runs it 6 times). Prints the pass's
kernels grouped by name (and grid), their count, total µs and share.
"""
import csv
import statistics
import sys
from collections import OrderedDict


def launches(path):
    rows = []
    with open(path) as f:
        lines = [l for l in f if l.startswith('"')]
    for r in csv.DictReader(lines):
        if r.get("Metric Name") != "gpu__time_duration.sum":
            continue
        value = float(r["Metric Value"].replace(",", ""))
        unit = r.get("Metric Unit", "nsecond")
        ns = value * {"nsecond": 1, "ns": 1, "usecond": 1e3, "us": 1e3, "msecond": 1e6, "ms": 1e6}.get(unit, 1)
        rows.append((r["Kernel Name"], r["Grid Size"], r["Block Size"], ns))
    return rows


def run_length(keys, period, end):
    """How many launches before `end` equal the launch `period` later."""
    n = 0
    i = end - period - 1
    while i >= 0 and keys[i] == keys[i + period]:
        n += 1
        i -= 1
    return n


def tail_period(keys):
    best = None
    for p in range(8, len(keys) // 3):
        if run_length(keys, p, len(keys)) >= 2 * p:
            best = p  # the largest period that repeats at least three times at the end
    if best is None:
        return None
    # A run of many identical steps also repeats every few steps: keep one step (a divisor of the
    # period that the last period's launches repeat with; a layer does not, the step's ends break it).
    for k in range(12, 1, -1):
        q = best // k
        if best % k == 0 and q >= 8 and run_length(keys, q, len(keys)) >= best - q:
            return q
    return best


def repeated_block(keys, copies=4):
    """The last copy of the longest launch sequence that runs `copies` times in a row."""
    n = len(keys)
    for p in range(n // copies, 7, -1):
        run = 0
        for i in range(n - p):
            run = run + 1 if keys[i] == keys[i + p] else 0
            if run >= (copies - 1) * p:  # keys[i-(copies-1)p+1 .. i+p] is `copies` copies
                return i + 1, p
    return None, None


def short(name):
    return name.replace("void ", "")[:90]


def table(rows, title):
    groups = OrderedDict()
    for name, grid, block, ns in rows:
        key = (short(name), grid)
        g = groups.setdefault(key, [0, 0.0])
        g[0] += 1
        g[1] += ns
    total = sum(ns for *_, ns in rows)
    print(f"{title}: {len(rows)} kernels, {total / 1e3:.1f} µs summed (each kernel alone)")
    print(f"{'µs':>9} {'share':>6} {'count':>5}  {'grid':<16} kernel")
    for (name, grid), (count, ns) in sorted(groups.items(), key=lambda kv: -kv[1][1]):
        print(f"{ns / 1e3:9.1f} {100 * ns / total:5.1f}% {count:5d}  {grid:<16} {name}")


def metric_medians(path):
    values = OrderedDict()  # (kernel, grid) -> metric -> [values]
    with open(path) as f:
        lines = [l for l in f if l.startswith('"')]
    for r in csv.DictReader(lines):
        try:
            v = float(r["Metric Value"].replace(",", ""))
        except ValueError:
            continue
        key = (short(r["Kernel Name"]), r["Grid Size"])
        values.setdefault(key, OrderedDict()).setdefault(r["Metric Name"], []).append(v)
    names = []
    for m in values.values():
        names += [n for n in m if n not in names]
    print("  ".join(f"{n}" for n in names))
    for (kernel, grid), m in values.items():
        cells = [f"{statistics.median(m[n]):.1f}" if n in m else "-" for n in names]
        count = max(len(v) for v in m.values())
        print(f"{' '.join(f'{c:>10}' for c in cells)} {count:4d}  {grid:<14} {kernel[:70]}")


def main():
    path = sys.argv[1]
    if "--by-kernel" in sys.argv:
        metric_medians(path)
        return
    rows = launches(path)
    if not rows:
        sys.exit(f"{path}: no gpu__time_duration rows")
    if "--last-step" in sys.argv:
        keys = [r[0] for r in rows]
        p = tail_period(keys)
        if p is None:
            sys.exit("no repeated decode step at the end of the run")
        table(rows[-p:], "last decode step")
    else:
        # Decode steps follow the prefills: leave them out first.
        names = [r[0] for r in rows]
        step = tail_period(names)
        if step is not None:
            rows = rows[:len(rows) - step - run_length(names, step, len(names))]
        keys = [(r[0], r[1]) for r in rows]
        begin, p = repeated_block(keys)
        if begin is None:
            sys.exit("no repeated prefill block")
        table(rows[begin:begin + p], f"prefill (a block of {p} launches, repeated)")

if __name__ == "__main__":
    main()
