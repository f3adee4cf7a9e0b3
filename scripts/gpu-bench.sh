#!/usr/bin/env bash
# sieve's GPU benchmark: kernel and golden tests on the GPU, then synthetic 1B
# and 8B shapes (random weights made on the GPU, no download): prefill 512 and
# decode at depths 0/4096/16384 next to llama.cpp's Vulkan figures (with
# `--kernels auto`: on a GPU each weight shape's kernels timed on the device),
# the fixed-rule `gpu` and the `cpu` kernel sets and the device's kernels
# without wgpu's shader loop counters, and with wgpu's own SPIR-V for the
# cooperative kernels, side by side, contexts 4k/16k/64k with
# the full cache and with eviction, and the CCS refresh. On a Linux machine
# with an NVIDIA GPU and its driver (any Vulkan device works). Prints each
# result as it comes and writes OUT/gpu-bench.json and OUT/gpu-bench.md.
# Sized for 8 to 9 minutes on an H200: what runs after the speed table stops
# at a budget (SIEVE_BENCH_SECONDS, 450 s after the tests).
#
#   bash scripts/gpu-bench.sh [--small] [--from PACK] [OUT]   (OUT: bench-out)
#   bash scripts/gpu-bench.sh --pack PACK
#
# --pack PACK (on a build machine) fills PACK with what an offline GPU machine
# needs: the stripped release binary, the library and tiny-golden test
# binaries, the tiny golden models, and the Debian packages of the Vulkan
# loader and GL dispatch libraries (libvulkan1 libglvnd0 libglx0 libegl1
# libgl1 libopengl0 libgles2: NVIDIA's Vulkan driver finds no device with the
# loader alone). About 50 MB. --from PACK (on the GPU machine) uses them.
# --small runs CI-sized shapes instead (the 135M shape at contexts 512/1024), so
# that the script can be checked on a CPU Vulkan driver such as lavapipe.
# The KV cache is stored in f16, as a deployment would; SIEVE_KV_DTYPE=f32
# measures the f32 cache instead.
set -uo pipefail
cd "$(dirname "$0")/.."
# Every run but the one that asks otherwise keeps wgpu's shader loop counters,
unset SIEVE_LOOP_BOUNDING
# ... and sieve's own SPIR-V for the cooperative kernels (SIEVE_SPIRV).
unset SIEVE_SPIRV
small=0
out=bench-out
pack=
from=
while [ $# -gt 0 ]; do
    case "$1" in
        --small) small=1 ;;
        --pack) pack="$2"; shift ;;
        --from) from="$2"; shift ;;
        -h|--help) sed -n 2,22p "$0"; exit 0 ;;
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
    du -sh "$pack"
    exit 0
fi

mkdir -p "$out"
start=$SECONDS
budget_s=${SIEVE_BENCH_SECONDS:-450}
kv_dtype=${SIEVE_KV_DTYPE:-f16}

