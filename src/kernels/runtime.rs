//! The kernels' runtime, the layer above the device ([`Gpu`]): the kernel
//! variant every op runs there ([`KernelVariants`], chosen once), the
//! start-up checks that keep a candidate only where it computes what its
//! CPU reference does, the timings of `--kernels tuned` ([`Tuner`]), and
//! the per-shape copies of a product's input some kernels read. Launchers,
//! the engine and the library take a [`Runtime`]; everything of the
//! device itself (`runtime.device`, `runtime.pipeline(..)`) is reached
//! through it, as it dereferences to its [`Gpu`].

use anyhow::{bail, Result};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use super::tune::{DiskCache, Tuner};
use super::variants::{KernelVariants, MatmulVariant};
use crate::gpu::{Gpu, GpuOptions};

/// A device with sieve's kernels chosen for it.
pub struct Runtime {
    gpu: Arc<Gpu>,
    /// The kernel variant of every op, chosen once from the device's
    /// profile and kernel set, less what failed its start-up check.
    pub kernels: KernelVariants,
    /// The kernel timings made on this device (`--kernels tuned`), kept per
    /// weight shape for every engine built on it.
    pub tuner: Tuner,
    /// The `cpu` products' input textures by (k/4, tokens) (`x_texture`).
    x_textures: Mutex<HashMap<(u32, u32), wgpu::Texture>>,
    /// The f16 copies of x that `CoopX16` products read, by (k/4, tokens)
    /// (`x16_buffer`).
    x16_buffers: Mutex<HashMap<(u32, u32), wgpu::Buffer>>,
}

impl std::ops::Deref for Runtime {
    type Target = Gpu;

    fn deref(&self) -> &Gpu {
        &self.gpu
    }
}

impl Runtime {
    /// Opens the adapter `opts` (and the `SIEVE_*` settings) choose and
    /// chooses its kernels; errors are of kind
    /// [`ErrorKind::Gpu`](crate::error::ErrorKind::Gpu).
    pub fn open(opts: &GpuOptions) -> Result<Arc<Self>> {
        Ok(Self::new(Gpu::new(opts)?))
    }

    /// sieve's kernels on `gpu`: the variants its profile and kernel set
    /// select, each candidate that rests on an experimental feature or on
    /// what the API does not promise checked against its CPU reference
    /// first (a failure drops it, with a warning).
    pub fn new(gpu: Arc<Gpu>) -> Arc<Self> {
        let kernels = KernelVariants::select(&gpu.profile, gpu.set, &gpu.compile);
        let tuner = Tuner::with_disk(tuning_cache(&gpu));
        let mut rt = Runtime {
            gpu,
            kernels,
            tuner,
            x_textures: Mutex::new(HashMap::new()),
            x16_buffers: Mutex::new(HashMap::new()),
        };
        run_start_up_checks(&mut rt);
        Arc::new(rt)
    }

    /// The device.
    pub fn gpu(&self) -> &Arc<Gpu> {
        &self.gpu
    }

    /// One line for `sieve info` and `sieve bench`: the kernel set, the
    /// variants and how they compile.
    pub fn describe_kernels(&self) -> String {
        self.kernels.describe(&self.gpu.compile)
    }

    /// The buffer `CoopX16` products copy their input x into in f16
    /// (x_f16.wgsl): `tokens` rows (rounded up to whole 32-token tiles,
    /// which the product reads) of `k4` groups of four values. One per
    /// shape and device, shared by every product of that shape, as
    /// [`Runtime::x_texture`] is.
    pub fn x16_buffer(&self, k4: u32, tokens: u32) -> Result<wgpu::Buffer> {
        let bytes = tokens.next_multiple_of(32) as u64 * k4 as u64 * 8;
        let limit = self.gpu.limits.max_storage_buffer_binding_size;
        if bytes > limit {
            bail!(
                "the f16 copy of a product's input ({} values by {tokens} tokens) needs {bytes} bytes; \
                 this device binds at most {limit}",
                k4 * 4
            );
        }
        let mut cache = self.x16_buffers.lock().unwrap();
        let buffer = cache
            .entry((k4, tokens.next_multiple_of(32)))
            .or_insert_with(|| self.gpu.storage("x-f16", bytes));
        Ok(buffer.clone())
    }

