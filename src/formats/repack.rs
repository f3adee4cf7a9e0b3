//! The block layouts sieve keeps quantized weight matrices in on the GPU,
//! the repacking of llama.cpp's blocks into those layouts (each format's
//! function is in its row of `FORMATS`), and the quantizers behind
//! `--dtype q8_0|q4_0`.
//!
//! A GGUF block is copied into whole 32-bit words, because WGSL reads storage
//! buffers in words and llama.cpp's 18-, 22- and 210-byte blocks would
//! straddle them. Each block stays self-contained (a row part can start at
//! any block), its scales first, then its quants in value order, except
//! Q4_0's: its blocks go in groups of eight, the eight f16 scales in one
//! 16-byte word and each block's quants in another, so that a lane reads a
//! block's quants with one 16-byte load and the bytes are llama.cpp's own
//! (18 per block where five words took 20); rows start at whole groups, the
//! last group of a row padded with zero blocks (rows of K = 576, 18
//! blocks, take three groups, 33% more; K a multiple of 256, none) (llama.cpp
//! interleaves the two halves of a block in the nibbles of one byte; sieve's
//! layout puts value `8i + n` in nibble `n` of quant word `i`, so that four
//! consecutive values are one shift away). The WGSL side of each layout is
//! `shaders/weights_<format>.wgsl`: it declares the weights binding and
//! `weight4(g)`, the four values of flat group `g`, and `dot32`, the dot
//! product of 32 values (one block, or one sub-block of a K-quant) with x,
//! which the `cpu` mat-vec uses: whole quant words, the scale applied once,
//! and an offset such as Q4_1's `m` applied once to the sum of x. The CPU reference of
//! every layout is llama.cpp's dequantization in src/formats/dequant.rs (checked against
//! gguf-py), applied to the GGUF block before repacking.
//!
//! | format | values/block | GGUF bytes | GPU words | GPU layout (words) |
//! |---|---|---|---|---|
//! | Q8_0 | 32 | 34 | 9 | d; 32 x i8 |
//! | Q4_0 | 32 | 18 | 36 per 8 blocks | 8 x d; then per block 32 x u4 (x = d (q - 8)) |
//! | Q4_1 | 32 | 20 | 5 | d, m; 32 x u4 (x = d q + m) |
//! | Q5_0 | 32 | 22 | 6 | d; 32 high bits; 32 x u4 (x = d (q - 16)) |
//! | Q4_K | 256 | 144 | 36 | d, dmin; 12 bytes of 6-bit scales/mins; 256 x u4 |
//! | Q5_K | 256 | 176 | 44 | as Q4_K, then 256 high bits, then 256 x u4 |
//! | Q6_K | 256 | 210 | 53 | d; 16 x i8 scales; 256 x u4; 256 x u2 |

use anyhow::{bail, Result};
use half::f16;

use super::WeightFormat;

/// Appends the GPU words of `data`, whole rows of `cols` values in GGUF
/// blocks of `format`'s type.
pub fn repack(format: WeightFormat, data: &[u8], cols: usize, out: &mut Vec<u32>) {
    let b = format.block().expect("repack takes a quantized format");
    let bytes = b.ggml.block_bytes() as usize;
    let row_bytes = cols / b.values * bytes;
    for row in data.chunks_exact(row_bytes) {
        for group in row.chunks(b.group * bytes) {
            let start = out.len();
            (b.repack)(group, out);
            debug_assert_eq!(out.len() - start, b.words);
        }
    }
}

/// Q4_0: a group of up to eight 18-byte blocks (fewer at a row's end,
/// padded with zero blocks): the eight scales, then each block's quants.
pub(super) fn q4_0(group: &[u8], out: &mut Vec<u32>) {
    let blocks: Vec<&[u8]> = group.chunks_exact(18).collect();
    let scale = |j: usize| blocks.get(j).map_or(0, |b| u16_at(b, 0));
    out.extend((0..4).map(|i| scale(2 * i) | scale(2 * i + 1) << 16));
    for j in 0..8 {
        match blocks.get(j) {
            Some(block) => push_nibbles(out, 32, |v| split_nibble(&block[2..18], v)),
            None => out.extend([0; 4]),
        }
    }
}

