//! Per-slot buffers split into pages that each fit one storage binding.
//!
//! A layer's key cache is `[slots, n_kv * head_dim]` f32. At long contexts it
//! can exceed what one storage binding may address (128 MiB on lavapipe; the
//! adapter's own `max_storage_buffer_binding_size` elsewhere). It is then held
//! as several buffers ("pages") of `page_slots` consecutive slots each, a
//! multiple of the attention key chunk, so no key chunk straddles two pages.
//! A kernel that reads or writes per-slot rows gets one bind group per page,
//! with that page's `Page` uniform (shaders/common.wgsl), and is dispatched
//! once for every page holding a slot it touches. With one page, the usual
//! case, that is one bind group and one dispatch, exactly as without paging.

use anyhow::{bail, Result};
use bytemuck::{Pod, Zeroable};
use std::ops::Range;

use crate::gpu::Gpu;

/// Mirror of `Page` in shaders/common.wgsl: the slots `first .. first + len`
/// held by the bound page buffer, whose row 0 is slot `first`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, Pod, Zeroable)]
pub struct PageUniform {
    pub first: u32,
    pub len: u32,
    _p: [u32; 2],
}

/// How `PageUniform` mirrors `Page` (checked against naga in tests/shaders.rs).
pub(crate) fn uniform_layout() -> super::UniformLayout {
    use crate::shaders;
    super::uniform_layout!(PageUniform as "Page" in [shaders::ATTENTION, shaders::ROPE_KV, shaders::ATTN_WEIGHTS] {
        first, len, _p
    })
}

/// `slots` rows of `row_bytes` each, in pages of `page_slots` rows (the last
/// page may be shorter). Clones share the buffers.
#[derive(Clone)]
pub struct SlotPages {
    pub buffers: Vec<wgpu::Buffer>,
    /// The `Page` uniform of each buffer.
    pub uniforms: Vec<wgpu::Buffer>,
    pub page_slots: usize,
    pub slots: usize,
    pub row_bytes: u64,
}

impl SlotPages {
    /// Allocates `slots` rows in pages of a multiple of `align` slots, as
    /// large as one storage binding of the device allows, or at most `cap`
    /// slots when given (a multiple of `align`; tests use small pages).
    pub fn new(
        gpu: &Gpu,
        label: &str,
        slots: usize,
        row_bytes: u64,
        align: usize,
        cap: Option<usize>,
    ) -> Result<Self> {
        let fit = (gpu.max_binding / row_bytes) as usize / align * align;
        if fit == 0 {
            bail!(
                "{label}: a page of {align} slots of {row_bytes} bytes needs a {}-byte storage binding; this device allows {} bytes per binding",
                align as u64 * row_bytes,
                gpu.max_binding
            );
        }
        let mut page = fit;
        if let Some(c) = cap {
            if c == 0 || !c.is_multiple_of(align) {
                bail!("{label}: a page size of {c} slots is not a positive multiple of {align}");
            }
            page = page.min(c);
        }
        let page_slots = page.min(slots.max(1));
        let n_pages = slots.max(1).div_ceil(page_slots);
        let buffers = (0..n_pages)
            .map(|p| {
                let rows = page_slots.min(slots.max(1) - p * page_slots);
                let name = if n_pages == 1 {
                    label.to_string()
                } else {
                    format!("{label} (page {p} of {n_pages})")
                };
                gpu.storage(&name, rows as u64 * row_bytes)
            })
            .collect();
        Ok(Self::with_buffers(
            gpu, buffers, page_slots, slots, row_bytes,
        ))
    }

    /// One existing buffer of `slots` rows as a single page.
    pub fn single(gpu: &Gpu, buffer: wgpu::Buffer, slots: usize, row_bytes: u64) -> Self {
        Self::with_buffers(gpu, vec![buffer], slots.max(1), slots, row_bytes)
    }

    /// Pages of `page_slots` rows filled from `data` (`row_len` values per row).
    pub fn from_rows<T: Pod>(gpu: &Gpu, data: &[T], row_len: usize, page_slots: usize) -> Self {
        let slots = data.len() / row_len;
        let buffers = data
            .chunks(page_slots * row_len)
            .map(|rows| gpu.storage_from("slot-page", rows))
            .collect();
        let row_bytes = (row_len * std::mem::size_of::<T>()) as u64;
        Self::with_buffers(gpu, buffers, page_slots, slots, row_bytes)
    }

    fn with_buffers(
        gpu: &Gpu,
        buffers: Vec<wgpu::Buffer>,
        page_slots: usize,
        slots: usize,
        row_bytes: u64,
    ) -> Self {
        let mut pages = SlotPages {
            buffers,
            uniforms: vec![],
            page_slots,
            slots,
            row_bytes,
        };
        pages.uniforms = (0..pages.buffers.len())
            .map(|p| {
                let r = pages.range(p);
                gpu.uniform(
                    "page",
                    &PageUniform {
                        first: r.start as u32,
                        len: r.len() as u32,
                        _p: [0; 2],
                    },
                )
            })
            .collect();
        pages
    }

