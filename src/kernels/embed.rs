//! `shaders/embed.wgsl`: token embedding lookup.

use anyhow::Result;
use std::sync::Arc;

use super::{ceil_div, dispatch, table_part_groups};
use crate::gpu::Gpu;
use crate::shaders;
use crate::weights::GpuMatrix;

pub struct Embed {
    pipeline: Arc<wgpu::ComputePipeline>,
    groups: Vec<wgpu::BindGroup>,
    hidden4: u32,
}

impl Embed {
    /// `table` is `[vocab, hidden]`, `ids` `[n]` u32, `x` `[n, hidden]` f32.
    pub fn new(
        gpu: &Gpu,
        step: &wgpu::Buffer,
        table: &GpuMatrix,
        ids: &wgpu::Buffer,
        x: &wgpu::Buffer,
        scale: f32,
    ) -> Result<Self> {
        let format = table.single_format("the embedding table")?;
        // An override constant only where it scales, so the other models'
        // pipeline is the one they always had.
        let constants: Vec<(&str, f64)> = if scale == 1.0 {
            vec![]
        } else {
            vec![("SCALE", scale as f64)]
        };
        let pipeline = gpu.pipeline(&shaders::EMBED, Some(format.into()), "main", &constants)?;
        let hidden4 = (table.cols / 4) as u32;
        let groups = table_part_groups(gpu, &pipeline, step, table, &[ids, x]);
        Ok(Embed {
            pipeline,
            groups,
            hidden4,
        })
    }

    pub fn encode(&self, pass: &mut wgpu::ComputePass, n_tokens: u32) {
        for g in &self.groups {
            dispatch(
                pass,
                &self.pipeline,
                g,
                (ceil_div(self.hidden4, 64), n_tokens, 1),
            );
        }
    }
}

/// CPU reference: rows of the table by id, times `scale`.
pub fn reference(table: &[f32], hidden: usize, ids: &[u32], scale: f32) -> Vec<f32> {
    ids.iter()
        .flat_map(|&id| {
            table[id as usize * hidden..(id as usize + 1) * hidden]
                .iter()
                .map(move |v| v * scale)
        })
        .collect()
}

#[cfg(any(test, feature = "kernel-checks"))]
pub(crate) mod tests {
    use super::*;
    use crate::formats::WeightFormat;
    use crate::kernels::testutil::*;
    use crate::kernels::Step;
    use crate::shaders::WeightStore;

    #[cfg_attr(test, test)]
    fn gathers_rows_across_table_parts() {
        for store in WeightStore::ALL {
            // 256-byte bindings split a 37 x 12 f16 table into parts of 8 rows.
            let gpu = gpu_storing(store, Some(256));
            let (vocab, hidden) = (37, 12);
            let mut table = f16_values(rand_vec(vocab * hidden, 5, 2.0));
            let m = GpuMatrix::new(&gpu, "emb", vocab, hidden, WeightFormat::F16).unwrap();
            assert!(m.parts.len() > 1);
            m.write_rows(&gpu, 0, &table, "emb").unwrap();
            let ids = vec![36, 0, 8, 7, 9, 16, 35, 10];
            for ids in [vec![0u32], ids.clone()] {
                assert_eq!(
                    gather(&gpu, &m, &ids, 1.0),
                    reference(&table, hidden, &ids, 1.0)
                );
            }
            // Gemma's scale: sqrt(hidden), not a power of two.
            let s = (hidden as f32).sqrt();
            assert_eq!(
                gather(&gpu, &m, &ids, s),
                reference(&table, hidden, &ids, s)
            );
            // Rows written again after the table was read (a texture's
            // staging copy is gone by then): the new rows 7 .. 11, which
            // share words and parts with rows kept, and the others as before.
            let new_rows = f16_values(rand_vec(4 * hidden, 6, 2.0));
            m.write_rows(&gpu, 7, &new_rows, "emb").unwrap();
            table[7 * hidden..11 * hidden].copy_from_slice(&new_rows);
            assert_eq!(
                gather(&gpu, &m, &ids, 1.0),
                reference(&table, hidden, &ids, 1.0),
                "{store:?}"
            );
        }
    }

    fn f16_values(v: Vec<f32>) -> Vec<f32> {
        v.iter().map(|&v| half::f16::from_f32(v).to_f32()).collect()
    }

    /// The rows of `ids` gathered from `m` by the kernel.
    fn gather(gpu: &Gpu, m: &GpuMatrix, ids: &[u32], scale: f32) -> Vec<f32> {
        let n = ids.len();
        let step = step_buffer(
            gpu,
            Step {
                n_tokens: n as u32,
                ..Default::default()
            },
        );
        let idb = gpu.storage_from("ids", ids);
        let x = gpu.storage("x", (n * m.cols * 4) as u64);
        let e = Embed::new(gpu, &step, m, &idb, &x, scale).unwrap();
        run_pass(gpu, |pass| e.encode(pass, n as u32));
        gpu.read(&x, 0, n * m.cols).unwrap()
    }

    /// Every quantized format gathers the dequantized rows (a 256-value
    /// row is one K-quant super-block or eight 32-value blocks), across
    /// table parts.
    #[cfg_attr(test, test)]
    fn gathers_quantized_rows() {
        let (vocab, hidden) = (37, 256);
        let ids = vec![36u32, 0, 8, 7, 9, 16, 35];
        for (store, format) in WeightStore::ALL
            .into_iter()
            .flat_map(|s| quantized().into_iter().map(move |f| (s, f)))
        {
            let gpu = gpu_storing(store, Some(4096));
            let m = GpuMatrix::new(&gpu, "emb", vocab, hidden, format).unwrap();
            assert!(m.parts.len() > 1, "{format:?}");
            let table = fill_test_weights(&gpu, &m, 3);
            let got = gather(&gpu, &m, &ids, 1.0);
            let want = reference(&table, hidden, &ids, 1.0);
            assert!(max_abs_diff(&got, &want) < 1e-5, "{format:?} {store:?}");
        }
    }

    crate::kernels::checks::register![gathers_rows_across_table_parts, gathers_quantized_rows,];
}
