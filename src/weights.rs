//! Weights: safetensors files (single or sharded) memory-mapped and uploaded to
//! the GPU tensor by tensor, converted to the chosen storage format on the way.
//!
//! Only one tensor's converted copy is in host memory at a time. Matrices larger
//! than the device's largest storage binding are split into row parts
//! ([`GpuMatrix`]); kernels that read weights launch once per part.

use anyhow::{bail, Context, Result};
use half::{bf16, f16};
use memmap2::Mmap;
use safetensors::{Dtype, SafeTensors};
use std::collections::HashMap;
use std::path::{Path, PathBuf};

use crate::formats::WeightFormat;
use crate::gpu::Gpu;
use crate::shaders::WeightStore;

/// A memory-mapped set of safetensors files and the tensor names each holds.
pub struct TensorStore {
    files: Vec<(PathBuf, Mmap)>,
    /// tensor name -> index into `files`
    index: HashMap<String, usize>,
}

/// One tensor as f32 values with its shape (host side, transient).
pub struct HostTensor {
    pub shape: Vec<usize>,
    pub data: Vec<f32>,
}

impl TensorStore {
    /// Opens `model.safetensors` or the shards named by `model.safetensors.index.json`.
    pub fn open(dir: &Path) -> Result<Self> {
        let single = dir.join("model.safetensors");
        let index_path = dir.join("model.safetensors.index.json");
        let paths: Vec<PathBuf> = if single.exists() {
            vec![single]
        } else if index_path.exists() {
            let text = std::fs::read_to_string(&index_path)
                .with_context(|| format!("reading {}", index_path.display()))?;
            let v: serde_json::Value = serde_json::from_str(&text)
                .with_context(|| format!("{}: not valid JSON", index_path.display()))?;
            let map = v
                .get("weight_map")
                .and_then(|m| m.as_object())
                .with_context(|| format!("{}: no 'weight_map' object", index_path.display()))?;
            let mut files = Vec::new();
            for (tensor, f) in map {
                // Shards are files in the model folder: a name with a folder
                // part (`../../etc/passwd`, `/abs`) would open a file outside it.
                let name = f.as_str().filter(|f| {
                    let mut parts = Path::new(f).components();
                    matches!(
                        (parts.next(), parts.next()),
                        (Some(std::path::Component::Normal(_)), None)
                    )
                });
                let Some(name) = name else {
                    bail!(
                        "{}: tensor '{tensor}' maps to {f}, which is not a file name in the model folder",
                        index_path.display()
                    );
                };
                files.push(name.to_string());
            }
            files.sort();
            files.dedup();
            files.into_iter().map(|f| dir.join(f)).collect()
        } else {
            bail!(
                "{}: no model.safetensors or model.safetensors.index.json",
                dir.display()
            );
        };
        let mut files = Vec::new();
        let mut index = HashMap::new();
        for path in paths {
            let file = std::fs::File::open(&path)
                .with_context(|| format!("opening {}", path.display()))?;
            // SAFETY: the file is opened read-only; sieve never writes model files it maps.
            let mmap = unsafe { Mmap::map(&file) }
                .with_context(|| format!("mapping {}", path.display()))?;
            let st = SafeTensors::deserialize(&mmap).map_err(|e| {
                anyhow::anyhow!("{}: not a valid safetensors file ({e})", path.display())
            })?;
            for name in st.names() {
                index.insert(name.to_string(), files.len());
            }
            files.push((path, mmap));
        }
        Ok(TensorStore { files, index })
    }

    pub fn contains(&self, name: &str) -> bool {
        self.index.contains_key(name)
    }

    /// Reads one tensor and converts it to f32 (f32, f16 and bf16 are accepted).
    pub fn read(&self, name: &str) -> Result<HostTensor> {
        let &fi = self.index.get(name).with_context(|| {
            format!("tensor '{name}' is missing from the model's safetensors files")
        })?;
        let (path, mmap) = &self.files[fi];
        let st = SafeTensors::deserialize(mmap).map_err(|e| {
            anyhow::anyhow!("{}: not a valid safetensors file ({e})", path.display())
        })?;
        let view = st
            .tensor(name)
            .map_err(|e| anyhow::anyhow!("{}: tensor '{name}': {e}", path.display()))?;
        let bytes = view.data();
        let data: Vec<f32> = match view.dtype() {
            Dtype::F32 => bytes
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect(),
            Dtype::F16 => bytes
                .chunks_exact(2)
                .map(|c| f16::from_le_bytes([c[0], c[1]]).to_f32())
                .collect(),
            Dtype::BF16 => bytes
                .chunks_exact(2)
                .map(|c| bf16::from_le_bytes([c[0], c[1]]).to_f32())
                .collect(),
            other => bail!(
                "{}: tensor '{name}' has dtype {other:?}; supported: F32, F16, BF16",
                path.display()
            ),
        };
        // A NaN or infinity in any weight makes every logit NaN: refuse it
        // here, naming the tensor (one more pass over values being converted
        // anyway).
        if let Some(i) = data.iter().position(|v| !v.is_finite()) {
            bail!(
                "{}: tensor '{name}' holds {} at flat index {i}; weights must be finite",
                path.display(),
                data[i]
            );
        }
        Ok(HostTensor {
            shape: view.shape().to_vec(),
            data,
        })
    }

