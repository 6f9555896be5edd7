//! `wgpar project`: replay a recorded run (`wgpar run --trace`) on a host profile and print
//! projected latency, throughput, communication and bubble shares next to the measured ones.

use clap::Args;
use serde::Serialize;
use wgpar::sim::{
    project_engine, CollectivePolicy, Engine, HostGaps, HostProfile, ProjectOptions, Projection,
    ProjectionReport, StepBarriers,
};
use wgpar::trace::{timeline_svg_with, SvgOptions, Timeline};
use wgpar::{Result, WgparError};

/// Options of `wgpar project`.
#[derive(Args, Clone, Debug)]
pub struct ProjectArgs {
    /// Trace written by `wgpar run --trace`; of a run under mpirun, every rank's trace
    /// (`--trace run.rank0.json --trace run.rank1.json`), merged with one rank per node of a
    /// multi-node profile (packed onto one node otherwise), or one merged trace (--merged-out).
    #[arg(long, value_name = "FILE", required = true)]
    trace: Vec<String>,
    /// With several rank traces: also write the merged trace.
    #[arg(long, value_name = "FILE")]
    merged_out: Option<String>,
    /// Host profile: a file, or a shipped name (pcie4-2gpu, dgx-h100, ...).
    #[arg(long, value_name = "PROFILE")]
    host: String,
    /// Engine whose figures cost the run: `wgpar` (this code; on a calibrated profile its
    /// measurements), `cuda-nccl` (the same work in f16 on tensor cores with NCCL), `peak`
    /// (every figure of the profile at 100 %), or an engine TOML file.
    #[arg(long, default_value = "wgpar", value_name = "ENGINE")]
    engine: String,
    /// Cost collectives with the cheapest algorithm the engine has on the profile instead of
    /// the recorded one.
    #[arg(long)]
    best_collectives: bool,
    /// Keep each span's measured host gap (only meaningful on the calibrated profile of the
    /// machine that recorded the trace).
    #[arg(long)]
    keep_host_gaps: bool,
    /// Do not treat idle instants of the recorded run as step boundaries.
    #[arg(long)]
    no_step_barriers: bool,
    /// Tokens the run processed, for throughput (default: the trace's `tokens` metadata).
    #[arg(long)]
    tokens: Option<u64>,
    /// Write the projected timeline as a Chrome trace.
    #[arg(long, value_name = "FILE")]
    out: Option<String>,
    /// Draw the recorded timeline as SVG.
    #[arg(long, value_name = "FILE")]
    svg: Option<String>,
    /// Draw the projected timeline as SVG.
    #[arg(long, value_name = "FILE")]
    svg_projected: Option<String>,
    /// Draw only step K (0-based) of each timeline: steps are separated by idle instants.
    #[arg(long, value_name = "K", conflicts_with = "window_ms")]
    step: Option<usize>,
    /// Draw only START..END milliseconds (from the timeline's first span), e.g. 0:650.
    #[arg(long, value_name = "START:END", value_parser = parse_window)]
    window_ms: Option<(f64, f64)>,
    /// Heading of the SVG pictures (default: what they show and the trace file).
    #[arg(long)]
    title: Option<String>,
    /// SVG size in pixels, WIDTHxHEIGHT.
    #[arg(long, default_value = "1200x360", value_parser = parse_size)]
    svg_size: (u32, u32),
    /// Print JSON instead of a table.
    #[arg(long)]
    json: bool,
}

fn parse_size(text: &str) -> std::result::Result<(u32, u32), String> {
    let bad = || format!("'{text}' is not a size: expected WIDTHxHEIGHT, e.g. 1200x360");
    let (w, h) = text.split_once('x').ok_or_else(bad)?;
    let w: u32 = w.trim().parse().map_err(|_| bad())?;
    let h: u32 = h.trim().parse().map_err(|_| bad())?;
    if w == 0 || h == 0 {
        return Err(bad());
    }
    Ok((w, h))
}

fn parse_window(text: &str) -> std::result::Result<(f64, f64), String> {
    let bad = || format!("'{text}' is not a window: expected START:END in ms, e.g. 0:650");
    let (a, b) = text.split_once(':').ok_or_else(bad)?;
    let a: f64 = a.trim().parse().map_err(|_| bad())?;
    let b: f64 = b.trim().parse().map_err(|_| bad())?;
    if !(a.is_finite() && b.is_finite() && a >= 0.0 && b > a) {
        return Err(bad());
    }
    Ok((a, b))
}

/// Measured and projected rates, when the token count is known.
#[derive(Debug, Serialize)]
struct Throughput {
    tokens: u64,
    measured_tokens_per_s: f64,
    projected_tokens_per_s: f64,
}

#[derive(Debug, Serialize)]
struct Output<'a> {
    trace: &'a str,
    report: &'a ProjectionReport,
    projected_over_measured: f64,
    throughput: Option<Throughput>,
}

