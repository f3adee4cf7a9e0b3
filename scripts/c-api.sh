#!/usr/bin/env bash
# sieve's C API as its users build it (docs/C.md): the shared and static
# libraries (cargo build -p sieve-c), the committed header checked current,
# examples/c/chat.c compiled with cc and run on the default model (it must
# answer Paris), and bindings/c/tests/api.c, the contract test: run as
# is, its logits compared bit for bit with `sieve logits`, and again under
# AddressSanitizer for leaks and memory errors.
#
#   bash scripts/c-api.sh [MODEL]
set -euo pipefail
cd "$(dirname "$0")/.."
model=${1:-models/smollm2-135m-instruct}
out=target/c-api
mkdir -p "$out"
cargo build --release -p sieve-c --quiet
cargo test --release -p sieve-c --quiet
cflags=(-std=c11 -Wall -Wextra -Werror -pedantic -Ibindings/c/include)
link=(-Ltarget/release -lsieve_c -lm -pthread -Wl,-rpath,"$PWD/target/release")

# The README shows examples/c/chat.c as it is.
python3 - <<'PY'
import re, sys
readme = open("README.md").read()
blocks = re.findall(r"```c\n(.*?)```", readme, re.S)
if blocks != [open("examples/c/chat.c").read()]:
    sys.exit("c-api: README.md's C block is not examples/c/chat.c")
PY
cc "${cflags[@]}" examples/c/chat.c "${link[@]}" -o "$out/chat"
"$out/chat" "$model" | tee "$out/chat.txt"
grep -q Paris "$out/chat.txt" || { echo "c-api: chat.c did not answer Paris" >&2; exit 1; }

# The static library links with the system libraries docs/C.md lists.
cc "${cflags[@]}" examples/c/chat.c target/release/libsieve_c.a -lm -ldl -lpthread \
  -o "$out/chat-static"
"$out/chat-static" "$model" > "$out/chat-static.txt"
grep -q Paris "$out/chat-static.txt" || { echo "c-api: the static chat did not answer Paris" >&2; exit 1; }

cc "${cflags[@]}" -pthread bindings/c/tests/api.c "${link[@]}" -o "$out/api"
"$out/api" "$model" "$out/logits.f32"
./target/release/sieve logits --model "$model" --ids 1,2,3 --out "$out/logits.npy"
# The .npy's data is its last vocab x 4 bytes.
cmp <(tail -c "$(stat -c %s "$out/logits.f32")" "$out/logits.npy") "$out/logits.f32" ||
  { echo "c-api: sieve_logits differs from sieve logits" >&2; exit 1; }

# Under AddressSanitizer: the C program is instrumented (its memory errors
# abort the run); sieve's allocations go through the malloc ASan
# intercepts, so leaks anywhere are listed at exit. lavapipe's compiled shaders allocate through realloc from code
# that has no module (two 128-byte blocks); a leak with any frame in a
# named module (sieve, the C program, a library) fails.
cc "${cflags[@]}" -g -fsanitize=address -fno-omit-frame-pointer bindings/c/tests/api.c \
  "${link[@]}" -o "$out/api-asan"
ASAN_OPTIONS=detect_leaks=1:exitcode=0 "$out/api-asan" "$model" "$out/logits-asan.f32" \
  2>&1 | tee "$out/asan.txt" | grep -v XDG_RUNTIME_DIR
grep -q "all checks passed" "$out/asan.txt" || { echo "c-api: the ASan run failed" >&2; exit 1; }
if grep -q "ERROR: AddressSanitizer" "$out/asan.txt"; then
  echo "c-api: AddressSanitizer found a memory error" >&2
  exit 1
fi
# Each leak report: its allocation frames after #0 (the interceptor).
if awk '/leak of/ {inleak=1; next} inleak && /^ *#[1-9]/ && !/<unknown module>/ {bad=1}
        /^$/ {inleak=0} END {exit !bad}' "$out/asan.txt"; then
  echo "c-api: a leak from sieve or the program (see $out/asan.txt)" >&2
  exit 1
fi
echo "c-api: passed"
