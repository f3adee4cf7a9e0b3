"""A load generator for `sieve serve` (standard library only), side by side in
one run:

1. aggregate decode tokens/s of N concurrent streams against the same
   requests one at a time;
2. time to first token of a short request when idle, and while 3 long
   prompts are being read (chunked prefill lets it in);
3. the latency of a 1-token completion.

Usage: python3 scripts/serve-bench.py BASE_URL [--streams 4] [--tokens 64]
Prints a markdown table and a JSON line.
"""

import argparse
import json
import threading
import time
import urllib.request

p = argparse.ArgumentParser()
p.add_argument("base")
p.add_argument("--streams", type=int, default=4)
p.add_argument("--tokens", type=int, default=64)
p.add_argument("--long-prompt-words", type=int, default=1500)
a = p.parse_args()


def stream(body):
    """(seconds to the first text, seconds in all, completion tokens) of a streamed completion."""
    body = {**body, "stream": True, "stream_options": {"include_usage": True}, "temperature": 0}
    req = urllib.request.Request(a.base + "/v1/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    t0 = time.time()
    first, tokens = None, 0
    with urllib.request.urlopen(req, timeout=3600) as r:
        for line in r:
            line = line.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("choices") and chunk["choices"][0].get("text") and first is None:
                first = time.time() - t0
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    return first if first is not None else time.time() - t0, time.time() - t0, tokens


def together(bodies):
    out = [None] * len(bodies)

    def run(i):
        out[i] = stream(bodies[i])

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(bodies))]
    t = time.time()
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    return out, time.time() - t


prompts = [f"Story {i}: once upon a time, in a land far away," for i in range(a.streams)]
bodies = [{"prompt": q, "max_tokens": a.tokens, "sieve": {"policy": "full"}} for q in prompts]
stream(bodies[0])  # warm-up
t = time.time()
alone = [stream(b) for b in bodies]
t_alone = time.time() - t
both, t_both = together(bodies)
tokens = sum(r[2] for r in both)
one_tps, many_tps = sum(r[2] for r in alone) / t_alone, tokens / t_both

short = {"prompt": "The capital of France is", "max_tokens": 8}
idle_ttft = min(stream(short)[0] for _ in range(3))
long_bodies = [{"prompt": f"Text {i}: " + "many words " * a.long_prompt_words, "max_tokens": 4}
               for i in range(3)]
result = {}


def long_reads():
    result["long"] = together(long_bodies)


bg = threading.Thread(target=long_reads)
bg.start()
time.sleep(0.5)  # the long prompts are being read
busy_ttft = stream(short)[0]
bg.join()

one_token = {"prompt": "The capital of France is", "max_tokens": 1}
latency = min(stream(one_token)[1] for _ in range(3))

print("| measurement | value |")
print("|---|---|")
print(f"| {a.streams} streams of {a.tokens} tokens one at a time | {one_tps:.2f} tok/s |")
print(f"| the same {a.streams} together | {many_tps:.2f} tok/s ({many_tps / one_tps:.2f}x) |")
print(f"| time to first token, idle (best of 3) | {idle_ttft * 1e3:.0f} ms |")
print(f"| time to first token while 3 prompts of ~{a.long_prompt_words * 2} tokens are read | "
      f"{busy_ttft * 1e3:.0f} ms ({busy_ttft / idle_ttft:.2f}x idle) |")
print(f"| 1-token completion latency (best of 3) | {latency * 1e3:.0f} ms |")
print(json.dumps({"streams": a.streams, "tokens": a.tokens, "one_at_a_time_tps": one_tps,
                  "together_tps": many_tps, "idle_ttft_s": idle_ttft, "busy_ttft_s": busy_ttft,
                  "one_token_latency_s": latency}))
