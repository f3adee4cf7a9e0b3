//! The device layer: adapter and device selection, pipeline cache, buffer
//! helpers. It knows shaders as sources to compile, not what they compute:
//! which kernel runs where, the timings and the start-up checks are the
//! kernels' runtime's, a layer above (`kernels::runtime`).
//!
//! One [`Gpu`] owns the wgpu device and queue. Pipelines are compiled once per
//! (shader, entry point, constants) key and cached. Limits are requested from the
//! adapter's real limits so that large GPUs are not held to WebGPU defaults, and
//! every size the engine needs is checked against them before a buffer is made
//! (wgpu does not check workgroup memory itself; `Gpu::pipeline` does).

use anyhow::{anyhow, bail, Context, Result};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use crate::device::{has_coop_f16_16x16, CompileOptions, DeviceProfile, KernelSet, Settings};
use crate::shaders;

/// How to choose the adapter. The backend, the adapter and the kernel set
/// can also come from the environment (`SIEVE_BACKEND`: vulkan, metal,
/// dx12, gl; `SIEVE_ADAPTER`: a substring of the adapter name;
/// `SIEVE_KERNELS`: [`Settings`]); what is given here wins.
#[derive(Clone, Debug, Default)]
pub struct GpuOptions {
    pub backend: Option<String>,
    pub adapter: Option<String>,
    /// Pretend the device's largest storage binding is this many bytes (never more
    /// than the real limit). Used by tests to exercise tensor splitting.
    pub max_binding_override: Option<u64>,
    /// Kernel set (`--kernels`); None: `SIEVE_KERNELS`, else auto.
    pub kernels: Option<KernelSet>,
}

pub struct Gpu {
    pub device: wgpu::Device,
    pub queue: wgpu::Queue,
    pub info: wgpu::AdapterInfo,
    pub features: wgpu::Features,
    pub limits: wgpu::Limits,
    /// Largest storage binding the engine will use, in bytes.
    pub max_binding: u64,
    /// What the kernels know about this device.
    pub profile: DeviceProfile,
    /// The kernel set asked for (`auto` resolved: `cpu`, `gpu` or `tuned`).
    pub set: KernelSet,
    /// How sieve's kernels are compiled here.
    pub compile: CompileOptions,
    /// The `SIEVE_*` environment the device was opened with (read once).
    pub settings: Settings,
    pipelines: Mutex<HashMap<String, Arc<wgpu::ComputePipeline>>>,
}

pub(crate) fn parse_backend(name: &str) -> Result<wgpu::Backends> {
    Ok(match name.to_ascii_lowercase().as_str() {
        "vulkan" | "vk" => wgpu::Backends::VULKAN,
        "metal" => wgpu::Backends::METAL,
        "dx12" | "d3d12" => wgpu::Backends::DX12,
        "gl" | "gles" | "opengl" => wgpu::Backends::GL,
        other => bail!("unknown backend '{other}' (option --backend or SIEVE_BACKEND): expected one of vulkan, metal, dx12, gl"),
    })
}

fn device_rank(t: wgpu::DeviceType) -> u32 {
    match t {
        wgpu::DeviceType::DiscreteGpu => 0,
        wgpu::DeviceType::IntegratedGpu => 1,
        wgpu::DeviceType::VirtualGpu => 2,
        wgpu::DeviceType::Cpu => 3,
        wgpu::DeviceType::Other => 4,
    }
}

/// The adapters an instance offers: every one (native), or the browser's
/// (WebGPU offers one adapter, high performance first).
fn adapters(instance: &wgpu::Instance, backends: wgpu::Backends) -> Vec<wgpu::Adapter> {
    if cfg!(target_arch = "wasm32") {
        let options = wgpu::RequestAdapterOptions {
            power_preference: wgpu::PowerPreference::HighPerformance,
            ..Default::default()
        };
        crate::platform::block_on(instance.request_adapter(&options))
            .into_iter()
            .collect()
    } else {
        crate::platform::block_on(instance.enumerate_adapters(backends))
    }
}

fn backend_rank(b: wgpu::Backend) -> u32 {
    // GL lacks the features we prefer (f16, subgroups); take it only when nothing else exists.
    if b == wgpu::Backend::Gl {
        1
    } else {
        0
    }
}

impl Gpu {
    /// Picks an adapter (discrete GPU first, GL last) and opens a device with the
    /// adapter's own limits.
    /// Opens the adapter `opts` (and SIEVE_BACKEND / SIEVE_ADAPTER) choose;
    /// its errors are of kind [`ErrorKind::Gpu`](crate::error::ErrorKind::Gpu).
    pub fn new(opts: &GpuOptions) -> Result<Arc<Self>> {
        use crate::error::{ErrorKind, TagKind};
        Self::open(opts).tag(ErrorKind::Gpu)
    }