pub(super) fn q8_0(block: &[u8], out: &mut Vec<u32>) {
    out.push(u16_at(block, 0));
    out.extend(block[2..34].chunks_exact(4).map(word));
}

pub(super) fn q4_1(block: &[u8], out: &mut Vec<u32>) {
    out.push(word(&block[0..4]));
    push_nibbles(out, 32, |v| split_nibble(&block[4..20], v));
}

pub(super) fn q5_0(block: &[u8], out: &mut Vec<u32>) {
    out.push(u16_at(block, 0));
    out.push(word(&block[2..6]));
    push_nibbles(out, 32, |v| split_nibble(&block[6..22], v));
}

pub(super) fn q4_k(block: &[u8], out: &mut Vec<u32>) {
    out.extend(block[0..16].chunks_exact(4).map(word));
    push_nibbles(out, 256, |v| k_nibble(&block[16..144], v));
}

pub(super) fn q5_k(block: &[u8], out: &mut Vec<u32>) {
    out.extend(block[0..16].chunks_exact(4).map(word));
    let qh = &block[16..48];
    push_bits(out, 1, 256, |v| {
        let (pair, within) = (v / 64, v % 64);
        let bit = 2 * pair + within / 32;
        u32::from(qh[within % 32] >> bit) & 1
    });
    push_nibbles(out, 256, |v| k_nibble(&block[48..176], v));
}

pub(super) fn q6_k(block: &[u8], out: &mut Vec<u32>) {
    out.push(u16_at(block, 208));
    out.extend(block[192..208].chunks_exact(4).map(word));
    // Value v = 128 half + 32 k + l (l < 32) takes its low bits
    // from ql[64 half + l + 32 (k odd)] (low nibble for k < 2) and
    // its high bits from bits 2k of qh[32 half + l].
    let (ql, qh) = (&block[0..128], &block[128..192]);
    let q6 = |v: usize| {
        let (half, k, l) = (v / 128, (v % 128) / 32, v % 32);
        let low = ql[64 * half + l + 32 * (k % 2)];
        let low = if k < 2 { low & 0x0F } else { low >> 4 };
        let high = (qh[32 * half + l] >> (2 * k)) & 3;
        (u32::from(low), u32::from(high))
    };
    push_nibbles(out, 256, |v| q6(v).0);
    push_bits(out, 2, 256, |v| q6(v).1);
}

fn word(b: &[u8]) -> u32 {
    u32::from_le_bytes([b[0], b[1], b[2], b[3]])
}

fn u16_at(b: &[u8], at: usize) -> u32 {
    u32::from(u16::from_le_bytes([b[at], b[at + 1]]))
}

/// Quant `v` of a 32-value block whose 16 bytes hold values j (low nibble)
/// and j + 16 (high nibble) in byte j.
fn split_nibble(qs: &[u8], v: usize) -> u32 {
    u32::from(if v < 16 {
        qs[v] & 0x0F
    } else {
        qs[v - 16] >> 4
    })
}

/// Low four bits of value `v` of a Q4_K/Q5_K super-block: each 32 bytes hold
/// two sub-blocks, the first in the low nibbles.
fn k_nibble(qs: &[u8], v: usize) -> u32 {
    let (pair, within) = (v / 64, v % 64);
    let q = qs[32 * pair + within % 32];
    u32::from(if within < 32 { q & 0x0F } else { q >> 4 })
}

/// Words of 8 nibbles: value 8i + n in nibble n of word i.
fn push_nibbles(out: &mut Vec<u32>, count: usize, nibble: impl Fn(usize) -> u32) {
    push_bits(out, 4, count, nibble)
}

/// Words of `32 / bits` fields of `bits` bits: value i in field i % (32 /
/// bits) of word i / (32 / bits).
fn push_bits(out: &mut Vec<u32>, bits: usize, count: usize, field: impl Fn(usize) -> u32) {
    let per_word = 32 / bits;
    for w in 0..count / per_word {
        let mut word = 0u32;
        for n in 0..per_word {
            word |= field(w * per_word + n) << (n * bits);
        }
        out.push(word);
    }
}

