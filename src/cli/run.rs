//! `wgpar run`: prefill + greedy decode on the chosen strategy, with tokens/s and where the
//! time went.

use clap::Args;
use std::sync::Arc;
use wgpar::comm::CommConfig;
use wgpar::device::Adapters;
use wgpar::parallel::{build_engine, generate, PartitionSpec, Schedule, Strategy};

use wgpar::sim::{HostProfile, LinkPacer};
use wgpar::trace::{DeviceTiming, Recorder};
use wgpar::{Result, WgparError};

use super::text::TextArgs;
use super::{DeviceArgs, ModelArgs};

/// Strategy options shared by `run` and `compare`.
#[derive(Args, Clone, Debug)]
pub struct StrategyArgs {
    /// How to spread the model: none (first device), tp (tensor parallel over all devices),
    /// pp (one pipeline stage per device), hybrid (pipeline stages of --tp devices each).
    #[arg(long, default_value = "none", value_parser = ["none", "tp", "pp", "hybrid"])]
    pub strategy: String,
    /// Hybrid: devices per pipeline stage (tensor-parallel degree inside a stage).
    #[arg(long, default_value_t = 2)]
    pub tp: usize,
    /// Tensor parallel: relative shares per device, e.g. 3,1 (default even).
    #[arg(long, value_delimiter = ',')]
    pub split: Option<Vec<usize>>,
    /// Pipeline: layers per stage, e.g. 5,7 (default: --partition).
    #[arg(long, value_delimiter = ',')]
    pub layers: Option<Vec<usize>>,
    /// Pipeline: even, or balanced by measured per-device layer/embedding/head time.
    #[arg(long, default_value = "even", value_parser = ["even", "balanced"])]
    pub partition: String,
    /// Pipeline: micro-batches per batch.
    #[arg(long, default_value_t = 1)]
    pub micro_batches: usize,
    /// Pipeline decode: in-flight (each micro-batch's next token enters stage 0 as soon as
    /// its previous one is sampled) or gpipe (a fill-drain of all micro-batches per token).
    #[arg(long, default_value = "in-flight", value_parser = ["in-flight", "gpipe"])]
    pub schedule: String,
}

impl StrategyArgs {
    fn partition_spec(&self) -> PartitionSpec {
        match (&self.layers, self.partition.as_str()) {
            (Some(l), _) => PartitionSpec::Explicit(l.clone()),
            (None, "balanced") => PartitionSpec::Balanced,
            _ => PartitionSpec::Even,
        }
    }

    /// The pipeline decode schedule.
    pub fn schedule(&self) -> Schedule {
        Schedule::parse(&self.schedule).unwrap_or_default()
    }

    /// The strategy these options name.
    pub fn strategy(&self) -> Result<Strategy> {
        Ok(match self.strategy.as_str() {
            "tp" => Strategy::Tensor {
                split: self.split.clone(),
            },
            "pp" => Strategy::Pipeline {
                partition: self.partition_spec(),
                micro_batches: self.micro_batches,
                schedule: self.schedule(),
            },
            "hybrid" => Strategy::Hybrid {
                tp: self.tp,
                partition: self.partition_spec(),
                micro_batches: self.micro_batches,
                schedule: self.schedule(),
            },
            _ => Strategy::Single,
        })
    }
}

/// Options of `wgpar run`.
#[derive(Args, Clone, Debug)]
pub struct RunArgs {
    #[command(flatten)]
    devices: DeviceArgs,
    #[command(flatten)]
    model: ModelArgs,
    #[command(flatten)]
    strategy: StrategyArgs,
    /// Sequences per batch.
    #[arg(long, default_value_t = 4)]
    batch: usize,
    /// Prompt length (random token ids).
    #[arg(long, default_value_t = 64)]
    prompt_len: usize,
    /// Tokens to generate per sequence.
    #[arg(long, default_value_t = 16)]
    gen: usize,
    /// Write the run's timeline as Chrome Trace Event JSON (opens in Perfetto).
    #[arg(long, value_name = "FILE")]
    trace: Option<String>,
    /// Pace transfers and collectives to a host profile's links (shipped name or TOML path),
    /// e.g. pcie3-2gpu, so the run behaves like that machine's interconnect; or to one link
    /// given as ALPHA_US:BETA_GBPS, e.g. 50:0.125 for a 1 Gb/s network.
    #[arg(long, value_name = "PROFILE|ALPHA_US:BETA_GBPS")]
    pace: Option<String>,
    /// With --trace, also time compute spans on the device with timestamp queries: auto (where
    /// the adapter has TIMESTAMP_QUERY and is not a CPU driver, on which timestamp writes
    /// slow each submission down), on, off.
    #[arg(long, default_value = "auto", value_parser = ["auto", "on", "off"])]
    device_timestamps: String,
    #[command(flatten)]
    text: TextArgs,
}