    fn open(opts: &GpuOptions) -> Result<Arc<Self>> {
        let settings = Settings::from_env()?;
        let backend = opts.backend.clone().or(settings.backend.clone());
        let wanted_name = opts.adapter.clone().or(settings.adapter.clone());
        let backends = match &backend {
            Some(b) => parse_backend(b)?,
            None => wgpu::Backends::all(),
        };
        let instance = wgpu::Instance::new(wgpu::InstanceDescriptor {
            backends,
            flags: wgpu::InstanceFlags::empty(),
            ..wgpu::InstanceDescriptor::new_without_display_handle()
        });
        let mut adapters = adapters(&instance, backends);
        if adapters.is_empty() {
            bail!(
                "no GPU adapter found (backends: {}). On Linux install a Vulkan driver, e.g. \
                 `apt-get install mesa-vulkan-drivers` for the CPU driver lavapipe",
                backend.as_deref().unwrap_or("all")
            );
        }
        let names: Vec<String> = adapters
            .iter()
            .map(|a| {
                let i = a.get_info();
                format!("{} ({:?}, {:?})", i.name, i.backend, i.device_type)
            })
            .collect();
        if let Some(want) = &wanted_name {
            let want_l = want.to_ascii_lowercase();
            adapters.retain(|a| a.get_info().name.to_ascii_lowercase().contains(&want_l));
            if adapters.is_empty() {
                bail!(
                    "no adapter name contains '{want}' (SIEVE_ADAPTER / --adapter); available: {}",
                    names.join("; ")
                );
            }
        }
        adapters.sort_by_key(|a| {
            let i = a.get_info();
            (backend_rank(i.backend), device_rank(i.device_type))
        });
        let adapter = adapters.remove(0);
        let info = adapter.get_info();
        let kernel_set = opts.kernels.or(settings.kernels).unwrap_or_default();
        let (device, queue) =
            crate::platform::block_on(adapter.request_device(&device_descriptor(&adapter)))
                .with_context(|| format!("opening a device on adapter '{}'", info.name))?;
        let binding = opts.max_binding_override;
        Ok(Self::assemble(
            info, device, queue, binding, kernel_set, settings,
        ))
    }

    /// Runs sieve on a device the application already has (egui, iced,
    /// Bevy): no second device is opened. `adapter` is the one `device` came
    /// from (its name, type and subgroup sizes pick the kernel variants).
    /// sieve needs no feature (it uses SHADER_F16, SUBGROUP, the timestamp
    /// queries and cooperative matrices when the device has them), but some
    /// limits: a device below them is an error naming each limit, its value
    /// and what sieve needs. A device opened with [`device_descriptor`]
    /// has everything sieve can use. Errors are of kind
    /// [`ErrorKind::Gpu`](crate::error::ErrorKind::Gpu).
    pub fn from_wgpu(
        adapter: &wgpu::Adapter,
        device: wgpu::Device,
        queue: wgpu::Queue,
        kernels: Option<KernelSet>,
    ) -> Result<Arc<Self>> {
        use crate::error::{ErrorKind, TagKind};
        (|| {
            let info = adapter.get_info();
            check_limits(&device.limits())
                .with_context(|| format!("the application's device on '{}'", info.name))?;
            let settings = Settings::from_env()?;
            let kernel_set = kernels.or(settings.kernels).unwrap_or_default();
            Ok(Self::assemble(
                info, device, queue, None, kernel_set, settings,
            ))
        })()
        .tag(ErrorKind::Gpu)
    }

    /// A `Gpu` around an open device: its profile, the kernel set and how
    /// kernels compile there.
    fn assemble(
        info: wgpu::AdapterInfo,
        device: wgpu::Device,
        queue: wgpu::Queue,
        max_binding_override: Option<u64>,
        kernel_set: KernelSet,
        settings: Settings,
    ) -> Arc<Self> {
        let features = device.features();
        let limits = device.limits();
        let real_max_binding = limits
            .max_storage_buffer_binding_size
            .min(limits.max_buffer_size);
        let max_binding = match max_binding_override {
            Some(v) => v.min(real_max_binding),
            None => real_max_binding,
        };
        let mut profile = DeviceProfile::new(&info, features, &limits);
        if settings.no_matrix_units {
            profile.coop_f16_16x16 = false;
        }
        let set = kernel_set.resolve(&profile);
        let passthrough = features.contains(wgpu::Features::PASSTHROUGH_SHADERS)
            && info.backend == wgpu::Backend::Vulkan;
        let compile = CompileOptions::new(set, passthrough, &settings);
        Arc::new(Gpu {
            device,
            queue,
            info,
            features,
            limits,
            max_binding,
            profile,
            set,
            compile,
            settings,
            pipelines: Mutex::new(HashMap::new()),
        })
    }

    /// One line naming the adapter, for logs and `sieve info`.
    pub fn describe(&self) -> String {
        format!(
            "{} ({:?}, {:?}, driver {} {})",
            self.info.name,
            self.info.backend,
            self.info.device_type,
            self.info.driver,
            self.info.driver_info
        )
    }

