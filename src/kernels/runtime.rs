//! The kernels' runtime, the layer above the device ([`Gpu`]): the kernel
//! variant every op runs there ([`KernelVariants`], chosen once), the
//! start-up checks that keep a candidate only where it computes what its
//! CPU reference does, the timings of `--kernels tuned` ([`Tuner`]), and
//! the per-shape copies of a product's input some kernels read (the
//! checks and the constructor that runs them are in kernels/startup.rs,
//! which may import the launchers this file's users are). Launchers,
//! the engine and the library take a [`Runtime`]; everything of the
//! device itself (`runtime.device`, `runtime.pipeline(..)`) is reached
//! through it, as it dereferences to its [`Gpu`].

use anyhow::{bail, Result};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use super::prepared_x::XForm;
use super::tune::{DiskCache, Tuner};
use super::variants::KernelVariants;
use crate::gpu::Gpu;

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
    /// One token's x prepared for the mat-vecs that read it so
    /// (`IntegerDot`, `HalfX`), by form and K (`prepared_x_buffer`).
    prepared_x: Mutex<HashMap<(XForm, usize), wgpu::Buffer>>,
}

impl std::ops::Deref for Runtime {
    type Target = Gpu;

    fn deref(&self) -> &Gpu {
        &self.gpu
    }
}