/// The formats `--dtype` can quantize to when loading (from f16, bf16 or f32
/// weights, or any GGUF type after dequantization).
pub const QUANTIZABLE: [WeightFormat; 2] = [WeightFormat::Q8_0, WeightFormat::Q4_0];

/// llama.cpp's reference quantization (`quantize_row_q8_0_ref`,
/// `quantize_row_q4_0_ref`) of `values`, whole blocks, as GGUF block bytes.
pub fn quantize(format: WeightFormat, values: &[f32]) -> Result<Vec<u8>> {
    let Some(b) = format.block() else {
        bail!("{} is not a quantized format", format.name());
    };
    if !QUANTIZABLE.contains(&format) {
        let names: Vec<_> = QUANTIZABLE.iter().map(|f| f.name()).collect();
        bail!(
            "weights cannot be quantized to {} at load time (supported: {}); load a GGUF file of that type instead",
            format.name(),
            names.join(", ")
        );
    }
    let mut out = Vec::with_capacity(values.len() / b.values * b.ggml.block_bytes() as usize);
    for x in values.chunks_exact(b.values) {
        match format {
            WeightFormat::Q8_0 => {
                let amax = x.iter().fold(0f32, |a, v| a.max(v.abs()));
                let d = amax / 127.0;
                let id = if d != 0.0 { 1.0 / d } else { 0.0 };
                out.extend(f16::from_f32(d).to_le_bytes());
                out.extend(x.iter().map(|v| (v * id).round() as i8 as u8));
            }
            WeightFormat::Q4_0 => {
                // The value of largest magnitude, with its sign, maps to -8.
                let max = x
                    .iter()
                    .fold(0f32, |m, &v| if v.abs() > m.abs() { v } else { m });
                let d = max / -8.0;
                let id = if d != 0.0 { 1.0 / d } else { 0.0 };
                out.extend(f16::from_f32(d).to_le_bytes());
                let q = |v: f32| ((v * id + 8.5) as i8).min(15) as u8;
                out.extend((0..16).map(|j| q(x[j]) | (q(x[j + 16]) << 4)));
            }
            _ => unreachable!("checked against QUANTIZABLE"),
        }
    }
    Ok(out)
}

