//! Which strategy wins on each host profile, and why, in numbers.

use serde::Serialize;

use super::{Measurement, Projected, ServingSection};
use crate::batching::ServeMetrics;
use crate::sim::HostProfile;

/// The answer for one host profile (or for this machine, measured).
#[derive(Debug, Clone, Serialize)]
pub struct Verdict {
    /// Profile name, or "this machine (measured)".
    pub profile: String,
    /// Strategy with the lowest per-token latency at the smallest batch.
    pub lowest_latency: String,
    /// Its per-token latency, ms.
    pub latency_ms: f64,
    /// Strategy with the highest generation throughput at any batch.
    pub highest_throughput: String,
    /// Its tokens/s.
    pub throughput_tps: f64,
    /// The best strategies under the serving section's stream of requests.
    pub under_load: Option<UnderLoad>,
    /// The numbers behind the choice.
    pub why: Vec<String>,
}

/// Which strategy served the comparison's stream of requests best on one machine.
#[derive(Debug, Clone, Serialize)]
pub struct UnderLoad {
    /// Highest output tokens/s.
    pub highest_throughput: String,
    /// Its output tokens/s.
    pub throughput_tps: f64,
    /// Lowest median time to first token.
    pub lowest_ttft: String,
    /// Its median TTFT, ms.
    pub ttft_ms: f64,
    /// Lowest median time per output token.
    pub lowest_tpot: String,
    /// Its median TPOT, ms.
    pub tpot_ms: f64,
}

fn explain_load(label: &str, m: &ServeMetrics, what: &str) -> String {
    format!(
        "{what}: {label} at {:.1} output tokens/s ({:.2} requests/s), TTFT p50 {:.2} ms, TPOT p50 {:.3} ms; bubble {}, communication {}",
        m.output_tokens_per_s,
        m.request_throughput,
        m.ttft_ms.p50,
        m.tpot_ms.p50,
        percent(m.bubble_share),
        percent(m.comm_share)
    )
}

/// A share as a whole percentage, `n/a` where it was not measured.
fn percent(v: Option<f64>) -> String {
    v.map_or_else(|| "n/a".into(), |v| format!("{:.0}%", v * 100.0))
}

/// The best under load among (label, figures) pairs, with the lines that explain it.
fn decide_load(points: &[(&str, &ServeMetrics)]) -> Option<(UnderLoad, Vec<String>)> {
    let fastest = points
        .iter()
        .max_by(|a, b| a.1.output_tokens_per_s.total_cmp(&b.1.output_tokens_per_s))?;
    let first = points
        .iter()
        .min_by(|a, b| a.1.ttft_ms.p50.total_cmp(&b.1.ttft_ms.p50))?;
    let steady = points
        .iter()
        .min_by(|a, b| a.1.tpot_ms.p50.total_cmp(&b.1.tpot_ms.p50))?;
    let why = vec![
        explain_load(fastest.0, fastest.1, "highest throughput under load"),
        explain_load(
            steady.0,
            steady.1,
            "lowest time per output token under load",
        ),
        explain_load(first.0, first.1, "lowest time to first token under load"),
    ];
    Some((
        UnderLoad {
            highest_throughput: fastest.0.to_string(),
            throughput_tps: fastest.1.output_tokens_per_s,
            lowest_ttft: first.0.to_string(),
            ttft_ms: first.1.ttft_ms.p50,
            lowest_tpot: steady.0.to_string(),
            tpot_ms: steady.1.tpot_ms.p50,
        },
        why,
    ))
}

struct Point<'a> {
    m: &'a Measurement,
    per_token_ms: f64,
    tg_tps: f64,
    comm_share: f64,
    bubble_share: f64,
}

fn explain(p: &Point, what: &str) -> String {
    format!(
        "{what}: {} (batch {}) at {:.2} ms/token, {:.0} tokens/s; all-reduce/hand-off share {:.0}%, bubble {:.0}%, {:.0} B moved per token per device",
        p.m.label,
        p.m.batch,
        p.per_token_ms,
        p.tg_tps,
        p.comm_share * 100.0,
        p.bubble_share * 100.0,
        p.m.bytes_per_token
    )
}

