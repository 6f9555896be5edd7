//! `wgpar plan`: modeled projections for models and machines that are not at hand. The
//! engines' schedules are rebuilt as timelines ([`modeled_timeline`]) and projected onto host
//! profiles: how TP's all-reduce share grows with batch and sequence over PCIe and NVLink, where
//! PP's throughput overtakes TP's, and what the bubble costs at m = 1 and m = 4p.

use std::fmt::Write;

use serde::Serialize;

use super::modeled::modeled_timeline;
use crate::device::DType;
use crate::error::{Result, WgparError};
use crate::model::{valid_tp_degrees, ModelConfig, Step};
use crate::parallel::{PartitionSpec, Strategy};
use crate::sim::{project, CollectivePolicy, HostProfile, ProjectOptions};

/// What to model.
#[derive(Debug, Clone)]
pub struct PlanOptions {
    /// The model.
    pub config: ModelConfig,
    /// Weight storage (sets bytes moved per FLOP on the modeled devices).
    pub dtype: DType,
    /// Devices per configuration.
    pub devices: usize,
    /// Batch sizes.
    pub batches: Vec<usize>,
    /// Prompt lengths.
    pub seqs: Vec<usize>,
    /// Host profiles.
    pub profiles: Vec<HostProfile>,
    /// Decode steps modeled per configuration.
    pub decode_steps: usize,
}

/// One modeled configuration on one profile.
#[derive(Debug, Clone, Serialize)]
pub struct PlanRow {
    /// Profile.
    pub profile: String,
    /// Strategy label.
    pub strategy: String,
    /// Batch.
    pub batch: usize,
    /// Prompt length.
    pub seq: usize,
    /// Prefill latency (time to first token), ms.
    pub prefill_ms: f64,
    /// Communication share of device-time during prefill.
    pub prefill_comm: f64,
    /// One decode step, ms.
    pub decode_ms: f64,
    /// Generated tokens/s.
    pub decode_tps: f64,
    /// Communication share during decode.
    pub decode_comm: f64,
    /// Bubble share during decode.
    pub decode_bubble: f64,
}

fn strategies(config: &ModelConfig, n: usize) -> Vec<(String, Strategy)> {
    let mut v = vec![("single".to_string(), Strategy::Single)];
    if n >= 2 && valid_tp_degrees(config).contains(&n) {
        v.push((format!("tp{n}"), Strategy::Tensor { split: None }));
    }
    if n >= 2 && n <= config.layers {
        for m in [1, 4 * n] {
            v.push((
                format!("pp{n} m={m}"),
                Strategy::Pipeline {
                    partition: PartitionSpec::Even,
                    micro_batches: m,
                },
            ));
        }
    }
    v
}

/// Models every (profile, strategy, batch, seq).
pub fn plan(opts: &PlanOptions) -> Result<Vec<PlanRow>> {
    if opts.devices == 0 || opts.batches.is_empty() || opts.seqs.is_empty() {
        return Err(WgparError::Config(
            "plan needs devices, batches and sequence lengths".into(),
        ));
    }
    let mut rows = Vec::new();
    // The cheapest collective on each profile: NVLink rings on a DGX, the host path elsewhere.
    let popts = ProjectOptions {
        collectives: CollectivePolicy::Best,
        ..ProjectOptions::default()
    };
    for profile in &opts.profiles {
        if profile.device_count() < opts.devices {
            return Err(WgparError::Config(format!(
                "profile {} has {} devices, fewer than {}",
                profile.name,
                profile.device_count(),
                opts.devices
            )));
        }
        for (label, strategy) in strategies(&opts.config, opts.devices) {
            let n = if matches!(strategy, Strategy::Single) {
                1
            } else {
                opts.devices
            };
            for &batch in &opts.batches {
                for &seq in &opts.seqs {
                    if seq + opts.decode_steps > opts.config.max_seq {
                        continue;
                    }
                    let step = Step {
                        batch,
                        seq,
                        past: 0,
                    };
                    let pre = modeled_timeline(&strategy, n, &opts.config, opts.dtype, step, 1)?;
                    let dec_step = Step {
                        batch,
                        seq: 1,
                        past: seq,
                    };
                    let dec = modeled_timeline(
                        &strategy,
                        n,
                        &opts.config,
                        opts.dtype,
                        dec_step,
                        opts.decode_steps,
                    )?;
                    let err = |source: crate::sim::ProjectError| WgparError::Projection {
                        what: label.clone(),
                        profile: profile.name.clone(),
                        source,
                    };
                    let p = project(&pre, profile, &popts)
                        .map_err(err)?
                        .report
                        .projected;
                    let d = project(&dec, profile, &popts)
                        .map_err(err)?
                        .report
                        .projected;
                    let decode_ms = d.makespan_us / 1e3 / opts.decode_steps.max(1) as f64;
                    rows.push(PlanRow {
                        profile: profile.name.clone(),
                        strategy: label.clone(),
                        batch,
                        seq,
                        prefill_ms: p.makespan_us / 1e3,
                        prefill_comm: p.comm_share,
                        decode_ms,
                        decode_tps: batch as f64 / (decode_ms / 1e3),
                        decode_comm: d.comm_share,
                        decode_bubble: d.bubble_share,
                    });
                }
            }
        }
    }
    Ok(rows)
}

/// The rows as Markdown tables, one per profile.
pub fn plan_markdown(opts: &PlanOptions, rows: &[PlanRow]) -> String {
    let mut s = String::new();
    let c = &opts.config;
    let _ = writeln!(
        s,
        "Modeled (not measured): {} ({:.2}B parameters, {:?} weights, f32 arithmetic as wgpar's kernels do) on {} devices; decode averaged over {} steps; collectives costed with the best algorithm each profile has (NVLink ring on DGX, host-staged elsewhere).\n",
        c.name,
        c.params() as f64 / 1e9,
        opts.dtype,
        opts.devices,
        opts.decode_steps
    );
    for profile in &opts.profiles {
        let _ = writeln!(s, "### {}\n", profile.name);
        let _ = writeln!(s, "| strategy | batch | prompt | TTFT ms | prefill comm % | decode ms/step | tokens/s | decode comm % | bubble % |");
        let _ = writeln!(s, "|---|---:|---:|---:|---:|---:|---:|---:|---:|");
        for r in rows.iter().filter(|r| r.profile == profile.name) {
            let _ = writeln!(
                s,
                "| {} | {} | {} | {:.2} | {:.1} | {:.3} | {:.0} | {:.1} | {:.1} |",
                r.strategy,
                r.batch,
                r.seq,
                r.prefill_ms,
                r.prefill_comm * 100.0,
                r.decode_ms,
                r.decode_tps,
                r.decode_comm * 100.0,
                r.decode_bubble * 100.0
            );
        }
        let _ = writeln!(s);
    }
    s
}