/// The GPU words of `values` (whole rows of `cols`) quantized to `format`.
pub fn encode(format: WeightFormat, values: &[f32], cols: usize) -> Result<Vec<u32>> {
    let blocks = quantize(format, values)?;
    let mut words = Vec::new();
    repack(format, &blocks, cols, &mut words);
    Ok(words)
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::formats::dequant::dequantize_blocks;
    use crate::kernels::testutil::{quantized, random_blocks};

    /// The GPU layout of rows of `cols` values decoded on the CPU the way
    /// the WGSL preludes decode it (written from the layout table,
    /// independently of `repack`).
    fn decode_gpu(format: WeightFormat, words: &[u32], cols: usize) -> Vec<f32> {
        let b = format.block().unwrap();
        let h = |w: u32, hi: bool| f16::from_bits((if hi { w >> 16 } else { w }) as u16).to_f32();
        if format == WeightFormat::Q4_0 {
            // Groups of 8 blocks: 4 words of scales, then 4 quant words a
            // block; each row's last group padded.
            let row_words = (cols / 32).div_ceil(8) * 36;
            let mut out = Vec::new();
            for row in words.chunks_exact(row_words) {
                let mut values = vec![];
                for g in row.chunks_exact(36) {
                    for j in 0..8 {
                        let d = h(g[j / 2], j % 2 == 1);
                        let q = &g[4 + 4 * j..8 + 4 * j];
                        values.extend(
                            (0..32).map(|v| d * (((q[v / 8] >> (4 * (v % 8))) & 15) as f32 - 8.0)),
                        );
                    }
                }
                out.extend(&values[..cols]);
            }
            return out;
        }
        let field = |ws: &[u32], bits: usize, i: usize| {
            let per = 32 / bits;
            (ws[i / per] >> ((i % per) * bits)) & ((1 << bits) - 1)
        };
        let mut out = Vec::new();
        for w in words.chunks_exact(b.words) {
            for v in 0..b.values {
                let x = match format {
                    WeightFormat::Q8_0 => {
                        h(w[0], false) * f32::from((w[1 + v / 4] >> (8 * (v % 4))) as u8 as i8)
                    }
                    WeightFormat::Q4_1 => {
                        h(w[0], false) * field(&w[1..], 4, v) as f32 + h(w[0], true)
                    }
                    WeightFormat::Q5_0 => {
                        let q = field(&w[2..], 4, v) | (field(&w[1..], 1, v) << 4);
                        h(w[0], false) * (q as f32 - 16.0)
                    }
                    WeightFormat::Q4_K | WeightFormat::Q5_K => {
                        let bytes: Vec<u8> = w[1..4].iter().flat_map(|x| x.to_le_bytes()).collect();
                        let j = v / 32;
                        let (sc, m) = if j < 4 {
                            (bytes[j] & 63, bytes[j + 4] & 63)
                        } else {
                            (
                                (bytes[j + 4] & 15) | ((bytes[j - 4] >> 6) << 4),
                                (bytes[j + 4] >> 4) | ((bytes[j] >> 6) << 4),
                            )
                        };
                        let q = if format == WeightFormat::Q5_K {
                            field(&w[12..], 4, v) | (field(&w[4..], 1, v) << 4)
                        } else {
                            field(&w[4..], 4, v)
                        };
                        h(w[0], false) * f32::from(sc) * q as f32 - h(w[0], true) * f32::from(m)
                    }
                    WeightFormat::Q6_K => {
                        let sc = (w[1 + v / 64] >> (8 * ((v / 16) % 4))) as u8 as i8;
                        let q = field(&w[5..], 4, v) | (field(&w[37..], 2, v) << 4);
                        h(w[0], false) * f32::from(sc) * (q as f32 - 32.0)
                    }
                    _ => unreachable!(),
                };
                out.push(x);
            }
        }
        out
    }

    /// Rows of 5 blocks (Q4_0: one group padded with 3 zero blocks) and
    /// of 19 (Q4_0: three groups, the last with 3 blocks), three rows each.
    #[test]
    fn repacked_blocks_decode_to_llama_cpp_values() {
        for format in quantized() {
            let b = format.block().unwrap();
            for per_row in [5, 19] {
                let (rows, cols) = (3, per_row * b.values);
                let data = random_blocks(format, rows * per_row, cols as u64);
                let mut want = vec![0f32; rows * cols];
                dequantize_blocks(b.ggml, &data, &mut want).unwrap();
                let mut words = vec![];
                repack(format, &data, cols, &mut words);
                assert_eq!(
                    words.len() as u64 * 4,
                    rows as u64 * format.row_bytes(cols),
                    "{format:?}"
                );
                assert_eq!(decode_gpu(format, &words, cols), want, "{format:?}");
            }
        }
    }

    #[test]
    fn quantizers_round_trip_within_half_a_step() {
        let values: Vec<f32> = (0..96)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) / 17.0)
            .collect();
        for format in QUANTIZABLE {
            let blocks = quantize(format, &values).unwrap();
            let mut back = vec![0f32; values.len()];
            dequantize_blocks(format.block().unwrap().ggml, &blocks, &mut back).unwrap();
            for (x, chunk) in values.chunks(32).zip(back.chunks(32)) {
                let amax = x.iter().fold(0f32, |a, v| a.max(v.abs()));
                let step = amax
                    / if format == WeightFormat::Q8_0 {
                        127.0
                    } else {
                        8.0
                    };
                for (a, b) in x.iter().zip(chunk) {
                    // Q4_0 clamps the top half step of the positive side.
                    let tol = if format == WeightFormat::Q8_0 {
                        0.5
                    } else {
                        1.0
                    };
                    assert!(
                        (a - b).abs() <= step * tol + 1e-3 * amax,
                        "{format:?} {a} {b}"
                    );
                }
            }
        }
        assert!(quantize(WeightFormat::Q4_K, &values).is_err());
    }
}