fn decide(name: &str, points: &[Point], load: &[(&str, &ServeMetrics)]) -> Option<Verdict> {
    let smallest = points.iter().map(|p| p.m.batch).min()?;
    let latency = points
        .iter()
        .filter(|p| p.m.batch == smallest)
        .min_by(|a, b| a.per_token_ms.total_cmp(&b.per_token_ms))?;
    let throughput = points.iter().max_by(|a, b| a.tg_tps.total_cmp(&b.tg_tps))?;
    let mut why = vec![
        explain(latency, "lowest latency"),
        explain(throughput, "highest throughput"),
    ];
    // The strongest rival of each family, so the reader sees what the winner beat.
    for family in ["single", "tp", "pp", "hybrid"] {
        if let Some(best) = points
            .iter()
            .filter(|p| p.m.family == family && p.m.batch == smallest)
            .min_by(|a, b| a.per_token_ms.total_cmp(&b.per_token_ms))
        {
            if best.m.label != latency.m.label {
                why.push(explain(best, &format!("best {family} at batch {smallest}")));
            }
        }
    }
    let under_load = decide_load(load).map(|(u, lines)| {
        why.extend(lines);
        u
    });
    Some(Verdict {
        profile: name.into(),
        lowest_latency: format!("{} (batch {})", latency.m.label, latency.m.batch),
        latency_ms: latency.per_token_ms,
        highest_throughput: format!("{} (batch {})", throughput.m.label, throughput.m.batch),
        throughput_tps: throughput.tg_tps,
        under_load,
        why,
    })
}

/// Verdicts for the measured machine and for each (profile, engine) projection, from the
/// static batches and, when there is one, the serving section (measured here, and projected
/// as wgpar runs it onto each profile).
pub fn verdicts(
    measurements: &[Measurement],
    serving: Option<&ServingSection>,
    profiles: &[HostProfile],
) -> Vec<Verdict> {
    let served = serving.map_or(&[][..], |s| &s.measurements[..]);
    let mut out = Vec::new();
    let measured: Vec<Point> = measurements
        .iter()
        .map(|m| Point {
            m,
            per_token_ms: m.per_token_ms.mean,
            tg_tps: m.tg_tps.mean,
            comm_share: m.comm_share,
            bubble_share: m.bubble_share,
        })
        .collect();
    let load: Vec<(&str, &ServeMetrics)> = served
        .iter()
        .map(|m| (m.label.as_str(), &m.metrics))
        .collect();
    out.extend(decide("this machine (measured)", &measured, &load));
    let mut keys: Vec<(String, String, String)> = Vec::new();
    for profile in profiles {
        for m in measurements {
            for p in m.projected.iter().filter(|p| p.profile == profile.name) {
                let k = (p.key(), p.profile.clone(), p.engine.clone());
                if !keys.contains(&k) {
                    keys.push(k);
                }
            }
        }
    }
    for (key, profile, engine) in keys {
        let points: Vec<Point> = measurements
            .iter()
            .filter_map(|m| {
                let p: &Projected = m.projected.iter().find(|p| p.key() == key)?;
                Some(Point {
                    m,
                    per_token_ms: p.per_token_ms,
                    tg_tps: p.tg_tps,
                    comm_share: p.comm_share,
                    bubble_share: p.bubble_share,
                })
            })
            .collect();
        // The serving stream is projected as wgpar runs it; other engines have no serving run.
        let load: Vec<(&str, &ServeMetrics)> = if engine == "wgpar" {
            served
                .iter()
                .filter_map(|m| {
                    let p = m.projected.iter().find(|p| p.profile == profile)?;
                    Some((m.label.as_str(), &p.metrics))
                })
                .collect()
        } else {
            Vec::new()
        };
        out.extend(decide(&key, &points, &load));
    }
    out
}

/// The verdicts as one line per question (lowest latency, highest throughput and, where a
/// stream was served, the three under-load questions), each naming every machine's winner
/// with the figure it won with.
pub fn question_lines(verdicts: &[Verdict]) -> Vec<String> {
    let line = |question: &str, answer: &dyn Fn(&Verdict) -> Option<String>| {
        let parts: Vec<String> = verdicts
            .iter()
            .filter_map(|v| answer(v).map(|a| format!("{}: {a}", v.profile)))
            .collect();
        (!parts.is_empty()).then(|| format!("{question}: {}", parts.join("; ")))
    };
    let load = |v: &Verdict| v.under_load.clone();
    [
        line("lowest latency", &|v| {
            Some(format!("{} {:.3} ms/token", v.lowest_latency, v.latency_ms))
        }),
        line("highest throughput", &|v| {
            Some(format!(
                "{} {:.0} tokens/s",
                v.highest_throughput, v.throughput_tps
            ))
        }),
        line("under a request stream, most output tokens/s", &|v| {
            load(v).map(|u| format!("{} {:.1}", u.highest_throughput, u.throughput_tps))
        }),
        line("under a request stream, lowest TTFT p50", &|v| {
            load(v).map(|u| format!("{} {:.2} ms", u.lowest_ttft, u.ttft_ms))
        }),
        line("under a request stream, lowest TPOT p50", &|v| {
            load(v).map(|u| format!("{} {:.3} ms", u.lowest_tpot, u.tpot_ms))
        }),
    ]
    .into_iter()
    .flatten()
    .collect()
}
