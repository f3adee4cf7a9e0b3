//! Progress callbacks: a model upload, a prompt being processed.

use std::sync::Arc;

/// A progress callback called with (done, total):
/// `Progress::new(move |done, total| ...)`. A closure, `Send + Sync`, so it
/// can hold a channel sender or a widget handle.
#[derive(Clone)]
pub struct Progress(Arc<dyn Fn(usize, usize) + Send + Sync>);

impl Progress {
    pub fn new(f: impl Fn(usize, usize) + Send + Sync + 'static) -> Self {
        Progress(Arc::new(f))
    }

    pub(crate) fn report(&self, done: usize, total: usize) {
        (self.0)(done, total)
    }
}

impl std::fmt::Debug for Progress {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Progress(..)")
    }
}
