#!/usr/bin/env bash
# sieve's kernel tests in headless Chromium on its WebGPU (Dawn and Tint on
# SwiftShader): builds the pages (scripts/web-build.sh), then runs the check
# page, checks.html, to its end (scripts/web-checks.mjs). Fails unless every
# check that ran passed. Writes target/web-checks/ (checks.json with each
# check's outcome, seconds and notes; a screenshot of the table).
#
# Usage: bash scripts/web-checks.sh [SKIP,...] [ONLY,...]
#   SKIP: leave out the checks whose names contain any of these;
#   ONLY: run only those whose names contain one of these.
set -euo pipefail
cd "$(dirname "$0")/.."
out=target/web-checks
mkdir -p "$out"
bash scripts/web-build.sh
bash scripts/browser.sh scripts/web-checks.mjs "$PWD/target/web" "$PWD/$out" "${1:-}" "${2:-}"
