//! All-reduce across virtual devices with the library API: one caller holding every tensor,
//! then one thread per device as the tensor-parallel engine runs. The benchmark is
//! `wgpar allreduce` (nccl-tests flags: `-b 8 -e 64M -f 2`).
//!
//! ```text
//! cargo run --release --example allreduce -- -g 4
//! ```

use std::sync::Arc;

use clap::Parser;
use wgpar::comm::{Collectives, CommConfig, Communicator};
use wgpar::device::{open_devices, Adapters, DeviceSelection, Gpu, GpuOptions};

#[derive(Parser)]
struct Args {
    /// Virtual devices to open on the preferred adapter.
    #[arg(short = 'g', long, default_value_t = 2)]
    devices: usize,
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args = Args::parse();
    let adapters = Adapters::discover()?;
    let selection = DeviceSelection::Virtual {
        adapter: adapters.preferred(),
        count: args.devices,
    };
    let gpus = open_devices(&adapters, &selection, &GpuOptions::default())?;

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
