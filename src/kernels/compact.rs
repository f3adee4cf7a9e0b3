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
    sub_len: u32,
    list_first: u32,
}

/// How `Params` mirrors `CompactParams` (checked against naga in tests/shaders.rs).
pub(crate) fn uniform_layout() -> super::UniformLayout {
    super::uniform_layout!(Params as "CompactParams" in [shaders::COMPACT] {
        row_len, dst_offset, dst_first, dst_len, src_first, src_len, sub_len, list_first
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

/// Which keep list moves a per-slot buffer's rows: rows split into `per_row`
/// equal sub-rows, sub-row j moved by list `first + j` (a layer's keys at
/// head granularity: one sub-row per KV head). `whole(l)`: the row moves
/// with list l.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RowLists {
    pub first: usize,
    pub per_row: usize,
}

impl RowLists {
    pub const fn whole(list: usize) -> Self {
        RowLists {
            first: list,
            per_row: 1,
        }
    }
}

/// Which entries the bounded cache keeps (`--granularity`): one set for
/// every layer and KV head (SPEC.md section 3), a set per layer, or a set
/// per (layer, KV head), as kvpress's presses keep. Every set holds the
/// same number of entries, so the cache's size is the same at each.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Granularity {
    #[default]
    Token,
    Layer,
    Head,
}

impl Granularity {
    pub const ALL: [(&'static str, Granularity); 3] = [
        ("token", Granularity::Token),
        ("layer", Granularity::Layer),
        ("head", Granularity::Head),
    ];

    pub fn name(self) -> &'static str {
        Self::ALL.iter().find(|(_, g)| *g == self).unwrap().0
    }

    pub fn parse(name: &str) -> Result<Self> {
        match Self::ALL.iter().find(|(n, _)| *n == name) {
            Some((_, g)) => Ok(*g),
            None => anyhow::bail!("unknown granularity '{name}'; known: token, layer, head"),
        }
    }

    /// Keep lists of a model of `layers` layers with `n_kv` KV heads.
    pub fn lists(self, layers: usize, n_kv: usize) -> usize {
        match self {
            Granularity::Token => 1,
            Granularity::Layer => layers,
            Granularity::Head => layers * n_kv,
        }
    }

    /// The keep list of layer `layer`'s KV head `kvh`.
    pub fn list_of(self, layer: usize, kvh: usize, n_kv: usize) -> usize {
        match self {
            Granularity::Token => 0,
            Granularity::Layer => layer,
            Granularity::Head => layer * n_kv + kvh,
        }
    }

    /// The lists that move layer `layer`'s key and value rows
    /// (`[n_kv * head_dim]` each: a sub-row per KV head).
    pub fn kv_rows(self, layer: usize, n_kv: usize) -> RowLists {
        match self {
            Granularity::Head => RowLists {
                first: layer * n_kv,
                per_row: n_kv,
            },
            _ => RowLists::whole(self.list_of(layer, 0, n_kv)),
        }
    }

    /// Where layer `layer`'s kernels find each KV head's slot positions in
    /// the per-list positions (`[slots, lists]` u32).
    pub fn positions_of(self, layer: usize, layers: usize, n_kv: usize) -> SlotPositions {
        SlotPositions {
            lists: self.lists(layers, n_kv) as u32,
            first: self.list_of(layer, 0, n_kv) as u32,
            per_kv: u32::from(self == Granularity::Head),
        }
    }
}

/// How a layer's kernels index the slot positions, `[slots, lists]` u32:
/// KV head h's position of slot s is at `s * lists + first + h * per_kv`
/// (the `kpos_*` fields of the kernels' parameters).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SlotPositions {
    pub lists: u32,
    pub first: u32,
    pub per_kv: u32,
}

impl Default for SlotPositions {
    /// One list (token granularity).
    fn default() -> Self {
        SlotPositions {
            lists: 1,
            first: 0,
            per_kv: 0,
        }
    }
}

/// Compacts a fixed set of per-slot buffers with `n_lists` keep lists of
/// the same length (one, or one per layer, or per (layer, KV head):
/// `Granularity`).
pub struct Compactor {
    pipeline: Arc<wgpu::ComputePipeline>,
    refresh: wgpu::Buffer,
    keep: wgpu::Buffer,
    scratch: wgpu::Buffer,
    units: Vec<Unit>,
    max_keep: usize,
    n_lists: usize,
}

