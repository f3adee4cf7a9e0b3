#!/usr/bin/env bash
# Drives the desktop chat app (apps/chat, `sieve-chat`) in a real window
# under Xvfb, as a person would: real mouse clicks and key presses (xdotool),
# a screenshot after each check (ImageMagick's import). The app's --log tells
# where its widgets are and what it showed.
#
#   1. ask "What is the capital of France?": the answer must name Paris;
#   2. send a long question and click Stop while the prompt is processed: the
#      generation must end within 100 ms of the end of the prompt chunk in
#      progress, before any token is sampled;
#   3. ask for a story and click Stop while it streams: it must end within
#      one token + 100 ms of the click.
#
# Usage: bash scripts/chat-app.sh [OUT_DIR]   (default target/chat-app)
# Needs: Xvfb, xdotool, ImageMagick (Debian: xvfb xdotool imagemagick), the
# default model (scripts/setup.sh). Writes OUT_DIR/{log.jsonl,answer.png,
# stop-prompt.png,stop-answer.png}; exits 1 on a failed check.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-target/chat-app}
model=${SIEVE_CHAT_MODEL:-models/smollm2-135m-instruct}
mkdir -p "$out"
for tool in Xvfb xdotool import python3; do
  command -v "$tool" >/dev/null || { echo "chat-app: $tool is missing (Debian: apt-get install xvfb xdotool imagemagick)"; exit 1; }
done
[ -f "$model/config.json" ] || { echo "chat-app: no model at $model (run scripts/setup.sh)"; exit 1; }
cargo build --release --quiet -p sieve-chat

# A free X display number.
n=90
while [ -e "/tmp/.X11-unix/X$n" ] || [ -e "/tmp/.X$n-lock" ]; do n=$((n + 1)); done
export DISPLAY=":$n" NODEVICE_SELECT=1
log="$out/log.jsonl"
rm -f "$log"
Xvfb "$DISPLAY" -screen 0 1280x800x24 -nolisten tcp >"$out/xvfb.log" 2>&1 &
xvfb=$!
app=
# shellcheck disable=SC2329  # called by the trap
cleanup() { [ -n "$app" ] && kill "$app" 2>/dev/null; kill "$xvfb" 2>/dev/null; true; }
trap cleanup EXIT
for _ in $(seq 50); do xdpyinfo >/dev/null 2>&1 && break; [ -e "/tmp/.X11-unix/X$n" ] && break; sleep 0.1; done

./target/release/sieve-chat --model "$model" --log "$log" >"$out/app.log" 2>&1 &
app=$!

# The number of lines of event $1 in the log.
count() { local c; c=$(grep -c "\"event\":\"$1\"" "$log" 2>/dev/null || true); echo "${c:-0}"; }
# Waits until event $1 has appeared more than $2 times (at most $3 seconds).
wait_for() {
  local deadline=$((SECONDS + $3))
  while [ "$(count "$1")" -le "$2" ]; do
    kill -0 "$app" 2>/dev/null || { echo "chat-app: the app exited"; cat "$out/app.log"; exit 1; }
    [ $SECONDS -lt $deadline ] || { echo "chat-app: no '$1' event within $3 s"; cat "$out/app.log"; exit 1; }
    sleep 0.1
  done
}
# The last logged event $1 as JSON.
last() { grep "\"event\":\"$1\"" "$log" | tail -1; }
# The centre of widget $1 in the last layout.
centre() {
  last layout | python3 -c 'import json,sys; x,y,w,h=json.load(sys.stdin)["widgets"][sys.argv[1]]; print(x+w//2, y+h//2)' "$1"
}
click() {
  local x y
  read -r x y < <(centre "$1")
  xdotool mousemove "$x" "$y"; sleep 0.2; xdotool click 1
}
ask() {
  click prompt
  xdotool type --delay 15 "$1"
  xdotool key Return
}

wait_for ready 0 300
window=$(xdotool search --sync --name "sieve chat" | head -1)
xdotool windowfocus --sync "$window"
fail=0

# 1. The question.
answers=$(count answer)
ask "What is the capital of France?"
wait_for answer "$answers" 300
import -window "$window" "$out/answer.png"
answer=$(last answer)
echo "chat-app: answer: $answer"
if echo "$answer" | grep -q Paris; then echo "chat-app: ok, the answer names Paris"; else echo "chat-app: FAIL, no Paris"; fail=1; fi

# A check of the last 'stopped' event (Python prints the verdict, exits 1 on
# failure). During the prompt a cancel takes effect when the prompt chunk in
# progress is done: the app must return within 100 ms of that moment,
# having sampled nothing. During the answer: within one token + 100 ms of
# the click.
check_stop() {
  last stopped | python3 -c '
import json, sys
e = json.load(sys.stdin)
phase = sys.argv[1]
click, after_step, step = e["click_to_return_ms"], e["step_to_return_ms"], e["step_ms"]
fed, gen = e["prompt_tokens_fed"], e["generated_tokens"]
chunks, total = e["prompt_chunks_after_click"], e["prompt_length"]
if phase == "prompt":
    ok = gen == 0 and fed < total and after_step <= 100 and chunks <= 1
else:
    ok = gen > 0 and click <= step + 100
verdict = "ok" if ok else "FAIL"
print(f"chat-app: {verdict}, stopped during the {phase}: {click:.0f} ms after the click, "
      f"{after_step:.0f} ms after the step that saw it (one step: {step:.0f} ms on average; "
      f"{chunks} prompt chunks ended after the click; "
      f"{fed} of {total} prompt tokens fed, {gen} generated)")
sys.exit(0 if ok else 1)' "$1"
}

# 2. Stop during the prompt: a question of a few hundred tokens.
long="Here is a list of fruits: $(printf 'apple, pear, plum, cherry, grape, lemon, mango, %.0s' $(seq 14))and kiwi. Which fruit is yellow?"
stops=$(count stopped)
started=$(count prompt_started)
ask "$long"
# Clicked once the window shows the prompt's progress, as a person would.
wait_for prompt_started "$started" 60
click stop
wait_for stopped "$stops" 120
import -window "$window" "$out/stop-prompt.png"
check_stop prompt || fail=1

# 3. Stop while the answer streams.
stops=$(count stopped)
pieces=$(count first_piece)
ask "Write a long story about a dragon who learns to bake bread."
wait_for first_piece "$pieces" 300
sleep 1
click stop
wait_for stopped "$stops" 60
import -window "$window" "$out/stop-answer.png"
check_stop answer || fail=1

[ $fail = 0 ] && echo "chat-app: all checks passed (log and screenshots in $out)"
exit $fail
