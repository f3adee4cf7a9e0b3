//! `shaders/read_bandwidth.wgsl` and `read_bandwidth_texture.wgsl`: the
//! device's streaming-read bandwidth, the bound `sieve bench` compares
//! decode speed with.
//!
//! Both ways a kernel can stream weights are measured: from a storage
//! buffer (the `gpu` and `tuned` sets) and from a texture (the `cpu` set);
//! the bound is the faster, since it is what the device can read. On
//! lavapipe the texture is several times faster (docs/ARCHITECTURE.md,
//! "lavapipe facts"); a storage-only probe put decode there above 100% of
//! its bound.
//!
//! Each source is as large as one storage binding allows up to 1 GiB (far
//! larger than any GPU cache; the texture as near that as its largest side
//! allows), the workgroup count gives each lane about 32 16-byte loads, and
//! the time is the GPU's own (timestamp queries around the dispatch, where
//! the adapter has them; else the host's wall clock around submission and
//! wait). The median of several runs after a warm-up is kept.

use anyhow::Result;
use web_time::Instant;

use crate::gpu::Gpu;
use crate::profile::Profiler;
use crate::shaders;
use crate::weights::WEIGHT_TEXTURE_WIDTH;

const LANES: u64 = 256;

/// Where the probe reads from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReadPath {
    StorageBuffer,
    Texture,
}

impl ReadPath {
    pub fn name(self) -> &'static str {
        match self {
            ReadPath::StorageBuffer => "storage buffer",
            ReadPath::Texture => "texture",
        }
    }
}

