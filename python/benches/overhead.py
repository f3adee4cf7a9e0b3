"""Python's overhead against the command line (issue #56's targets), side by
side in one run on the default model:

* decode speed: ``llm.generate`` against ``sieve run`` (raw prompt, greedy,
  ``max_tokens`` new tokens, end of sequence ignored), tokens per second as
  both report it ((generated - 1) / decode seconds);
* logits of 512 ids: ``sieve logits --out x.npy`` (a process: load, read,
  write) against ``sieve.Llm(...)`` + ``llm.logits`` + ``numpy.save`` in
  this process, and ``llm.logits`` alone.

Each round runs both, alternating; the medians are printed with their
ratios. Run from a checkout after ``bash scripts/python-api.sh``:

    SIEVE_ROOT=. target/python-venv/bin/python python/benches/overhead.py
"""

import argparse
import os
import re
import statistics
import subprocess
import tempfile
import time

import numpy as np

import sieve

ROOT = os.environ.get("SIEVE_ROOT", ".")
CLI = os.path.join(ROOT, "target/release/sieve")
PROSE = os.path.join(ROOT, "data/prose/moby_dick.txt")


def cli_decode(model: str, prompt: str, max_tokens: int) -> float:
    run = subprocess.run(
        [CLI, "run", "--model", model, "--raw", "--ignore-eos", "--max-tokens", str(max_tokens), "--prompt", prompt],
        check=True,
        capture_output=True,
        text=True,
    )
    return float(re.search(r"generated \d+ tokens in [\d.]+ s \(([\d.]+) tok/s\)", run.stderr).group(1))


def cli_logits(model: str, ids: list, out: str) -> float:
    start = time.perf_counter()
    subprocess.run(
        [CLI, "logits", "--model", model, "--ids", ",".join(map(str, ids)), "--out", out],
        check=True,
        capture_output=True,
    )
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=os.path.join(ROOT, "models/smollm2-135m-instruct"))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--ids", type=int, default=512)
    a = ap.parse_args()
    prompt = "Once upon a time"
    tmp = tempfile.mkdtemp()
    start = time.perf_counter()
    llm = sieve.Llm(a.model)
    load = time.perf_counter() - start
    ids = llm.tokenize(" ".join(open(PROSE).read().split()[2000:3000]))[: a.ids]
    assert len(ids) == a.ids, f"the text has only {len(ids)} tokens"
    py_tps, cli_tps, cli_s, py_s, py_alone = [], [], [], [], []
    for r in range(a.rounds):
        cli_tps.append(cli_decode(a.model, prompt, a.max_tokens))
        py_tps.append(llm.generate(prompt, max_tokens=a.max_tokens, ignore_eos=True).tokens_per_second)
        cli_s.append(cli_logits(a.model, ids, os.path.join(tmp, "cli.npy")))
        start = time.perf_counter()
        fresh = sieve.Llm(a.model)
        np.save(os.path.join(tmp, "py.npy"), fresh.logits(ids))
        py_s.append(time.perf_counter() - start)
        del fresh
        start = time.perf_counter()
        llm.logits(ids)
        py_alone.append(time.perf_counter() - start)
    same = np.array_equal(np.load(os.path.join(tmp, "cli.npy")).reshape(-1)[-llm.vocab_size :], np.load(os.path.join(tmp, "py.npy")))
    med = statistics.median
    print(f"model {a.model}, {a.rounds} rounds (medians), first load {load:.2f} s")
    print(f"decode tok/s, {a.max_tokens} tokens: sieve run {med(cli_tps):.2f}, llm.generate {med(py_tps):.2f}, python / cli {med(py_tps) / med(cli_tps):.3f}")
    print(f"logits of {a.ids} ids, s: sieve logits --out .npy {med(cli_s):.2f}, Llm + logits + np.save {med(py_s):.2f} "
          f"(python / cli {med(py_s) / med(cli_s):.3f}), llm.logits alone {med(py_alone):.2f} ({med(py_alone) / med(cli_s):.3f}); "
          f"the last logits {'equal' if same else 'DIFFER'}")


if __name__ == "__main__":
    main()
