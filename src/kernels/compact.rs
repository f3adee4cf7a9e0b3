//! `shaders/compact.wgsl`: moves the kept rows of per-slot buffers (K and V of
//! every layer, and any other per-slot data) to the front, in keep-list order,
//! on the GPU: a gather into scratch, then a copy back.

use anyhow::Result;
use bytemuck::{Pod, Zeroable};
use std::sync::Arc;

use super::{ceil_div, dispatch};
use crate::gpu::Gpu;
use crate::shaders;

#[repr(C)]
#[derive(Clone, Copy, Pod, Zeroable)]
struct Params {
    row_len: u32,
    dst_offset: u32,
    _p: [u32; 2],
}

struct Target {
    buffer: wgpu::Buffer,
    group: wgpu::BindGroup,
    row_bytes: u64,
    scratch_offset: u64,
    /// Targets are gathered in batches whose kept rows fit one scratch binding;
    /// this is the batch this target belongs to.
    batch: usize,
}

/// Compacts a fixed set of per-slot buffers with one keep list.
pub struct Compactor {
    pipeline: Arc<wgpu::ComputePipeline>,
    refresh: wgpu::Buffer,
    keep: wgpu::Buffer,
    scratch: wgpu::Buffer,
    targets: Vec<Target>,
    max_keep: usize,
}

impl Compactor {
    /// `buffers` are (buffer, bytes per slot row); `max_keep` bounds the keep list.
    /// Scratch holds `max_keep` rows of as many buffers as fit one storage
    /// binding of the device; the buffers are gathered batch by batch.
    pub fn new(gpu: &Gpu, buffers: &[(&wgpu::Buffer, u64)], max_keep: usize) -> Result<Self> {
        let pipeline = gpu.pipeline(&shaders::COMPACT, None, "main", &[])?;
        let refresh = gpu.uniform("refresh", &[0u32; 4]);
        let keep = gpu.storage("keep-list", max_keep as u64 * 4);
        let kept_bytes = |row_bytes: u64| row_bytes * max_keep as u64;
        let largest = buffers
            .iter()
            .map(|(_, rb)| kept_bytes(*rb))
            .max()
            .unwrap_or(4);
        gpu.check_binding(
            "compaction scratch (the kept rows of one per-slot buffer)",
            largest,
        )?;
        let total: u64 = buffers.iter().map(|(_, rb)| kept_bytes(*rb)).sum();
        let scratch_bytes = total.min(gpu.max_binding / 4 * 4).max(largest);
        let scratch = gpu.storage("compaction-scratch", scratch_bytes);
        let mut offset = 0;
        let mut batch = 0;
        let mut targets = vec![];
        for (buf, row_bytes) in buffers {
            assert!(row_bytes % 4 == 0, "per-slot rows are whole u32 words");
            if offset + kept_bytes(*row_bytes) > scratch_bytes {
                batch += 1;
                offset = 0;
            }
            let params = gpu.uniform(
                "compact-params",
                &Params {
                    row_len: (*row_bytes / 4) as u32,
                    dst_offset: (offset / 4) as u32,
                    _p: [0; 2],
                },
            );
            let group = gpu.bind_group(&pipeline, &[&refresh, &params, &keep, buf, &scratch]);
            targets.push(Target {
                buffer: (*buf).clone(),
                group,
                row_bytes: *row_bytes,
                scratch_offset: offset,
                batch,
            });
            offset += row_bytes * max_keep as u64;
        }
        Ok(Compactor {
            pipeline,
            refresh,
            keep,
            scratch,
            targets,
            max_keep,
        })
    }

    /// Number of gather batches (1 when the kept rows of all buffers fit one binding).
    pub fn batches(&self) -> usize {
        self.targets.last().map_or(0, |t| t.batch + 1)
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
        let mut enc = gpu.device.create_command_encoder(&Default::default());
        for batch in 0..self.batches() {
            let in_batch = || self.targets.iter().filter(move |t| t.batch == batch);
            {
                let mut pass = enc.begin_compute_pass(&Default::default());
                for t in in_batch() {
                    dispatch(
                        &mut pass,
                        &self.pipeline,
                        &t.group,
                        (ceil_div((t.row_bytes / 4) as u32, 64), keep.len() as u32, 1),
                    );
                }
            }
            for t in in_batch() {
                enc.copy_buffer_to_buffer(
                    &self.scratch,
                    t.scratch_offset,
                    &t.buffer,
                    0,
                    t.row_bytes * keep.len() as u64,
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::testutil::*;

    #[test]
    fn keep_lists_that_stress_in_place_moves() {
        keep_lists_on(&gpu());
    }

    /// With a storage-binding limit that holds the kept rows of only one
    /// buffer, the compactor gathers in batches (what a long context needs on
    /// a device with small bindings).
    #[test]
    fn scratch_larger_than_one_binding_is_split_into_batches() {
        let opts = crate::gpu::GpuOptions {
            max_binding_override: Some(93_000),
            ..Default::default()
        };
        keep_lists_on(&Gpu::new(&opts).unwrap());
    }

    fn keep_lists_on(gpu: &Gpu) {
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
            let bufs: Vec<wgpu::Buffer> = data
                .iter()
                .map(|d| gpu.storage_from("slot-data", d))
                .collect();
            let pairs: Vec<(&wgpu::Buffer, u64)> =
                bufs.iter().zip(rows).map(|(b, r)| (b, r as u64)).collect();
            let c = Compactor::new(gpu, &pairs, j).unwrap();
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
                let got: Vec<u32> = gpu.read(b, 0, keep.len() * row).unwrap();
                assert_eq!(got, reference(&data[k], row, &keep), "{name}, buffer {k}");
                // Rows past the kept ones are untouched.
                let tail: Vec<u32> = gpu.read(b, (keep.len() * row) as u64, row).unwrap();
                assert_eq!(
                    tail,
                    data[k][keep.len() * row..(keep.len() + 1) * row],
                    "{name}, buffer {k} tail"
                );
            }
        }
    }

    #[test]
    fn rejects_unsorted_or_long_keep_lists() {
        let gpu = gpu();
        let b = gpu.storage("b", 64);
        let c = Compactor::new(&gpu, &[(&b, 4)], 4).unwrap();
        assert!(c.compact(&gpu, &[2, 1]).is_err());
        assert!(c.compact(&gpu, &[0, 1, 2, 3, 4]).is_err());
    }
}
