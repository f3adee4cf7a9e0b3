#!/usr/bin/env bash
# sieve's GPU benchmark: synthetic 1B and 8B shapes (random weights made on the
# GPU, no download) at contexts 4k/16k/64k with the full cache and with
# eviction, on a Linux machine with an NVIDIA GPU and its driver (any Vulkan
# device works). Prints each result as it comes and writes OUT/gpu-bench.json
# and OUT/gpu-bench.md. Sized to finish within 8 minutes on an H100/H200.
#
#   bash scripts/gpu-bench.sh [--small] [OUT]      (OUT defaults to bench-out)
#
# --small runs CI-sized shapes instead (the 135M shape at contexts 512/1024), so
# that the script can be checked on a CPU Vulkan driver such as lavapipe.
# The KV cache is stored in f16, as a deployment would; SIEVE_KV_DTYPE=f32
# measures the f32 cache instead.
set -uo pipefail
cd "$(dirname "$0")/.."
small=0
out=bench-out
for arg in "$@"; do
    case "$arg" in
        --small) small=1 ;;
        -h|--help) sed -n 2,12p "$0"; exit 0 ;;
        *) out="$arg" ;;
    esac
done
mkdir -p "$out"
start=$SECONDS
budget_s=${SIEVE_BENCH_SECONDS:-450}
kv_dtype=${SIEVE_KV_DTYPE:-f16}

# 1. A Vulkan loader. Offline machines can bring Debian packages in .gl/.
if ! ldconfig -p 2>/dev/null | grep -q 'libvulkan\.so\.1'; then
    if compgen -G ".gl/*.deb" >/dev/null; then
        for f in .gl/*.deb; do dpkg -x "$f" /; done
        ldconfig
    elif command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
        apt-get install -y -q libvulkan1 >/dev/null
    fi
    if ! ldconfig -p 2>/dev/null | grep -q 'libvulkan\.so\.1'; then
        echo "gpu-bench: no Vulkan loader (libvulkan.so.1); install libvulkan1" >&2
        exit 1
    fi
fi
# The NVIDIA driver's Vulkan manifest, where containers put it outside the
# standard folders.
if [ -z "${VK_DRIVER_FILES:-}${VK_ICD_FILENAMES:-}" ]; then
    for icd in /usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json; do
        if [ -f "$icd" ] && ! ls /usr/share/vulkan/icd.d/nvidia_icd*.json /etc/vulkan/icd.d/nvidia_icd*.json >/dev/null 2>&1; then
            export VK_DRIVER_FILES="$icd"
        fi
    done
fi

# 2. The release binary (built here when cargo is present).
if command -v cargo >/dev/null; then
    cargo build --release || exit 1
fi
bin=./target/release/sieve
if [ ! -x "$bin" ]; then
    echo "gpu-bench: no $bin; install Rust (cargo) or bring a release build" >&2
    exit 1
fi
export NODEVICE_SELECT=1

# 3. The adapter.
"$bin" info | tee "$out/info.txt"

# 4. The runs, per shape: the full cache at every context; then window, EpiKV
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
runs=()
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

# 5. One JSON and one markdown file.
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
    echo '```'
    for shape in "${shapes[@]}"; do
        for pass in full policies; do
            [ -f "$out/$shape-$pass.md" ] || continue
            echo
            echo "## $shape, $pass"
            echo
            cat "$out/$shape-$pass.md"
        done
    done
} > "$out/gpu-bench.md"
echo "gpu-bench: $out/gpu-bench.json and $out/gpu-bench.md in $(( SECONDS - start )) s"
