"""The real `openai` Python client against `sieve serve` (scripts/openai-client.sh
starts the servers): answers, streaming, usage, stop strings, max_tokens, a
conversation's second turn (reused cache) against a server that feeds it whole,
concurrent streams against the same requests one at a time, bad requests with
their status and error code, a client that leaves mid-stream, and the server
still answering after all of it.

Usage: python3 tests/openai_client.py BASE_URL FRESH_BASE_URL [--other]
(FRESH_BASE_URL: a server started with --no-cache-reuse). Exits non-zero on the
first failed check. With --other (another server, such as llama.cpp's
llama-server), the checks that read sieve's /metrics are left out and every
failed check is reported instead of ending the run.
"""

import concurrent.futures
import json
import sys
import time
import urllib.request

import jsonschema
import openai
import pydantic

BASE, FRESH = sys.argv[1], sys.argv[2]
OTHER = "--other" in sys.argv[3:]
failed = []
client = openai.OpenAI(base_url=BASE + "/v1", api_key="none", max_retries=0, timeout=600)
fresh = openai.OpenAI(base_url=FRESH + "/v1", api_key="none", max_retries=0, timeout=600)
QUESTION = "What is the capital of France?"
GREEDY = {"model": "sieve", "temperature": 0}


def chat(c, messages, **kw):
    return c.chat.completions.create(messages=messages, **{**GREEDY, **kw})


def user(text):
    return [{"role": "user", "content": text}]


def metric(name):
    with urllib.request.urlopen(BASE + "/metrics") as r:
        for line in r.read().decode().splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
    raise AssertionError(f"{name} not in /metrics")


class Nothing:
    content = None


def check(ok, what):
    if not ok:
        if not OTHER:
            raise AssertionError(what)
        failed.append(what)
        print("FAILED:", what)
        return
    print("ok:", what.split(":")[0])


# A whole answer, then the same streamed with the usage chunk last.
whole = chat(client, user(QUESTION), max_tokens=30)
text = whole.choices[0].message.content
check("Paris" in text, f"the capital of France is Paris: {text!r}")
check(whole.object == "chat.completion" and whole.usage.total_tokens
      == whole.usage.prompt_tokens + whole.usage.completion_tokens, f"usage adds up: {whole.usage}")
chunks = list(chat(client, user(QUESTION), max_tokens=30, stream=True,
                   stream_options={"include_usage": True}))
streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
check(streamed == text, f"streamed text = whole text: {streamed!r} vs {text!r}")
check(chunks[-1].choices == [] and chunks[-1].usage is not None, "the last chunk carries usage only")
check(chunks[-1].usage.completion_tokens == whole.usage.completion_tokens,
      f"streamed usage = whole usage: {chunks[-1].usage} vs {whole.usage}")
finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
check(finish == [whole.choices[0].finish_reason], f"one finish reason: {finish}")

# A stop string: cut before it, finish_reason stop. max_tokens: length.
stopped = chat(client, user(QUESTION), max_tokens=30, stop=["Paris"])
check("Paris" not in stopped.choices[0].message.content
      and stopped.choices[0].finish_reason == "stop",
      f"stop string: {stopped.choices[0].message.content!r}")
short = chat(client, user(QUESTION), max_tokens=3)
check(short.choices[0].finish_reason == "length" and short.usage.completion_tokens == 3,
      f"max_tokens 3: {short.usage}")

# The second turn reuses the first turn's cache, and answers as a server
# that feeds the whole conversation does.
second = user(QUESTION) + [{"role": "assistant", "content": text}] + user("And of Italy?")
turn2 = chat(client, second, max_tokens=30)
whole2 = chat(fresh, second, max_tokens=30)
cached = turn2.usage.prompt_tokens_details.cached_tokens
check(cached > whole.usage.prompt_tokens // 2, f"the second turn reuses the cache: {cached} cached "
      f"of {turn2.usage.prompt_tokens}")
check(whole2.usage.prompt_tokens_details.cached_tokens == 0, "the fresh server feeds it whole")
check(turn2.choices[0].message.content == whole2.choices[0].message.content,
      f"same second answer: {turn2.choices[0].message.content!r} vs "
      f"{whole2.choices[0].message.content!r}")

# Concurrent streams: each the text it gets alone (from the server that
# does not reuse caches), and the throughput of both.
questions = ["Name a colour.", "What is 2 + 2?", "Say hello in French.", "Name a planet.",
             "What is the opposite of hot?", "Name a fruit."]


