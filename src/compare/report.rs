//! The comparison as a terminal table and as a Markdown report.

use std::fmt::Write;

use super::{question_lines, CompareReport, ScaleSection, ServingSection};

fn pm(mean: f64, std: f64) -> String {
    format!("{mean:.1} ± {std:.1}")
}

/// What the serving section ran, in one line.
fn stream_line(s: &ServingSection) -> String {
    let o = &s.options;
    format!(
        "{} requests at {} (continuous batching, {} KV slots; pipelines keep one lane per stage in flight), prompt {} tokens, output {} tokens",
        o.requests, o.rate, o.max_batch, o.prompt_len, o.output_len
    )
}

fn of_ideal(p: &Option<crate::parallel::PipelineStats>) -> String {
    match p {
        Some(p) if p.ideal_makespan_s > 0.0 => {
            format!("{:.0}%", p.tokens_per_s() / p.ideal_tokens_per_s() * 100.0)
        }
        _ => "-".into(),
    }
}

/// The profiles the serving runs were projected onto, in first-seen order.
fn projected_profiles(s: &ServingSection) -> Vec<&str> {
    let mut profiles: Vec<&str> = Vec::new();
    for p in s.measurements.iter().flat_map(|m| &m.projected) {
        if !profiles.contains(&p.profile.as_str()) {
            profiles.push(&p.profile);
        }
    }
    profiles
}

/// The serving section as terminal text.
fn serving_table(s: &ServingSection, out: &mut String) {
    let _ = writeln!(
        out,
        "
serving under load: {}",
        stream_line(s)
    );
    let _ = writeln!(
        out,
        "{:<16} {:>5} {:>7} {:>10} {:>10} {:>10} {:>10} {:>10} {:>10} {:>6} {:>6} {:>8}",
        "strategy",
        "lanes",
        "req/s",
        "out tok/s",
        "TTFT p50",
        "TTFT p99",
        "TPOT p50",
        "TPOT p99",
        "E2E p50",
        "bubb%",
        "comm%",
        "of ideal"
    );
    for m in &s.measurements {
        let x = &m.metrics;
        let _ = writeln!(
            out,
            "{:<16} {:>5} {:>7.2} {:>10.1} {:>10.1} {:>10.1} {:>10.2} {:>10.2} {:>10.1} {:>6} {:>6} {:>8}",
            m.label,
            m.lanes,
            x.request_throughput,
            x.output_tokens_per_s,
            x.ttft_ms.p50,
            x.ttft_ms.p99,
            x.tpot_ms.p50,
            x.tpot_ms.p99,
            x.e2e_ms.p50,
            share_pct(x.bubble_share),
            share_pct(x.comm_share),
            of_ideal(&m.pipeline)
        );
    }
    for profile in projected_profiles(s) {
        let _ = writeln!(
            out,
            "
serving under load, projected onto {profile} (ms):"
        );
        let _ = writeln!(
            out,
            "{:<16} {:>9} {:>11} {:>10} {:>10} {:>10} {:>6} {:>6}",
            "strategy", "req/s", "out tok/s", "TTFT p50", "TPOT p50", "E2E p50", "bubb%", "comm%"
        );
        for m in &s.measurements {
            if let Some(p) = m.projected.iter().find(|p| p.profile == profile) {
                let x = &p.metrics;
                let _ = writeln!(
                    out,
                    "{:<16} {:>9.1} {:>11.0} {:>10.3} {:>10.4} {:>10.3} {:>6} {:>6}",
                    m.label,
                    x.request_throughput,
                    x.output_tokens_per_s,
                    x.ttft_ms.p50,
                    x.tpot_ms.p50,
                    x.e2e_ms.p50,
                    share_pct(x.bubble_share),
                    share_pct(x.comm_share)
                );
            }
        }
    }
}

