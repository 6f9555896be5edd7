//! Running the projection benchmark (`wgpar bench projection`): each round calibrates this
//! machine once, then records one traced run per case; every run is then projected onto every
//! round's profile. Runs and calibrations are separate processes of the wgpar executable
//! (`wgpar calibrate`, `wgpar run --trace`), exactly the commands a user would type, so
//! nothing of one run (threads, caches, devices) carries into the next. The cases and the
//! figures are [`super::projection_bench`]'s; this module launches, projects and renders.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::Command;

use super::projection_bench::{
    parse_config, parse_workload, row_of, summarise_out_of_sample, unrunnable, Config,
    ConfigSummary, Pair, Report, Row, Workload,
};
use super::{merge_rank_traces, project, HostGaps, HostProfile, ProjectOptions};
use crate::error::{Result, WgparError};
use crate::trace::{rank_trace_path, Timeline};

/// What the benchmark measures, as the command line gives it.
#[derive(Debug, Clone)]
pub struct ProjectionBenchOptions {
    /// Model preset or folder of the calibration (and of the default workload).
    pub model: String,
    /// Configurations: `single`, `tpN`, `ppN-mM`.
    pub configs: Vec<String>,
    /// Workloads, `MODEL:BATCHxPROMPT` each; empty: the calibration shape only.
    pub runs: Vec<String>,
    /// Rounds: each calibrates, then records every case once.
    pub rounds: usize,
    /// Sequences per batch of the calibration.
    pub batch: usize,
    /// Prompt length of the calibration.
    pub prompt_len: usize,
    /// Tokens generated per sequence.
    pub gen: usize,
    /// Largest copy of the calibration's link sweep, e.g. `1M`.
    pub max_bytes: String,
    /// Calibrate with `--quick`.
    pub quick: bool,
    /// Keep each span's measured host gap in the projection.
    pub keep_host_gaps: bool,
    /// Folder for the profiles, traces and logs.
    pub out_dir: PathBuf,
    /// Agreement asked of the median error, percent.
    pub tolerance: f64,
    /// Processes per run (MPI ranks); 1: one process.
    pub ranks: usize,
    /// With ranks: the MPI launcher and its options, split at spaces (default `mpirun`).
    pub launcher: Option<String>,
}

/// How the benchmark's runs are started: the executable as one process, or under an MPI
/// launcher as `ranks` processes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Launch {
    /// One process.
    Process,
    /// `LAUNCHER -np RANKS wgpar ...`.
    Ranks {
        /// Processes.
        ranks: usize,
        /// The launcher and its options.
        launcher: Vec<String>,
    },
}

