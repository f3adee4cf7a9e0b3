//! Tool calls over OpenAI's API: a request's `tools`, `tool_choice` and
//! `parallel_tool_calls`; the assistant messages that carry earlier calls
//! and the `tool` messages that carry their results (rendered in the Hermes
//! format of `crate::tools`); and the calls of an answer as
//! `message.tool_calls` or streamed `delta.tool_calls` chunks.

use serde_json::{json, Map, Value};

use super::error::ApiError;
use crate::tokenizer::Message;
use crate::tools::{self, Tool, ToolCall, ToolChoice, ToolSet, CALL_CLOSE, CALL_OPEN};

/// The request's tools and choice; None without tools (and with a
/// `tool_choice` that asks for no call). `tool_choice` defaults to "auto"
/// with tools, as OpenAI's.
pub fn parse_tools(body: &Map<String, Value>) -> Result<Option<ToolSet>, ApiError> {
    let bad = |param: &str, what: &str| ApiError::invalid(Some(param), format!("'{param}' {what}"));
    for key in ["functions", "function_call"] {
        if !matches!(body.get(key), None | Some(Value::Null)) {
            return Err(bad(
                key,
                "(OpenAI's older form of tools) is not supported; use 'tools' and 'tool_choice'",
            ));
        }
    }
    let items = match body.get("tools") {
        None | Some(Value::Null) => vec![],
        Some(Value::Array(items)) => items.clone(),
        Some(_) => return Err(bad("tools", "must be a list of tools")),
    };
    let mut list = vec![];
    for (i, item) in items.iter().enumerate() {
        let param = format!("tools[{i}]");
        if item.get("type").and_then(Value::as_str) != Some("function") {
            return Err(bad(
                &param,
                "must be {\"type\": \"function\", \"function\": {...}}",
            ));
        }
        let Some(f) = item.get("function").and_then(Value::as_object) else {
            return Err(bad(&format!("{param}.function"), "must be an object"));
        };
        let name = f.get("name").and_then(Value::as_str).unwrap_or_default();
        let description = match f.get("description") {
            None | Some(Value::Null) => None,
            Some(Value::String(d)) => Some(d.clone()),
            Some(_) => {
                return Err(bad(
                    &format!("{param}.function.description"),
                    "must be a string",
                ))
            }
        };
        let parameters = match f.get("parameters") {
            None | Some(Value::Null) => json!({"type": "object", "properties": {}}),
            Some(p) => p.clone(),
        };
        let tool = Tool {
            name: name.to_string(),
            description,
            parameters,
        };
        if let Err(e) = tool.check() {
            // `check` looks at the name first.
            let name_ok = Tool {
                parameters: json!({}),
                ..tool.clone()
            }
            .check()
            .is_ok();
            let field = if name_ok { "parameters" } else { "name" };
            return Err(bad(
                &format!("{param}.function.{field}"),
                &format!("is refused: {e}"),
            ));
        }
        if list.iter().any(|t: &Tool| t.name == tool.name) {
            return Err(bad(
                &format!("{param}.function.name"),
                "names a tool that is already listed",
            ));
        }
        list.push(tool);
    }
    let choice = match body.get("tool_choice") {
        None | Some(Value::Null) if list.is_empty() => ToolChoice::None,
        None | Some(Value::Null) => ToolChoice::Auto,
        Some(Value::String(c)) if c == "none" => ToolChoice::None,
        Some(Value::String(c)) if c == "auto" => ToolChoice::Auto,
        Some(Value::String(c)) if c == "required" => ToolChoice::Required,
        Some(v @ Value::Object(_)) => {
            let name = (v.get("type").and_then(Value::as_str) == Some("function"))
                .then(|| v.pointer("/function/name").and_then(Value::as_str))
                .flatten();
            match name {
                Some(name) => ToolChoice::Named(name.to_string()),
                None => {
                    return Err(bad(
                        "tool_choice",
                        "must be \"none\", \"auto\", \"required\" or {\"type\": \"function\", \"function\": {\"name\": ...}}",
                    ))
                }
            }
        }
        Some(_) => {
            return Err(bad(
                "tool_choice",
                "must be \"none\", \"auto\", \"required\" or {\"type\": \"function\", \"function\": {\"name\": ...}}",
            ))
        }
    };
    if let ToolChoice::Named(name) = &choice {
        if !list.iter().any(|t| &t.name == name) {
            return Err(bad(
                "tool_choice",
                &format!("names {name:?}, which is not in 'tools'"),
            ));
        }
    }
    if choice == ToolChoice::Required && list.is_empty() {
        return Err(bad(
            "tool_choice",
            "is \"required\" but 'tools' lists no tool",
        ));
    }
    let parallel = match body.get("parallel_tool_calls") {
        None | Some(Value::Null) => true,
        Some(Value::Bool(b)) => *b,
        Some(_) => return Err(bad("parallel_tool_calls", "must be a boolean")),
    };
    Ok((choice != ToolChoice::None).then_some(ToolSet {
        tools: list,
        choice,
        parallel,
    }))
}