impl Runtime {
    /// The variants `gpu`'s profile and kernel set select, before the
    /// start-up checks: `Runtime::new` (kernels/startup.rs, which runs the
    /// kernels it checks, as this file cannot without importing them) makes
    /// the runtime the library uses.
    pub(super) fn unchecked(gpu: Arc<Gpu>) -> Self {
        let kernels = KernelVariants::select(&gpu.profile, gpu.set, &gpu.compile);
        let tuner = Tuner::with_disk(tuning_cache(&gpu));
        Runtime {
            gpu,
            kernels,
            tuner,
            x_textures: Mutex::new(HashMap::new()),
            x16_buffers: Mutex::new(HashMap::new()),
            prepared_x: Mutex::new(HashMap::new()),
        }
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

    /// The buffer the mat-vecs that read x prepared in `form` (`IntegerDot`,
    /// `HalfX`) read one token's x of `cols` values from (a kernel of
    /// `prepared_x` writes it right before each such product): one per form,
    /// K and device, shared by every product of that K, as
    /// [`Runtime::x_texture`] is.
    pub fn prepared_x_buffer(&self, form: XForm, cols: usize) -> Result<wgpu::Buffer> {
        let bytes = form.bytes(cols);
        let limit = self.gpu.limits.max_storage_buffer_binding_size;
        if bytes > limit {
            bail!("x prepared as {form:?} ({cols} values) needs {bytes} bytes; this device binds at most {limit}");
        }
        let mut cache = self.prepared_x.lock().unwrap();
        let buffer = cache
            .entry((form, cols))
            .or_insert_with(|| self.gpu.storage("x-prepared", bytes));
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

#[cfg(any(test, feature = "kernel-checks"))]
pub(crate) mod tests {
    /// The `cpu` products' input texture: past the device's largest side a
    /// clear error naming the limit and the way out, not a wgpu validation
    /// failure; within it one texture per shape, shared.
    #[cfg_attr(test, test)]
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

    /// A mat-vec-sized product of `rows` x `cols` weights in `format` built
    /// on `rt` (timed, where its kernel set is `tuned`).
    fn one_product(
        rt: &super::Runtime,
        format: crate::formats::WeightFormat,
        rows: usize,
        cols: usize,
    ) -> crate::kernels::matmul::Matmul {
        use crate::kernels::matmul::{Matmul, MatmulOptions};
        use crate::kernels::testutil::{fill_test_weights, step_buffer};
        use crate::kernels::{Rows, Step};
        let m = crate::weights::GpuMatrix::new(rt, "w", rows, cols, format).unwrap();
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
        Matmul::new(rt, &step, &m, None, &x, &y, opts).unwrap()
    }

    /// With a tuning cache folder, `tuned` keeps its timings in a file: a
    /// second runtime on the same device takes them from there without
    /// timing (and with the same choice and times), and one whose file is
    /// not readable times afresh. In a browser the "folder" is a prefix of
    /// localStorage items (src/platform.rs).
    #[cfg_attr(test, test)]
    fn timings_are_kept_between_processes() {
        use crate::device::KernelSet;
        use crate::formats::WeightFormat;
        use crate::gpu::{Gpu, GpuOptions};
        use std::sync::Arc;
        // A folder of its own (one name a run: the time).
        let now = web_time::SystemTime::now().duration_since(web_time::UNIX_EPOCH);
        let name = format!("sieve-tune-cache-{}", now.unwrap().as_nanos());
        #[cfg(not(target_arch = "wasm32"))]
        let dir = std::env::temp_dir().join(name);
        #[cfg(target_arch = "wasm32")]
        let dir = std::path::PathBuf::from(name);
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
            one_product(rt, WeightFormat::F16, 24, 64);
            rt.tuner.results()
        };
        let first = runtime();
        if !first.features.contains(wgpu::Features::TIMESTAMP_QUERY) {
            crate::kernels::testutil::note("this device has no timestamp queries: nothing to keep");
            return;
        }
        let timed = product(&first);
        assert_eq!(timed.len(), 1);
        assert!(timed[0].untimed.is_none(), "{timed:?}");
        let path = first.tuner.disk_path().unwrap().to_path_buf();
        assert!(
            path.starts_with(&dir) && crate::platform::read_kept(&path).is_some(),
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
        crate::platform::write_kept(&path, b"not json").unwrap();
        let again = product(&runtime());
        assert!(again[0].untimed.is_none(), "{again:?}");
        crate::platform::remove_kept(&path).unwrap();
        #[cfg(not(target_arch = "wasm32"))]
        std::fs::remove_dir(&dir).unwrap();
    }

    /// `SIEVE_TUNE_FORCE`'s patterns: an exact label keeps that candidate
    /// alone, a prefix every label it begins, `!` those it does not. On a
    /// device, a pattern that keeps one candidate takes it untimed, one
    /// that keeps several times only those (the rest have no time), and
    /// one that keeps none leaves the rule's.
    #[cfg_attr(test, test)]
    fn forced_candidates_are_the_ones_the_pattern_keeps() {
        use crate::device::KernelSet;
        use crate::formats::WeightFormat;
        use crate::gpu::{Gpu, GpuOptions};
        use crate::kernels::tune::forced;
        use std::sync::Arc;
        let labels: Vec<String> = ["128x2", "128x2 unfused", "q8 32x1", "q8 64x2"]
            .map(String::from)
            .to_vec();
        assert_eq!(forced("128x2", &labels), [true, false, false, false]);
        assert_eq!(forced("128x2 u", &labels), [false, true, false, false]);
        assert_eq!(forced("q8", &labels), [false, false, true, true]);
        assert_eq!(forced("!q8", &labels), [true, true, false, false]);
        assert_eq!(forced("256", &labels), [false; 4]);
        // A Q4_0 product's mat-vec on a `tuned` device with `pattern`.
        let run = |pattern: &str| {
            let mut gpu = Gpu::new(&GpuOptions {
                kernels: Some(KernelSet::Tuned),
                ..Default::default()
            })
            .unwrap();
            let settings = &mut Arc::get_mut(&mut gpu).unwrap().settings;
            settings.tune_cache = None;
            settings.tune_force = vec![("mat-vec".into(), pattern.into())];
            let rt = super::Runtime::new(gpu);
            let mm = one_product(&rt, WeightFormat::Q4_0, 24, 256);
            let t = rt.tuner.results().remove(0);
            (t, mm.matvec_variants()[0], rt.kernels.matvec)
        };
        let (t, ran, rule) = run("512x2");
        assert!(
            t.untimed.as_deref().unwrap().contains("keeps no candidate"),
            "{t:?}"
        );
        assert_eq!(ran, rule);
        if !crate::kernels::testutil::gpu().profile.subgroups {
            crate::kernels::testutil::note(
                "this device has no subgroups: no integer-dot candidates to force",
            );
            return;
        }
        let (t, ran, _) = run("q8 64x2");
        assert!(
            t.untimed
                .as_deref()
                .unwrap()
                .contains("forced by SIEVE_TUNE_FORCE"),
            "{t:?}"
        );
        assert_eq!(ran.label(), "q8 64x2");
        let (t, ran, _) = run("q8 32");
        if t.untimed.is_none() {
            let kept = forced("q8 32", &t.labels);
            for (i, s) in t.seconds.iter().enumerate() {
                assert_eq!(s.is_some(), kept[i], "{}: {s:?}", t.labels[i]);
            }
            assert!(ran.label().starts_with("q8 32x"), "{ran:?}");
        } else {
            crate::kernels::testutil::note("this device has no timestamp queries: nothing timed");
        }
    }

    crate::kernels::checks::register![
        x_texture_past_the_largest_side_is_a_clear_error,
        timings_are_kept_between_processes,
        forced_candidates_are_the_ones_the_pattern_keeps,
    ];
}
