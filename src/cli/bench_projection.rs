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

use std::path::{Path, PathBuf};
use std::process::Command;

use clap::Args;
use wgpar::sim::projection_bench::{
    parse_config, parse_workload, row_of, summarise_out_of_sample, unrunnable, Config,
    ConfigSummary, Pair, Report, Row, Workload,
};
use wgpar::sim::{project, HostGaps, HostProfile, ProjectOptions};
use wgpar::trace::{rank_trace_path, Timeline};
use wgpar::{Result, WgparError};

use super::options::merge_rank_traces;

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

/// How the benchmark's runs are started: this executable as one process, or under an MPI
/// launcher as `ranks` processes.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Launch {
    Process,
    Ranks { ranks: usize, launcher: Vec<String> },
}

impl Launch {
    fn from_args(ranks: usize, launcher: Option<&str>) -> Result<Self> {
        match (ranks, launcher) {
            (0, _) => Err(WgparError::option(
                "--ranks",
                "--ranks must be at least 1".into(),
            )),
            (1, None) => Ok(Launch::Process),
            (1, Some(_)) => Err(WgparError::unsupported(
                "--launcher applies only with --ranks 2 or more".into(),
            )),
            (n, l) => {
                if !cfg!(feature = "mpi") {
                    return Err(WgparError::unsupported(format!(
                        "--ranks {n} runs wgpar under MPI: this build has no MPI (build with `--features mpi`)"
                    )));
                }
                let launcher: Vec<String> = l
                    .unwrap_or("mpirun")
                    .split_whitespace()
                    .map(str::to_string)
                    .collect();
                if launcher.is_empty() {
                    return Err(WgparError::option(
                        "--launcher",
                        "--launcher is empty".into(),
                    ));
                }
                Ok(Launch::Ranks { ranks: n, launcher })
            }
        }
    }

    fn ranks(&self) -> usize {
        match self {
            Launch::Process => 1,
            Launch::Ranks { ranks, .. } => *ranks,
        }
    }

    /// The trace files a run asked for `path` writes: itself, or one per rank.
    fn trace_files(&self, path: &Path) -> Vec<PathBuf> {
        match self {
            Launch::Process => vec![path.to_path_buf()],
            Launch::Ranks { ranks, .. } => (0..*ranks)
                .map(|r| PathBuf::from(rank_trace_path(&path.display().to_string(), r)))
                .collect(),
        }
    }
}

/// Runs this executable with `args`, as one process or as MPI ranks; its output goes to
/// `log`.
fn wgpar(launch: &Launch, args: &[String], log: &Path) -> Result<()> {
    let exe = std::env::current_exe().map_err(|e| WgparError::Subprocess {
        command: "wgpar".into(),
        detail: format!("cannot find this executable: {e}"),
    })?;
    let mut command = match launch {
        Launch::Process => Command::new(&exe),
        Launch::Ranks { ranks, launcher } => {
            let mut c = Command::new(&launcher[0]);
            c.args(&launcher[1..])
                .args(["-np", &ranks.to_string()])
                .arg(&exe);
            c
        }
    };
    let shown = format!("{command:?} {}", args.join(" "));
    let out = command
        .args(args)
        .output()
        .map_err(|e| WgparError::Subprocess {
            command: shown.clone(),
            detail: format!("cannot start: {e}"),
        })?;
    let mut text = out.stdout;
    text.extend_from_slice(&out.stderr);
    std::fs::write(log, &text).map_err(|source| WgparError::Io {
        path: log.display().to_string(),
        source,
    })?;
    if !out.status.success() {
        let tail: String = String::from_utf8_lossy(&text)
            .lines()
            .rev()
            .take(5)
            .collect::<Vec<_>>()
            .into_iter()
            .rev()
            .collect::<Vec<_>>()
            .join("\n");
        return Err(WgparError::Subprocess {
            command: shown,
            detail: format!("{} (log: {}):\n{tail}", out.status, log.display()),
        });
    }
    Ok(())
}

