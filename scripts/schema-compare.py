#!/usr/bin/env python3
"""Structured output through an OpenAI-compatible server: sieve serve or
llama-server, run one after the other on the same model (docs/BENCHMARKS.md,
"Constrained decoding").

For each schema of tests/data/schemas.json, a greedy streamed chat answer
with `response_format: {"type": "json_schema", ...}`, then the same prompt
without it, cut at the same number of tokens. Prints, and writes as JSON
with --json: whether each constrained answer parses and is valid under its
schema (the `jsonschema` package), and decode speed with and without the
constraint, measured by the client from the stream (tokens after the first
over the time from the first content chunk to the last), summed over all
schemas.

    python3 scripts/schema-compare.py http://127.0.0.1:8080 --json out.json

Needs `jsonschema` (pip). Only the standard library otherwise.
"""

import argparse
import json
import pathlib
import sys
import time
import urllib.request

import jsonschema

ROOT = pathlib.Path(__file__).resolve().parent.parent


def stream_chat(base, body):
    """Streams one chat completion; (text, completion tokens, seconds from
    the first content chunk to the last, content chunks, finish reason)."""
    body = dict(body, stream=True, stream_options={"include_usage": True})
    request = urllib.request.Request(
        base + "/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    text, tokens, finish, chunks = "", None, None, 0
    first = last = None
    with urllib.request.urlopen(request, timeout=600) as response:
        for line in response:
            line = line.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
            for choice in event.get("choices", []):
                piece = choice.get("delta", {}).get("content")
                if piece:
                    now = time.perf_counter()
                    first = first or now
                    last = now
                    chunks += 1
                    text += piece
                finish = choice.get("finish_reason") or finish
    if tokens is None:
        sys.exit("the server reported no usage (stream_options.include_usage)")
    return text, tokens, (last - first) if first else 0.0, chunks, finish


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("base", help="the server's address, http://host:port")
    parser.add_argument("--model", default="default")
    parser.add_argument("--schemas", default=str(ROOT / "tests/data/schemas.json"))
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    cases = json.loads(pathlib.Path(args.schemas).read_text())
    rows = []
    print("| schema | valid | tokens | constrained tok/s | unconstrained tok/s |")
    print("|---|---|---|---|---|")
    for case in cases:
        base_body = {
            "model": args.model,
            "messages": [{"role": "user", "content": case["prompt"]}],
            "temperature": 0,
        }
        constrained = dict(
            base_body,
            max_tokens=args.max_tokens,
            response_format={
                "type": "json_schema",
                "json_schema": {
                    "name": case["name"],
                    "schema": case["schema"],
                    "strict": True,
                },
            },
        )
        text, n, seconds, _, finish = stream_chat(args.base, constrained)
        try:
            jsonschema.validate(json.loads(text), case["schema"])
            valid, why = True, ""
        except (json.JSONDecodeError, jsonschema.ValidationError) as e:
            valid, why = False, str(e).splitlines()[0][:120]
        free_text, free_n, free_seconds, _, _ = stream_chat(
            args.base, dict(base_body, max_tokens=n)
        )
        rows.append(
            {
                "schema": case["name"],
                "valid": valid,
                "why": why,
                "finish_reason": finish,
                "tokens": n,
                "seconds": seconds,
                "unconstrained_tokens": free_n,
                "unconstrained_seconds": free_seconds,
                "text": text,
            }
        )
        rate = lambda k, s: (k - 1) / s if s > 0 and k > 1 else float("nan")
        print(
            f"| {case['name']} | {'yes' if valid else 'no: ' + why} | {n} "
            f"| {rate(n, seconds):.2f} | {rate(free_n, free_seconds):.2f} |"
        )
    timed = lambda key_n, key_s: (
        sum(r[key_n] - 1 for r in rows if r[key_s] > 0 and r[key_n] > 1),
        sum(r[key_s] for r in rows if r[key_s] > 0 and r[key_n] > 1),
    )
    (cn, cs), (fn, fs) = timed("tokens", "seconds"), timed(
        "unconstrained_tokens", "unconstrained_seconds"
    )
    summary = {
        "valid": sum(r["valid"] for r in rows),
        "schemas": len(rows),
        "constrained_tokens_per_second": cn / cs if cs else None,
        "unconstrained_tokens_per_second": fn / fs if fs else None,
    }
    ratio = (
        summary["constrained_tokens_per_second"]
        / summary["unconstrained_tokens_per_second"]
        if cs and fs
        else float("nan")
    )
    print(
        f"| all: {summary['valid']} of {len(rows)} valid | {cn} + {fn} timed "
        f"| {summary['constrained_tokens_per_second']:.2f} "
        f"| {summary['unconstrained_tokens_per_second']:.2f} (ratio {ratio:.3f}) |"
    )
    if args.json:
        pathlib.Path(args.json).write_text(
            json.dumps({"summary": summary, "schemas": rows}, indent=1) + "\n"
        )


if __name__ == "__main__":
    main()
