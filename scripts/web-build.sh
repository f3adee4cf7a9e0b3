#!/usr/bin/env bash
# Builds the chat page and the kernel check page into target/web (serve
# that folder with any static web server): sieve-web for wasm32 (web/),
# wasm-bindgen's glue, and the pages' own files. Needs the wasm32-unknown-unknown target and the
# wasm-bindgen command line of the version web/Cargo.toml pins (both
# installed here when missing).
set -euo pipefail
cd "$(dirname "$0")/.."
version=$(sed -n 's/^wasm-bindgen = "=\(.*\)"/\1/p' web/Cargo.toml)
# rustup adds the wasm32 standard library when it is missing; a toolchain
# without rustup must bring it itself (the build below says so if not).
if command -v rustup >/dev/null \
  && ! rustup target list --installed | grep -x wasm32-unknown-unknown >/dev/null; then
  rustup target add wasm32-unknown-unknown
fi
if [ "$(wasm-bindgen --version 2>/dev/null | cut -d' ' -f2)" != "$version" ]; then
  # A debug build: about 75 s here against 4 to 5 minutes optimized, and it
  # still writes the glue in seconds.
  cargo install --quiet --debug wasm-bindgen-cli --version "$version"
fi
cargo build --release --quiet --target wasm32-unknown-unknown -p sieve-web
out=target/web
rm -rf "$out"
wasm-bindgen --target web --no-typescript --out-dir "$out" \
  target/wasm32-unknown-unknown/release/sieve_web.wasm
cp web/index.html web/app.js web/jspi.js web/checks.html web/checks.js "$out/"
wasm=$(stat -c %s "$out/sieve_web_bg.wasm")
gz=$(gzip -9 -c "$out/sieve_web_bg.wasm" | wc -c)
echo "web-build: $out (sieve_web_bg.wasm $wasm bytes, $gz gzipped; glue $(stat -c %s "$out/sieve_web.js") bytes)"
