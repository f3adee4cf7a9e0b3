//! Storage formats: one row per weight format in `FORMATS` (name, GGUF
//! type and block geometry, WGSL prelude, texture words, repacking and CPU
//! dequantization), and the KV cache's own format type ([`KvFormat`]).
//!
//! - `ggml.rs`: the GGUF file's tensor types (ids, names, block sizes).
//! - `repack.rs`: the GPU block layouts, the repacking of GGUF blocks into
//!   them, and the quantizers behind `--dtype q8_0|q4_0`.
//! - `dequant.rs`: llama.cpp's dequantization of each type, the CPU
//!   reference of every layout.

pub mod dequant;
pub mod ggml;
pub mod repack;

use anyhow::{bail, Result};

use dequant::BlockDecoder;
pub use ggml::GgmlType;

/// Storage format of packed values on the GPU: weight matrices (every
/// variant), and the KV cache (f16 and f32 only). The quantized formats'
/// block layouts are described in repack.rs.
#[allow(non_camel_case_types)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum WeightFormat {
    F16,
    F32,
    Q8_0,
    Q4_0,
    Q4_1,
    Q5_0,
    Q4_K,
    Q5_K,
    Q6_K,
}

impl WeightFormat {
    /// Every format, in the order `--dtype` lists them (that of `FORMATS`).
    pub const ALL: [WeightFormat; FORMATS.len()] = {
        let mut all = [WeightFormat::F16; FORMATS.len()];
        let mut i = 0;
        while i < all.len() {
            all[i] = FORMATS[i].format;
            i += 1;
        }
        all
    };

    /// Bytes of one value of a float format (the quantized ones have
    /// [`WeightFormat::row_bytes`] instead).
    pub fn bytes_per_value(self) -> u64 {
        match self {
            WeightFormat::F16 => 2,
            WeightFormat::F32 => 4,
            other => unreachable!("{other:?} has no bytes per value; see row_bytes"),
        }
    }

    pub fn is_float(self) -> bool {
        matches!(self, WeightFormat::F16 | WeightFormat::F32)
    }

    pub fn name(self) -> &'static str {
        self.row().name
    }

    /// This format's row of [`FORMATS`].
    fn row(self) -> &'static FormatRow {
        FORMATS
            .iter()
            .find(|r| r.format == self)
            .expect("every format has a row")
    }

    /// The block of a quantized format; None for f16 and f32.
    pub fn block(self) -> Option<Block> {
        self.row().block
    }

    /// The GGUF type whose blocks this format's GPU layout holds.
    pub fn ggml(self) -> GgmlType {
        match self.block() {
            Some(b) => b.ggml,
            None if self == WeightFormat::F16 => GgmlType::F16,
            None => GgmlType::F32,
        }
    }

    /// llama.cpp's CPU dequantization of this format's GGUF blocks.
    pub fn dequantize(self) -> BlockDecoder {
        self.row().dequantize
    }

    /// How a texture texel's words are read (weights_texture_*.wgsl).
    pub fn texture_words(self) -> &'static str {
        self.row().texture_words
    }

    /// The weight-format prelude (see `FormatRow`).
    pub fn prelude(self) -> &'static str {
        self.row().prelude
    }

    /// The format called `name` (as [`WeightFormat::name`] writes it).
    pub fn parse(name: &str) -> Option<WeightFormat> {
        Self::ALL
            .into_iter()
            .find(|f| f.name().eq_ignore_ascii_case(name))
    }
}

impl WeightFormat {
    /// The weight format that keeps a GGUF tensor of type `t` as it is
    /// stored (bf16 has no GPU layout of its own: f32 holds it exactly).
    pub fn of_ggml(t: GgmlType) -> Option<WeightFormat> {
        Some(match t {
            GgmlType::F32 | GgmlType::BF16 => WeightFormat::F32,
            GgmlType::F16 => WeightFormat::F16,
            GgmlType::Q8_0 => WeightFormat::Q8_0,
            GgmlType::Q4_0 => WeightFormat::Q4_0,
            GgmlType::Q4_1 => WeightFormat::Q4_1,
            GgmlType::Q5_0 => WeightFormat::Q5_0,
            GgmlType::Q4_K => WeightFormat::Q4_K,
            GgmlType::Q5_K => WeightFormat::Q5_K,
            GgmlType::Q6_K => WeightFormat::Q6_K,
            _ => return None,
        })
    }

