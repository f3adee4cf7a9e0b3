//! Waiting for the GPU, the main thing that differs between native code and
//! the browser (wasm32 on WebGPU; the others: the adapter's choice and the
//! shader text, in src/gpu.rs).
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
