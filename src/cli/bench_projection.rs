//! `wgpar bench projection`: how well does a projection onto this machine's calibrated
//! profile predict what the machine measures?
//!
//! Each round calibrates the machine once, at one shape (`--model`, `--batch`, `--prompt-len`),
//! then records one traced run per workload and configuration; every run is then projected onto
//! every round's profile. Workloads (`--runs`) default to the calibration shape (in sample);
//! other batch sizes, prompt lengths and models test the projection out of sample: the profile
//! has never seen them. Runs and calibrations are separate processes
//! of this executable (`wgpar calibrate`, `wgpar run --trace`), exactly the commands a user
//! would type, so nothing of one run (threads, caches, devices) carries into the next. On a
//! noisy machine single pairs scatter by tens of percent; the medians over all pairs are the
//! figure, with the range beside them.

use std::path::PathBuf;

use clap::Args;
use wgpar::sim::projection_run::ProjectionBenchOptions;
use wgpar::{Result, WgparError};

/// Options of `wgpar bench projection`.
#[derive(Args, Debug, Clone)]
pub struct ProjectionBenchArgs {
    /// Model preset or folder (passed to `calibrate` and `run`).
    #[arg(long, default_value = "default", value_name = "PRESET|DIR")]
    model: String,
    /// Configurations: `single`, `tpN` (tensor parallel over N devices), `ppN-mM` (N
    /// pipeline stages, M micro-batches).
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "single,tp2,tp4,pp2-m1,pp2-m8,pp4-m1,pp4-m8"
    )]
    configs: Vec<String>,
    /// Workloads to record and project, `MODEL:BATCHxPROMPT` each (e.g. `tiny-gpt2:4x32`);
    /// default: the calibration shape only. Configurations a model cannot run (a TP degree its
    /// heads do not divide, more stages than layers, more micro-batches than sequences) are
    /// skipped and listed.
    #[arg(long, value_delimiter = ',', value_name = "MODEL:BxP")]
    runs: Vec<String>,
    /// Rounds: each calibrates, then records every configuration once.
    #[arg(long, default_value_t = 3)]
    rounds: usize,
    /// Sequences per batch of the calibration (and of the default workload).
    #[arg(long, default_value_t = 8)]
    batch: usize,
    /// Prompt length of the calibration (and of the default workload).
    #[arg(long, default_value_t = 32)]
    prompt_len: usize,
    /// Tokens generated per sequence.
    #[arg(long, default_value_t = 8)]
    gen: usize,
    /// Largest copy of the calibration's link sweep (the runs move at most a few hundred KB).
    #[arg(long, default_value = "1M")]
    max_bytes: String,
    /// Calibrate with `--quick` (seconds instead of a minute; rougher).
    #[arg(long)]
    quick: bool,
    /// Keep each span's measured host gap in the projection (`project --keep-host-gaps`).
    #[arg(long)]
    keep_host_gaps: bool,
    /// Folder for the profiles and traces (kept, for `wgpar project` and Perfetto).
    #[arg(long, default_value = "wgpar-projection-bench")]
    out_dir: PathBuf,
    /// Agreement asked of the median error, percent.
    #[arg(long, default_value_t = 15.0)]
    tolerance: f64,
    /// Print JSON instead of a table.
    #[arg(long)]
    json: bool,
    /// Run every configuration as this many MPI ranks (`LAUNCHER -np N wgpar run ...`, each
    /// rank writing its trace), calibrate under the same launcher (`wgpar calibrate` under
    /// mpirun), and project the merged rank traces: what `project` makes of a multi-process
    /// run on this machine. 1: one process, no MPI. Needs a build with `--features mpi`.
    #[arg(long, default_value_t = 1)]
    ranks: usize,
    /// With --ranks: the MPI launcher and its options, split at spaces, placed before `-np N`
    /// [default: mpirun], e.g. `mpirun --oversubscribe` (as root Open MPI also wants
    /// `--allow-run-as-root`, or OMPI_ALLOW_RUN_AS_ROOT=1 and OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1).
    #[arg(long, value_name = "COMMAND")]
    launcher: Option<String>,
}

impl ProjectionBenchArgs {
    /// The benchmark's options, as the library takes them.
    fn options(&self) -> ProjectionBenchOptions {
        ProjectionBenchOptions {
            model: self.model.clone(),
            configs: self.configs.clone(),
            runs: self.runs.clone(),
            rounds: self.rounds,
            batch: self.batch,
            prompt_len: self.prompt_len,
            gen: self.gen,
            max_bytes: self.max_bytes.clone(),
            quick: self.quick,
            keep_host_gaps: self.keep_host_gaps,
            out_dir: self.out_dir.clone(),
            tolerance: self.tolerance,
            ranks: self.ranks,
            launcher: self.launcher.clone(),
        }
    }
}

/// Runs the benchmark with this executable and prints its report.
pub fn run(args: &ProjectionBenchArgs) -> Result<()> {
    let options = args.options();
    let plan = options.plan()?;
    let exe = std::env::current_exe().map_err(|e| WgparError::Subprocess {
        command: "wgpar".into(),
        detail: format!("cannot find this executable: {e}"),
    })?;
    let report = options.run(&plan, &exe)?;
    if args.json {
        let text = serde_json::to_string_pretty(&report).map_err(|source| WgparError::Json {
            what: "the benchmark report".into(),
            source,
        })?;
        return outln!("{text}");
    }
    out!("{}", options.render(&plan.launch, &report))
}