/// The serving section as Markdown.
fn serving_markdown(s: &ServingSection, out: &mut String) {
    let _ = writeln!(
        out,
        "
## Serving under load

{}.
",
        stream_line(s)
    );
    let _ = writeln!(
        out,
        "Measured on this machine:
"
    );
    let _ = writeln!(out, "| strategy | lanes | req/s | output tok/s | TTFT p50 ms | TTFT p99 ms | TPOT p50 ms | TPOT p99 ms | E2E p50 ms | bubble % | comm % | of ideal |");
    let _ = writeln!(
        out,
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
    );
    for m in &s.measurements {
        let x = &m.metrics;
        let _ = writeln!(
            out,
            "| {} | {} | {:.2} | {:.1} | {:.1} | {:.1} | {:.2} | {:.2} | {:.1} | {} | {} | {} |",
            m.label,
            m.lanes,
            x.request_throughput,
            x.output_tokens_per_s,
            x.ttft_ms.p50,
            x.ttft_ms.p99,
            x.tpot_ms.p50,
            x.tpot_ms.p99,
            x.e2e_ms.p50,
            share_pct(x.bubble_share),
            share_pct(x.comm_share),
            of_ideal(&m.pipeline)
        );
    }
    for profile in projected_profiles(s) {
        let _ = writeln!(
            out,
            "
Projected onto `{profile}` (the same run replayed, requests released at their arrivals):
"
        );
        let _ = writeln!(out, "| strategy | req/s | output tok/s | TTFT p50 ms | TPOT p50 ms | E2E p50 ms | bubble % | comm % |");
        let _ = writeln!(out, "|---|---:|---:|---:|---:|---:|---:|---:|");
        for m in &s.measurements {
            if let Some(p) = m.projected.iter().find(|p| p.profile == profile) {
                let x = &p.metrics;
                let _ = writeln!(
                    out,
                    "| {} | {:.1} | {:.0} | {:.3} | {:.4} | {:.3} | {} | {} |",
                    m.label,
                    x.request_throughput,
                    x.output_tokens_per_s,
                    x.ttft_ms.p50,
                    x.tpot_ms.p50,
                    x.e2e_ms.p50,
                    share_pct(x.bubble_share),
                    share_pct(x.comm_share)
                );
            }
        }
    }
}

fn under_load_line(v: &super::Verdict) -> Option<String> {
    let u = v.under_load.as_ref()?;
    Some(format!(
        "under load: highest throughput {} ({:.1} output tokens/s); lowest TPOT {} ({:.3} ms); lowest TTFT {} ({:.2} ms)",
        u.highest_throughput, u.throughput_tps, u.lowest_tpot, u.tpot_ms, u.lowest_ttft, u.ttft_ms
    ))
}

/// A terminal table of the measured figures, then the projections and the verdicts.
pub fn table(r: &CompareReport) -> String {
    let mut s = String::new();
    let _ = writeln!(
        s,
        "{:<16} {:>5} {:>18} {:>18} {:>16} {:>16} {:>6} {:>6} {:>9} {:>8}",
        "strategy",
        "batch",
        "pp tok/s",
        "tg tok/s",
        "ttft ms",
        "ms/token",
        "comm%",
        "bubb%",
        "B/token",
        "rel err"
    );
    for m in &r.measurements {
        let _ = writeln!(
            s,
            "{:<16} {:>5} {:>18} {:>18} {:>16} {:>16} {:>6.1} {:>6.1} {:>9.0} {:>8.1e}",
            m.label,
            m.batch,
            pm(m.pp_tps.mean, m.pp_tps.std),
            pm(m.tg_tps.mean, m.tg_tps.std),
            pm(m.ttft_ms.mean, m.ttft_ms.std),
            pm(m.per_token_ms.mean, m.per_token_ms.std),
            m.comm_share * 100.0,
            m.bubble_share * 100.0,
            m.bytes_per_token,
            m.max_rel_err
        );
    }
    for profile in r.profile_names() {
        let _ = writeln!(s, "\nprojected onto {profile}:");
        let _ = writeln!(
            s,
            "{:<16} {:>5} {:>10} {:>10} {:>12} {:>10} {:>6} {:>6}",
            "strategy", "batch", "ttft ms", "ms/token", "pp tok/s", "tg tok/s", "comm%", "bubb%"
        );
        for m in &r.measurements {
            if let Some(p) = m.projected.iter().find(|p| p.key() == profile) {
                let _ = writeln!(
                    s,
                    "{:<16} {:>5} {:>10.3} {:>10.4} {:>12.0} {:>10.0} {:>6.1} {:>6.1}",
                    m.label,
                    m.batch,
                    p.ttft_ms,
                    p.per_token_ms,
                    p.pp_tps,
                    p.tg_tps,
                    p.comm_share * 100.0,
                    p.bubble_share * 100.0
                );
            }
        }
    }
    if let Some(serving) = &r.serving {
        serving_table(serving, &mut s);
    }
    if let Some(scale) = &r.scale {
        scale_table(scale, &mut s);
    }
    let _ = writeln!(
        s,
        "\nverdicts (one line per question, each machine's winner; the numbers behind them in report.md):"
    );
    for line in question_lines(&r.verdicts) {
        let _ = writeln!(s, "- {line}");
    }
    s
}

