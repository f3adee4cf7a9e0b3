#!/usr/bin/env bash
# Every kernel module sieve assembles, compiled by a second WGSL compiler:
# Tint, in headless Chromium's WebGPU (Dawn on SwiftShader). Writes the
# modules with `sieve shaders --dump` and runs scripts/tint-check.mjs.
# Results: target/tint-check/result.json.
set -euo pipefail
cd "$(dirname "$0")/.."
out=target/tint-check
rm -rf "$out/modules"
mkdir -p "$out"
cargo build --release --quiet
target/release/sieve shaders --dump "$out/modules"
bash scripts/browser.sh scripts/tint-check.mjs "$PWD/$out/modules" "$PWD/$out/result.json"
