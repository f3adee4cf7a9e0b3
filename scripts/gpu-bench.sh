#!/usr/bin/env bash
# sieve's GPU benchmark, sized for one command on a lent GPU machine: the
# kernel and golden tests on the device first, then synthetic Llama-3.1-8B
# and Llama-3.2-1B shapes (random weights made on the GPU, no download):
# prefill 512 (median of 3 after a warm-up) and decode at depths
# 0/4096/16384 next to llama.cpp's Vulkan figures, with the device's
# timed kernels (`--kernels auto`, which is `tuned` on a GPU), without the
# matrix units (SIEVE_MATRIX_UNITS=0: the tiled GEMMs), with wgpu's
# shader loop counters (SIEVE_LOOP_BOUNDING=1), in Q4_0 and Q8_0, the CCS refresh, the fixed-rule
# `gpu` set, wgpu's own SPIR-V for the cooperative kernels, decode with
# eviction and long contexts.
#
# Fits by construction: every section has a time cap and a minimum, and
# starts only while the whole run's budget (SIEVE_BENCH_SECONDS, default
# 440 s from the start, tests included) has its minimum left; it runs
# under `timeout` for the smaller of its cap and what is left. So the
# script ends within the budget plus about 15 s (setup and packing), under
# 8 minutes, and the sections that matter most come first.
#
# Leaves four files in OUT (a GPU machine returns at most 8): gpu-bench.md
# (the summary: adapter, test results, the table against llama.cpp, every
# section's tables), gpu-bench.json (every `sieve bench` report), log.txt
# (everything printed) and gpu-bench.tar.gz (every section's full output).
#
#   bash scripts/gpu-bench.sh [--small] [--from PACK] [OUT]   (OUT: bench-out)
#   bash scripts/gpu-bench.sh --pack PACK
#
# --pack PACK (on a build machine) fills PACK with what an offline GPU machine
# needs: the stripped release binary, the library and tiny-golden test
# binaries, the tiny golden models, and the Debian packages of the Vulkan
# loader and GL dispatch libraries (libvulkan1 libglvnd0 libglx0 libegl1
# libgl1 libopengl0 libgles2: NVIDIA's Vulkan driver finds no device with the
# loader alone). About 45 MB. --from PACK (on the GPU machine) uses them.
# --small runs CI-sized shapes instead (the 135M shape, short prompts and
# depths), so that the script can be checked on a CPU Vulkan driver such as
# lavapipe (give it SIEVE_BENCH_SECONDS=900 or so there).
# The KV cache is stored in f16, as a deployment would; SIEVE_KV_DTYPE=f32
# measures the f32 cache instead.
set -uo pipefail
cd "$(dirname "$0")/.."
# Every section but the ones that ask otherwise runs sieve's defaults:
# kernels without wgpu's shader loop counters, sieve's own SPIR-V for the
# cooperative kernels, the matrix units.
unset SIEVE_LOOP_BOUNDING SIEVE_SPIRV SIEVE_MATRIX_UNITS SIEVE_KERNELS
small=0
out=bench-out
pack=
from=
while [ $# -gt 0 ]; do
    case "$1" in
        --small) small=1 ;;
        --pack) pack="$2"; shift ;;
        --from) from="$2"; shift ;;
        -h|--help) sed -n 2,38p "$0"; exit 0 ;;
        *) out="$1" ;;
    esac
    shift
done

