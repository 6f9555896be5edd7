//! The comparison as a terminal table and as a Markdown report.

use std::fmt::Write;

use super::CompareReport;

fn pm(mean: f64, std: f64) -> String {
    format!("{mean:.1} ± {std:.1}")
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
    let _ = writeln!(s, "\nverdicts:");
    for v in &r.verdicts {
        let _ = writeln!(
            s,
            "- {}: lowest latency {} ({:.3} ms/token); highest throughput {} ({:.0} tokens/s)",
            v.profile, v.lowest_latency, v.latency_ms, v.highest_throughput, v.throughput_tps
        );
        for w in &v.why {
            let _ = writeln!(s, "    {w}");
        }
    }
    s
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
    for profile in &r.profile_names() {
        let _ = writeln!(s, "\n## Projected onto `{profile}`\n");
        let _ = writeln!(s, "| strategy | batch | TTFT ms | ms/token | pp tok/s | tg tok/s | comm % (prefill) | comm % (decode) | bubble % |");
        let _ = writeln!(s, "|---|---:|---:|---:|---:|---:|---:|---:|---:|");
        for m in &r.measurements {
            if let Some(p) = m.projected.iter().find(|p| &p.key() == profile) {
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
    let _ = writeln!(s, "\n## Verdicts\n");
    for v in &r.verdicts {
        let _ = writeln!(
            s,
            "**{}**: lowest latency {} ({:.3} ms/token); highest throughput {} ({:.0} tokens/s).\n",
            v.profile, v.lowest_latency, v.latency_ms, v.highest_throughput, v.throughput_tps
        );
        for w in &v.why {
            let _ = writeln!(s, "- {w}");
        }
        let _ = writeln!(s);
    }
    if !charts.is_empty() {
        let _ = writeln!(s, "## Charts\n");
        for (title, path) in charts {
            let _ = writeln!(s, "### {title}\n\n![{title}]({path})\n");
        }
    }
    s
}
