//! `wgpar allreduce`: collectives between devices through host memory, measured the way
//! nccl-tests measures them (plus per-iteration percentiles and the transfer floor).

use clap::Args;
use wgpar::comm::bench::{parse_dtype, run_bench, BenchOp, BenchOptions};
use wgpar::comm::units::parse_size;
use wgpar::comm::{Algorithm, CommConfig, LinkPrecision};
use wgpar::device::Adapters;
use wgpar::{Result, WgparError};

use super::options::DeviceArgs;

/// Options of `wgpar allreduce` (nccl-tests flags where they exist).
#[derive(Args, Clone, Debug)]
pub struct AllreduceArgs {
    #[command(flatten)]
    pub(super) devices: DeviceArgs,
    /// Smallest size, bytes (suffixes K, M, G).
    #[arg(short = 'b', long = "minbytes", default_value = "8")]
    pub(super) min: String,
    /// Largest size.
    #[arg(short = 'e', long = "maxbytes", default_value = "64M")]
    pub(super) max: String,
    /// Size multiplier.
    #[arg(short = 'f', long = "stepfactor", default_value_t = 2)]
    pub(super) factor: u64,
    /// Timed iterations per size.
    #[arg(short = 'n', long = "iters", default_value_t = 20)]
    pub(super) iters: usize,
    /// Warm-up iterations per size.
    #[arg(short = 'w', long = "warmup_iters", default_value_t = 5)]
    pub(super) warmup: usize,
    /// allreduce, allgather, reducescatter or sendrecv.
    #[arg(long, default_value = "allreduce")]
    pub(super) op: String,
    /// f32 or f16.
    #[arg(short = 'd', long, default_value = "f32")]
    pub(super) dtype: String,
    /// auto (by size), grb (gather-reduce-broadcast) or pipe (chunked, pipelined).
    #[arg(short = 'a', long, default_value = "auto")]
    pub(super) algorithm: String,
    /// Send f32 payloads as f16 over the link (reduce in f32): halves the bytes.
    #[arg(long, default_value = "native", value_parser = ["native", "f16"])]
    pub(super) link: String,
    /// Pipelined chunk size per device.
    #[arg(long)]
    pub(super) chunk: Option<String>,
    /// Print JSON.
    #[arg(long)]
    pub(super) json: bool,
}

/// Runs the benchmark and prints the nccl-tests style table.
pub fn run(args: &AllreduceArgs) -> Result<()> {
    let mut config = CommConfig::default();
    if let Some(c) = &args.chunk {
        config.chunk_bytes = parse_size(c)?;
    }
    config.link = args.link.parse::<LinkPrecision>()?;
    let opts = BenchOptions {
        config,
        min_bytes: parse_size(&args.min)?,
        max_bytes: parse_size(&args.max)?,
        factor: args.factor,
        iters: args.iters,
        warmup: args.warmup,
        op: args.op.parse::<BenchOp>()?,
        dtype: parse_dtype(&args.dtype)?,
        algorithm: args.algorithm.parse::<Algorithm>()?,
        ..BenchOptions::default()
    };
    // Sizes, counts, the chunk and names are checked before an adapter is looked for.
    opts.validate()?;
    opts.config.validate()?;
    let adapters = Adapters::discover()?;
    let mut devices = args.devices.clone();
    if devices.devices.is_none() && devices.virtual_count.is_none() {
        devices.virtual_count = Some(2);
    }
    let devices = devices.choice();
    opts.check_fits(&devices.selected(&adapters)?)?;
    let gpus = devices.open(&adapters)?;
    let report = run_bench(&gpus, &opts)?;
    if args.json {
        let text = serde_json::to_string_pretty(&report).map_err(|source| WgparError::Json {
            what: "the collective benchmark".into(),
            source,
        })?;
        outln!("{text}")?;
    } else {
        out!("{report}")?;
    }
    Ok(())
}