def stream(c, q):
    parts = list(chat(c, user(q), max_tokens=24, stream=True,
                      stream_options={"include_usage": True}))
    return ("".join(p.choices[0].delta.content or "" for p in parts if p.choices),
            parts[-1].usage.completion_tokens)


t = time.time()
alone = [stream(fresh, q) for q in questions]
t_alone = time.time() - t
t = time.time()
with concurrent.futures.ThreadPoolExecutor(len(questions)) as pool:
    together = list(pool.map(lambda q: stream(client, q), questions))
t_together = time.time() - t
check(together == alone, f"concurrent streams = each alone: {together} vs {alone}")
tokens = sum(n for _, n in together)
print(f"throughput: {len(questions)} streams, {tokens} tokens: {tokens / t_alone:.2f} tok/s one at "
      f"a time, {tokens / t_together:.2f} tok/s together ({t_alone / t_together:.2f}x)")

# Bad requests: status and OpenAI's error code.
for what, kw, status, code in [
    ("max_tokens -1", {"messages": user("Hi"), "max_tokens": -1}, 400, None),
    ("temperature 5", {"messages": user("Hi"), "temperature": 5}, 400, None),
    ("n 2", {"messages": user("Hi"), "n": 2}, 400, None),
    ("no messages", {"messages": []}, 400, None),
    ("role wizard", {"messages": [{"role": "wizard", "content": "x"}]}, 400, None),
    ("context", {"messages": user("word " * 5000)}, 400, "context_length_exceeded"),
] + ([] if OTHER else [
    # What sieve does not do is refused, not ignored (other servers do it).
    ("logit_bias", {"messages": user("Hi"), "logit_bias": {"100": 5}}, 400, None),
    ("top_logprobs 21", {"messages": user("Hi"), "logprobs": True, "top_logprobs": 21}, 400, None),
]):
    try:
        client.chat.completions.create(**{**GREEDY, **kw})
        check(False, f"{what}: accepted")
    except openai.APIStatusError as e:
        body = e.body if isinstance(e.body, dict) else {}
        check(e.status_code == status and body.get("code") == code and body.get("message"),
              f"{what}: {e.status_code} {body}")

# Structured output: the client's own parse() with a Pydantic model (it
# sends a strict json_schema and parses the answer into the model), every
# schema of tests/data/schemas.json validated by the jsonschema package, a
# JSON object, and a schema that cannot compile.
class City(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=30)
    country: str = pydantic.Field(max_length=30)
    population: int = pydantic.Field(ge=0)


parsed = client.chat.completions.parse(
    messages=user("Give the capital of France as JSON."), response_format=City, max_tokens=80,
    **GREEDY)
city = parsed.choices[0].message.parsed
check(isinstance(city, City) and parsed.choices[0].finish_reason == "stop",
      f"parse() with a Pydantic model: {parsed.choices[0].message.content!r}")
print("  parsed:", city)
with open(sys.path[0] + "/data/schemas.json") as f:
    schemas = json.load(f)


def structured(case):
    r = chat(client, user(case["prompt"]), max_tokens=120, response_format={
        "type": "json_schema", "json_schema": {"name": case["name"], "schema": case["schema"],
                                               "strict": True}})
    return r.choices[0].message.content, r.choices[0].finish_reason


with concurrent.futures.ThreadPoolExecutor(6) as pool:
    answers = list(pool.map(structured, schemas))
valid = 0
for case, (content, finish) in zip(schemas, answers):
    try:
        jsonschema.validate(json.loads(content), case["schema"])
        valid += finish == "stop"
    except (ValueError, jsonschema.ValidationError) as e:
        print(f"  {case['name']}: {content!r} ({finish}): {e}")
print(f"  json_schema: {valid} of {len(schemas)} valid and complete")
check(valid == len(schemas), f"every schema holds: {valid} of {len(schemas)}")
obj = chat(client, user("Describe Paris as JSON."), max_tokens=120,
           response_format={"type": "json_object"})
check(isinstance(json.loads(obj.choices[0].message.content), dict), "json_object gives an object")
try:
    chat(client, user("Hi"), response_format={"type": "json_schema", "json_schema": {
        "name": "bad", "schema": {"type": "object", "properties": {"a": {"type": "nope"}}}}})
    check(False, "a schema that cannot compile: accepted")
except openai.BadRequestError as e:
    check(e.body.get("param") == "response_format", f"a schema that cannot compile: {e.body}")

