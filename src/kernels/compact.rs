//! `shaders/compact.wgsl`: moves the kept rows of per-slot buffers (K and V of
//! every layer, and any other per-slot data) to the front, in keep-list order,
//! on the GPU: a gather into scratch, then a copy back.

use anyhow::Result;
use bytemuck::{Pod, Zeroable};
use std::ops::Range;
use std::sync::Arc;

use super::paging::SlotPages;
use super::{ceil_div, dispatch};
use crate::gpu::Gpu;
use crate::shaders;

#[repr(C)]
#[derive(Clone, Copy, Pod, Zeroable)]
struct Params {
    row_len: u32,
    dst_offset: u32,
    dst_first: u32,
    dst_len: u32,
    src_first: u32,
    src_len: u32,
    _p: [u32; 2],
}

/// How `Params` mirrors `CompactParams` (checked against naga in tests/shaders.rs).
pub(crate) fn uniform_layout() -> super::UniformLayout {
    super::uniform_layout!(Params as "CompactParams" in [shaders::COMPACT] {
        row_len, dst_offset, dst_first, dst_len, src_first, src_len, _p
    })
}

/// The kept rows of one per-slot buffer that land in one of its pages.
struct Unit {
    /// The destination page; its row 0 is kept row `rows.start`.
    dest: wgpu::Buffer,
    rows: Range<usize>,
    row_bytes: u64,
    scratch_offset: u64,
    /// Units are gathered in batches whose rows fit one scratch binding;
    /// this is the batch this unit belongs to.
    batch: usize,
    /// One bind group per source page that can hold these rows' sources.
    groups: Vec<wgpu::BindGroup>,
}

/// Compacts a fixed set of per-slot buffers with one keep list.
pub struct Compactor {
    pipeline: Arc<wgpu::ComputePipeline>,
    refresh: wgpu::Buffer,
    keep: wgpu::Buffer,
    scratch: wgpu::Buffer,
    units: Vec<Unit>,
    max_keep: usize,
}

impl Compactor {
    /// `targets` are per-slot buffers, each in one or more pages; `max_keep`
    /// bounds the keep list. Scratch holds the kept rows of as many
    /// (buffer, destination page) units as fit one storage binding of the
    /// device; the units are gathered batch by batch.
    pub fn new(gpu: &Gpu, targets: &[&SlotPages], max_keep: usize) -> Result<Self> {
        let pipeline = gpu.pipeline(&shaders::COMPACT, None, "main", &[])?;
        let refresh = gpu.uniform("refresh", &[0u32; 4]);
        let keep = gpu.storage("keep-list", max_keep as u64 * 4);
        // (target, destination page, kept rows that land there), in target
        // order and ascending pages. Batches copy back in this order, which is
        // safe because keep[i] >= i: a unit never reads a slot of a page that
        // an earlier unit of its buffer has overwritten.
        let mut plan = vec![];
        for (t, target) in targets.iter().enumerate() {
            for p in 0..target.n_pages() {
                let r = target.range(p);
                let rows = r.start..r.end.min(max_keep);
                if !rows.is_empty() {
                    plan.push((t, p, rows));
                }
            }
        }
        let unit_bytes =
            |(t, _, rows): &(usize, usize, Range<usize>)| targets[*t].row_bytes * rows.len() as u64;
        let largest = plan.iter().map(unit_bytes).max().unwrap_or(4);
        gpu.check_binding(
            "compaction scratch (the kept rows of one per-slot buffer page)",
            largest,
        )?;
        let total: u64 = plan.iter().map(unit_bytes).sum();
        let scratch_bytes = total.min(gpu.max_binding / 4 * 4).max(largest);
        let scratch = gpu.storage("compaction-scratch", scratch_bytes);
        let mut offset = 0;
        let mut batch = 0;
        let mut units = vec![];
        for unit in &plan {
            let (t, p, rows) = unit;
            let target = targets[*t];
            assert!(
                target.row_bytes.is_multiple_of(4),
                "per-slot rows are whole u32 words"
            );
            let bytes = unit_bytes(unit);
            if offset + bytes > scratch_bytes {
                batch += 1;
                offset = 0;
            }
            // Sources of rows >= rows.start sit in slots >= rows.start.
            let groups = (0..target.n_pages())
                .filter(|&sp| target.range(sp).end > rows.start)
                .map(|sp| {
                    let src = target.range(sp);
                    let params = gpu.uniform(
                        "compact-params",
                        &Params {
                            row_len: (target.row_bytes / 4) as u32,
                            dst_offset: (offset / 4) as u32,
                            dst_first: rows.start as u32,
                            dst_len: rows.len() as u32,
                            src_first: src.start as u32,
                            src_len: src.len() as u32,
                            _p: [0; 2],
                        },
                    );
                    let src_buf = &target.buffers[sp];
                    gpu.bind_group(&pipeline, &[&refresh, &params, &keep, src_buf, &scratch])
                })
                .collect();
            units.push(Unit {
                dest: target.buffers[*p].clone(),
                rows: rows.clone(),
                row_bytes: target.row_bytes,
                scratch_offset: offset,
                batch,
                groups,
            });
            offset += bytes;
        }
        Ok(Compactor {
            pipeline,
            refresh,
            keep,
            scratch,
            units,
            max_keep,
        })
    }

