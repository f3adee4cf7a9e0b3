//! Tool calls in the Hermes format (NousResearch's Hermes 2 Pro, which
//! Qwen 2.5 and many fine-tunes follow): the tools are described to the
//! model in a system message, `<tools>` followed by their JSON signatures;
//! the model calls one by writing
//!
//! ```text
//! <tool_call>
//! {"name": "get_weather", "arguments": {"city": "Paris"}}
//! </tool_call>
//! ```
//!
//! and a tool's result comes back as `<tool_response>` text. A grammar
//! ([`ToolSet::constraint`]) makes every call valid: the name one of the
//! tools', the arguments valid under its parameter schema. With
//! [`ToolChoice::Auto`] the model may answer in text instead; the grammar
//! only takes over once it writes `<tool_call>` (llguidance's lazy rule).
//! [`parse`] reads the calls back out of the text.

use anyhow::{bail, Result};
use serde_json::{json, Value};

use crate::constraint::Constraint;

/// The text that opens a call, and the one that closes it.
pub const CALL_OPEN: &str = "<tool_call>";
pub const CALL_CLOSE: &str = "</tool_call>";

/// A function the model may call.
#[derive(Clone, Debug, PartialEq)]
pub struct Tool {
    pub name: String,
    pub description: Option<String>,
    /// A JSON schema of the arguments (an object).
    pub parameters: Value,
}

/// Whether and how the model must call a tool.
#[derive(Clone, Debug, PartialEq)]
pub enum ToolChoice {
    /// No call: the tools are not shown to the model.
    None,
    /// Text or calls, as the model chooses.
    Auto,
    /// One call or more, and no text.
    Required,
    /// A call of this tool, and no text.
    Named(String),
}

/// The tools of a request and the choice.
#[derive(Clone, Debug)]
pub struct ToolSet {
    pub tools: Vec<Tool>,
    pub choice: ToolChoice,
    /// Whether several calls may come in one answer.
    pub parallel: bool,
}

/// A call the model made.
#[derive(Clone, Debug, PartialEq)]
pub struct ToolCall {
    pub name: String,
    /// The arguments as compact JSON text (OpenAI's `function.arguments`).
    pub arguments: String,
}

impl Tool {
    /// Refuses a name OpenAI would refuse and parameters that are not an
    /// object schema.
    pub fn check(&self) -> Result<()> {
        let ok = (1..=64).contains(&self.name.len())
            && (self.name.chars()).all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-');
        if !ok {
            bail!(
                "the name {:?} is not 1 to 64 letters, digits, '_' or '-'",
                self.name
            );
        }
        if !self.parameters.is_object() {
            bail!(
                "the parameters of {} are not a JSON schema object",
                self.name
            );
        }
        Ok(())
    }

    /// Its signature as the system message shows it (OpenAI's tool object).
    fn signature(&self) -> Value {
        let mut f = json!({"name": self.name, "parameters": self.parameters});
        if let Some(d) = &self.description {
            f["description"] = json!(d);
        }
        json!({"type": "function", "function": f})
    }

    /// The schema of one call of this tool: `{"name": NAME, "arguments": {...}}`.
    pub fn call_schema(&self) -> Value {
        json!({
            "type": "object",
            "properties": {"name": {"const": self.name}, "arguments": self.parameters},
            "required": ["name", "arguments"],
            "additionalProperties": false,
        })
    }
}

impl ToolSet {
    /// The tools the model may call under the choice (a named choice: that
    /// one; none: no tool).
    fn callable(&self) -> Vec<&Tool> {
        match &self.choice {
            ToolChoice::None => vec![],
            ToolChoice::Named(name) => self.tools.iter().filter(|t| &t.name == name).collect(),
            ToolChoice::Auto | ToolChoice::Required => self.tools.iter().collect(),
        }
    }

    /// The system message that describes the tools (Hermes 2 Pro's), or
    /// None when no tool may be called.
    pub fn system_prompt(&self) -> Option<String> {
        let tools = self.callable();
        if tools.is_empty() {
            return None;
        }
        let signatures: Vec<String> = tools.iter().map(|t| t.signature().to_string()).collect();
        Some(format!(
            "You are a function calling AI model. You are provided with function signatures within <tools></tools> XML tags. You may call one or more functions to assist with the user query. Don't make assumptions about what values to plug into functions. Here are the available tools: <tools>\n{}\n</tools>\nFor each function call, return a json object with function name and arguments within {CALL_OPEN}{CALL_CLOSE} XML tags as follows:\n{CALL_OPEN}\n{{\"name\": <function-name>, \"arguments\": <args-json-object>}}\n{CALL_CLOSE}",
            signatures.join("\n")
        ))
    }