# Log-probabilities: one entry per token, the top ones sorted with the
# greedy choice first, whole and streamed (the stream helper gathers them).
r = chat(client, user(QUESTION), max_tokens=12, logprobs=True, top_logprobs=4)
entries = r.choices[0].logprobs.content
check(len(entries) == r.usage.completion_tokens
      and "".join(e.token for e in entries) == r.choices[0].message.content
      and all(e.top_logprobs[0].token == e.token
              and [t.logprob for t in e.top_logprobs] == sorted(
                  (t.logprob for t in e.top_logprobs), reverse=True)
              for e in entries),
      f"logprobs: {entries[:2]}")
with client.chat.completions.stream(messages=user(QUESTION), max_tokens=12, logprobs=True,
                                    top_logprobs=4, **GREEDY) as s:
    for _ in s:
        pass
    sfinal = s.get_final_completion()
# (Within float noise: the second request finds the first one's cache and
# feeds its prompt in other steps.)
streamed_lps = [e.logprob for e in (sfinal.choices[0].logprobs or Nothing).content or []]
check(len(streamed_lps) == len(entries)
      and all(abs(a - e.logprob) < 1e-3 for a, e in zip(streamed_lps, entries)),
      f"streamed logprobs = whole: {streamed_lps} vs {[e.logprob for e in entries]}")

# Tools: a loop (a call, its result in a tool message, the final answer),
# with tool_choice "required" whole and a named function streamed through
# the client's stream helper, which assembles the call from its chunks.
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30}},
                   "required": ["city"], "additionalProperties": False}}}]
ask = user("What is the weather in Paris?")
# (One call each: free to call again, SmolLM2 goes on calling to max_tokens.)
r = chat(client, ask, tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
         max_tokens=60)
calls = r.choices[0].message.tool_calls or []
check(r.choices[0].finish_reason == "tool_calls" and len(calls) >= 1
      and calls[0].function.name == "get_weather"
      and isinstance(json.loads(calls[0].function.arguments).get("city"), str),
      f"tool_choice required: {r.choices[0].message}")
print("  call:", calls[0].function.name, calls[0].function.arguments)
loop = ask + [{"role": "assistant", "content": None,
               "tool_calls": [c.model_dump() for c in calls]}] + [
    {"role": "tool", "tool_call_id": c.id, "content": json.dumps({"temperature_c": 18, "sky": "sunny"})}
    for c in calls]
final = chat(client, loop, tools=TOOLS, max_tokens=40)
check(final.choices[0].finish_reason in ("stop", "length", "tool_calls"),
      f"the answer after the tool's result: {final.choices[0].message}")
print("  after the result:", repr(final.choices[0].message.content),
      final.choices[0].message.tool_calls)
with client.chat.completions.stream(
        messages=ask, tools=TOOLS, max_tokens=60, parallel_tool_calls=False,
        tool_choice={"type": "function", "function": {"name": "get_weather"}}, **GREEDY) as s:
    for _ in s:
        pass
    streamed = s.get_final_completion()
scalls = streamed.choices[0].message.tool_calls or []
check(streamed.choices[0].finish_reason == "tool_calls" and len(scalls) == 1
      and scalls[0].function.name == "get_weather"
      and json.loads(scalls[0].function.arguments) == json.loads(calls[0].function.arguments),
      f"a named function, streamed: {streamed.choices[0].message}")
try:
    chat(client, ask, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}})
    check(False, "tool_choice naming a missing tool: accepted")
except openai.BadRequestError as e:
    check(e.body.get("param") == "tool_choice", f"tool_choice naming a missing tool: {e.body}")

# A client that leaves mid-stream: its sequence ends and frees its cache.
cancelled = 0 if OTHER else metric("sieve_requests_cancelled_total")
s = chat(client, user("Count from one to one hundred."), max_tokens=200, stream=True)
next(iter(s))
s.close()
deadline = time.time() + 120
while not OTHER and (metric("sieve_requests_cancelled_total") < cancelled + 1
                     or metric("sieve_sequences_busy") > 0):
    if time.time() > deadline:
        raise AssertionError("the stream's sequence was not cancelled")
    time.sleep(0.1)
print("ok: a client that leaves frees its sequence" if not OTHER else "(left a stream mid-way)")

# Still serving.
last = chat(client, user(QUESTION), max_tokens=30)
check(last.choices[0].message.content == text, "still serving the same answer")
with urllib.request.urlopen(BASE + "/v1/models") as r:
    check(json.loads(r.read())["data"], "models listed")
if failed:
    print(f"openai client tests: {len(failed)} failed:", *failed, sep="\n  ")
    sys.exit(1)
print("openai client tests: all passed")
