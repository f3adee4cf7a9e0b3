#!/usr/bin/env bash
# Runs a Node script that drives headless Chromium (scripts/tint-check.mjs,
# scripts/web-test.mjs): playwright-core from npm goes into target/browser
# (no browser download: it drives the system's chromium, $CHROMIUM), and the
# script runs from there so that Node finds it.
# Usage: bash scripts/browser.sh SCRIPT.mjs ARGS...
set -euo pipefail
cd "$(dirname "$0")/.."
command -v "${CHROMIUM:-chromium}" >/dev/null || {
  echo "browser: no chromium (Debian: apt-get install chromium)" >&2
  exit 1
}
for tool in node npm; do
  command -v "$tool" >/dev/null || {
    echo "browser: no $tool (Debian: apt-get install nodejs npm, or any Node.js 18 or later with its npm)" >&2
    exit 1
  }
done
CHROMIUM=$(command -v "${CHROMIUM:-chromium}")
export CHROMIUM
dir=target/browser
mkdir -p "$dir"
if [ ! -d "$dir/node_modules/playwright-core" ]; then
  (cd "$dir" && npm install --silent --no-audit --no-fund playwright-core@1 >/dev/null)
fi
script=$1
shift
cp scripts/browser.mjs "$script" "$dir/"
node "$dir/$(basename "$script")" "$@"
