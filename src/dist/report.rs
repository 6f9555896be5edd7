//! What rank 0 of a job says: the rates of a run over the ranks, the pipeline over every
//! rank's stages, and every rank's adapters. Plain text built from gathered figures, so it
//! is here in builds without MPI too (and tested there).

use std::fmt::Write as _;

use crate::error::{human_bytes, Result, WgparError};
use crate::parallel::timed::Timed;
use crate::parallel::PipelineStats;

/// A run's prefill and decode rates over the ranks of `batch` sequences, the first
/// sequence's tokens and the recorded phase's time.
pub fn render_rank_run(done: &Timed, batch: usize) -> String {
    let g = &done.generation;
    let mut s = format!(
        "prefill: {} tokens in {:.1} ms = {:.1} tokens/s\n",
        g.prompt_tokens,
        g.prefill_s * 1e3,
        g.prefill_tokens_per_s()
    );
    if let Some(st) = &done.prefill.step {
        let _ = writeln!(s, "  {}", st.per_token_line());
    }
    if g.decode_steps == 0 {
        // `--gen 1`: the prefill gave the only token, and no step was timed.
        let _ = writeln!(
            s,
            "decode: 0 steps x {batch} sequences, n/a ms per step, n/a tokens/s"
        );
    } else {
        let per_step_ms = g.decode_s / g.decode_steps as f64 * 1e3;
        let _ = writeln!(
            s,
            "decode: {} steps x {batch} sequences, {per_step_ms:.2} ms per step = {:.1} tokens/s",
            g.decode_steps,
            g.decode_tokens_per_s()
        );
    }
    if let Some(st) = &done.decode {
        let _ = writeln!(s, "  {}", st.per_token_line());
    }
    let _ = writeln!(s, "first sequence's tokens: {:?}", g.tokens[0]);
    let _ = writeln!(s, "recorded phase: {:.1} ms", done.wall_s * 1e3);
    s
}

/// The pipeline over every rank's stages: rate, makespan against the ideal from the measured
/// stage times, the bubble, then one line per stage.
pub fn render_pipeline_over_ranks(combined: &PipelineStats) -> String {
    let mut s = format!(
        "pipeline over ranks (last run, {} passes per stage, {} lanes, {}): {:.1} tokens/s, makespan {:.1} ms; ideal from the measured stage times {:.1} ms: {:.0} % of ideal throughput; bubble {:.0} % measured vs {:.0} % for a perfect pipeline\n",
        combined.passes,
        combined.microbatches,
        combined.schedule,
        combined.tokens_per_s(),
        combined.makespan_s * 1e3,
        combined.ideal_makespan_s * 1e3,
        combined.ideal_makespan_s / combined.makespan_s * 100.0,
        combined.measured_bubble * 100.0,
        combined.theoretical_bubble * 100.0
    );
    for (i, st) in combined.stages.iter().enumerate() {
        let _ = writeln!(
            s,
            "  stage {i}: layers {}..{} on {}: busy {:.1} ms, hand-off {:.1} ms, {} micro-batches",
            st.layers.start,
            st.layers.end,
            st.device,
            st.busy_s * 1e3,
            st.handoff_s() * 1e3,
            st.microbatches
        );
    }
    s
}

/// Every rank's adapters from the JSON lists the ranks gathered (`gathered[r]` from the rank
/// on `hosts[r]`): one JSON array of `{rank, host, adapters}`, or a table per rank.
pub fn render_rank_adapters(hosts: &[String], gathered: &[String], json: bool) -> Result<String> {
    let parsed: Vec<serde_json::Value> = (gathered.iter())
        .map(|t| serde_json::from_str(t).unwrap_or(serde_json::Value::Null))
        .collect();
    if json {
        let out: Vec<serde_json::Value> = (parsed.into_iter().enumerate())
            .map(|(r, a)| serde_json::json!({ "rank": r, "host": hosts[r], "adapters": a }))
            .collect();
        let text = serde_json::to_string_pretty(&out).map_err(|source| WgparError::Json {
            what: "the ranks' adapters".into(),
            source,
        })?;
        return Ok(text + "\n");
    }
    let mut s = String::new();
    for (r, list) in parsed.iter().enumerate() {
        let _ = writeln!(s, "rank {r} on {}:", hosts[r]);
        let _ = writeln!(
            s,
            "  {:>3}  {:<40} {:<7} {:<13} {:>10} {:>12}",
            "idx", "name", "backend", "type", "max buffer", "max storage"
        );
        for d in list.as_array().into_iter().flatten() {
            let text = |k: &str| d[k].as_str().unwrap_or("").to_string();
            let n = |k: &str| d[k].as_u64().unwrap_or(0);
            let name: String = text("name").chars().take(40).collect();
            let _ = writeln!(
                s,
                "  {:>3}  {:<40} {:<7} {:<13} {:>10} {:>12}",
                n("index"),
                name,
                text("backend"),
                text("device_type"),
                human_bytes(n("max_buffer_size")),
                human_bytes(n("max_storage_binding"))
            );
            let _ = writeln!(
                s,
                "       driver: {} {}",
                text("driver"),
                text("driver_info")
            );
        }
    }
    Ok(s)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_rank_adapters_are_listed_under_its_host() {
        let hosts = vec!["a".to_string(), "b".to_string()];
        let one = r#"[{"index":0,"name":"llvmpipe","backend":"vulkan","device_type":"Cpu",
            "max_buffer_size":1073741824,"max_storage_binding":134217728,"driver":"llvmpipe",
            "driver_info":"Mesa"}]"#;
        let text = render_rank_adapters(&hosts, &[one.into(), "[]".into()], false).unwrap();
        assert!(
            text.contains("rank 0 on a:") && text.contains("rank 1 on b:"),
            "{text}"
        );
        assert!(
            text.contains("1.0 GiB") && text.contains("128.0 MiB"),
            "{text}"
        );
        assert!(text.contains("driver: llvmpipe Mesa"), "{text}");
        let json = render_rank_adapters(&hosts, &[one.into(), "[]".into()], true).unwrap();
        let v: serde_json::Value = serde_json::from_str(&json).unwrap();
        assert_eq!(v[0]["adapters"][0]["name"], "llvmpipe");
        assert_eq!(v[1]["host"], "b");
    }
}