# shellcheck source=scripts/vulkan-env.sh
source scripts/vulkan-env.sh
if [ -n "$pack" ]; then
    set -e
    mkdir -p "$pack/bin" "$pack/golden" "$pack/gl"
    cargo build --release
    cp target/release/sieve "$pack/bin/sieve"
    # The test executables cargo builds, by target name.
    tests_json=$(cargo test --release --no-run --message-format=json 2>/dev/null)
    exe() { # kind name
        printf '%s\n' "$tests_json" | grep "\"kind\":\[\"$1\"\],[^}]*\"name\":\"$2\"" |
            grep '"test":true' | grep -o '"executable":"[^"]*"' | head -1 | cut -d'"' -f4
    }
    cp "$(exe lib sieve)" "$pack/bin/sieve-lib-tests"
    cp "$(exe test golden_tiny)" "$pack/bin/golden-tiny-tests"
    strip "$pack"/bin/* 2>/dev/null || true
    cp -r ../shared/golden/tiny-qwen2 ../shared/golden/tiny-llama-gqa "$pack/golden/"
    download_vulkan_debs "$pack/gl"
    # The commit the binaries were built from ("+" where the tree had changes).
    echo "$(git rev-parse --short HEAD)$(git diff --quiet HEAD -- src shaders Cargo.toml || echo +)" > "$pack/commit"
    du -sh "$pack"
    exit 0
fi

start=$SECONDS
budget_s=${SIEVE_BENCH_SECONDS:-440}
kv_dtype=${SIEVE_KV_DTYPE:-f16}
mkdir -p "$out"
work=$(mktemp -d "${TMPDIR:-/tmp}/sieve-gpu-bench.XXXXXX")
exec > >(tee "$work/log.txt") 2>&1

# The summary: adapter and kernels, test results, the table against
# llama.cpp, then each section's tables.
summarize() {
    echo "# sieve gpu-bench ($(date -u +%Y-%m-%d), commit ${commit:-?}, KV cache $kv_dtype, $(( SECONDS - start )) s)"
    echo
    echo '```'
    head -16 "$work/info.txt" 2>/dev/null
    grep -E '^kernels|^warning' "$work/info-cpu-set.txt" 2>/dev/null | sed 's/^/--kernels cpu: /'
    grep -E '^kernels|^warning' "$work/info-wgpu-spirv.txt" 2>/dev/null | sed 's/^/SIEVE_SPIRV=wgpu: /'
    echo '```'
    for f in tests-kernels tests-golden tests-wgpu-spirv; do
        [ -f "$work/$f.txt" ] && echo && echo "$f: $(grep 'test result' "$work/$f.txt" | head -1)"
    done
    if command -v python3 >/dev/null; then
        echo
        python3 - "$work"/speed-*.json <<'PY'
import json, sys
# llama.cpp's Vulkan backend (llama-bench, flash attention on), measured on
# 2026-11-30 on the H200 machine this script is written for: prefill 512,
# decode at depth 0 and 4096, tok/s.
ref = {("llama-3.1-8b", "f16"): (2587, 180.4, 163.5), ("llama-3.2-1b", "f16"): (5988, 526, 609),
       ("llama-3.1-8b", "q8_0"): (2481, 209, 186), ("llama-3.1-8b", "q4_0"): (2552, 251, 224),
       ("llama-3.2-1b", "q4_0"): (15008, 705, 657)}
def cell(v, l):
    if v is None:
        return "-"
    return f"{v:,.0f}" + (f" ({l:,.0f}, x{v / l:.2f})" if l else "")
print("## Against llama.cpp (Vulkan, measured 2026-11-30 on the H200 machine)")
print()
print("Decode: steps submitted ahead (the headline), one synchronous step at a time in brackets.")
print()
print("| run | kernels | prefill tok/s (llama.cpp at 512) | decode d0 (llama.cpp) | d4096 (llama.cpp) | d16384 | % of read bound at d0 |")
print("|---|---|---|---|---|---|---|")
for path in sys.argv[1:]:
    try:
        r = json.load(open(path))
    except Exception as e:
        print(f"| {path.rsplit('/', 1)[-1]} | unreadable: {e} | | | | | |")
        continue
    shape = next(((s, f) for s, f in ref if s in r["model"] and r["weights"].startswith(f + " ")), None)
    lp, l0, l4 = ref.get(shape, (None, None, None))
    pre = {p["tokens"]: p["tokens_per_second"] for p in r["prefill"]}
    n_pre = max(pre, default=None)
    pre_cell = "-" if n_pre is None else f"{n_pre}: " + cell(pre[n_pre], lp if n_pre == 512 else None)
    dec = {d["depth"]: d for d in r["decode"]}
    def decode(depth, l):
        d = dec.get(depth)
        if d is None:
            return "-"
        return cell(d["tokens_per_second"], l) + f" [{d.get('synchronous_tokens_per_second', 0):,.0f}]"
    bound = dec.get(0, {}).get("fraction_of_bound")
    bound = "-" if bound is None else f"{100 * bound:.0f}%"
    name = path.rsplit("/", 1)[-1].removesuffix(".json").removeprefix("speed-")
    print(f"| {name} | {r['kernels'].split()[0]} | {pre_cell} | {decode(0, l0)} | {decode(4096, l4)} | {decode(16384, None)} | {bound} |")
PY
    fi
    for name in "${sections[@]}"; do
        case $name in info*) continue ;; esac
        echo
        echo "## $name"
        echo
        cat "$work/$name.md"
    done
    if [ -f "$work/skipped.txt" ]; then
        echo
        echo "## Skipped"
        echo
        cat "$work/skipped.txt"
    fi
}

# The four files of OUT, also when the run is interrupted.
finish() {
    summarize > "$work/gpu-bench.md"
    cp "$work/gpu-bench.md" "$work/gpu-bench.json" "$out/" 2>/dev/null
    tar -czf "$out/gpu-bench.tar.gz" -C "$work" . 2>/dev/null
    echo "gpu-bench: $out/gpu-bench.md, gpu-bench.json, gpu-bench.tar.gz, log.txt after $(( SECONDS - start )) s"
    sleep 0.2
    cp "$work/log.txt" "$out/log.txt"
}
trap finish EXIT

# 1. A Vulkan loader. Offline machines bring Debian packages (--from PACK, or .gl/).
debs=()
[ -n "$from" ] && debs+=("$from"/gl/*.deb)
setup_vulkan "${debs[@]}" || exit 1

# 2. The release binary (built here when cargo is present).
if [ -n "$from" ]; then
    bin="$from/bin/sieve"
    tests_bin="$from/bin/sieve-lib-tests"
    golden_bin="$from/bin/golden-tiny-tests"
    export SIEVE_GOLDEN_DIR="$from/golden"
else
    if command -v cargo >/dev/null; then
        cargo build --release || exit 1
    fi
    bin=./target/release/sieve
    tests_bin=
    golden_bin=
fi
if [ -n "$from" ] && [ -f "$from/commit" ]; then
    commit=$(cat "$from/commit")
else
    commit="$(git rev-parse --short HEAD 2>/dev/null)$(git diff --quiet HEAD -- src shaders Cargo.toml 2>/dev/null || echo +)"
fi
if [ ! -x "$bin" ]; then
    echo "gpu-bench: no $bin; install Rust (cargo) or bring a release build" >&2
    exit 1
fi

# section NAME CAP MIN [VAR=VALUE ...] -- COMMAND ...: runs COMMAND (with the
# variables set) under a time limit of CAP seconds or what is left of the
# budget, whichever is less, if at least MIN seconds are left; its output
# goes to NAME.txt, the lines of its tables to the console and NAME.md.
sections=()
section() {
    local name=$1 cap=$2 min=$3 left limit rc
    shift 3
    local vars=()
    while [ "$1" != -- ]; do vars+=("$1"); shift; done
    shift
    left=$(( budget_s - (SECONDS - start) ))
    if [ "$left" -lt "$min" ]; then
        echo "== $name: skipped ($left s of the budget left, $min needed)" | tee -a "$work/skipped.txt"
        return
    fi
    limit=$(( left < cap ? left : cap ))
    echo "== $name (at most $limit s): ${vars[*]} $*"
    local t0=$SECONDS
    env "${vars[@]}" timeout -k 5 "$limit" "$@" > "$work/$name.txt" 2>&1
    rc=$?
    grep -E '^\||^kernel|^streaming|^sieve bench|^test |^test result|panicked|^warning|^error|^Error|^GPU' "$work/$name.txt" |
        grep -v '^test .* \.\.\. ok$' | tee "$work/$name.md"
    [ "$rc" = 124 ] && echo "   (stopped at its limit of $limit s)" | tee -a "$work/$name.md"
    echo "   ($name: exit status $rc in $(( SECONDS - t0 )) s)" | tee -a "$work/$name.md"
    sections+=("$name")
}

# bench NAME CAP MIN [VAR=VALUE ...] -- SHAPE ARGS ...: a `sieve bench` section
# on a synthetic shape, its report in NAME.json.
bench() {
    local name=$1 cap=$2 min=$3
    shift 3
    local vars=()
    while [ "$1" != -- ]; do vars+=("$1"); shift; done
    shift
    local shape=$1
    shift
    # --small runs one shape for both: the second run of a name gets a suffix.
    [ -f "$work/$name.txt" ] && name=$name-again
    section "$name" "$cap" "$min" "${vars[@]}" -- "$bin" bench --synthetic "$shape" \
        --kv-dtype "$kv_dtype" --json "$work/$name.json" "$@"
}

# 3. The adapter, and the kernels each set uses on it.
section info 30 10 -- "$bin" info
section info-cpu-set 20 10 -- "$bin" info --kernels cpu
# The cooperative kernels' start-up checks with wgpu's own SPIR-V (the
# Vulkan memory model declared, its barriers unmet: src/spirv.rs); a kernel
# that fails there prints a warning.
section info-wgpu-spirv 20 10 SIEVE_SPIRV=wgpu -- "$bin" info

if [ "$small" = 1 ]; then
    big=smollm2-135m
    little=smollm2-135m
    prefill=128
    depths=0,512
    depths_short=0,256
    steps=4
    evict=(--budget 40 --chunk 8 --generate 48)
    refresh=320
    contexts=512,1024
    policy_context=1024
    budgets=256
    tests_slack=4
else
    big=llama-3.1-8b
    little=llama-3.2-1b
    prefill=512
    depths=0,4096,16384
    depths_short=0,4096
    steps=16
    evict=(--budget 256 --chunk 32 --generate 512)
    refresh=4160
    contexts=4096,16384,65536
    policy_context=65536
    budgets=2048,4096,8192
    tests_slack=1
fi
speed=(--prefill "$prefill" --refresh-sizes 0)

# 4. Correctness on this device first: every kernel variant against its CPU
# reference (the cooperative GEMMs included where the device offers them)
# and every kernel set on the tiny golden models. A `--small` run on a CPU
# driver gets four times the limits, so that its results show too.
if [ -n "$tests_bin" ] && [ -x "$tests_bin" ]; then
    section tests-kernels $((90 * tests_slack)) 30 -- "$tests_bin" --test-threads 4 \
        kernels:: device:: spirv:: gpu:: shaders::
    section tests-golden $((45 * tests_slack)) 20 -- "$golden_bin" --test-threads 2
fi

# 5. Speed, most important first: the 8B shape with the device's kernels
# (per-kernel split of a prefill and a decode step included), then without
# the matrix units and with the loop counters, the 1B shape, the block
# formats and the CCS refresh.
bench speed-$big 100 40 -- "$big" "${speed[@]}" --depths "$depths" --decode-steps "$steps"
bench speed-$big-no-matrix-units 60 30 SIEVE_MATRIX_UNITS=0 -- "$big" "${speed[@]}" \
    --depths 0 --decode-steps 8
bench speed-$big-loop-counters 60 30 SIEVE_LOOP_BOUNDING=1 -- "$big" "${speed[@]}" \
    --depths "$depths_short" --decode-steps "$steps"
bench speed-$little 60 30 -- "$little" "${speed[@]}" --depths "$depths" --decode-steps "$steps"
for dtype in q4_0 q8_0; do
    bench speed-$big-$dtype 60 30 -- "$big" "${speed[@]}" --dtype "$dtype" \
        --depths "$depths_short" --decode-steps 8
done
# Decode without the mat-vecs that read x prepared once per token (issue
# #53), beside the rows above (every candidate timed; each report lists the
# timings' choices): f16 without the f16-x ones (`!x16`), Q4_0 without the
# integer-dot ones (`!q8`) and with them alone (`q8`).
bench speed-$big-no-x16 40 20 "SIEVE_TUNE_FORCE=mat-vec=!x16" -- "$big" "${speed[@]}" \
    --depths 0 --decode-steps 8 --prefill-runs 1
bench speed-$big-q4_0-no-q8 40 20 "SIEVE_TUNE_FORCE=mat-vec=!q8" -- "$big" "${speed[@]}" \
    --dtype q4_0 --depths 0 --decode-steps 8 --prefill-runs 1
bench speed-$big-q4_0-q8-only 40 20 "SIEVE_TUNE_FORCE=mat-vec=q8" -- "$big" "${speed[@]}" \
    --dtype q4_0 --depths 0 --decode-steps 8 --prefill-runs 1
# Decode at depth without the split-key attention (`!SplitKey`) and with
# it alone (`SplitKey`: the timings choose its split length per depth).
bench speed-$big-no-split 50 25 "SIEVE_TUNE_FORCE=attention decode=!SplitKey" -- "$big" \
    "${speed[@]}" --depths "$depths" --decode-steps 8 --prefill-runs 1
bench speed-$big-split-only 50 25 "SIEVE_TUNE_FORCE=attention decode=SplitKey" -- "$big" \
    "${speed[@]}" --depths "$depths" --decode-steps 8 --prefill-runs 1
bench speed-$little-split-only 40 20 "SIEVE_TUNE_FORCE=attention decode=SplitKey" -- "$little" \
    "${speed[@]}" --depths "$depths_short" --decode-steps 8 --prefill-runs 1
# The CCS refresh at cache size 4096 + 64 (target: within 2x of the paper's
# 52.6 ms for ccs and 496 ms for ccs-full on an 8B model).
bench ccs-$big 60 30 -- "$big" --prefill 1 --depths 0 --decode-steps 2 \
    --policies ccs,ccs-full --refresh-sizes "$refresh" --chunk 64

# 6. Beside the device's kernels: the mat-mul and attention tests with
# wgpu's own SPIR-V, the fixed-rule `gpu` set, the device's kernels with
# wgpu's SPIR-V for the cooperative kernels.
if [ -n "$tests_bin" ] && [ -x "$tests_bin" ]; then
    section tests-wgpu-spirv $((45 * tests_slack)) 20 SIEVE_SPIRV=wgpu -- "$tests_bin" \
        --test-threads 4 kernels::matmul kernels::attention
fi
bench speed-$big-gpu-set 45 25 -- "$big" "${speed[@]}" --kernels gpu --depths 0 --decode-steps 8
bench speed-$big-wgpu-spirv 45 25 SIEVE_SPIRV=wgpu -- "$big" "${speed[@]}" --depths 0 --decode-steps 8
bench speed-$little-q4_0 45 25 -- "$little" "${speed[@]}" --dtype q4_0 --depths "$depths_short" \
    --decode-steps 8
# The newer families' shapes beside the 8B Llama one (issue #52's target:
# decode within 10% of its tok/s per weight byte): Qwen3's q/k norms,
# Gemma 3's heads of 256, windows and sandwich norms.
if [ "$small" != 1 ]; then
    for shape in qwen3-8b gemma-3-4b; do
        bench speed-$shape 45 25 -- "$shape" "${speed[@]}" --depths "$depths_short" --decode-steps 8
    done
fi

# 7. Decode with eviction, one step at a time and with steps submitted
# ahead between refreshes (after a 32-token prompt the cache fills at J + h
# and refreshes every h tokens), then long contexts: the full cache at
# each context, and window, EpiKV and H2O (fused, and materialized as eager
# attention would) at each budget at the largest context, filled in one
# eager prefill step of J + h tokens.
bench evicting-decode-$little 60 30 -- "$little" --prefill 8 --depths 0 --decode-steps 2 \
    --prefill-runs 1 --refresh-sizes 0 "${evict[@]}" --policies full,window,h2o,tova,epikv,ccs
bench contexts-$little 60 30 -- "$little" --prefill "$prefill" --prefill-runs 1 --depths 0 \
    --decode-steps "$steps" --context "$contexts" --refresh-sizes 0
fill=$(( ${budgets##*,} + 64 ))
bench contexts-policies-$little 90 40 -- "$little" --prefill 1 --prefill-runs 1 --depths 0 \
    --decode-steps "$steps" --context "$policy_context" --context-budgets "$budgets" \
    --policies window,epikv,h2o --materialize --fill-step "$fill" --refresh-sizes 0

# 8. One JSON of every report, and the summary (finish, at exit).
{
    echo "{\"commit\": \"$commit\", \"date\": \"$(date -u +%Y-%m-%dT%H:%M:%SZ)\", \"runs\": ["
    first=1
    for j in "$work"/*.json; do
        [ -f "$j" ] && [ "$j" != "$work/gpu-bench.json" ] || continue
        [ $first = 1 ] || echo ","
        first=0
        cat "$j"
    done
    echo "]}"
} > "$work/gpu-bench.json"