    /// Reads a tensor and checks its shape.
    pub fn read_shaped(&self, name: &str, shape: &[usize]) -> Result<HostTensor> {
        let t = self.read(name)?;
        if t.shape != shape {
            bail!(
                "tensor '{name}' has shape {:?}; the config implies {:?}",
                t.shape,
                shape
            );
        }
        Ok(t)
    }
}

/// Where weight values come from: safetensors files ([`TensorStore`]) or
/// random values generated on the GPU (`crate::synthetic`).
pub trait WeightSource {
    /// Fills rows `row0 .. row0 + rows` of `m` with the tensor `name`
    /// (shape `[rows, m.cols]`).
    fn fill_rows(
        &self,
        gpu: &Gpu,
        m: &GpuMatrix,
        row0: usize,
        rows: usize,
        name: &str,
    ) -> Result<()>;
    /// A small vector tensor (norm weight, bias) of `len` values.
    fn vector(&self, name: &str, len: usize) -> Result<Vec<f32>>;
    /// Whether the tensor exists (an untied LM head).
    fn contains(&self, name: &str) -> bool;
    /// The format that keeps the tensor `name` as it is stored, when there
    /// is one (a GGUF file's quantized tensors); None lets the loader choose.
    fn stored_format(&self, _name: &str) -> Option<WeightFormat> {
        None
    }
}

impl WeightSource for TensorStore {
    fn fill_rows(
        &self,
        gpu: &Gpu,
        m: &GpuMatrix,
        row0: usize,
        rows: usize,
        name: &str,
    ) -> Result<()> {
        let t = self.read_shaped(name, &[rows, m.cols])?;
        m.write_rows(gpu, row0, &t.data, name)
    }

    fn vector(&self, name: &str, len: usize) -> Result<Vec<f32>> {
        Ok(self.read_shaped(name, &[len])?.data)
    }

    fn contains(&self, name: &str) -> bool {
        TensorStore::contains(self, name)
    }
}

/// Converts f32 values (whole rows of `cols`) to the bytes of the storage format:
/// quantized formats are quantized (src/quant.rs). f16 storage rejects
/// values outside f16's range (bf16 checkpoints can hold them) instead of
/// silently turning them into infinities.
pub fn encode(values: &[f32], cols: usize, format: WeightFormat, what: &str) -> Result<Vec<u8>> {
    match format {
        WeightFormat::F32 => Ok(bytemuck::cast_slice(values).to_vec()),
        WeightFormat::F16 => {
            let mut out = Vec::with_capacity(values.len() * 2);
            for &v in values {
                let h = f16::from_f32(v);
                if h.is_infinite() && v.is_finite() {
                    bail!("{what}: value {v} does not fit in f16; load the weights as f32 (LoadOptions::dtype)");
                }
                out.extend_from_slice(&h.to_le_bytes());
            }
            Ok(out)
        }
        quantized => {
            let words = crate::formats::repack::encode(quantized, values, cols)
                .with_context(|| what.to_string())?;
            Ok(bytemuck::cast_slice(&words).to_vec())
        }
    }
}

/// The most bytes one row part of a weight matrix may hold on `gpu`: a
/// storage binding, or for weights in textures also the largest texture of
/// [`WEIGHT_TEXTURE_WIDTH`] texels per row.
pub fn max_weight_part(gpu: &Gpu) -> u64 {
    match gpu.compile.weight_store {
        WeightStore::Buffer => gpu.max_binding,
        WeightStore::Texture => gpu
            .max_binding
            .min(WEIGHT_TEXTURE_WIDTH as u64 * gpu.limits.max_texture_dimension_2d as u64 * 16),
    }
}