impl Launch {
    /// The launch `--ranks` and `--launcher` ask for, refused where they do not fit.
    pub fn from_args(ranks: usize, launcher: Option<&str>) -> Result<Self> {
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

    /// Processes per run.
    pub fn ranks(&self) -> usize {
        match self {
            Launch::Process => 1,
            Launch::Ranks { ranks, .. } => *ranks,
        }
    }

    /// The trace files a run asked for `path` writes: itself, or one per rank.
    pub fn trace_files(&self, path: &Path) -> Vec<PathBuf> {
        match self {
            Launch::Process => vec![path.to_path_buf()],
            Launch::Ranks { ranks, .. } => (0..*ranks)
                .map(|r| PathBuf::from(rank_trace_path(&path.display().to_string(), r)))
                .collect(),
        }
    }

    /// Runs `exe` with `args`, as one process or as MPI ranks; its output goes to `log`.
    fn run(&self, exe: &Path, args: &[String], log: &Path) -> Result<()> {
        let mut command = match self {
            Launch::Process => Command::new(exe),
            Launch::Ranks { ranks, launcher } => {
                let mut c = Command::new(&launcher[0]);
                c.args(&launcher[1..])
                    .args(["-np", &ranks.to_string()])
                    .arg(exe);
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
            let lines: Vec<_> = String::from_utf8_lossy(&text)
                .lines()
                .map(str::to_string)
                .collect();
            let tail = lines[lines.len().saturating_sub(5)..].join("\n");
            return Err(WgparError::Subprocess {
                command: shown,
                detail: format!("{} (log: {}):\n{tail}", out.status, log.display()),
            });
        }
        Ok(())
    }
}

/// Every (workload, configuration) pair to record.
pub type Cases = Vec<(Workload, Config)>;

/// What the benchmark runs: how it launches, every (workload, configuration) pair the models
/// can run and the ones skipped, the calibration's workload, and the devices a calibration
/// opens.
#[derive(Debug, Clone)]
pub struct Plan {
    /// How runs start.
    pub launch: Launch,
    /// The cases to record.
    pub cases: Cases,
    /// The cases no model can run, with why.
    pub skipped: Vec<String>,
    /// The calibration's workload.
    pub calibration: Workload,
    /// Devices each calibrating process opens.
    pub devices: usize,
}

impl ProjectionBenchOptions {
    /// Checks the options and lists the cases, before anything runs.
    pub fn plan(&self) -> Result<Plan> {
        self.check_counts()?;
        let launch = Launch::from_args(self.ranks, self.launcher.as_deref())?;
        let configs = (self.configs.iter())
            .map(|c| parse_config(c, launch.ranks()))
            .collect::<Result<Vec<_>>>()?;
        if configs.is_empty() {
            return Err(WgparError::option("--configs", "--configs is empty".into()));
        }
        let calibration = Workload {
            model: self.model.clone(),
            batch: self.batch,
            prompt_len: self.prompt_len,
        };
        let workloads = if self.runs.is_empty() {
            vec![calibration.clone()]
        } else {
            (self.runs.iter())
                .map(|r| parse_workload(r))
                .collect::<Result<Vec<_>>>()?
        };
        let (cases, skipped) = cases(&workloads, &configs)?;
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

    /// The counts and the tolerance, checked.
    fn check_counts(&self) -> Result<()> {
        if self.rounds == 0 || self.batch == 0 || self.prompt_len == 0 || self.gen == 0 {
            return Err(WgparError::option(
                "--rounds",
                "--rounds, --batch, --prompt-len and --gen must be positive".into(),
            ));
        }
        if !(self.tolerance.is_finite() && self.tolerance > 0.0) {
            return Err(WgparError::option(
                "--tolerance",
                format!(
                    "--tolerance must be a positive number of percent, got {}",
                    self.tolerance
                ),
            ));
        }
        Ok(())
    }

    /// Runs the plan with the wgpar executable `exe`: every round recorded, every case
    /// projected onto every round's profile.
    pub fn run(&self, plan: &Plan, exe: &Path) -> Result<Report<'_>> {
        let dir = &self.out_dir;
        std::fs::create_dir_all(dir).map_err(|source| WgparError::Io {
            path: dir.display().to_string(),
            source,
        })?;
        for round in 0..self.rounds {
            self.record_round(plan, exe, round)?;
        }
        let rows = self.project_cases(plan)?;
        Ok(Report {
            calibration_model: &self.model,
            calibration_batch: self.batch,
            calibration_prompt_len: self.prompt_len,
            skipped: plan.skipped.clone(),
            gen: self.gen,
            rounds: self.rounds,
            ranks: plan.launch.ranks(),
            host_gaps_kept: self.keep_host_gaps,
            tolerance_pct: self.tolerance,
            within: rows.iter().filter(|r| r.within_tolerance).count(),
            out_of_sample: summarise_out_of_sample(&rows, self.tolerance),
            rows,
        })
    }

    /// The trace a case's run writes in `round`.
    fn trace_of(&self, (w, c): (&Workload, &Config), round: usize) -> PathBuf {
        (self.out_dir).join(format!("{}.{}.r{round}.json", w.file_stem(), c.name))
    }

    /// `wgpar calibrate`'s arguments for `round`.
    fn calibrate_args(&self, plan: &Plan, round: usize) -> Vec<String> {
        let profile = self.out_dir.join(format!("cal{round}.toml"));
        let mut cal: Vec<String> = vec![
            "calibrate".into(),
            "--model".into(),
            self.model.clone(),
            "--virtual".into(),
            plan.devices.to_string(),
            "--max-bytes".into(),
            self.max_bytes.clone(),
            "--out".into(),
            profile.display().to_string(),
            "--batch".into(),
            self.batch.to_string(),
            "--prompt-len".into(),
            self.prompt_len.to_string(),
        ];
        if self.quick {
            cal.push("--quick".into());
        }
        cal
    }

    /// One round: a calibration, then one traced run of every case.
    fn record_round(&self, plan: &Plan, exe: &Path, round: usize) -> Result<()> {
        let path = |name: String| self.out_dir.join(name);
        eprintln!("round {}/{}: calibrating", round + 1, self.rounds);
        let cal = self.calibrate_args(plan, round);
        plan.launch
            .run(exe, &cal, &path(format!("cal{round}.log")))?;
        for (w, c) in &plan.cases {
            eprintln!(
                "round {}/{}: {} {}",
                round + 1,
                self.rounds,
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
                self.gen.to_string(),
                "--trace".into(),
                self.trace_of((w, c), round).display().to_string(),
            ]);
            let log = path(format!("{}.{}.r{round}.log", w.file_stem(), c.name));
            plan.launch.run(exe, &run, &log)?;
        }
        Ok(())
    }

    /// Every case's runs projected onto every round's profile, one row per case.
    fn project_cases(&self, plan: &Plan) -> Result<Vec<Row>> {
        let profiles = (0..self.rounds)
            .map(|r| {
                let p = self.out_dir.join(format!("cal{r}.toml"));
                HostProfile::load(&p).map_err(WgparError::from)
            })
            .collect::<Result<Vec<_>>>()?;
        let mut rows = Vec::new();
        for (w, c) in &plan.cases {
            let mut pairs = Vec::new();
            for run_round in 0..self.rounds {
                pairs.extend(self.project_run(plan, (w, c), run_round, &profiles)?);
            }
            let in_sample = *w == plan.calibration;
            rows.push(row_of((w, c), in_sample, pairs, self.tolerance));
        }
        Ok(rows)
    }

    /// One recorded run projected onto every profile.
    fn project_run(
        &self,
        plan: &Plan,
        case: (&Workload, &Config),
        run_round: usize,
        profiles: &[HostProfile],
    ) -> Result<Vec<Pair>> {
        let options = ProjectOptions {
            host_gaps: if self.keep_host_gaps {
                HostGaps::Keep
            } else {
                HostGaps::Drop
            },
            ..Default::default()
        };
        let trace = self.trace_of(case, run_round);
        let traces = (plan.launch.trace_files(&trace).iter())
            .map(Timeline::read_chrome_trace)
            .collect::<std::result::Result<Vec<_>, _>>()?;
        let mut pairs = Vec::new();
        for (calibration_round, profile) in profiles.iter().enumerate() {
            let timeline = match plan.launch {
                Launch::Process => traces[0].clone(),
                Launch::Ranks { .. } => merge_rank_traces(&traces, profile)?,
            };
            let p =
                project(&timeline, profile, &options).map_err(|source| WgparError::Projection {
                    what: trace.display().to_string(),
                    profile: profile.name.clone(),
                    source,
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
        Ok(pairs)
    }

    /// The report as Markdown tables, as `bench projection` prints it.
    pub fn render(&self, launch: &Launch, report: &Report<'_>) -> String {
        let n = self.rounds;
        let processes = match launch {
            Launch::Process => String::new(),
            Launch::Ranks { ranks, launcher } => format!(
                "; every run and calibration as {ranks} MPI ranks ({} -np {ranks})",
                launcher.join(" ")
            ),
        };
        let mut s = String::new();
        let _ = writeln!(
            s,
            "projection onto this machine's calibrated profile (calibrated on {}, batch {}, prompt {}); {} generated per run; {n} rounds, every run onto every calibration ({} pairs per row){processes}\n",
            self.model,
            self.batch,
            self.prompt_len,
            self.gen,
            n * n
        );
        let _ = writeln!(
            s,
            "| workload | config | sample | measured ms, median of {n} (range) | projected ms, median of {} | error, median [range] |",
            n * n
        );
        s.push_str("|---|---|---|---:|---:|---:|\n");
        for r in &report.rows {
            let _ = writeln!(
                s,
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
            );
        }
        s.push('\n');
        for skipped in &report.skipped {
            let _ = writeln!(s, "skipped {skipped}");
        }
        let _ = writeln!(
            s,
            "{} of {} rows within {} % (median error); profiles and traces in {}",
            report.within,
            report.rows.len(),
            self.tolerance,
            self.out_dir.display()
        );
        s + &render_out_of_sample(self.tolerance, &report.out_of_sample)
    }
}

/// Every (workload, configuration) the models can run, and the others with why; refused when
/// none can run.
fn cases(workloads: &[Workload], configs: &[Config]) -> Result<(Cases, Vec<String>)> {
    let mut cases = Vec::new();
    let mut skipped = Vec::new();
    for w in workloads {
        for c in configs {
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
    Ok((cases, skipped))
}

/// The out-of-sample summary table, when there are out-of-sample workloads.
fn render_out_of_sample(tolerance: f64, summaries: &[ConfigSummary]) -> String {
    let mut s = String::new();
    if summaries.is_empty() {
        return s;
    }
    s.push_str("\nout of sample, per configuration (every pair of every workload the calibration did not see):\n\n");
    let _ = writeln!(
        s,
        "| config | workloads | pairs | error, median | magnitude, median | within {tolerance} % |"
    );
    s.push_str("|---|---:|---:|---:|---:|---|\n");
    for c in summaries {
        let _ = writeln!(
            s,
            "| {} | {} | {} | {:+.1} % | {:.1} % | {} |",
            c.config,
            c.workloads,
            c.pairs,
            c.error_pct_median,
            c.abs_error_pct_median,
            if c.within_tolerance { "yes" } else { "no" }
        );
    }
    s
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
