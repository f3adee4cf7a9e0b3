//! OpenAI's request and response shapes: the fields sieve reads from a
//! chat or text completion request, each checked with an error naming it,
//! the error object, and the response and stream chunk objects.

use serde_json::{json, Map, Value};

use super::error::ApiError;
use crate::cache::CacheOptions;
use crate::constraint::Constraint;
use crate::eviction::Policy;
use crate::kernels::sample::SamplingParams;
use crate::kernels::sample::TokenLogprobs;
use crate::session::{Generation, StopReason};
use crate::tokenizer::Message;
use crate::tokenizer::Tokenizer;
use crate::tools::ToolSet;

/// What a chat or text completion request asks for, besides its prompt.
#[derive(Clone, Debug)]
pub struct Generate {
    /// None: up to the context's end.
    pub max_tokens: Option<usize>,
    pub sampling: SamplingParams,
    pub stop: Vec<String>,
    pub stream: bool,
    pub include_usage: bool,
    /// What the output must match, and the request field that asked for it
    /// (named by the error when it does not compile).
    pub constraint: Option<(Constraint, &'static str)>,
    /// The tools the model may call (None: no call may be made).
    pub tools: Option<ToolSet>,
    /// Log-probabilities asked for, with this many top entries
    /// ([`parse_logprobs`]).
    pub logprobs: Option<usize>,
}

/// The body as a JSON object.
pub fn parse_body(bytes: &[u8]) -> Result<Map<String, Value>, ApiError> {
    match serde_json::from_slice::<Value>(bytes) {
        Ok(Value::Object(map)) => Ok(map),
        Ok(_) => Err(ApiError::invalid(
            None,
            "the request body must be a JSON object",
        )),
        Err(e) => Err(ApiError::invalid(
            None,
            format!("the request body is not valid JSON: {e}"),
        )),
    }
}

/// A field of `body` that, when present and not null, has this type.
fn field<'a, T>(
    body: &'a Map<String, Value>,
    key: &str,
    what: &str,
    get: impl Fn(&'a Value) -> Option<T>,
) -> Result<Option<T>, ApiError> {
    match body.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => get(v)
            .map(Some)
            .ok_or_else(|| ApiError::invalid(Some(key), format!("'{key}' must be {what}"))),
    }
}

fn number_in(
    body: &Map<String, Value>,
    key: &str,
    lo: f64,
    hi: f64,
) -> Result<Option<f64>, ApiError> {
    let v = field(body, key, "a number", Value::as_f64)?;
    match v {
        Some(x) if !(lo..=hi).contains(&x) => Err(ApiError::invalid(
            Some(key),
            format!("'{key}' is {x}; it must be between {lo} and {hi}"),
        )),
        _ => Ok(v),
    }
}

/// `response_format`: `{"type": "text"}` (any text), `{"type":
/// "json_object"}` (a JSON object) or `{"type": "json_schema",
/// "json_schema": {"name", "schema", "strict", "description"}}` (JSON valid
/// under the schema; enforced whether `strict` is true or not).
fn parse_response_format(body: &Map<String, Value>) -> Result<Option<Constraint>, ApiError> {
    const KEY: &str = "response_format";
    let format = match body.get(KEY) {
        None | Some(Value::Null) => return Ok(None),
        Some(Value::Object(o)) => o,
        Some(_) => {
            return Err(ApiError::invalid(
                Some(KEY),
                "'response_format' must be an object",
            ))
        }
    };
    match format.get("type").and_then(Value::as_str) {
        Some("text") => Ok(None),
        Some("json_object") => Ok(Some(Constraint::json_object())),
        Some("json_schema") => {
            let param = "response_format.json_schema";
            let Some(Value::Object(spec)) = format.get("json_schema") else {
                return Err(ApiError::invalid(
                    Some(param),
                    "'response_format.json_schema' must be an object: {\"name\": ..., \"schema\": {...}}",
                ));
            };
            let name =
                field(spec, "name", "a string", Value::as_str).map_err(|e| e.param_in(param))?;
            if !name.is_some_and(|n| {
                (1..=64).contains(&n.len())
                    && n.chars()
                        .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-')
            }) {
                return Err(ApiError::invalid(
                    Some("response_format.json_schema.name"),
                    "'response_format.json_schema.name' must be 1 to 64 letters, digits, '_' or '-'",
                ));
            }
            field(spec, "strict", "a boolean", Value::as_bool).map_err(|e| e.param_in(param))?;
            field(spec, "description", "a string", Value::as_str).map_err(|e| e.param_in(param))?;
            match spec.get("schema") {
                Some(schema @ Value::Object(_)) => Ok(Some(Constraint::json_schema(schema))),
                _ => Err(ApiError::invalid(
                    Some("response_format.json_schema.schema"),
                    "'response_format.json_schema.schema' must be a JSON schema (an object)",
                )),
            }
        }
        _ => Err(ApiError::invalid(
            Some("response_format.type"),
            "'response_format.type' must be \"text\", \"json_object\" or \"json_schema\"",
        )),
    }
}