/// Texels per row of a weights texture (`W_TEXTURE_SHIFT` in
/// shaders/weights_texture.wgsl is its log2): a power of two, so that the
/// kernels find a texel with a shift and a mask, and small, so that the
/// padding of a part's last texture row stays under 64 KiB.
pub const WEIGHT_TEXTURE_WIDTH: u32 = 4096;

/// One row part of a matrix on the GPU, in one storage format.
pub struct MatrixPart {
    pub row0: usize,
    pub rows: usize,
    pub format: WeightFormat,
    store: PartStore,
}

/// Where a part's bytes live ([`WeightStore`], chosen with the kernel set).
enum PartStore {
    Buffer(wgpu::Buffer),
    /// An Rgba32Uint texture of `WEIGHT_TEXTURE_WIDTH` texels per row, the
    /// part's bytes in order. Writes (uploads, the synthetic models' random
    /// fill) go to a staging buffer of the texture's size, copied into the
    /// texture (and dropped) when the part is first bound; a write after
    /// that first copies the texture back into a new staging buffer.
    Texture {
        texture: wgpu::Texture,
        view: wgpu::TextureView,
        staging: std::sync::Mutex<Option<wgpu::Buffer>>,
    },
}

impl MatrixPart {
    fn new(
        gpu: &Gpu,
        label: &str,
        row0: usize,
        rows: usize,
        format: WeightFormat,
        bytes: u64,
    ) -> Self {
        let store = match gpu.compile.weight_store {
            WeightStore::Buffer => PartStore::Buffer(gpu.storage(label, bytes)),
            WeightStore::Texture => {
                let texture = texel_texture(
                    gpu,
                    label,
                    texture_extent(bytes),
                    wgpu::TextureUsages::COPY_DST | wgpu::TextureUsages::COPY_SRC,
                );
                let view = texture.create_view(&Default::default());
                PartStore::Texture {
                    texture,
                    view,
                    staging: std::sync::Mutex::new(None),
                }
            }
        };
        MatrixPart {
            row0,
            rows,
            format,
            store,
        }
    }

    /// The buffer the part's words are written into: the part itself, or
    /// the staging buffer of its texture (made, from the texture's
    /// contents, if the part was bound since the last write).
    pub fn write_target(&self, gpu: &Gpu) -> wgpu::Buffer {
        match &self.store {
            PartStore::Buffer(b) => b.clone(),
            PartStore::Texture {
                texture, staging, ..
            } => {
                let mut staging = staging.lock().unwrap();
                staging
                    .get_or_insert_with(|| {
                        let size = texture.size();
                        let bytes = texture_bytes(size);
                        let buf = gpu.storage("weights-staging", bytes);
                        let mut enc = gpu.device.create_command_encoder(&Default::default());
                        enc.copy_texture_to_buffer(
                            texture.as_image_copy(),
                            texel_rows(&buf, size),
                            size,
                        );
                        gpu.queue.submit([enc.finish()]);
                        buf
                    })
                    .clone()
            }
        }
    }

    /// The part's buffer, where it is stored in one ([`WeightStore::Buffer`]):
    /// what the cooperative GEMM that loads f16 weights straight from
    /// memory binds.
    pub fn buffer(&self) -> Option<&wgpu::Buffer> {
        match &self.store {
            PartStore::Buffer(b) => Some(b),
            PartStore::Texture { .. } => None,
        }
    }

    /// The part's resource for binding 2 of a weight-reading kernel (a
    /// texture's pending writes copied in first).
    pub fn binding(&self, gpu: &Gpu) -> wgpu::BindingResource<'_> {
        match &self.store {
            PartStore::Buffer(b) => b.as_entire_binding(),
            PartStore::Texture {
                texture,
                view,
                staging,
            } => {
                if let Some(buf) = staging.lock().unwrap().take() {
                    let size = texture.size();
                    let mut enc = gpu.device.create_command_encoder(&Default::default());
                    enc.copy_buffer_to_texture(
                        texel_rows(&buf, size),
                        texture.as_image_copy(),
                        size,
                    );
                    gpu.queue.submit([enc.finish()]);
                }
                wgpu::BindingResource::TextureView(view)
            }
        }
    }
}

