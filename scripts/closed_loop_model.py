"""A step-cost model of the one-GPU closed loop (h200_cluster.sh's conc64 and the engine alone):
C streams each send a P-token prompt for G tokens, a new one as soon as theirs ends, N in all;
the engine's scheduler (engine/scheduler) runs each step: every decoding request's token, then
prompt chunks first come first served within the step's budget (the whole --max-num-batched-tokens
while nothing decodes, --max-num-mixed-tokens beside decoding requests). A step costs what
cuda_llama_bench measured for 64 decode rows beside a chunk of that many prompt tokens
(--mixed-prompt; the H100 table "A chunk's cost" in docs/BENCHMARKS.md), interpolated.

Prints output tok/s over the whole run and over its steady window (duet-bench's: from the first
request's end to the last request's send), the steps, and the TTFT median and p99 in steps' ms.
Policies to compare (one line each):

  python3 scripts/closed_loop_model.py                       # the default configuration, 256 to 4096 requests
  python3 scripts/closed_loop_model.py --mixed 320,384,448   # other mixed budgets
  python3 scripts/closed_loop_model.py --ramp                # a larger budget while prompts outnumber decoders
  python3 scripts/closed_loop_model.py --follow-arrivals     # prompt tokens a step after their arrival rate
"""
import argparse
import math

# (prompt tokens beside 64 decode rows at context 576, ms a step); H100, cuda_llama_bench.
MIXED_STEP_MS = [(0, 7.79), (64, 8.48), (128, 9.31), (192, 10.04), (256, 11.11), (320, 12.37), (448, 14.73)]
DECODE_ROW_MS = 0.0233  # a decode row's share of a step (the weights' stream is the rest)


def step_ms(decode_rows, prompt_tokens):
    base = MIXED_STEP_MS[0][1] - DECODE_ROW_MS * (64 - decode_rows)
    for (a, ca), (b, cb) in zip(MIXED_STEP_MS, MIXED_STEP_MS[1:]):
        if prompt_tokens <= b:
            return base + (ca - MIXED_STEP_MS[0][1]) + (cb - ca) * (prompt_tokens - a) / (b - a)
    last_a, last_c = MIXED_STEP_MS[-1]
    slope = (last_c - MIXED_STEP_MS[-2][1]) / (last_a - MIXED_STEP_MS[-2][0])
    return base + (last_c - MIXED_STEP_MS[0][1]) + slope * (prompt_tokens - last_a)


class Request:
    def __init__(self, prompt, gen, sent_ms):
        self.prompt_left, self.gen_left, self.sent_ms = prompt, gen, sent_ms
        self.first_token_ms = None


def run(requests, streams=64, prompt=512, gen=128, budget=1024, mixed=384, policy="fixed"):
    """policy: "fixed" (the engine's), "ramp" (the whole budget while waiting prompts outnumber
    decoding requests) or "follow" (beside decoding requests, 1.1x the prompt tokens arriving a step,
    an average over ~20 steps, or the backlog spread over 16 steps if more; at most the mixed
    budget). Returns (out tok/s, steady out tok/s, steps, TTFT median ms, TTFT p99 ms)."""
    now = 0.0
    waiting = [Request(prompt, gen, 0.0) for _ in range(streams)]
    sent, running, finished, steps = streams, [], 0, 0
    token_times, ttfts, first_end, last_send = [], [], None, 0.0
    arriving, arrived = 0.0, prompt * streams  # prompt tokens a step (average), and this step's
    while finished < requests:
        arriving, arrived = 0.95 * arriving + 0.05 * arrived, 0
        decoding = [r for r in running if r.prompt_left == 0]
        prefilling = [r for r in running if r.prompt_left > 0]
        waiting_prompts = len(waiting) + len(prefilling)
        step_budget = budget if not decoding else max(len(decoding), mixed)
        if policy == "ramp" and decoding and waiting_prompts > len(decoding):
            step_budget = budget
        if policy == "follow" and decoding:
            backlog = sum(r.prompt_left for r in waiting + prefilling)
            step_budget = max(len(decoding), min(mixed, len(decoding) + max(64, int(1.1 * arriving),
                                                                              math.ceil(backlog / 16))))
        left = step_budget - len(decoding)
        chunk = 0
        for r in prefilling:
            take = min(left, r.prompt_left)
            r.prompt_left -= take
            left -= take
            chunk += take
        while left > 0 and waiting and len(running) < streams:
            r = waiting.pop(0)
            take = min(left, r.prompt_left)
            r.prompt_left -= take
            left -= take
            chunk += take
            running.append(r)
        now += step_ms(len(decoding), chunk)
        steps += 1
        prompts_done = [r for r in running if r.prompt_left == 0 and r.first_token_ms is None]
        for r in prompts_done:
            r.first_token_ms = now
        for r in decoding + prompts_done:  # a token each
            r.gen_left -= 1
            token_times.append(now)
        for r in [r for r in running if r.gen_left == 0]:
            running.remove(r)
            finished += 1
            first_end = now if first_end is None else first_end
            ttfts.append(r.first_token_ms - r.sent_ms)
            if sent < requests:  # the stream's next request
                waiting.append(Request(prompt, gen, now))
                arrived += prompt
                sent += 1
                last_send = now
    ttft = sorted(ttfts)
    steady = sum(first_end <= t <= last_send for t in token_times) / (last_send - first_end) * 1e3 \
        if last_send > first_end else 0.0
    return len(token_times) / now * 1e3, steady, steps, ttft[len(ttft) // 2], ttft[int(len(ttft) * 0.99)]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", default="256,1024,4096")
    parser.add_argument("--mixed", default="384", help="--max-num-mixed-tokens values")
    parser.add_argument("--ramp", action="store_true", help="also: the whole budget while prompts outnumber decoders")
    parser.add_argument("--follow-arrivals", action="store_true", help="also: prompt tokens after their arrival rate")
    args = parser.parse_args()
    print(f"{'requests':>8} {'mixed':>5} {'policy':>6} {'out tok/s':>9} {'steady':>7} {'steps':>6} "
          f"{'TTFT med':>8} {'TTFT p99':>8}")
    for requests in map(int, args.requests.split(",")):
        for mixed in map(int, args.mixed.split(",")):
            policies = ["fixed"] + ["ramp"] * args.ramp + ["follow"] * args.follow_arrivals
            for policy in policies:
                tps, steady, steps, t50, t99 = run(requests, mixed=mixed, policy=policy)
                print(f"{requests:>8} {mixed:>5} {policy:>6} {tps:>9.0f} {steady:>7.0f} "
                      f"{steps:>6} {t50:>8.1f} {t99:>8.1f}")


if __name__ == "__main__":
    main()