    /// Number of gather batches (1 when the kept rows of all buffers fit one binding).
    pub fn batches(&self) -> usize {
        self.units.last().map_or(0, |u| u.batch + 1)
    }

    /// Bytes of the scratch buffer.
    pub fn scratch_bytes(&self) -> u64 {
        self.scratch.size()
    }

    /// Row i of every buffer becomes its former row `keep[i]`. `keep` must be
    /// sorted ascending (stable order), at most `max_keep` long.
    pub fn compact(&self, gpu: &Gpu, keep: &[u32]) -> Result<()> {
        anyhow::ensure!(
            keep.len() <= self.max_keep,
            "keep list longer than the compactor's {}",
            self.max_keep
        );
        anyhow::ensure!(
            keep.windows(2).all(|w| w[0] < w[1]),
            "keep list must be strictly ascending"
        );
        if keep.is_empty() {
            return Ok(());
        }
        gpu.write(
            &self.refresh,
            0,
            bytemuck::bytes_of(&[keep.len() as u32, 0, 0, 0]),
        );
        gpu.write(&self.keep, 0, bytemuck::cast_slice(keep));
        let n_keep = keep.len();
        let mut enc = gpu.device.create_command_encoder(&Default::default());
        for batch in 0..self.batches() {
            let in_batch = || {
                self.units
                    .iter()
                    .filter(move |u| u.batch == batch && u.rows.start < n_keep)
            };
            {
                let mut pass = enc.begin_compute_pass(&Default::default());
                for u in in_batch() {
                    let rows = (u.rows.end.min(n_keep) - u.rows.start) as u32;
                    let words = ceil_div((u.row_bytes / 4) as u32, 64);
                    for group in &u.groups {
                        dispatch(&mut pass, &self.pipeline, group, (words, rows, 1));
                    }
                }
            }
            for u in in_batch() {
                let rows = (u.rows.end.min(n_keep) - u.rows.start) as u64;
                enc.copy_buffer_to_buffer(
                    &self.scratch,
                    u.scratch_offset,
                    &u.dest,
                    0,
                    u.row_bytes * rows,
                );
            }
        }
        gpu.queue.submit([enc.finish()]);
        Ok(())
    }
}

/// A plain gather with the same kernel: row i of `dst` becomes row `index[i]`
/// of `src` (used to load stored per-slot states into an activation buffer).
pub struct Gather {
    pipeline: Arc<wgpu::ComputePipeline>,
    refresh: wgpu::Buffer,
    index: wgpu::Buffer,
    group: wgpu::BindGroup,
    row_words: u32,
    max_rows: usize,
}

impl Gather {
    pub fn new(
        gpu: &Gpu,
        src: &wgpu::Buffer,
        dst: &wgpu::Buffer,
        row_bytes: u64,
        max_rows: usize,
    ) -> Result<Self> {
        let pipeline = gpu.pipeline(&shaders::COMPACT, None, "main", &[])?;
        let refresh = gpu.uniform("gather-rows", &[0u32; 4]);
        let index = gpu.storage("gather-index", max_rows as u64 * 4);
        let params = gpu.uniform(
            "gather-params",
            &Params {
                row_len: (row_bytes / 4) as u32,
                dst_offset: 0,
                dst_first: 0,
                dst_len: max_rows as u32,
                src_first: 0,
                src_len: u32::MAX,
                _p: [0; 2],
            },
        );
        let group = gpu.bind_group(&pipeline, &[&refresh, &params, &index, src, dst]);
        Ok(Gather {
            pipeline,
            refresh,
            index,
            group,
            row_words: (row_bytes / 4) as u32,
            max_rows,
        })
    }

    /// Writes the row list; encode the gather afterwards in the same submission.
    pub fn set_rows(&self, gpu: &Gpu, rows: &[u32]) -> Result<()> {
        anyhow::ensure!(
            rows.len() <= self.max_rows,
            "gather of {} rows, at most {}",
            rows.len(),
            self.max_rows
        );
        gpu.write(
            &self.refresh,
            0,
            bytemuck::bytes_of(&[rows.len() as u32, 0, 0, 0]),
        );
        gpu.write(&self.index, 0, bytemuck::cast_slice(rows));
        Ok(())
    }

    pub fn encode(&self, pass: &mut wgpu::ComputePass, n_rows: u32) {
        dispatch(
            pass,
            &self.pipeline,
            &self.group,
            (ceil_div(self.row_words, 64), n_rows, 1),
        );
    }
}

