//! Tensor vs pipeline parallelism through the library API: a small comparison on four virtual
//! devices of the preferred adapter, projected onto a PCIe desktop and an NVLink DGX, as wgpar
//! runs it and as CUDA + NCCL would (modeled).
//!
//! `cargo run --release --example tp_vs_pp`

use wgpar::batching::{Length, Rate};
use wgpar::compare::{run_compare, table, CompareOptions, ServingOptions};
use wgpar::device::{open_devices, Adapters, DType, DeviceSelection, GpuOptions};
use wgpar::model::ModelConfig;
use wgpar::sim::{Engine, HostProfile};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let adapters = Adapters::discover()?;
    let selection = DeviceSelection::Virtual {
        adapter: adapters.preferred(),
        count: 4,
    };
    let gpus = open_devices(&adapters, &selection, &GpuOptions::default())?;
    let opts = CompareOptions {
        config: ModelConfig::preset("tiny-llama")?,
        dtype: DType::F32,
        batches: vec![1, 4],
        micro_batches: vec![1, 4],
        schedule: wgpar::parallel::Schedule::InFlight,
        prompt_len: 16,
        gen: 4,
        reps: 2,
        profiles: vec![
            HostProfile::resolve("pcie4-4gpu")?,
            HostProfile::resolve("dgx-h100")?,
        ],
        engines: vec![Engine::shipped("wgpar")?, Engine::shipped("cuda-nccl")?],
        seed: 1,
        serving: Some(ServingOptions {
            requests: 6,
            rate: Rate::Burst,
            prompt_len: Length::Fixed(16),
            output_len: Length::Fixed(4),
            max_batch: 4,
            seed: 1,
        }),
        at_scale: false,
    };
    let report = run_compare(&gpus, &opts, &mut |done, total, what| {
        eprintln!("[{done}/{total}] {what}");
    })?;
    print!("{}", table(&report));
    Ok(())
}
