#!/usr/bin/env bash
# The full evaluation of EVAL.md in one command, for a machine with a real GPU
# (on lavapipe it takes days). Resumable: rerun after an interruption.
#
#   bash scripts/eval-full.sh [OUT] [extra options for every sweep, e.g. --model DIR]
#
# Every policy at budgets 128/256/512 (chunk 32) on all 45 reasoning traces and
# 12 prose segments (2,048 tokens each), needle retrieval at 5 depths x 4 pass
# keys in 2,048-token prompts, generation agreement on 20 MATH-500 problems,
# and MATH-500 / GSM8K / AIME 2024 accuracy. To spread the task runs over n
# machines, run `sieve eval task ... --shard i/n` on each and combine the
# folders with `sieve eval merge`.
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-eval-out}"
shift || true
bin=./target/release/sieve
[ -x "$bin" ] || cargo build --release
common=(--budgets 128,256,512 --chunk 32 "$@")
"$bin" eval fidelity --dataset reasoning_traces --doc-tokens 2048 "${common[@]}" --out "$out/fidelity-reasoning-traces"
"$bin" eval fidelity --dataset prose --docs 12 --doc-tokens 2048 "${common[@]}" --out "$out/fidelity-prose"
"$bin" eval needle --context 2048 --depths 0.1,0.3,0.5,0.7,0.9 --trials 4 "${common[@]}" --out "$out/needle"
"$bin" eval generate --dataset math500 --limit 20 --max-new-tokens 1024 "${common[@]}" --out "$out/generate"
for d in math500 gsm8k aime2024; do
    "$bin" eval task --dataset "$d" --max-new-tokens 2048 "${common[@]}" --out "$out/task-$d"
done
echo "eval-full: results and reports under $out"
