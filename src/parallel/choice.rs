//! A strategy as a command names it (`--strategy`, `--tp`, `--split`, `--layers`,
//! `--partition`, `--micro-batches`, `--schedule`), as plain values: the options that do not
//! apply refused by name, then resolved to a [`Strategy`] (for a run, a server, or ranks).

use super::auto::{AutoPlacement, MAX_LIST_TEXT};
use super::{PartitionSpec, Schedule, Strategy};
use crate::error::{Result, WgparError};

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
    if text.len() > MAX_LIST_TEXT {
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

/// The strategy options of a command.
#[derive(Debug, Clone)]
pub struct StrategyChoice {
    /// none, single, tp, pp or hybrid.
    pub strategy: String,
    /// Hybrid: devices per pipeline stage (default 2).
    pub tp: Option<usize>,
    /// Tensor parallel: shares per device, or auto.
    pub split: Option<Counts>,
    /// Pipeline and hybrid: layers per stage, or auto.
    pub layers: Option<Counts>,
    /// Pipeline and hybrid: even or balanced.
    pub partition: Option<String>,
    /// Pipeline and hybrid: micro-batches per batch (a server's lanes).
    pub micro_batches: Option<usize>,
    /// Pipeline decode: in-flight or gpipe.
    pub schedule: Option<String>,
}

impl Default for StrategyChoice {
    fn default() -> Self {
        Self {
            strategy: "none".into(),
            tp: None,
            split: None,
            layers: None,
            partition: None,
            micro_batches: None,
            schedule: None,
        }
    }
}

impl StrategyChoice {
    /// The automatic placement these options ask for within `gpu_memory` (`--layers auto`,
    /// `--split auto`).
    pub fn auto_placement(&self, gpu_memory: Option<&str>) -> AutoPlacement {
        AutoPlacement::new(
            self.layers == Some(Counts::Auto),
            self.split == Some(Counts::Auto),
            gpu_memory.map(str::to_string),
        )
    }

    /// How the layers are split into stages.
    pub fn partition_spec(&self) -> PartitionSpec {
        match (&self.layers, self.partition.as_deref()) {
            (Some(Counts::Given(l)), _) => PartitionSpec::Explicit(l.clone()),
            (None, Some("balanced")) => PartitionSpec::Balanced,
            // `auto` is placed by `AutoPlacement` once the accounting is at hand.
            _ => PartitionSpec::Even,
        }
    }

    /// The pipeline decode schedule (in flight unless `--schedule gpipe`).
    pub fn schedule(&self) -> Schedule {
        (self.schedule.as_deref())
            .and_then(Schedule::parse)
            .unwrap_or_default()
    }

    /// Refuses options that do not apply to the chosen strategy instead of ignoring them.
    pub fn check_options(&self) -> Result<()> {
        let s = self.strategy.as_str();
        let pipeline = matches!(s, "pp" | "hybrid");
        let refused = [
            (
                self.split.is_some() && s != "tp",
                "--split",
                "sets tensor-parallel shares (--strategy tp; hybrid stages split evenly)",
            ),
            (
                self.layers.is_some() && !pipeline,
                "--layers",
                "sets layers per pipeline stage (pp, hybrid)",
            ),
            (
                self.partition.is_some() && !pipeline,
                "--partition",
                "splits layers into stages (pp, hybrid)",
            ),
        ];
        refuse_first(s, &refused)?;
        if self.layers.is_some() && self.partition.as_deref() == Some("balanced") {
            return Err(WgparError::unsupported(
                "--layers and --partition balanced both set the stages: give one".into(),
            ));
        }
        let refused = [
            (
                self.micro_batches.is_some() && !pipeline,
                "--micro-batches",
                "splits a batch for a pipeline (pp, hybrid)",
            ),
            (
                self.schedule.is_some() && !pipeline,
                "--schedule",
                "schedules a pipeline's decode (pp, hybrid)",
            ),
            (
                self.tp.is_some() && s != "hybrid",
                "--tp",
                "sets the devices per hybrid stage (--strategy tp uses every device)",
            ),
        ];
        refuse_first(s, &refused)
    }

    /// Whether `--layers auto` or `--split auto` asks for a placement by memory.
    pub fn auto(&self) -> bool {
        self.layers == Some(Counts::Auto) || self.split == Some(Counts::Auto)
    }

    /// The strategy over MPI ranks, with `micro_batches` where none is given. `auto`
    /// placements are refused (each rank would measure its own devices alone).
    pub fn over_ranks(&self, micro_batches: usize) -> Result<Strategy> {
        if self.auto() {
            return Err(WgparError::unsupported(
                "--layers auto and --split auto are not taken under mpirun (each rank would \
                 measure its own devices alone): give the counts"
                    .into(),
            ));
        }
        self.named(micro_batches)
    }

    /// The strategy these options name, with `micro_batches` where none is given; `auto`
    /// placed evenly (see [`AutoPlacement`]).
    pub fn named(&self, micro_batches: usize) -> Result<Strategy> {
        self.check_options()?;
        let micro_batches = self.micro_batches.unwrap_or(micro_batches);
        Ok(match self.strategy.as_str() {
            "tp" => Strategy::Tensor {
                split: match &self.split {
                    Some(Counts::Given(v)) => Some(v.clone()),
                    _ => None,
                },
            },
            "pp" => Strategy::Pipeline {
                partition: self.partition_spec(),
                micro_batches,
                schedule: self.schedule(),
            },
            "hybrid" => Strategy::Hybrid {
                tp: self.tp.unwrap_or(2),
                partition: self.partition_spec(),
                micro_batches,
                schedule: self.schedule(),
            },
            _ => Strategy::Single,
        })
    }

    /// The strategy a serving run uses on `devices` devices with `max_batch` KV slots: a
    /// pipeline keeps one step per lane in flight, one lane per stage by default (never more
    /// lanes than slots), and more lanes than slots are refused; `--schedule gpipe` is
    /// refused, since requests join and leave the running batch at every token.
    pub fn serving(&self, devices: usize, max_batch: usize) -> Result<Strategy> {
        self.check_serving()?;
        let stages = match self.strategy.as_str() {
            "pp" => devices,
            "hybrid" => devices / self.tp.unwrap_or(2).max(1),
            _ => 1,
        };
        // `auto` is placed by `AutoPlacement`, around the devices' opening.
        let strategy = self.named(stages.clamp(1, max_batch))?;
        check_lanes_have_slots(&strategy, max_batch)?;
        Ok(strategy)
    }

    /// Refuses `--schedule gpipe` for a server, which has no fill-drain.
    pub fn check_serving(&self) -> Result<()> {
        if self.schedule() == Schedule::GPipe {
            return Err(WgparError::unsupported(
                "--schedule gpipe does not apply to serve: requests join and leave the running \
                 batch at every token"
                    .into(),
            ));
        }
        Ok(())
    }
}

/// The first refused option of `refused` (given, option, what it does) under strategy `s`.
fn refuse_first(s: &str, refused: &[(bool, &str, &str)]) -> Result<()> {
    match refused.iter().find(|(given, _, _)| *given) {
        Some((_, option, applies)) => Err(WgparError::unsupported(format!(
            "{option} does not apply to --strategy {s}: it {applies}"
        ))),
        None => Ok(()),
    }
}

/// Refuses a pipeline with more micro-batch lanes than KV slots: the extra lanes would never
/// run a sequence.
pub fn check_lanes_have_slots(strategy: &Strategy, max_batch: usize) -> Result<()> {
    let lanes = match strategy {
        Strategy::Pipeline { micro_batches, .. } | Strategy::Hybrid { micro_batches, .. } => {
            *micro_batches
        }
        _ => return Ok(()),
    };
    if lanes > max_batch {
        return Err(WgparError::unsupported(format!(
            "--micro-batches {lanes} keeps {lanes} lanes in flight, but --max-batch {max_batch} \
             gives KV slots to only {max_batch} of them: raise --max-batch to at least {lanes} \
             or lower --micro-batches to {max_batch}"
        )));
    }
    Ok(())
}