/// A sampled Rgba32Uint texture of (width, height) texels, also usable as
/// `usage` says: a weight part's, or the read-bandwidth probe's.
pub(crate) fn texel_texture(
    gpu: &Gpu,
    label: &str,
    (width, height): (u32, u32),
    usage: wgpu::TextureUsages,
) -> wgpu::Texture {
    gpu.device.create_texture(&wgpu::TextureDescriptor {
        label: Some(label),
        size: wgpu::Extent3d {
            width,
            height,
            depth_or_array_layers: 1,
        },
        mip_level_count: 1,
        sample_count: 1,
        dimension: wgpu::TextureDimension::D2,
        format: wgpu::TextureFormat::Rgba32Uint,
        usage: wgpu::TextureUsages::TEXTURE_BINDING | usage,
        view_formats: &[],
    })
}

/// The texture extent (width, height in texels) that holds `bytes`: rows
/// of `WEIGHT_TEXTURE_WIDTH` texels, or one row of a multiple of 16 texels
/// (copies between buffers and textures move rows of a multiple of 256
/// bytes).
fn texture_extent(bytes: u64) -> (u32, u32) {
    let texels = bytes.max(16).div_ceil(16);
    let width = texels.next_multiple_of(16).min(WEIGHT_TEXTURE_WIDTH as u64) as u32;
    let height = texels.div_ceil(width as u64) as u32;
    (width, height)
}

fn texture_bytes(size: wgpu::Extent3d) -> u64 {
    size.width as u64 * size.height as u64 * 16
}

/// A buffer laid out as the texture's rows, back to back.
fn texel_rows(buf: &wgpu::Buffer, size: wgpu::Extent3d) -> wgpu::TexelCopyBufferInfo<'_> {
    wgpu::TexelCopyBufferInfo {
        buffer: buf,
        layout: wgpu::TexelCopyBufferLayout {
            offset: 0,
            bytes_per_row: Some(size.width * 16),
            rows_per_image: Some(size.height),
        },
    }
}

/// A `[rows, cols]` weight matrix (nn.Linear layout), split into row parts that
/// each fit one storage binding. A stacked matrix (q|k|v, gate|up) may hold
/// its tensors in different formats (a Q4_K_M file's q and k in Q4_K, v in
/// Q6_K): each part has one, and a part never spans two.
pub struct GpuMatrix {
    pub rows: usize,
    pub cols: usize,
    pub parts: Vec<MatrixPart>,
}

impl GpuMatrix {
    /// A matrix in one format.
    pub fn new(
        gpu: &Gpu,
        label: &str,
        rows: usize,
        cols: usize,
        format: WeightFormat,
    ) -> Result<Self> {
        Self::stacked(gpu, label, cols, &[(rows, format)])
    }

    /// A matrix of row blocks `(rows, format)` stacked in order.
    pub fn stacked(
        gpu: &Gpu,
        label: &str,
        cols: usize,
        blocks: &[(usize, WeightFormat)],
    ) -> Result<Self> {
        let mut parts = Vec::new();
        let mut row0 = 0;
        // Neighbours in one format share their parts.
        let mut merged: Vec<(usize, WeightFormat)> = vec![];
        for &(rows, format) in blocks {
            match merged.last_mut() {
                Some((r, f)) if *f == format => *r += rows,
                _ => merged.push((rows, format)),
            }
        }
        for (rows, format) in merged {
            format.check_cols(cols, label)?;
            let row_bytes = format.row_bytes(cols);
            // Parts hold a multiple of 4 rows: the matmul kernel works in
            // 4-row blocks.
            let rows_per_part = ((max_weight_part(gpu) / row_bytes) as usize / 4) * 4;
            if rows_per_part == 0 {
                bail!(
                    "{label}: one row of {row_bytes} bytes exceeds the device's {} bytes per weight part (its largest {})",
                    max_weight_part(gpu),
                    match gpu.compile.weight_store {
                        WeightStore::Buffer => "storage binding",
                        WeightStore::Texture => "texture",
                    }
                );
            }
            let end = row0 + rows;
            while row0 < end {
                let n = rows_per_part.min(end - row0);
                let bytes = n as u64 * row_bytes;
                parts.push(MatrixPart::new(
                    gpu,
                    &format!("{label}[{row0}..]"),
                    row0,
                    n,
                    format,
                    bytes,
                ));
                row0 += n;
            }
        }
        Ok(GpuMatrix {
            rows: row0,
            cols,
            parts,
        })
    }

    /// The format of row `row` (None past the last row).
    pub fn format_at(&self, row: usize) -> Option<WeightFormat> {
        self.parts
            .iter()
            .find(|p| (p.row0..p.row0 + p.rows).contains(&row))
            .map(|p| p.format)
    }

