//! A recorded run projected onto a host profile, as `wgpar project` loads, draws and reports
//! it: the rank traces of an MPI run merged, the token count, the rates, and the text.

use std::fmt::Write as _;

use serde::Serialize;

use super::{HostProfile, Projection, ProjectionReport};
use crate::error::{Result, WgparError};
use crate::trace::{timeline_svg_with, RankPlacement, SvgOptions, Timeline};

/// The rank traces of one MPI run merged for projection onto `profile`: one rank per node
/// when the profile has several nodes, packed onto its one node otherwise.
pub fn merge_rank_traces(traces: &[Timeline], profile: &HostProfile) -> Result<Timeline> {
    let placement = if profile.nodes > 1 {
        RankPlacement::PerNode(profile.devices_per_node())
    } else {
        RankPlacement::Pack
    };
    Ok(Timeline::merge_ranks(traces, placement)?)
}

/// The timeline to project from the trace files `paths` (`--trace`): one trace, or the rank
/// traces of an MPI run merged onto `profile` (and written to `merged_out` when given).
pub fn load_run(
    paths: &[String],
    merged_out: Option<&str>,
    profile: &HostProfile,
) -> Result<Timeline> {
    let mut traces = Vec::with_capacity(paths.len());
    for path in paths {
        traces.push(Timeline::read_chrome_trace(path)?);
    }
    if traces.len() == 1 {
        if let Some((rank, size)) = traces[0].rank_of_job().filter(|(_, n)| *n > 1) {
            return Err(WgparError::option("--trace", format!(
                "--trace {}: this is rank {rank} of a {size}-rank run: pass every rank's trace (--trace once per rank)",
                paths[0]
            )));
        }
        if merged_out.is_some() {
            return Err(WgparError::unsupported(
                "--merged-out needs several rank traces".into(),
            ));
        }
        return Ok(traces.remove(0));
    }
    let merged = merge_rank_traces(&traces, profile)?;
    if let Some(path) = merged_out {
        merged.write_chrome_trace(path)?;
    }
    Ok(merged)
}

/// Tokens the run processed: `given` (`--tokens`), else the trace's `tokens` metadata, else
/// unknown.
pub fn run_tokens(given: Option<u64>, timeline: &Timeline) -> Result<Option<u64>> {
    if let Some(t) = given {
        return Ok(Some(t));
    }
    match timeline.meta.get("tokens") {
        Some(text) => Ok(Some(text.parse::<u64>().map_err(|_| {
            WgparError::Config(format!(
                "the trace's `tokens` metadata '{text}' is not a number"
            ))
        })?)),
        None => Ok(None),
    }
}

/// What part of a timeline an SVG picture shows, and how large.
#[derive(Debug, Clone, Copy)]
pub struct SvgView {
    /// Width and height in pixels.
    pub size: (u32, u32),
    /// Only step K (0-based): steps are separated by idle instants.
    pub step: Option<usize>,
    /// Only START..END milliseconds from the timeline's first span.
    pub window_ms: Option<(f64, f64)>,
}

/// Draws `timeline` as SVG into `path`, titled `title`, showing what `view` selects.
pub fn write_timeline_svg(
    timeline: &Timeline,
    path: &str,
    title: String,
    view: &SvgView,
) -> Result<()> {
    let mut opts = SvgOptions::new(view.size.0, view.size.1);
    opts.title = title;
    if let Some(k) = view.step {
        let steps = timeline.steps();
        let window = steps.get(k).ok_or_else(|| {
            WgparError::option(
                "--step",
                format!(
                    "--step {k}: the timeline has {} steps (0..{})",
                    steps.len(),
                    steps.len().saturating_sub(1)
                ),
            )
        })?;
        opts.window_us = Some(*window);
    }
    if let Some((a, b)) = view.window_ms {
        // Relative to the first span, as the axis is drawn.
        let origin = timeline
            .spans
            .iter()
            .map(|s| s.start_us())
            .fold(f64::INFINITY, f64::min);
        let origin = if origin.is_finite() { origin } else { 0.0 };
        opts.window_us = Some((origin + a * 1e3, origin + b * 1e3));
    }
    std::fs::write(path, timeline_svg_with(timeline, &opts)).map_err(|source| WgparError::Io {
        path: path.into(),
        source,
    })
}

/// Measured and projected rates, when the token count is known.
#[derive(Debug, Clone, Serialize)]
pub struct Throughput {
    /// Tokens the run processed.
    pub tokens: u64,
    /// Tokens per second as recorded.
    pub measured_tokens_per_s: f64,
    /// Tokens per second as projected.
    pub projected_tokens_per_s: f64,
}

impl Throughput {
    /// The rates of `tokens` over both makespans of `report`; none when either makespan is
    /// empty.
    pub fn of(tokens: Option<u64>, report: &ProjectionReport) -> Option<Self> {
        let (m, p) = (report.measured.makespan_us, report.projected.makespan_us);
        tokens.filter(|_| m > 0.0 && p > 0.0).map(|t| Throughput {
            tokens: t,
            measured_tokens_per_s: t as f64 / (m / 1e6),
            projected_tokens_per_s: t as f64 / (p / 1e6),
        })
    }
}

/// A projected run: the traces it came from, the profile, both timelines and the rates.
pub struct ProjectedRun<'a> {
    /// The trace files, joined with ` + `.
    pub trace_name: &'a str,
    /// The profile projected onto.
    pub profile: &'a HostProfile,
    /// The recorded timeline.
    pub timeline: &'a Timeline,
    /// The projection.
    pub projection: &'a Projection,
    /// The rates, when the token count is known.
    pub throughput: Option<Throughput>,
}

/// `wgpar project --json`'s document.
#[derive(Serialize)]
struct Output<'a> {
    trace: &'a str,
    report: &'a ProjectionReport,
    /// Null where the measured makespan is empty.
    projected_over_measured: Option<f64>,
    throughput: Option<&'a Throughput>,
}

impl ProjectedRun<'_> {
    /// The projection as pretty JSON.
    pub fn json(&self) -> Result<String> {
        let report = &self.projection.report;
        let (m, p) = (report.measured.makespan_us, report.projected.makespan_us);
        let out = Output {
            trace: self.trace_name,
            report,
            projected_over_measured: (m > 0.0).then(|| p / m),
            throughput: self.throughput.as_ref(),
        };
        serde_json::to_string_pretty(&out).map_err(|source| WgparError::Json {
            what: "the projection".into(),
            source,
        })
    }

    /// The projection as text: the report, latency and throughput, and the `files` written
    /// (what, path).
    pub fn render(&self, files: &[(&str, Option<&String>)]) -> String {
        let report = &self.projection.report;
        let (m, p) = (report.measured.makespan_us, report.projected.makespan_us);
        let mut s = format!(
            "trace {} ({} steps)\n{report}\n",
            self.trace_name,
            self.timeline.steps().len()
        );
        let _ = writeln!(
            s,
            "  latency (makespan): measured {:.3} ms, projected {:.3} ms",
            m / 1e3,
            p / 1e3
        );
        match &self.throughput {
            Some(t) => writeln!(
                s,
                "  throughput ({} tokens): measured {:.1} tokens/s, projected {:.1} tokens/s",
                t.tokens, t.measured_tokens_per_s, t.projected_tokens_per_s
            ),
            None => writeln!(
                s,
                "  throughput: pass --tokens N (the trace does not say how many tokens)"
            ),
        }
        .expect("writing to a String");
        for (what, path) in files {
            if let Some(path) = path {
                let _ = writeln!(s, "{what}: {path}");
            }
        }
        s
    }
}
