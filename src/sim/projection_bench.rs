//! The projection benchmark's cases and figures (`wgpar bench projection`): the
//! configurations and workloads it records, which of them a model can run, and each case's
//! measured and projected makespans summarised against the tolerance, in sample and out of
//! it. The command line launches the runs (this executable, or `mpirun`); what it plans and
//! reports with lives here.

use serde::Serialize;

use crate::error::{Result, WgparError};

/// A configuration of the benchmark.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Config {
    /// Its name as given (`single`, `tp2`, `pp4-m8`).
    pub name: String,
    /// Devices of the whole job.
    pub devices: usize,
    /// Devices each process opens (`--virtual`): all of them in one process.
    #[serde(skip)]
    pub devices_per_rank: usize,
    /// Sequence groups a batch is split into (1 outside pipelines).
    #[serde(skip)]
    pub micro_batches: usize,
    /// `run` arguments that select it.
    #[serde(skip)]
    pub args: Vec<String>,
}

/// Parses a configuration for a job of `ranks` processes: over ranks a pipeline's stages are
/// spread evenly (P a multiple of the ranks) and tensor parallelism is one device per rank.
pub fn parse_config(text: &str, ranks: usize) -> Result<Config> {
    let bad = || {
        WgparError::option(
            "--configs",
            format!(
                "bad configuration '{text}': expected single, tpN or ppN-mM (e.g. tp2, pp4-m8)"
            ),
        )
    };
    let over_ranks = |why: &str| {
        WgparError::unsupported(format!("configuration '{text}' over {ranks} ranks: {why}"))
    };
    let number = |s: &str| s.parse::<usize>().ok().filter(|&n| n >= 1).ok_or_else(bad);
    let owned = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
    if text == "single" {
        if ranks > 1 {
            return Err(over_ranks(
                "one device is one process; choose tpN (N = the ranks) or ppP-mM (P a multiple of the ranks)",
            ));
        }
        return Ok(Config {
            name: text.into(),
            devices: 1,
            devices_per_rank: 1,
            micro_batches: 1,
            args: owned(&["--strategy", "none"]),
        });
    }
    if let Some(n) = text.strip_prefix("tp") {
        let n = number(n)?;
        if ranks > 1 && n != ranks {
            return Err(over_ranks(&format!(
                "tensor parallelism over ranks takes one device per rank: tp{ranks}"
            )));
        }
        let per_rank = n / ranks;
        return Ok(Config {
            name: text.into(),
            devices: n,
            devices_per_rank: per_rank,
            micro_batches: 1,
            args: owned(&["--strategy", "tp", "--virtual", &per_rank.to_string()]),
        });
    }
    if let Some(rest) = text.strip_prefix("pp") {
        let (p, m) = rest.split_once("-m").ok_or_else(bad)?;
        let (p, m) = (number(p)?, number(m)?);
        if p % ranks != 0 {
            return Err(over_ranks(&format!(
                "{p} stages do not spread evenly over {ranks} ranks"
            )));
        }
        let per_rank = p / ranks;
        return Ok(Config {
            name: text.into(),
            devices: p,
            devices_per_rank: per_rank,
            micro_batches: m,
            args: owned(&[
                "--strategy",
                "pp",
                "--virtual",
                &per_rank.to_string(),
                "--micro-batches",
                &m.to_string(),
            ]),
        });
    }
    Err(bad())
}

/// A model and shape to record and project.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Workload {
    /// Model preset or checkpoint.
    pub model: String,
    /// Sequences.
    pub batch: usize,
    /// Prompt tokens per sequence.
    pub prompt_len: usize,
}

impl Workload {
    /// `MODEL:BATCHxPROMPT`, as `--runs` gives it.
    pub fn name(&self) -> String {
        format!("{}:{}x{}", self.model, self.batch, self.prompt_len)
    }

    /// A name safe in file names.
    pub fn file_stem(&self) -> String {
        self.name()
            .chars()
            .map(|c| {
                if c.is_ascii_alphanumeric() || c == '-' {
                    c
                } else {
                    '_'
                }
            })
            .collect()
    }
}

