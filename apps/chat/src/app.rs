//! The window: model folder, KV cache settings, the conversation, a prompt
//! box with Send and Stop, and a status line with memory and speed.

use std::path::{Path, PathBuf};
use std::sync::mpsc::{Receiver, Sender};
use std::time::Instant;

use eframe::egui;
use sieve::{CancelToken, GenerateOptions, Policy, StopReason};

use crate::log::Log;
use crate::worker::{CacheSettings, Command, Event, Occupancy};

/// What the model thread is doing, as the UI knows it.
enum Phase {
    NoModel,
    Loading {
        done: usize,
        total: usize,
    },
    Idle,
    /// Processing the prompt since `since`: `done` of `total` tokens fed.
    Prefill {
        since: Instant,
        done: usize,
        total: usize,
    },
    /// Streaming the answer: `pieces` pieces since the first one at `since`.
    Decoding {
        since: Instant,
        pieces: usize,
    },
}

struct Turn {
    question: String,
    answer: String,
    /// A note under the answer: how it ended, its speed.
    note: String,
}

pub struct ChatApp {
    commands: Sender<Command>,
    events: Receiver<Event>,
    log: Log,
    phase: Phase,
    model_dir: String,
    /// Model folders found under ./models, for the picker.
    found: Vec<PathBuf>,
    model_name: Option<String>,
    settings: CacheSettings,
    max_new_tokens: usize,
    turns: Vec<Turn>,
    prompt: String,
    cancel: Option<CancelToken>,
    stop_clicked: Option<Instant>,
    /// When each prompt chunk of the current question was done.
    chunk_ends: Vec<Instant>,
    occupancy: Occupancy,
    /// The last generation's speeds (prefill, decode), tokens/s.
    last_speed: Option<(f64, f64)>,
    status: String,
    /// Focus the prompt box on the next frame.
    focus_prompt: bool,
}

impl ChatApp {
    pub fn new(
        commands: Sender<Command>,
        events: Receiver<Event>,
        model: Option<PathBuf>,
        log: Log,
    ) -> Self {
        let found = find_models(Path::new("models"));
        let model_dir = model
            .or_else(|| found.first().cloned())
            .map(|p| p.display().to_string())
            .unwrap_or_default();
        let mut app = ChatApp {
            commands,
            events,
            log,
            phase: Phase::NoModel,
            model_dir,
            found,
            model_name: None,
            settings: CacheSettings {
                policy: Policy::Window,
                budget: 512,
                prefill_chunk: 16,
            },
            max_new_tokens: 256,
            turns: vec![],
            prompt: String::new(),
            cancel: None,
            stop_clicked: None,
            chunk_ends: vec![],
            occupancy: Occupancy::default(),
            last_speed: None,
            status: String::new(),
            focus_prompt: false,
        };
        if !app.model_dir.is_empty() {
            app.load();
        }
        app
    }

    fn busy(&self) -> bool {
        matches!(self.phase, Phase::Prefill { .. } | Phase::Decoding { .. })
    }

    fn load(&mut self) {
        self.phase = Phase::Loading { done: 0, total: 0 };
        self.status = format!("loading {}", self.model_dir);
        self.turns.clear();
        let dir = PathBuf::from(self.model_dir.trim());
        let _ = self
            .commands
            .send(Command::Load(dir, self.settings.clone()));
    }

    fn new_chat(&mut self) {
        self.turns.clear();
        self.last_speed = None;
        let _ = self.commands.send(Command::NewChat(self.settings.clone()));
    }

    fn send_prompt(&mut self) {
        let question = self.prompt.trim().to_string();
        if question.is_empty() || self.busy() || !matches!(self.phase, Phase::Idle) {
            return;
        }
        // Cleared before the command leaves, so a Stop clicked right after
        // Send is not lost (generate never clears the token itself).
        if let Some(cancel) = &self.cancel {
            cancel.reset();
        }
        self.stop_clicked = None;
        let opts = GenerateOptions {
            max_new_tokens: self.max_new_tokens,
            ..Default::default()
        };
        let _ = self.commands.send(Command::Ask(question.clone(), opts));
        self.turns.push(Turn {
            question,
            answer: String::new(),
            note: String::new(),
        });
        self.prompt.clear();
        self.phase = Phase::Prefill {
            since: Instant::now(),
            done: 0,
            total: 0,
        };
        self.chunk_ends.clear();
    }