/// What the benchmark runs: how it launches, every (workload, configuration) pair the models
/// can run and the ones skipped, the calibration's workload, and the devices a calibration
/// opens.
struct Plan {
    launch: Launch,
    cases: Vec<(Workload, Config)>,
    skipped: Vec<String>,
    calibration: Workload,
    devices: usize,
}

/// Runs the benchmark.
pub fn run(args: &ProjectionBenchArgs) -> Result<()> {
    let plan = plan(args)?;
    let dir = &args.out_dir;
    std::fs::create_dir_all(dir).map_err(|source| WgparError::Io {
        path: dir.display().to_string(),
        source,
    })?;
    for round in 0..args.rounds {
        record_round(args, &plan, round)?;
    }
    let rows = project_cases(args, &plan)?;
    let report = Report {
        calibration_model: &args.model,
        calibration_batch: args.batch,
        calibration_prompt_len: args.prompt_len,
        skipped: plan.skipped,
        gen: args.gen,
        rounds: args.rounds,
        ranks: plan.launch.ranks(),
        host_gaps_kept: args.keep_host_gaps,
        tolerance_pct: args.tolerance,
        within: rows.iter().filter(|r| r.within_tolerance).count(),
        out_of_sample: summarise_out_of_sample(&rows, args.tolerance),
        rows,
    };
    if args.json {
        let text = serde_json::to_string_pretty(&report).map_err(|source| WgparError::Json {
            what: "the benchmark report".into(),
            source,
        })?;
        outln!("{text}")?;
        return Ok(());
    }
    print_report(args, &plan.launch, &report)
}

/// Checks the options and lists the cases.
fn plan(args: &ProjectionBenchArgs) -> Result<Plan> {
    if args.rounds == 0 || args.batch == 0 || args.prompt_len == 0 || args.gen == 0 {
        return Err(WgparError::option(
            "--rounds",
            "--rounds, --batch, --prompt-len and --gen must be positive".into(),
        ));
    }
    if !(args.tolerance.is_finite() && args.tolerance > 0.0) {
        return Err(WgparError::option(
            "--tolerance",
            format!(
                "--tolerance must be a positive number of percent, got {}",
                args.tolerance
            ),
        ));
    }
    let launch = Launch::from_args(args.ranks, args.launcher.as_deref())?;
    let configs = (args.configs.iter())
        .map(|c| parse_config(c, launch.ranks()))
        .collect::<Result<Vec<_>>>()?;
    if configs.is_empty() {
        return Err(WgparError::option("--configs", "--configs is empty".into()));
    }
    let calibration = Workload {
        model: args.model.clone(),
        batch: args.batch,
        prompt_len: args.prompt_len,
    };
    let workloads = if args.runs.is_empty() {
        vec![calibration.clone()]
    } else {
        (args.runs.iter())
            .map(|r| parse_workload(r))
            .collect::<Result<Vec<_>>>()?
    };
    // Every (workload, configuration) the models can run; the others are listed.
    let mut cases: Vec<(Workload, Config)> = Vec::new();
    let mut skipped = Vec::new();
    for w in &workloads {
        for c in &configs {
            match unrunnable(c, w) {
                Some(why) => skipped.push(format!("{}: {why}", w.name())),
                None => cases.push((w.clone(), c.clone())),
            }
        }
    }
    if cases.is_empty() {
        return Err(WgparError::unsupported(format!(
            "no configuration can run any workload: {}",
            skipped.join("; ")
        )));
    }
    // Devices each calibrating process opens: one process measures two or more (their
    // sharing of the processor); under MPI each rank opens what its runs open, and the
    // sharing between ranks is measured across processes.
    let per_rank = (configs.iter().map(|c| c.devices_per_rank))
        .max()
        .unwrap_or(1);
    let devices = match launch {
        Launch::Process => per_rank.max(2),
        Launch::Ranks { .. } => per_rank,
    };
    Ok(Plan {
        launch,
        cases,
        skipped,
        calibration,
        devices,
    })
}