/// The calls of an assistant message (`tool_calls`): (id, call) each.
pub fn parse_calls(calls: &Value, param: &str) -> Result<Vec<(String, ToolCall)>, ApiError> {
    let bad = |what: &str| ApiError::invalid(Some(param), format!("'{param}' {what}"));
    let Some(items) = calls.as_array() else {
        return Err(bad("must be a list of tool calls"));
    };
    items
        .iter()
        .map(|c| {
            let id = c.get("id").and_then(Value::as_str);
            let name = c.pointer("/function/name").and_then(Value::as_str);
            let arguments = c.pointer("/function/arguments").and_then(Value::as_str);
            match (id, name, arguments) {
                (Some(id), Some(name), Some(arguments)) => {
                    let parsed: Value = serde_json::from_str(arguments).map_err(|e| {
                        bad(&format!("holds arguments that are not JSON ({e}): {arguments:?}"))
                    })?;
                    Ok((
                        id.to_string(),
                        ToolCall {
                            name: name.to_string(),
                            arguments: parsed.to_string(),
                        },
                    ))
                }
                _ => Err(bad("must hold {\"id\", \"type\": \"function\", \"function\": {\"name\", \"arguments\"}} calls")),
            }
        })
        .collect()
}

/// Adds the tools' system message to `messages` (before the first system
/// message's text, or as a new first message).
pub fn add_system_prompt(messages: &mut Vec<Message>, tools: &ToolSet) {
    let Some(prompt) = tools.system_prompt() else {
        return;
    };
    match messages.first_mut().filter(|m| m.role == "system") {
        Some(system) => system.content = format!("{prompt}\n\n{}", system.content),
        None => messages.insert(0, Message::new("system", &prompt)),
    }
}

/// A call of an answer as OpenAI writes it, with its id.
fn call_json(id: &str, call: &ToolCall) -> Value {
    json!({"id": id, "type": "function",
        "function": {"name": call.name, "arguments": call.arguments}})
}

/// The id of call `index` of response `response_id` (unique per server run).
pub fn call_id(response_id: &str, index: usize) -> String {
    format!("call_{response_id}_{index}")
}

/// The `message` of a whole answer with tools: its text before the calls
/// (null when there is none) and the calls.
pub fn message(response_id: &str, text: &str) -> (Value, bool) {
    let (content, calls) = tools::parse(text);
    if calls.is_empty() {
        return (json!({"role": "assistant", "content": text}), false);
    }
    let calls: Vec<Value> = (calls.iter().enumerate())
        .map(|(i, c)| call_json(&call_id(response_id, i), c))
        .collect();
    (
        json!({"role": "assistant", "content": content, "tool_calls": calls}),
        true,
    )
}

/// Splits a streamed answer into content deltas and calls, as
/// `tools::parse` splits a whole one: text before the first call streams
/// as content (a tail that could start `<tool_call>`, and white space that
/// may precede a call, held back); each call is sent whole once its
/// `</tool_call>` arrives, as one `delta.tool_calls` entry with its id, name
/// and arguments; text after the calls is dropped.
#[derive(Default)]
pub struct ToolStream {
    /// Text received and not yet sent or dropped.
    pending: String,
    /// Calls sent so far.
    calls: usize,
    /// A `<tool_call>` that was not a call was met: the rest is text.
    text_only: bool,
}

/// What a piece of a streamed answer with tools sends.
pub enum Delta {
    Content(String),
    Call(Value),
}