    fn stop(&mut self) {
        if let (true, Some(cancel)) = (self.busy(), &self.cancel) {
            cancel.cancel();
            self.stop_clicked.get_or_insert_with(Instant::now);
        }
    }

    fn handle(&mut self, event: Event) {
        match event {
            Event::Loading { done, total } => self.phase = Phase::Loading { done, total },
            Event::Ready {
                model,
                cancel,
                occupancy,
            } => {
                self.log.ready(&model, &self.settings);
                self.status.clear();
                self.model_name = Some(model);
                self.cancel = Some(cancel);
                self.occupancy = occupancy;
                self.phase = Phase::Idle;
                self.focus_prompt = true;
            }
            Event::PromptProgress { done, total, at } => {
                if self.chunk_ends.is_empty() {
                    self.log.prompt_started();
                }
                self.chunk_ends.push(at);
                if let Phase::Prefill { since, .. } = self.phase {
                    self.phase = Phase::Prefill { since, done, total };
                }
            }
            Event::Piece(text) => {
                if let Some(turn) = self.turns.last_mut() {
                    turn.answer.push_str(&text);
                }
                self.phase = match self.phase {
                    Phase::Decoding { since, pieces } => Phase::Decoding {
                        since,
                        pieces: pieces + 1,
                    },
                    _ => {
                        self.log.first_piece();
                        Phase::Decoding {
                            since: Instant::now(),
                            pieces: 1,
                        }
                    }
                };
            }
            Event::Finished {
                stop,
                prompt_tokens,
                generated_tokens,
                prefill_seconds,
                decode_seconds,
                returned_at,
                occupancy,
            } => {
                self.occupancy = occupancy;
                let prefill = prompt_tokens as f64 / prefill_seconds.max(1e-9);
                let decode = generated_tokens.saturating_sub(1) as f64 / decode_seconds.max(1e-9);
                self.last_speed = Some((prefill, decode));
                let mut note = format!(
                    "{} · prompt {prompt_tokens} tokens at {prefill:.1} tok/s · {generated_tokens} tokens at {decode:.1} tok/s",
                    stop_words(stop)
                );
                if let (StopReason::Cancelled, Some(clicked)) = (stop, self.stop_clicked) {
                    let ms =
                        |a: Instant, b: Instant| a.saturating_duration_since(b).as_secs_f64() * 1e3;
                    let after_click = ms(returned_at, clicked);
                    note.push_str(&format!(" · stopped {after_click:.0} ms after the click"));
                    // A cancel takes effect when the next prompt chunk or
                    // token is done: measure from that moment (or from the
                    // click, if the click came later).
                    let last_chunk = self.chunk_ends.iter().rev().find(|&&t| t <= returned_at);
                    let after_step =
                        ms(returned_at, last_chunk.map_or(clicked, |&t| t.max(clicked)));
                    // How long one step took: a prompt chunk when stopped
                    // during the prompt, else one token.
                    let step_ms = if generated_tokens == 0 {
                        prefill_seconds * 1e3 / self.chunk_ends.len().max(1) as f64
                    } else {
                        decode_seconds * 1e3 / generated_tokens.max(1) as f64
                    };
                    let steps_after_click = self
                        .chunk_ends
                        .iter()
                        .filter(|&&t| t > clicked && t <= returned_at)
                        .count();
                    let prompt_length = match self.phase {
                        Phase::Prefill { total, .. } => total,
                        _ => prompt_tokens,
                    };
                    self.log.stopped(
                        after_click,
                        after_step,
                        steps_after_click,
                        (prompt_tokens, prompt_length),
                        generated_tokens,
                        step_ms,
                    );
                }
                if let Some(turn) = self.turns.last_mut() {
                    turn.note = note;
                    self.log
                        .answer(&turn.question, &turn.answer, stop, prefill, decode);
                }
                self.phase = Phase::Idle;
                self.focus_prompt = true;
            }
            Event::Error(message) => {
                self.log.error(&message);
                self.status = format!("error: {message}");
                self.phase = if self.model_name.is_some() && self.cancel.is_some() {
                    Phase::Idle
                } else {
                    Phase::NoModel
                };
            }
        }
    }