/// Parses `--runs`' `MODEL:BATCHxPROMPT`.
pub fn parse_workload(text: &str) -> Result<Workload> {
    let bad = |why: &str| {
        WgparError::option(
            "--runs",
            format!("--runs '{text}': {why}; expected MODEL:BATCHxPROMPT, e.g. tiny-gpt2:4x32"),
        )
    };
    let (model, shape) = text.rsplit_once(':').ok_or_else(|| bad("no ':'"))?;
    let (b, p) = shape
        .split_once('x')
        .ok_or_else(|| bad("no 'x' in the shape"))?;
    let positive = |s: &str, what: &str| {
        s.trim()
            .parse::<usize>()
            .ok()
            .filter(|&n| n >= 1)
            .ok_or_else(|| bad(&format!("{what} '{s}' is not a positive whole number")))
    };
    if model.trim().is_empty() {
        return Err(bad("no model"));
    }
    Ok(Workload {
        model: model.trim().to_owned(),
        batch: positive(b, "batch")?,
        prompt_len: positive(p, "prompt length")?,
    })
}

/// Why `config` cannot run `workload` (more micro-batches than sequences, a TP degree its
/// heads do not divide, more pipeline stages than layers), or `None`. Unknown model names
/// pass: `wgpar run` reports them.
pub fn unrunnable(config: &Config, workload: &Workload) -> Option<String> {
    if config.micro_batches > workload.batch {
        return Some(format!(
            "{}: {} micro-batches for a batch of {}",
            config.name, config.micro_batches, workload.batch
        ));
    }
    let m = crate::model::ModelConfig::preset(&workload.model).ok()?;
    if config.name.starts_with("tp")
        && !crate::model::valid_tp_degrees(&m).contains(&config.devices)
    {
        return Some(format!(
            "{}: {} heads / {} KV heads do not split over {}",
            config.name, m.heads, m.kv_heads, config.devices
        ));
    }
    if config.name.starts_with("pp") && config.devices > m.layers {
        return Some(format!(
            "{}: {} stages for {} layers",
            config.name, config.devices, m.layers
        ));
    }
    None
}

/// One run projected onto one calibration.
#[derive(Debug, Clone, Serialize)]
pub struct Pair {
    /// The recording round.
    pub run_round: usize,
    /// The calibration round.
    pub calibration_round: usize,
    /// Measured makespan, ms.
    pub measured_ms: f64,
    /// Projected makespan, ms.
    pub projected_ms: f64,
    /// (projected - measured) / measured, %.
    pub error_pct: f64,
}

/// The figures of one configuration on one workload.
#[derive(Debug, Clone, Serialize)]
pub struct Row {
    /// The workload.
    pub workload: Workload,
    /// Whether the calibration ran this workload (in sample).
    pub in_sample: bool,
    /// The configuration.
    pub config: Config,
    /// Median measured makespan, ms.
    pub measured_ms_median: f64,
    /// Smallest and largest measured makespan, ms.
    pub measured_ms_range: [f64; 2],
    /// Median projected makespan, ms.
    pub projected_ms_median: f64,
    /// Median error of the projection, %.
    pub error_pct_median: f64,
    /// Smallest and largest error, %.
    pub error_pct_range: [f64; 2],
    /// Whether the median error is within the tolerance.
    pub within_tolerance: bool,
    /// Every run projected onto every calibration.
    pub pairs: Vec<Pair>,
}

/// The benchmark's report, as JSON and the tables print it.
#[derive(Serialize)]
pub struct Report<'a> {
    /// The model the profile was calibrated on.
    pub calibration_model: &'a str,
    /// Its batch.
    pub calibration_batch: usize,
    /// Its prompt length.
    pub calibration_prompt_len: usize,
    /// Cases the models cannot run, with why.
    pub skipped: Vec<String>,
    /// Tokens generated per run.
    pub gen: usize,
    /// Rounds of recording and of calibration.
    pub rounds: usize,
    /// Processes per run (MPI ranks; 1 without MPI).
    pub ranks: usize,
    /// Whether host gaps were kept in the projection.
    pub host_gaps_kept: bool,
    /// The tolerance, %.
    pub tolerance_pct: f64,
    /// Every case's figures.
    pub rows: Vec<Row>,
    /// Cases within the tolerance.
    pub within: usize,
    /// Per configuration, all its out-of-sample pairs together.
    pub out_of_sample: Vec<ConfigSummary>,
}

