//! `sieve serve` over loopback HTTP on a tiny model: answers (whole and
//! streamed, chat and text) are the tokens a `Session` gives alone, also
//! when several requests run at once; every bad request gets its status
//! and OpenAI's error object; a client that goes mid-stream frees its
//! sequence; a full queue is a 429; and the server keeps serving.

mod common;
use common::tiny_text_model;
use serde_json::{json, Value};
use sieve::cache::CacheOptions;
use sieve::eviction::Policy;
use sieve::model::LoadOptions;
use sieve::session::{GenerateOptions, Llm, SessionOptions};
use sieve::tokenizer::Message;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// A running `sieve serve`, killed when dropped.
struct Server {
    child: Child,
    address: String,
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Server {
    fn start(args: &[&str]) -> Server {
        Server::start_with(&tiny_text_model(), args)
    }

    fn start_with(model: &std::path::Path, args: &[&str]) -> Server {
        let mut child = Command::new(env!("CARGO_BIN_EXE_sieve"))
            .args(["serve", "--model", model.to_str().unwrap(), "--port", "0"])
            .args(["--alias", "tiny"])
            .args(match args.contains(&"--max-context") {
                true => vec![],
                false => vec!["--max-context", "128"],
            })
            .args(args)
            .env("NODEVICE_SELECT", "1")
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .unwrap();
        let mut line = String::new();
        BufReader::new(child.stdout.take().unwrap())
            .read_line(&mut line)
            .unwrap();
        let address = line
            .split("http://")
            .nth(1)
            .and_then(|r| r.split_whitespace().next())
            .unwrap_or_else(|| panic!("no address in {line:?}"))
            .to_string();
        let server = Server { child, address };
        wait_for("the server to be healthy", || {
            server.get("/health").0 == 200
        });
        server
    }

    /// Sends a request; returns the connection to read the answer from.
    fn send(&self, method: &str, path: &str, headers: &[&str], body: &[u8]) -> TcpStream {
        send(&self.address, method, path, headers, body)
    }

    fn request(&self, method: &str, path: &str, headers: &[&str], body: &[u8]) -> Response {
        request(&self.address, method, path, headers, body)
    }

    fn get(&self, path: &str) -> Response {
        match TcpStream::connect(&self.address) {
            Ok(_) => self.request("GET", path, &[], b""),
            Err(_) => (0, String::new(), String::new()),
        }
    }

    fn post(&self, path: &str, body: &Value) -> Response {
        self.request("POST", path, &[], body.to_string().as_bytes())
    }

    /// A Prometheus value of /metrics.
    fn metric(&self, name: &str) -> u64 {
        let (_, _, text) = self.get("/metrics");
        text.lines()
            .find_map(|l| l.strip_prefix(&format!("{name} ")))
            .unwrap_or_else(|| panic!("{name} not in {text}"))
            .trim()
            .parse()
            .unwrap()
    }
}

type Response = (u16, String, String);

/// Polls `done` until it holds; fails after two minutes.
fn wait_for(what: &str, done: impl Fn() -> bool) {
    let t = Instant::now();
    while !done() {
        if t.elapsed() > Duration::from_secs(120) {
            panic!("waited in vain for {what}");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Sends a request to `address`; returns the connection to read the answer from.
fn send(address: &str, method: &str, path: &str, headers: &[&str], body: &[u8]) -> TcpStream {
    let mut s = TcpStream::connect(address).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(120))).unwrap();
    let mut head = format!(
        "{method} {path} HTTP/1.1\r\nHost: test\r\nConnection: close\r\nContent-Length: {}\r\nContent-Type: application/json\r\n",
        body.len()
    );
    for h in headers {
        head.push_str(h);
        head.push_str("\r\n");
    }
    head.push_str("\r\n");
    s.write_all(head.as_bytes()).unwrap();
    // The server may answer (413) before reading a large body.
    let _ = s.write_all(body);
    s
}

/// (status, headers, body) of a whole exchange.
fn request(address: &str, method: &str, path: &str, headers: &[&str], body: &[u8]) -> Response {
    let mut s = send(address, method, path, headers, body);
    let mut raw = vec![];
    let _ = s.read_to_end(&mut raw);
    parse(&raw)
}

/// Status, headers and body (chunked transfer decoded).
fn parse(raw: &[u8]) -> Response {
    let text = String::from_utf8_lossy(raw).to_string();
    let Some((head, body)) = text.split_once("\r\n\r\n") else {
        return (0, text, String::new());
    };
    let status = head
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    let chunked = head
        .to_ascii_lowercase()
        .contains("transfer-encoding: chunked");
    let body = if chunked {
        let mut out = String::new();
        let mut rest = body;
        while let Some((size, after)) = rest.split_once("\r\n") {
            let n = usize::from_str_radix(size.trim(), 16).unwrap_or(0);
            if n == 0 || after.len() < n {
                break;
            }
            out.push_str(&after[..n]);
            rest = after[n..].trim_start_matches("\r\n");
        }
        out
    } else {
        body.to_string()
    };
    (status, head.to_string(), body)
}

/// The JSON chunks of an SSE body, and whether it ended with [DONE].
fn sse_chunks(body: &str) -> (Vec<Value>, bool) {
    let mut chunks = vec![];
    let mut done = false;
    for data in body.lines().filter_map(|l| l.strip_prefix("data: ")) {
        if data == "[DONE]" {
            done = true;
        } else {
            chunks.push(serde_json::from_str(data).unwrap());
        }
    }
    (chunks, done)
}

/// What a `Session` generates alone, greedily, for `prompt` tokens.
fn alone(llm: &Llm, prompt: &[u32], max_new_tokens: usize) -> (String, usize) {
    alone_with(llm, prompt, max_new_tokens, None)
}

fn alone_with(
    llm: &Llm,
    prompt: &[u32],
    max_new_tokens: usize,
    cache: Option<CacheOptions>,
) -> (String, usize) {
    let mut session = llm
        .session(SessionOptions {
            max_context: 128,
            prefill_chunk: 64,
            cache,
        })
        .unwrap();
    let opts = GenerateOptions {
        max_new_tokens,
        ..Default::default()
    };
    let g = session.generate(prompt, &opts, |_| true).unwrap();
    (g.text, g.stats.generated_tokens)
}

fn text_of(response: &Value, kind: &str) -> String {
    match kind {
        "chat" => response["choices"][0]["message"]["content"]
            .as_str()
            .unwrap()
            .to_string(),
        _ => response["choices"][0]["text"].as_str().unwrap().to_string(),
    }
}

#[test]
fn answers_are_those_of_a_session_alone_also_together() {
    let server = Server::start(&["--parallel", "3", "--chunk", "16", "--recent", "8"]);
    let llm = Llm::load(&tiny_text_model(), &LoadOptions::default()).unwrap();
    let (status, _, body) = server.get("/v1/models");
    assert_eq!(status, 200);
    let models: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(models["data"][0]["id"], "tiny");

    // A chat, whole: the template's prompt, greedy.
    let messages = [Message::new("user", "What is the capital of France?")];
    let prompt = llm.chat_prompt(&messages).unwrap();
    let (want, n) = alone(&llm, &prompt, 12);
    let chat_request = json!({"model": "tiny", "messages": [{"role": "user", "content": "What is the capital of France?"}],
        "max_tokens": 12, "temperature": 0, "some_unknown_field": {"x": 1}});
    let (status, _, body) = server.post("/v1/chat/completions", &chat_request);
    assert_eq!(status, 200, "{body}");
    let r: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(r["object"], "chat.completion");
    assert_eq!(text_of(&r, "chat"), want);
    assert_eq!(r["usage"]["prompt_tokens"], prompt.len());
    assert_eq!(r["usage"]["completion_tokens"], n);
    assert_eq!(r["usage"]["total_tokens"], prompt.len() + n);
    assert_eq!(
        r["choices"][0]["finish_reason"],
        if n == 12 { "length" } else { "stop" }
    );
    assert_eq!(r["sieve"]["policy"], "full");

    // The next turn of the conversation reads only its new part from the
    // first turn's cache, and answers as a fresh request would.
    let turn2 = [
        Message::new("user", "What is the capital of France?"),
        Message::new("assistant", &want),
        Message::new("user", "And of Italy?"),
    ];
    let prompt2 = llm.chat_prompt(&turn2).unwrap();
    let (want2, _) = alone(&llm, &prompt2, 12);
    let messages2: Vec<Value> = turn2
        .iter()
        .map(|m| json!({"role": m.role, "content": m.content}))
        .collect();
    let (status, _, body) = server.post(
        "/v1/chat/completions",
        &json!({"messages": messages2, "max_tokens": 12, "temperature": 0}),
    );
    assert_eq!(status, 200, "{body}");
    let r2: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(text_of(&r2, "chat"), want2);
    assert_eq!(r2["usage"]["prompt_tokens"], prompt2.len());
    let cached = r2["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap();
    assert!(
        cached as usize >= prompt.len(),
        "{cached} cached of {}",
        prompt2.len()
    );
    assert!((cached as usize) < prompt2.len());

    // The same, streamed, with the usage chunk last.
    let mut streamed = chat_request.clone();
    streamed["stream"] = json!(true);
    streamed["stream_options"] = json!({"include_usage": true});
    let (status, head, body) = server.post("/v1/chat/completions", &streamed);
    assert_eq!(status, 200);
    assert!(
        head.to_ascii_lowercase().contains("text/event-stream"),
        "{head}"
    );
    let (chunks, done) = sse_chunks(&body);
    assert!(done, "{body}");
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    let text: String = chunks
        .iter()
        .filter_map(|c| c["choices"][0]["delta"]["content"].as_str())
        .collect();
    assert_eq!(text, want);
    let last = chunks.last().unwrap();
    assert_eq!(last["choices"], json!([]));
    assert_eq!(last["usage"]["completion_tokens"], n);
    let finish = &chunks[chunks.len() - 2]["choices"][0]["finish_reason"];
    assert!(finish == "length" || finish == "stop", "{finish}");

    // Text completions, several at once (more than --parallel: one waits),
    // each with the text it gets alone; a stop string cuts the text.
    let prompts = [
        "The quick brown fox",
        "Once upon a time",
        "1, 2, 3,",
        "In the beginning",
        "Paris is",
    ];
    let handles: Vec<_> = prompts
        .iter()
        .map(|p| {
            let address = server.address.clone();
            let body = json!({"prompt": p, "max_tokens": 16, "temperature": 0.0});
            std::thread::spawn(move || {
                request(
                    &address,
                    "POST",
                    "/v1/completions",
                    &[],
                    body.to_string().as_bytes(),
                )
            })
        })
        .collect();
    for (p, h) in prompts.iter().zip(handles) {
        let (status, _, body) = h.join().unwrap();
        assert_eq!(status, 200, "{body}");
        let r: Value = serde_json::from_str(&body).unwrap();
        let ids = llm.tokenizer.encode(p).unwrap();
        assert_eq!(text_of(&r, "text"), alone(&llm, &ids, 16).0, "prompt {p:?}");
    }
    // A request's own cache (the "sieve" extension): a window of 32
    // entries refreshed every 16 tokens, with the server's 4 sinks and 8
    // recent entries.
    let ids = llm.tokenizer.encode(prompts[1]).unwrap();
    let window = CacheOptions {
        sinks: 4,
        recent: 8,
        ..CacheOptions::new(Policy::Window, 32, 16)
    };
    let (want, n) = alone_with(&llm, &ids, 60, Some(window));
    let body = json!({"prompt": prompts[1], "max_tokens": 60, "temperature": 0,
        "sieve": {"policy": "window", "budget": 32}});
    let (status, _, body) = server.post("/v1/completions", &body);
    assert_eq!(status, 200, "{body}");
    let r: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(text_of(&r, "text"), want);
    assert_eq!(r["usage"]["completion_tokens"], n);
    assert_eq!(r["sieve"], json!({"policy": "window", "budget": 32}));
    assert_ne!(
        want,
        alone(&llm, &ids, 60).0,
        "the window changes the answer"
    );

    let ids = llm.tokenizer.encode(prompts[0]).unwrap();
    let (full, _) = alone(&llm, &ids, 16);
    if let Some(stop) = full.get(3..6).filter(|s| !s.trim().is_empty()) {
        let body =
            json!({"prompt": prompts[0], "max_tokens": 16, "temperature": 0, "stop": [stop]});
        let (_, _, body) = server.post("/v1/completions", &body);
        let r: Value = serde_json::from_str(&body).unwrap();
        assert_eq!(text_of(&r, "text"), full[..full.find(stop).unwrap()]);
        assert_eq!(r["choices"][0]["finish_reason"], "stop");
    }
}

#[test]
fn bad_requests_get_their_status_and_error_object() {
    // A 16-token chunk and 8 recent entries: a request may ask for a
    // window of 64 entries, so that its generation has no end of context.
    let server = Server::start(&[
        "--parallel",
        "1",
        "--queue",
        "1",
        "--body-limit",
        "4000",
        "--chunk",
        "16",
        "--recent",
        "8",
    ]);
    let chat = |body: &[u8]| server.request("POST", "/v1/chat/completions", &[], body);
    let user = json!([{"role": "user", "content": "Hi"}]);
    // (body, status, the error's param, its code)
    type Case = (Vec<u8>, u16, Option<&'static str>, Option<&'static str>);
    let cases: Vec<Case> = vec![
        (b"{not json".to_vec(), 400, None, None),
        (b"[1, 2]".to_vec(), 400, None, None),
        (
            json!({"messages": []}).to_string().into(),
            400,
            Some("messages"),
            None,
        ),
        (
            json!({"messages": "hi"}).to_string().into(),
            400,
            Some("messages"),
            None,
        ),
        (
            json!({"messages": [{"role": "wizard", "content": "x"}]})
                .to_string()
                .into(),
            400,
            Some("messages[0]"),
            None,
        ),
        (
            json!({"messages": user, "max_tokens": -5})
                .to_string()
                .into(),
            400,
            Some("max_tokens"),
            None,
        ),
        (
            json!({"messages": user, "max_tokens": 1e12})
                .to_string()
                .into(),
            400,
            Some("max_tokens"),
            None,
        ),
        (
            json!({"messages": user, "max_tokens": 100000})
                .to_string()
                .into(),
            400,
            Some("messages"),
            Some("context_length_exceeded"),
        ),
        (
            json!({"messages": user, "temperature": 9})
                .to_string()
                .into(),
            400,
            Some("temperature"),
            None,
        ),
        (
            json!({"messages": user, "n": 3}).to_string().into(),
            400,
            Some("n"),
            None,
        ),
        (
            json!({"messages": user, "max_tokens": u64::MAX})
                .to_string()
                .into(),
            400,
            Some("messages"),
            Some("context_length_exceeded"),
        ),
        (
            json!({"messages": [{"role": "user", "content": "word ".repeat(300)}]})
                .to_string()
                .into(),
            400,
            Some("messages"),
            Some("context_length_exceeded"),
        ),
        (
            json!({"messages": user, "response_format": {"type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": "object", "properties": {"a": {"type": "nope"}}}}}})
            .to_string()
            .into(),
            400,
            Some("response_format"),
            None,
        ),
        (
            json!({"messages": user, "response_format": {"type": "json_schema",
                "json_schema": {"name": "x", "schema": {"$ref": "#/$defs/gone"}}}})
            .to_string()
            .into(),
            400,
            Some("response_format"),
            None,
        ),
        (
            json!({"messages": user, "response_format": {"type": "yaml"}})
                .to_string()
                .into(),
            400,
            Some("response_format.type"),
            None,
        ),
        (
            json!({"messages": user, "frequency_penalty": -3})
                .to_string()
                .into(),
            400,
            Some("frequency_penalty"),
            None,
        ),
        (
            json!({"messages": user, "sieve": {"policy": "window", "budget": 10}})
                .to_string()
                .into(),
            400,
            Some("sieve.budget"),
            None,
        ),
        (
            json!({"messages": [{"role": "user", "content": "x".repeat(5000)}]})
                .to_string()
                .into(),
            413,
            None,
            None,
        ),
    ];
    for (body, status, param, code) in cases {
        let (got, _, text) = chat(&body);
        let what = String::from_utf8_lossy(&body[..body.len().min(80)]).to_string();
        assert_eq!(got, status, "{what}: {text}");
        let e: Value = serde_json::from_str(&text).unwrap_or_else(|_| panic!("{what}: {text}"));
        assert!(
            e["error"]["message"]
                .as_str()
                .is_some_and(|m| !m.is_empty()),
            "{text}"
        );
        assert!(e["error"]["type"].is_string(), "{text}");
        assert_eq!(e["error"]["param"].as_str(), param, "{what}: {text}");
        assert_eq!(e["error"]["code"].as_str(), code, "{what}: {text}");
    }
    let (status, _, text) = server.get("/v1/nothing");
    assert_eq!(status, 404);
    assert!(text.contains("\"error\""), "{text}");
    let (status, _, text) = server.get("/v1/chat/completions");
    assert_eq!(status, 405);
    assert!(text.contains("\"error\""), "{text}");

    // A client that goes mid-stream: its sequence ends and frees its cache.
    // Endless (a window cache, 100,000 tokens): it cannot end on its own
    // before the server notices the client has gone.
    let long = json!({"prompt": "Count:", "max_tokens": 100_000, "temperature": 0, "stream": true,
        "stream_options": {"include_usage": true}, "sieve": {"policy": "window", "budget": 64}});
    let mut s = server.send("POST", "/v1/completions", &[], long.to_string().as_bytes());
    let mut first = [0u8; 64];
    s.read_exact(&mut first).unwrap();
    drop(s);
    wait_for("the sequence to be cancelled", || {
        server.metric("sieve_requests_cancelled_total") >= 1
    });
    assert_eq!(server.metric("sieve_sequences_busy"), 0);

    // One running, one waiting (--queue 1): the next is a 429 with Retry-After.
    let mut running = server.send("POST", "/v1/completions", &[], long.to_string().as_bytes());
    running.read_exact(&mut first).unwrap();
    let waiting = server.send("POST", "/v1/completions", &[], long.to_string().as_bytes());
    wait_for("the request to wait", || {
        server.metric("sieve_queue_length") == 1
    });
    let (status, head, text) = server.post("/v1/completions", &long);
    assert_eq!(status, 429, "{text}");
    assert!(
        head.to_ascii_lowercase().contains("retry-after: 1"),
        "{head}"
    );
    assert_eq!(
        serde_json::from_str::<Value>(&text).unwrap()["error"]["code"],
        "rate_limit_exceeded"
    );
    drop(running);
    drop(waiting);
    // Both leave: the running one is cancelled, the waiting one never starts.
    wait_for("the queue to empty", || {
        server.metric("sieve_queue_length") + server.metric("sieve_sequences_busy") == 0
    });

    // Still serving.
    let (status, _, text) = server.post(
        "/v1/completions",
        &json!({"prompt": "Hello", "max_tokens": 3, "temperature": 0}),
    );
    assert_eq!(status, 200, "{text}");
}

/// Kept sets per head (`--granularity head`): SnapKV's 64-query window
/// outreaches the 8 recent entries and the 16-token chunk, so a request
/// for it is refused naming `sieve.policy`; a token-scoring policy serves,
/// and the reply names the granularity.
#[test]
fn a_policy_the_servers_granularity_cannot_take_is_refused() {
    let server = Server::start(&["--chunk", "16", "--recent", "8", "--granularity", "head"]);
    let user = json!([{"role": "user", "content": "Hi"}]);
    let body =
        json!({"messages": user, "max_tokens": 2, "sieve": {"policy": "snapkv", "budget": 64}});
    let (status, _, text) = server.post("/v1/chat/completions", &body);
    assert_eq!(status, 400, "{text}");
    let e: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(e["error"]["param"], "sieve.policy", "{text}");
    assert!(
        e["error"]["message"]
            .as_str()
            .unwrap()
            .contains("snapkv_window 64"),
        "{text}"
    );
    let body =
        json!({"messages": user, "max_tokens": 2, "sieve": {"policy": "keydiff", "budget": 32}});
    let (status, _, text) = server.post("/v1/chat/completions", &body);
    assert_eq!(status, 200, "{text}");
    let r: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(
        r["sieve"],
        json!({"policy": "keydiff", "budget": 32, "granularity": "head"})
    );
}

/// `response_format` holds (a schema, any JSON object), whole and
/// streamed, with `finish_reason: "stop"` when the output is complete, and
/// "length" when max_tokens cuts it; penalties give the answer a session
/// gives with them.
#[test]
fn response_formats_and_penalties_are_honoured() {
    let server = Server::start(&[]);
    let schema = json!({"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 12},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "minItems": 1, "maxItems": 3}},
        "required": ["name", "tags"], "additionalProperties": false});
    let validator = jsonschema::validator_for(&schema).unwrap();
    let schema_format = json!({"type": "json_schema",
        "json_schema": {"name": "thing", "schema": schema, "strict": true}});
    for (format, seed) in [
        (&schema_format, 1),
        (&schema_format, 2),
        (&json!({"type": "json_object"}), 3),
    ] {
        let body = json!({"messages": [{"role": "user", "content": "A thing, as JSON."}],
            "response_format": format, "temperature": 0.9, "seed": seed, "max_tokens": 80});
        let (status, _, text) = server.post("/v1/chat/completions", &body);
        assert_eq!(status, 200, "{text}");
        let v: Value = serde_json::from_str(&text).unwrap();
        let content = text_of(&v, "chat");
        let finish = v["choices"][0]["finish_reason"]
            .as_str()
            .unwrap()
            .to_string();
        // Any object may go on past max_tokens with random weights.
        if format == &schema_format || finish == "stop" {
            assert_eq!(finish, "stop", "{text}");
            let parsed: Value =
                serde_json::from_str(&content).unwrap_or_else(|e| panic!("{content:?}: {e}"));
            assert!(parsed.is_object(), "{content}");
            assert!(
                format != &schema_format || validator.is_valid(&parsed),
                "{content}"
            );
        }
        // Streamed: the same text, and the same finish.
        let mut streamed = body.clone();
        streamed["stream"] = json!(true);
        let (status, _, text) = server.post("/v1/chat/completions", &streamed);
        assert_eq!(status, 200, "{text}");
        let (chunks, done) = sse_chunks(&text);
        assert!(done, "{text}");
        let pieces: String = (chunks.iter())
            .filter_map(|c| c["choices"][0]["delta"]["content"].as_str())
            .collect();
        assert_eq!(pieces, content);
        let streamed_finish = chunks
            .iter()
            .find_map(|c| c["choices"][0]["finish_reason"].as_str());
        assert_eq!(streamed_finish, Some(finish.as_str()));
    }
    let cut = json!({"prompt": "x", "response_format": schema_format, "max_tokens": 2});
    let (status, _, text) = server.post("/v1/completions", &cut);
    assert_eq!(status, 200, "{text}");
    let v: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(v["choices"][0]["finish_reason"], "length", "{text}");
    assert_eq!(v["usage"]["completion_tokens"], 2, "{text}");

    // Penalties: the answer of a session with the same settings.
    let llm = Llm::load(&tiny_text_model(), &LoadOptions::default()).unwrap();
    let prompt = llm.tokenizer.encode("Count:").unwrap();
    let sampling = sieve::SamplingParams {
        presence_penalty: 1.5,
        frequency_penalty: 0.5,
        ..Default::default()
    };
    let mut session = llm
        .session(SessionOptions {
            max_context: 128,
            prefill_chunk: 64,
            cache: None,
        })
        .unwrap();
    let opts = GenerateOptions {
        max_new_tokens: 24,
        sampling,
        ..Default::default()
    };
    let want = session.generate(&prompt, &opts, |_| true).unwrap();
    let plain = alone(&llm, &prompt, 24).0;
    assert_ne!(want.text, plain, "the penalties change this answer");
    let body = json!({"prompt": "Count:", "max_tokens": 24, "temperature": 0,
        "presence_penalty": 1.5, "frequency_penalty": 0.5});
    let (status, _, text) = server.post("/v1/completions", &body);
    assert_eq!(status, 200, "{text}");
    assert_eq!(
        text_of(&serde_json::from_str(&text).unwrap(), "text"),
        want.text
    );
}

/// Tools: a required or named choice gives `message.tool_calls` (ids, a
/// listed name, arguments valid under the tool's parameters) with
/// `finish_reason: "tool_calls"`, and the same calls streamed as
/// `delta.tool_calls` chunks; the call's result goes back in a `tool`
/// message; bad tools and calls are 400s naming the field.
#[test]
fn tool_calls_are_made_and_streamed() {
    // The tools' system message takes about 240 tokens.
    let server = Server::start(&["--max-context", "512"]);
    let params = json!({"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 12}, "days": {"type": "integer", "minimum": 1, "maximum": 7}},
        "required": ["city", "days"], "additionalProperties": false});
    let validator = jsonschema::validator_for(&params).unwrap();
    let tools = json!([
        {"type": "function", "function": {"name": "forecast", "description": "Weather", "parameters": params}},
        {"type": "function", "function": {"name": "noop"}},
    ]);
    let question = json!([{"role": "user", "content": "Weather in Paris?"}]);
    for (choice, seed) in [
        (json!("required"), 1),
        (
            json!({"type": "function", "function": {"name": "forecast"}}),
            2,
        ),
    ] {
        let body = json!({"messages": question, "tools": tools, "tool_choice": choice,
            "parallel_tool_calls": false, "temperature": 0.8, "seed": seed, "max_tokens": 60});
        let (status, _, text) = server.post("/v1/chat/completions", &body);
        assert_eq!(status, 200, "{text}");
        let v: Value = serde_json::from_str(&text).unwrap();
        let choice0 = &v["choices"][0];
        assert_eq!(choice0["finish_reason"], "tool_calls", "{text}");
        let calls = choice0["message"]["tool_calls"].as_array().unwrap();
        assert_eq!(calls.len(), 1, "{text}");
        let f = &calls[0]["function"];
        let args: Value = serde_json::from_str(f["arguments"].as_str().unwrap()).unwrap();
        match f["name"].as_str().unwrap() {
            "forecast" => assert!(validator.is_valid(&args), "{text}"),
            "noop" => assert!(choice == "required" && args.is_object(), "{text}"),
            other => panic!("{other}: {text}"),
        }
        assert!(calls[0]["id"]
            .as_str()
            .is_some_and(|id| id.starts_with("call_")));
        // Streamed: the same call, in a delta.tool_calls chunk.
        let mut streamed = body.clone();
        streamed["stream"] = json!(true);
        let (status, _, text) = server.post("/v1/chat/completions", &streamed);
        assert_eq!(status, 200, "{text}");
        let (chunks, done) = sse_chunks(&text);
        assert!(done, "{text}");
        let deltas: Vec<&Value> = (chunks.iter())
            .filter_map(|c| c["choices"][0]["delta"]["tool_calls"].as_array())
            .flatten()
            .collect();
        assert_eq!(deltas.len(), 1, "{text}");
        assert_eq!(deltas[0]["function"], *f, "{text}");
        assert_eq!(deltas[0]["index"], 0);
        let finish = chunks
            .iter()
            .find_map(|c| c["choices"][0]["finish_reason"].as_str());
        assert_eq!(finish, Some("tool_calls"));
        // The call and its result go back; the next answer is text.
        let id = calls[0]["id"].clone();
        let next = json!({"messages": [
            question[0],
            {"role": "assistant", "content": null, "tool_calls": calls},
            {"role": "tool", "tool_call_id": id, "content": "{\"forecast\": \"sunny\"}"}],
            "tools": tools, "tool_choice": "none", "max_tokens": 5, "temperature": 0});
        let (status, _, text) = server.post("/v1/chat/completions", &next);
        assert_eq!(status, 200, "{text}");
        let v: Value = serde_json::from_str(&text).unwrap();
        assert!(v["choices"][0]["message"]["content"].is_string(), "{text}");
        assert!(
            v["choices"][0]["message"].get("tool_calls").is_none(),
            "{text}"
        );
    }
    let bad_params = json!([{"type": "function", "function": {"name": "f",
        "parameters": {"type": "object", "properties": {"a": {"type": "nope"}}}}}]);
    for (body, path, param) in [
        (
            json!({"messages": question, "tools": bad_params, "tool_choice": "required"}),
            "/v1/chat/completions",
            "tools[0].function.parameters",
        ),
        (
            json!({"prompt": "x", "tools": tools}),
            "/v1/completions",
            "tools",
        ),
        (
            json!({"messages": question, "tools": tools,
            "tool_choice": {"type": "function", "function": {"name": "missing"}}}),
            "/v1/chat/completions",
            "tool_choice",
        ),
        (
            json!({"messages": [question[0], {"role": "tool", "tool_call_id": "call_9", "content": "x"}]}),
            "/v1/chat/completions",
            "messages[1].tool_call_id",
        ),
    ] {
        let (status, _, text) = server.post(path, &body);
        assert_eq!(status, 400, "{text}");
        let e: Value = serde_json::from_str(&text).unwrap();
        assert_eq!(e["error"]["param"], param, "{text}");
    }
}

/// Log-probabilities: a chat answer's `logprobs.content` has one entry
/// per generated token (their texts make the answer), the top entries
/// sorted with the greedy choice first; the stream carries the same entries
/// in its last chunk; a text completion gives the legacy form.
#[test]
fn logprobs_are_reported_whole_and_streamed() {
    let server = Server::start(&[]);
    let body = json!({"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 8,
        "temperature": 0, "logprobs": true, "top_logprobs": 3});
    let (status, _, text) = server.post("/v1/chat/completions", &body);
    assert_eq!(status, 200, "{text}");
    let v: Value = serde_json::from_str(&text).unwrap();
    let content = v["choices"][0]["logprobs"]["content"]
        .as_array()
        .unwrap()
        .clone();
    assert_eq!(
        content.len() as u64,
        v["usage"]["completion_tokens"].as_u64().unwrap()
    );
    let joined: String = content
        .iter()
        .map(|e| e["token"].as_str().unwrap())
        .collect();
    assert_eq!(joined, text_of(&v, "chat"));
    for e in &content {
        let top = e["top_logprobs"].as_array().unwrap();
        assert_eq!(top.len(), 3);
        assert_eq!(top[0]["token"], e["token"], "{e}");
        assert!(
            (top[0]["logprob"].as_f64().unwrap() - e["logprob"].as_f64().unwrap()).abs() < 1e-6
        );
        let lps: Vec<f64> = top.iter().map(|t| t["logprob"].as_f64().unwrap()).collect();
        assert!(lps.windows(2).all(|w| w[0] >= w[1]), "{e}");
        assert!(e["bytes"].is_array());
    }
    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    let (_, _, text) = server.post("/v1/chat/completions", &streamed);
    let (chunks, _) = sse_chunks(&text);
    let sent: Vec<Value> = (chunks.iter())
        .filter_map(|c| c["choices"][0]["logprobs"]["content"].as_array())
        .flatten()
        .cloned()
        .collect();
    assert_eq!(sent, content);
    let legacy = json!({"prompt": "Hello", "max_tokens": 6, "temperature": 0, "logprobs": 2});
    let (status, _, text) = server.post("/v1/completions", &legacy);
    assert_eq!(status, 200, "{text}");
    let v: Value = serde_json::from_str(&text).unwrap();
    let lp = &v["choices"][0]["logprobs"];
    assert_eq!(lp["tokens"].as_array().unwrap().len(), 6, "{text}");
    assert_eq!(lp["token_logprobs"].as_array().unwrap().len(), 6, "{text}");
    assert!(
        lp["top_logprobs"][0].as_object().unwrap().len() == 2,
        "{text}"
    );
    assert_eq!(lp["text_offset"][0], 0);
}

#[test]
fn an_api_key_is_required_when_set() {
    let server = Server::start(&["--api-key", "sesame"]);
    let body = json!({"prompt": "Hi", "max_tokens": 2}).to_string();
    let (status, _, text) = server.request("POST", "/v1/completions", &[], body.as_bytes());
    assert_eq!(status, 401, "{text}");
    assert_eq!(
        serde_json::from_str::<Value>(&text).unwrap()["error"]["code"],
        "invalid_api_key"
    );
    let wrong = server.request(
        "POST",
        "/v1/completions",
        &["Authorization: Bearer nope"],
        body.as_bytes(),
    );
    assert_eq!(wrong.0, 401);
    let (status, _, text) = server.request(
        "POST",
        "/v1/completions",
        &["Authorization: Bearer sesame"],
        body.as_bytes(),
    );
    assert_eq!(status, 200, "{text}");
}

/// SIGTERM: the server stops accepting, finishes the stream in flight and
/// exits 0.
#[cfg(unix)]
#[test]
fn sigterm_drains_the_requests_in_flight() {
    let mut server = Server::start(&[]);
    let body = json!({"prompt": "Count:", "max_tokens": 120, "temperature": 0, "stream": true,
        "stream_options": {"include_usage": true}});
    let mut stream = server.send("POST", "/v1/completions", &[], body.to_string().as_bytes());
    let mut first = [0u8; 64];
    stream.read_exact(&mut first).unwrap();
    let pid = server.child.id().to_string();
    assert!(Command::new("kill")
        .args(["-TERM", &pid])
        .status()
        .unwrap()
        .success());
    let mut rest = vec![];
    let _ = stream.read_to_end(&mut rest);
    let (chunks, done) = sse_chunks(&parse(&[first.as_slice(), &rest].concat()).2);
    let raw = String::from_utf8_lossy(&rest).to_string();
    assert!(
        done,
        "the stream was cut: {}",
        &raw[raw.len().saturating_sub(600)..]
    );
    assert_eq!(chunks.last().unwrap()["usage"]["completion_tokens"], 120);
    let status = server.child.wait().unwrap();
    assert!(status.success(), "{status}");
}

/// splitmix64, seeded by `SIEVE_FUZZ_SEED` (default 1) like tests/fuzz.rs.
struct Rng(u64);

impl Rng {
    fn new() -> Self {
        let seed = std::env::var("SIEVE_FUZZ_SEED")
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or(1u64);
        Rng(seed ^ 0x5e7e_5e7e)
    }
    fn below(&mut self, n: usize) -> usize {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        ((z ^ (z >> 31)) % n.max(1) as u64) as usize
    }
}

/// A body of `base` with one mutation: a field's value swapped for an
/// extreme or a wrong type, a field removed or added, deep nesting, a huge
/// string, or the text cut short.
fn mutated(rng: &mut Rng, base: &Value) -> Vec<u8> {
    let extremes = [
        json!(-1),
        json!(0),
        json!(1e308),
        json!(-1e308),
        json!(u64::MAX),
        json!(i64::MIN),
        json!(0.5),
        json!("text"),
        json!(""),
        json!(true),
        json!(null),
        json!([]),
        json!({}),
        json!([{"role": "user"}]),
        json!({"policy": "window", "budget": u64::MAX}),
        json!({"include_usage": "yes"}),
        json!("x".repeat(20_000)),
        json!([1, "a", null]),
    ];
    let mut v = base.clone();
    let fields: Vec<String> = v.as_object().unwrap().keys().cloned().collect();
    let extra = [
        "max_tokens",
        "temperature",
        "top_p",
        "seed",
        "stop",
        "n",
        "stream",
        "stream_options",
        "sieve",
        "presence_penalty",
        "logprobs",
        "unknown",
    ];
    match rng.below(7) {
        0 | 1 => {
            let key = fields[rng.below(fields.len())].clone();
            v[key.as_str()] = extremes[rng.below(extremes.len())].clone();
        }
        2 => {
            let key = extra[rng.below(extra.len())];
            v[key] = extremes[rng.below(extremes.len())].clone();
        }
        3 => {
            let key = &fields[rng.below(fields.len())];
            v.as_object_mut().unwrap().remove(key);
        }
        4 => {
            let depth = 1 + rng.below(5000);
            let text = format!("{}1{}", "[".repeat(depth), "]".repeat(depth));
            let key = fields[rng.below(fields.len())].clone();
            let mut body = v.to_string();
            let at = body.find(&format!("\"{key}\":")).unwrap() + key.len() + 3;
            let end = at + v[key.as_str()].to_string().len();
            body.replace_range(at..end, &text);
            return body.into_bytes();
        }
        5 => {
            if let Some(m) = v.get_mut("messages").and_then(|m| m.as_array_mut()) {
                m[0]["content"] = extremes[rng.below(extremes.len())].clone();
            }
        }
        _ => {
            let body = v.to_string().into_bytes();
            let cut = rng.below(body.len());
            return body[..cut].to_vec();
        }
    }
    v.to_string().into_bytes()
}

/// Hundreds of mutated request bodies: each gets an answer (200, or 400 or
/// 413 with OpenAI's error object) within the timeout, never a dropped
/// connection; the server's memory stays bounded and it still answers.
#[test]
fn mutated_request_bodies_never_break_the_server() {
    let server = Server::start(&["--parallel", "4", "--body-limit", "65536"]);
    let chat = json!({"model": "tiny", "messages": [{"role": "user", "content": "Hi there"}],
        "max_tokens": 4, "temperature": 0});
    let text = json!({"prompt": "Once upon", "max_tokens": 4, "stream": true,
        "stream_options": {"include_usage": true}});
    let mut rng = Rng::new();
    let mut statuses = std::collections::BTreeMap::new();
    for n in 0..400 {
        let (path, base) = match n % 2 {
            0 => ("/v1/chat/completions", &chat),
            _ => ("/v1/completions", &text),
        };
        let body = mutated(&mut rng, base);
        let (status, _, answer) = server.request("POST", path, &[], &body);
        let what = String::from_utf8_lossy(&body[..body.len().min(120)]).to_string();
        assert!(
            [200, 400, 413].contains(&status),
            "case {n} {path} {what}: status {status}: {answer}"
        );
        if status != 200 {
            let e: Value = serde_json::from_str(&answer)
                .unwrap_or_else(|_| panic!("case {n} {what}: not JSON: {answer}"));
            assert!(e["error"]["message"].is_string(), "case {n}: {answer}");
        }
        *statuses.entry(status).or_insert(0) += 1;
    }
    eprintln!("mutated request bodies: {statuses:?}");
    assert!(statuses.len() >= 2, "{statuses:?}");
    let status = std::fs::read_to_string(format!("/proc/{}/status", server.child.id()));
    if let Some(kb) = status.ok().and_then(|s| {
        s.lines()
            .find(|l| l.starts_with("VmHWM:"))
            .and_then(|l| l.split_whitespace().nth(1)?.parse::<u64>().ok())
    }) {
        assert!(kb < 4 << 20, "the server's peak memory reached {kb} kB");
    }
    let (status, _, answer) = server.post(
        "/v1/completions",
        &json!({"prompt": "Hello", "max_tokens": 2}),
    );
    assert_eq!(status, 200, "{answer}");
}

/// A model that cannot be loaded ends the server with exit status 1 and
/// the reason (the file and what is wrong), after it said where it
/// listened: the load runs while /health answers 503.
#[test]
fn a_model_that_cannot_load_ends_the_server() {
    let (model, dir) = tiny_text_model_copy("truncated");
    let weights = std::fs::read(model.join("model.safetensors")).unwrap();
    std::fs::write(dir.join("model.safetensors"), &weights[..weights.len() / 2]).unwrap();
    let missing = dir.join("no-such-model");
    for (model, expected) in [
        (&dir, "not a valid safetensors"),
        (&missing, "no-such-model"),
    ] {
        // stderr to a file: a pipe read only after the exit could fill.
        let err_file = dir.join("stderr.txt");
        let mut child = Command::new(env!("CARGO_BIN_EXE_sieve"))
            .args(["serve", "--model", model.to_str().unwrap(), "--port", "0"])
            .env("NODEVICE_SELECT", "1")
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&err_file).unwrap())
            .spawn()
            .unwrap();
        let t = Instant::now();
        let status = loop {
            if let Some(status) = child.try_wait().unwrap() {
                break status;
            }
            if t.elapsed() > Duration::from_secs(120) {
                let _ = child.kill();
                panic!("sieve serve --model {} did not end", model.display());
            }
            std::thread::sleep(Duration::from_millis(20));
        };
        let err = std::fs::read_to_string(&err_file).unwrap();
        assert_eq!(status.code(), Some(1), "{err}");
        assert!(err.contains(expected) && !err.contains("panicked"), "{err}");
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

/// The tiny text model with a final norm of 3e38 in a folder of its own:
/// finite weights whose logits overflow, whatever the prompt.
fn overflowing_text_model() -> std::path::PathBuf {
    let (model, dir) = tiny_text_model_copy("overflow");
    let bytes = std::fs::read(model.join("model.safetensors")).unwrap();
    let tensors = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let huge: Vec<u8> = tensors
        .tensor("model.norm.weight")
        .unwrap()
        .data()
        .chunks(4)
        .flat_map(|_| 3e38f32.to_le_bytes())
        .collect();
    let views: Vec<(String, safetensors::tensor::TensorView)> = tensors
        .tensors()
        .into_iter()
        .map(|(name, view)| match name.as_str() {
            "model.norm.weight" => {
                let v = safetensors::tensor::TensorView::new(
                    view.dtype(),
                    view.shape().to_vec(),
                    &huge,
                )
                .unwrap();
                (name, v)
            }
            _ => (name, view),
        })
        .collect();
    safetensors::serialize_to_file(views, None, &dir.join("model.safetensors")).unwrap();
    dir
}

/// Non-finite logits fail the request that met them (a 500 with the error
/// object, or an error chunk in a stream that has started) and the server
/// keeps serving: it stays healthy, counts the failures, frees the
/// sequences, and answers the next request the same way.
#[test]
fn non_finite_logits_fail_the_request_and_the_server_keeps_serving() {
    let dir = overflowing_text_model();
    let server = Server::start_with(&dir, &["--parallel", "2"]);
    let chat = json!({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4});
    for _ in 0..2 {
        let (status, _, body) = server.post("/v1/chat/completions", &chat);
        assert_eq!(status, 500, "{body}");
        let e: Value = serde_json::from_str(&body).unwrap();
        assert_eq!(e["error"]["type"], "server_error", "{body}");
        assert!(
            e["error"]["message"]
                .as_str()
                .unwrap()
                .contains("NaN or infinity"),
            "{body}"
        );
    }
    let streamed =
        json!({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "stream": true});
    let (status, _, body) = server.post("/v1/chat/completions", &streamed);
    assert_eq!(status, 200, "{body}");
    let (chunks, _) = sse_chunks(&body);
    assert_eq!(
        chunks[0]["choices"][0]["delta"]["role"], "assistant",
        "{body}"
    );
    let error = chunks
        .iter()
        .find(|c| c.get("error").is_some())
        .expect(&body);
    assert_eq!(error["error"]["type"], "server_error", "{body}");
    assert_eq!(server.get("/health").0, 200);
    assert_eq!(server.metric("sieve_requests_failed_total"), 3);
    assert_eq!(server.metric("sieve_sequences_busy"), 0);
    drop(server);
    std::fs::remove_dir_all(&dir).unwrap();
}

/// The tiny text model and a fresh copy of its folder (`tag` names it), for
/// a test to damage.
fn tiny_text_model_copy(tag: &str) -> (std::path::PathBuf, std::path::PathBuf) {
    let model = tiny_text_model();
    let dir = std::env::temp_dir().join(format!("sieve-serve-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    for f in std::fs::read_dir(&model).unwrap() {
        let f = f.unwrap().path();
        std::fs::copy(&f, dir.join(f.file_name().unwrap())).unwrap();
    }
    (model, dir)
}