    /// Whether every override constant is a whole number from 1 to the
    /// workgroup's invocation limit, as sieve's launchers set them (lanes,
    /// rows, heads per KV head, head_dim / 4, tile width). Some are loop
    /// steps, and wgpu checks a workgroup size set by an override against
    /// zero only, not against the limits; out of that range a kernel keeps
    /// its loop counters.
    fn constants_in_range(&self, constants: &[(&str, f64)]) -> bool {
        let max = self.limits.max_compute_invocations_per_workgroup as f64;
        constants
            .iter()
            .all(|&(_, v)| v.fract() == 0.0 && (1.0..=max).contains(&v))
    }

    /// Compiles (once) and returns the pipeline for `entry` of a shader assembled
    /// by [`shaders::source`], with the given override constants.
    pub fn pipeline(
        &self,
        shader: &shaders::Shader,
        packed: Option<shaders::Packed>,
        entry: &str,
        constants: &[(&str, f64)],
    ) -> Result<Arc<wgpu::ComputePipeline>> {
        // Sieve's own kernels with override constants in the ranges its
        // launchers use, and others of the same name, are cached apart (the
        // former may be compiled without loop counters).
        let builtin = shaders::is_builtin(shader) && self.constants_in_range(constants);
        let store = self.compile.weight_store;
        let key = format!(
            "{}:{builtin}:{:?}:{store:?}:{}:{:?}",
            shader.name, packed, entry, constants
        );
        if let Some(p) = self.pipelines.lock().unwrap().get(&key) {
            return Ok(p.clone());
        }
        let src = shaders::source(shader, packed, store);
        // wgpu does not check workgroup memory against the device's limit
        // (and some drivers accept more than they report).
        let bytes = shaders::workgroup_bytes(&src, shader.file, entry, constants)?;
        let limit = self.limits.max_compute_workgroup_storage_size as u64;
        if bytes > limit {
            bail!(
                "kernel {} entry {entry} needs {bytes} bytes of workgroup memory; this device allows {limit}",
                shader.file
            );
        }
        let (built, err) = self
            .catch_errors(|| self.build_pipeline(shader, &src, &key, entry, constants, builtin));
        if let Some(err) = err {
            bail!("compiling shader {} entry {entry}: {err}", shader.file);
        }
        let p = Arc::new(built?);
        self.pipelines.lock().unwrap().insert(key, p.clone());
        Ok(p)
    }

    /// Runs `f` with wgpu's validation and internal errors (a shader the
    /// driver's compiler refuses is an internal error) caught, and returns
    /// the first: uncaught, they would reach wgpu's default handler, which
    /// panics.
    pub fn catch_errors<T>(&self, f: impl FnOnce() -> T) -> (T, Option<wgpu::Error>) {
        let validation = self.device.push_error_scope(wgpu::ErrorFilter::Validation);
        let internal = self.device.push_error_scope(wgpu::ErrorFilter::Internal);
        let out = f();
        let internal = crate::platform::block_on(internal.pop());
        let validation = crate::platform::block_on(validation.pop());
        (out, internal.or(validation))
    }

    /// The module and pipeline of [`Gpu::pipeline`] (whose errors wgpu
    /// reports through its error scopes).
    fn build_pipeline(
        &self,
        shader: &shaders::Shader,
        src: &str,
        key: &str,
        entry: &str,
        constants: &[(&str, f64)],
        builtin: bool,
    ) -> Result<wgpu::ComputePipeline> {
        let loop_counters = self.compile.bounded_loops || !builtin;
        if self.compile.spirv.writes(shader) {
            let module = self.passthrough_module(shader, src, entry, constants, loop_counters)?;
            // The override constants are applied already, by naga.
            return self.compute_pipeline(&module, src, shader.file, key, entry, &[]);
        }
        // wgpu compiles WGSL with naga, except on the web, where the
        // browser's compiler reads the source as written.
        let wgsl = if cfg!(target_arch = "wasm32") {
            src.to_string()
        } else {
            shaders::naga_source(src)
        };
        let desc = wgpu::ShaderModuleDescriptor {
            label: Some(shader.name),
            source: wgpu::ShaderSource::Wgsl(wgsl.into()),
        };
        // wgpu adds a 64-bit counter to every shader loop by default, so
        // that a loop that never ends cannot let the driver's compiler assume
        // it unreachable; the counter can also keep that compiler from
        // unrolling a loop and from keeping its arrays in registers (wgpu
        // issue 7698: a pipeline a hundred times slower). sieve drops it
        // for its own kernels only, unless `SIEVE_LOOP_BOUNDING=1`; bounds
        // checks stay on.
        let module = if loop_counters {
            self.device.create_shader_module(desc)
        } else {
            let checks = wgpu::ShaderRuntimeChecks {
                force_loop_bounding: false,
                ..wgpu::ShaderRuntimeChecks::checked()
            };
            // SAFETY: the one check turned off asks that no loop runs
            // forever. Every loop in sieve's kernels counts up by one,
            // halves a positive constant down to zero, or counts in larger
            // steps (a constant, a workgroup size set as an override
            // constant, LANES or SUBGROUP_SIZE, here at most the invocation
            // limit: `constants_in_range`, or the dispatch width, which the
            // kernel clamps below 2^24) up to a constant or to a bound
            // clamped to 2^30 by `bounded()` (or shown small at the loop), and
            // no body changes its counter, so no counter wraps past 2^32
            // whatever the buffers hold, and every loop ends (common.wgsl;
            // tests/shaders.rs checks each loop header).
            unsafe { self.device.create_shader_module_trusted(desc, checks) }
        };
        self.compute_pipeline(&module, src, shader.file, key, entry, constants)
    }