    /// The grammar the answer follows: None for `ToolChoice::None`;
    /// calls only (one, or several when parallel) for a required or named
    /// choice; for `Auto` text with calls (free text until the model writes
    /// `<tool_call>`, then a valid call; one at most unless parallel, and
    /// no `<tool_call>` in the text that follows).
    pub fn constraint(&self) -> Option<Constraint> {
        let tools = self.callable();
        if tools.is_empty() {
            return None;
        }
        let mut g = String::new();
        let names: Vec<String> = (0..tools.len()).map(|i| format!("tool_{i}")).collect();
        match self.choice {
            ToolChoice::Auto => {
                let many = if self.parallel { "*" } else { "?" };
                // Text, with a valid call wherever `<tool_call>` is
                // written: the text after the last call (or all of it)
                // never holds `<tool_call>`, so every one is a call.
                g += &format!("start: tool_call{many} TAIL\n");
                g += &format!(
                    "tool_call: lead \"\\n\" ({}) \"\\n{CALL_CLOSE}\"\n",
                    names.join(" | ")
                );
                g += &format!("lead[lazy]: TEXT \"{CALL_OPEN}\"\n");
                g += "TEXT: /(.|\\n)*/\n";
                g += &format!("TAIL: /(.|\\n)*/ & ~/(.|\\n)*{CALL_OPEN}(.|\\n)*/\n");
            }
            _ => {
                let more = if self.parallel {
                    " (\"\\n\" tool_call)*"
                } else {
                    ""
                };
                g += &format!("start: tool_call{more}\n");
                g += &format!(
                    "tool_call: \"{CALL_OPEN}\\n\" ({}) \"\\n{CALL_CLOSE}\"\n",
                    names.join(" | ")
                );
            }
        }
        for (name, tool) in names.iter().zip(&tools) {
            let mut schema = tool.call_schema();
            crate::constraint::bound_integers(&mut schema);
            schema["x-guidance"] = crate::constraint::json_options();
            g += &format!("{name}: %json {schema}\n");
        }
        Some(Constraint::Grammar(g))
    }
}

/// The calls in a model's answer, and the text before the first one (its
/// trailing white space dropped; None when nothing is left). Without calls
/// the text is returned whole. Text after the last call is dropped
/// (Hermes models end their turn there). A `<tool_call>` whose JSON does
/// not parse as `{"name", "arguments"}` and all after it stay text.
pub fn parse(text: &str) -> (Option<String>, Vec<ToolCall>) {
    let mut calls = vec![];
    let mut content_end = text.len();
    let mut rest = text;
    let mut offset = 0;
    while let Some(open) = rest.find(CALL_OPEN) {
        let body_start = open + CALL_OPEN.len();
        let Some(close) = rest[body_start..].find(CALL_CLOSE) else {
            break;
        };
        let body = rest[body_start..body_start + close].trim();
        let call = serde_json::from_str::<Value>(body).ok().and_then(|v| {
            let name = v.get("name")?.as_str()?.to_string();
            let arguments = v.get("arguments").filter(|a| a.is_object())?.to_string();
            Some(ToolCall { name, arguments })
        });
        let Some(call) = call else { break };
        if calls.is_empty() {
            content_end = offset + open;
        }
        calls.push(call);
        let consumed = body_start + close + CALL_CLOSE.len();
        offset += consumed;
        rest = &rest[consumed..];
    }
    if calls.is_empty() {
        return ((!text.is_empty()).then(|| text.to_string()), calls);
    }
    let content = text[..content_end].trim_end();
    let content = (!content.is_empty()).then(|| content.to_string());
    (content, calls)
}

/// An assistant message's calls as the model writes them (to render an
/// earlier turn of the conversation back into the prompt).
pub fn render_calls(content: Option<&str>, calls: &[ToolCall]) -> String {
    let mut out = content.map(|c| format!("{c}\n")).unwrap_or_default();
    let parts: Vec<String> = calls
        .iter()
        .map(|c| {
            let arguments: Value = serde_json::from_str(&c.arguments).unwrap_or(json!({}));
            let call = json!({"name": c.name, "arguments": arguments});
            format!("{CALL_OPEN}\n{call}\n{CALL_CLOSE}")
        })
        .collect();
    out += &parts.join("\n");
    out
}

/// A tool's result as the model reads it.
pub fn render_response(content: &str) -> String {
    format!("<tool_response>\n{content}\n</tool_response>")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn calls_are_read_back_and_bad_ones_stay_text() {
        let text = "Let me look.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>\n<tool_call>\n{\"name\": \"time\", \"arguments\": {}}\n</tool_call>";
        let (content, calls) = parse(text);
        assert_eq!(content.as_deref(), Some("Let me look."));
        assert_eq!(
            calls,
            [
                ToolCall {
                    name: "get_weather".into(),
                    arguments: "{\"city\":\"Paris\"}".into()
                },
                ToolCall {
                    name: "time".into(),
                    arguments: "{}".into()
                }
            ]
        );
        assert_eq!(parse("just text "), (Some("just text ".into()), vec![]));
        let broken = "<tool_call>\n{\"name\": 3}\n</tool_call>";
        assert_eq!(parse(broken), (Some(broken.into()), vec![]));
        let unclosed = "<tool_call>\n{\"name\": \"f\", \"arguments\": {}}";
        assert_eq!(parse(unclosed).1, vec![]);
        // Rendered back, a call parses to itself.
        let (_, again) = parse(&render_calls(Some("x"), &calls));
        assert_eq!(again, calls);
    }

    #[test]
    fn names_and_parameters_are_checked() {
        let tool = |name: &str, parameters: Value| Tool {
            name: name.into(),
            description: None,
            parameters,
        };
        tool("get_weather-2", json!({"type": "object"}))
            .check()
            .unwrap();
        assert!(tool("", json!({})).check().is_err());
        assert!(tool("has space", json!({})).check().is_err());
        assert!(tool(&"x".repeat(65), json!({})).check().is_err());
        assert!(tool("f", json!([1])).check().is_err());
    }
}