impl ToolStream {
    pub fn push(&mut self, response_id: &str, piece: &str) -> Vec<Delta> {
        self.pending.push_str(piece);
        let mut out = vec![];
        loop {
            if self.text_only {
                out.push(Delta::Content(std::mem::take(&mut self.pending)));
                return out;
            }
            let Some(open) = self.pending.find(CALL_OPEN) else {
                // Hold back what could still become `<tool_call>`.
                let hold = (1..CALL_OPEN.len())
                    .rev()
                    .find(|&n| self.pending.ends_with(&CALL_OPEN[..n]))
                    .unwrap_or(0);
                self.send_before(self.pending.len() - hold, &mut out);
                return out;
            };
            let Some(close) = self.pending[open..].find(CALL_CLOSE) else {
                self.send_before(open, &mut out);
                return out;
            };
            let end = open + close + CALL_CLOSE.len();
            match tools::parse(&self.pending[open..end]).1.into_iter().next() {
                Some(call) => {
                    self.send_before(open, &mut out);
                    let entry = json!({"index": self.calls,
                        "id": call_id(response_id, self.calls), "type": "function",
                        "function": {"name": call.name, "arguments": call.arguments}});
                    out.push(Delta::Call(entry));
                    self.calls += 1;
                    let end =
                        self.pending.find(CALL_CLOSE).expect("still there") + CALL_CLOSE.len();
                    self.pending.drain(..end);
                }
                // Not a call: from here on all is text (as `tools::parse`
                // reads it), unless calls came before.
                None if self.calls == 0 => self.text_only = true,
                None => {
                    self.pending.clear();
                    return out;
                }
            }
        }
    }

    /// Sends `pending[..end]` as content, but its trailing white space
    /// (which may precede a call), and drops what it sent. After a call
    /// nothing is sent.
    fn send_before(&mut self, end: usize, out: &mut Vec<Delta>) {
        let keep = self.pending[..end].trim_end().len();
        let text: String = self.pending.drain(..keep).collect();
        if self.calls == 0 && !text.is_empty() {
            out.push(Delta::Content(text));
        }
    }

    /// The end of the answer: what was held back is content when no call
    /// came.
    pub fn finish(&mut self) -> Vec<Delta> {
        let rest = std::mem::take(&mut self.pending);
        match self.calls == 0 && !rest.is_empty() {
            true => vec![Delta::Content(rest)],
            false => vec![],
        }
    }

    /// Whether any call was sent (the finish reason is then "tool_calls").
    pub fn called(&self) -> bool {
        self.calls > 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// However an answer is cut into pieces, the stream sends the content
    /// and calls the whole answer has.
    #[test]
    fn streamed_calls_are_those_of_the_whole_answer() {
        let call = |name: &str, city: &str| {
            format!("<tool_call>\n{{\"name\": \"{name}\", \"arguments\": {{\"city\": \"{city}\"}}}}\n</tool_call>")
        };
        let answers = [
            format!(
                "Let me check.\n{}\n{}",
                call("a", "Paris"),
                call("b", "Rome")
            ),
            call("a", "Oslo"),
            "No call here, just < and <tool text.  ".to_string(),
            "Broken <tool_call>\n{\"name\": 1}\n</tool_call> then text".to_string(),
            format!("  {}\ntrailing words", call("c", "Lima")),
            "cut <tool_call>\n{\"name\": \"a\"".to_string(),
        ];
        for text in &answers {
            let (whole, _) = message("r", text);
            for size in [1, 2, 3, 5, 7, 64] {
                let mut s = ToolStream::default();
                let mut deltas = vec![];
                let chars: Vec<char> = text.chars().collect();
                for piece in chars.chunks(size) {
                    deltas.extend(s.push("r", &piece.iter().collect::<String>()));
                }
                deltas.extend(s.finish());
                let mut content = String::new();
                let mut calls = vec![];
                for d in deltas {
                    match d {
                        Delta::Content(c) => content.push_str(&c),
                        Delta::Call(mut c) => {
                            c.as_object_mut().unwrap().remove("index");
                            calls.push(c);
                        }
                    }
                }
                let want_content = whole["content"].as_str().unwrap_or("");
                assert_eq!(content, want_content, "{text:?} in pieces of {size}");
                let want_calls = whole.get("tool_calls").cloned().unwrap_or(json!([]));
                assert_eq!(json!(calls), want_calls, "{text:?} in pieces of {size}");
                assert_eq!(s.called(), !calls.is_empty());
            }
        }
    }
}
