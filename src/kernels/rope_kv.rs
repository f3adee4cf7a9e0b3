//! `shaders/rope_kv.wgsl`: RoPE on q and k, and the append of k and v to the cache.

use anyhow::Result;
use bytemuck::{Pod, Zeroable};
use std::sync::Arc;

use super::paging::{PageUniform, SlotPages};
use super::{ceil_div, dispatch};
use crate::formats::KvFormat;
use crate::gpu::Gpu;
use crate::shaders;

#[repr(C)]
#[derive(Clone, Copy, Pod, Zeroable)]
struct Params {
    n_heads: u32,
    n_kv: u32,
    head_dim: u32,
    rotary_dim: u32,
    attention_factor: f32,
    _p0: u32,
    _p1: u32,
    _p2: u32,
}

/// How `Params` mirrors `RopeParams` (checked against naga in tests/shaders.rs).
pub(crate) fn uniform_layout() -> super::UniformLayout {
    super::uniform_layout!(Params as "RopeParams" in [shaders::ROPE_KV] {
        n_heads, n_kv, head_dim, rotary_dim, attention_factor, _p0, _p1, _p2
    })
}

/// Head counts of one attention layer, and how its cache stores keys and values.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Heads {
    pub n_heads: usize,
    pub n_kv: usize,
    pub head_dim: usize,
    /// Storage format of the cached keys and values.
    pub kv_format: KvFormat,
}

impl Heads {
    pub fn new(n_heads: usize, n_kv: usize, head_dim: usize, kv_format: KvFormat) -> Self {
        Heads {
            n_heads,
            n_kv,
            head_dim,
            kv_format,
        }
    }

    /// Bytes of one cache slot's keys (or values) of one layer.
    pub fn kv_row_bytes(&self) -> u64 {
        (self.n_kv * self.head_dim) as u64 * self.kv_format.bytes_per_value()
    }
}

/// One layer's rotary position embedding (Hugging Face's rotate_half
/// convention).
#[derive(Clone, Debug, PartialEq)]
pub struct Rope {
    /// The first `rotary_dim` dimensions of each head rotate, in pairs
    /// (j, j + rotary_dim / 2); the others pass unchanged. 0: a layer
    /// without RoPE.
    pub rotary_dim: usize,
    /// The inverse frequency of each pair (rotary_dim / 2 values), the
    /// scaling folded in.
    pub inv_freq: Vec<f32>,
    /// cos and sin are multiplied by this (1 but for LongRoPE).
    pub attention_factor: f32,
    /// LongRoPE's frequencies for long contexts, which an engine that can
    /// see positions past `original` uses instead of `inv_freq`.
    pub long: Option<LongRope>,
}

/// LongRoPE's second set of frequencies.
#[derive(Clone, Debug, PartialEq)]
pub struct LongRope {
    pub inv_freq: Vec<f32>,
    /// `original_max_position_embeddings`: contexts up to this many
    /// positions take the short frequencies.
    pub original: usize,
}

impl Rope {
    /// No rotation at all (SmolLM3's NoPE layers).
    pub fn none() -> Self {
        Rope {
            rotary_dim: 0,
            inv_freq: vec![],
            attention_factor: 1.0,
            long: None,
        }
    }
}

pub struct RopeKv {
    pipeline: Arc<wgpu::ComputePipeline>,
    /// One bind group per cache page with the slots it holds; `None` for the
    /// group that writes no key or value (always dispatched).
    groups: Vec<(Option<std::ops::Range<usize>>, wgpu::BindGroup)>,
    invocations: u32,
}