/// The trace a case's run writes in `round`.
fn trace_of(args: &ProjectionBenchArgs, (w, c): (&Workload, &Config), round: usize) -> PathBuf {
    (args.out_dir).join(format!("{}.{}.r{round}.json", w.file_stem(), c.name))
}

/// One round: a calibration, then one traced run of every case.
fn record_round(args: &ProjectionBenchArgs, plan: &Plan, round: usize) -> Result<()> {
    let path = |name: String| args.out_dir.join(name);
    let mut cal: Vec<String> = vec![
        "calibrate".into(),
        "--model".into(),
        args.model.clone(),
        "--virtual".into(),
        plan.devices.to_string(),
        "--max-bytes".into(),
        args.max_bytes.clone(),
        "--out".into(),
        path(format!("cal{round}.toml")).display().to_string(),
        "--batch".into(),
        args.batch.to_string(),
        "--prompt-len".into(),
        args.prompt_len.to_string(),
    ];
    if args.quick {
        cal.push("--quick".into());
    }
    eprintln!("round {}/{}: calibrating", round + 1, args.rounds);
    wgpar(&plan.launch, &cal, &path(format!("cal{round}.log")))?;
    for (w, c) in &plan.cases {
        eprintln!(
            "round {}/{}: {} {}",
            round + 1,
            args.rounds,
            w.name(),
            c.name
        );
        let mut run: Vec<String> = vec!["run".into(), "--model".into(), w.model.clone()];
        run.extend(c.args.iter().cloned());
        run.extend([
            "--batch".into(),
            w.batch.to_string(),
            "--prompt-len".into(),
            w.prompt_len.to_string(),
            "--gen".into(),
            args.gen.to_string(),
            "--trace".into(),
            trace_of(args, (w, c), round).display().to_string(),
        ]);
        let log = path(format!("{}.{}.r{round}.log", w.file_stem(), c.name));
        wgpar(&plan.launch, &run, &log)?;
    }
    Ok(())
}

/// Every case's runs projected onto every round's profile, one row per case.
fn project_cases(args: &ProjectionBenchArgs, plan: &Plan) -> Result<Vec<Row>> {
    let profiles = (0..args.rounds)
        .map(|r| {
            let p = args.out_dir.join(format!("cal{r}.toml"));
            HostProfile::load(&p).map_err(WgparError::from)
        })
        .collect::<Result<Vec<_>>>()?;
    let options = ProjectOptions {
        host_gaps: if args.keep_host_gaps {
            HostGaps::Keep
        } else {
            HostGaps::Drop
        },
        ..Default::default()
    };
    let mut rows = Vec::new();
    for (w, c) in &plan.cases {
        let mut pairs = Vec::new();
        for run_round in 0..args.rounds {
            let trace = trace_of(args, (w, c), run_round);
            let traces = (plan.launch.trace_files(&trace).iter())
                .map(Timeline::read_chrome_trace)
                .collect::<std::result::Result<Vec<_>, _>>()?;
            for (calibration_round, profile) in profiles.iter().enumerate() {
                let timeline = match plan.launch {
                    Launch::Process => traces[0].clone(),
                    Launch::Ranks { .. } => merge_rank_traces(&traces, profile)?,
                };
                let p = project(&timeline, profile, &options).map_err(|source| {
                    WgparError::Projection {
                        what: trace.display().to_string(),
                        profile: profile.name.clone(),
                        source,
                    }
                })?;
                let measured_ms = p.report.measured.makespan_us / 1e3;
                let projected_ms = p.report.projected.makespan_us / 1e3;
                pairs.push(Pair {
                    run_round,
                    calibration_round,
                    measured_ms,
                    projected_ms,
                    error_pct: (projected_ms - measured_ms) / measured_ms * 100.0,
                });
            }
        }
        rows.push(row_of(
            (w, c),
            *w == plan.calibration,
            pairs,
            args.tolerance,
        ));
    }
    Ok(rows)
}

