//! `wgpar project`: replay a recorded run (`wgpar run --trace`) on a host profile and print
//! projected latency, throughput, communication and bubble shares next to the measured ones.

use clap::Args;
use wgpar::sim::project_run::{
    load_run, run_tokens, write_timeline_svg, ProjectedRun, SvgView, Throughput,
};
use wgpar::sim::{
    project_engine, CollectivePolicy, Engine, HostGaps, HostProfile, ProjectOptions, StepBarriers,
};
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

/// Runs the projection and prints it.
pub fn run(args: &ProjectArgs) -> Result<()> {
    let profile = HostProfile::resolve(&args.host)?;
    let engine = Engine::resolve(&args.engine)?;
    let timeline = load_run(&args.trace, args.merged_out.as_deref(), &profile)?;
    let trace_name = args.trace.join(" + ");
    let projection =
        project_engine(&timeline, &profile, &engine, &project_options(args)).map_err(|source| {
            WgparError::Projection {
                what: format!("{trace_name} as {}", engine.label()),
                profile: profile.name.clone(),
                source,
            }
        })?;
    let tokens = run_tokens(args.tokens, &timeline)?;
    let run = ProjectedRun {
        trace_name: &trace_name,
        profile: &profile,
        timeline: &timeline,
        throughput: Throughput::of(tokens, &projection.report),
        projection: &projection,
    };
    write_files(args, &run)?;
    if args.json {
        return outln!("{}", run.json()?);
    }
    out!(
        "{}",
        run.render(&[
            ("projected trace", args.out.as_ref()),
            ("recorded timeline SVG", args.svg.as_ref()),
            ("projected timeline SVG", args.svg_projected.as_ref()),
        ])
    )
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

/// Writes the projected trace and the SVG pictures asked for.
fn write_files(args: &ProjectArgs, run: &ProjectedRun<'_>) -> Result<()> {
    if let Some(path) = &args.out {
        run.projection.timeline.write_chrome_trace(path)?;
    }
    let view = SvgView {
        size: args.svg_size,
        step: args.step,
        window_ms: args.window_ms,
    };
    let what = args.title.as_deref().unwrap_or(run.trace_name);
    if let Some(path) = &args.svg {
        write_timeline_svg(run.timeline, path, format!("measured: {what}"), &view)?;
    }
    if let Some(path) = &args.svg_projected {
        let title = format!("projected onto {}: {what}", run.profile.name);
        write_timeline_svg(&run.projection.timeline, path, title, &view)?;
    }
    Ok(())
}
