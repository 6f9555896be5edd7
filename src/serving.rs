//! The engine a serving run steps (`wgpar serve`, `wgpar bench serve`): the strategy for its
//! KV slots, the devices, the memory and the injected fault checked before any device opens
//! ([`ServingChoice::plan`]), then the devices opened, the model placed and the engine built
//! ([`ServingPlan::build`]), for the server on its own thread ([`ServingPlan::server_engine`]).

use std::sync::Arc;

use crate::comm::CommConfig;
use crate::device::{Adapters, DType, DeviceChoice, Gpu};
use crate::error::Result;
use crate::load::ModelChoice;
use crate::memory_check::PlannedRun;
use crate::model::memory::Workload;
use crate::model::ModelConfig;
use crate::parallel::arming::FaultSpec;
use crate::parallel::auto::{AutoPlacement, Setting};
use crate::parallel::choice::StrategyChoice;
use crate::parallel::run_plan::check_planned_runs;
use crate::parallel::{build_step_engine, StepEngine, Strategy};
use crate::server::BatchOptions;
use crate::sim::{pacer_for, LinkPacer};

/// The choices of a serving run, as a command gives them.
#[derive(Debug, Clone)]
pub struct ServingChoice<'a> {
    /// The devices.
    pub devices: DeviceChoice,
    /// The model.
    pub model: ModelChoice<'a>,
    /// The strategy.
    pub strategy: StrategyChoice,
    /// `--gpu-memory`: one cap per device, or one for all.
    pub gpu_memory: Option<&'a str>,
    /// KV slots (`--max-batch`).
    pub max_batch: usize,
    /// The most tokens one step carries.
    pub step_tokens: usize,
    /// The work the memory accounting sizes.
    pub work: Workload,
    /// The shape the engine is built and a measured placement probed with.
    pub probe: Workload,
    /// `--pace`: a host profile, or ALPHA_US:BETA_GBPS.
    pub pace: Option<&'a str>,
    /// A stage's or a rank's fault (`--inject-fault`), injected after the server's warm-up.
    pub fault: Option<&'a str>,
}

/// What a serving run checked before any device opens: enough to build its engine, on
/// another thread too.
pub struct ServingPlan {
    /// The adapters found.
    pub adapters: Adapters,
    /// The devices to open.
    pub devices: DeviceChoice,
    /// The model.
    pub config: ModelConfig,
    /// The weights' dtype.
    pub dtype: DType,
    /// The strategy, its `auto` placement resolved as far as the accounting goes.
    pub strategy: Strategy,
    auto: AutoPlacement,
    probe: Workload,
    pacer: Option<(LinkPacer, String)>,
    fault: Option<FaultSpec>,
}

/// A serving engine, built.
pub struct ServingEngine {
    /// The engine.
    pub engine: Box<dyn StepEngine>,
    /// Its devices.
    pub gpus: Vec<Arc<Gpu>>,
    /// The weights' dtype.
    pub dtype: DType,
    /// The strategy, placed.
    pub strategy: Strategy,
    /// What the transfers are paced to, when `--pace` asks.
    pub paced: Option<String>,
}

impl ServingChoice<'_> {
    /// Checks, before any device opens, the strategy against the devices and the slots, the
    /// fault against the strategy, and that the model and the largest step fit the devices
    /// and their `--gpu-memory` caps.
    pub fn plan(&self, config: ModelConfig) -> Result<ServingPlan> {
        let pacer = self.pace.map(pacer_for).transpose()?;
        let adapters = Adapters::discover()?;
        let selected = self.devices.selected(&adapters)?;
        let dtype = self.model.dtype_for(&selected, self.devices.force_f32)?;
        let strategy = self.strategy.serving(selected.len(), self.max_batch)?;
        let fault = match self.fault {
            Some(text) => {
                let spec = FaultSpec::parse(text)?;
                spec.check(&strategy, selected.len())?;
                Some(spec)
            }
            None => None,
        };
        let auto = self.strategy.auto_placement(self.gpu_memory);
        let setting = Setting {
            config: &config,
            dtype,
            model: self.model,
            kv: self.devices.kv_dtypes(&selected),
            selected: &selected,
            work: self.work,
        };
        let strategy = auto.before_open(strategy, &setting)?;
        let runs = [PlannedRun {
            strategy: &strategy,
            adapters: &selected,
            step_tokens: self.step_tokens,
            batch: self.max_batch,
            work: self.work,
        }];
        let fit = (&config, dtype);
        check_planned_runs(self.model, fit, &setting.kv, self.gpu_memory, &runs)?;
        Ok(ServingPlan {
            adapters,
            devices: self.devices.clone(),
            config,
            dtype,
            strategy,
            auto,
            probe: self.probe,
            pacer,
            fault,
        })
    }
}

impl ServingPlan {
    /// Opens the devices, places the model (measured where `auto` asks), builds the engine
    /// from `model`'s weights (dropped once the devices hold them) and paces it.
    pub fn build(self, model: ModelChoice<'_>) -> Result<(ServingEngine, Option<FaultSpec>)> {
        let (config, dtype) = (&self.config, self.dtype);
        let gpus = self.devices.open(&self.adapters)?;
        let weights = model.weights(config)?;
        let placed = (self.auto).once_open(&self.strategy, &gpus, (&weights, dtype), self.probe)?;
        let comm = CommConfig::default();
        let shape = (self.probe.batch, self.probe.prompt);
        let mut engine = build_step_engine(&placed, &gpus, &weights, dtype, &comm, shape)?;
        drop(weights);
        let paced = self.pacer.map(|(pacer, what)| {
            engine.set_pacer(Some(Arc::new(pacer)));
            what
        });
        let built = ServingEngine {
            engine,
            gpus,
            dtype,
            strategy: placed,
            paced,
        };
        Ok((built, self.fault))
    }

    /// The server's engine: [`Self::build`], warmed up for `batch` (every kernel compiled,
    /// the KV slots reserved), then the fault injected.
    pub fn server_engine(
        self,
        model: ModelChoice<'_>,
        batch: BatchOptions,
    ) -> Result<Box<dyn StepEngine>> {
        let (built, fault) = self.build(model)?;
        let mut engine = built.engine;
        crate::server::setup::warm_up(engine.as_mut(), batch)?;
        if let Some(f) = fault {
            engine.inject_fault(f.worker, f.fault)?;
        }
        Ok(engine)
    }
}
