#!/usr/bin/env bash
# The tiny golden models of the families beyond Llama and Qwen2 as GGUF
# files, written by llama.cpp's own Python package (gguf-py: its tensor
# names and metadata keys; tests/family_gguf.py) into target/family-gguf,
# for tests/golden_tiny.rs (family_ggufs_match_transformers). gguf and numpy
# go into target/py-gguf (pip, no virtual environment needed), once.
set -euo pipefail
cd "$(dirname "$0")/.."
golden=${SIEVE_GOLDEN_DIR:-../shared/golden}
deps=target/py-gguf
out=target/family-gguf
mkdir -p "$out"
if ! PYTHONPATH="$deps" python3 -c "import gguf, numpy" 2>/dev/null; then
  python3 -m pip install --quiet --disable-pip-version-check --root-user-action=ignore \
    --target "$deps" "gguf==0.19.0" numpy
fi
for name in tiny-qwen3 tiny-smollm3 tiny-phi3; do
  PYTHONPATH="$deps" python3 tests/family_gguf.py "$golden" "$name" "$out/$name.gguf.partial"
  mv "$out/$name.gguf.partial" "$out/$name.gguf"
done
echo "family-ggufs: $(ls "$out"/*.gguf | wc -l) files in $out"