    /// The pipeline of `entry` in `module` (made from `src`), with the
    /// explicit layout of [`Gpu::layout_for`]; workgroup memory is not
    /// zeroed.
    fn compute_pipeline(
        &self,
        module: &wgpu::ShaderModule,
        src: &str,
        file: &str,
        key: &str,
        entry: &str,
        constants: &[(&str, f64)],
    ) -> Result<wgpu::ComputePipeline> {
        let layout = self.layout_for(src, file)?;
        Ok(self
            .device
            .create_compute_pipeline(&wgpu::ComputePipelineDescriptor {
                label: Some(key),
                layout: Some(&layout),
                module,
                entry_point: Some(entry),
                compilation_options: wgpu::PipelineCompilationOptions {
                    constants,
                    zero_initialize_workgroup_memory: false,
                },
                cache: None,
            }))
    }

    /// The module of a kernel whose SPIR-V sieve writes ([`SpirvPath`]):
    /// naga's SPIR-V for `entry` with the override constants applied, under
    /// the GLSL450 memory model (src/spirv.rs), handed to the driver as it
    /// is.
    fn passthrough_module(
        &self,
        shader: &shaders::Shader,
        src: &str,
        entry: &str,
        constants: &[(&str, f64)],
        loop_counters: bool,
    ) -> Result<wgpu::ShaderModule> {
        use crate::spirv::{glsl450_memory_model, kernel_spirv};
        let file = shader.file;
        let (words, size) =
            kernel_spirv(src, file, entry, constants, loop_counters, self.features)?;
        let words = glsl450_memory_model(&words).with_context(|| format!("{file} {entry}"))?;
        // wgpu checks the workgroup size of the modules it writes against
        // the device's limits, and cannot for this one.
        let l = &self.limits;
        let max = [
            l.max_compute_workgroup_size_x,
            l.max_compute_workgroup_size_y,
            l.max_compute_workgroup_size_z,
        ];
        let invocations: u64 = size.iter().map(|&v| v as u64).product();
        if size.iter().zip(max).any(|(&v, m)| v > m)
            || invocations > l.max_compute_invocations_per_workgroup as u64
        {
            bail!(
                "{file} {entry}: workgroup size {size:?} is past the device's limits ({max:?}, {} invocations)",
                l.max_compute_invocations_per_workgroup
            );
        }
        let entry_points = [wgpu::PassthroughShaderEntryPoint {
            name: entry.into(),
            workgroup_size: (size[0], size[1], size[2]),
        }];
        let desc = wgpu::ShaderModuleDescriptorPassthrough {
            label: Some(shader.name),
            entry_points: entry_points[..].into(),
            spirv: Some(words.into()),
            ..Default::default()
        };
        // SAFETY: the words are what naga writes for a module it parsed
        // and validated, with wgpu's Vulkan options where they matter to
        // safety (bounds checks on, buffer indices clamped too, loop
        // counters as wgpu would add them); the one change, the GLSL450 memory model declared
        // instead of the Vulkan one, is refused for any module using what
        // only the Vulkan model defines (`spirv::glsl450_memory_model`).
        // naga validated the module against the device's features (f16,
        // subgroups, cooperative matrices), as wgpu does, its workgroup size
        // is within the limits (above), and the pipeline layout is explicit.
        // What wgpu would check and this path does not: each binding's
        // minimum size (sieve's launchers size every buffer for the shape
        // they dispatch) and the bounds of cooperative loads and stores
        // (naga clamps only their first element, in wgpu's SPIR-V too).
        Ok(unsafe { self.device.create_shader_module_passthrough(desc) })
    }

