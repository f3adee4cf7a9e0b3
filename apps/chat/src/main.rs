//! sieve-chat: a desktop chat window on the sieve library.
//!
//! egui draws with wgpu, and sieve runs its compute shaders on the very same
//! wgpu device (`Gpu::from_wgpu`): one device, one queue, no copy between
//! two. The device is opened with the descriptor sieve asks for
//! (`sieve::gpu::device_descriptor`: the adapter's limits and features), so
//! sieve's kernels run as fast there as in the command line. The model and
//! the conversation live on a thread of their own (worker.rs); the window
//! only sends commands and shows events.
//!
//! Usage: sieve-chat [--model DIR] [--log FILE]

mod app;
mod log;
mod worker;

use std::path::PathBuf;
use std::sync::Arc;

use eframe::egui;
use eframe::egui_wgpu::{WgpuConfiguration, WgpuSetup, WgpuSetupCreateNew};

struct Args {
    model: Option<PathBuf>,
    log: Option<PathBuf>,
}

fn parse_args() -> Result<Args, String> {
    let mut args = Args {
        model: None,
        log: None,
    };
    let mut it = std::env::args_os().skip(1);
    while let Some(arg) = it.next() {
        let mut value = |name: &str| {
            it.next()
                .map(PathBuf::from)
                .ok_or_else(|| format!("{name} needs a value"))
        };
        match arg.to_str() {
            Some("--model") => args.model = Some(value("--model")?),
            Some("--log") => args.log = Some(value("--log")?),
            Some("-h" | "--help") => {
                println!(
                    "sieve-chat: a chat window on the sieve library\n\n\
                     Usage: sieve-chat [--model DIR] [--log FILE]\n\n\
                     --model DIR  a Hugging Face model folder (default: the first folder under ./models)\n\
                     --log FILE   write what the window shows as JSON lines (for scripts)"
                );
                std::process::exit(0);
            }
            _ => return Err(format!("unknown argument {arg:?} (try --help)")),
        }
    }
    Ok(args)
}

fn main() {
    let args = match parse_args() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("sieve-chat: {e}");
            std::process::exit(2);
        }
    };
    let log = match &args.log {
        Some(path) => match log::Log::create(path) {
            Ok(l) => l,
            Err(e) => {
                eprintln!(
                    "sieve-chat: cannot create the log file {}: {e}",
                    path.display()
                );
                std::process::exit(2);
            }
        },
        None => log::Log::default(),
    };
    let options = eframe::NativeOptions {
        viewport: egui::ViewportBuilder::default()
            .with_title("sieve chat")
            .with_inner_size([960.0, 640.0]),
        renderer: eframe::Renderer::Wgpu,
        wgpu_options: WgpuConfiguration {
            wgpu_setup: WgpuSetup::CreateNew(WgpuSetupCreateNew {
                // The device sieve wants: egui's needs are within it.
                device_descriptor: Arc::new(sieve::gpu::device_descriptor),
                ..WgpuSetupCreateNew::without_display_handle()
            }),
            ..Default::default()
        },
        ..Default::default()
    };
    let model = args.model;
    let result = eframe::run_native(
        "sieve chat",
        options,
        Box::new(move |cc| {
            let render = cc
                .wgpu_render_state
                .as_ref()
                .ok_or("eframe started without its wgpu renderer")?;
            // sieve on egui's own device and queue.
            let gpu = sieve::gpu::Gpu::from_wgpu(
                &render.adapter,
                render.device.clone(),
                render.queue.clone(),
                None,
            )?;
            let ctx = cc.egui_ctx.clone();
            let (commands, events) = worker::spawn(gpu, move || ctx.request_repaint());
            Ok(Box::new(app::ChatApp::new(commands, events, model, log)))
        }),
    );
    if let Err(e) = result {
        eprintln!("sieve-chat: {e}");
        std::process::exit(1);
    }
}