/// The OpenAI field that asks for what sieve does not do (logit biases): a
/// 400 naming it wherever a value asks for something, so that no client
/// believes it was done. An empty bias map passes.
fn refuse_what_is_not_honoured(body: &Map<String, Value>) -> Result<(), ApiError> {
    let refuse = |key: &str, why: &str| Err(ApiError::invalid(Some(key), format!("'{key}' {why}")));
    match body.get("logit_bias") {
        None | Some(Value::Null) => {}
        Some(Value::Object(m)) if m.is_empty() => {}
        Some(_) => return refuse("logit_bias", "is not supported"),
    }
    Ok(())
}

/// The generation fields shared by chat and text completions.
pub fn parse_generate(body: &Map<String, Value>) -> Result<Generate, ApiError> {
    let n = field(body, "n", "an integer", Value::as_u64)?;
    if n.is_some_and(|n| n != 1) {
        return Err(ApiError::invalid(
            Some("n"),
            "only one choice per request is supported ('n' must be 1)",
        ));
    }
    let presence_penalty = number_in(body, "presence_penalty", -2.0, 2.0)?.unwrap_or(0.0);
    let frequency_penalty = number_in(body, "frequency_penalty", -2.0, 2.0)?.unwrap_or(0.0);
    refuse_what_is_not_honoured(body)?;
    let tools = super::tools::parse_tools(body)?;
    let format = parse_response_format(body)?;
    let constraint = match (format, tools.as_ref().and_then(ToolSet::constraint)) {
        (Some(_), Some(_)) => {
            return Err(ApiError::invalid(
                Some("response_format"),
                "'response_format' cannot be combined with tools the model may call (tool_choice \"none\" or no tools)",
            ))
        }
        (Some(format), None) => Some((format, "response_format")),
        (None, Some(calls)) => Some((calls, "tools")),
        (None, None) => None,
    };
    let mut max_tokens = None;
    for key in ["max_completion_tokens", "max_tokens"] {
        let v = field(body, key, "a positive integer", |v| {
            v.as_u64().filter(|&n| n >= 1)
        })?;
        max_tokens = max_tokens.or(v);
    }
    let temperature = number_in(body, "temperature", 0.0, 2.0)?.unwrap_or(1.0);
    let top_p = number_in(body, "top_p", 0.0, 1.0)?.unwrap_or(1.0);
    if top_p == 0.0 {
        return Err(ApiError::invalid(
            Some("top_p"),
            "'top_p' must be greater than 0",
        ));
    }
    let seed = field(body, "seed", "an integer", |v| {
        v.as_u64().or(v.as_i64().map(|s| s as u64))
    })?;
    let stop = match body.get("stop") {
        None | Some(Value::Null) => vec![],
        Some(Value::String(s)) => vec![s.clone()],
        Some(Value::Array(items)) => items
            .iter()
            .map(|s| s.as_str().map(str::to_string))
            .collect::<Option<Vec<_>>>()
            .ok_or_else(|| {
                ApiError::invalid(Some("stop"), "'stop' must be a string or a list of strings")
            })?,
        Some(_) => {
            return Err(ApiError::invalid(
                Some("stop"),
                "'stop' must be a string or a list of strings",
            ))
        }
    };
    if stop.len() > 4 || stop.iter().any(String::is_empty) {
        return Err(ApiError::invalid(
            Some("stop"),
            "'stop' takes at most 4 strings, none empty",
        ));
    }
    let stream = field(body, "stream", "a boolean", Value::as_bool)?.unwrap_or(false);
    let include_usage = match body.get("stream_options") {
        None | Some(Value::Null) => false,
        Some(Value::Object(o)) => field(o, "include_usage", "a boolean", Value::as_bool)
            .map_err(|mut e| {
                e.param = Some("stream_options.include_usage".into());
                e
            })?
            .unwrap_or(false),
        Some(_) => {
            return Err(ApiError::invalid(
                Some("stream_options"),
                "'stream_options' must be an object",
            ))
        }
    };
    // Without a seed, each request samples differently (as OpenAI's API).
    let seed = seed.unwrap_or_else(|| {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64);
        static DRAWS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let draw = DRAWS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        nanos ^ draw.wrapping_mul(0x9e37_79b9_7f4a_7c15)
    });
    let sampling = SamplingParams {
        temperature: temperature as f32,
        top_p: top_p as f32,
        presence_penalty: presence_penalty as f32,
        frequency_penalty: frequency_penalty as f32,
        seed,
        ..SamplingParams::GREEDY
    };
    Ok(Generate {
        max_tokens: max_tokens.map(|n| n.min(usize::MAX as u64) as usize),
        sampling,
        stop,
        stream,
        include_usage,
        constraint,
        tools,
        logprobs: None,
    })
}