    /// An explicit layout with every binding the shader declares, so that all
    /// entry points of one file share it (wgpu's automatic layouts keep only the
    /// bindings each entry point uses).
    fn layout_for(&self, src: &str, file: &str) -> Result<wgpu::PipelineLayout> {
        let module =
            shaders::parse(src).map_err(|e| anyhow!("{file}: {}", e.emit_to_string(src)))?;
        let mut entries = Vec::new();
        for (_, var) in module.global_variables.iter() {
            let Some(binding) = &var.binding else {
                continue;
            };
            if binding.group != 0 {
                bail!("{file}: only bind group 0 is used by sieve's kernels");
            }
            let buffer = |ty| wgpu::BindingType::Buffer {
                ty,
                has_dynamic_offset: false,
                min_binding_size: None,
            };
            let ty = match var.space {
                naga::AddressSpace::Uniform => buffer(wgpu::BufferBindingType::Uniform),
                naga::AddressSpace::Storage { access } => {
                    buffer(wgpu::BufferBindingType::Storage {
                        read_only: !access.contains(naga::StorageAccess::STORE),
                    })
                }
                // The textures sieve binds: weights, and the `cpu` products'
                // input, in a texture_2d<u32> (shaders/weights_texture.wgsl,
                // matmul.wgsl), the latter written as a storage texture
                // (x_texture.wgsl).
                naga::AddressSpace::Handle => match module.types[var.ty].inner {
                    naga::TypeInner::Image {
                        dim: naga::ImageDimension::D2,
                        arrayed: false,
                        class:
                            naga::ImageClass::Sampled {
                                kind: naga::ScalarKind::Uint,
                                multi: false,
                            },
                    } => wgpu::BindingType::Texture {
                        sample_type: wgpu::TextureSampleType::Uint,
                        view_dimension: wgpu::TextureViewDimension::D2,
                        multisampled: false,
                    },
                    naga::TypeInner::Image {
                        dim: naga::ImageDimension::D2,
                        arrayed: false,
                        class:
                            naga::ImageClass::Storage {
                                format: naga::StorageFormat::Rgba32Uint,
                                access: naga::StorageAccess::STORE,
                            },
                    } => wgpu::BindingType::StorageTexture {
                        access: wgpu::StorageTextureAccess::WriteOnly,
                        format: wgpu::TextureFormat::Rgba32Uint,
                        view_dimension: wgpu::TextureViewDimension::D2,
                    },
                    ref other => bail!("{file}: unsupported texture binding {other:?}"),
                },
                other => bail!("{file}: unsupported binding {other:?}"),
            };
            entries.push(wgpu::BindGroupLayoutEntry {
                binding: binding.binding,
                visibility: wgpu::ShaderStages::COMPUTE,
                ty,
                count: None,
            });
        }
        entries.sort_by_key(|e| e.binding);
        let bgl = self
            .device
            .create_bind_group_layout(&wgpu::BindGroupLayoutDescriptor {
                label: Some(file),
                entries: &entries,
            });
        Ok(self
            .device
            .create_pipeline_layout(&wgpu::PipelineLayoutDescriptor {
                label: Some(file),
                bind_group_layouts: &[Some(&bgl)],
                immediate_size: 0,
            }))
    }

    /// The most bytes of buffers sieve will try to allocate on this device
    /// in total. wgpu reports no memory size, so this is a ceiling that no
    /// device of this kind can exceed, to refuse impossible sizes before
    /// anything is allocated (a huge `--budget` would otherwise abort the
    /// process in a host allocation): for a CPU implementation (lavapipe),
    /// whose buffers are host memory, the machine's memory when it can be
    /// read; otherwise 64 of the device's largest buffers (256 GiB on an
    /// H200, which has 141 GB). What passes and still does not fit fails at
    /// allocation with the device's out-of-memory error.
    pub fn memory_ceiling(&self) -> u64 {
        let buffers = self.limits.max_buffer_size.saturating_mul(64);
        if self.profile.cpu_implementation {
            if let Some(host) = host_memory_bytes() {
                return host;
            }
        }
        buffers
    }

    /// Checks that a storage buffer of `bytes` can be bound; names the tensor.
    pub fn check_binding(&self, what: &str, bytes: u64) -> Result<()> {
        if bytes > self.max_binding {
            crate::error::bail_kind!(
                crate::error::ErrorKind::GpuOutOfMemory,
                "{what} needs a {bytes}-byte storage binding; this device allows {} bytes per binding",
                self.max_binding
            );
        }
        Ok(())
    }

