//! Per-kernel GPU time from timestamp queries written between the dispatches
//! of a step (where the adapter supports timestamps inside compute passes).
//!
//! Each mark records the time at which the kernels encoded before it had
//! finished as seen by the GPU's timestamp; the time between two marks is
//! charged to the later mark's label and summed over layers and steps. On
//! GPUs that overlap independent dispatches the split is approximate; the
//! total is exact.

use anyhow::{anyhow, Result};

use crate::gpu::Gpu;

/// At most this many marks per step (a 32-layer model uses about 400).
const MAX_MARKS: u32 = 1024;

pub struct Profiler {
    set: wgpu::QuerySet,
    resolve: wgpu::Buffer,
    readback: wgpu::Buffer,
    period_ns: f64,
    /// Labels of this step's marks, in order (the first is the start).
    marks: Vec<&'static str>,
    /// Total nanoseconds per label, in first-seen order.
    pub totals: Vec<(&'static str, f64)>,
    pub steps: usize,
}

impl Profiler {
    /// None when the adapter cannot write timestamps inside compute passes.
    pub fn new(gpu: &Gpu) -> Option<Self> {
        if !gpu.features.contains(
            wgpu::Features::TIMESTAMP_QUERY | wgpu::Features::TIMESTAMP_QUERY_INSIDE_PASSES,
        ) {
            return None;
        }
        let set = gpu.device.create_query_set(&wgpu::QuerySetDescriptor {
            label: Some("kernel-timestamps"),
            ty: wgpu::QueryType::Timestamp,
            count: MAX_MARKS,
        });
        let bytes = MAX_MARKS as u64 * 8;
        let resolve = gpu.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("timestamp-resolve"),
            size: bytes,
            usage: wgpu::BufferUsages::QUERY_RESOLVE | wgpu::BufferUsages::COPY_SRC,
            mapped_at_creation: false,
        });
        let readback = gpu.readback("timestamp-readback", bytes);
        Some(Profiler {
            set,
            resolve,
            readback,
            period_ns: gpu.queue.get_timestamp_period() as f64,
            marks: vec![],
            totals: vec![],
            steps: 0,
        })
    }

    /// Records a timestamp after the kernels encoded so far; `label` names them.
    pub fn mark(&mut self, pass: &mut wgpu::ComputePass, label: &'static str) {
        let i = self.marks.len() as u32;
        if i < MAX_MARKS {
            pass.write_timestamp(&self.set, i);
            self.marks.push(label);
        }
    }

    /// Resolves this step's timestamps (after the step's passes).
    pub fn resolve(&self, enc: &mut wgpu::CommandEncoder) {
        let n = self.marks.len() as u32;
        if n == 0 {
            return;
        }
        enc.resolve_query_set(&self.set, 0..n, &self.resolve, 0);
        enc.copy_buffer_to_buffer(&self.resolve, 0, &self.readback, 0, n as u64 * 8);
    }

    /// Reads the step's timestamps (after submission) and adds them to the totals.
    pub fn collect(&mut self, gpu: &Gpu) -> Result<()> {
        let n = self.marks.len();
        if n < 2 {
            self.marks.clear();
            return Ok(());
        }
        let bytes = gpu.map_and_read(&self.readback, n as u64 * 8)?;
        let ticks: Vec<u64> = bytemuck::pod_collect_to_vec(&bytes);
        for i in 1..n {
            let dt = ticks[i]
                .checked_sub(ticks[i - 1])
                .ok_or_else(|| anyhow!("timestamps went backwards"))? as f64
                * self.period_ns;
            let label = self.marks[i];
            match self.totals.iter_mut().find(|(l, _)| *l == label) {
                Some((_, t)) => *t += dt,
                None => self.totals.push((label, dt)),
            }
        }
        self.marks.clear();
        self.steps += 1;
        Ok(())
    }

    /// Forgets the totals.
    pub fn clear(&mut self) {
        self.totals.clear();
        self.steps = 0;
    }
}