/// The cache of a request: the server's (`base`), or the policy and
/// budget its `"sieve": {"policy", "budget"}` extension asks for, with the
/// server's chunk, sinks and recent entries; at most `max_slots` slots.
pub fn parse_cache(
    body: &Map<String, Value>,
    base: &CacheOptions,
    max_slots: usize,
) -> Result<CacheOptions, ApiError> {
    let ext = match body.get("sieve") {
        None | Some(Value::Null) => return Ok(*base),
        Some(Value::Object(o)) => o,
        Some(_) => {
            return Err(ApiError::invalid(
                Some("sieve"),
                "'sieve' must be an object: {\"policy\": NAME, \"budget\": J}",
            ))
        }
    };
    let named = |mut e: ApiError| {
        e.param = e.param.map(|p| format!("sieve.{p}"));
        e.message = format!("sieve.{}", e.message.trim_start_matches('\''));
        e
    };
    let policy = match field(ext, "policy", "a policy name", Value::as_str).map_err(named)? {
        None => base.policy,
        Some(name) => Policy::parse(name)
            .ok()
            .filter(|p| !p.needs_future())
            .ok_or_else(|| {
                let names: Vec<&str> = Policy::ALL
                    .iter()
                    .filter(|(_, p)| !p.needs_future())
                    .map(|(n, _)| *n)
                    .collect();
                ApiError::invalid(
                    Some("sieve.policy"),
                    format!(
                        "sieve.policy '{name}' is not a policy for generation ({})",
                        names.join(", ")
                    ),
                )
            })?,
    };
    let budget = field(ext, "budget", "a positive integer", |v| {
        v.as_u64().filter(|&b| b >= 1)
    })
    .map_err(named)?;
    let opts = CacheOptions {
        policy,
        budget: budget.map_or(base.budget, |b| b.min(usize::MAX as u64) as usize),
        ..*base
    };
    if policy == Policy::Full {
        return Ok(opts);
    }
    let bad_budget = |message: String| ApiError::invalid(Some("sieve.budget"), message);
    if opts.budget == 0 {
        return Err(bad_budget(format!(
            "sieve.budget is needed for policy '{}'",
            policy.name()
        )));
    }
    if opts.budget.saturating_add(opts.chunk) > max_slots {
        return Err(bad_budget(format!(
            "sieve.budget {} and the server's chunk {} take more than the {max_slots} cache slots of a sequence (--max-context)",
            opts.budget, opts.chunk
        )));
    }
    opts.validate().map_err(|e| {
        // Past the budget's own bound, the request's policy is what the
        // server's settings cannot take (SnapKV's window per head).
        let budget_bound = opts.budget <= opts.sinks.saturating_add(opts.recent);
        let param = if budget_bound {
            "sieve.budget"
        } else {
            "sieve.policy"
        };
        ApiError::invalid(Some(param), e.to_string())
    })?;
    Ok(opts)
}