    /// A zero-initialised storage buffer (at least 16 bytes, so that empty tensors bind).
    pub fn storage(&self, label: &str, bytes: u64) -> wgpu::Buffer {
        self.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some(label),
            size: bytes.max(16).next_multiple_of(4),
            usage: wgpu::BufferUsages::STORAGE
                | wgpu::BufferUsages::COPY_DST
                | wgpu::BufferUsages::COPY_SRC,
            mapped_at_creation: false,
        })
    }

    /// A storage buffer holding `data`.
    pub fn storage_from<T: bytemuck::Pod>(&self, label: &str, data: &[T]) -> wgpu::Buffer {
        let bytes: &[u8] = bytemuck::cast_slice(data);
        let buf = self.storage(label, bytes.len() as u64);
        if !bytes.is_empty() {
            self.write(&buf, 0, bytes);
        }
        buf
    }

    /// Writes bytes, padding the tail to 4 bytes as wgpu requires.
    pub fn write(&self, buf: &wgpu::Buffer, offset: u64, bytes: &[u8]) {
        if bytes.len().is_multiple_of(4) {
            self.queue.write_buffer(buf, offset, bytes);
        } else {
            let mut padded = bytes.to_vec();
            padded.resize(bytes.len().next_multiple_of(4), 0);
            self.queue.write_buffer(buf, offset, &padded);
        }
    }

    /// A uniform buffer holding one parameter struct.
    pub fn uniform<T: bytemuck::Pod>(&self, label: &str, value: &T) -> wgpu::Buffer {
        let bytes = bytemuck::bytes_of(value);
        let buf = self.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some(label),
            size: (bytes.len() as u64).next_multiple_of(16),
            usage: wgpu::BufferUsages::UNIFORM | wgpu::BufferUsages::COPY_DST,
            mapped_at_creation: false,
        });
        self.write(&buf, 0, bytes);
        buf
    }

    /// Bind group for group 0 of `pipeline`: binding i is the whole of `buffers[i]`.
    pub fn bind_group(
        &self,
        pipeline: &wgpu::ComputePipeline,
        buffers: &[&wgpu::Buffer],
    ) -> wgpu::BindGroup {
        let resources: Vec<_> = buffers.iter().map(|b| b.as_entire_binding()).collect();
        self.bind_group_of(pipeline, &resources)
    }

    /// Bind group for group 0 of a weight-reading kernel: bindings 0 and 1
    /// are `head`, binding 2 the weight part `w` (a buffer or a texture:
    /// `MatrixPart::binding`), bindings 3, 4, ... `rest`, then `extra` if
    /// given (the products' copy of their input: the `cpu` ones' texture,
    /// matmul.wgsl, or the f16 buffer of matmul_coop.wgsl).
    pub fn bind_group_with_weights(
        &self,
        pipeline: &wgpu::ComputePipeline,
        head: [&wgpu::Buffer; 2],
        w: wgpu::BindingResource,
        rest: &[&wgpu::Buffer],
        extra: Option<wgpu::BindingResource>,
    ) -> wgpu::BindGroup {
        let mut resources: Vec<_> = head.iter().map(|b| b.as_entire_binding()).collect();
        resources.push(w);
        resources.extend(rest.iter().map(|b| b.as_entire_binding()));
        resources.extend(extra);
        self.bind_group_of(pipeline, &resources)
    }

    /// Bind group for group 0 of `pipeline`: binding i is `resources[i]`.
    pub(crate) fn bind_group_of(
        &self,
        pipeline: &wgpu::ComputePipeline,
        resources: &[wgpu::BindingResource],
    ) -> wgpu::BindGroup {
        let layout = pipeline.get_bind_group_layout(0);
        let entries: Vec<wgpu::BindGroupEntry> = resources
            .iter()
            .enumerate()
            .map(|(i, r)| wgpu::BindGroupEntry {
                binding: i as u32,
                resource: r.clone(),
            })
            .collect();
        self.device.create_bind_group(&wgpu::BindGroupDescriptor {
            label: None,
            layout: &layout,
            entries: &entries,
        })
    }

    /// A buffer that copies land in and the host maps to read them.
    pub fn readback(&self, label: &str, bytes: u64) -> wgpu::Buffer {
        self.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some(label),
            size: bytes.next_multiple_of(4).max(4),
            usage: wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST,
            mapped_at_creation: false,
        })
    }

    /// Copies `bytes` bytes at `offset` of `src` back to the host (blocking).
    pub fn read_bytes(&self, src: &wgpu::Buffer, offset: u64, bytes: u64) -> Result<Vec<u8>> {
        let size = bytes.next_multiple_of(4);
        let staging = self.readback("readback", size);
        let mut enc = self.device.create_command_encoder(&Default::default());
        enc.copy_buffer_to_buffer(src, offset, &staging, 0, size);
        self.queue.submit([enc.finish()]);
        self.map_and_read(&staging, bytes)
    }

    /// Maps a MAP_READ buffer whose copy has been submitted and returns its first bytes.
    pub fn map_and_read(&self, staging: &wgpu::Buffer, bytes: u64) -> Result<Vec<u8>> {
        self.map_and_read_after(staging, bytes, None)
    }

    /// Reads a MAP_READ buffer last written by `submission`, waiting for that
    /// submission only (None: for all of them): work submitted after it
    /// keeps the GPU busy meanwhile.
    pub fn map_and_read_after(
        &self,
        staging: &wgpu::Buffer,
        bytes: u64,
        submission: Option<wgpu::SubmissionIndex>,
    ) -> Result<Vec<u8>> {
        let slice = staging.slice(..);
        let (tx, rx) = std::sync::mpsc::channel();
        slice.map_async(wgpu::MapMode::Read, move |r| {
            let _ = tx.send(r);
        });
        let mapped = crate::platform::recv_after(&self.device, &self.queue, submission, &rx)?;
        mapped.map_err(|e| anyhow!("mapping a readback buffer: {e}"))?;
        let out = slice
            .get_mapped_range()
            .map_err(|e| anyhow!("reading a mapped buffer: {e:?}"))?[..bytes as usize]
            .to_vec();
        staging.unmap();
        Ok(out)
    }

    pub fn read<T: bytemuck::Pod>(
        &self,
        src: &wgpu::Buffer,
        offset_elems: u64,
        n: usize,
    ) -> Result<Vec<T>> {
        let es = std::mem::size_of::<T>() as u64;
        let bytes = self.read_bytes(src, offset_elems * es, n as u64 * es)?;
        Ok(bytemuck::pod_collect_to_vec(&bytes))
    }
}

