# Sourced by the GPU scripts' prologues: the SM clock, power and throttle reasons sampled every
# 100 ms into $OUT/clocks.csv from the moment it is sourced; clock_mark and clock_summary LABEL
# print what was sampled since the mark (whether sustained work ran below boost, at the power cap).
nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,temperature.gpu,clocks_event_reasons.active \
  --format=csv,noheader,nounits -lms 100 > "$OUT/clocks.csv" 2>&1 &
clock_sampler_pid=$!
trap 'kill $clock_sampler_pid 2>/dev/null' EXIT
clock_from=0
clock_mark() { clock_from=$(wc -l < "$OUT/clocks.csv"); }
clock_summary() {  # label
  tail -n +"$((clock_from + 1))" "$OUT/clocks.csv" | python3 -c '
import sys, statistics
rows = [l.strip().split(", ") for l in sys.stdin if l.count(",") >= 4]
num = lambda v: v.replace(".", "", 1).isdigit()
clk = [float(r[1]) for r in rows if num(r[1])]
pw = [float(r[2]) for r in rows if num(r[2])]
if clk:
    print(f"{sys.argv[1]}: SM clock MHz min {min(clk):.0f}, median {statistics.median(clk):.0f}, max {max(clk):.0f}; "
          f"power W median {statistics.median(pw):.0f}, max {max(pw):.0f}; {len(clk)} samples; "
          f"event reasons {sorted({r[4] for r in rows})}")' "$1"
}