/// The chat's messages. An assistant message may carry `tool_calls`
/// (then its content may be null) and a `tool` message answers one of
/// them by `tool_call_id`: both are rendered as the model reads them in
/// the Hermes format (`crate::tools`), a run of tool results as one user
/// message.
pub fn parse_messages(body: &Map<String, Value>) -> Result<Vec<Message>, ApiError> {
    let Some(Value::Array(items)) = body.get("messages") else {
        return Err(ApiError::invalid(
            Some("messages"),
            "'messages' must be a list of messages",
        ));
    };
    if items.is_empty() {
        return Err(ApiError::invalid(
            Some("messages"),
            "'messages' must hold at least one message",
        ));
    }
    let mut messages: Vec<Message> = vec![];
    let mut call_ids: Vec<String> = vec![];
    // Whether the last message holds tool results (the next joins it).
    let mut last_was_tool = false;
    for (i, m) in items.iter().enumerate() {
        let param = format!("messages[{i}]");
        let bad = |what: &str| ApiError::invalid(Some(&param), format!("{param}: {what}"));
        let m = m
            .as_object()
            .ok_or_else(|| bad("a message must be an object"))?;
        let role = match m.get("role").and_then(Value::as_str) {
            Some("system" | "developer") => "system",
            Some("user") => "user",
            Some("assistant") => "assistant",
            Some("tool") => "tool",
            Some(other) => {
                return Err(bad(&format!(
                    "role '{other}' is not supported (system, developer, user, assistant or tool)"
                )))
            }
            None => return Err(bad("'role' must be a string")),
        };
        let calls = match m.get("tool_calls") {
            Some(calls) if role == "assistant" && !calls.is_null() => {
                super::tools::parse_calls(calls, &format!("{param}.tool_calls"))?
            }
            None | Some(Value::Null) => vec![],
            Some(_) => return Err(bad("only an assistant message carries 'tool_calls'")),
        };
        let content = match m.get("content") {
            Some(Value::String(s)) => s.clone(),
            Some(Value::Array(parts)) => parts
                .iter()
                .map(|p| match (p.get("type"), p.get("text")) {
                    (Some(Value::String(t)), Some(Value::String(text))) if t == "text" => {
                        Some(text.as_str())
                    }
                    _ => None,
                })
                .collect::<Option<Vec<_>>>()
                .ok_or_else(|| bad("only text content parts are supported"))?
                .concat(),
            None | Some(Value::Null) if !calls.is_empty() => String::new(),
            _ => return Err(bad("'content' must be a string or a list of text parts")),
        };
        if role == "tool" {
            let id = m.get("tool_call_id").and_then(Value::as_str);
            if !id.is_some_and(|id| call_ids.iter().any(|c| c == id)) {
                return Err(ApiError::invalid(
                    Some(&format!("{param}.tool_call_id")),
                    format!("{param}: a tool message must answer a call of an earlier assistant message by its id ('tool_call_id' {id:?})"),
                ));
            }
            let response = crate::tools::render_response(&content);
            match messages.last_mut().filter(|_| last_was_tool) {
                Some(last) => last.content = format!("{}\n{response}", last.content),
                None => messages.push(Message::new("user", &response)),
            }
            last_was_tool = true;
            continue;
        }
        last_was_tool = false;
        if calls.is_empty() {
            messages.push(Message::new(role, &content));
        } else {
            let content = (!content.is_empty()).then_some(content.as_str());
            let (ids, calls): (Vec<String>, Vec<_>) = calls.into_iter().unzip();
            call_ids.extend(ids);
            messages.push(Message::new(
                "assistant",
                &crate::tools::render_calls(content, &calls),
            ));
        }
    }
    Ok(messages)
}

/// The prompt of a text completion: a string, or a list of one string.
pub fn parse_prompt(body: &Map<String, Value>) -> Result<String, ApiError> {
    let bad = || ApiError::invalid(Some("prompt"), "'prompt' must be a non-empty string");
    let text = match body.get("prompt") {
        Some(Value::String(s)) => s.clone(),
        Some(Value::Array(items)) if items.len() == 1 => {
            items[0].as_str().ok_or_else(bad)?.to_string()
        }
        Some(Value::Array(_)) => {
            return Err(ApiError::invalid(
                Some("prompt"),
                "only one prompt per request is supported",
            ))
        }
        _ => return Err(bad()),
    };
    if text.is_empty() {
        return Err(bad());
    }
    Ok(text)
}

/// OpenAI's finish reason for a stop.
pub fn finish_reason(stop: StopReason) -> &'static str {
    match stop {
        StopReason::Eos
        | StopReason::StopString
        | StopReason::Cancelled
        | StopReason::ConstraintComplete => "stop",
        StopReason::MaxTokens | StopReason::ContextFull => "length",
    }
}

/// The finish reason of an answer that made tool calls or not: OpenAI's
/// "tool_calls" when it did and ended by itself.
fn finish_reason_with_calls(stop: StopReason, called: bool) -> &'static str {
    match finish_reason(stop) {
        "stop" if called => "tool_calls",
        other => other,
    }
}