/// Total memory of this machine (Linux: MemTotal in /proc/meminfo).
fn host_memory_bytes() -> Option<u64> {
    let info = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = info.lines().find(|l| l.starts_with("MemTotal:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    kib.checked_mul(1024)
}

/// The device sieve asks of `adapter`: the adapter's own limits (sieve's
/// buffers are as large as the device allows) and, where offered, SHADER_F16,
/// SUBGROUP, the timestamp queries and the cooperative-matrix configuration
/// of sieve's GEMM. An application that opens the device itself (egui's
/// `WgpuSetupCreateNew::device_descriptor`, say) and shares it with sieve
/// through [`Gpu::from_wgpu`] asks for this, so sieve runs its fastest
/// kernels there; the application's own needs are within the adapter's
/// limits too.
pub fn device_descriptor(adapter: &wgpu::Adapter) -> wgpu::DeviceDescriptor<'static> {
    let mut want_features = wgpu::Features::SHADER_F16
        | wgpu::Features::SUBGROUP
        | wgpu::Features::TIMESTAMP_QUERY
        | wgpu::Features::TIMESTAMP_QUERY_INSIDE_ENCODERS
        | wgpu::Features::TIMESTAMP_QUERY_INSIDE_PASSES;
    // Cooperative matrices (tensor cores) only where the adapter offers the
    // configuration sieve's GEMM uses; the feature is experimental in wgpu.
    let coop = adapter
        .features()
        .contains(wgpu::Features::EXPERIMENTAL_COOPERATIVE_MATRIX)
        && has_coop_f16_16x16(&adapter.cooperative_matrix_properties());
    if coop {
        want_features |= wgpu::Features::EXPERIMENTAL_COOPERATIVE_MATRIX;
    }
    // SPIR-V handed to a Vulkan driver as it is: sieve's cooperative kernels
    // under the GLSL450 memory model (`SpirvPath`).
    if adapter.get_info().backend == wgpu::Backend::Vulkan {
        want_features |= wgpu::Features::PASSTHROUGH_SHADERS;
    }
    let experimental_features = if coop {
        // SAFETY: wgpu asks callers of experimental features to accept that
        // their implementation may have bugs; sieve uses only the
        // cooperative-matrix load, multiply-add and store, in the kernels
        // that use them (mat-muls, prefill attention), each checked against
        // a CPU reference whenever a device is opened (`Gpu::assemble`).
        unsafe { wgpu::ExperimentalFeatures::enabled() }
    } else {
        wgpu::ExperimentalFeatures::disabled()
    };
    wgpu::DeviceDescriptor {
        label: Some("sieve"),
        required_features: adapter.features() & want_features,
        required_limits: adapter.limits(),
        experimental_features,
        memory_hints: wgpu::MemoryHints::Performance,
        trace: wgpu::Trace::Off,
    }
}

/// Checks that a device's limits are enough for sieve's kernels: the most
/// storage and uniform buffers any kernel binds (counted from the WGSL with
/// naga), 256 invocations per workgroup, 65,535 workgroups per dimension.
/// Workgroup memory is checked per kernel when it is built.
pub fn check_limits(limits: &wgpu::Limits) -> Result<()> {
    let (mut storage, mut uniform) = (0u32, 0u32);
    for shader in shaders::all() {
        // f16 (the first of each list), weights in a buffer: the most
        // storage bindings.
        let format = shaders::formats(shader)[0];
        let src = shaders::source(shader, format, shaders::WeightStore::Buffer);
        let module = shaders::parse(&src)
            .map_err(|e| anyhow!("{}: {}", shader.file, e.emit_to_string(&src)))?;
        let count = |f: fn(&naga::AddressSpace) -> bool| {
            module
                .global_variables
                .iter()
                .filter(|(_, v)| v.binding.is_some() && f(&v.space))
                .count() as u32
        };
        storage = storage.max(count(|s| matches!(s, naga::AddressSpace::Storage { .. })));
        uniform = uniform.max(count(|s| matches!(s, naga::AddressSpace::Uniform)));
    }
    let needs = [
        (
            "max_storage_buffers_per_shader_stage",
            limits.max_storage_buffers_per_shader_stage,
            storage,
        ),
        (
            "max_uniform_buffers_per_shader_stage",
            limits.max_uniform_buffers_per_shader_stage,
            uniform,
        ),
        (
            "max_compute_invocations_per_workgroup",
            limits.max_compute_invocations_per_workgroup,
            256,
        ),
        (
            "max_compute_workgroup_size_x",
            limits.max_compute_workgroup_size_x,
            256,
        ),
        (
            "max_compute_workgroups_per_dimension",
            limits.max_compute_workgroups_per_dimension,
            65535,
        ),
    ];
    let short: Vec<String> = needs
        .iter()
        .filter(|(_, has, need)| has < need)
        .map(|(name, has, need)| format!("{name} is {has}, sieve needs {need}"))
        .collect();
    if !short.is_empty() {
        bail!(
            "the device's limits are too low: {} (request the adapter's limits when creating the device)",
            short.join("; ")
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::{Gpu, GpuOptions};
    use std::sync::Arc;

    fn gpu() -> Arc<Gpu> {
        Gpu::new(&GpuOptions::default()).expect("a GPU adapter (lavapipe on CI)")
    }

    /// Only override constants in the ranges sieve's launchers use may be
    /// compiled without loop counters: some are loop steps, and wgpu checks
    /// a workgroup size set by an override against zero only.
    #[test]
    fn override_constants_outside_the_launchers_ranges_keep_the_counters() {
        let gpu = gpu();
        let max = gpu.limits.max_compute_invocations_per_workgroup as f64;
        assert!(gpu.constants_in_range(&[]));
        assert!(gpu.constants_in_range(&[("LANES", 256.0), ("ROWS", 8.0), ("HD4", 1.0)]));
        assert!(gpu.constants_in_range(&[("SUBGROUP_SIZE", max)]));
        for bad in [0.0, -1.0, 1.5, max + 1.0, (1u64 << 29) as f64, f64::NAN] {
            assert!(
                !gpu.constants_in_range(&[("ROWS", 2.0), ("LANES", bad)]),
                "{bad} accepted"
            );
        }
    }

    /// On Vulkan, wgpu offers passthrough on every device, so sieve's own
    /// SPIR-V path is the one `SIEVE_SPIRV` asks for (`coop` unset; CI runs
    /// the kernel tests again with `all`, so this fails there if those runs
    /// went through wgpu's path instead); elsewhere wgpu writes everything.
    #[test]
    fn sieve_writes_spirv_where_the_driver_takes_it() {
        use crate::device::SpirvPath;
        let gpu = gpu();
        if gpu.info.backend == wgpu::Backend::Vulkan {
            assert!(gpu.features.contains(wgpu::Features::PASSTHROUGH_SHADERS));
            let asked = crate::device::Settings::from_env().unwrap().spirv;
            assert_eq!(gpu.compile.spirv, asked);
        } else {
            assert_eq!(gpu.compile.spirv, SpirvPath::Wgpu);
        }
    }

    /// A kernel is refused, with an error naming it, when its workgroup
    /// memory is past the device's limit (wgpu does not check it); at the
    /// limit it is built.
    #[test]
    fn pipelines_past_the_workgroup_memory_limit_are_refused() {
        let gpu = gpu();
        let limit = gpu.limits.max_compute_workgroup_storage_size;
        let kernel = |words: u32| {
            let body = format!(
                "var<workgroup> tile: array<u32, {words}>;
@group(0) @binding(0) var<storage, read_write> out: array<u32>;
@compute @workgroup_size(64)
fn main(@builtin(local_invocation_index) i: u32) {{
    tile[i] = i;
    workgroupBarrier();
    out[i] = tile[63u - i] + tile[{words}u - 1u];
}}"
            );
            // (Pipelines are cached by kernel name.)
            crate::shaders::Shader {
                name: Box::leak(format!("workgroup-probe-{words}").into_boxed_str()),
                file: "workgroup_probe.wgsl",
                body: Box::leak(body.into_boxed_str()),
                prelude: crate::shaders::Prelude::None,
                include: "",
            }
        };
        gpu.pipeline(&kernel(limit / 4), None, "main", &[]).unwrap();
        let e = gpu
            .pipeline(&kernel(limit / 4 + 1), None, "main", &[])
            .unwrap_err();
        let want = format!(
            "kernel workgroup_probe.wgsl entry main needs {} bytes of workgroup memory; this device allows {limit}",
            limit + 16 // one word more, rounded up to 16 bytes
        );
        assert!(format!("{e:#}").contains(&want), "{e:#}");
    }

    /// A kernel whose SPIR-V sieve writes is refused, with an error naming
    /// it, when its workgroup is past the device's limits (wgpu checks that
    /// only for the modules it writes); within them it is built.
    #[test]
    fn sieve_spirv_checks_the_workgroup_size() {
        let gpu = gpu();
        if !gpu.features.contains(wgpu::Features::PASSTHROUGH_SHADERS)
            || gpu.info.backend != wgpu::Backend::Vulkan
        {
            eprintln!("note: no SPIR-V passthrough on this device; nothing to check");
            return;
        }
        let shader = &crate::shaders::MATVEC_WORKGROUP;
        let src = crate::shaders::source(
            shader,
            Some(crate::formats::WeightFormat::F16.into()),
            crate::shaders::WeightStore::Buffer,
        );
        let max = gpu.limits.max_compute_invocations_per_workgroup;
        let build = |lanes: u32| {
            let constants = [("LANES", lanes as f64), ("ROWS", 2.0)];
            gpu.catch_errors(|| gpu.passthrough_module(shader, &src, "matvec", &constants, true))
        };
        let (built, err) = build(64);
        assert!(built.is_ok() && err.is_none(), "{:?} {err:?}", built.err());
        let (refused, _) = build(2 * max);
        let e = format!("{:#}", refused.expect_err("a workgroup past the limits"));
        assert!(
            e.contains("matvec_workgroup.wgsl matvec: workgroup size"),
            "{e}"
        );
    }
}
