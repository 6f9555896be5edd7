//! `--gpu-memory`: a cap on what each device may hold, checked against the memory accounting
//! ([`wgpar::model::memory`]) before any device is opened or weight built; and the line `run`
//! prints after a run, bytes allocated per device against the accounting.

use clap::Args;
use std::sync::Arc;
use wgpar::device::{AdapterDesc, DType, Gpu, MAX_DEVICES};
use wgpar::error::human_bytes;
use wgpar::model::memory::{check_block_splits, per_device, DeviceBytes, MemorySpec, WeightFormat};
use wgpar::model::ModelConfig;
use wgpar::{Result, WgparError};

use super::{ModelArgs, PlannedRun};

/// Longest `--gpu-memory` text read (a size per device, at most [`MAX_DEVICES`]).
const MAX_TEXT: usize = 32 * MAX_DEVICES;

/// `--gpu-memory`, for the commands that run a model on devices.
#[derive(Args, Clone, Debug, Default)]
pub struct MemoryArgs {
    /// Most memory each device may hold for the model (weights, KV cache, activations,
    /// logits, staging), e.g. 6G,10G: one size per selected device, or one for all (K, M, G,
    /// Ki, Mi, Gi: powers of 1024; or plain bytes). A run that would exceed a cap is refused
    /// before any device is opened, with each device's bytes by kind.
    #[arg(long, value_name = "SIZE[,SIZE...]")]
    pub gpu_memory: Option<String>,
}

/// Counts per device or stage (`--split`, `--layers`), or `auto`: placed by memory.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Counts {
    /// Chosen by the memory accounting within the `--gpu-memory` caps.
    Auto,
    /// Given, one per device or stage.
    Given(Vec<usize>),
}

/// Parses `auto` or comma-separated whole numbers (at most one per device wgpar can select).
pub fn parse_counts(text: &str) -> std::result::Result<Counts, String> {
    if text.trim() == "auto" {
        return Ok(Counts::Auto);
    }
    if text.len() > MAX_TEXT {
        return Err(format!(
            "{} characters: give at most one count per device",
            text.len()
        ));
    }
    (text.split(','))
        .map(|part| {
            (part.trim().parse::<usize>())
                .map_err(|_| format!("'{}' is not a whole number (or give auto)", part.trim()))
        })
        .collect::<std::result::Result<Vec<usize>, String>>()
        .map(Counts::Given)
}

/// Parses `--gpu-memory` for `devices` selected devices: one cap each (a single size is
/// every device's).
pub fn parse_caps(text: &str, devices: usize) -> Result<Vec<u64>> {
    let bad =
        |why: String| WgparError::option("--gpu-memory", format!("--gpu-memory '{text}': {why}"));
    if text.len() > MAX_TEXT {
        return Err(WgparError::option(
            "--gpu-memory",
            format!(
            "--gpu-memory is {} characters long: give at most one size per device ({MAX_DEVICES})",
            text.len()
        ),
        ));
    }
    let caps = (text.split(','))
        .map(|part| {
            // `Mi` is read as `MiB`, which the shared size parser takes.
            let part = part.trim();
            let full = match part.ends_with(['i', 'I']) {
                true => format!("{part}B"),
                false => part.to_string(),
            };
            let bytes = wgpar::comm::units::parse_size(&full).map_err(|e| bad(e.to_string()))?;
            if bytes == 0 {
                return Err(bad(format!(
                    "'{}' is zero: a device must hold something",
                    part.trim()
                )));
            }
            Ok(bytes)
        })
        .collect::<Result<Vec<u64>>>()?;
    match caps.len() {
        1 => Ok(vec![caps[0]; devices]),
        n if n == devices => Ok(caps),
        n => Err(bad(format!(
            "{n} sizes for {devices} selected devices: give one per device, or one for all"
        ))),
    }
}