# 1. A Vulkan loader. Offline machines bring Debian packages (--from PACK, or .gl/).
debs=()
[ -n "$from" ] && debs+=("$from"/gl/*.deb)
setup_vulkan "${debs[@]}" || exit 1

# 2. The release binary (built here when cargo is present).
if [ -n "$from" ]; then
    bin="$from/bin/sieve"
else
    if command -v cargo >/dev/null; then
        cargo build --release || exit 1
    fi
    bin=./target/release/sieve
fi
if [ ! -x "$bin" ]; then
    echo "gpu-bench: no $bin; install Rust (cargo) or bring a release build" >&2
    exit 1
fi

# 3. The adapter, and the kernels each set uses on it.
"$bin" info | tee "$out/info.txt"
"$bin" info --kernels cpu | grep '^kernels' | sed 's/^kernels: /kernels (--kernels cpu):/' | tee -a "$out/info.txt"
# The cooperative kernels' start-up checks with wgpu's own SPIR-V too (the
# Vulkan memory model declared, its barriers unmet: src/spirv.rs); a kernel
# that fails there prints a warning.
SIEVE_SPIRV=wgpu "$bin" info 2>&1 | grep -E '^kernels|^warning' |
    sed 's/^kernels: /kernels (SIEVE_SPIRV=wgpu):/' | tee -a "$out/info.txt"

# 4. Correctness on this device first: every kernel variant against its CPU
# reference (the cooperative GEMM included where the device offers it) and
# every kernel set on the tiny golden models. The time limits fit a GPU;
# a `--small` run on a CPU driver gets four times as long, so that its
# test results show too.
tests_slack=1
[ "$small" = 1 ] && tests_slack=4
if [ -n "$from" ] && [ -x "$from/bin/sieve-lib-tests" ]; then
    echo "== kernel tests on this device"
    timeout $((150 * tests_slack)) "$from/bin/sieve-lib-tests" --test-threads 1 kernels:: device:: spirv:: gpu:: shaders:: 2>&1 |
        grep -E '^test |test result|panicked|note:' | tee "$out/kernel-tests.txt"
    echo "== the mat-mul and attention kernel tests again with wgpu's own SPIR-V (SIEVE_SPIRV=wgpu)"
    SIEVE_SPIRV=wgpu timeout $((90 * tests_slack)) "$from/bin/sieve-lib-tests" --test-threads 1 kernels::matmul kernels::attention 2>&1 |
        grep -E '^test |test result|panicked|note:' | tee "$out/kernel-tests-wgpu-spirv.txt"
    echo "== golden tests (tiny models, every kernel set)"
    SIEVE_GOLDEN_DIR="$from/golden" timeout $((120 * tests_slack)) "$from/bin/golden-tiny-tests" --test-threads 1 2>&1 |
        grep -E '^test |test result|panicked' | tee "$out/golden-tests.txt"
fi

# 5. Speed: prefill 512 and decode at depths 0/4096/16384 with the device's
# kernels, and the 8B shape with the `cpu` set side by side.
if [ "$small" = 1 ]; then
    speed_shapes=(smollm2-135m)
    speed_args=(--prefill 128 --depths 0,512 --decode-steps 4)
else
    speed_shapes=(llama-3.2-1b llama-3.1-8b)
    speed_args=(--prefill 512 --depths 0,4096,16384 --decode-steps 16)
fi
runs=()
for shape in "${speed_shapes[@]}"; do
    json="$out/$shape-speed.json"
    echo "== $shape (speed): sieve bench --synthetic $shape --kv-dtype $kv_dtype ${speed_args[*]} --refresh-sizes 0"
    timeout 120 "$bin" bench --synthetic "$shape" --kv-dtype "$kv_dtype" "${speed_args[@]}" \
        --refresh-sizes 0 --json "$json" | grep -E '^\||^kernel|^streaming' | tee "$out/$shape-speed.md"
    [ -f "$json" ] && runs+=("$json")
done
shape=${speed_shapes[-1]}
# Beside it, the same shape with the fixed-rule `gpu` kernels (what the
# timings bought: 2 rows per mat-vec workgroup, Coop for f16 prefill), with
# the `cpu` kernels, and with the device's kernels compiled without wgpu's
# loop counters (SIEVE_LOOP_BOUNDING=0: what the counters cost), and with
# wgpu writing the cooperative kernels' SPIR-V (SIEVE_SPIRV=wgpu: what
# sieve's own SPIR-V, GLSL450 memory model and clamped buffer indices, costs
# or buys).
for run in gpu cpu unbounded wgpu-spirv; do
    kernels=$run
    bounding=1
    spirv=coop
    case $run in
        gpu) steps=8; what="fixed rules, no timings" ;;
        cpu) steps=4; what="the lavapipe kernels" ;;
        unbounded) steps=8; kernels=auto; bounding=0; what="shader loops unbounded" ;;
        wgpu-spirv) steps=4; kernels=auto; spirv=wgpu; what="SPIR-V by wgpu" ;;
    esac
    json="$out/$shape-speed-$run-kernels.json"
    echo "== $shape (speed, --kernels $kernels: $what)"
    SIEVE_SPIRV=$spirv SIEVE_LOOP_BOUNDING=$bounding timeout 120 "$bin" bench --synthetic "$shape" --kv-dtype "$kv_dtype" \
        --kernels "$kernels" --prefill "${speed_args[1]}" --depths 0 --decode-steps "$steps" \
        --refresh-sizes 0 --json "$json" |
        grep -E '^\||^kernel' | tee "$out/$shape-speed-$run-kernels.md"
    [ -f "$json" ] && runs+=("$json")
done
# Quantized weights (issue #13): the largest shape with random blocks made on
# the GPU in each format; decode against the read bound of its own bytes.
if [ "$small" = 1 ]; then
    quant_formats=(q8_0 q4_0)
    quant_args=("${speed_args[@]}")
else
    quant_formats=(q8_0 q4_0 q4_k)
    quant_args=(--prefill 512 --depths 0,4096 --decode-steps 8)
fi
for dtype in "${quant_formats[@]}"; do
    json="$out/$shape-speed-$dtype.json"
    echo "== $shape (speed, --dtype $dtype)"
    timeout 90 "$bin" bench --synthetic "$shape" --kv-dtype "$kv_dtype" --dtype "$dtype" \
        "${quant_args[@]}" --refresh-sizes 0 --json "$json" |
        grep -E '^\||^kernel|^sieve bench' | tee "$out/$shape-speed-$dtype.md"
    [ -f "$json" ] && runs+=("$json")
done
# Side by side with llama.cpp's Vulkan backend on an H200 (flash attention
# on; prefill 512, decode at depth 0 and 4096; from the issue and the brief).
if command -v python3 >/dev/null; then
    python3 - "$out" "${runs[@]}" <<'PY' | tee "$out/vs-llama-cpp.md"
import json, sys
ref = {("llama-3.1-8b", "f16"): (2587, 180.4, 163.5), ("llama-3.2-1b", "f16"): (5988, 526, 609),
       ("llama-3.1-8b", "q8_0"): (2481, 209, 186), ("llama-3.1-8b", "q4_0"): (2552, 251, 224)}
print("| shape | kernels | prefill 512 tok/s (llama.cpp) | decode d0 (llama.cpp) | decode d4096 (llama.cpp) | decode d16384 | decode d0, steps submitted ahead | CPU ms recording a d0 step |")
print("|---|---|---|---|---|---|---|---|")
for path in sys.argv[2:]:
    r = json.load(open(path))
    shape = next(((s, f) for s, f in ref if s in r["model"] and r["weights"].startswith(f + " ")), None)
    pre = {p["tokens"]: p["tokens_per_second"] for p in r["prefill"]}
    dec = {d["depth"]: d["tokens_per_second"] for d in r["decode"]}
    record = {d["depth"]: d.get("record_ms_per_step") for d in r["decode"]}
    ahead = {d["depth"]: d.get("submitted_ahead_tokens_per_second") for d in r["decode"]}
    lp, l0, l4 = ref.get(shape, (None, None, None))
    def cell(v, l):
        if v is None:
            return "-"
        return f"{v:,.0f}" + (f" ({l:,.0f}, x{v / l:.2f})" if l else "")
    kernels = r["kernels"].split()[0] + (", loops unbounded" if "shader loops unbounded" in r["kernels"] else "")
    if "wgpu-spirv" in path:
        kernels += ", SPIR-V by wgpu"
    print(f"| {r['model']} {r['weights'].split()[0]} | {kernels} | {cell(pre.get(512), lp)} | {cell(dec.get(0), l0)} | {cell(dec.get(4096), l4)} | {cell(dec.get(16384), None)} | {cell(ahead.get(0), l0)} | {record.get(0) or 0:.2f} |")
PY
fi

# 5b. Decode with eviction, one step at a time and with steps submitted
# ahead between refreshes (the same tokens; the ratio is the host's share of
# a step), on the smaller shape. After the 32-token prompt the cache fills
# at J + h and refreshes every h tokens (small: 4 refreshes; else 8).
if [ "$small" = 1 ]; then
    evict_args=(--budget 40 --chunk 8 --generate 48)
else
    evict_args=(--budget 256 --chunk 32 --generate 512)
fi
shape=${speed_shapes[0]}
json="$out/$shape-evicting-decode.json"
echo "== $shape (decode with eviction): ${evict_args[*]}"
timeout 120 "$bin" bench --synthetic "$shape" --kv-dtype "$kv_dtype" --prefill 8 --depths 0 \
    --decode-steps 2 --refresh-sizes 0 "${evict_args[@]}" --policies full,window,h2o,tova,epikv,ccs \
    --json "$json" | grep '^|' | tee "$out/$shape-evicting-decode.md"
[ -f "$json" ] && runs+=("$json")

# 6. The shapes and sizes of the runs below (7: CCS, 8: per shape).
# The runs, per shape: the full cache at every context; then window, EpiKV
# and H2O (fused, and materialized as eager attention would) at each budget at
# the largest context (a bounded cache holds J + h entries whatever the
# context), filled in one eager prefill step of J + h tokens, and the refresh
# latency at budget 4096, chunk 64.
if [ "$small" = 1 ]; then
    shapes=(smollm2-135m)
    contexts=512,1024
    policy_context=1024
    budgets=256
    refresh=320
    prefill=128
    steps=4
else
    shapes=(llama-3.2-1b llama-3.1-8b)
    contexts=4096,16384,65536
    policy_context=65536
    budgets=2048,4096,8192
    refresh=4160
    prefill=512
    steps=16
fi
chunk=64
fill=$(( ${budgets##*,} + chunk ))

# 7. The CCS refresh on the largest shape (target: within 2x of the paper's
# 52.6 ms for ccs and 496 ms for ccs-full at cache size 4096 on an 8B model),
# before the long contexts so that the budget keeps it; at most 120 s.
left=$(( budget_s - (SECONDS - start) ))
shape=${shapes[-1]}
if [ "$left" -ge 30 ]; then
    json="$out/$shape-ccs.json"
    echo "== $shape (ccs refresh at $refresh)"
    timeout "$(( left < 120 ? left : 120 ))" "$bin" bench --synthetic "$shape" --kv-dtype "$kv_dtype" --prefill 1 --depths 0 \
        --decode-steps 2 --policies ccs,ccs-full --refresh-sizes "$refresh" --chunk "$chunk" \
        --json "$json" | grep '^|' | tee "$out/$shape-ccs.md"
    [ -f "$json" ] && runs+=("$json")
else
    echo "gpu-bench: time budget spent; skipping the CCS refresh" | tee -a "$out/skipped.txt"
fi

# 8. The runs per shape (see 6).
for shape in "${shapes[@]}"; do
    left=$(( budget_s - (SECONDS - start) ))
    if [ "$left" -lt 30 ]; then
        echo "gpu-bench: time budget spent; skipping $shape" | tee -a "$out/skipped.txt"
        continue
    fi
    for pass in full policies; do
        json="$out/$shape-$pass.json"
        if [ "$pass" = full ]; then
            args=(--prefill "$prefill" --depths 0 --context "$contexts" --refresh-sizes 0)
        else
            args=(--prefill 1 --depths 0 --context "$policy_context" --context-budgets "$budgets"
                  --policies window,epikv,h2o --materialize --fill-step "$fill"
                  --refresh-sizes "$refresh" --chunk "$chunk")
        fi
        echo "== $shape ($pass): sieve bench --synthetic $shape --kv-dtype $kv_dtype ${args[*]}"
        left=$(( budget_s - (SECONDS - start) ))
        timeout "$left" "$bin" bench --synthetic "$shape" --kv-dtype "$kv_dtype" \
            --decode-steps "$steps" "${args[@]}" \
            --json "$json" | grep '^|' | tee "$out/$shape-$pass.md"
        [ -f "$json" ] && runs+=("$json")
    done
done

# 9. One JSON and one markdown file.
{
    echo "["
    first=1
    for j in "${runs[@]}"; do
        [ $first = 1 ] || echo ","
        first=0
        cat "$j"
    done
    echo "]"
} > "$out/gpu-bench.json"
{
    echo "# sieve gpu-bench ($(date -u +%Y-%m-%d), KV cache $kv_dtype)"
    echo
    echo '```'
    head -5 "$out/info.txt"
    grep '^kernels' "$out/info.txt"
    echo '```'
    for f in kernel-tests kernel-tests-wgpu-spirv golden-tests; do
        [ -f "$out/$f.txt" ] && { echo; echo "$f: $(grep 'test result' "$out/$f.txt" | head -1)"; }
    done
    if [ -f "$out/vs-llama-cpp.md" ]; then
        echo
        echo "## Against llama.cpp (Vulkan, H200)"
        echo
        cat "$out/vs-llama-cpp.md"
    fi
    for shape in "${speed_shapes[@]}"; do
        for f in "$shape-speed" "$shape-speed-gpu-kernels" "$shape-speed-cpu-kernels" \
            "$shape-speed-unbounded-kernels" "$shape-speed-wgpu-spirv-kernels"; do
            [ -f "$out/$f.md" ] || continue
            echo
            echo "## $f"
            echo
            cat "$out/$f.md"
        done
    done
    for shape in "${shapes[@]}"; do
        for pass in full policies ccs; do
            [ -f "$out/$shape-$pass.md" ] || continue
            echo
            echo "## $shape, $pass"
            echo
            cat "$out/$shape-$pass.md"
        done
    done
} > "$out/gpu-bench.md"
echo "gpu-bench: $out/gpu-bench.json and $out/gpu-bench.md in $(( SECONDS - start )) s"
