//! The report's modeled section at the scale people split models at: Llama-3-8B on four PCIe
//! GPUs against a DGX H100, and Llama-3-70B on two nodes (TP inside a node, PP across them)
//! against TP or PP alone, on nodes of PCIe GPUs and on DGX H100 nodes with NVLink inside. The
//! pipeline rows use the micro-batch count the model finds best for each batch. Built by
//! [`plan`](super::plan::plan), the code behind `wgpar plan`, so the report and the planner
//! cannot disagree.

use serde::Serialize;

use super::plan::{plan, plan_model, PlanOptions, PlanRow, PlanStrategy};
use crate::error::Result;
use crate::sim::{Engine, HostProfile, NumFormat};

/// Prompt tokens of every modeled request.
pub const PROMPT: usize = 512;
/// Decode steps modeled after the prompt.
pub const DECODE_STEPS: usize = 128;
/// The batch sizes: one request alone, and a batch as a server holds under a stream.
pub const BATCHES: [usize; 2] = [1, 32];

/// One question the section answers, and the configurations that answer it.
struct Case {
    question: &'static str,
    model: &'static str,
    profiles: &'static [&'static str],
    strategies: &'static [&'static str],
    /// For a two-node case, the tensor-parallel strategy that spans both nodes: the rule "TP
    /// inside a node, PP across" is judged against it.
    across_nodes: Option<&'static str>,
}

const CASES: [Case; 3] = [
    Case {
        question: "Llama-3-8B on four PCIe GPUs or on a DGX H100: does splitting pay?",
        model: "llama-8b",
        profiles: &["pcie4-4gpu", "dgx-h100"],
        strategies: &["single", "tp2", "tp4", "pp4", "pp4-m4"],
        across_nodes: None,
    },
    Case {
        question: "Llama-3-70B on two nodes of PCIe GPUs over InfiniBand: TP inside a node, PP \
                   across, or one alone?",
        model: "llama3-70b",
        profiles: &["2node-ib200"],
        strategies: &["tp8", "pp8-mbest", "tp4xpp2-mbest"],
        across_nodes: Some("tp8"),
    },
    Case {
        question: "Llama-3-70B on two DGX H100 nodes (NVLink inside, InfiniBand between): TP \
                   inside a node, PP across, or one alone?",
        model: "llama3-70b",
        profiles: &["2node-dgx-h100"],
        strategies: &["tp8", "tp16", "pp16-mbest", "tp8xpp2-mbest"],
        across_nodes: Some("tp16"),
    },
];

/// One question's modeled rows and its answers.
#[derive(Debug, Clone, Serialize)]
pub struct ScaleCase {
    /// The question.
    pub question: String,
    /// Model name.
    pub model: String,
    /// Parameters, billions.
    pub params_b: f64,
    /// Every (profile, engine, strategy, batch).
    pub rows: Vec<PlanRow>,
    /// One line per question asked of the rows (latency alone, throughput in a batch).
    pub answers: Vec<String>,
}

/// The section: f16 weights, `PROMPT` tokens in, `DECODE_STEPS` out, at `BATCHES`.
#[derive(Debug, Clone, Serialize)]
pub struct ScaleSection {
    /// Prompt tokens.
    pub prompt: usize,
    /// Decode steps.
    pub decode_steps: usize,
    /// The questions.
    pub cases: Vec<ScaleCase>,
}

/// Models every case on every engine in `engines`.
pub fn modeled_at_scale(engines: &[Engine]) -> Result<ScaleSection> {
    let cases = CASES
        .iter()
        .map(|case| model_case(case, engines))
        .collect::<Result<Vec<_>>>()?;
    Ok(ScaleSection {
        prompt: PROMPT,
        decode_steps: DECODE_STEPS,
        cases,
    })
}

fn model_case(case: &Case, engines: &[Engine]) -> Result<ScaleCase> {
    let config = plan_model(case.model)?;
    let opts = PlanOptions {
        config: config.clone(),
        weights: NumFormat::F16,
        file_format: None,
        strategies: case
            .strategies
            .iter()
            .map(|s| PlanStrategy::parse(s))
            .collect::<Result<_>>()?,
        batches: BATCHES.to_vec(),
        seqs: vec![PROMPT],
        profiles: case
            .profiles
            .iter()
            .map(|p| HostProfile::shipped(p).map_err(Into::into))
            .collect::<Result<_>>()?,
        engines: engines.to_vec(),
        decode_steps: DECODE_STEPS,
    };
    let rows = plan(&opts)?;
    let mut answers = answers(&rows);
    if let Some(tp) = case.across_nodes {
        answers.extend(rule_verdicts(&rows, tp));
    }
    Ok(ScaleCase {
        question: case.question.into(),
        model: config.name.clone(),
        params_b: config.params() as f64 / 1e9,
        rows,
        answers,
    })
}