    /// The texture the `cpu` products copy their input x into
    /// (x_texture.wgsl), `k4` texels wide and `tokens` high: one per shape
    /// and device, shared by every product of that shape, since each copies
    /// its x in right before it reads it (within one pass, and queue
    /// submissions run in order).
    pub fn x_texture(&self, k4: u32, tokens: u32) -> Result<wgpu::TextureView> {
        let side = self.gpu.limits.max_texture_dimension_2d;
        if k4 > side || tokens > side {
            bail!(
                "the `cpu` kernels take an input of at most {side} x 4 values by {side} tokens \
                 (this device's largest texture side); this product has {} by {tokens} \
                 (use --kernels gpu)",
                k4 * 4
            );
        }
        let mut cache = self.x_textures.lock().unwrap();
        let texture = cache.entry((k4.max(1), tokens.max(1))).or_insert_with(|| {
            self.gpu.device.create_texture(&wgpu::TextureDescriptor {
                label: Some("x-texture"),
                size: wgpu::Extent3d {
                    width: k4.max(1),
                    height: tokens.max(1),
                    depth_or_array_layers: 1,
                },
                mip_level_count: 1,
                sample_count: 1,
                dimension: wgpu::TextureDimension::D2,
                format: wgpu::TextureFormat::Rgba32Uint,
                usage: wgpu::TextureUsages::TEXTURE_BINDING | wgpu::TextureUsages::STORAGE_BINDING,
                view_formats: &[],
            })
        });
        Ok(texture.create_view(&Default::default()))
    }
}

/// Where `--kernels tuned` keeps this device's timings between processes
/// (`Settings::tune_cache`): a file whose name hashes what a timing
/// depends on besides the shape (the adapter and its driver, sieve's
/// version, how the kernels compile, and every kernel module's source);
/// None for the fixed sets, or where no folder is set.
fn tuning_cache(gpu: &Gpu) -> Option<DiskCache> {
    use std::hash::{Hash, Hasher};
    let dir = gpu.settings.tune_cache.as_ref()?;
    if gpu.set != crate::device::KernelSet::Tuned {
        return None;
    }
    let i = &gpu.info;
    let mut h = std::collections::hash_map::DefaultHasher::new();
    (&i.name, i.vendor, i.device, &i.driver, &i.driver_info).hash(&mut h);
    format!("{:?} {:?} {:?}", i.backend, gpu.compile, gpu.profile).hash(&mut h);
    env!("CARGO_PKG_VERSION").hash(&mut h);
    crate::shaders::sources_hash(gpu.compile.weight_store).hash(&mut h);
    Some(DiskCache::open(dir, h.finish(), &gpu.describe()))
}

