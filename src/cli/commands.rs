//! The command line's grammar: every command and its options, as clap parses them. The
//! dispatchers (`cli::main`, and `cli::mpi` under mpirun) match on it; commands never see it.

use clap::{Parser, Subcommand};

use super::allreduce::AllreduceArgs;
use super::bench::BenchCommand;
use super::calibrate::CalibrateArgs;
use super::chat::ChatArgs;
use super::compare::CompareArgs;
use super::embed::EmbedArgs;
use super::options::{MpiArgs, RunArgs};
use super::plan::PlanArgs;
use super::project::ProjectArgs;
use super::server::ServerArgs;

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
    pub(super) command: Option<Command>,
    #[command(flatten)]
    pub(super) mpi: MpiArgs,
}

#[derive(Subcommand)]
pub(super) enum Command {
    /// List every adapter on every backend, with the limits and features that matter.
    Devices {
        /// Print JSON instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// Prefill a batch of prompts and greedily decode, reporting tokens/s; with --prompt and a
    /// model folder, generate text.
    Run(RunArgs),
    /// OpenAI-compatible HTTP server (completions, chat, SSE streaming, /metrics) over any
    /// strategy, with continuous batching; the benchmark is `bench serve`.
    Serve(ServerArgs),
    /// Interactive chat in the terminal through the model's chat template, on any strategy:
    /// replies stream as they are generated, /reset and /exit, Ctrl-C stops a reply.
    Chat(ChatArgs),
    /// Single vs tensor vs pipeline vs hybrid parallelism: measured here, projected onto host
    /// profiles, with verdicts, a Markdown report and SVG charts.
    Compare(CompareArgs),
    /// Sentence embeddings of texts with an encoder checkpoint (BERT, e.g. all-MiniLM-L6-v2),
    /// and their pairwise cosine similarities.
    Embed(EmbedArgs),
    /// Modeled projections of a model on host profiles, for models and machines not at hand
    /// (TP all-reduce share vs batch and sequence, PP vs TP throughput, bubble cost).
    Plan(PlanArgs),
    /// Collectives between devices through host memory, nccl-tests style (-b 8 -e 64M -f 2).
    Allreduce(AllreduceArgs),
    /// Benchmarks.
    Bench {
        #[command(subcommand)]
        what: BenchCommand,
    },
    /// Measure this machine (links, host reduce, kernel rates) and write a host profile.
    Calibrate(CalibrateArgs),
    /// Replay a recorded run (`run --trace`) on a host profile.
    Project(ProjectArgs),
}