impl RopeKv {
    /// `cache` is this layer's (keys, values); `None` rotates the queries
    /// only. `rope` says which dimensions rotate and how much cos and sin
    /// are scaled; `inv_freq` holds its frequencies (at least one value).
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        gpu: &Gpu,
        step: &wgpu::Buffer,
        heads: Heads,
        rope: &Rope,
        qkv: &wgpu::Buffer,
        positions: &wgpu::Buffer,
        inv_freq: &wgpu::Buffer,
        q: &wgpu::Buffer,
        cache: Option<(&SlotPages, &SlotPages)>,
    ) -> Result<Self> {
        let pipeline =
            gpu.pipeline(&shaders::ROPE_KV, Some(heads.kv_format.into()), "main", &[])?;
        let params = gpu.uniform(
            "rope-params",
            &Params {
                n_heads: heads.n_heads as u32,
                n_kv: heads.n_kv as u32,
                head_dim: heads.head_dim as u32,
                rotary_dim: rope.rotary_dim as u32,
                attention_factor: rope.attention_factor,
                _p0: 0,
                _p1: 0,
                _p2: 0,
            },
        );
        let group = |kc: &wgpu::Buffer, vc: &wgpu::Buffer, page: &wgpu::Buffer| {
            gpu.bind_group(
                &pipeline,
                &[step, &params, qkv, positions, inv_freq, q, kc, vc, page],
            )
        };
        let groups = match cache {
            Some((k, v)) => (0..k.n_pages())
                .map(|p| {
                    let g = group(&k.buffers[p], &v.buffers[p], &k.uniforms[p]);
                    (Some(k.range(p)), g)
                })
                .collect(),
            None => {
                let none = gpu.storage("no-kv-write", 16);
                let page = gpu.uniform("no-kv-page", &PageUniform::default());
                vec![(None, group(&none, &none, &page))]
            }
        };
        let invocations = ((heads.n_heads + 2 * heads.n_kv) * heads.head_dim / 4) as u32;
        Ok(RopeKv {
            pipeline,
            groups,
            invocations,
        })
    }

    /// `n_tokens` tokens going to cache slots `start_slot..`.
    pub fn encode(&self, pass: &mut wgpu::ComputePass, n_tokens: u32, start_slot: u32) {
        let slots = start_slot as usize..(start_slot + n_tokens) as usize;
        for (range, group) in &self.groups {
            let touched = range
                .as_ref()
                .is_none_or(|r| r.start < slots.end && slots.start < r.end);
            if touched {
                dispatch(
                    pass,
                    &self.pipeline,
                    group,
                    (ceil_div(self.invocations, 64), n_tokens, 1),
                );
            }
        }
    }
}

/// CPU reference of rotate_half RoPE on one head vector: its first
/// `rope.rotary_dim` dimensions rotate, the rest pass unchanged.
pub fn rope_reference(x: &mut [f32], pos: u32, rope: &Rope) {
    let half = rope.rotary_dim / 2;
    let factor = rope.attention_factor as f64;
    for j in 0..half {
        let angle = pos as f32 * rope.inv_freq[j];
        let (s, c) = (angle as f64).sin_cos();
        let (s, c) = (s * factor, c * factor);
        let (a, b) = (x[j] as f64, x[j + half] as f64);
        x[j] = (a * c - b * s) as f32;
        x[j + half] = (b * c + a * s) as f32;
    }
}

/// CPU reference: splits `qkv` rows into rotated q, rotated k and v.
pub fn reference(
    qkv: &[f32],
    h: Heads,
    positions: &[u32],
    rope: &Rope,
) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let (qd, kd) = (h.n_heads * h.head_dim, h.n_kv * h.head_dim);
    let (mut q, mut k, mut v) = (vec![], vec![], vec![]);
    for (row, &pos) in qkv.chunks(qd + 2 * kd).zip(positions) {
        let mut qr = row[..qd].to_vec();
        let mut kr = row[qd..qd + kd].to_vec();
        qr.chunks_mut(h.head_dim)
            .for_each(|x| rope_reference(x, pos, rope));
        kr.chunks_mut(h.head_dim)
            .for_each(|x| rope_reference(x, pos, rope));
        q.extend(qr);
        k.extend(kr);
        v.extend_from_slice(&row[qd + kd..]);
    }
    (q, k, v)
}

#[cfg(any(test, feature = "kernel-checks"))]
pub(crate) mod tests {
    use super::*;
    use crate::kernels::testutil::*;
    use crate::kernels::Step;

    /// RoPE over the first `rotary_dim` dimensions with base 10,000, cos
    /// and sin times `factor`.
    fn rope(rotary_dim: usize, factor: f32) -> Rope {
        Rope {
            rotary_dim,
            inv_freq: (0..rotary_dim / 2)
                .map(|j| 1.0 / 10000f32.powf(2.0 * j as f32 / rotary_dim as f32))
                .collect(),
            attention_factor: factor,
            long: None,
        }
    }

