//! Command-line interface: parses arguments and hands them to the engines and benchmarks.
//! Nothing here touches wgpu directly.

/// Writes to stdout, formatted like `print!`, as a `Result`: a closed pipe (`wgpar devices |
/// true`) or a full disk is an error the command returns, where `print!` would panic.
macro_rules! out {
    ($($arg:tt)*) => {
        $crate::cli::output::write_stdout(format_args!($($arg)*))
    };
}

/// [`out!`] with a newline, like `println!`.
macro_rules! outln {
    () => {
        $crate::cli::output::write_stdout(format_args!("\n"))
    };
    ($($arg:tt)*) => {
        $crate::cli::output::write_stdout(format_args!("{}\n", format_args!($($arg)*)))
    };
}

mod allreduce;
mod bench;
mod bench_decode;
mod bench_projection;
mod bench_serve;
mod calibrate;
mod chat;
mod commands;
mod compare;
mod devices;
mod embed;
mod mpi;
mod options;
mod output;
mod plan;
mod project;
mod run;
mod server;
mod text;
mod trace;

use clap::Parser;
use commands::{Cli, Command};
use wgpar::device::Adapters;
use wgpar::Result;

use std::path::Path;

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
