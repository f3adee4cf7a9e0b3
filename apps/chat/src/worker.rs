//! The model thread: owns the loaded model and the chat session, so the UI
//! thread never waits on the GPU. The UI sends [`Command`]s and reads
//! [`Event`]s; each event asks egui for a repaint.

use std::path::PathBuf;
use std::sync::mpsc::{Receiver, Sender};
use std::sync::Arc;
use std::time::Instant;

use sieve::gpu::Gpu;
use sieve::{
    CacheOptions, CancelToken, GenerateOptions, Llm, LoadOptions, MemoryReport, Policy, Progress,
    Session, SessionOptions, StopReason,
};

/// How the session is made: the KV cache policy and its budget.
#[derive(Clone, Debug, PartialEq)]
pub struct CacheSettings {
    pub policy: Policy,
    /// J, entries kept after each refresh (ignored by `full`).
    pub budget: usize,
    /// Tokens per prompt chunk: a stop is seen between chunks, so smaller
    /// chunks stop sooner (and process the prompt a little slower).
    pub prefill_chunk: usize,
}

impl CacheSettings {
    fn session_options(&self) -> SessionOptions {
        let cache = (self.policy != Policy::Full)
            .then(|| CacheOptions::new(self.policy, self.budget, self.prefill_chunk));
        SessionOptions {
            max_context: 0,
            prefill_chunk: self.prefill_chunk,
            cache,
        }
    }
}

pub enum Command {
    Load(PathBuf, CacheSettings),
    /// A new, empty conversation with these settings.
    NewChat(CacheSettings),
    Ask(String, GenerateOptions),
}

/// What the session holds after a turn.
#[derive(Clone, Copy, Debug, Default)]
pub struct Occupancy {
    pub memory: Option<MemoryReport>,
    /// Tokens of the conversation so far.
    pub tokens: usize,
    /// Entries the KV cache holds now (at most budget + chunk when bounded).
    pub cache_entries: usize,
}

pub enum Event {
    Loading {
        done: usize,
        total: usize,
    },
    /// A session is ready; its cancel token lets the UI stop a generation.
    Ready {
        model: String,
        cancel: CancelToken,
        occupancy: Occupancy,
    },
    /// The prompt is being processed: `done` of `total` tokens fed at `at`
    /// (a cancel takes effect at these moments).
    PromptProgress {
        done: usize,
        total: usize,
        at: Instant,
    },
    Piece(String),
    Finished {
        stop: StopReason,
        /// Prompt tokens fed (fewer than the prompt's when stopped during it).
        prompt_tokens: usize,
        generated_tokens: usize,
        prefill_seconds: f64,
        decode_seconds: f64,
        /// When `chat` returned: the UI measures a stop from its click.
        returned_at: Instant,
        occupancy: Occupancy,
    },
    Error(String),
}

/// Starts the model thread on `gpu` (the device egui renders with);
/// `repaint` wakes the UI after each event.
pub fn spawn(
    gpu: Arc<Gpu>,
    repaint: impl Fn() + Send + Sync + 'static,
) -> (Sender<Command>, Receiver<Event>) {
    let (commands, command_rx) = std::sync::mpsc::channel::<Command>();
    let (events_tx, events) = std::sync::mpsc::channel::<Event>();
    let mut worker = Worker {
        gpu,
        events: events_tx,
        repaint: Arc::new(repaint),
        llm: None,
        session: None,
    };
    std::thread::Builder::new()
        .name("sieve-model".into())
        .spawn(move || {
            for command in command_rx {
                if let Err(e) = worker.run(command) {
                    worker.send(Event::Error(e.to_string()));
                }
            }
        })
        .expect("spawning the model thread");
    (commands, events)
}

struct Worker {
    gpu: Arc<Gpu>,
    events: Sender<Event>,
    repaint: Arc<dyn Fn() + Send + Sync>,
    llm: Option<(Llm, String)>,
    session: Option<Session>,
}

impl Worker {
    fn send(&self, event: Event) {
        // An error means the window closed: nothing left to tell.
        let _ = self.events.send(event);
        (self.repaint)();
    }

    fn run(&mut self, command: Command) -> sieve::Result<()> {
        match command {
            Command::Load(dir, settings) => {
                self.session = None;
                self.llm = None;
                let (events, repaint) = (self.events.clone(), self.repaint.clone());
                let opts = LoadOptions {
                    progress: Some(Progress::new(move |done, total| {
                        let _ = events.send(Event::Loading { done, total });
                        repaint();
                    })),
                    ..Default::default()
                };
                let llm = Llm::load_on(self.gpu.clone(), &dir, &opts)?;
                let name = dir
                    .file_name()
                    .map(|n| n.to_string_lossy().into_owned())
                    .unwrap_or_else(|| dir.display().to_string());
                self.llm = Some((llm, name));
                self.new_chat(&settings)
            }
            Command::NewChat(settings) => self.new_chat(&settings),
            Command::Ask(text, opts) => {
                let Some(mut session) = self.session.take() else {
                    self.send(Event::Error("load a model first".into()));
                    return Ok(());
                };
                let result = self.ask(&mut session, &text, &opts);
                self.session = Some(session);
                result
            }
        }
    }

    fn ask(&self, session: &mut Session, text: &str, opts: &GenerateOptions) -> sieve::Result<()> {
        let (events, repaint) = (self.events.clone(), self.repaint.clone());
        let opts = GenerateOptions {
            on_prompt: Some(Progress::new(move |done, total| {
                let at = Instant::now();
                let _ = events.send(Event::PromptProgress { done, total, at });
                repaint();
            })),
            ..opts.clone()
        };
        let out = session.chat(text, &opts, |piece| {
            self.send(Event::Piece(piece.to_string()));
            true
        })?;
        let returned_at = Instant::now();
        let s = out.stats;
        self.send(Event::Finished {
            stop: s.stop,
            prompt_tokens: s.prompt_tokens,
            generated_tokens: s.generated_tokens,
            prefill_seconds: s.prefill_seconds,
            decode_seconds: s.decode_seconds,
            returned_at,
            occupancy: occupancy(session),
        });
        Ok(())
    }

    fn new_chat(&mut self, settings: &CacheSettings) -> sieve::Result<()> {
        self.session = None; // frees the old cache first
        let Some((llm, name)) = &self.llm else {
            return Ok(());
        };
        let mut session = llm.session(settings.session_options())?;
        self.send(Event::Ready {
            model: name.clone(),
            cancel: session.cancel_token(),
            occupancy: occupancy(&mut session),
        });
        self.session = Some(session);
        Ok(())
    }
}

fn occupancy(session: &mut Session) -> Occupancy {
    Occupancy {
        memory: Some(session.memory()),
        tokens: session.tokens().len(),
        cache_entries: session.cache().slots.len(),
    }
}