/// One configuration's out-of-sample pairs, over every workload the profile has not seen.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ConfigSummary {
    /// The configuration.
    pub config: String,
    /// Out-of-sample workloads the configuration ran.
    pub workloads: usize,
    /// Every run projected onto every calibration.
    pub pairs: usize,
    /// Median error of the projection, %.
    pub error_pct_median: f64,
    /// Median of the errors' magnitudes: over- and under-projections do not cancel.
    pub abs_error_pct_median: f64,
    /// Whether the median magnitude is within the tolerance.
    pub within_tolerance: bool,
}

/// Per configuration, in the order the configurations first appear, the errors of every
/// out-of-sample pair: the "median error per configuration", with the magnitudes'
/// median as the figure held to the tolerance.
pub fn summarise_out_of_sample(rows: &[Row], tolerance: f64) -> Vec<ConfigSummary> {
    let mut names: Vec<&str> = Vec::new();
    for r in rows.iter().filter(|r| !r.in_sample) {
        if !names.contains(&r.config.name.as_str()) {
            names.push(&r.config.name);
        }
    }
    names
        .into_iter()
        .map(|name| {
            let of_config: Vec<&Row> = rows
                .iter()
                .filter(|r| !r.in_sample && r.config.name == name)
                .collect();
            let errors: Vec<f64> = of_config
                .iter()
                .flat_map(|r| r.pairs.iter().map(|p| p.error_pct))
                .collect();
            let magnitudes: Vec<f64> = errors.iter().map(|e| e.abs()).collect();
            let abs_median = median(&magnitudes);
            ConfigSummary {
                config: name.to_string(),
                workloads: of_config.len(),
                pairs: errors.len(),
                error_pct_median: median(&errors),
                abs_error_pct_median: abs_median,
                within_tolerance: abs_median <= tolerance,
            }
        })
        .collect()
}

/// A case's row: medians and ranges of its pairs.
pub fn row_of(
    (w, c): (&Workload, &Config),
    in_sample: bool,
    pairs: Vec<Pair>,
    tolerance: f64,
) -> Row {
    let measured: Vec<f64> = (pairs.iter())
        .filter(|p| p.calibration_round == 0)
        .map(|p| p.measured_ms)
        .collect();
    let projected: Vec<f64> = pairs.iter().map(|p| p.projected_ms).collect();
    let errors: Vec<f64> = pairs.iter().map(|p| p.error_pct).collect();
    let error = median(&errors);
    Row {
        in_sample,
        workload: w.clone(),
        config: c.clone(),
        measured_ms_median: median(&measured),
        measured_ms_range: range(&measured),
        projected_ms_median: median(&projected),
        error_pct_median: error,
        error_pct_range: range(&errors),
        within_tolerance: error.abs() <= tolerance,
        pairs,
    }
}

/// The reported median: the mean of the two middle values for an even count (unlike
/// `crate::stats::median`, which keeps a measured value), NaN for none.
pub fn median(values: &[f64]) -> f64 {
    // The 50th percentile interpolated between the two middle ranks is their mean.
    crate::stats::percentile(values, 50.0).unwrap_or(f64::NAN)
}

