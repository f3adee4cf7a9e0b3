//! llama.cpp's dequantization of each GGUF type sieve reads (checked
//! against gguf-py): the CPU reference of every GPU layout, and how GGUF
//! tensors are read into f32.

use anyhow::{anyhow, ensure};
use half::{bf16, f16};

use super::{GgmlType, WeightFormat};

/// The types `GgufFile::dequantize` understands.
pub const DEQUANTIZABLE_TYPES: [GgmlType; 10] = [
    GgmlType::F32,
    GgmlType::F16,
    GgmlType::BF16,
    GgmlType::Q8_0,
    GgmlType::Q4_0,
    GgmlType::Q4_1,
    GgmlType::Q5_0,
    GgmlType::Q4_K,
    GgmlType::Q5_K,
    GgmlType::Q6_K,
];

/// Decodes whole blocks (`&[u8]`) into values (`&mut [f32]`).
pub type BlockDecoder = fn(&[u8], &mut [f32]);

/// The decoder of a type in [`DEQUANTIZABLE_TYPES`]: the row of the
/// weight format of that type, or bf16's (which has no GPU layout).
pub fn block_decoder(ty: GgmlType) -> Option<BlockDecoder> {
    if ty == GgmlType::BF16 {
        return Some(BF16);
    }
    WeightFormat::ALL
        .into_iter()
        .find(|f| f.ggml() == ty)
        .map(WeightFormat::dequantize)
}

pub const F32: BlockDecoder = |data, out| decode_scalars(data, out, f32::from_le_bytes);
pub const F16: BlockDecoder =
    |data, out| decode_scalars(data, out, |b| f16::from_le_bytes(b).to_f32());
const BF16: BlockDecoder =
    |data, out| decode_scalars(data, out, |b| bf16::from_le_bytes(b).to_f32());
pub const Q8_0: BlockDecoder = |data, out| decode_blocks(data, out, dequantize_q8_0);
pub const Q4_0: BlockDecoder = |data, out| decode_blocks(data, out, dequantize_q4_0);
pub const Q4_1: BlockDecoder = |data, out| decode_blocks(data, out, dequantize_q4_1);
pub const Q5_0: BlockDecoder = |data, out| decode_blocks(data, out, dequantize_q5_0);
pub const Q4_K: BlockDecoder = |data, out| decode_blocks(data, out, dequantize_q4_k);
pub const Q5_K: BlockDecoder = |data, out| decode_blocks(data, out, dequantize_q5_k);
pub const Q6_K: BlockDecoder = |data, out| decode_blocks(data, out, dequantize_q6_k);

/// llama.cpp's dequantization of `data`, whole blocks of type `ty`, into
/// `out` (one value per element; `out.len()` elements are decoded).
pub fn dequantize_blocks(ty: GgmlType, data: &[u8], out: &mut [f32]) -> anyhow::Result<()> {
    let decode = block_decoder(ty).ok_or_else(|| anyhow!("type {ty} cannot be dequantized"))?;
    let need = out.len() as u64 / ty.block_size() * ty.block_bytes();
    ensure!(
        (out.len() as u64).is_multiple_of(ty.block_size()) && data.len() as u64 >= need,
        "{} values of type {ty} need {need} bytes of whole blocks; {} given",
        out.len(),
        data.len()
    );
    decode(data, out);
    Ok(())
}

/// Values per block of the 32-wide quant formats.
const QK: usize = 32;

fn decode_scalars<const N: usize>(data: &[u8], out: &mut [f32], decode: impl Fn([u8; N]) -> f32) {
    for (x, bytes) in out.iter_mut().zip(data.chunks_exact(N)) {
        *x = decode(bytes.try_into().expect("chunks_exact yields N bytes"));
    }
}

fn decode_blocks<const B: usize, const N: usize>(
    data: &[u8],
    out: &mut [f32],
    decode: fn(&[u8; B], &mut [f32; N]),
) {
    for (values, block) in out.chunks_exact_mut(N).zip(data.chunks_exact(B)) {
        decode(
            block.try_into().expect("chunks_exact yields B bytes"),
            values.try_into().expect("chunks_exact_mut yields N values"),
        );
    }
}

fn f16_at(block: &[u8], at: usize) -> f32 {
    f16::from_le_bytes([block[at], block[at + 1]]).to_f32()
}

/// Q8_0: `f16 d; i8 q[32]`, `x = d * q`.
fn dequantize_q8_0(block: &[u8; 34], out: &mut [f32; QK]) {
    let d = f16_at(block, 0);
    for (x, &q) in out.iter_mut().zip(&block[2..]) {
        *x = d * f32::from(q as i8);
    }
}

/// Q4_0: `f16 d; u8 qs[16]`, low nibbles are values 0..16, high nibbles
/// 16..32, both offset by 8: `x = d * (q - 8)`.
fn dequantize_q4_0(block: &[u8; 18], out: &mut [f32; QK]) {
    let d = f16_at(block, 0);
    for (j, &q) in block[2..].iter().enumerate() {
        out[j] = d * (f32::from(q & 0x0F) - 8.0);
        out[j + QK / 2] = d * (f32::from(q >> 4) - 8.0);
    }
}