    /// The one format of a matrix whose parts all share it (an embedding
    /// table, an LM head); an error for a mixed stack.
    pub fn single_format(&self, what: &str) -> Result<WeightFormat> {
        let first = self.parts.first().map(|p| p.format);
        match first {
            Some(f) if self.parts.iter().all(|p| p.format == f) => Ok(f),
            _ => bail!("{what}: the matrix mixes weight formats, which this kernel cannot read"),
        }
    }

    /// Each format with the bytes the matrix holds in it.
    pub fn format_bytes(&self) -> Vec<(WeightFormat, u64)> {
        let mut out: Vec<(WeightFormat, u64)> = vec![];
        for p in &self.parts {
            let b = p.rows as u64 * p.format.row_bytes(self.cols);
            match out.iter_mut().find(|(f, _)| *f == p.format) {
                Some((_, bytes)) => *bytes += b,
                None => out.push((p.format, b)),
            }
        }
        out
    }

    /// Writes `values` (whole rows, f32) starting at row `row0`, encoded in
    /// the format of the parts they land in.
    pub fn write_rows(&self, gpu: &Gpu, row0: usize, values: &[f32], what: &str) -> Result<()> {
        self.write_encoded(gpu, row0, values.len(), what, |lo, hi, format| {
            encode(
                &values[lo * self.cols..hi * self.cols],
                self.cols,
                format,
                what,
            )
        })
    }

    /// Writes rows starting at `row0` from llama.cpp blocks of the (quantized)
    /// format of the parts they land in, whole rows, repacked into the GPU
    /// layout.
    pub fn write_blocks(&self, gpu: &Gpu, row0: usize, blocks: &[u8], what: &str) -> Result<()> {
        let format = self.format_at(row0).unwrap_or(WeightFormat::F32);
        let b = format
            .block()
            .with_context(|| format!("{what}: {} is not a block format", format.name()))?;
        let row_in = self.cols / b.values * b.ggml.block_bytes() as usize;
        if !blocks.len().is_multiple_of(row_in) {
            bail!(
                "{what}: {} bytes are not whole rows of {row_in} bytes of {}",
                blocks.len(),
                b.ggml
            );
        }
        if let Some((i, v)) = b.first_nonfinite_scale(blocks) {
            bail!(
                "{what}: block {i} (row {}) has the scale {v}; a {} block's scales must be finite",
                row0 + i * b.values / self.cols,
                b.ggml
            );
        }
        let values = blocks.len() / row_in * self.cols;
        self.write_encoded(gpu, row0, values, what, |lo, hi, part_format| {
            if part_format != format {
                bail!(
                    "{what}: {} blocks cannot fill rows stored as {}",
                    format.name(),
                    part_format.name()
                );
            }
            let mut words = Vec::new();
            crate::formats::repack::repack(
                format,
                &blocks[lo * row_in..hi * row_in],
                self.cols,
                &mut words,
            );
            Ok(bytemuck::cast_slice(&words).to_vec())
        })
    }

    /// Writes `n_values` values (whole rows) from row `row0`, part by part;
    /// `encode(lo, hi, format)` gives the bytes of rows `row0 + lo .. row0 + hi`
    /// in the format of their part.
    fn write_encoded(
        &self,
        gpu: &Gpu,
        row0: usize,
        n_values: usize,
        what: &str,
        encode: impl Fn(usize, usize, WeightFormat) -> Result<Vec<u8>>,
    ) -> Result<()> {
        if !n_values.is_multiple_of(self.cols) || row0 + n_values / self.cols > self.rows {
            bail!(
                "{what}: {n_values} values do not fit rows {row0}.. of a {}x{} matrix",
                self.rows,
                self.cols
            );
        }
        let n_rows = n_values / self.cols;
        for part in &self.parts {
            let lo = row0.max(part.row0);
            let hi = (row0 + n_rows).min(part.row0 + part.rows);
            if lo >= hi {
                continue;
            }
            let bytes = encode(lo - row0, hi - row0, part.format)?;
            let row_bytes = part.format.row_bytes(self.cols);
            gpu.write(
                &part.write_target(gpu),
                (lo - part.row0) as u64 * row_bytes,
                &bytes,
            );
        }
        Ok(())
    }

    pub fn bytes(&self) -> u64 {
        self.format_bytes().iter().map(|(_, b)| b).sum()
    }

    /// The bytes the matrix would take in llama.cpp's blocks (a GGUF
    /// file's own layout), beside [`GpuMatrix::bytes`].
    pub fn gguf_bytes(&self) -> u64 {
        self.parts
            .iter()
            .map(|p| p.rows as u64 * p.format.gguf_row_bytes(self.cols))
            .sum()
    }
}