    /// Bytes of one row of `cols` values on the GPU (`cols` must be a
    /// multiple of the block, see [`WeightFormat::check_cols`]).
    pub fn row_bytes(self, cols: usize) -> u64 {
        match self.block() {
            None => cols as u64 * self.bytes_per_value(),
            Some(b) => ((cols / b.values).div_ceil(b.group) * b.words * 4) as u64,
        }
    }

    /// Bytes of one row of `cols` values in llama.cpp's own blocks (a GGUF
    /// file's), beside [`WeightFormat::row_bytes`] on the GPU.
    pub fn gguf_row_bytes(self, cols: usize) -> u64 {
        match self.block() {
            None => self.row_bytes(cols),
            Some(b) => (cols / b.values) as u64 * b.ggml.block_bytes(),
        }
    }

    /// Quantized rows must hold whole blocks.
    pub fn check_cols(self, cols: usize, what: &str) -> Result<()> {
        match self.block() {
            Some(b) if !cols.is_multiple_of(b.values) => bail!(
                "{what}: rows of {cols} values cannot be stored as {}, whose blocks hold {} values",
                self.name(),
                b.values
            ),
            _ => Ok(()),
        }
    }
}

/// Storage format of the KV cache: f32 (exact comparisons) or f16 (half
/// the memory and bandwidth). Its prelude (`kv_<format>.wgsl`) declares
/// `KvPacked`, `unpack_kv` and `pack_kv`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub enum KvFormat {
    F16,
    #[default]
    F32,
}

impl KvFormat {
    pub const ALL: [KvFormat; 2] = [KvFormat::F16, KvFormat::F32];

    /// As `--kv-dtype` takes it.
    pub fn name(self) -> &'static str {
        match self {
            KvFormat::F16 => "f16",
            KvFormat::F32 => "f32",
        }
    }

    /// The format called `name` (as [`KvFormat::name`] writes it).
    pub fn parse(name: &str) -> Option<KvFormat> {
        Self::ALL
            .into_iter()
            .find(|f| f.name().eq_ignore_ascii_case(name))
    }

    /// Bytes of one cached value.
    pub fn bytes_per_value(self) -> u64 {
        match self {
            KvFormat::F16 => 2,
            KvFormat::F32 => 4,
        }
    }

    /// The KV-cache prelude.
    pub fn prelude(self) -> &'static str {
        match self {
            KvFormat::F16 => include_str!("../../shaders/kv_f16.wgsl"),
            KvFormat::F32 => include_str!("../../shaders/kv_f32.wgsl"),
        }
    }
}

/// A block format whose prelude reads u32 words (`w_u32` and the row
/// alignment from weights_words.wgsl) or, with `own_words`, one that
/// defines them itself (Q4_0, which reads vec4<u32>).
macro_rules! quantized {
    ($name:literal) => {
        concat!(
            include_str!(concat!("../../shaders/weights_", $name, ".wgsl")),
            include_str!("../../shaders/weights_words.wgsl"),
            include_str!("../../shaders/weights_blocks.wgsl"),
            include_str!("../../shaders/weights_rows.wgsl")
        )
    };
    ($name:literal, own_words) => {
        concat!(
            include_str!(concat!("../../shaders/weights_", $name, ".wgsl")),
            include_str!("../../shaders/weights_blocks.wgsl"),
            include_str!("../../shaders/weights_rows.wgsl")
        )
    };
}

macro_rules! float {
    ($name:literal) => {
        concat!(
            include_str!(concat!("../../shaders/weights_", $name, ".wgsl")),
            include_str!("../../shaders/weights_floats.wgsl"),
            include_str!("../../shaders/weights_rows.wgsl")
        )
    };
}

/// The block geometry of a quantized format (its GPU layout: its
/// `repack` writes GGUF blocks into it, the prelude reads it).
#[derive(Clone, Copy, Debug)]
pub struct Block {
    /// Values per block.
    pub values: usize,
    /// The llama.cpp type the block is repacked from.
    pub ggml: GgmlType,
    /// Blocks the GPU layout keeps together (1; Q4_0: 8), rows padded to
    /// whole groups.
    pub group: usize,
    /// 32-bit words per group on the GPU.
    pub words: usize,
    /// Appends the GPU words of one group of GGUF blocks (fewer blocks at
    /// a row's end; the group is padded with zero blocks).
    pub repack: fn(&[u8], &mut Vec<u32>),
    /// Byte offsets of the f16 scales in one GGUF block: the only floats a
    /// block holds, so a block decodes to finite values when they are finite.
    pub scales: &'static [usize],
}

