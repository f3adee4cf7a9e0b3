//! Waiting for the GPU, the main thing that differs between native code and
//! the browser (wasm32 on WebGPU; the others: the adapter's choice and the
//! shader text, in src/gpu.rs), and where what sieve keeps between runs
//! (the tuner's timings) lives: files natively, the page's localStorage in
//! a browser.
//!
//! Native code blocks: `pollster::block_on` for wgpu's futures (adapters,
//! devices, error scopes) and `Device::poll` for submitted work and buffer
//! maps. A browser page cannot block its thread, and a buffer map completes
//! only when the page's event loop runs. There sieve suspends instead,
//! through JavaScript Promise Integration (JSPI): `yield_to_browser` is a
//! `WebAssembly.Suspending` import (the page's `sieve_jspi` module,
//! web/jspi.js) that returns to the event loop and resumes the wasm stack a
//! moment later. So the library's synchronous code (a session's steps, the
//! cache's refreshes) runs unchanged in the browser, when its entry point is
//! called through `WebAssembly.promising`; nothing is duplicated into an
//! async second engine.

use anyhow::{anyhow, Result};
use std::future::Future;
use std::path::Path;
use std::sync::mpsc::Receiver;

/// Runs a future to its end: blocking (native), or suspending to the
/// browser until it is ready (wasm32).
#[cfg(not(target_arch = "wasm32"))]
pub fn block_on<F: Future>(f: F) -> F::Output {
    pollster::block_on(f)
}

/// Waits for the GPU to finish `submission` (None: everything submitted).
#[cfg(not(target_arch = "wasm32"))]
pub fn wait_for_gpu(
    device: &wgpu::Device,
    _queue: &wgpu::Queue,
    submission: Option<wgpu::SubmissionIndex>,
) -> Result<()> {
    device
        .poll(wgpu::PollType::Wait {
            submission_index: submission,
            timeout: None,
        })
        .map(|_| ())
        .map_err(|e| anyhow!("waiting for the GPU: {e}"))
}

/// The value a wgpu callback (a buffer map's) sends on `rx`, once the GPU
/// has finished `submission`.
#[cfg(not(target_arch = "wasm32"))]
pub fn recv_after<T>(
    device: &wgpu::Device,
    queue: &wgpu::Queue,
    submission: Option<wgpu::SubmissionIndex>,
    rx: &Receiver<T>,
) -> Result<T> {
    wait_for_gpu(device, queue, submission)?;
    // A wait for one submission runs the callbacks it made ready, which
    // includes a map of a buffer last used there; should the callback still
    // be pending, waiting for everything is correct too.
    match rx.try_recv() {
        Ok(v) => Ok(v),
        Err(_) => {
            wait_for_gpu(device, queue, None)?;
            rx.recv().map_err(|_| anyhow!("a GPU callback was dropped"))
        }
    }
}

#[cfg(target_arch = "wasm32")]
mod browser {
    #[link(wasm_import_module = "sieve_jspi")]
    extern "C" {
        /// Suspends this wasm stack, lets the browser's event loop run
        /// (WebGPU's promises settle), and resumes (web/jspi.js).
        fn yield_to_browser();
    }

    pub fn yield_now() {
        // SAFETY: an import without arguments or result; it only suspends
        // and resumes this stack.
        unsafe { yield_to_browser() }
    }

    /// The page's localStorage.
    pub fn storage() -> anyhow::Result<web_sys::Storage> {
        web_sys::window()
            .ok_or_else(|| anyhow::anyhow!("no window (a worker?)"))?
            .local_storage()
            .ok()
            .flatten()
            .ok_or_else(|| anyhow::anyhow!("this page has no localStorage"))
    }
}

/// Lets the browser's event loop run once (a repaint, a click) during long
/// work that has no GPU wait to do it, such as a model's upload; nothing
/// natively.
pub fn let_browser_run() {
    #[cfg(target_arch = "wasm32")]
    browser::yield_now();
}

#[cfg(target_arch = "wasm32")]
pub fn block_on<F: Future>(f: F) -> F::Output {
    use std::task::{Context, Poll, Waker};
    let mut f = std::pin::pin!(f);
    let mut cx = Context::from_waker(Waker::noop());
    loop {
        if let Poll::Ready(v) = f.as_mut().poll(&mut cx) {
            return v;
        }
        browser::yield_now();
    }
}

#[cfg(target_arch = "wasm32")]
pub fn wait_for_gpu(
    _device: &wgpu::Device,
    queue: &wgpu::Queue,
    _submission: Option<wgpu::SubmissionIndex>,
) -> Result<()> {
    // WebGPU tells when everything submitted so far is done (not one
    // submission): later work is waited for too.
    let (tx, rx) = std::sync::mpsc::channel();
    queue.on_submitted_work_done(move || {
        let _ = tx.send(());
    });
    recv_ready(&rx)
}

#[cfg(target_arch = "wasm32")]
pub fn recv_after<T>(
    _device: &wgpu::Device,
    _queue: &wgpu::Queue,
    _submission: Option<wgpu::SubmissionIndex>,
    rx: &Receiver<T>,
) -> Result<T> {
    recv_ready(rx)
}

#[cfg(target_arch = "wasm32")]
fn recv_ready<T>(rx: &Receiver<T>) -> Result<T> {
    use std::sync::mpsc::TryRecvError;
    loop {
        match rx.try_recv() {
            Ok(v) => return Ok(v),
            Err(TryRecvError::Empty) => browser::yield_now(),
            Err(TryRecvError::Disconnected) => return Err(anyhow!("a GPU callback was dropped")),
        }
    }
}

/// What sieve kept at `path` between runs (the tuner's timings), None where
/// nothing is (or it cannot be read). Natively a file; in a browser the
/// page's localStorage item named `path`.
pub fn read_kept(path: &Path) -> Option<Vec<u8>> {
    #[cfg(not(target_arch = "wasm32"))]
    return std::fs::read(path).ok();
    #[cfg(target_arch = "wasm32")]
    return browser::storage()
        .ok()?
        .get_item(&path.to_string_lossy())
        .ok()?
        .map(String::into_bytes);
}

/// Keeps `bytes` (UTF-8 text: JSON) at `path` for later runs: natively
/// written atomically, its folder made; in a browser a localStorage item.
pub fn write_kept(path: &Path, bytes: &[u8]) -> Result<()> {
    #[cfg(not(target_arch = "wasm32"))]
    {
        use anyhow::Context;
        std::fs::create_dir_all(path.parent().unwrap_or(Path::new(".")))
            .context("creating its folder")?;
        crate::files::write_atomic(path, bytes)
    }
    #[cfg(target_arch = "wasm32")]
    {
        let text = std::str::from_utf8(bytes).map_err(|e| anyhow!("not text: {e}"))?;
        browser::storage()?
            .set_item(&path.to_string_lossy(), text)
            .map_err(|e| anyhow!("localStorage refused it ({e:?}): full?"))
    }
}

/// Forgets what was kept at `path` (a missing one is no error).
pub fn remove_kept(path: &Path) -> Result<()> {
    #[cfg(not(target_arch = "wasm32"))]
    return match std::fs::remove_file(path) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
            Err(anyhow!("removing {}: {e}", path.display()))
        }
        _ => Ok(()),
    };
    #[cfg(target_arch = "wasm32")]
    return browser::storage()?
        .remove_item(&path.to_string_lossy())
        .map_err(|e| anyhow!("localStorage: {e:?}"));
}