/// CPU reference: rows of `data` (row length `row`) in keep order.
pub fn reference(data: &[u32], row: usize, keep: &[u32]) -> Vec<u32> {
    keep.iter()
        .flat_map(|&k| {
            data[k as usize * row..(k as usize + 1) * row]
                .iter()
                .copied()
        })
        .collect()
}

#[cfg(any(test, feature = "kernel-checks"))]
pub(crate) mod tests {
    use super::*;
    use crate::kernels::testutil::*;

    #[cfg_attr(test, test)]
    fn keep_lists_that_stress_in_place_moves() {
        keep_lists_on(&gpu(), 300);
    }

    /// Buffers split into pages (a long KV cache on a device with small
    /// bindings): kept rows move between pages, and page sizes need not
    /// divide the slot count or the keep count.
    #[cfg_attr(test, test)]
    fn paged_buffers() {
        let gpu = gpu();
        keep_lists_on(&gpu, 64);
        keep_lists_on(&gpu, 7);
    }

    /// With a storage-binding limit that holds the kept rows of only one
    /// buffer, the compactor gathers in batches (what a long context needs on
    /// a device with small bindings).
    #[cfg_attr(test, test)]
    fn scratch_larger_than_one_binding_is_split_into_batches() {
        let opts = crate::gpu::GpuOptions {
            max_binding_override: Some(93_000),
            ..Default::default()
        };
        keep_lists_on(&Gpu::new(&opts).unwrap(), 300);
    }

    /// Three per-slot buffers of 300 slots in pages of `page` slots, compacted
    /// to 120 with keep lists that stress in-place moves.
    fn keep_lists_on(gpu: &Gpu, page: usize) {
        let slots = 300usize;
        let rows = [192usize * 4, 12, 4]; // bytes: a K row, an odd-sized row, one word
        let data: Vec<Vec<u32>> = rows
            .iter()
            .enumerate()
            .map(|(i, rb)| {
                (0..slots * rb / 4)
                    .map(|x| (x as u32).wrapping_mul(2654435761).wrapping_add(i as u32))
                    .collect()
            })
            .collect();
        let j = 120;
        let mut lcg = 7u64;
        let mut random: Vec<u32> = (0..slots as u32).collect();
        for i in (1..random.len()).rev() {
            lcg = lcg.wrapping_mul(6364136223846793005).wrapping_add(1);
            random.swap(i, (lcg >> 33) as usize % (i + 1));
        }
        let mut random: Vec<u32> = random[..j].to_vec();
        random.sort();
        let cases: Vec<(&str, Vec<u32>)> = vec![
            (
                "every other slot",
                (0..slots as u32).step_by(2).take(j).collect(),
            ),
            ("all but the first", (1..=j as u32).collect()),
            (
                "the last J only",
                ((slots - j) as u32..slots as u32).collect(),
            ),
            ("random", random),
            ("one slot", vec![299]),
        ];
        for (name, keep) in cases {
            let bufs: Vec<SlotPages> = data
                .iter()
                .zip(rows)
                .map(|(d, rb)| SlotPages::from_rows(gpu, d, rb / 4, page))
                .collect();
            let c = Compactor::new(gpu, &bufs.iter().collect::<Vec<_>>(), j).unwrap();
            if gpu.max_binding < 94_000 {
                assert_eq!(
                    c.batches(),
                    2,
                    "a K row buffer alone, then the two small ones"
                );
            }
            c.compact(gpu, &keep).unwrap();
            for (k, (b, rb)) in bufs.iter().zip(rows).enumerate() {
                let row = rb / 4;
                let all: Vec<u32> = b.read(gpu, slots).unwrap();
                let got = &all[..keep.len() * row];
                let what = format!("{name}, buffer {k}, pages of {page}");
                assert_eq!(got, reference(&data[k], row, &keep), "{what}");
                // Rows past the kept ones are untouched.
                assert_eq!(
                    all[keep.len() * row..],
                    data[k][keep.len() * row..],
                    "{what}: tail"
                );
            }
        }
    }

    #[cfg_attr(test, test)]
    fn rejects_unsorted_or_long_keep_lists() {
        let gpu = gpu();
        let b = SlotPages::single(&gpu, gpu.storage("b", 64), 16, 4);
        let c = Compactor::new(&gpu, &[&b], 4).unwrap();
        assert!(c.compact(&gpu, &[2, 1]).is_err());
        assert!(c.compact(&gpu, &[0, 1, 2, 3, 4]).is_err());
    }

    crate::kernels::checks::register![
        keep_lists_that_stress_in_place_moves,
        paged_buffers,
        scratch_larger_than_one_binding_is_split_into_batches,
        rejects_unsorted_or_long_keep_lists,
    ];
}