    /// One step of the kernel: `qkv` and `pos` hold rows `0..pos.len()`,
    /// the step's tokens from `row0`; the cache has a zeroed slot for
    /// `start` and each token, in pages of `page` slots. Returns every row
    /// of q and the cache's keys and values (every slot), and the
    /// reference's q, k and v of the step's tokens.
    #[allow(clippy::type_complexity, clippy::too_many_arguments)]
    fn run_step(
        gpu: &Gpu,
        h: Heads,
        rope: &Rope,
        qkv: &[f32],
        pos: &[u32],
        row0: usize,
        start: usize,
        page: usize,
    ) -> ([Vec<f32>; 3], [Vec<f32>; 3]) {
        let (rows, row) = (pos.len(), (h.n_heads + 2 * h.n_kv) * h.head_dim);
        let (n, kv_row) = (rows - row0, h.n_kv * h.head_dim);
        let slots = start + n;
        let step = step_buffer(
            gpu,
            Step {
                n_tokens: n as u32,
                start_slot: start as u32,
                row0: row0 as u32,
                ..Default::default()
            },
        );
        let qkvb = gpu.storage_from("qkv", qkv);
        let posb = gpu.storage_from("pos", pos);
        let invb = gpu.storage_from("inv", &[rope.inv_freq.as_slice(), &[0.0]].concat());
        let q_len = rows * h.n_heads * h.head_dim;
        let qb = gpu.storage_from("q", &vec![0f32; q_len]);
        let zeros = vec![0f32; slots * kv_row];
        let (kc, _) = kv_pages(gpu, &zeros, kv_row, page, h.kv_format);
        let (vc, _) = kv_pages(gpu, &zeros, kv_row, page, h.kv_format);
        let k = RopeKv::new(
            gpu,
            &step,
            h,
            rope,
            &qkvb,
            &posb,
            &invb,
            &qb,
            Some((&kc, &vc)),
        )
        .unwrap();
        run_pass(gpu, |pass| k.encode(pass, n as u32, start as u32));
        let (wq, wk, wv) = reference(&qkv[row0 * row..], h, &pos[row0..], rope);
        let got = [
            gpu.read(&qb, 0, q_len).unwrap(),
            read_kv(gpu, &kc, slots, h.kv_format),
            read_kv(gpu, &vc, slots, h.kv_format),
        ];
        (got, [wq, wk, wv])
    }

    #[cfg_attr(test, test)]
    fn rotates_and_appends_at_the_start_slot() {
        let gpu = gpu();
        // (heads, kv heads, head_dim, tokens, start slot, slots per cache page):
        // the last two write across page boundaries.
        let cases = [
            (2, 1, 4, 1, 0, 1),
            (9, 3, 64, 5, 3, 8),
            (4, 4, 128, 3, 4090, 4093),
            (6, 2, 32, 7, 1, 8),
            (6, 2, 32, 20, 3, 8),
            (4, 2, 16, 9, 13, 4),
        ];
        for format in [KvFormat::F32, KvFormat::F16] {
            for &(nh, nkv, hd, n, start, page) in &cases {
                let h = Heads::new(nh, nkv, hd, format);
                let qkv = rand_vec(n * (nh + 2 * nkv) * hd, 6, 1.0);
                // Positions need not be contiguous (eviction keeps original positions).
                let pos: Vec<u32> = (0..n as u32).map(|i| start as u32 * 2 + 3 * i).collect();
                let ([gq, all_k, all_v], [wq, wk, wv]) =
                    run_step(&gpu, h, &rope(hd, 1.0), &qkv, &pos, 0, start, page);
                let (gk, gv) = (&all_k[start * nkv * hd..], &all_v[start * nkv * hd..]);
                // Slots before the step are untouched.
                assert!(all_k[..start * nkv * hd].iter().all(|&x| x == 0.0));
                // The same f32 angles (up to ~8,000 rad), their sine and
                // cosine exact (f64) in the reference; f16 storage rounds
                // values below 1 by up to 2^-12.
                let tol = 2e-5;
                let kv_tol = if format == KvFormat::F16 { 5e-4 } else { tol };
                let what = format!("{nh}/{nkv}/{hd} n {n} start {start} page {page} {format:?}");
                assert!(
                    max_abs_diff(&gq, &wq) < tol,
                    "q {what}: {}",
                    max_abs_diff(&gq, &wq)
                );
                assert!(max_abs_diff(gk, &wk) < kv_tol.max(tol), "k {what}");
                assert!(max_abs_diff(gv, &wv) < kv_tol, "v {what}");
            }
        }
    }

