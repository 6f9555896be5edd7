//! Memory checked around a run: before any device opens or weight is built, every planned
//! configuration against the adapters' buffer limits, the host's memory and the per-device
//! caps of `--gpu-memory` (the accounting of [`crate::model::memory`]); after the engine is
//! built, the bytes each device allocated against that accounting.

use std::sync::Arc;

use crate::device::{AdapterDesc, DType, Gpu};
use crate::error::{human_bytes, Result, WgparError};
use crate::model::memory::{
    check_block_splits, per_device, DeviceBytes, MemorySpec, WeightFormat, Workload,
};
use crate::model::{budget, ModelConfig};
use crate::parallel::auto::{binding_limits, parse_caps};
use crate::parallel::Strategy;

/// One configuration a command will run, as [`check_runs_fit`] checks it.
pub struct PlannedRun<'a> {
    /// Its strategy.
    pub strategy: &'a Strategy,
    /// The adapters of the devices it uses, in order.
    pub adapters: &'a [AdapterDesc],
    /// New tokens of its largest step (a whole prefill, or one micro-batch's).
    pub step_tokens: usize,
    /// Sequences whose KV cache a device holds.
    pub batch: usize,
    /// The whole batch and prompt, for the memory accounting (`--gpu-memory`).
    pub work: Workload,
}

/// Refuses a prompt and generation longer than the model's context.
pub fn check_context(prompt_len: usize, gen: usize, config: &ModelConfig) -> Result<()> {
    if prompt_len.saturating_add(gen) > config.max_seq {
        return Err(WgparError::limit(
            "context (tokens)",
            (prompt_len.saturating_add(gen) as u64, config.max_seq as u64),
            format!(
                "--prompt-len {prompt_len} + --gen {gen} exceed max_seq {} of model '{}' (raise \
                 it with --max-seq)",
                config.max_seq, config.name
            ),
        ));
    }
    Ok(())
}

/// What a command that builds a model checks before it opens a device or builds a weight:
/// every configuration it will run fits the selected adapters' buffer and storage-binding
/// limits, and the model's weights fit the host's memory. So an oversized model is refused
/// in milliseconds, not after minutes of building weights.
pub fn check_runs_fit(config: &ModelConfig, dtype: DType, runs: &[PlannedRun]) -> Result<()> {
    for run in runs {
        run.strategy
            .check_fits(config, dtype, run.adapters, run.step_tokens, run.batch)?;
    }
    budget::check_host_weights(config, budget::host_available_bytes())
}

/// Refuses a planned run whose tensor-parallel shards would cut a packed matrix's blocks, or
/// whose accounted bytes exceed a device's cap in `caps` (`--gpu-memory`'s text; without it
/// only the block check runs); `kv` holds the KV-cache type of each selected device, of which
/// each run uses the first ones; the weights stored as `format`.
pub fn check_runs_capped(
    caps: Option<&str>,
    format: &WeightFormat,
    config: &ModelConfig,
    kv: &[DType],
    runs: &[PlannedRun<'_>],
) -> Result<()> {
    for run in runs {
        check_block_splits(run.strategy, run.adapters.len(), config, format)?;
    }
    let Some(text) = caps else {
        return Ok(());
    };
    let caps = parse_caps(text, kv.len())?;
    for run in runs {
        let limits = binding_limits(run.adapters.iter());
        let spec = MemorySpec {
            config,
            format,
            kv_dtypes: kv,
            work: run.work,
            binding_limits: &limits,
        };
        let accounted = per_device(run.strategy, run.adapters.len(), &spec)?;
        check_caps(&accounted, &caps, &config.name)?;
    }
    Ok(())
}

/// Refuses when a device's accounted total exceeds its cap, naming every device's needs by
/// kind against its cap.
pub fn check_caps(accounted: &[DeviceBytes], caps: &[u64], model: &str) -> Result<()> {
    let Some((i, (a, &cap))) =
        (accounted.iter().zip(caps).enumerate()).find(|(_, (a, &cap))| a.total() > cap)
    else {
        return Ok(());
    };
    let lines: Vec<String> = (accounted.iter().zip(caps).enumerate())
        .map(|(i, (a, &cap))| {
            let verdict = if a.total() > cap { "over" } else { "fits" };
            format!(
                "gpu{i} needs {} of its {} cap ({verdict}): {}",
                human_bytes(a.total()),
                human_bytes(cap),
                a.describe()
            )
        })
        .collect();
    // The first device over its cap carries the numbers; the message names every device.
    Err(WgparError::limit(
        format!("memory of gpu{i} under --gpu-memory (bytes)"),
        (a.total(), cap),
        format!(
            "model '{model}' does not fit --gpu-memory: {}. Lower --batch or --max-seq, store \
             the layers in fewer bits (--weights q8_0, q4_k), spread the model over more \
             devices, or raise the cap",
            lines.join("; ")
        ),
    ))
}

/// Per device, the bytes of the tensors it holds beyond `before` (its live bytes when the
/// engine began to be built) against the accounting's prediction of them, with the
/// accounting's kinds, one line each. Scratch freed on the way (the autotuner's measurements)
/// is not held.
pub fn render_allocated(gpus: &[Arc<Gpu>], accounted: &[DeviceBytes], before: &[u64]) -> String {
    let mut s = String::new();
    for ((gpu, a), before) in gpus.iter().zip(accounted).zip(before) {
        let allocated = gpu.bytes_live().saturating_sub(*before);
        let predicted = a.tensors();
        let off = (allocated as f64 - predicted as f64) / predicted.max(1) as f64 * 100.0;
        s += &format!(
            "memory {}: {allocated} B allocated, {predicted} B accounted ({off:+.2} %): {}; \
             beside the tensors: readback {}, staging {}\n",
            gpu.label(),
            DeviceBytes {
                readback: 0,
                staging: 0,
                ..*a
            }
            .describe(),
            human_bytes(a.readback),
            human_bytes(a.staging),
        );
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_device_over_its_cap_is_refused_with_every_device() {
        let a = DeviceBytes {
            weights: 3 << 30,
            kv_cache: 1 << 30,
            ..DeviceBytes::default()
        };
        check_caps(&[a, a], &[4 << 30, 5 << 30], "m").unwrap();
        let e = check_caps(&[a, a], &[5 << 30, 3 << 30], "m").unwrap_err();
        let WgparError::ResourceLimit {
            needed, available, ..
        } = &e
        else {
            panic!("not a resource limit: {e}")
        };
        assert_eq!((*needed, *available), (4 << 30, 3 << 30));
        assert_eq!(e.exit_code(), crate::error::EXIT_FAILURE);
        let e = e.to_string();
        assert!(
            e.contains("gpu0 needs 4.0 GiB of its 5.0 GiB cap (fits)")
                && e.contains("gpu1 needs 4.0 GiB of its 3.0 GiB cap (over)")
                && e.contains("weights 3.0 GiB, KV cache 1.0 GiB"),
            "{e}"
        );
    }
}