fn opt(v: Option<f64>, decimals: usize) -> String {
    v.map_or_else(|| "-".into(), |x| format!("{x:.decimals$}"))
}

fn pct(v: Option<f64>) -> String {
    v.map_or_else(|| "-".into(), |x| format!("{:.0}", x * 100.0))
}

/// A modeled row's cells: profile, engine, strategy, batch, TTFT, ms/token, tokens/s and the
/// communication and bubble percentages ("-" where it does not fit).
fn scale_cells(r: &super::PlanRow) -> [String; 9] {
    [
        r.profile.clone(),
        r.engine.clone(),
        r.strategy.clone(),
        r.batch.to_string(),
        opt(r.prefill_ms, 1),
        opt(r.decode_ms, 2),
        opt(r.decode_tps, 0),
        pct(r.decode_comm),
        pct(r.decode_bubble),
    ]
}

fn scale_table(scale: &ScaleSection, s: &mut String) {
    let _ = writeln!(
        s,
        "\nmodeled at scale (f16 weights, prompt {} tokens, {} decode steps; as `wgpar plan` models them):",
        scale.prompt, scale.decode_steps
    );
    for case in &scale.cases {
        let _ = writeln!(
            s,
            "\n{} ({}, {:.1}B parameters)",
            case.question, case.model, case.params_b
        );
        let _ = writeln!(
            s,
            "{:<12} {:<12} {:<12} {:>5} {:>10} {:>10} {:>10} {:>6} {:>6}",
            "profile",
            "engine",
            "strategy",
            "batch",
            "TTFT ms",
            "ms/token",
            "tok/s",
            "comm%",
            "bubb%"
        );
        for r in &case.rows {
            let [profile, engine, strategy, batch, ttft, ms, tps, comm, bubble] = scale_cells(r);
            let _ = writeln!(
                s,
                "{profile:<12} {engine:<12} {strategy:<12} {batch:>5} {ttft:>10} {ms:>10} {tps:>10} {comm:>6} {bubble:>6}{}",
                if r.fits { "" } else { "  does not fit" }
            );
        }
        for a in &case.answers {
            let _ = writeln!(s, "  {a}");
        }
    }
}

fn scale_markdown(scale: &ScaleSection, s: &mut String) {
    let _ = writeln!(s, "\n## Modeled at scale\n");
    let _ = writeln!(
        s,
        "The models people split, on machines people split them over: f16 weights, a prompt of {} tokens, {} decode steps, modeled by the same code as `wgpar plan` (wgpar's host-staged path and CUDA + NCCL on the same work).\n",
        scale.prompt, scale.decode_steps
    );
    for case in &scale.cases {
        let _ = writeln!(s, "### {}\n", case.question);
        let _ = writeln!(s, "{}, {:.1}B parameters.\n", case.model, case.params_b);
        for a in &case.answers {
            let _ = writeln!(s, "- {}{}", a[..1].to_uppercase(), &a[1..]);
        }
        let _ = writeln!(s, "\n| profile | engine | strategy | batch | TTFT ms | ms/token | tokens/s | comm % | bubble % | fits |");
        let _ = writeln!(s, "|---|---|---|---:|---:|---:|---:|---:|---:|---|");
        for r in &case.rows {
            let cells = scale_cells(r).join(" | ");
            let fits = if r.fits { "yes" } else { "no" };
            let _ = writeln!(s, "| {cells} | {fits} |");
        }
        let _ = writeln!(s);
    }
}

/// A Markdown report; `charts` are (title, relative path) pairs of images written beside it.
pub fn markdown(r: &CompareReport, charts: &[(String, String)]) -> String {
    let mut s = String::new();
    let c = &r.model;
    let _ = writeln!(s, "# wgpar compare: {}\n", c.name);
    let _ = writeln!(
        s,
        "Model {} ({:?}, {} layers, hidden {}, {} heads / {} KV heads, {:.1}M parameters); prompt {} tokens, {} generated, {} repetitions (mean ± stddev).\n",
        c.name, c.arch, c.layers, c.hidden, c.heads, c.kv_heads, c.params() as f64 / 1e6, r.prompt_len, r.gen, r.reps
    );
    let _ = writeln!(s, "Devices:\n");
    for d in &r.devices {
        let _ = writeln!(s, "- {d}");
    }
    let _ = writeln!(s, "\nEvery strategy's prefill logits and generated tokens were checked against the single-device run first.\n");
    measured_markdown(r, &mut s);
    for profile in &r.profile_names() {
        projected_markdown(r, profile, &mut s);
    }
    if let Some(serving) = &r.serving {
        serving_markdown(serving, &mut s);
    }
    if let Some(scale) = &r.scale {
        scale_markdown(scale, &mut s);
    }
    verdicts_markdown(r, &mut s);
    if !charts.is_empty() {
        let _ = writeln!(s, "## Charts\n");
        for (title, path) in charts {
            let _ = writeln!(s, "### {title}\n\n![{title}]({path})\n");
        }
    }
    s
}

