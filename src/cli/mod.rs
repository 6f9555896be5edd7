//! Command-line interface: parses arguments and hands them to the engines and benchmarks.
//! Nothing here touches wgpu directly.

/// Writes to stdout, formatted like `print!`, as a `Result`: a closed pipe (`wgpar devices |
/// true`) or a full disk is an error the command returns, where `print!` would panic.
macro_rules! out {
    ($($arg:tt)*) => {
        $crate::cli::write_stdout(format_args!($($arg)*))
    };
}

/// [`out!`] with a newline, like `println!`.
macro_rules! outln {
    () => {
        $crate::cli::write_stdout(format_args!("\n"))
    };
    ($($arg:tt)*) => {
        $crate::cli::write_stdout(format_args!("{}\n", format_args!($($arg)*)))
    };
}

mod allreduce;
mod bench;
mod bench_decode;
mod bench_projection;
mod bench_serve;
mod calibrate;
mod chat;
mod compare;
mod devices;
mod embed;
mod mpi;
mod options;
mod plan;
mod project;
mod run;
mod server;
mod text;
mod trace;

use clap::{Parser, Subcommand};
use wgpar::device::Adapters;
use wgpar::{Result, WgparError};

use std::path::Path;

/// The exit statuses, by class (docs/USAGE.md, "Exit status").
const EXIT_STATUS: &str = "Exit status: 0 success; 1 failure while running (a device, file, \
model, link, rank or memory); 2 usage error (an option or a combination of them); 70 internal \
error (a library call out of order or a broken invariant: please report it)";

/// wgpar: run transformer inference across several GPUs of any vendor and backend, and see
/// where the time goes (tensor vs pipeline parallelism, PCIe vs NVLink).
#[derive(Parser)]
#[command(name = "wgpar", version, about, long_about = None, after_help = EXIT_STATUS)]
pub struct Cli {
    #[command(subcommand)]
    command: Option<Command>,
    #[command(flatten)]
    mpi: mpi::MpiArgs,
}

#[derive(Subcommand)]
enum Command {
    /// List every adapter on every backend, with the limits and features that matter.
    Devices {
        /// Print JSON instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// Prefill a batch of prompts and greedily decode, reporting tokens/s; with --prompt and a
    /// model folder, generate text.
    Run(options::RunArgs),
    /// OpenAI-compatible HTTP server (completions, chat, SSE streaming, /metrics) over any
    /// strategy, with continuous batching; the benchmark is `bench serve`.
    Serve(server::ServerArgs),
    /// Interactive chat in the terminal through the model's chat template, on any strategy:
    /// replies stream as they are generated, /reset and /exit, Ctrl-C stops a reply.
    Chat(chat::ChatArgs),
    /// Single vs tensor vs pipeline vs hybrid parallelism: measured here, projected onto host
    /// profiles, with verdicts, a Markdown report and SVG charts.
    Compare(compare::CompareArgs),
    /// Sentence embeddings of texts with an encoder checkpoint (BERT, e.g. all-MiniLM-L6-v2),
    /// and their pairwise cosine similarities.
    Embed(embed::EmbedArgs),
    /// Modeled projections of a model on host profiles, for models and machines not at hand
    /// (TP all-reduce share vs batch and sequence, PP vs TP throughput, bubble cost).
    Plan(plan::PlanArgs),
    /// Collectives between devices through host memory, nccl-tests style (-b 8 -e 64M -f 2).
    Allreduce(allreduce::AllreduceArgs),
    /// Benchmarks.
    Bench {
        #[command(subcommand)]
        what: bench::BenchCommand,
    },
    /// Measure this machine (links, host reduce, kernel rates) and write a host profile.
    Calibrate(calibrate::CalibrateArgs),
    /// Replay a recorded run (`run --trace`) on a host profile.
    Project(project::ProjectArgs),
}

/// Writes `text` to stdout and flushes it, so that a failed write is seen here, by the command
/// that printed, and not lost in the flush at exit.
pub(crate) fn write_stdout(text: std::fmt::Arguments) -> Result<()> {
    use std::io::Write;
    let mut stdout = std::io::stdout().lock();
    stdout
        .write_fmt(text)
        .and_then(|()| stdout.flush())
        .map_err(|source| WgparError::Stdout { source })
}

/// Where no Wayland display can be reached (`XDG_RUNTIME_DIR` unset or not a folder, and
/// `WAYLAND_DISPLAY` unset or relative to it: a headless shell, CI), adapter discovery would
/// still probe for one and libwayland print "error: XDG_RUNTIME_DIR is invalid or not set"
/// although nothing failed. Two probes do it: the EGL one of the GL backend (which reads
/// `WAYLAND_DISPLAY`: forgotten here) and Mesa's Vulkan device-select layer, which up to Mesa
/// 22.3 connects to the default display `wayland-0` even with no `WAYLAND_DISPLAY` (disabled
/// here with its own switch `NODEVICE_SELECT=1`, unless the user set it or chose a device with
/// `MESA_VK_DEVICE_SELECT`). The layer only orders GPUs by the display they drive, and there
/// is none; wgpar lists and picks every adapter itself. A reachable display changes nothing.
fn quiet_unreachable_display_probes() {
    let runtime_ok = std::env::var_os("XDG_RUNTIME_DIR")
        .is_some_and(|d| !d.is_empty() && Path::new(&d).is_dir());
    let display_absolute =
        std::env::var_os("WAYLAND_DISPLAY").is_some_and(|d| Path::new(&d).is_absolute());
    if runtime_ok || display_absolute {
        return;
    }
    // Runs first in main, before any thread exists.
    std::env::remove_var("WAYLAND_DISPLAY");
    let user_chose = ["NODEVICE_SELECT", "MESA_VK_DEVICE_SELECT"]
        .iter()
        .any(|v| std::env::var_os(v).is_some());
    if !user_chose {
        std::env::set_var("NODEVICE_SELECT", "1");
    }
}

/// Entry point: parse, dispatch, report errors as values.
pub fn main() -> Result<()> {
    quiet_unreachable_display_probes();
    let cli = Cli::parse();
    // Every environment switch is checked before a device opens or a model is built.
    wgpar::switches::validate()?;
    // Under mpirun (or --mpi) every rank runs its part of the job; a build without the `mpi`
    // feature refuses a parallel launch here.
    if cli.mpi.active()? {
        return mpi::main(cli);
    }
    match cli.command {
        Some(Command::Devices { json }) => devices::print(&Adapters::discover()?, json),
        Some(Command::Run(args)) => run::run(&args),
        Some(Command::Embed(args)) => embed::run(&args),
        Some(Command::Bench { what }) => bench::run(&what),
        Some(Command::Serve(args)) => server::run(&args),
        Some(Command::Chat(args)) => chat::run(&args),
        Some(Command::Compare(args)) => compare::run(&args),
        Some(Command::Plan(args)) => plan::run(&args),
        Some(Command::Allreduce(args)) => allreduce::run(&args),
        Some(Command::Calibrate(args)) => calibrate::run(&args),
        Some(Command::Project(args)) => project::run(&args),
        None => {
            // No arguments: show the machine, then the main job: compare the strategies on
            // the embedded default model.
            let adapters = Adapters::discover()?;
            devices::print(&adapters, false)?;
            outln!()?;
            compare::run(&compare::CompareArgs::default_job())
        }
    }
}