/// `logprobs` and `top_logprobs`: a chat completion takes `logprobs: true`
/// and `top_logprobs` in 0..=20 (which needs `logprobs`); a text completion
/// takes `logprobs` as the number of top entries, 0..=5 (OpenAI's legacy
/// form). The number of top entries, or None when not asked for.
pub fn parse_logprobs(body: &Map<String, Value>, kind: Kind) -> Result<Option<usize>, ApiError> {
    let top = field(body, "top_logprobs", "an integer from 0 to 20", |v| {
        v.as_u64().filter(|&n| n <= 20)
    })?;
    match kind {
        Kind::Chat => {
            let on = field(body, "logprobs", "a boolean", Value::as_bool)?.unwrap_or(false);
            if top.is_some() && !on {
                return Err(ApiError::invalid(
                    Some("top_logprobs"),
                    "'top_logprobs' needs 'logprobs': true",
                ));
            }
            Ok(on.then_some(top.unwrap_or(0) as usize))
        }
        Kind::Text => {
            if top.is_some() {
                return Err(ApiError::invalid(
                    Some("top_logprobs"),
                    "'top_logprobs' is for chat completions; a text completion's 'logprobs' is the number of top entries",
                ));
            }
            let n = field(body, "logprobs", "an integer from 0 to 5", |v| {
                v.as_u64().filter(|&n| n <= 5)
            })?;
            Ok(n.map(|n| n as usize))
        }
    }
}

/// A token's text and bytes as the log-probabilities show them.
fn token_text(tokenizer: &Tokenizer, id: u32) -> (String, Vec<u8>) {
    let bytes = tokenizer.token_bytes(id);
    (String::from_utf8_lossy(&bytes).into_owned(), bytes)
}

/// The `logprobs` of a choice: chat's `{"content": [...]}` or a text
/// completion's `{"tokens", "token_logprobs", "top_logprobs",
/// "text_offset"}`, for `ids` and their log-probabilities.
pub fn logprobs_json(
    kind: Kind,
    tokenizer: &Tokenizer,
    ids: &[u32],
    lps: &[TokenLogprobs],
) -> Value {
    match kind {
        Kind::Chat => {
            let entry = |id: u32, lp: f32| {
                let (token, bytes) = token_text(tokenizer, id);
                json!({"token": token, "logprob": lp, "bytes": bytes})
            };
            let content: Vec<Value> = (ids.iter().zip(lps))
                .map(|(&id, lp)| {
                    let mut e = entry(id, lp.logprob);
                    e["top_logprobs"] = lp.top.iter().map(|&(t, v)| entry(t, v)).collect();
                    e
                })
                .collect();
            json!({"content": content, "refusal": null})
        }
        Kind::Text => {
            let mut offset = 0;
            let (mut tokens, mut offsets) = (vec![], vec![]);
            for &id in ids {
                let (token, _) = token_text(tokenizer, id);
                offsets.push(offset);
                offset += token.len();
                tokens.push(token);
            }
            let top: Vec<Value> = (lps.iter())
                .map(|lp| {
                    let m: Map<String, Value> = (lp.top.iter())
                        .map(|&(t, v)| (token_text(tokenizer, t).0, json!(v)))
                        .collect();
                    Value::Object(m)
                })
                .collect();
            json!({"tokens": tokens, "token_logprobs": lps.iter().map(|l| l.logprob).collect::<Vec<_>>(),
                "top_logprobs": top, "text_offset": offsets})
        }
    }
}

/// The `usage` object.
pub fn usage(g: &Generation) -> Value {
    let cached = g.stats.cached_tokens;
    let (p, c) = (g.stats.prompt_tokens + cached, g.stats.generated_tokens);
    json!({
        "prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c,
        "prompt_tokens_details": {"cached_tokens": cached},
    })
}

/// Which request kind a response answers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    Chat,
    Text,
}

impl Kind {
    /// The request field that holds the prompt.
    pub fn prompt_param(self) -> &'static str {
        match self {
            Kind::Chat => "messages",
            Kind::Text => "prompt",
        }
    }

    fn object(self, chunk: bool) -> &'static str {
        match (self, chunk) {
            (Kind::Chat, false) => "chat.completion",
            (Kind::Chat, true) => "chat.completion.chunk",
            (Kind::Text, _) => "text_completion",
        }
    }

    /// A choice carrying `text` (and `finish`, when it is the last).
    fn choice(self, text: Option<&str>, finish: Option<&str>, chunk: bool) -> Value {
        match (self, chunk) {
            (Kind::Chat, false) => json!({
                "index": 0, "message": {"role": "assistant", "content": text.unwrap_or("")},
                "finish_reason": finish, "logprobs": null,
            }),
            (Kind::Chat, true) => {
                let delta = match text {
                    Some(t) => json!({"content": t}),
                    None => json!({}),
                };
                json!({"index": 0, "delta": delta, "finish_reason": finish, "logprobs": null})
            }
            (Kind::Text, _) => json!({
                "index": 0, "text": text.unwrap_or(""), "finish_reason": finish, "logprobs": null,
            }),
        }
    }
}