/// Q4_1: `f16 d; f16 m; u8 qs[16]`, nibbles as in Q4_0 but unsigned with an
/// offset: `x = d * q + m`.
fn dequantize_q4_1(block: &[u8; 20], out: &mut [f32; QK]) {
    let d = f16_at(block, 0);
    let m = f16_at(block, 2);
    for (j, &q) in block[4..].iter().enumerate() {
        out[j] = d * f32::from(q & 0x0F) + m;
        out[j + QK / 2] = d * f32::from(q >> 4) + m;
    }
}

/// Q5_0: `f16 d; u8 qh[4]; u8 qs[16]`: 5-bit values, the low four bits as in
/// Q4_0, bit 4 of value j in bit j of the little-endian u32 `qh`:
/// `x = d * (q - 16)`.
fn dequantize_q5_0(block: &[u8; 22], out: &mut [f32; QK]) {
    let d = f16_at(block, 0);
    let qh = u32::from_le_bytes([block[2], block[3], block[4], block[5]]);
    for (j, &q) in block[6..].iter().enumerate() {
        let high0 = ((qh >> j) << 4) & 0x10;
        let high1 = (qh >> (j + 12)) & 0x10;
        out[j] = d * ((u32::from(q & 0x0F) | high0) as f32 - 16.0);
        out[j + QK / 2] = d * ((u32::from(q >> 4) | high1) as f32 - 16.0);
    }
}

/// Values per super-block of the K-quants.
const QK_K: usize = 256;

/// The 6-bit scale and min of sub-block `j` (0..8) of a Q4_K/Q5_K
/// super-block, packed in 12 bytes as ggml's `get_scale_min_k4`.
fn scale_min_k4(j: usize, q: &[u8]) -> (f32, f32) {
    let (sc, m) = if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        (
            (q[j + 4] & 0x0F) | ((q[j - 4] >> 6) << 4),
            (q[j + 4] >> 4) | ((q[j] >> 6) << 4),
        )
    };
    (f32::from(sc), f32::from(m))
}

/// Q4_K: `f16 d; f16 dmin; u8 scales[12]; u8 qs[128]`: eight sub-blocks of
/// 32 with 6-bit scales and mins; each 32 bytes of `qs` hold two
/// sub-blocks, low nibbles first: `x = d * sc * q - dmin * m`.
fn dequantize_q4_k(block: &[u8; 144], out: &mut [f32; QK_K]) {
    dequantize_k_sub_blocks(block, None, &block[16..], out);
}

/// Q5_K: `f16 d; f16 dmin; u8 scales[12]; u8 qh[32]; u8 qs[128]`: Q4_K
/// with a fifth bit per value, bit `2 * pair` (low nibbles) or
/// `2 * pair + 1` (high nibbles) of `qh[l]`.
fn dequantize_q5_k(block: &[u8; 176], out: &mut [f32; QK_K]) {
    dequantize_k_sub_blocks(block, Some(&block[16..48]), &block[48..], out);
}

/// Q4_K and Q5_K after their common header (`d`, `dmin`, 12 bytes of
/// scales): `qs` in pairs of sub-blocks, `qh` the fifth bits of Q5_K.
fn dequantize_k_sub_blocks(block: &[u8], qh: Option<&[u8]>, qs: &[u8], out: &mut [f32; QK_K]) {
    let d = f16_at(block, 0);
    let dmin = f16_at(block, 2);
    let scales = &block[4..16];
    for (pair, (qs, values)) in qs
        .chunks_exact(32)
        .zip(out.chunks_exact_mut(64))
        .enumerate()
    {
        let (sc1, m1) = scale_min_k4(2 * pair, scales);
        let (sc2, m2) = scale_min_k4(2 * pair + 1, scales);
        let high = |l: usize, bit: u8| match qh {
            Some(qh) if qh[l] & (bit << (2 * pair)) != 0 => 16.0,
            _ => 0.0,
        };
        for (l, &q) in qs.iter().enumerate() {
            values[l] = d * sc1 * (f32::from(q & 0x0F) + high(l, 1)) - dmin * m1;
            values[l + 32] = d * sc2 * (f32::from(q >> 4) + high(l, 2)) - dmin * m2;
        }
    }
}

/// Q6_K: `u8 ql[128]; u8 qh[64]; i8 scales[16]; f16 d`: 6-bit values (low
/// four bits in `ql`, high two in `qh`) in two halves of 128, with a signed
/// 8-bit scale per 16 values: `x = d * scale * (q - 32)`.
fn dequantize_q6_k(block: &[u8; 210], out: &mut [f32; QK_K]) {
    let d = f16_at(block, 208);
    for half in 0..2 {
        let ql = &block[64 * half..64 * half + 64];
        let qh = &block[128 + 32 * half..128 + 32 * half + 32];
        let sc = &block[192 + 8 * half..192 + 8 * half + 8];
        let values = &mut out[128 * half..128 * half + 128];
        for l in 0..32 {
            let is = l / 16;
            let q1 = i32::from((ql[l] & 0x0F) | ((qh[l] & 3) << 4)) - 32;
            let q2 = i32::from((ql[l + 32] & 0x0F) | (((qh[l] >> 2) & 3) << 4)) - 32;
            let q3 = i32::from((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32;
            let q4 = i32::from((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32;
            let scale = |k: usize| d * f32::from(sc[is + k] as i8);
            values[l] = scale(0) * q1 as f32;
            values[l + 32] = scale(2) * q2 as f32;
            values[l + 64] = scale(4) * q3 as f32;
            values[l + 96] = scale(6) * q4 as f32;
        }
    }
}