/// One measurement.
#[derive(Clone, Copy, Debug)]
pub struct Bandwidth {
    pub path: ReadPath,
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

/// What a probe reads: a buffer of `bytes` (a multiple of 16), or a
/// texture view of `texels` Rgba32Uint texels laid out as
/// read_bandwidth_texture.wgsl says.
pub(crate) enum Source<'a> {
    Buffer(&'a wgpu::Buffer, u64),
    Texture(&'a wgpu::TextureView, u64),
}

/// The probe's kernel bound to one source (a buffer one is also the cache
/// flush of the kernel timings in src/kernels/tune.rs).
pub(crate) struct Probe {
    pipeline: std::sync::Arc<wgpu::ComputePipeline>,
    group: wgpu::BindGroup,
    groups: u32,
    /// Read back by the test only (the bind group keeps it alive).
    #[cfg_attr(not(test), allow(dead_code))]
    dst: wgpu::Buffer,
}

impl Probe {
    pub(crate) fn new(gpu: &Gpu, src: Source) -> Result<Self> {
        let (shader, n, src) = match src {
            Source::Buffer(b, bytes) => {
                (&shaders::READ_BANDWIDTH, bytes / 16, b.as_entire_binding())
            }
            Source::Texture(view, texels) => (
                &shaders::READ_BANDWIDTH_TEXTURE,
                texels,
                wgpu::BindingResource::TextureView(view),
            ),
        };
        let groups = groups_for(n, gpu.limits.max_compute_workgroups_per_dimension);
        let dst = gpu.storage("bandwidth-dst", groups as u64 * LANES * 4);
        let pipeline = gpu.pipeline(shader, None, "main", &[])?;
        let group = gpu.bind_group_of(&pipeline, &[src, dst.as_entire_binding()]);
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
        crate::platform::wait_for_gpu(&gpu.device, &gpu.queue, None)?;
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

/// Streaming-read bandwidth through each [`ReadPath`] (storage buffer
/// first), each the median of `runs` timed runs after one warm-up
/// (lavapipe's timestamps now and then report a run several times too
/// fast, which a best-of would keep).
pub fn measure(gpu: &Gpu, runs: usize) -> Result<Vec<Bandwidth>> {
    let bytes = gpu.max_binding.min(1 << 30) / 16 * 16;
    let src = gpu.storage("bandwidth-src", bytes);
    let mut out = vec![time(
        gpu,
        ReadPath::StorageBuffer,
        &Probe::new(gpu, Source::Buffer(&src, bytes))?,
        bytes,
        runs,
    )?];
    drop(src);
    let (width, height) = texture_extent(bytes, gpu.limits.max_texture_dimension_2d);
    let texture = probe_texture(gpu, width, height);
    let texels = width as u64 * height as u64;
    let view = texture.create_view(&Default::default());
    out.push(time(
        gpu,
        ReadPath::Texture,
        &Probe::new(gpu, Source::Texture(&view, texels))?,
        texels * 16,
        runs,
    )?);
    Ok(out)
}

/// The fastest of `measure`'s paths: the device's read bound.
pub fn fastest(paths: &[Bandwidth]) -> Option<Bandwidth> {
    paths
        .iter()
        .copied()
        .max_by(|a, b| a.bytes_per_second.total_cmp(&b.bytes_per_second))
}

/// The median of `runs` timed runs of `probe` after a warm-up.
fn time(gpu: &Gpu, path: ReadPath, probe: &Probe, bytes: u64, runs: usize) -> Result<Bandwidth> {
    let mut prof = Profiler::new(gpu);
    let gpu_timed = prof.is_some();
    probe.run(gpu, prof.as_mut())?;
    let mut times = (0..runs.max(1))
        .map(|_| probe.run(gpu, prof.as_mut()))
        .collect::<Result<Vec<f64>>>()?;
    times.sort_by(f64::total_cmp);
    let median = times[times.len() / 2];
    Ok(Bandwidth {
        path,
        bytes_per_second: bytes as f64 / median,
        bytes,
        gpu_timed,
    })
}

/// (width, height) of the probe texture for about `bytes`: rows of
/// `WEIGHT_TEXTURE_WIDTH` texels, at most `max_side` of them (at least one).
fn texture_extent(bytes: u64, max_side: u32) -> (u32, u32) {
    let row = WEIGHT_TEXTURE_WIDTH as u64 * 16;
    let rows = (bytes / row).clamp(1, max_side as u64) as u32;
    (WEIGHT_TEXTURE_WIDTH, rows)
}

/// A sampled Rgba32Uint texture of `width` x `height` texels (zeros until
/// written).
fn probe_texture(gpu: &Gpu, width: u32, height: u32) -> wgpu::Texture {
    crate::weights::texel_texture(
        gpu,
        "bandwidth-texture",
        (width, height),
        wgpu::TextureUsages::COPY_DST,
    )
}

#[cfg(any(test, feature = "kernel-checks"))]
pub(crate) mod tests {
    use super::*;
    use crate::kernels::testutil::*;

    /// Every element is read exactly once: the lanes' sums add up to the sum
    /// of the buffer, for sizes that leave partial strides and groups.
    #[cfg_attr(test, test)]
    fn reads_every_element_once() {
        let gpu = gpu();
        for n_vec4 in [1usize, 255, 256 * 32 * 3 + 17, 256 * 32 * 9 + 4 * 256 + 3] {
            let data: Vec<u32> = (0..n_vec4 as u32 * 4)
                .map(|i| i.wrapping_mul(2654435761) >> 7)
                .collect();
            let src = gpu.storage_from("src", &data);
            let probe = Probe::new(&gpu, Source::Buffer(&src, n_vec4 as u64 * 16)).unwrap();
            assert_eq!(
                lane_sum(&gpu, &probe),
                wrapping_sum(&data),
                "{n_vec4} elements"
            );
        }
    }

    /// The same through a texture: full rows of `WEIGHT_TEXTURE_WIDTH`
    /// texels (one, or enough for partial strides and groups), and one
    /// shorter row.
    #[cfg_attr(test, test)]
    fn reads_every_texel_once() {
        let gpu = gpu();
        let w = WEIGHT_TEXTURE_WIDTH;
        for (width, height) in [(w, 1), (w, 7), (w, 19), (272, 1)] {
            let data: Vec<u32> = (0..width * height * 4)
                .map(|i| i.wrapping_mul(2654435761) >> 5)
                .collect();
            let texture = probe_texture(&gpu, width, height);
            gpu.queue.write_texture(
                texture.as_image_copy(),
                bytemuck::cast_slice(&data),
                wgpu::TexelCopyBufferLayout {
                    offset: 0,
                    bytes_per_row: Some(width * 16),
                    rows_per_image: Some(height),
                },
                texture.size(),
            );
            let view = texture.create_view(&Default::default());
            let texels = width as u64 * height as u64;
            let probe = Probe::new(&gpu, Source::Texture(&view, texels)).unwrap();
            assert_eq!(
                lane_sum(&gpu, &probe),
                wrapping_sum(&data),
                "{width} x {height} texels"
            );
        }
    }

    /// Runs the probe once and adds up its lanes' sums.
    fn lane_sum(gpu: &Gpu, probe: &Probe) -> u32 {
        probe.run(gpu, None).unwrap();
        let lanes = probe.groups as usize * LANES as usize;
        let got: Vec<u32> = gpu.read(&probe.dst, 0, lanes).unwrap();
        wrapping_sum(&got)
    }

    fn wrapping_sum(v: &[u32]) -> u32 {
        v.iter().fold(0u32, |a, &b| a.wrapping_add(b))
    }

    #[cfg_attr(test, test)]
    fn measures_a_positive_bandwidth_on_each_path() {
        let got = measure(&gpu(), 2).unwrap();
        let paths: Vec<ReadPath> = got.iter().map(|b| b.path).collect();
        assert_eq!(paths, [ReadPath::StorageBuffer, ReadPath::Texture]);
        for b in &got {
            assert!(
                b.bytes_per_second.is_finite() && b.bytes_per_second > 0.0,
                "{b:?}"
            );
        }
        let best = fastest(&got).unwrap();
        assert!(got
            .iter()
            .all(|b| b.bytes_per_second <= best.bytes_per_second));
    }

    crate::kernels::checks::register![
        reads_every_element_once,
        reads_every_texel_once,
        measures_a_positive_bandwidth_on_each_path,
    ];
}
