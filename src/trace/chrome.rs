//! Chrome Trace Event export (opens in Perfetto and chrome://tracing) and lossless reload.
//!
//! The file holds two views of the same timeline: `traceEvents` for viewers (one process per
//! device with tracks compute, d2h and h2d, plus a `host` process), and a `wgpar` block with the
//! full span data, which is what [`Timeline::from_chrome_trace_str`] reads back. Viewers ignore
//! unknown top-level keys, so the extra block costs nothing but bytes.

use std::collections::BTreeMap;
use std::path::Path;

use serde::Deserialize;
use serde_json::{json, Map, Value};

use super::error::TraceError;
use super::span::{Span, Track};
use super::timeline::Timeline;

/// Version of the `wgpar` block; bump when [`Timeline`]'s serialised shape changes.
pub const TRACE_FORMAT_VERSION: u32 = 1;

/// Process id and thread id of a track in the exported trace.
fn pid_tid(track: &Track, others: &BTreeMap<String, u32>) -> (u32, u32) {
    match track {
        Track::Device(d) => (d + 1, 0),
        Track::DeviceToHost(d) => (d + 1, 1),
        Track::HostToDevice(d) => (d + 1, 2),
        Track::Host => (0, 0),
        Track::Other(name) => (0, others.get(name).copied().unwrap_or(0)),
    }
}

fn metadata(name: &str, pid: u32, tid: Option<u32>, key: &str, value: Value) -> Value {
    let mut m = json!({ "name": name, "ph": "M", "pid": pid, "args": { key: value } });
    if let Some(tid) = tid {
        m["tid"] = json!(tid);
    }
    m
}

fn span_args(s: &Span) -> Value {
    let mut a = Map::new();
    a.insert("id".into(), json!(s.id.0));
    if let Some(d) = s.device {
        a.insert("device".into(), json!(d));
    }
    if let Some(mb) = s.microbatch {
        a.insert("microbatch".into(), json!(mb));
    }
    if let Some(l) = s.layer {
        a.insert("layer".into(), json!(l));
    }
    if s.bytes > 0 {
        a.insert("bytes".into(), json!(s.bytes));
    }
    if s.flops > 0 {
        a.insert("flops".into(), json!(s.flops));
    }
    if s.kernels > 0 {
        a.insert("kernels".into(), json!(s.kernels));
    }
    if let Some(f) = s.family {
        a.insert("family".into(), json!(f));
    }
    if let Some(ns) = s.device_ns {
        a.insert("device_us".into(), json!(ns as f64 / 1e3));
    }
    if !s.deps.is_empty() {
        a.insert(
            "deps".into(),
            json!(s.deps.iter().map(|d| d.0).collect::<Vec<_>>()),
        );
    }
    if let Some(c) = &s.collective {
        a.insert("op".into(), json!(c.op.label()));
        a.insert("algorithm".into(), json!(c.algorithm));
        a.insert("participants".into(), json!(c.participants));
        if let Some(g) = c.group {
            a.insert("group".into(), json!(g));
        }
        if c.chunks > 1 {
            a.insert("chunks".into(), json!(c.chunks));
        }
    }
    Value::Object(a)
}

impl Timeline {
    /// The timeline as a Chrome Trace Event JSON object (see the module docs).
    pub fn to_chrome_trace(&self) -> Value {
        let tracks = self.tracks();
        let others: BTreeMap<String, u32> = tracks
            .iter()
            .filter_map(|t| match t {
                Track::Other(n) => Some(n.clone()),
                _ => None,
            })
            .zip(1..)
            .collect();

        let mut events = Vec::with_capacity(self.spans.len() + 2 * tracks.len() + 2);
        let mut processes: BTreeMap<u32, String> = BTreeMap::new();
        for t in &tracks {
            let (pid, tid) = pid_tid(t, &others);
            let pname = match t.device() {
                Some(d) => match self.devices.get(&d) {
                    Some(label) => format!("gpu{d}: {label}"),
                    None => format!("gpu{d}"),
                },
                None => "host".to_owned(),
            };
            processes.insert(pid, pname);
            events.push(metadata(
                "thread_name",
                pid,
                Some(tid),
                "name",
                json!(t.to_string()),
            ));
            events.push(metadata(
                "thread_sort_index",
                pid,
                Some(tid),
                "sort_index",
                json!(tid),
            ));
        }
        for (pid, name) in &processes {
            events.push(metadata("process_name", *pid, None, "name", json!(name)));
            // Devices first, host last: the host process gets the largest index.
            let sort = if *pid == 0 { u32::MAX } else { *pid };
            events.push(metadata(
                "process_sort_index",
                *pid,
                None,
                "sort_index",
                json!(sort),
            ));
        }
        for s in &self.spans {
            let (pid, tid) = pid_tid(&s.track, &others);
            events.push(json!({
                "name": s.name,
                "cat": s.kind.label(),
                "ph": "X",
                "ts": s.start_us(),
                "dur": s.dur_us(),
                "pid": pid,
                "tid": tid,
                "args": span_args(s),
            }));
        }
        json!({
            "traceEvents": events,
            "displayTimeUnit": "ms",
            "otherData": self.meta,
            "wgpar": { "version": TRACE_FORMAT_VERSION, "timeline": self },
        })
    }

    /// [`Timeline::to_chrome_trace`] as a compact JSON string.
    pub fn to_chrome_trace_string(&self) -> String {
        self.to_chrome_trace().to_string()
    }