/// Runs generation and prints the rates.
pub fn run(args: &RunArgs) -> Result<()> {
    if let Some(prompt) = &args.text.prompt {
        return super::text::generate(&args.devices, &args.model, &args.text, prompt, args.gen);
    }
    let config = args.model.config()?;
    if args.batch == 0 || args.prompt_len == 0 || args.gen == 0 {
        return Err(WgparError::Config(
            "--batch, --prompt-len and --gen must be positive".into(),
        ));
    }
    if args.prompt_len + args.gen > config.max_seq {
        return Err(WgparError::Config(format!(
            "--prompt-len {} + --gen {} exceed max_seq {} of model '{}'",
            args.prompt_len, args.gen, config.max_seq, config.name
        )));
    }
    let strategy = args.strategy.strategy()?;
    let adapters = Adapters::discover()?;
    let gpus = args.devices.open(&adapters)?;
    let dtype = args.model.dtype(&gpus)?;
    let weights = args.model.weights(&config)?;
    println!(
        "model {} ({} arch, {} layers, hidden {}, {:.1}M params, {:?} weights)",
        config.name,
        format!("{:?}", config.arch).to_lowercase(),
        config.layers,
        config.hidden,
        config.params() as f64 / 1e6,
        dtype
    );
    let mut engine = build_engine(
        &strategy,
        &gpus,
        &weights,
        dtype,
        &CommConfig::default(),
        (args.batch, args.prompt_len),
    )?;
    println!("engine: {}", engine.name());
    if let Some(text) = &args.pace {
        let (pacer, what) = pacer_for(text)?;
        println!("pacing transfers to {what}");
        engine.set_pacer(Some(Arc::new(pacer)));
    }
    let prompts: Vec<Vec<u32>> = (0..args.batch)
        .map(|b| {
            (0..args.prompt_len)
                .map(|i| ((b * 7919 + i * 104_729) % config.vocab) as u32)
                .collect()
        })
        .collect();
    // One untimed pass compiles the pipelines and allocates buffers.
    generate(engine.as_mut(), &prompts, 2)?;
    let recorder = if args.trace.is_some() {
        Recorder::new()
            .with_device_timing(DeviceTiming::parse(&args.device_timestamps).unwrap_or_default())
    } else {
        Recorder::disabled()
    };
    // What `wgpar project` needs to turn a makespan into throughput, and what a reader of the
    // trace needs to know what ran. The recorded part is one prefill, then a generation (a
    // prefill and gen - 1 decode steps).
    let processed = args.batch * (2 * args.prompt_len + args.gen - 1);
    for (key, value) in [
        ("model", config.name.clone()),
        ("strategy", engine.name()),
        ("dtype", format!("{dtype:?}").to_lowercase()),
        ("batch", args.batch.to_string()),
        ("prompt_len", args.prompt_len.to_string()),
        ("gen", args.gen.to_string()),
        ("tokens", processed.to_string()),
        (
            "adapters",
            gpus.iter()
                .map(|g| g.info().label())
                .collect::<Vec<_>>()
                .join("; "),
        ),
    ] {
        recorder.set_meta(key, value);
    }
    engine.set_recorder(recorder.clone());
    // Prefill alone first, to report its accounting; then the full generation.
    engine.prefill(&prompts)?;
    let prefill_stats = engine.last_step();
    let g = generate(engine.as_mut(), &prompts, args.gen)?;
    println!(
        "prefill: {} tokens in {:.1} ms = {:.1} tokens/s (time to first token {:.1} ms)",
        g.prompt_tokens,
        g.prefill_s * 1e3,
        g.prefill_tokens_per_s(),
        g.prefill_s * 1e3
    );
    if let Some(s) = &prefill_stats {
        println!(
            "  compute {:.1} ms, communication {:.1} ms ({:.0}% of device time), {} collectives/hand-offs, {} B sent per device",
            s.compute_s * 1e3,
            s.comm_s * 1e3,
            s.comm_share() * 100.0,
            s.collectives,
            s.bytes_sent
        );
        println!("  {}", s.per_token_line());
    }
    println!(
        "decode: {} tokens x {} sequences in {:.1} ms, {:.2} ms per token = {:.1} tokens/s",
        g.decode_steps,
        args.batch,
        g.decode_s * 1e3,
        g.per_token_s() * 1e3,
        g.decode_tokens_per_s()
    );
    if g.decode_steps > 0 {
        let s = &g.decode_stats;
        println!(
            "  compute {:.2} ms, communication {:.2} ms ({:.0}%), {} collectives/hand-offs per device",
            s.compute_s * 1e3,
            s.comm_s * 1e3,
            s.comm_share() * 100.0,
            s.collectives
        );
        println!("  {}", s.per_token_line());
    }
    println!("first sequence's tokens: {:?}", g.tokens[0]);
    if let Some(path) = &args.trace {
        let timeline = recorder.timeline();
        timeline
            .write_chrome_trace(path)
            .map_err(|e| WgparError::Config(e.to_string()))?;
        println!(
            "trace: {} spans written to {path} (open in https://ui.perfetto.dev)",
            timeline.spans.len()
        );
        let timed: Vec<_> = timeline
            .spans
            .iter()
            .filter_map(|s| s.device_ns.map(|ns| (ns, s.dur_ns)))
            .collect();
        if !timed.is_empty() {
            let device: u64 = timed.iter().map(|t| t.0).sum();
            let host: u64 = timed.iter().map(|t| t.1).sum();
            println!(
                "  device time (timestamp queries) of {} compute spans: {:.1} ms of their {:.1} ms on the host clock ({:.0} %)",
                timed.len(),
                device as f64 / 1e6,
                host as f64 / 1e6,
                device as f64 / host.max(1) as f64 * 100.0
            );
        }
    }
    Ok(())
}

