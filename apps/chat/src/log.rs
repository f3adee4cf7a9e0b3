//! `--log FILE`: what the window shows, one JSON object per line, so that a
//! script driving the window with real input events (scripts/chat-app.sh)
//! can tell where the widgets are and what the answer was.

use std::fs::File;
use std::io::Write;
use std::path::Path;

use eframe::egui::Rect;
use serde_json::{json, Value};
use sieve::StopReason;

use crate::worker::CacheSettings;

#[derive(Default)]
pub struct Log {
    file: Option<File>,
    /// The last widget layout written (it is written again only when it moves).
    layout: Option<Value>,
}

impl Log {
    pub fn create(path: &Path) -> std::io::Result<Log> {
        Ok(Log {
            file: Some(File::create(path)?),
            layout: None,
        })
    }

    fn write(&mut self, value: Value) {
        if let Some(file) = &mut self.file {
            // A full disk should not stop the chat: the log is for scripts.
            let _ = writeln!(file, "{value}").and_then(|_| file.flush());
        }
    }

    /// Widget rectangles in physical pixels of the window: [x, y, w, h].
    pub fn layout(&mut self, widgets: &[(&str, Rect)], pixels_per_point: f32) {
        if self.file.is_none() {
            return;
        }
        let mut map = serde_json::Map::new();
        for (name, r) in widgets {
            let px = |v: f32| (v * pixels_per_point).round() as i64;
            map.insert(
                (*name).into(),
                json!([px(r.min.x), px(r.min.y), px(r.width()), px(r.height())]),
            );
        }
        let value = Value::Object(map);
        if self.layout.as_ref() != Some(&value) {
            self.layout = Some(value.clone());
            self.write(json!({"event": "layout", "widgets": value}));
        }
    }

    pub fn ready(&mut self, model: &str, settings: &CacheSettings) {
        self.write(json!({
            "event": "ready",
            "model": model,
            "policy": settings.policy.name(),
            "budget": settings.budget,
            "prefill_chunk": settings.prefill_chunk,
        }));
    }

    pub fn answer(
        &mut self,
        question: &str,
        answer: &str,
        stop: StopReason,
        prefill: f64,
        decode: f64,
    ) {
        self.write(json!({
            "event": "answer",
            "question": question,
            "answer": answer,
            "stop": format!("{stop:?}"),
            "prefill_tokens_per_second": prefill,
            "decode_tokens_per_second": decode,
        }));
    }

    /// The first prompt chunk of a question is done.
    pub fn prompt_started(&mut self) {
        self.write(json!({"event": "prompt_started"}));
    }

    /// The first piece of an answer: the prompt is done.
    pub fn first_piece(&mut self) {
        self.write(json!({"event": "first_piece"}));
    }

    /// A generation stopped by the Stop button (or Escape): milliseconds
    /// from the click to the return of `chat`, and from the end of the step
    /// (prompt chunk or token) that saw the cancel, or the click if later.
    pub fn stopped(
        &mut self,
        click_to_return_ms: f64,
        step_to_return_ms: f64,
        prompt_chunks_after_click: usize,
        (prompt_tokens_fed, prompt_length): (usize, usize),
        generated_tokens: usize,
        step_ms: f64,
    ) {
        self.write(json!({
            "event": "stopped",
            "click_to_return_ms": click_to_return_ms,
            "step_to_return_ms": step_to_return_ms,
            // Prompt chunks that ended between the click and the return: the
            // cancel is seen at the first, so at most 1.
            "prompt_chunks_after_click": prompt_chunks_after_click,
            "prompt_tokens_fed": prompt_tokens_fed,
            "prompt_length": prompt_length,
            "generated_tokens": generated_tokens,
            // One prompt chunk (stopped during the prompt) or one token.
            "step_ms": step_ms,
        }));
    }

    pub fn error(&mut self, message: &str) {
        self.write(json!({"event": "error", "message": message}));
    }
}