    /// Writes the Chrome trace to `path`.
    pub fn write_chrome_trace(&self, path: impl AsRef<Path>) -> Result<(), TraceError> {
        let path = path.as_ref();
        std::fs::write(path, self.to_chrome_trace_string()).map_err(|source| TraceError::Io {
            path: path.to_owned(),
            source,
        })
    }

    /// Reads a trace written by [`Timeline::write_chrome_trace`].
    pub fn read_chrome_trace(path: impl AsRef<Path>) -> Result<Timeline, TraceError> {
        let path = path.as_ref();
        let text = crate::files::read_text(path, crate::files::TRACE_LIMIT).map_err(|source| {
            TraceError::Io {
                path: path.to_owned(),
                source,
            }
        })?;
        Self::from_chrome_trace_str(&text, &path.display().to_string())
    }

    /// Parses a trace written by wgpar; `file` names the source in errors.
    ///
    /// The timeline is validated (unique ids, dependencies on earlier spans only).
    pub fn from_chrome_trace_str(text: &str, file: &str) -> Result<Timeline, TraceError> {
        #[derive(Deserialize)]
        struct Head {
            wgpar: Option<Version>,
        }
        #[derive(Deserialize)]
        struct Version {
            version: u32,
        }
        #[derive(Deserialize)]
        struct Full {
            wgpar: Block,
        }
        #[derive(Deserialize)]
        struct Block {
            timeline: Timeline,
        }
        let json_err = |e: serde_json::Error| TraceError::Json {
            file: file.to_owned(),
            line: e.line(),
            column: e.column(),
            message: e.to_string(),
        };
        // Check the version before the shape, so that an old file says "version" rather than
        // reporting whichever field changed.
        let head: Head = serde_json::from_str(text).map_err(json_err)?;
        let version = head.wgpar.ok_or_else(|| TraceError::NotWgpar {
            file: file.to_owned(),
        })?;
        if version.version != TRACE_FORMAT_VERSION {
            return Err(TraceError::Version {
                file: file.to_owned(),
                found: version.version,
                expected: TRACE_FORMAT_VERSION,
            });
        }
        let full: Full = serde_json::from_str(text).map_err(json_err)?;
        let mut timeline = full.wgpar.timeline;
        timeline.validate()?;
        Ok(timeline)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::trace::{CollectiveOp, SpanAttrs};

    fn sample() -> Timeline {
        let mut t = Timeline::new();
        t.devices.insert(0, "test gpu".into());
        let a = t.push_us(
            SpanAttrs::compute("layer0.attn", 0).layer(0).flops(1000),
            0.0,
            3.25,
        );
        t.push_us(
            SpanAttrs::collective("ar", 0, CollectiveOp::AllReduce, "host-staged", 2, 64)
                .group(7)
                .after(a),
            3.25,
            10.0,
        );
        t.push_us(
            SpanAttrs::d2h("x", 1, 64).on_track(Track::Other("net".into())),
            1.0,
            1.0,
        );
        t
    }

    #[test]
    fn events_have_tracks_and_args() {
        let v = sample().to_chrome_trace();
        let events = v["traceEvents"].as_array().unwrap();
        let thread_names: Vec<&str> = events
            .iter()
            .filter(|e| e["name"] == "thread_name")
            .map(|e| e["args"]["name"].as_str().unwrap())
            .collect();
        assert_eq!(thread_names, vec!["gpu0", "net"]);
        let proc_names: Vec<&str> = events
            .iter()
            .filter(|e| e["name"] == "process_name")
            .map(|e| e["args"]["name"].as_str().unwrap())
            .collect();
        assert_eq!(proc_names, vec!["host", "gpu0: test gpu"]);
        let x: Vec<&Value> = events.iter().filter(|e| e["ph"] == "X").collect();
        assert_eq!(x.len(), 3);
        assert_eq!(x[0]["ts"], json!(0.0));
        assert_eq!(x[0]["dur"], json!(3.25));
        assert_eq!(
            (x[0]["pid"].clone(), x[0]["tid"].clone()),
            (json!(1), json!(0))
        );
        assert_eq!(x[0]["args"]["layer"], json!(0));
        assert_eq!(x[0]["args"]["flops"], json!(1000));
        assert_eq!(x[1]["args"]["algorithm"], json!("host-staged"));
        assert_eq!(x[1]["args"]["deps"], json!([1]));
        assert_eq!(
            (x[2]["pid"].clone(), x[2]["tid"].clone()),
            (json!(0), json!(1))
        );
    }

    #[test]
    fn reload_rejects_foreign_and_future_files() {
        let foreign = r#"{"traceEvents": []}"#;
        assert!(matches!(
            Timeline::from_chrome_trace_str(foreign, "f.json"),
            Err(TraceError::NotWgpar { .. })
        ));
        let future = r#"{"wgpar": {"version": 99, "timeline": {}}}"#;
        assert!(matches!(
            Timeline::from_chrome_trace_str(future, "f.json"),
            Err(TraceError::Version { found: 99, .. })
        ));
        let broken = "{\n  \"wgpar\": [1,\n}";
        match Timeline::from_chrome_trace_str(broken, "f.json") {
            Err(TraceError::Json { line, .. }) => assert_eq!(line, 3),
            other => panic!("expected a JSON error, got {other:?}"),
        }
    }
}
