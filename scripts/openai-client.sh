#!/usr/bin/env bash
# The real `openai` Python client against `sieve serve` on the default model
# (tests/openai_client.py): one server as users run it, one that feeds every
# request whole (--no-cache-reuse) for the answers to compare with. The
# client goes into target/openai-client-deps (pip, no virtual environment
# needed). Both servers are stopped with SIGTERM and must exit 0.
set -euo pipefail
cd "$(dirname "$0")/.."
bin=target/release/sieve
deps=target/openai-client-deps
out=target/openai-client
mkdir -p "$out"
# jsonschema validates the structured outputs (an implementation
# independent of sieve's).
if ! PYTHONPATH="$deps" python3 -c "import openai, jsonschema" 2>/dev/null; then
  python3 -m pip install --quiet --disable-pip-version-check --root-user-action=ignore \
    --target "$deps" openai jsonschema
fi
pids=()
trap 'kill "${pids[@]}" 2>/dev/null || true' EXIT
# start NAME ARGS...: starts a server on a free port (in this shell, so
# that its pid is kept) and sets `address` once it answers /health.
start() {
  local name=$1
  shift
  "$bin" serve --port 0 --parallel 6 "$@" >"$out/$name.out" 2>"$out/$name.err" &
  pids+=($!)
  address=""
  for _ in $(seq 600); do
    address=$(sed -n 's|.*listening on \(http://[^ ]*\).*|\1|p' "$out/$name.out")
    if [ -n "$address" ] && python3 - "$address" <<'PY' 2>/dev/null; then return 0; fi
import sys, urllib.request
urllib.request.urlopen(sys.argv[1] + "/health", timeout=5)
PY
    sleep 0.5
  done
  cat "$out/$name.err" >&2
  echo "openai-client: $name did not start" >&2
  exit 1
}
start serving
serving=$address
start fresh --no-cache-reuse
fresh=$address
PYTHONPATH="$deps" python3 tests/openai_client.py "$serving" "$fresh"
[ "${#pids[@]}" = 2 ] || { echo "openai-client: expected 2 servers, have ${#pids[@]}" >&2; exit 1; }
for pid in "${pids[@]}"; do
  kill -TERM "$pid"
  wait "$pid" || { echo "openai-client: a server did not exit 0 after SIGTERM" >&2; exit 1; }
done
pids=()
echo "openai-client: both servers stopped cleanly"