/// The smallest and largest of `values`.
pub fn range(values: &[f64]) -> [f64; 2] {
    values
        .iter()
        .fold([f64::INFINITY, f64::NEG_INFINITY], |[lo, hi], &v| {
            [lo.min(v), hi.max(v)]
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn configurations_parse_and_bad_ones_are_named() {
        let c = parse_config("pp4-m8", 1).unwrap();
        assert_eq!(c.devices, 4);
        assert_eq!(
            c.args,
            ["--strategy", "pp", "--virtual", "4", "--micro-batches", "8"]
        );
        assert_eq!(parse_config("tp2", 1).unwrap().devices, 2);
        assert_eq!(parse_config("single", 1).unwrap().devices, 1);
        for bad in ["tp", "tp0", "pp2", "pp2-m0", "dp2", "pp-m2"] {
            let e = parse_config(bad, 1).unwrap_err().to_string();
            assert!(e.contains(bad) && e.contains("ppN-mM"), "{e}");
        }
    }

    #[test]
    fn workloads_parse_and_unrunnable_configurations_are_named() {
        let w = parse_workload("tiny-gpt2:4x32").unwrap();
        assert_eq!(
            (w.model.as_str(), w.batch, w.prompt_len),
            ("tiny-gpt2", 4, 32)
        );
        assert_eq!(w.file_stem(), "tiny-gpt2_4x32");
        for bad in ["tiny-gpt2", "m:4", "m:0x3", "m:4xq", ":4x4"] {
            let e = parse_workload(bad).unwrap_err().to_string();
            assert!(e.contains(bad) && e.contains("MODEL:BATCHxPROMPT"), "{e}");
        }
        // tiny-gpt2 has 6 heads and 2 layers: no TP over 4, no 4-stage pipeline.
        let tp4 = parse_config("tp4", 1).unwrap();
        let pp4 = parse_config("pp4-m1", 1).unwrap();
        let default = parse_workload("default:8x32").unwrap();
        assert!(unrunnable(&tp4, &w).is_some());
        assert!(unrunnable(&pp4, &w).is_some());
        assert!(unrunnable(&parse_config("tp2", 1).unwrap(), &w).is_none());
        assert!(unrunnable(&tp4, &default).is_none());
        // Four micro-batches need four sequences.
        let pp2_m4 = parse_config("pp2-m4", 1).unwrap();
        let two = parse_workload("default:2x64").unwrap();
        let why = unrunnable(&pp2_m4, &two).unwrap();
        assert!(why.contains("4 micro-batches for a batch of 2"), "{why}");
        assert!(unrunnable(&pp2_m4, &w).is_none());
    }

    #[test]
    fn configurations_over_ranks_split_devices_or_are_refused() {
        let pp = parse_config("pp4-m8", 2).unwrap();
        assert_eq!((pp.devices, pp.devices_per_rank), (4, 2));
        assert_eq!(
            pp.args,
            ["--strategy", "pp", "--virtual", "2", "--micro-batches", "8"]
        );
        let tp = parse_config("tp2", 2).unwrap();
        assert_eq!(tp.args, ["--strategy", "tp", "--virtual", "1"]);
        for (bad, why) in [
            ("single", "one device is one process"),
            ("tp4", "one device per rank: tp2"),
            ("pp3-m2", "3 stages do not spread evenly over 2 ranks"),
        ] {
            let e = parse_config(bad, 2).unwrap_err().to_string();
            assert!(e.contains(bad) && e.contains(why), "{e}");
        }
    }

    fn row(workload: &str, config: &str, in_sample: bool, errors: &[f64]) -> Row {
        Row {
            workload: parse_workload(workload).unwrap(),
            in_sample,
            config: parse_config(config, 1).unwrap(),
            measured_ms_median: 100.0,
            measured_ms_range: [100.0, 100.0],
            projected_ms_median: 100.0,
            error_pct_median: median(errors),
            error_pct_range: range(errors),
            within_tolerance: median(errors).abs() <= 15.0,
            pairs: errors
                .iter()
                .enumerate()
                .map(|(i, &e)| Pair {
                    run_round: i,
                    calibration_round: 0,
                    measured_ms: 100.0,
                    projected_ms: 100.0 + e,
                    error_pct: e,
                })
                .collect(),
        }
    }

    #[test]
    fn out_of_sample_summary_pools_a_configurations_pairs_and_skips_in_sample_ones() {
        let rows = [
            // In sample: left out, however far off.
            row("default:8x32", "tp2", true, &[90.0, 95.0, 99.0]),
            row("default:2x64", "tp2", false, &[-20.0, 4.0, 30.0]),
            row("tiny-gpt2:4x32", "tp2", false, &[-18.0, -16.0, 2.0]),
            row("default:2x64", "single", false, &[1.0, -3.0, 5.0]),
        ];
        let s = summarise_out_of_sample(&rows, 15.0);
        assert_eq!(s.len(), 2);
        let tp2 = &s[0];
        assert_eq!(
            (tp2.config.as_str(), tp2.workloads, tp2.pairs),
            ("tp2", 2, 6)
        );
        // Errors -20 -18 -16 2 4 30: the signed median -7 hides what the magnitudes show,
        // 2 4 16 18 20 30 -> 17.
        assert_eq!(tp2.error_pct_median, -7.0);
        assert_eq!(tp2.abs_error_pct_median, 17.0);
        assert!(!tp2.within_tolerance);
        let single = &s[1];
        assert_eq!((single.config.as_str(), single.pairs), ("single", 3));
        assert_eq!(single.abs_error_pct_median, 3.0);
        assert!(single.within_tolerance);
    }

    #[test]
    fn medians_and_ranges() {
        assert_eq!(median(&[3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(&[4.0, 1.0, 2.0, 3.0]), 2.5);
        assert_eq!(range(&[3.0, -1.0, 2.0]), [-1.0, 3.0]);
    }
}
