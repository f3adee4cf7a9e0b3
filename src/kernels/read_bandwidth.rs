//! `shaders/read_bandwidth.wgsl`: the device's streaming-read bandwidth, the
//! bound `sieve bench` compares decode speed with.
//!
//! The buffer is as large as one storage binding allows up to 1 GiB (far
//! larger than any GPU cache), the workgroup count gives each lane about 32
//! 16-byte loads, and the time is the GPU's own (timestamp queries around the
//! dispatch, where the adapter has them; else the host's wall clock around
//! submission and wait). The median of several runs after a warm-up is kept.

use anyhow::{anyhow, Result};
use std::time::Instant;

use crate::gpu::Gpu;
use crate::profile::Profiler;
use crate::shaders;

const LANES: u64 = 256;

/// One measurement.
#[derive(Clone, Copy, Debug)]
pub struct Bandwidth {
    pub bytes_per_second: f64,
    /// Bytes read per run.
    pub bytes: u64,
    /// Timed by GPU timestamps (else by the host clock).
    pub gpu_timed: bool,
}

/// Workgroups for `n` 16-byte elements: about 32 loads per lane, at least
/// one group, at most the dispatch limit and 65,535 (the kernel's stride
/// assumes no more).
fn groups_for(n: u64, max_groups: u32) -> u32 {
    (n / (LANES * 32)).clamp(1, max_groups.min(65535) as u64) as u32
}

/// The probe's kernel bound to one buffer (also the cache flush of the
/// kernel timings in src/kernels/tune.rs).
pub(crate) struct Probe {
    pipeline: std::sync::Arc<wgpu::ComputePipeline>,
    group: wgpu::BindGroup,
    groups: u32,
    /// Read back by the test only (the bind group keeps it alive).
    #[cfg_attr(not(test), allow(dead_code))]
    dst: wgpu::Buffer,
}

impl Probe {
    pub(crate) fn new(gpu: &Gpu, src: &wgpu::Buffer, bytes: u64) -> Result<Self> {
        let groups = groups_for(bytes / 16, gpu.limits.max_compute_workgroups_per_dimension);
        let dst = gpu.storage("bandwidth-dst", groups as u64 * LANES * 4);
        let pipeline = gpu.pipeline(&shaders::READ_BANDWIDTH, None, "main", &[])?;
        let group = gpu.bind_group(&pipeline, &[src, &dst]);
        Ok(Probe {
            pipeline,
            group,
            groups,
            dst,
        })
    }

    /// Encodes one read of the whole buffer.
    pub(crate) fn encode(&self, pass: &mut wgpu::ComputePass) {
        pass.set_pipeline(&self.pipeline);
        pass.set_bind_group(0, &self.group, &[]);
        pass.dispatch_workgroups(self.groups, 1, 1);
    }

    /// Runs once; the GPU time in seconds when `prof` is given, else the
    /// host's time around submission and wait.
    fn run(&self, gpu: &Gpu, prof: Option<&mut Profiler>) -> Result<f64> {
        let mut enc = gpu.device.create_command_encoder(&Default::default());
        let mut prof = prof;
        {
            let mut pass = enc.begin_compute_pass(&Default::default());
            if let Some(p) = prof.as_deref_mut() {
                p.mark(&mut pass, "start");
            }
            self.encode(&mut pass);
            if let Some(p) = prof.as_deref_mut() {
                p.mark(&mut pass, "read");
            }
        }
        if let Some(p) = prof.as_deref() {
            p.resolve(&mut enc);
        }
        let t = Instant::now();
        gpu.queue.submit([enc.finish()]);
        gpu.device
            .poll(wgpu::PollType::wait_indefinitely())
            .map_err(|e| anyhow!("waiting for the GPU: {e}"))?;
        let host = t.elapsed().as_secs_f64();
        match prof {
            Some(p) => {
                p.collect(gpu)?;
                let ns = p.totals.iter().map(|(_, t)| t).sum::<f64>();
                p.clear();
                // A driver that reports zero ticks gets the host time.
                Ok(if ns > 0.0 { ns * 1e-9 } else { host })
            }
            None => Ok(host),
        }
    }
}

/// Streaming-read bandwidth: the median of `runs` timed runs after one
/// warm-up (lavapipe's timestamps now and then report a run several times too
/// fast, which a best-of would keep).
pub fn measure(gpu: &Gpu, runs: usize) -> Result<Bandwidth> {
    let bytes = gpu.max_binding.min(1 << 30) / 16 * 16;
    let src = gpu.storage("bandwidth-src", bytes);
    let probe = Probe::new(gpu, &src, bytes)?;
    let mut prof = Profiler::new(gpu);
    let gpu_timed = prof.is_some();
    probe.run(gpu, prof.as_mut())?;
    let mut times = (0..runs.max(1))
        .map(|_| probe.run(gpu, prof.as_mut()))
        .collect::<Result<Vec<f64>>>()?;
    times.sort_by(f64::total_cmp);
    let median = times[times.len() / 2];
    Ok(Bandwidth {
        bytes_per_second: bytes as f64 / median,
        bytes,
        gpu_timed,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::testutil::*;

    /// Every element is read exactly once: the lanes' sums add up to the sum
    /// of the buffer, for sizes that leave partial strides and groups.
    #[test]
    fn reads_every_element_once() {
        let gpu = gpu();
        for n_vec4 in [1usize, 255, 256 * 32 * 3 + 17, 256 * 32 * 9 + 4 * 256 + 3] {
            let data: Vec<u32> = (0..n_vec4 as u32 * 4)
                .map(|i| i.wrapping_mul(2654435761) >> 7)
                .collect();
            let src = gpu.storage_from("src", &data);
            let probe = Probe::new(&gpu, &src, n_vec4 as u64 * 16).unwrap();
            probe.run(&gpu, None).unwrap();
            let lanes = probe.groups as usize * LANES as usize;
            let got: Vec<u32> = gpu.read(&probe.dst, 0, lanes).unwrap();
            let got = got.iter().fold(0u32, |a, &b| a.wrapping_add(b));
            let want = data.iter().fold(0u32, |a, &b| a.wrapping_add(b));
            assert_eq!(got, want, "{n_vec4} elements, {} groups", probe.groups);
        }
    }

    #[test]
    fn measures_a_positive_bandwidth() {
        let b = measure(&gpu(), 2).unwrap();
        assert!(b.bytes_per_second.is_finite() && b.bytes_per_second > 0.0);
    }
}
