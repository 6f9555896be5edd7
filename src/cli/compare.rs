//! `wgpar compare`: single vs TP vs PP vs hybrid, measured here and projected onto host
//! profiles, with a table, verdicts, a Markdown report and SVG charts.

use std::path::PathBuf;

use clap::Args;
use indicatif::{ProgressBar, ProgressStyle};
use wgpar::batching::{Length, Rate};
use wgpar::compare::{run_compare, table, write_report, CompareChoice, ServeChoice};
use wgpar::Result;

use super::options::ModelArgs;

/// Options of `wgpar compare`.
#[derive(Args, Clone, Debug)]
pub struct CompareArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// Adapter indices to use (default: every distinct GPU, or virtual devices on one adapter).
    #[arg(long)]
    devices: Option<String>,
    /// Use N virtual devices on one adapter (the default, 4, when there is one GPU).
    #[arg(long = "virtual", value_name = "N", value_parser = wgpar::device::parse_virtual)]
    virtual_count: Option<usize>,
    #[command(flatten)]
    binding: super::options::ModelDeviceArgs,
    #[command(flatten)]
    memory: super::options::MemoryArgs,
    /// Batch sizes to sweep.
    #[arg(long, value_delimiter = ',', default_value = "1,4")]
    batches: Vec<usize>,
    /// Pipeline micro-batch counts to sweep.
    #[arg(long, value_delimiter = ',', default_value = "1,4")]
    micro_batches: Vec<usize>,
    /// Pipeline decode: in-flight, or gpipe (a fill-drain of all micro-batches per token).
    #[arg(long, default_value = "in-flight", value_parser = ["in-flight", "gpipe"])]
    schedule: String,
    /// Prompt length.
    #[arg(long, default_value_t = 32)]
    prompt_len: usize,
    /// Tokens generated per sequence.
    #[arg(long, default_value_t = 8)]
    gen: usize,
    /// Timed repetitions per configuration.
    #[arg(long, default_value_t = 3)]
    reps: usize,
    /// Serving section: requests every strategy serves with continuous batching (0: skip it).
    #[arg(long, default_value_t = 16)]
    serve_requests: usize,
    /// Serving section: arrival rate in requests/s, or inf (all at once: the heaviest load).
    #[arg(long, default_value = "inf")]
    serve_rate: Rate,
    /// Serving section: prompt tokens per request, N or MIN:MAX (default: --prompt-len).
    #[arg(long)]
    serve_prompt_len: Option<Length>,
    /// Serving section: tokens generated per request, N or MIN:MAX (default: --gen).
    #[arg(long)]
    serve_output_len: Option<Length>,
    /// Serving section: KV slots (sequences in the running batches at once).
    #[arg(long, default_value_t = 8)]
    serve_max_batch: usize,
    /// Host profiles to project onto (shipped names or TOML paths).
    #[arg(long, value_delimiter = ',', default_value = "pcie4-4gpu,dgx-h100")]
    profiles: Vec<String>,
    /// Engines each run is projected with on every profile: wgpar as it runs here, and others
    /// modeled on the same work (shipped names or TOML paths).
    #[arg(long, value_delimiter = ',', default_value = "wgpar,cuda-nccl")]
    engines: Vec<String>,
    /// Folder for the report and charts.
    #[arg(long, default_value = "wgpar-report")]
    out: PathBuf,
    /// Print JSON instead of the table.
    #[arg(long)]
    json: bool,
    /// Add a modeled section at realistic scale (Llama-3-8B on PCIe GPUs against a DGX H100,
    /// Llama-3-70B on two nodes), built by the same code as `wgpar plan`, on `--engines`.
    #[arg(long)]
    at_scale: bool,
}

impl CompareArgs {
    /// What `wgpar` with no arguments compares.
    pub fn default_job() -> Self {
        Self {
            model: ModelArgs {
                model: wgpar::model::hub::ModelRef::Preset("default".into()),
                dtype: "f32".into(),
                weights: None,
                seed: None,
                max_seq: None,
            },
            devices: None,
            virtual_count: None,
            binding: super::options::ModelDeviceArgs::default(),
            memory: super::options::MemoryArgs::default(),
            batches: vec![1, 4],
            micro_batches: vec![1, 4],
            schedule: "in-flight".into(),
            prompt_len: 32,
            gen: 8,
            reps: 3,
            serve_requests: 16,
            serve_rate: Rate::Burst,
            serve_prompt_len: None,
            serve_output_len: None,
            serve_max_batch: 8,
            profiles: vec!["pcie4-4gpu".into(), "dgx-h100".into()],
            engines: vec!["wgpar".into(), "cuda-nccl".into()],
            out: PathBuf::from("wgpar-report"),
            json: false,
            at_scale: true,
        }
    }
}

impl CompareArgs {
    /// The library's choice from the command line.
    fn choice(&self) -> CompareChoice<'_> {
        CompareChoice {
            model: self.model.choice(),
            devices: self.devices.as_deref(),
            virtual_count: self.virtual_count,
            binding: self.binding.choice(),
            gpu_memory: self.memory.gpu_memory.as_deref(),
            batches: &self.batches,
            micro_batches: &self.micro_batches,
            schedule: &self.schedule,
            prompt_len: self.prompt_len,
            gen: self.gen,
            reps: self.reps,
            serve: ServeChoice {
                requests: self.serve_requests,
                rate: self.serve_rate,
                prompt_len: self.serve_prompt_len,
                output_len: self.serve_output_len,
                max_batch: self.serve_max_batch,
            },
            profiles: &self.profiles,
            engines: &self.engines,
            at_scale: self.at_scale,
        }
    }
}

/// Runs the comparison and writes the report.
pub fn run(args: &CompareArgs) -> Result<()> {
    let plan = args.choice().plan()?;
    let opts = &plan.options;
    // The report goes there: a folder that cannot be written fails now, not after the runs.
    super::options::check_writable_dir(&args.out, &args.out)?;
    let gpus = plan.open()?;
    if !args.json {
        outln!(
            "comparing strategies for model '{}' on {} device(s): {}",
            opts.config.name,
            gpus.len(),
            gpus.iter()
                .map(|g| g.describe())
                .collect::<Vec<_>>()
                .join(", ")
        )?;
    }
    let bar = progress_bar(args.json);
    let report = run_compare(&gpus, opts, &mut |done, total, label| {
        bar.set_length(total as u64);
        bar.set_position(done as u64);
        bar.set_message(label.to_string());
    })?;
    bar.finish_and_clear();
    let files = write_report(&report, &args.out)?;
    if args.json {
        outln!("{}", files.json)?;
    } else {
        out!("{}", table(&report))?;
        outln!(
            "\nreport: {} (charts and JSON beside it)",
            files.markdown.display()
        )?;
    }
    Ok(())
}

/// A progress bar on the terminal, hidden when the output is JSON.
fn progress_bar(json: bool) -> ProgressBar {
    let bar = if json {
        ProgressBar::hidden()
    } else {
        ProgressBar::new(1)
    };
    bar.set_style(
        ProgressStyle::with_template("{bar:30} {pos}/{len} {msg} [{elapsed}]")
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    bar
}