/// Two lines: the fastest single request, and the most tokens/s in a full batch, each with
/// its winner on every (profile, engine) and the figure it won with.
fn answers(rows: &[PlanRow]) -> Vec<String> {
    let (alone, full) = (BATCHES[0], BATCHES[BATCHES.len() - 1]);
    let latency = winners(
        rows,
        alone,
        |r| r.decode_ms.map(|ms| -ms),
        |r| format!("{:.2} ms/token", r.decode_ms.unwrap_or(f64::NAN)),
    );
    let throughput = winners(
        rows,
        full,
        |r| r.decode_tps,
        |r| format!("{:.0} tokens/s", r.decode_tps.unwrap_or(f64::NAN)),
    );
    vec![
        format!("lowest latency, one request: {latency}"),
        format!("highest throughput, batch {full}: {throughput}"),
    ]
}

/// For each (profile, engine): does "TP inside a node, PP across nodes" beat tensor parallelism
/// over both nodes (`across`) in a full batch? The hybrid row is the best of its micro-batch
/// counts (the `-mbest` strategies), so the verdict does not hang on a fixed count.
fn rule_verdicts(rows: &[PlanRow], across: &str) -> Vec<String> {
    let full = BATCHES[BATCHES.len() - 1];
    let mut out = Vec::new();
    for r in rows
        .iter()
        .filter(|r| r.batch == full && r.strategy == across)
    {
        let same = |x: &&PlanRow| x.profile == r.profile && x.engine == r.engine && x.batch == full;
        let hybrid = rows
            .iter()
            .filter(same)
            .filter(|x| x.strategy.starts_with("tp") && x.strategy.contains("xpp"));
        let Some(h) = hybrid.min_by(|a, b| step(a).total_cmp(&step(b))) else {
            continue;
        };
        let holds = if step(h) < step(r) {
            "holds"
        } else {
            "does not hold"
        };
        let ms = |x: &PlanRow| match x.decode_ms {
            Some(ms) if x.fits => format!("{ms:.1} ms/step"),
            _ => "does not fit".into(),
        };
        out.push(format!(
            "TP inside a node, PP across, batch {full}: {}, {}: {holds} ({} {} against {} {})",
            r.profile,
            r.engine,
            h.strategy,
            ms(h),
            r.strategy,
            ms(r)
        ));
    }
    out
}

/// A row's decode step for comparing, rows that do not fit last.
fn step(r: &PlanRow) -> f64 {
    match r.decode_ms {
        Some(ms) if r.fits => ms,
        _ => f64::INFINITY,
    }
}

/// `profile, engine: strategy (figure)` for each (profile, engine) in first-seen order: the
/// row that fits and scores highest at `batch`.
fn winners(
    rows: &[PlanRow],
    batch: usize,
    score: impl Fn(&PlanRow) -> Option<f64>,
    figure: impl Fn(&PlanRow) -> String,
) -> String {
    let mut machines: Vec<(&str, &str)> = Vec::new();
    for r in rows {
        if !machines.contains(&(r.profile.as_str(), r.engine.as_str())) {
            machines.push((r.profile.as_str(), r.engine.as_str()));
        }
    }
    let parts: Vec<String> = machines
        .iter()
        .map(|&(profile, engine)| {
            let best = rows
                .iter()
                .filter(|r| r.profile == profile && r.engine == engine && r.batch == batch)
                .filter(|r| r.fits)
                .filter_map(|r| score(r).map(|s| (s, r)))
                .max_by(|a, b| a.0.total_cmp(&b.0));
            match best {
                Some((_, r)) => format!("{profile}, {engine}: {} ({})", r.strategy, figure(r)),
                None => format!("{profile}, {engine}: nothing fits"),
            }
        })
        .collect();
    parts.join("; ")
}