    /// A sequence's rows of a step several sequences share: with row0 = 3,
    /// rows 3.. of qkv and pos are its tokens and rows 3.. of q get their
    /// rotated queries, while its keys and values go to its own cache from
    /// its start slot; the rows before are left alone (a kernel that
    /// ignored row0 would rotate the other sequence's rows).
    #[cfg_attr(test, test)]
    fn a_sequence_takes_its_rows_from_row0() {
        let gpu = gpu();
        let (nh, nkv, hd, n, start, row0) = (4, 2, 16, 3, 5, 3);
        let h = Heads::new(nh, nkv, hd, KvFormat::F32);
        let rows = row0 + n;
        let qkv = rand_vec(rows * (nh + 2 * nkv) * hd, 9, 1.0);
        let pos: Vec<u32> = (0..rows as u32).map(|i| 7 * i + 1).collect();
        let ([gq, all_k, all_v], [wq, wk, wv]) =
            run_step(&gpu, h, &rope(hd, 1.0), &qkv, &pos, row0, start, start + n);
        assert!(gq[..row0 * nh * hd].iter().all(|&x| x == 0.0));
        assert!(max_abs_diff(&gq[row0 * nh * hd..], &wq) < 2e-5);
        assert!(max_abs_diff(&all_k[start * nkv * hd..], &wk) < 2e-5);
        assert!(max_abs_diff(&all_v[start * nkv * hd..], &wv) < 2e-5);
    }

    /// Positions up to 262,143 (twice a 128k context) with inverse
    /// frequencies up to 1: angles past 200,000 radians, where a driver's
    /// own sin and cos need not be close (WGSL promises them only inside
    /// [-pi, pi]); the kernel's reduction keeps them within 2e-5.
    #[cfg_attr(test, test)]
    fn far_positions_match_reference() {
        let gpu = gpu();
        let h = Heads::new(2, 1, 64, KvFormat::F32);
        let pos: Vec<u32> = vec![65_521, 100_000, 131_071, 200_003, 262_143];
        let qkv = rand_vec(pos.len() * 4 * 64, 11, 1.0);
        let ([gq, gk, _], [wq, wk, _]) =
            run_step(&gpu, h, &rope(64, 1.0), &qkv, &pos, 0, 0, pos.len());
        for (what, got, want) in [("q", gq, wq), ("k", gk, wk)] {
            let err = max_abs_diff(&got, &want);
            assert!(err < 2e-5, "{what}: {err}");
        }
    }

    /// Partial rotary (Phi-3's 0.75: 24 of 32 dimensions; 48 of 64; 4 of
    /// 12), a layer without RoPE (0: q and k pass unchanged) and cos and
    /// sin scaled (LongRoPE's attention factor): the dimensions past
    /// rotary_dim must come out as they went in.
    #[cfg_attr(test, test)]
    fn partial_and_scaled_rotations_match_reference() {
        let gpu = gpu();
        for &(nh, nkv, hd, rotary, factor) in &[
            (4, 2, 32, 24, 1.1902f32),
            (2, 1, 64, 48, 1.0),
            (3, 3, 12, 4, 1.0),
            (4, 2, 32, 0, 1.0),
        ] {
            let h = Heads::new(nh, nkv, hd, KvFormat::F32);
            let n = 5;
            let qkv = rand_vec(n * (nh + 2 * nkv) * hd, 13, 1.0);
            let pos: Vec<u32> = (0..n as u32).map(|i| 1 + 37 * i).collect();
            let r = rope(rotary, factor);
            let ([gq, gk, gv], [wq, wk, wv]) = run_step(&gpu, h, &r, &qkv, &pos, 0, 0, n);
            if rotary == 0 {
                // The first token's query and key heads, as they went in.
                assert_eq!(gq[..nh * hd], qkv[..nh * hd], "no RoPE leaves q as it is");
                assert_eq!(gk[..nkv * hd], qkv[nh * hd..][..nkv * hd]);
            }
            for (what, got, want) in [("q", gq, wq), ("k", gk, wk), ("v", gv, wv)] {
                let err = max_abs_diff(&got, &want);
                assert!(err < 2e-5, "{what}, rotary {rotary} of {hd}: {err}");
            }
        }
    }

    crate::kernels::checks::register![
        partial_and_scaled_rotations_match_reference,
        far_positions_match_reference,
        rotates_and_appends_at_the_start_slot,
        a_sequence_takes_its_rows_from_row0,
    ];
}