impl Block {
    /// The first block of `blocks` (GGUF blocks of this format) with a
    /// scale that is not finite, and that scale.
    pub fn first_nonfinite_scale(&self, blocks: &[u8]) -> Option<(usize, f32)> {
        let bytes = self.ggml.block_bytes() as usize;
        blocks
            .chunks_exact(bytes)
            .enumerate()
            .find_map(|(i, block)| {
                self.scales
                    .iter()
                    .map(|&at| half::f16::from_le_bytes([block[at], block[at + 1]]).to_f32())
                    .find(|v| !v.is_finite())
                    .map(|v| (i, v))
            })
    }
}

/// Everything about one storage format that is not code: its name, its
/// WGSL prelude, what a texel of its texture holds, and its block.
struct FormatRow {
    format: WeightFormat,
    /// As `--dtype` and `--kv-dtype` take it.
    name: &'static str,
    /// The weight-format prelude: `weight4`, its family's shared code
    /// (`dot32` for the floats, the block helpers for the quantized ones)
    /// and `w_row` (where a row starts).
    prelude: &'static str,
    /// How a texture texel's words are read (weights_texture_*.wgsl).
    texture_words: &'static str,
    block: Option<Block>,
    /// llama.cpp's CPU dequantization of its GGUF type (the reference the
    /// GPU layouts are checked against).
    dequantize: BlockDecoder,
}

const fn block(
    values: usize,
    ggml: GgmlType,
    group: usize,
    words: usize,
    repack: fn(&[u8], &mut Vec<u32>),
    scales: &'static [usize],
) -> Option<Block> {
    Some(Block {
        values,
        ggml,
        group,
        words,
        repack,
        scales,
    })
}

/// One row per format: adding a format is one row here, its prelude, its
/// repacking (repack.rs) and its CPU dequantization (dequant.rs).
const FORMATS: [FormatRow; 9] = [
    FormatRow {
        format: WeightFormat::F16,
        name: "f16",
        prelude: float!("f16"),
        texture_words: WEIGHTS_TEXTURE_F16,
        block: None,
        dequantize: dequant::F16,
    },
    FormatRow {
        format: WeightFormat::F32,
        name: "f32",
        prelude: float!("f32"),
        texture_words: WEIGHTS_TEXTURE_F32,
        block: None,
        dequantize: dequant::F32,
    },
    FormatRow {
        format: WeightFormat::Q8_0,
        name: "q8_0",
        prelude: quantized!("q8_0"),
        texture_words: WEIGHTS_TEXTURE_U32,
        block: block(32, GgmlType::Q8_0, 1, 9, repack::q8_0, &[0]),
        dequantize: dequant::Q8_0,
    },
    FormatRow {
        format: WeightFormat::Q4_0,
        name: "q4_0",
        prelude: quantized!("q4_0", own_words),
        texture_words: WEIGHTS_TEXTURE_U32X4,
        block: block(32, GgmlType::Q4_0, 8, 36, repack::q4_0, &[0]),
        dequantize: dequant::Q4_0,
    },
    FormatRow {
        format: WeightFormat::Q4_1,
        name: "q4_1",
        prelude: quantized!("q4_1"),
        texture_words: WEIGHTS_TEXTURE_U32,
        block: block(32, GgmlType::Q4_1, 1, 5, repack::q4_1, &[0, 2]),
        dequantize: dequant::Q4_1,
    },
    FormatRow {
        format: WeightFormat::Q5_0,
        name: "q5_0",
        prelude: quantized!("q5_0"),
        texture_words: WEIGHTS_TEXTURE_U32,
        block: block(32, GgmlType::Q5_0, 1, 6, repack::q5_0, &[0]),
        dequantize: dequant::Q5_0,
    },
    FormatRow {
        format: WeightFormat::Q4_K,
        name: "q4_k",
        prelude: quantized!("q4_k"),
        texture_words: WEIGHTS_TEXTURE_U32,
        block: block(256, GgmlType::Q4_K, 1, 36, repack::q4_k, &[0, 2]),
        dequantize: dequant::Q4_K,
    },
    FormatRow {
        format: WeightFormat::Q5_K,
        name: "q5_k",
        prelude: quantized!("q5_k"),
        texture_words: WEIGHTS_TEXTURE_U32,
        block: block(256, GgmlType::Q5_K, 1, 44, repack::q5_k, &[0, 2]),
        dequantize: dequant::Q5_K,
    },
    FormatRow {
        format: WeightFormat::Q6_K,
        name: "q6_k",
        prelude: quantized!("q6_k"),
        texture_words: WEIGHTS_TEXTURE_U32,
        block: block(256, GgmlType::Q6_K, 1, 53, repack::q6_k, &[208]),
        dequantize: dequant::Q6_K,
    },
];