impl Compactor {
    /// `targets` are per-slot buffers, each in one or more pages, with the
    /// keep lists that move them (of `n_lists`); `max_keep` bounds a keep
    /// list. Scratch holds the kept rows of as many
    /// (buffer, destination page) units as fit one storage binding of the
    /// device; the units are gathered batch by batch.
    pub fn new(
        gpu: &Gpu,
        targets: &[(&SlotPages, RowLists)],
        max_keep: usize,
        n_lists: usize,
    ) -> Result<Self> {
        let pipeline = gpu.pipeline(&shaders::COMPACT, None, "main", &[])?;
        let refresh = gpu.uniform("refresh", &[0u32; 4]);
        for (t, lists) in targets {
            let words = t.row_bytes / 4;
            anyhow::ensure!(
                lists.per_row >= 1
                    && words.is_multiple_of(lists.per_row as u64)
                    && lists.first + lists.per_row <= n_lists,
                "compaction: rows of {words} words cannot take keep lists {lists:?} of {n_lists}"
            );
        }
        let keep_bytes = (max_keep as u64 * 4).checked_mul(n_lists as u64);
        let keep_bytes = keep_bytes.unwrap_or(u64::MAX);
        gpu.check_binding("keep lists (lists x budget x 4 bytes)", keep_bytes)?;
        let keep = gpu.storage("keep-list", keep_bytes);
        // (target, destination page, kept rows that land there), in target
        // order and ascending pages. Batches copy back in this order, which is
        // safe because keep[i] >= i: a unit never reads a slot of a page that
        // an earlier unit of its buffer has overwritten.
        let mut plan = vec![];
        for (t, (target, _)) in targets.iter().enumerate() {
            for p in 0..target.n_pages() {
                let r = target.range(p);
                let rows = r.start..r.end.min(max_keep);
                if !rows.is_empty() {
                    plan.push((t, p, rows));
                }
            }
        }
        let unit_bytes = |(t, _, rows): &(usize, usize, Range<usize>)| {
            targets[*t].0.row_bytes * rows.len() as u64
        };
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
            let (target, lists) = targets[*t];
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
                            sub_len: (target.row_bytes / 4 / lists.per_row as u64) as u32,
                            list_first: lists.first as u32,
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
            n_lists,
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

    /// Row i of every buffer becomes its former row `keep[i]` of the list
    /// that moves it: `lists` holds the compactor's `n_lists` keep lists,
    /// each sorted ascending (stable order), all of one length, at most
    /// `max_keep`.
    pub fn compact(&self, gpu: &Gpu, lists: &[&[u32]]) -> Result<()> {
        anyhow::ensure!(
            lists.len() == self.n_lists,
            "{} keep lists given, the compactor takes {}",
            lists.len(),
            self.n_lists
        );
        let n_keep = lists.first().map_or(0, |k| k.len());
        anyhow::ensure!(
            n_keep <= self.max_keep,
            "keep list longer than the compactor's {}",
            self.max_keep
        );
        for keep in lists {
            anyhow::ensure!(
                keep.len() == n_keep,
                "keep lists of {} and {} entries: every list keeps as many",
                n_keep,
                keep.len()
            );
            anyhow::ensure!(
                keep.windows(2).all(|w| w[0] < w[1]),
                "keep list must be strictly ascending"
            );
        }
        if n_keep == 0 {
            return Ok(());
        }
        gpu.write(
            &self.refresh,
            0,
            bytemuck::bytes_of(&[n_keep as u32, 0, 0, 0]),
        );
        gpu.write(&self.keep, 0, bytemuck::cast_slice(&lists.concat()));
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
                sub_len: (row_bytes / 4) as u32,
                list_first: 0,
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

/// CPU reference: the kept rows of `data` (row length `row`), sub-row j of
/// kept row i from row `lists[moved.first + j][i]`.
pub fn reference(data: &[u32], row: usize, lists: &[&[u32]], moved: RowLists) -> Vec<u32> {
    let sub = row / moved.per_row;
    let n_keep = lists[0].len();
    (0..n_keep)
        .flat_map(|i| {
            (0..moved.per_row).flat_map(move |j| {
                let k = lists[moved.first + j][i] as usize;
                data[k * row + j * sub..k * row + (j + 1) * sub]
                    .iter()
                    .copied()
            })
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

    /// A keep list per (layer, KV head) (`--granularity head`): four lists
    /// of 120 random slots each move the sub-rows of a K-like row (one per
    /// list), a row taken whole by list 2, and one word per list (the slot
    /// positions), in pages of 64 and of 300 slots.
    #[cfg_attr(test, test)]
    fn a_keep_list_per_sub_row() {
        let gpu = gpu();
        let (slots, j, n_lists) = (300usize, 120usize, 4usize);
        let lists: Vec<Vec<u32>> = (0..n_lists as u64)
            .map(|l| random_keep(slots, j, 11 + l))
            .collect();
        let refs: Vec<&[u32]> = lists.iter().map(|l| l.as_slice()).collect();
        let rows = [
            (
                4 * 24usize,
                RowLists {
                    first: 0,
                    per_row: 4,
                },
            ),
            (12, RowLists::whole(2)),
            (
                4 * n_lists,
                RowLists {
                    first: 0,
                    per_row: n_lists,
                },
            ),
        ];
        for page in [64, 300] {
            let data: Vec<Vec<u32>> = (0..rows.len())
                .map(|i| words(slots * rows[i].0 / 4, i as u32))
                .collect();
            let bufs: Vec<SlotPages> = data
                .iter()
                .zip(rows)
                .map(|(d, (rb, _))| SlotPages::from_rows(&gpu, d, rb / 4, page))
                .collect();
            let targets: Vec<(&SlotPages, RowLists)> =
                bufs.iter().zip(rows).map(|(b, (_, l))| (b, l)).collect();
            let c = Compactor::new(&gpu, &targets, j, n_lists).unwrap();
            c.compact(&gpu, &refs).unwrap();
            for (k, (b, (rb, moved))) in bufs.iter().zip(rows).enumerate() {
                let row = rb / 4;
                let all: Vec<u32> = b.read(&gpu, slots).unwrap();
                assert_eq!(
                    all[..j * row],
                    reference(&data[k], row, &refs, moved),
                    "buffer {k}, pages of {page}"
                );
            }
        }
        // Lists of unequal length, or too few lists, are refused.
        let b = SlotPages::single(&gpu, gpu.storage("b", 64 * 4), 16, 16);
        let c = Compactor::new(
            &gpu,
            &[(
                &b,
                RowLists {
                    first: 0,
                    per_row: 4,
                },
            )],
            4,
            4,
        )
        .unwrap();
        assert!(c.compact(&gpu, &[&[0, 1], &[0, 1], &[0], &[2, 3]]).is_err());
        assert!(c.compact(&gpu, &[&[0, 1]]).is_err());
        // A row that does not split into its lists' sub-rows is refused.
        assert!(Compactor::new(
            &gpu,
            &[(
                &b,
                RowLists {
                    first: 0,
                    per_row: 3
                }
            )],
            4,
            4
        )
        .is_err());
        assert!(Compactor::new(
            &gpu,
            &[(
                &b,
                RowLists {
                    first: 2,
                    per_row: 4
                }
            )],
            4,
            4
        )
        .is_err());
    }

    /// `j` distinct slots of `slots`, ascending, shuffled by `seed`.
    fn random_keep(slots: usize, j: usize, seed: u64) -> Vec<u32> {
        let mut lcg = seed;
        let mut all: Vec<u32> = (0..slots as u32).collect();
        for i in (1..all.len()).rev() {
            lcg = lcg.wrapping_mul(6364136223846793005).wrapping_add(1);
            all.swap(i, (lcg >> 33) as usize % (i + 1));
        }
        let mut keep = all[..j].to_vec();
        keep.sort();
        keep
    }

    /// `n` distinct-looking words, salted.
    fn words(n: usize, salt: u32) -> Vec<u32> {
        (0..n as u32)
            .map(|x| x.wrapping_mul(2654435761).wrapping_add(salt))
            .collect()
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
            .map(|(i, rb)| words(slots * rb / 4, i as u32))
            .collect();
        let j = 120;
        let random = random_keep(slots, j, 7);
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
            let targets: Vec<(&SlotPages, RowLists)> =
                bufs.iter().map(|b| (b, RowLists::whole(0))).collect();
            let c = Compactor::new(gpu, &targets, j, 1).unwrap();
            if gpu.max_binding < 94_000 {
                assert_eq!(
                    c.batches(),
                    2,
                    "a K row buffer alone, then the two small ones"
                );
            }
            c.compact(gpu, &[&keep]).unwrap();
            for (k, (b, rb)) in bufs.iter().zip(rows).enumerate() {
                let row = rb / 4;
                let all: Vec<u32> = b.read(gpu, slots).unwrap();
                let got = &all[..keep.len() * row];
                let what = format!("{name}, buffer {k}, pages of {page}");
                assert_eq!(
                    got,
                    reference(&data[k], row, &[&keep], RowLists::whole(0)),
                    "{what}"
                );
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
        let c = Compactor::new(&gpu, &[(&b, RowLists::whole(0))], 4, 1).unwrap();
        assert!(c.compact(&gpu, &[&[2, 1]]).is_err());
        assert!(c.compact(&gpu, &[&[0, 1, 2, 3, 4]]).is_err());
    }

    crate::kernels::checks::register![
        keep_lists_that_stress_in_place_moves,
        a_keep_list_per_sub_row,
        paged_buffers,
        scratch_larger_than_one_binding_is_split_into_batches,
        rejects_unsorted_or_long_keep_lists,
    ];
}
