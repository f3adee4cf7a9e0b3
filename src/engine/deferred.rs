//! Sampling submitted after the forward pass (`Engine::submit_forward`, a
//! batched step's deferred form): a constrained step's mask depends on the
//! token the step feeds, so the host computes it while the GPU runs the
//! step's layers and LM head, then submits the sampler with it.

use anyhow::{bail, Result};

use super::{Engine, Submitted};

/// Submits the pending sampling of each step in `steps`, in one
/// submission; each chooses among the tokens its engine allows now
/// (`Engine::set_allowed`, written by the caller after the forward pass was
/// submitted). Each step must be its engine's last submitted one: its
/// sampler reads the logits that step left.
pub fn submit_samples(steps: &mut [(&mut Engine, &mut Submitted)]) -> Result<()> {
    let Some((first, _)) = steps.first() else {
        return Ok(());
    };
    let gpu = first.model.gpu.clone();
    for (engine, s) in steps.iter() {
        if !s.sample_pending {
            bail!("the step's sampling was already submitted, or it does not sample");
        }
        if s.first_slot + s.n_tokens != engine.n_cached {
            bail!("a step's sampling must be submitted before the engine's next step");
        }
    }
    let mut enc = gpu.device.create_command_encoder(&Default::default());
    {
        let mut pass = enc.begin_compute_pass(&Default::default());
        for (engine, _) in steps.iter() {
            engine.sampler.encode(&mut pass);
        }
    }
    let staged: Vec<(usize, u64)> = (steps.iter_mut())
        .map(|(engine, _)| engine.stage_sample(&mut enc))
        .collect();
    let index = gpu.queue.submit([enc.finish()]);
    for ((engine, s), staging) in steps.iter_mut().zip(staged) {
        s.index = index.clone();
        s.staging = Some(staging);
        s.sample_pending = false;
        engine.last_step_sampled = true;
    }
    Ok(())
}