/// The start-up checks: each kernel the device would run or time that rests
/// on an experimental wgpu feature (the cooperative matrices) or on what
/// the API does not promise (subgroup layouts) runs once against its CPU
/// reference, and is dropped from `rt.kernels` where it fails.
fn run_start_up_checks(rt: &mut Runtime) {
    // The cooperative GEMMs rest on an experimental wgpu feature: before
    // the engine relies on them, one small product each (f16 weights, and
    // Q4_0 for the staged kernel that block formats use) is checked
    // against the CPU reference; a wrong or failing result falls back to
    // the tiled kernel (the fallback always works) with a warning, for
    // the weights that kernel serves.
    if rt.kernels.matmul == MatmulVariant::Coop {
        use crate::kernels::matmul::check_variant;
        use crate::shaders::WeightFormat;
        let device = rt.info.name.clone();
        let warn = |variant: MatmulVariant, format: WeightFormat, e: anyhow::Error, then: &str| {
            eprintln!(
                "warning: the cooperative-matrix mat-mul ({variant:?}) failed its check with {} weights on {} ({e:#}); {then}",
                format.name(),
                device
            );
        };
        if let Err(e) = check_variant(rt, MatmulVariant::CoopStaged, WeightFormat::Q4_0) {
            let then = "weights in block formats use the tiled kernel";
            warn(MatmulVariant::CoopStaged, WeightFormat::Q4_0, e, then);
            rt.kernels.coop_staged = false;
        }
        // With timings the staged kernel is also a candidate for f16
        // weights, checked with them on its own.
        if rt.kernels.coop_staged_f16 {
            if let Err(e) = check_variant(rt, MatmulVariant::CoopStaged, WeightFormat::F16) {
                let then = "it is not timed for f16 weights";
                warn(MatmulVariant::CoopStaged, WeightFormat::F16, e, then);
                rt.kernels.coop_staged_f16 = false;
            }
        }
        // Its 128-token tiles too (the same kernel with WIDE = 2, a
        // candidate wherever the staged one is), with the weights the
        // staged kernel kept.
        let formats = [
            (rt.kernels.coop_staged, WeightFormat::Q4_0),
            (rt.kernels.coop_staged_f16, WeightFormat::F16),
        ];
        for (kept, format) in formats {
            if !kept || !rt.kernels.coop_staged_wide {
                continue;
            }
            let wide = MatmulVariant::CoopStagedWide;
            if let Err(e) = check_variant(rt, wide, format) {
                warn(wide, format, e, "it is not timed");
                rt.kernels.coop_staged_wide = false;
            }
        }
        // The refined kernels (candidates beside the two above), with the
        // weights their plain kernels kept.
        let refined = [
            (
                rt.kernels.coop_staged,
                MatmulVariant::CoopStagedPadded,
                WeightFormat::Q4_0,
            ),
            (
                rt.kernels.coop_staged_f16,
                MatmulVariant::CoopStagedPadded,
                WeightFormat::F16,
            ),
            (
                rt.kernels.coop_staged,
                MatmulVariant::CoopStagedPrefetch,
                WeightFormat::Q4_0,
            ),
            (
                rt.kernels.coop_staged_f16,
                MatmulVariant::CoopStagedPrefetch,
                WeightFormat::F16,
            ),
            (
                rt.kernels.coop_staged,
                MatmulVariant::CoopStagedTokensFast,
                WeightFormat::Q4_0,
            ),
            (true, MatmulVariant::CoopPadded, WeightFormat::F16),
            (true, MatmulVariant::CoopTokensFast, WeightFormat::F16),
            (true, MatmulVariant::CoopX16, WeightFormat::F16),
        ];
        for (kept, variant, format) in refined {
            if !kept || !rt.kernels.coop_refined {
                continue;
            }
            if let Err(e) = check_variant(rt, variant, format) {
                warn(
                    variant,
                    format,
                    e,
                    "the refined cooperative kernels are not timed",
                );
                rt.kernels.coop_refined = false;
            }
        }
        if let Err(e) = check_variant(rt, MatmulVariant::Coop, WeightFormat::F16) {
            let then = "every weight format uses the tiled kernel";
            warn(MatmulVariant::Coop, WeightFormat::F16, e, then);
            rt.kernels.matmul = MatmulVariant::Tiled;
            rt.kernels.coop_staged = false;
            rt.kernels.coop_staged_f16 = false;
            rt.kernels.coop_staged_wide = false;
            rt.kernels.coop_refined = false;
        }
    }
    // The matrix-unit prefill attention rests on the same experimental
    // feature: where `tuned` would time it, it runs once against the CPU
    // reference first, and is dropped on a failure.
    if rt.kernels.attn_prefill_coop {
        use super::variants::AttnPrefillVariant::Coop;
        if let Err(e) = crate::kernels::attention::check_prefill_variant(rt, Coop) {
            eprintln!(
                "warning: the cooperative-matrix prefill attention failed its check on {} ({e:#}); it is not timed",
                rt.info.name
            );
            rt.kernels.attn_prefill_coop = false;
        }
    }
    // The eight-lanes-per-key decode attention numbers its lanes by
    // subgroup, counting on subgroups of one size in a workgroup, which
    // Vulkan does not promise: where `tuned` would time it, it runs once
    // against the CPU reference first, and is dropped on a failure.
    if rt.kernels.tuned() && rt.kernels.attn_decode_lanes {
        use super::variants::AttnDecodeVariant::LanesPerKey;
        if let Err(e) = crate::kernels::attention::check_decode_variant(rt, LanesPerKey) {
            eprintln!(
                "warning: the eight-lanes-per-key decode attention failed its check on {} ({e:#}); it is not timed",
                rt.info.name
            );
            rt.kernels.attn_decode_lanes = false;
        }
    }
}

