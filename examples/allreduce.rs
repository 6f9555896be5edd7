//! All-reduce across virtual devices with the library API, then (with `--bench`) the
//! nccl-tests style benchmark.
//!
//! ```text
//! cargo run --release --example allreduce                      # 2 devices, one all-reduce
//! cargo run --release --example allreduce -- --bench -g 4 -b 8 -e 64M -f 2
//! ```

use std::sync::Arc;

use clap::Parser;
use wgpar::comm::bench::{parse_dtype, run_bench, BenchOp, BenchOptions};
use wgpar::comm::units::parse_size;
use wgpar::comm::{Algorithm, Collectives, CommConfig, Communicator, LinkPrecision};
use wgpar::device::{open_devices, Adapters, DeviceSelection, Gpu, GpuOptions};

#[derive(Parser)]
struct Args {
    /// Virtual devices to open on the preferred adapter.
    #[arg(short = 'g', long, default_value_t = 2)]
    devices: usize,
    /// Run the benchmark instead of the demo.
    #[arg(long)]
    bench: bool,
    /// Smallest size.
    #[arg(short = 'b', long, default_value = "8")]
    min: String,
    /// Largest size.
    #[arg(short = 'e', long, default_value = "64M")]
    max: String,
    /// Size factor.
    #[arg(short = 'f', long, default_value_t = 2)]
    factor: u64,
    /// Timed iterations per size.
    #[arg(short = 'n', long, default_value_t = 20)]
    iters: usize,
    /// Warm-up iterations per size.
    #[arg(short = 'w', long, default_value_t = 5)]
    warmup: usize,
    /// allreduce, allgather, reducescatter or sendrecv.
    #[arg(long, default_value = "allreduce")]
    op: String,
    /// f32 or f16.
    #[arg(short = 'd', long, default_value = "f32")]
    dtype: String,
    /// auto, grb or pipe.
    #[arg(short = 'a', long, default_value = "auto")]
    algorithm: String,
    /// Pipelined chunk size (per device).
    #[arg(long)]
    chunk: Option<String>,
    /// Chunks in flight.
    #[arg(long)]
    depth: Option<usize>,
    /// Host threads for reductions.
    #[arg(long)]
    threads: Option<usize>,
    /// Staged bytes per device above which `auto` pipelines.
    #[arg(long)]
    threshold: Option<String>,
    /// Microseconds a device wait spins before it sleeps.
    #[arg(long)]
    spin_us: Option<u64>,
    /// native or f16 (f32 all-reduce payload sent as f16).
    #[arg(long, default_value = "native")]
    link: String,
    /// Print JSON instead of the table.
    #[arg(long)]
    json: bool,
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args = Args::parse();
    let adapters = Adapters::discover()?;
    let selection = DeviceSelection::Virtual {
        adapter: adapters.preferred(),
        count: args.devices,
    };
    let gpus = open_devices(&adapters, &selection, &GpuOptions::default())?;

    if args.bench {
        let mut config = CommConfig::default();
        if let Some(c) = &args.chunk {
            config.chunk_bytes = parse_size(c)?;
        }
        if let Some(t) = &args.threshold {
            config.pipeline_threshold = parse_size(t)?;
        }
        config.link = args.link.parse::<LinkPrecision>()?;
        config.depth = args.depth.unwrap_or(config.depth);
        config.host_threads = args.threads.unwrap_or(config.host_threads);
        if let Some(us) = args.spin_us {
            config.spin_wait = std::time::Duration::from_micros(us);
        }
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
        let report = run_bench(&gpus, &opts)?;
        if args.json {
            println!("{}", serde_json::to_string_pretty(&report)?);
        } else {
            print!("{report}");
        }
        return Ok(());
    }

    // One caller holding every tensor.
    let coll = Collectives::new(CommConfig::default())?;
    let tensors = gpus
        .iter()
        .enumerate()
        .map(|(r, g)| g.upload_f32("partial", &[r as f32 + 1.0; 8]))
        .collect::<Result<Vec<_>, _>>()?;
    let parts: Vec<(&Gpu, &_)> = gpus.iter().map(|g| g.as_ref()).zip(&tensors).collect();
    coll.all_reduce(&parts)?;
    for (g, t) in gpus.iter().zip(&tensors) {
        println!("{}: {:?}", g.label(), g.read_f32(t)?);
    }

    // One thread per device, as a tensor-parallel engine runs.
    let comm = Communicator::new(gpus.clone(), CommConfig::default())?;
    let workers: Vec<_> = (0..gpus.len())
        .map(|r| {
            let rank = comm.join(r)?;
            Ok(std::thread::spawn(move || -> wgpar::Result<Vec<f32>> {
                let gpu: &Arc<Gpu> = rank.gpu();
                let t = gpu.upload_f32("partial", &[10.0 * (r as f32 + 1.0); 4])?;
                rank.all_reduce(&t)?;
                gpu.read_f32(&t)
            }))
        })
        .collect::<wgpar::Result<_>>()?;
    for (r, w) in workers.into_iter().enumerate() {
        let sum = w.join().map_err(|_| "worker panicked")??;
        println!("rank {r} (thread): {sum:?}");
    }
    for rec in coll.stats().records() {
        println!(
            "{} {} {} B on {:?} in {:?} (d2h {:?}, reduce {:?}, h2d {:?})",
            rec.op,
            rec.algorithm,
            rec.bytes,
            rec.participants,
            rec.duration,
            rec.d2h,
            rec.reduce,
            rec.h2d
        );
    }
    Ok(())
}