/// The report as Markdown tables.
fn print_report(args: &ProjectionBenchArgs, launch: &Launch, report: &Report<'_>) -> Result<()> {
    let n = args.rounds;
    let processes = match launch {
        Launch::Process => String::new(),
        Launch::Ranks { ranks, launcher } => format!(
            "; every run and calibration as {ranks} MPI ranks ({} -np {ranks})",
            launcher.join(" ")
        ),
    };
    outln!(
        "projection onto this machine's calibrated profile (calibrated on {}, batch {}, prompt {}); {} generated per run; {n} rounds, every run onto every calibration ({} pairs per row){processes}",
        args.model,
        args.batch,
        args.prompt_len,
        args.gen,
        n * n
    )?;
    outln!()?;
    outln!(
        "| workload | config | sample | measured ms, median of {n} (range) | projected ms, median of {} | error, median [range] |",
        n * n
    )?;
    outln!("|---|---|---|---:|---:|---:|")?;
    for r in &report.rows {
        outln!(
            "| {} | {} | {} | {:.0} ({:.0}-{:.0}) | {:.0} | {:+.1} % [{:+.0}, {:+.0}] |",
            r.workload.name(),
            r.config.name,
            if r.in_sample { "in" } else { "out" },
            r.measured_ms_median,
            r.measured_ms_range[0],
            r.measured_ms_range[1],
            r.projected_ms_median,
            r.error_pct_median,
            r.error_pct_range[0],
            r.error_pct_range[1]
        )?;
    }
    outln!()?;
    for s in &report.skipped {
        outln!("skipped {s}")?;
    }
    outln!(
        "{} of {} rows within {} % (median error); profiles and traces in {}",
        report.within,
        report.rows.len(),
        args.tolerance,
        args.out_dir.display()
    )?;
    print_out_of_sample(args.tolerance, &report.out_of_sample)
}

/// The out-of-sample summary table, when there are out-of-sample workloads.
fn print_out_of_sample(tolerance: f64, summaries: &[ConfigSummary]) -> Result<()> {
    if summaries.is_empty() {
        return Ok(());
    }
    outln!()?;
    outln!("out of sample, per configuration (every pair of every workload the calibration did not see):")?;
    outln!()?;
    outln!(
        "| config | workloads | pairs | error, median | magnitude, median | within {tolerance} % |"
    )?;
    outln!("|---|---:|---:|---:|---:|---|")?;
    for c in summaries {
        outln!(
            "| {} | {} | {} | {:+.1} % | {:.1} % | {} |",
            c.config,
            c.workloads,
            c.pairs,
            c.error_pct_median,
            c.abs_error_pct_median,
            if c.within_tolerance { "yes" } else { "no" }
        )?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn launches_are_one_process_or_ranks_with_a_launcher() {
        assert_eq!(Launch::from_args(1, None).unwrap(), Launch::Process);
        let e = Launch::from_args(1, Some("mpirun"))
            .unwrap_err()
            .to_string();
        assert!(e.contains("--launcher applies only with --ranks"), "{e}");
        assert!(Launch::from_args(0, None).is_err());
        let launch = Launch::from_args(2, Some("mpirun  --oversubscribe"));
        if cfg!(feature = "mpi") {
            let launch = launch.unwrap();
            assert_eq!(
                launch,
                Launch::Ranks {
                    ranks: 2,
                    launcher: vec!["mpirun".into(), "--oversubscribe".into()]
                }
            );
            assert_eq!(
                launch.trace_files(Path::new("d/run.json")),
                [
                    PathBuf::from("d/run.rank0.json"),
                    PathBuf::from("d/run.rank1.json")
                ]
            );
        } else {
            let e = launch.unwrap_err().to_string();
            assert!(e.contains("--features mpi"), "{e}");
        }
    }
}