/// What every response and chunk of one request repeats.
#[derive(Clone)]
pub struct Envelope {
    pub kind: Kind,
    pub id: String,
    pub created: u64,
    pub model: String,
    /// The cache the request ran with: {"policy", "budget"}.
    pub cache: Value,
    /// Whether the answer may hold tool calls (read out of its text).
    pub tools: bool,
    /// The tokenizer, when the answer reports log-probabilities (the
    /// tokens' text).
    pub logprobs: Option<std::sync::Arc<Tokenizer>>,
}

impl Envelope {
    fn object(&self, chunk: bool, choices: Vec<Value>) -> Value {
        json!({
            "id": self.id, "object": self.kind.object(chunk), "created": self.created,
            "model": self.model, "choices": choices, "system_fingerprint": null,
            "sieve": self.cache,
        })
    }

    /// The whole answer of a request that does not stream.
    pub fn response(&self, g: &Generation) -> Value {
        let mut choice = self
            .kind
            .choice(Some(&g.text), Some(finish_reason(g.stats.stop)), false);
        if self.tools {
            let (message, called) = super::tools::message(&self.id, &g.text);
            choice["message"] = message;
            choice["finish_reason"] = json!(finish_reason_with_calls(g.stats.stop, called));
        }
        if let Some(t) = &self.logprobs {
            choice["logprobs"] = logprobs_json(self.kind, t, &g.ids, &g.logprobs);
        }
        let mut v = self.object(false, vec![choice]);
        v["usage"] = usage(g);
        v
    }

    /// The first chunk of a chat stream: the assistant's role.
    pub fn role_chunk(&self) -> Value {
        let choice = json!({"index": 0, "delta": {"role": "assistant", "content": ""},
            "finish_reason": null, "logprobs": null});
        self.object(true, vec![choice])
    }

    /// A chunk of streamed text.
    pub fn text_chunk(&self, text: &str) -> Value {
        self.object(true, vec![self.kind.choice(Some(text), None, true)])
    }

    /// The chunk that ends a stream's choice (`called`: it sent tool
    /// calls). It carries the log-probabilities of every token when they
    /// were asked for: the text streams in pieces that are not tokens.
    pub fn finish_chunk(&self, g: &Generation, called: bool) -> Value {
        let finish = finish_reason_with_calls(g.stats.stop, called);
        let mut choice = self.kind.choice(None, Some(finish), true);
        if let Some(t) = &self.logprobs {
            choice["logprobs"] = logprobs_json(self.kind, t, &g.ids, &g.logprobs);
        }
        self.object(true, vec![choice])
    }

    /// A chunk with one tool call (`delta.tool_calls`).
    pub fn call_chunk(&self, call: Value) -> Value {
        let choice = json!({"index": 0, "delta": {"tool_calls": [call]},
            "finish_reason": null, "logprobs": null});
        self.object(true, vec![choice])
    }

