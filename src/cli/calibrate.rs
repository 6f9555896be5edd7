//! `wgpar calibrate`: measure this machine and write a host profile of it. The measurements
//! are `wgpar::calibrate`; this command opens the devices, makes the model and writes the file.

use clap::Args;
use wgpar::calibrate::{calibrate, Calibration, CalibrationOptions};
use wgpar::comm::units::parse_size;
use wgpar::device::{AdapterDesc, DType};
use wgpar::memory_check::{check_runs_fit, PlannedRun};
use wgpar::model::{ModelConfig, ModelWeights};
use wgpar::parallel::Strategy;
use wgpar::sim::write_calibrated_profile;
use wgpar::{Result, WgparError};

use super::options::{DeviceArgs, ModelArgs};

/// Options of `wgpar calibrate`.
#[derive(Args, Clone, Debug)]
pub struct CalibrateArgs {
    #[command(flatten)]
    devices: DeviceArgs,
    /// Model whose block shapes the kernel rates are measured at.
    #[command(flatten)]
    model: ModelArgs,
    /// Largest batch of the runs to project (steps of 1, 2, 4, ... sequences are measured).
    #[arg(long, default_value_t = 8)]
    batch: usize,
    /// Prompt length of the runs to project (prefill steps; decode steps attend to it).
    #[arg(long, default_value_t = 32)]
    prompt_len: usize,
    /// Profile file to write.
    #[arg(long, default_value = "hosts/this-machine.toml")]
    out: String,
    /// Profile name.
    #[arg(long, default_value = "this-machine")]
    name: String,
    /// Largest copy in the link sweep (sizes grow by 4 from 256 bytes) [default: 16M, or 256K
    /// with --quick].
    #[arg(long)]
    max_bytes: Option<String>,
    /// Timed repetitions per point (the median is used) [default: 5, or 3 with --quick].
    #[arg(long)]
    iters: Option<usize>,
    /// A fast, rough calibration: copies up to 256K, 3 repetitions (unless --max-bytes or
    /// --iters say otherwise), two batch sizes.
    #[arg(long)]
    quick: bool,
}

/// Runs the calibration and writes the profile.
pub fn run(args: &CalibrateArgs) -> Result<()> {
    let config = args.model.choice().config()?;
    let options = args.options()?;
    let adapters = wgpar::device::Adapters::discover()?;
    let devices = args.devices.choice();
    args.check_fits(&config, &devices.selected(&adapters)?)?;
    // The profile goes there: fail now, not after the measurements.
    super::options::check_writable_file(std::path::Path::new(&args.out))?;
    let gpus = devices.open(&adapters)?;
    let weights = ModelWeights::synthetic(&config, args.model.choice().seed);
    let calibration = calibrate(&gpus, &weights, &options, &mut std::io::stdout())?;
    args.write(&calibration)
}

impl CalibrateArgs {
    /// What to calibrate for, from the options (also the MPI path's).
    pub(crate) fn options(&self) -> Result<CalibrationOptions> {
        // --quick sets the defaults; what is given explicitly wins.
        let max_bytes = match (&self.max_bytes, self.quick) {
            (None, true) => 256 << 10,
            (text, _) => parse_size(text.as_deref().unwrap_or("16M"))
                .map_err(|e| WgparError::option("--max-bytes", format!("--max-bytes: {e}")))?,
        };
        Ok(CalibrationOptions {
            batch: self.batch,
            prompt_len: self.prompt_len,
            max_bytes,
            iters: self.iters.unwrap_or(if self.quick { 3 } else { 5 }),
            quick: self.quick,
            name: self.name.clone(),
        })
    }

    /// Checks, before a device opens or a weight is built, that the whole model (the
    /// calibration runs it in f32 on every device) fits each of `adapters` at the largest
    /// step it measures, and fits the host's memory.
    pub(crate) fn check_fits(&self, config: &ModelConfig, adapters: &[AdapterDesc]) -> Result<()> {
        let runs: Vec<PlannedRun> = adapters
            .iter()
            .map(|adapter| PlannedRun {
                strategy: &Strategy::Single,
                adapters: std::slice::from_ref(adapter),
                step_tokens: self.batch * self.prompt_len,
                batch: self.batch,
                work: wgpar::model::memory::Workload {
                    batch: self.batch,
                    prompt: self.prompt_len,
                },
            })
            .collect();
        check_runs_fit(config, DType::F32, &runs)
    }

    /// Writes the calibrated profile to `--out` (creating its folder) and says so.
    pub(crate) fn write(&self, calibration: &Calibration) -> Result<()> {
        let (profile, note) = (&calibration.profile, &calibration.note);
        if let Some(dir) = std::path::Path::new(&self.out).parent() {
            if !dir.as_os_str().is_empty() {
                std::fs::create_dir_all(dir).map_err(|source| WgparError::Io {
                    path: dir.display().to_string(),
                    source,
                })?;
            }
        }
        write_calibrated_profile(profile, note, &self.out)?;
        outln!()?;
        outln!("profile `{}` written to {}", profile.name, self.out)?;
        Ok(())
    }

    /// The devices to open (under mpirun: per rank).
    #[cfg_attr(not(feature = "mpi"), allow(dead_code))]
    pub(crate) fn devices(&self) -> &DeviceArgs {
        &self.devices
    }

    /// The model whose shapes are measured.
    #[cfg_attr(not(feature = "mpi"), allow(dead_code))]
    pub(crate) fn model(&self) -> &ModelArgs {
        &self.model
    }
}
