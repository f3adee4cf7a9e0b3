#!/usr/bin/env bash
# The chat page in headless Chromium (scripts/web-test.mjs): builds it
# (scripts/web-build.sh), loads the default model's GGUF, answers "What is
# the capital of France?" with Paris, and stops a long answer; then the
# native command line answers the same question on this machine's Vulkan
# driver, for the figures side by side. Writes target/web-test/ (the
# screenshot, web-test.json).
set -euo pipefail
cd "$(dirname "$0")/.."
gguf=models/SmolLM2-135M-Instruct.Q4_1.gguf
out=target/web-test
mkdir -p "$out"
bash scripts/web-build.sh
cargo build --release --quiet   # the command line, for the figures beside the page's
bash scripts/browser.sh scripts/web-test.mjs "$PWD/target/web" "$PWD/$gguf" "$PWD/$out"
echo "web-test: the same question and cache with the native command line:"
target/release/sieve run --model "$gguf" --prompt "What is the capital of France?" \
  --max-tokens 32 --temperature 0 --policy epikv --budget 1024 --chunk 64 2>&1 | tail -2
