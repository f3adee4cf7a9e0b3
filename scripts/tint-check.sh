#!/usr/bin/env bash
# Every kernel module sieve assembles, compiled by a second WGSL compiler:
# Tint, in headless Chromium's WebGPU (Dawn on SwiftShader). Writes the
# modules with `sieve shaders --dump`, installs playwright-core (npm, into
# target/tint-check; no browser download: it drives the system's
# chromium), and runs scripts/tint-check.mjs. Results:
# target/tint-check/result.json.
set -euo pipefail
cd "$(dirname "$0")/.."
out=target/tint-check
bin=target/release/sieve
command -v "${CHROMIUM:-chromium}" >/dev/null || {
  echo "tint-check: no chromium (Debian: apt-get install chromium)" >&2
  exit 1
}
export CHROMIUM=$(command -v "${CHROMIUM:-chromium}")
mkdir -p "$out"
if [ ! -d "$out/node_modules/playwright-core" ]; then
  (cd "$out" && npm install --silent --no-audit --no-fund playwright-core@1 >/dev/null)
fi
rm -rf "$out/modules"
"$bin" shaders --dump "$out/modules"
# Node finds playwright-core from the script's folder upwards: run a copy there.
cp scripts/tint-check.mjs "$out/tint-check.mjs"
node "$out/tint-check.mjs" "$out/modules" "$out/result.json"
