//! Which strategy wins on each host profile, and why, in numbers.

use serde::Serialize;

use super::{Measurement, Projected};
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
    /// The numbers behind the choice.
    pub why: Vec<String>,
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

fn decide(name: &str, points: &[Point]) -> Option<Verdict> {
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
    Some(Verdict {
        profile: name.into(),
        lowest_latency: format!("{} (batch {})", latency.m.label, latency.m.batch),
        latency_ms: latency.per_token_ms,
        highest_throughput: format!("{} (batch {})", throughput.m.label, throughput.m.batch),
        throughput_tps: throughput.tg_tps,
        why,
    })
}

/// Verdicts for the measured machine and for each (profile, engine) projection.
pub fn verdicts(measurements: &[Measurement], profiles: &[HostProfile]) -> Vec<Verdict> {
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
    out.extend(decide("this machine (measured)", &measured));
    let mut keys: Vec<(String, String)> = Vec::new();
    for profile in profiles {
        for m in measurements {
            for p in m.projected.iter().filter(|p| p.profile == profile.name) {
                let k = (p.key(), p.engine.clone());
                if !keys.contains(&k) {
                    keys.push(k);
                }
            }
        }
    }
    for (key, _) in keys {
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
        out.extend(decide(&key, &points));
    }
    out
}