#[cfg(test)]
mod tests {
    /// The `cpu` products' input texture: past the device's largest side a
    /// clear error naming the limit and the way out, not a wgpu validation
    /// failure; within it one texture per shape, shared.
    #[test]
    fn x_texture_past_the_largest_side_is_a_clear_error() {
        // A device of its own: the shared one's textures are other tests'
        // too, made while this one runs.
        let gpu = crate::kernels::testutil::gpu_storing(crate::shaders::WeightStore::Texture, None);
        let side = gpu.limits.max_texture_dimension_2d;
        for (k4, tokens) in [(side + 1, 1), (1, side + 1)] {
            let err = gpu.x_texture(k4, tokens).unwrap_err().to_string();
            assert!(
                err.contains(&format!("at most {side} x 4 values by {side} tokens"))
                    && err.contains("--kernels gpu"),
                "{k4} x {tokens}: {err}"
            );
        }
        gpu.x_texture(side, 3).unwrap();
        gpu.x_texture(side, 3).unwrap();
        assert_eq!(gpu.x_textures.lock().unwrap().len(), 1);
    }

    /// With a tuning cache folder, `tuned` keeps its timings in a file: a
    /// second runtime on the same device takes them from there without
    /// timing (and with the same choice and times), and one whose file is
    /// not readable times afresh.
    #[test]
    fn timings_are_kept_between_processes() {
        use crate::device::KernelSet;
        use crate::gpu::{Gpu, GpuOptions};
        use crate::kernels::matmul::{Matmul, MatmulOptions};
        use crate::kernels::testutil::{fill_test_weights, step_buffer};
        use crate::kernels::{Rows, Step};
        use crate::shaders::WeightFormat;
        use crate::weights::GpuMatrix;
        use std::sync::Arc;
        let dir = std::env::temp_dir().join(format!("sieve-tune-cache-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let runtime = || {
            let opts = GpuOptions {
                kernels: Some(KernelSet::Tuned),
                ..Default::default()
            };
            let mut gpu = Gpu::new(&opts).unwrap();
            Arc::get_mut(&mut gpu).unwrap().settings.tune_cache = Some(dir.clone());
            super::Runtime::new(gpu)
        };
        let product = |rt: &super::Runtime| {
            let (rows, cols) = (24, 64);
            let m = GpuMatrix::new(rt, "w", rows, cols, WeightFormat::F16).unwrap();
            fill_test_weights(rt, &m, 7);
            let step = step_buffer(
                rt,
                Step {
                    n_tokens: 1,
                    ..Default::default()
                },
            );
            let (x, y) = (
                rt.storage("x", cols as u64 * 4),
                rt.storage("y", rows as u64 * 4),
            );
            let opts = MatmulOptions {
                accumulate: false,
                rows: Rows::Tokens,
            };
            Matmul::new(rt, &step, &m, None, &x, &y, opts).unwrap();
            rt.tuner.results()
        };
        let first = runtime();
        if !first.features.contains(wgpu::Features::TIMESTAMP_QUERY) {
            eprintln!(
                "note: {} has no timestamp queries: nothing to keep",
                first.info.name
            );
            return;
        }
        let timed = product(&first);
        assert_eq!(timed.len(), 1);
        assert!(timed[0].untimed.is_none(), "{timed:?}");
        let path = first.tuner.disk_path().unwrap().to_path_buf();
        assert!(
            path.starts_with(&dir) && path.exists(),
            "{}",
            path.display()
        );
        let kept = product(&runtime());
        assert_eq!(kept.len(), 1);
        assert!(
            kept[0]
                .untimed
                .as_deref()
                .unwrap()
                .contains("kept from an earlier process"),
            "{kept:?}"
        );
        assert_eq!(
            (&kept[0].labels, kept[0].choice, &kept[0].seconds),
            (&timed[0].labels, timed[0].choice, &timed[0].seconds)
        );
        std::fs::write(&path, b"not json").unwrap();
        let again = product(&runtime());
        assert!(again[0].untimed.is_none(), "{again:?}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
