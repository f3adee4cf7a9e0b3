//! Kernel micro-benchmarks on the shapes of SmolLM2-135M: `cargo bench`.
//! Prints milliseconds per call (median of 5 after a warm-up) side by side, so
//! kernel variants can be compared in one run on a noisy machine.

use sieve::formats::WeightFormat;
use sieve::gpu::{Gpu, GpuOptions};
use sieve::kernels::attention::{Attention, KEY_CHUNK};
use sieve::kernels::matmul::{Matmul, MatmulOptions};
use sieve::kernels::paging::SlotPages;
use sieve::kernels::rope_kv::Heads;
use sieve::kernels::runtime::Runtime;
use sieve::kernels::{Rows, Step};
use sieve::weights::GpuMatrix;
use std::time::Instant;

fn time(gpu: &Gpu, mut f: impl FnMut(&mut wgpu::ComputePass)) -> f64 {
    let mut samples = vec![];
    for i in 0..6 {
        let mut enc = gpu.device.create_command_encoder(&Default::default());
        {
            let mut pass = enc.begin_compute_pass(&Default::default());
            f(&mut pass);
        }
        let t = Instant::now();
        gpu.queue.submit([enc.finish()]);
        gpu.device
            .poll(wgpu::PollType::wait_indefinitely())
            .unwrap();
        if i > 0 {
            samples.push(t.elapsed().as_secs_f64() * 1e3);
        }
    }
    samples.sort_by(|a, b| a.partial_cmp(b).unwrap());
    samples[samples.len() / 2]
}

fn main() {
    let gpu = Runtime::open(&GpuOptions::default()).unwrap();
    println!("adapter: {}", gpu.describe());
    println!("| kernel | shape | ms | GB/s of weights |");
    println!("|---|---|---|---|");
    for &(rows, cols) in &[(576, 576), (1536 * 2, 576), (576, 1536), (49152, 576)] {
        let w = GpuMatrix::new(&gpu, "w", rows, cols, WeightFormat::F16).unwrap();
        for n in [1usize, 128] {
            let step = gpu.uniform(
                "step",
                &Step {
                    n_tokens: n as u32,
                    ..Default::default()
                },
            );
            let x = gpu.storage("x", (n * cols * 4) as u64);
            let y = gpu.storage("y", (n * rows * 4) as u64);
            let opts = MatmulOptions {
                accumulate: false,
                rows: Rows::Tokens,
            };
            let mm = Matmul::new(&gpu, &step, &w, None, &x, &y, opts).unwrap();
            let ms = time(&gpu, |p| mm.encode(p, n as u32));
            let gbs = w.bytes() as f64 / (ms * 1e-3) / 1e9;
            println!(
                "| {} | {rows}x{cols}, n={n} | {ms:.2} | {gbs:.2} |",
                if n == 1 { "matvec" } else { "matmul" }
            );
        }
    }
    let heads = Heads {
        n_heads: 9,
        n_kv: 3,
        head_dim: 64,
        kv_format: sieve::formats::KvFormat::F32,
    };
    for &(n, depth) in &[(1usize, 1024usize), (1, 4096), (128, 0), (128, 4096)] {
        let slots = depth + n;
        let step = gpu.uniform(
            "step",
            &Step {
                n_tokens: n as u32,
                start_slot: depth as u32,
                ..Default::default()
            },
        );
        let q = gpu.storage("q", (n * 9 * 64 * 4) as u64);
        let row = heads.kv_row_bytes();
        let k = SlotPages::new(&gpu, "k", slots, row, KEY_CHUNK as usize, None).unwrap();
        let v = SlotPages::new(&gpu, "v", slots, row, KEY_CHUNK as usize, None).unwrap();
        let part = gpu.storage("part", Attention::partials_bytes(heads, n, slots));
        let out = gpu.storage("out", (n * 9 * 64 * 4) as u64);
        let lse = gpu.storage("lse", (n * 9 * 4) as u64);
        let a = Attention::new(
            &gpu,
            &step,
            heads,
            slots,
            &q,
            &k,
            &v,
            &part,
            &out,
            &lse,
            &gpu.storage("qslot", 16),
            sieve::kernels::attention::AttnLayer::default(),
        )
        .unwrap();
        let ms = time(&gpu, |p| a.encode(p, n as u32, depth as u32));
        println!("| attention | 9/3 heads x 64, n={n}, depth {depth} | {ms:.2} | |");
    }
}