fn write_svg(timeline: &Timeline, path: &str, title: String, args: &ProjectArgs) -> Result<()> {
    let mut opts = SvgOptions::new(args.svg_size.0, args.svg_size.1);
    opts.title = title;
    if let Some(k) = args.step {
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
    if let Some((a, b)) = args.window_ms {
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

/// The timeline to project: one trace, or the rank traces of an MPI run merged (ranks on the
/// profile's nodes, one per node when it has several).
fn load(args: &ProjectArgs, profile: &HostProfile) -> Result<Timeline> {
    let mut traces = Vec::with_capacity(args.trace.len());
    for path in &args.trace {
        traces.push(Timeline::read_chrome_trace(path)?);
    }
    if traces.len() == 1 {
        if let Some((rank, size)) = traces[0].rank_of_job().filter(|(_, n)| *n > 1) {
            return Err(WgparError::option("--trace", format!(
                "--trace {}: this is rank {rank} of a {size}-rank run: pass every rank's trace (--trace once per rank)",
                args.trace[0]
            )));
        }
        if args.merged_out.is_some() {
            return Err(WgparError::unsupported(
                "--merged-out needs several rank traces".into(),
            ));
        }
        return Ok(traces.remove(0));
    }
    let merged = super::options::merge_rank_traces(&traces, profile)?;
    if let Some(path) = &args.merged_out {
        merged.write_chrome_trace(path)?;
    }
    Ok(merged)
}

/// Runs the projection and prints it.
pub fn run(args: &ProjectArgs) -> Result<()> {
    let profile = HostProfile::resolve(&args.host)?;
    let engine = Engine::resolve(&args.engine)?;
    let timeline = load(args, &profile)?;
    let trace_name = args.trace.join(" + ");
    let projection =
        project_engine(&timeline, &profile, &engine, &project_options(args)).map_err(|source| {
            WgparError::Projection {
                what: format!("{trace_name} as {}", engine.label()),
                profile: profile.name.clone(),
                source,
            }
        })?;
    let report = &projection.report;
    let tokens = tokens(args, &timeline)?;
    let (m, p) = (report.measured.makespan_us, report.projected.makespan_us);
    let throughput = tokens.filter(|_| m > 0.0 && p > 0.0).map(|t| Throughput {
        tokens: t,
        measured_tokens_per_s: t as f64 / (m / 1e6),
        projected_tokens_per_s: t as f64 / (p / 1e6),
    });
    let run = Run {
        trace_name: &trace_name,
        profile: &profile,
        timeline: &timeline,
        projection: &projection,
    };
    write_files(args, &run)?;
    if args.json {
        let out = Output {
            trace: &trace_name,
            report,
            projected_over_measured: if m > 0.0 { p / m } else { 0.0 },
            throughput,
        };
        let text = serde_json::to_string_pretty(&out).map_err(|source| WgparError::Json {
            what: "the projection".into(),
            source,
        })?;
        outln!("{text}")?;
        return Ok(());
    }
    print_text(args, &run, throughput.as_ref())
}

/// How the run is re-scheduled, from the switches.
fn project_options(args: &ProjectArgs) -> ProjectOptions {
    ProjectOptions {
        collectives: if args.best_collectives {
            CollectivePolicy::Best
        } else {
            CollectivePolicy::AsRecorded
        },
        host_gaps: if args.keep_host_gaps {
            HostGaps::Keep
        } else {
            HostGaps::Drop
        },
        barriers: if args.no_step_barriers {
            StepBarriers::Off
        } else {
            StepBarriers::Idle
        },
    }
}

/// Tokens the run processed: `--tokens`, else the trace's `tokens` metadata, else unknown.
fn tokens(args: &ProjectArgs, timeline: &Timeline) -> Result<Option<u64>> {
    if let Some(t) = args.tokens {
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

/// A projected run: the traces it came from, the profile, and both timelines.
struct Run<'a> {
    trace_name: &'a str,
    profile: &'a HostProfile,
    timeline: &'a Timeline,
    projection: &'a Projection,
}

/// Writes the projected trace and the SVG pictures asked for.
fn write_files(args: &ProjectArgs, run: &Run<'_>) -> Result<()> {
    if let Some(path) = &args.out {
        run.projection.timeline.write_chrome_trace(path)?;
    }
    if let Some(path) = &args.svg {
        let title = match &args.title {
            Some(t) => format!("measured: {t}"),
            None => format!("measured: {}", run.trace_name),
        };
        write_svg(run.timeline, path, title, args)?;
    }
    if let Some(path) = &args.svg_projected {
        let what = args.title.as_deref().unwrap_or(run.trace_name);
        let title = format!("projected onto {}: {what}", run.profile.name);
        write_svg(&run.projection.timeline, path, title, args)?;
    }
    Ok(())
}

/// The projection as text: the report, latency and throughput, and the files written.
fn print_text(args: &ProjectArgs, run: &Run<'_>, throughput: Option<&Throughput>) -> Result<()> {
    let report = &run.projection.report;
    let (m, p) = (report.measured.makespan_us, report.projected.makespan_us);
    outln!(
        "trace {} ({} steps)",
        run.trace_name,
        run.timeline.steps().len()
    )?;
    out!("{report}")?;
    outln!()?;
    outln!(
        "  latency (makespan): measured {:.3} ms, projected {:.3} ms",
        m / 1e3,
        p / 1e3
    )?;
    match throughput {
        Some(t) => outln!(
            "  throughput ({} tokens): measured {:.1} tokens/s, projected {:.1} tokens/s",
            t.tokens,
            t.measured_tokens_per_s,
            t.projected_tokens_per_s
        )?,
        None => outln!("  throughput: pass --tokens N (the trace does not say how many tokens)")?,
    }
    for (what, path) in [
        ("projected trace", &args.out),
        ("recorded timeline SVG", &args.svg),
        ("projected timeline SVG", &args.svg_projected),
    ] {
        if let Some(path) = path {
            outln!("{what}: {path}")?;
        }
    }
    Ok(())
}