    fn model_row(&mut self, ui: &mut egui::Ui) {
        ui.horizontal(|ui| {
            ui.label("Model folder");
            ui.add(egui::TextEdit::singleline(&mut self.model_dir).desired_width(320.0));
            let mut picked = None;
            egui::ComboBox::from_id_salt("found-models")
                .selected_text("models/…")
                .show_ui(ui, |ui| {
                    for dir in &self.found {
                        if ui.button(dir.display().to_string()).clicked() {
                            picked = Some(dir.display().to_string());
                        }
                    }
                    if self.found.is_empty() {
                        ui.label("no model folder under ./models");
                    }
                });
            let loading = matches!(self.phase, Phase::Loading { .. });
            let load = ui.add_enabled(!loading && !self.busy(), egui::Button::new("Load"));
            if let Some(dir) = picked {
                self.model_dir = dir;
                self.load();
            } else if load.clicked() {
                self.load();
            }
        });
    }

    fn cache_row(&mut self, ui: &mut egui::Ui) {
        let before = self.settings.clone();
        ui.horizontal(|ui| {
            ui.label("KV cache policy");
            egui::ComboBox::from_id_salt("policy")
                .selected_text(self.settings.policy.name())
                .show_ui(ui, |ui| {
                    for (name, policy) in Policy::ALL {
                        ui.selectable_value(&mut self.settings.policy, policy, name);
                    }
                });
            let bounded = self.settings.policy != Policy::Full;
            ui.label("budget");
            ui.add_enabled(
                bounded,
                egui::DragValue::new(&mut self.settings.budget).range(128..=65536),
            );
            ui.label("prompt chunk");
            ui.add(egui::DragValue::new(&mut self.settings.prefill_chunk).range(1..=512));
            ui.label("max tokens");
            ui.add(egui::DragValue::new(&mut self.max_new_tokens).range(1..=4096));
            let idle = matches!(self.phase, Phase::Idle);
            if ui
                .add_enabled(idle, egui::Button::new("New chat"))
                .clicked()
            {
                self.new_chat();
            }
        });
        // New cache settings take effect with a new conversation.
        if self.settings != before && matches!(self.phase, Phase::Idle) {
            self.new_chat();
        }
    }

    fn status_line(&self, ui: &mut egui::Ui) {
        let mib = |b: u64| b as f64 / (1u64 << 20) as f64;
        let mut parts = vec![];
        match &self.phase {
            Phase::NoModel => parts.push("no model loaded".to_string()),
            Phase::Loading { done, total } => parts.push(format!("loading {done}/{total}")),
            Phase::Idle => {}
            Phase::Prefill { since, done, total } => parts.push(format!(
                "processing the prompt: {done}/{total} tokens ({:.1} s)",
                since.elapsed().as_secs_f64()
            )),
            Phase::Decoding { since, pieces } => {
                let secs = since.elapsed().as_secs_f64().max(1e-3);
                parts.push(format!(
                    "answering: {:.1} tok/s",
                    pieces.saturating_sub(1) as f64 / secs
                ));
            }
        }
        if let Some(m) = self.occupancy.memory {
            parts.push(format!(
                "GPU memory: weights {:.0} MiB + session {:.0} MiB",
                mib(m.weights),
                mib(m.buffers)
            ));
            parts.push(format!(
                "conversation {} tokens, cache {} entries",
                self.occupancy.tokens, self.occupancy.cache_entries
            ));
        }
        if let (Phase::Idle, Some((p, d))) = (&self.phase, self.last_speed) {
            parts.push(format!("last: prompt {p:.1} tok/s, answer {d:.1} tok/s"));
        }
        if !self.status.is_empty() {
            parts.push(self.status.clone());
        }
        ui.label(parts.join("  ·  "));
    }

