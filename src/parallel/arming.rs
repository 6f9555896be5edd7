//! Fault arming for a run (`wgpar run --inject-fault`, `serve --inject-fault`): which worker
//! fails, how and when, parsed from `stage=1,kind=error,at=step:3`, checked against the
//! strategy and the run's length, and shifted past the untimed warm-up.

use super::{Fault, FaultKind, Strategy};
use crate::error::{Result, WgparError};

/// A parsed `--inject-fault`: which worker, and how and when it fails.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FaultSpec {
    /// Stage (pipeline) or rank (tensor parallel).
    pub worker: usize,
    /// Whether the spec named a stage (`stage=`) rather than a rank (`rank=`).
    pub stage: bool,
    /// How it fails, and after how many of its jobs.
    pub fault: Fault,
}

impl FaultSpec {
    /// Parses `stage=1,kind=error,at=step:3` (or `rank=`; `at` defaults to step 0).
    pub fn parse(text: &str) -> Result<Self> {
        let bad = |why: String| {
            WgparError::option(
                "--inject-fault",
                format!(
                "--inject-fault '{text}': {why}; expected e.g. stage=1,kind=error,at=step:3 or \
                 rank=0,kind=panic (kind: error, panic, device-lost)"
            ),
            )
        };
        let (mut worker, mut kind, mut after) = (None, None, 0);
        for part in text.split(',').map(str::trim) {
            let (key, value) = part
                .split_once('=')
                .ok_or_else(|| bad(format!("'{part}' is not key=value")))?;
            let number = |v: &str| {
                v.trim()
                    .parse::<usize>()
                    .map_err(|_| bad(format!("'{v}' is not a whole number")))
            };
            match key.trim() {
                "stage" | "rank" if worker.is_some() => {
                    return Err(bad("give one of stage= and rank=".into()))
                }
                "stage" => worker = Some((number(value)?, true)),
                "rank" => worker = Some((number(value)?, false)),
                "kind" => {
                    kind = Some(match value.trim() {
                        "error" => FaultKind::Error,
                        "panic" => FaultKind::Panic,
                        "device-lost" => FaultKind::LoseDevice,
                        other => return Err(bad(format!("unknown kind '{other}'"))),
                    })
                }
                "at" => after = number(value.trim().strip_prefix("step:").unwrap_or(value))?,
                other => return Err(bad(format!("unknown key '{other}'"))),
            }
        }
        let (worker, stage) = worker.ok_or_else(|| bad("no stage= or rank=".into()))?;
        let kind = kind.ok_or_else(|| bad("no kind=".into()))?;
        Ok(Self {
            worker,
            stage,
            fault: Fault { after, kind },
        })
    }

    /// Checks the spec against the strategy and the number of stages or ranks.
    pub fn check(&self, strategy: &Strategy, devices: usize) -> Result<()> {
        let (ok, count, what) = match strategy {
            Strategy::Tensor { .. } => (!self.stage, devices, "ranks"),
            Strategy::Pipeline { .. } => (self.stage, devices, "stages"),
            Strategy::Hybrid { tp, .. } => (self.stage, devices / (*tp).max(1), "stages"),
            Strategy::Single => {
                return Err(WgparError::unsupported(
                    "--inject-fault needs --strategy tp (rank=), pp or hybrid (stage=)".into(),
                ))
            }
        };
        if !ok {
            return Err(WgparError::option(
                "--inject-fault",
                format!(
                    "--inject-fault: --strategy {strategy} has {what}: use {}=",
                    if what == "ranks" { "rank" } else { "stage" }
                ),
            ));
        }
        if self.worker >= count {
            return Err(WgparError::option(
                "--inject-fault",
                format!(
                    "--inject-fault: no {} {} among {count} {what}",
                    &what[..what.len() - 1],
                    self.worker
                ),
            ));
        }
        Ok(())
    }

    /// Refuses a fault that the run would end before: the worker runs `jobs` jobs after the
    /// fault is injected (`per_step` per step, micro-batches for a stage).
    pub fn check_reached(&self, jobs: usize, per_step: usize) -> Result<()> {
        if self.fault.after < jobs {
            return Ok(());
        }
        let worker = if self.stage { "stage" } else { "rank" };
        Err(WgparError::option(
            "--inject-fault",
            format!(
                "--inject-fault at=step:{}: {worker} {} runs {jobs} jobs in this run ({per_step} \
             per step), so the fault would never fire: use at=step:0 to at=step:{}, or a longer \
             --gen",
                self.fault.after,
                self.worker,
                jobs.saturating_sub(1)
            ),
        ))
    }
}

/// Jobs a faulted worker runs per step: one per micro-batch for a pipeline stage, one for a
/// tensor-parallel rank.
pub fn jobs_per_step(strategy: &Strategy, micro_batches: usize) -> usize {
    match strategy {
        Strategy::Pipeline { .. } | Strategy::Hybrid { .. } => micro_batches,
        _ => 1,
    }
}

impl FaultSpec {
    /// The fault to inject before a warm-up of `warmup_steps` steps (`per_step` jobs each),
    /// so that its count of jobs (kept by the worker from its start) skips the warm-up's and
    /// counts the timed run's.
    pub fn past_warmup(&self, warmup_steps: usize, per_step: usize) -> Fault {
        Fault {
            after: self.fault.after + warmup_steps * per_step,
            kind: self.fault.kind,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_spec_is_parsed_checked_and_shifted_past_the_warmup() {
        let spec = FaultSpec::parse("stage=1,kind=panic,at=step:3").unwrap();
        assert_eq!((spec.worker, spec.stage), (1, true));
        assert_eq!(spec.fault.kind, FaultKind::Panic);
        let pp = Strategy::Pipeline {
            partition: crate::parallel::PartitionSpec::Even,
            micro_batches: 2,
            schedule: Default::default(),
        };
        spec.check(&pp, 2).unwrap();
        assert!(spec.check(&pp, 1).is_err(), "stage 1 of one stage");
        assert!(spec.check(&Strategy::Tensor { split: None }, 2).is_err());
        assert_eq!(jobs_per_step(&pp, 2), 2);
        // Three timed jobs reach at=step:3 only from four on.
        assert!(spec.check_reached(3, 1).is_err());
        spec.check_reached(4, 1).unwrap();
        assert_eq!(spec.past_warmup(2, 2).after, 3 + 4);
        for bad in [
            "stage=1",
            "kind=error",
            "stage=x,kind=error",
            "stage=0,kind=melt",
        ] {
            assert!(FaultSpec::parse(bad).is_err(), "{bad}");
        }
    }
}