/// The pacer `--pace` names: one link as `ALPHA_US:BETA_GBPS`, else a host profile (device 0's
/// host link, collectives by the profile's cost model). Also says what it paces to.
fn pacer_for(text: &str) -> Result<(LinkPacer, String)> {
    if let Some((alpha, beta)) = text.split_once(':') {
        if let (Ok(alpha_us), Ok(beta_gbps)) = (alpha.trim().parse(), beta.trim().parse()) {
            let pacer = LinkPacer::from_alpha_beta(alpha_us, beta_gbps)
                .map_err(|e| WgparError::Config(format!("--pace {text}: {e}")))?;
            return Ok((
                pacer,
                format!("one link of {alpha_us} us + bytes / {beta_gbps} GB/s per message"),
            ));
        }
    }
    let profile = HostProfile::resolve(text).map_err(|e| WgparError::Config(e.to_string()))?;
    let pacer =
        LinkPacer::from_profile(&profile, 0).map_err(|e| WgparError::Config(e.to_string()))?;
    Ok((pacer, format!("the links of {}", profile.name)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use wgpar::sim::Direction;

    #[test]
    fn pace_takes_a_link_or_a_profile() {
        let (gbit, what) = pacer_for("50:0.125").unwrap();
        assert!(
            what.contains("50 us") && what.contains("0.125 GB/s"),
            "{what}"
        );
        // 1 MB over 1 Gb/s: 50 us + 8 ms.
        let t = gbit.model_us(Direction::DeviceToHost, 1_000_000);
        assert!((t - 8050.0).abs() < 1e-6, "{t}");
        let (_, what) = pacer_for("pcie3-2gpu").unwrap();
        assert!(what.contains("pcie3-2gpu"), "{what}");
        let e = pacer_for("50:-1").unwrap_err().to_string();
        assert!(e.contains("--pace 50:-1"), "{e}");
        assert!(pacer_for("no-such-profile").is_err());
    }
}