/// The measured table of the Markdown report.
fn measured_markdown(r: &CompareReport, s: &mut String) {
    let _ = writeln!(s, "## Measured on this machine\n");
    let _ = writeln!(s, "| strategy | batch | pp tok/s | tg tok/s | TTFT ms | ms/token | comm % | bubble % | B/token | rel. err |");
    let _ = writeln!(s, "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
    for m in &r.measurements {
        let _ = writeln!(
            s,
            "| {} | {} | {} | {} | {} | {} | {:.1} | {:.1} | {:.0} | {:.1e} |",
            m.label,
            m.batch,
            pm(m.pp_tps.mean, m.pp_tps.std),
            pm(m.tg_tps.mean, m.tg_tps.std),
            pm(m.ttft_ms.mean, m.ttft_ms.std),
            pm(m.per_token_ms.mean, m.per_token_ms.std),
            m.comm_share * 100.0,
            m.bubble_share * 100.0,
            m.bytes_per_token,
            m.max_rel_err
        );
    }
}

/// The Markdown table of one projection (see [`super::Projected::key`]), with a line under
/// each configuration that does not fit.
fn projected_markdown(r: &CompareReport, profile: &str, s: &mut String) {
    let _ = writeln!(s, "\n## Projected onto `{profile}`\n");
    let _ = writeln!(s, "| strategy | batch | TTFT ms | ms/token | pp tok/s | tg tok/s | comm % (prefill) | comm % (decode) | bubble % |");
    let _ = writeln!(s, "|---|---:|---:|---:|---:|---:|---:|---:|---:|");
    for m in &r.measurements {
        if let Some(p) = m.projected.iter().find(|p| p.key() == profile) {
            let _ = writeln!(
                s,
                "| {} | {} | {:.3} | {:.4} | {:.0} | {:.0} | {:.1} | {:.1} | {:.1} |",
                m.label,
                m.batch,
                p.ttft_ms,
                p.per_token_ms,
                p.pp_tps,
                p.tg_tps,
                p.prefill_comm_share * 100.0,
                p.comm_share * 100.0,
                p.bubble_share * 100.0
            );
            if !p.fits {
                let _ = writeln!(
                    s,
                    "| ↳ {} does not fit: {:.2} of {:.2} GiB on the fullest device | | | | | | | | |",
                    m.label,
                    p.memory.0 as f64 / (1u64 << 30) as f64,
                    p.memory.1 as f64 / (1u64 << 30) as f64
                );
            }
        }
    }
}

/// The verdicts of the Markdown report, then the numbers behind them per profile.
fn verdicts_markdown(r: &CompareReport, s: &mut String) {
    let _ = writeln!(s, "\n## Verdicts\n");
    for line in question_lines(&r.verdicts) {
        let _ = writeln!(s, "- {}{}", line[..1].to_uppercase(), &line[1..]);
    }
    let _ = writeln!(s, "\n### The numbers behind them\n");
    for v in &r.verdicts {
        let _ = writeln!(
            s,
            "**{}**: lowest latency {} ({:.3} ms/token); highest throughput {} ({:.0} tokens/s).\n",
            v.profile, v.lowest_latency, v.latency_ms, v.highest_throughput, v.throughput_tps
        );
        if let Some(line) = under_load_line(v) {
            let _ = writeln!(s, "{}.\n", line[..1].to_uppercase() + &line[1..]);
        }
        for w in &v.why {
            let _ = writeln!(s, "- {w}");
        }
        let _ = writeln!(s);
    }
}

/// A serving run's device-time share as a percentage, `n/a` where it was not measured.
fn share_pct(v: Option<f64>) -> String {
    v.map_or_else(|| "n/a".into(), |v| format!("{:.1}", v * 100.0))
}