/// How a texture texel's words are read, by the format's word type.
const WEIGHTS_TEXTURE_U32: &str = include_str!("../../shaders/weights_texture_u32.wgsl");
const WEIGHTS_TEXTURE_F16: &str = include_str!("../../shaders/weights_texture_f16.wgsl");
const WEIGHTS_TEXTURE_F32: &str = include_str!("../../shaders/weights_texture_f32.wgsl");
const WEIGHTS_TEXTURE_U32X4: &str = include_str!("../../shaders/weights_texture_u32x4.wgsl");

#[cfg(test)]
mod tests {
    use super::*;

    /// Every format has one row (the match fails to compile when a format
    /// is added without being listed here), its name parses back to it,
    /// and the block words the table gives hold a block's bytes.
    #[test]
    fn every_format_has_one_row() {
        for f in WeightFormat::ALL {
            let listed = match f {
                WeightFormat::F16
                | WeightFormat::F32
                | WeightFormat::Q8_0
                | WeightFormat::Q4_0
                | WeightFormat::Q4_1
                | WeightFormat::Q5_0
                | WeightFormat::Q4_K
                | WeightFormat::Q5_K
                | WeightFormat::Q6_K => f,
            };
            assert_eq!(FORMATS.iter().filter(|r| r.format == listed).count(), 1);
            assert_eq!(WeightFormat::parse(f.name()), Some(f));
            if let Some(b) = f.block() {
                assert!(
                    b.words * 4 >= b.group * b.ggml.block_bytes() as usize,
                    "{f:?}"
                );
                assert_eq!(b.values as u64, b.ggml.block_size(), "{f:?}");
            }
        }
        assert_eq!(WeightFormat::ALL.len(), 9);
    }

    /// A block's listed scales are the floats llama.cpp decodes it with: a
    /// NaN at each of them makes the CPU decoder's output non-finite, and
    /// `first_nonfinite_scale` finds it (in the second of two blocks).
    #[test]
    fn scales_are_where_the_decoder_reads_them() {
        for f in WeightFormat::ALL {
            let Some(b) = f.block() else { continue };
            let bytes = b.ggml.block_bytes() as usize;
            let mut blocks = vec![0x11u8; 2 * bytes];
            for &at in b.scales {
                blocks[at..at + 2].copy_from_slice(&half::f16::from_f32(0.5).to_le_bytes());
                blocks[bytes + at..bytes + at + 2]
                    .copy_from_slice(&half::f16::from_f32(0.5).to_le_bytes());
            }
            assert_eq!(b.first_nonfinite_scale(&blocks), None, "{f:?}");
            for &at in b.scales {
                let mut bad = blocks.clone();
                bad[bytes + at..bytes + at + 2].copy_from_slice(&half::f16::NAN.to_le_bytes());
                assert!(
                    matches!(b.first_nonfinite_scale(&bad), Some((1, v)) if v.is_nan()),
                    "{f:?}"
                );
                let mut out = vec![0f32; 2 * b.values];
                dequant::dequantize_blocks(b.ggml, &bad, &mut out).unwrap();
                assert!(out[..b.values].iter().all(|v| v.is_finite()), "{f:?}");
                assert!(
                    out[b.values..].iter().any(|v| !v.is_finite()),
                    "{f:?} at {at}"
                );
            }
        }
    }

    #[test]
    fn kv_formats_parse() {
        for f in KvFormat::ALL {
            assert_eq!(KvFormat::parse(f.name()), Some(f));
        }
    }
}