    /// The last chunk with `stream_options.include_usage`: no choices.
    pub fn usage_chunk(&self, g: &Generation) -> Value {
        let mut v = self.object(true, vec![]);
        v["usage"] = usage(g);
        v
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::http::StatusCode;

    fn body(v: Value) -> Map<String, Value> {
        v.as_object().unwrap().clone()
    }

    #[test]
    fn generation_fields_are_checked_with_their_names() {
        let ok = parse_generate(&body(json!({
            "max_tokens": 5, "temperature": 0, "stop": "x", "stream": true,
            "stream_options": {"include_usage": true}, "unknown": [1, 2],
        })))
        .unwrap();
        assert_eq!(ok.max_tokens, Some(5));
        assert_eq!(ok.stop, vec!["x".to_string()]);
        assert!(ok.stream && ok.include_usage);
        assert_eq!(ok.sampling.temperature, 0.0);
        assert!(ok.constraint.is_none());
        let penalties = json!({"presence_penalty": 0.5, "frequency_penalty": -1.5});
        let g = parse_generate(&body(penalties)).unwrap();
        assert_eq!(g.sampling.presence_penalty, 0.5);
        assert_eq!(g.sampling.frequency_penalty, -1.5);
        let schema = json!({"type": "object", "properties": {"a": {"type": "integer"}}});
        for (format, want) in [
            (
                json!({"type": "json_object"}),
                Some(Constraint::json_object()),
            ),
            (
                json!({"type": "json_schema", "json_schema": {"name": "p-1", "schema": schema, "strict": true}}),
                Some(Constraint::json_schema(&schema)),
            ),
            (json!({"type": "text"}), None),
        ] {
            let g = parse_generate(&body(json!({ "response_format": format }))).unwrap();
            assert_eq!(g.constraint.map(|(c, _)| c), want);
        }
        // Values of the not-yet-supported fields that ask for nothing pass.
        parse_generate(&body(json!({
            "response_format": {"type": "text"}, "tools": [], "tool_choice": "auto",
            "top_logprobs": 0, "logit_bias": {}, "parallel_tool_calls": false,
        })))
        .unwrap();
        parse_generate(&body(json!({"tool_choice": "none"}))).unwrap();
        for (bad, param) in [
            (json!({"max_tokens": -1}), "max_tokens"),
            (json!({"max_tokens": 0}), "max_tokens"),
            (
                json!({"max_completion_tokens": "8"}),
                "max_completion_tokens",
            ),
            (json!({"temperature": 3.5}), "temperature"),
            (json!({"top_p": 0}), "top_p"),
            (json!({"n": 2}), "n"),
            (json!({"stop": [1]}), "stop"),
            (json!({"stop": ["a", "b", "c", "d", "e"]}), "stop"),
            (json!({"stream": "yes"}), "stream"),
            (json!({"presence_penalty": 2.5}), "presence_penalty"),
            (json!({"frequency_penalty": "1"}), "frequency_penalty"),
            (json!({"response_format": "json"}), "response_format"),
            (
                json!({"response_format": {"type": "xml"}}),
                "response_format.type",
            ),
            (
                json!({"response_format": {"type": "json_schema"}}),
                "response_format.json_schema",
            ),
            (
                json!({"response_format": {"type": "json_schema", "json_schema": {"schema": {}}}}),
                "response_format.json_schema.name",
            ),
            (
                json!({"response_format": {"type": "json_schema", "json_schema": {"name": "a b", "schema": {}}}}),
                "response_format.json_schema.name",
            ),
            (
                json!({"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": [1]}}}),
                "response_format.json_schema.schema",
            ),
            (
                json!({"response_format": {"type": "json_schema", "json_schema": {"name": "p", "strict": "yes", "schema": {}}}}),
                "response_format.json_schema.strict",
            ),
            (json!({"tools": {"name": "f"}}), "tools"),
            (json!({"tools": [{"name": "get_weather"}]}), "tools[0]"),
            (
                json!({"tools": [{"type": "function", "function": {"name": "get weather"}}]}),
                "tools[0].function.name",
            ),
            (
                json!({"tools": [{"type": "function", "function": {"name": "f", "parameters": [1]}}]}),
                "tools[0].function.parameters",
            ),
            (
                json!({"tools": [{"type": "function", "function": {"name": "f"}},
                    {"type": "function", "function": {"name": "f"}}]}),
                "tools[1].function.name",
            ),
            (
                json!({"tools": [{"type": "function", "function": {"name": "f"}}],
                    "tool_choice": {"type": "function", "function": {"name": "g"}}}),
                "tool_choice",
            ),
            (
                json!({"tools": [{"type": "function", "function": {"name": "f"}}],
                    "tool_choice": "always"}),
                "tool_choice",
            ),
            (
                json!({"tools": [{"type": "function", "function": {"name": "f"}}],
                    "response_format": {"type": "json_object"}}),
                "response_format",
            ),
            (
                json!({"tools": [{"type": "function", "function": {"name": "f"}}],
                    "parallel_tool_calls": "no"}),
                "parallel_tool_calls",
            ),
            (json!({"tool_choice": "required"}), "tool_choice"),
            (
                json!({"tool_choice": {"type": "function", "function": {"name": "f"}}}),
                "tool_choice",
            ),
            (json!({"functions": [{"name": "f"}]}), "functions"),
            (json!({"logit_bias": {"50256": -100}}), "logit_bias"),
            (
                json!({"stream_options": {"include_usage": 1}}),
                "stream_options.include_usage",
            ),
        ] {
            let e = parse_generate(&body(bad.clone())).unwrap_err();
            assert_eq!(e.status, StatusCode::BAD_REQUEST, "{bad}");
            assert_eq!(e.param.as_deref(), Some(param), "{bad}: {}", e.message);
        }
    }

    #[test]
    fn logprobs_take_each_api_form() {
        let parse = |v: Value, kind| parse_logprobs(&body(v), kind);
        assert_eq!(parse(json!({}), Kind::Chat).unwrap(), None);
        assert_eq!(
            parse(json!({"logprobs": true}), Kind::Chat).unwrap(),
            Some(0)
        );
        let both = json!({"logprobs": true, "top_logprobs": 20});
        assert_eq!(parse(both, Kind::Chat).unwrap(), Some(20));
        assert_eq!(parse(json!({"logprobs": 3}), Kind::Text).unwrap(), Some(3));
        for (bad, kind, param) in [
            (json!({"top_logprobs": 2}), Kind::Chat, "top_logprobs"),
            (
                json!({"logprobs": true, "top_logprobs": 21}),
                Kind::Chat,
                "top_logprobs",
            ),
            (
                json!({"logprobs": true, "top_logprobs": "3"}),
                Kind::Chat,
                "top_logprobs",
            ),
            (json!({"logprobs": 2}), Kind::Chat, "logprobs"),
            (json!({"logprobs": true}), Kind::Text, "logprobs"),
            (json!({"logprobs": 6}), Kind::Text, "logprobs"),
            (
                json!({"logprobs": 1, "top_logprobs": 1}),
                Kind::Text,
                "top_logprobs",
            ),
        ] {
            let e = parse(bad.clone(), kind).unwrap_err();
            assert_eq!(e.param.as_deref(), Some(param), "{bad}: {}", e.message);
        }
    }

    #[test]
    fn messages_are_checked_with_their_index() {
        let call = |id: &str| {
            json!({"id": id, "type": "function",
                "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}})
        };
        // A call and its two results: the call as the model writes it, the
        // results as one user message.
        let m = parse_messages(&body(json!({"messages": [
            {"role": "user", "content": "Weather?"},
            {"role": "assistant", "content": null, "tool_calls": [call("a"), call("b")]},
            {"role": "tool", "tool_call_id": "a", "content": "sunny"},
            {"role": "tool", "tool_call_id": "b", "content": "rain"},
        ]})))
        .unwrap();
        assert_eq!(m.len(), 3);
        let (_, calls) = crate::tools::parse(&m[1].content);
        assert_eq!(calls.len(), 2);
        assert_eq!(calls[0].arguments, "{\"city\":\"Paris\"}");
        assert_eq!(
            (m[2].role.as_str(), m[2].content.as_str()),
            (
                "user",
                "<tool_response>\nsunny\n</tool_response>\n<tool_response>\nrain\n</tool_response>"
            )
        );
        let m = parse_messages(&body(json!({"messages": [
            {"role": "developer", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "Hi "}, {"type": "text", "text": "there"}]},
        ]})))
        .unwrap();
        assert_eq!(
            (m[0].role.as_str(), m[1].content.as_str()),
            ("system", "Hi there")
        );
        for (bad, param) in [
            (json!({}), "messages"),
            (json!({"messages": []}), "messages"),
            (
                json!({"messages": [{"role": "tool", "content": "x"}]}),
                "messages[0].tool_call_id",
            ),
            (
                json!({"messages": [{"role": "assistant", "content": null, "tool_calls": [call("c1")]},
                    {"role": "tool", "tool_call_id": "c2", "content": "x"}]}),
                "messages[1].tool_call_id",
            ),
            (
                json!({"messages": [{"role": "assistant", "tool_calls": [{"id": "c1"}]}]}),
                "messages[0].tool_calls",
            ),
            (
                json!({"messages": [{"role": "assistant", "tool_calls": [{"id": "c1", "type": "function",
                    "function": {"name": "f", "arguments": "{not json"}}]}]}),
                "messages[0].tool_calls",
            ),
            (
                json!({"messages": [{"role": "user", "content": "x", "tool_calls": [call("c1")]}]}),
                "messages[0]",
            ),
            (
                json!({"messages": [{"role": "wizard", "content": "x"}]}),
                "messages[0]",
            ),
            (json!({"messages": [{"role": "user"}]}), "messages[0]"),
            (
                json!({"messages": [{"role": "user", "content": "a"}, 7]}),
                "messages[1]",
            ),
        ] {
            let e = parse_messages(&body(bad.clone())).unwrap_err();
            assert_eq!(e.param.as_deref(), Some(param), "{bad}: {}", e.message);
        }
    }
}