    /// The first `slots` rows as pages of their own, on the same buffers
    /// (a pooled cache lent to a sequence that needs fewer slots).
    pub fn first(&self, gpu: &Gpu, slots: usize) -> Result<Self> {
        if slots == 0 || slots > self.slots {
            bail!("{slots} slots asked of a buffer of {} slots", self.slots);
        }
        let pages = slots.div_ceil(self.page_slots);
        let buffers = self.buffers[..pages].to_vec();
        Ok(Self::with_buffers(
            gpu,
            buffers,
            self.page_slots,
            slots,
            self.row_bytes,
        ))
    }

    pub fn n_pages(&self) -> usize {
        self.buffers.len()
    }

    /// The slots held by page `p`.
    pub fn range(&self, p: usize) -> Range<usize> {
        let first = p * self.page_slots;
        first..(first + self.page_slots).min(self.slots.max(first))
    }

    /// Bytes of all pages together.
    pub fn bytes(&self) -> u64 {
        self.slots as u64 * self.row_bytes
    }

    /// The pages holding any of `slots`, with the part of `slots` each holds.
    pub fn touching(
        &self,
        slots: Range<usize>,
    ) -> impl Iterator<Item = (usize, Range<usize>)> + '_ {
        (0..self.n_pages()).filter_map(move |p| {
            let r = self.range(p);
            let part = r.start.max(slots.start)..r.end.min(slots.end);
            (!part.is_empty()).then_some((p, part))
        })
    }

    /// Rows `0..n` of all pages, in slot order.
    pub fn read<T: Pod>(&self, gpu: &Gpu, n: usize) -> Result<Vec<T>> {
        let per_row = self.row_bytes as usize / std::mem::size_of::<T>();
        let mut out = Vec::with_capacity(n * per_row);
        for (p, part) in self.touching(0..n) {
            out.extend(gpu.read::<T>(&self.buffers[p], 0, part.len() * per_row)?);
        }
        Ok(out)
    }
}

#[cfg(any(test, feature = "kernel-checks"))]
pub(crate) mod tests {
    use super::*;
    use crate::gpu::GpuOptions;

    #[cfg_attr(test, test)]
    fn pages_follow_the_binding_limit_and_the_alignment() {
        let gpu = Gpu::new(&GpuOptions {
            max_binding_override: Some(10_000),
            ..Default::default()
        })
        .unwrap();
        // 10,000 bytes hold 78 rows of 128 bytes; aligned to 16 that is 64.
        let p = SlotPages::new(&gpu, "k", 200, 128, 16, None).unwrap();
        assert_eq!((p.page_slots, p.n_pages()), (64, 4));
        assert_eq!(p.range(3), 192..200);
        let touched: Vec<_> = p.touching(60..130).collect();
        assert_eq!(touched, vec![(0, 60..64), (1, 64..128), (2, 128..130)]);
        // A cap below the binding's page, and one that is not aligned.
        let capped = SlotPages::new(&gpu, "k", 200, 128, 16, Some(32)).unwrap();
        assert_eq!((capped.page_slots, capped.n_pages()), (32, 7));
        assert!(SlotPages::new(&gpu, "k", 200, 128, 16, Some(20)).is_err());
        // Fits in one page: one buffer of exactly the slots.
        let one = SlotPages::new(&gpu, "k", 50, 128, 16, None).unwrap();
        assert_eq!(
            (one.page_slots, one.n_pages(), one.range(0)),
            (50, 1, 0..50)
        );
        // Not even one aligned page fits: the error names the buffer and the limit.
        let err = SlotPages::new(&gpu, "layer 3 key cache", 200, 1024, 16, None)
            .err()
            .unwrap()
            .to_string();
        assert!(
            err.contains("layer 3 key cache") && err.contains("10000"),
            "{err}"
        );
    }

    #[cfg_attr(test, test)]
    fn reads_back_across_pages() {
        let gpu = Gpu::new(&GpuOptions::default()).unwrap();
        let data: Vec<u32> = (0..3 * 70).collect();
        let p = SlotPages::from_rows(&gpu, &data, 3, 32);
        assert_eq!(p.n_pages(), 3);
        assert_eq!(p.read::<u32>(&gpu, 70).unwrap(), data);
        assert_eq!(p.read::<u32>(&gpu, 33).unwrap(), data[..99]);
        // The first slots as pages of their own, on the same buffers.
        let first = p.first(&gpu, 40).unwrap();
        assert_eq!((first.n_pages(), first.range(1)), (2, 32..40));
        assert_eq!(first.read::<u32>(&gpu, 40).unwrap(), data[..120]);
        assert!(p.first(&gpu, 71).is_err() && p.first(&gpu, 0).is_err());
    }

    crate::kernels::checks::register![
        pages_follow_the_binding_limit_and_the_alignment,
        reads_back_across_pages,
    ];
}
