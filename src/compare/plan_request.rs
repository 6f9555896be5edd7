//! `wgpar plan`'s options from their text: the model, weight format, strategies, profiles and
//! engines named on the command line, resolved and checked against each other.

use std::path::Path;

use super::{default_strategies, plan_model, PlanOptions, PlanStrategy};
use crate::device::DType;
use crate::error::{Result, WgparError};
use crate::model::memory::{FileBlocks, Vectors, WeightFormat};
use crate::model::quant::QuantType;
use crate::model::ModelConfig;
use crate::parallel::Strategy;
use crate::sim::{Engine, HostProfile, NumFormat};

/// What `wgpar plan` was asked, as text and counts.
#[derive(Debug, Clone, Copy)]
pub struct PlanRequest<'a> {
    /// A preset, a model folder, a `config.json` or a GGUF file.
    pub model: &'a str,
    /// The weight format (`f16`, `q4_k`, ...).
    pub weights: &'a str,
    /// Devices of the default strategies.
    pub devices: usize,
    /// Strategies (`tp4`, `pp2-m4`, ...); empty: the defaults for `devices`.
    pub strategies: &'a [String],
    /// Batch sizes.
    pub batches: &'a [usize],
    /// Prompt lengths.
    pub seqs: &'a [usize],
    /// A context other than the model's.
    pub max_seq: Option<usize>,
    /// Host profiles (names or files).
    pub hosts: &'a [String],
    /// Engines (names or files).
    pub engines: &'a [String],
    /// Decode steps modeled per configuration.
    pub decode_steps: usize,
}

/// Longest context `plan --max-seq` models (16M tokens: beyond any published model's).
const MAX_PLAN_CONTEXT: usize = 1 << 24;
/// Largest batch `plan --batches` models.
const MAX_PLAN_BATCH: usize = 1 << 20;

/// Refuses a pipeline strategy given with more micro-batches than the largest batch: no row
/// would run that many (each micro-batch needs a sequence).
fn check_micro_batches(strategies: &[PlanStrategy], batches: &[usize]) -> Result<()> {
    let largest = batches.iter().copied().max().unwrap_or(0);
    for s in strategies {
        let m = match s.strategy {
            Strategy::Pipeline { micro_batches, .. } | Strategy::Hybrid { micro_batches, .. } => {
                micro_batches
            }
            _ => continue,
        };
        if m > largest {
            return Err(WgparError::unsupported(format!(
                "--strategies {}: {m} micro-batches, but the largest of --batches is {largest}: \
                 each micro-batch needs a sequence, so at most {largest} would run; give -m{largest} \
                 or less, or larger --batches",
                s.label
            )));
        }
    }
    Ok(())
}

/// Everything `plan` needs, checked before anything is modeled.
impl PlanRequest<'_> {
    /// The options checked and resolved: the model (its context bounded), the weight format,
    /// the strategies (checked against the batches), the profiles and the engines.
    pub fn options(&self) -> Result<PlanOptions> {
        let mut config = plan_model(self.model)?;
        if let Some(m) = self.max_seq {
            if m == 0 || m > MAX_PLAN_CONTEXT {
                return Err(WgparError::option(
                    "--max-seq",
                    format!("--max-seq {m}: model a context of 1 to {MAX_PLAN_CONTEXT} tokens"),
                ));
            }
            config.max_seq = m;
            // The tables sized by the context stay within the model's size bounds.
            config.validate()?;
        }
        if let Some(&b) = self.batches.iter().find(|&&b| b > MAX_PLAN_BATCH) {
            return Err(WgparError::option(
                "--batches",
                format!("--batches {b}: model batches of at most {MAX_PLAN_BATCH} sequences"),
            ));
        }
        let weights: NumFormat = self
            .weights
            .parse()
            .map_err(|e| WgparError::option("--weights", format!("--weights: {e}")))?;
        if self.devices == 0 {
            return Err(WgparError::option(
                "--devices",
                "--devices 0: a configuration needs at least one device".into(),
            ));
        }
        let strategies = if self.strategies.is_empty() {
            default_strategies(&config, self.devices)
        } else {
            let given = self
                .strategies
                .iter()
                .map(|s| PlanStrategy::parse(s))
                .collect::<Result<Vec<_>>>()?;
            check_micro_batches(&given, self.batches)?;
            given
        };
        let profiles = self
            .hosts
            .iter()
            .map(|h| HostProfile::resolve(h).map_err(WgparError::from))
            .collect::<Result<Vec<_>>>()?;
        let engines = self
            .engines
            .iter()
            .map(|e| Engine::resolve(e).map_err(WgparError::from))
            .collect::<Result<Vec<_>>>()?;
        // The wgpar engine is projected only with weights its runtime can hold (`--dtype`,
        // `--weights`); other engines take any format.
        let loadable = matches!(
            weights,
            NumFormat::F32 | NumFormat::F16 | NumFormat::Q8_0 | NumFormat::Q4_0 | NumFormat::Q4K
        );
        if !loadable && engines.iter().any(|e| e.name == "wgpar") {
            return Err(WgparError::unsupported(format!(
            "--weights {}: the wgpar runtime holds f32, f16, q8_0, q4_0, q4_k and q6_k weights, \
             so the wgpar engine is not projected with this format; pick one of those, or \
             --engines without wgpar (e.g. cuda-nccl)",
            self.weights
        )));
        }
        let file_format = gguf_format(self.model, &config, weights)?;
        Ok(PlanOptions {
            config,
            weights,
            file_format,
            strategies,
            batches: self.batches.to_vec(),
            seqs: self.seqs.to_vec(),
            profiles,
            engines,
            decode_steps: self.decode_steps,
        })
    }
}

/// A GGUF model's storage in the wgpar runtime: its layers in the file's own block types (or
/// re-packed when `--weights` names a block type, as `run --weights` does), its tables dense
/// (f32 under `--weights f32`, else f16). `None` for other models.
fn gguf_format(
    model: &str,
    config: &ModelConfig,
    weights: NumFormat,
) -> Result<Option<WeightFormat>> {
    let path = Path::new(model);
    if !crate::model::gguf::is_gguf(path) {
        return Ok(None);
    }
    let gguf = crate::model::gguf::Gguf::open(path)?;
    let (dense, packed) = match weights {
        NumFormat::F32 => (DType::F32, None),
        NumFormat::Q8_0 => (DType::F16, Some(QuantType::Q8_0)),
        NumFormat::Q4_0 => (DType::F16, Some(QuantType::Q4_0)),
        NumFormat::Q4K => (DType::F16, Some(QuantType::Q4K)),
        _ => (DType::F16, None),
    };
    Ok(Some(WeightFormat {
        dense,
        packed,
        blocks: FileBlocks::of_gguf(gguf.file(), config),
        vectors: Vectors::of_gguf(gguf.file()),
    }))
}