    fn prompt_row(&mut self, ui: &mut egui::Ui) {
        ui.horizontal(|ui| {
            let width = (ui.available_width() - 140.0).max(100.0);
            let edit = ui.add(
                egui::TextEdit::singleline(&mut self.prompt)
                    .hint_text("Ask something and press Enter")
                    .desired_width(width),
            );
            if self.focus_prompt {
                edit.request_focus();
                self.focus_prompt = false;
            }
            // Enter is handled before the buttons are drawn, so this very
            // frame shows Stop enabled: a frame can wait long behind the
            // model's GPU work on a CPU driver, and a click lands on the
            // buttons as the last frame drew them.
            if edit.lost_focus() && ui.input(|i| i.key_pressed(egui::Key::Enter)) {
                self.send_prompt();
            }
            let idle = matches!(self.phase, Phase::Idle);
            let send = ui.add_enabled(idle, egui::Button::new("Send"));
            let stop = ui.add_enabled(self.busy(), egui::Button::new("Stop"));
            let scale = ui.ctx().pixels_per_point();
            self.log.layout(
                &[
                    ("prompt", edit.rect),
                    ("send", send.rect),
                    ("stop", stop.rect),
                ],
                scale,
            );
            if send.clicked() {
                self.send_prompt();
            }
            if stop.clicked() {
                self.stop();
            }
        });
        if ui.input(|i| i.key_pressed(egui::Key::Escape)) {
            self.stop();
        }
    }
}

impl eframe::App for ChatApp {
    fn ui(&mut self, ui: &mut egui::Ui, _frame: &mut eframe::Frame) {
        while let Ok(event) = self.events.try_recv() {
            self.handle(event);
        }
        egui::Panel::top("settings").show(ui, |ui| {
            ui.add_space(4.0);
            self.model_row(ui);
            self.cache_row(ui);
            ui.add_space(2.0);
        });
        egui::Panel::bottom("prompt").show(ui, |ui| {
            ui.add_space(4.0);
            self.prompt_row(ui);
            self.status_line(ui);
            ui.add_space(2.0);
        });
        egui::CentralPanel::default().show(ui, |ui| {
            egui::ScrollArea::vertical()
                .stick_to_bottom(true)
                .auto_shrink(false)
                .show(ui, |ui| {
                    if self.turns.is_empty() {
                        ui.weak(match &self.model_name {
                            Some(name) => format!("{name}: ask something below."),
                            None => "Pick a model folder (a Hugging Face folder, e.g. one made by `sieve convert-gguf`) and press Load.".into(),
                        });
                    }
                    for turn in &self.turns {
                        ui.label(egui::RichText::new(format!("› {}", turn.question)).strong());
                        ui.label(
                            egui::RichText::new(&turn.answer).color(ui.visuals().strong_text_color()),
                        );
                        if !turn.note.is_empty() {
                            ui.weak(&turn.note);
                        }
                        ui.separator();
                    }
                });
        });
        // The timers in the status line move while the model works.
        if self.busy() {
            ui.ctx()
                .request_repaint_after(std::time::Duration::from_millis(250));
        }
    }
}

fn stop_words(stop: StopReason) -> &'static str {
    match stop {
        StopReason::Eos => "done",
        StopReason::StopString => "stop string",
        StopReason::MaxTokens => "max tokens reached",
        StopReason::Cancelled => "stopped",
        StopReason::ContextFull => "context full",
        StopReason::ConstraintComplete => "done",
    }
}

/// Folders under `root` that hold a model (a config.json), sorted.
fn find_models(root: &Path) -> Vec<PathBuf> {
    let mut found: Vec<PathBuf> = std::fs::read_dir(root)
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.join("config.json").is_file())
        .collect();
    found.sort();
    found
}