impl MemoryArgs {
    /// Refuses, before anything is opened, a planned run whose tensor-parallel shards would
    /// cut a packed matrix's blocks, or whose accounted bytes exceed a
    /// device's cap; `kv` holds the KV-cache type of each selected device, of which each run
    /// uses the first ones; the weights stored as `model` says. Without `--gpu-memory` only the
    /// block check runs (and nothing is opened).
    pub(super) fn check_runs(
        &self,
        model: &ModelArgs,
        (config, dtype): (&ModelConfig, DType),
        kv: &[DType],
        runs: &[PlannedRun<'_>],
    ) -> Result<()> {
        let format = model.weight_format(config, dtype)?;
        self.check_runs_with(&format, config, kv, runs)
    }

    /// [`Self::check_runs`] with the weights stored as `format`.
    pub(super) fn check_runs_with(
        &self,
        format: &WeightFormat,
        config: &ModelConfig,
        kv: &[DType],
        runs: &[PlannedRun<'_>],
    ) -> Result<()> {
        for run in runs {
            check_block_splits(run.strategy, run.adapters.len(), config, format)?;
        }
        let Some(text) = &self.gpu_memory else {
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
}

/// One rank's device under mpirun: device `rank` of the strategy's `ranks`, on `adapter`,
/// its KV cache in `kv`.
#[cfg_attr(not(feature = "mpi"), allow(dead_code))]
pub(super) struct RankDevice<'a> {
    pub rank: usize,
    pub ranks: usize,
    pub adapter: &'a AdapterDesc,
    pub kv: DType,
}

impl MemoryArgs {
    /// `--gpu-memory` under mpirun, where a rank knows its own adapter alone: this rank's
    /// accounted bytes against its cap (one cap per rank, or one for all). `None` when they
    /// fit or no cap is given; else what this rank needs, for the refusal every rank prints.
    #[cfg_attr(not(feature = "mpi"), allow(dead_code))]
    pub(super) fn rank_over(
        &self,
        (config, format): (&ModelConfig, &WeightFormat),
        strategy: &wgpar::parallel::Strategy,
        work: wgpar::model::memory::Workload,
        me: &RankDevice<'_>,
    ) -> Result<Option<String>> {
        let Some(text) = &self.gpu_memory else {
            return Ok(None);
        };
        let caps = parse_caps(text, me.ranks)?;
        // Devices past the ends of the lists take this adapter's: only this rank's is read.
        let (limits, kv) = (binding_limits(std::iter::once(me.adapter)), [me.kv]);
        let spec = MemorySpec {
            config,
            format,
            kv_dtypes: &kv,
            work,
            binding_limits: &limits,
        };
        let bytes = per_device(strategy, me.ranks, &spec)?;
        let (mine, cap) = (&bytes[me.rank], caps[me.rank]);
        Ok((mine.total() > cap).then(|| {
            format!(
                "needs {} of its {} cap: {}",
                human_bytes(mine.total()),
                human_bytes(cap),
                mine.describe()
            )
        }))
    }
}

/// The bytes one binding may hold on each adapter (what splits the vocabulary tables).
pub fn binding_limits<'a>(adapters: impl Iterator<Item = &'a AdapterDesc>) -> Vec<u64> {
    adapters
        .map(|a| a.max_storage_binding.min(a.max_buffer_size))
        .collect()
}

/// Refuses when a device's accounted total exceeds its cap, naming every device's needs by
/// kind against its cap.
pub fn check_caps(accounted: &[DeviceBytes], caps: &[u64], model: &str) -> Result<()> {
    let over = accounted.iter().zip(caps).any(|(a, &cap)| a.total() > cap);
    if !over {
        return Ok(());
    }
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
    Err(WgparError::Config(format!(
        "model '{model}' does not fit --gpu-memory: {}. Lower --batch or --max-seq, store the \
         layers in fewer bits (--weights q8_0, q4_k), spread the model over more devices, or \
         raise the cap",
        lines.join("; ")
    )))
}

/// Prints, per device, the bytes of the tensors it holds beyond `before` (its live bytes when
/// the engine began to be built) against the accounting's prediction of them, with the
/// accounting's kinds. Scratch freed on the way (the autotuner's measurements) is not held.
pub fn print_allocated(gpus: &[Arc<Gpu>], accounted: &[DeviceBytes], before: &[u64]) -> Result<()> {
    for ((gpu, a), before) in gpus.iter().zip(accounted).zip(before) {
        let allocated = gpu.bytes_live().saturating_sub(*before);
        let predicted = a.tensors();
        let off = (allocated as f64 - predicted as f64) / predicted.max(1) as f64 * 100.0;
        outln!(
            "memory {}: {allocated} B allocated, {predicted} B accounted ({off:+.2} %): {}; \
             beside the tensors: readback {}, staging {}",
            gpu.label(),
            DeviceBytes {
                readback: 0,
                staging: 0,
                ..*a
            }
            .describe(),
            human_bytes(a.readback),
            human_bytes(a.staging),
        )?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn caps_are_one_per_device_or_one_for_all() {
        assert_eq!(parse_caps("6G,10G", 2).unwrap(), vec![6 << 30, 10 << 30]);
        assert_eq!(parse_caps("512Mi", 3).unwrap(), vec![512 << 20; 3]);
        assert_eq!(parse_caps("4096", 1).unwrap(), vec![4096]);
        for (text, needle) in [
            ("6G,10G,1G", "3 sizes for 2"),
            ("0", "zero"),
            ("six", "not a size"),
            ("99999999999999999999G", "not a size"),
            ("", "not a size"),
        ] {
            let e = parse_caps(text, 2).unwrap_err().to_string();
            assert!(e.contains(needle), "{text}: {e}");
        }
        let long = "1G,".repeat(MAX_DEVICES * 20);
        assert!(parse_caps(&long, 2)
            .unwrap_err()
            .to_string()
            .contains("characters"));
    }

    #[test]
    fn a_device_over_its_cap_is_refused_with_every_device() {
        let a = DeviceBytes {
            weights: 3 << 30,
            kv_cache: 1 << 30,
            ..DeviceBytes::default()
        };
        check_caps(&[a, a], &[4 << 30, 5 << 30], "m").unwrap();
        let e = check_caps(&[a, a], &[5 << 30, 3 << 30], "m")
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("gpu0 needs 4.0 GiB of its 5.0 GiB cap (fits)")
                && e.contains("gpu1 needs 4.0 GiB of its 3.0 GiB cap (over)")
                && e.contains("weights 3.0 GiB, KV cache 1.0 GiB"),
            "{e}"
        );
    }
}
