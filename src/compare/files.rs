//! The files `wgpar compare` writes into its report folder: the charts, the richest pipeline
//! timeline (as a Chrome trace and a picture), the Markdown report and the JSON.

use std::path::{Path, PathBuf};

use super::{breakdown_svg, markdown, scale_svg, throughput_svg, CompareReport};
use crate::error::{Result, WgparError};

/// What [`write_report`] wrote that a caller shows.
#[derive(Debug, Clone)]
pub struct ReportFiles {
    /// The Markdown report.
    pub markdown: PathBuf,
    /// The report as pretty JSON, as written to `report.json`.
    pub json: String,
}

/// Writes the report, its charts and its JSON into `out` (created if missing).
pub fn write_report(report: &CompareReport, out: &Path) -> Result<ReportFiles> {
    std::fs::create_dir_all(out).map_err(|e| io_err(out, e))?;
    let mut charts = measured_charts(report, out)?;
    if let Some(scale) = &report.scale {
        let svg = scale_svg(scale).map_err(|message| chart_err("scale.svg", message))?;
        write(&out.join("scale.svg"), svg)?;
        charts.push((
            "Modeled at scale: decode tokens/s".to_string(),
            "scale.svg".to_string(),
        ));
    }
    if let Some(chart) = pipeline_timeline(report, out)? {
        charts.push(chart);
    }
    let md_path = out.join("report.md");
    write(&md_path, markdown(report, &charts))?;
    let json = serde_json::to_string_pretty(report).map_err(|source| WgparError::Json {
        what: "the comparison report".into(),
        source,
    })?;
    write(&out.join("report.json"), &json)?;
    Ok(ReportFiles {
        markdown: md_path,
        json,
    })
}

/// The throughput and breakdown charts (both drawn before either is written); returns their
/// (title, file) pairs for the report.
fn measured_charts(report: &CompareReport, out: &Path) -> Result<Vec<(String, String)>> {
    let mut charts = Vec::new();
    for (title, file, svg) in [
        (
            "Generation throughput vs batch",
            "throughput.svg",
            throughput_svg(report).map_err(|message| chart_err("throughput.svg", message))?,
        ),
        (
            "Where device-time goes",
            "breakdown.svg",
            breakdown_svg(report).map_err(|message| chart_err("breakdown.svg", message))?,
        ),
    ] {
        write(&out.join(file), svg)?;
        charts.push((title.to_string(), file.to_string()));
    }
    Ok(charts)
}

/// The richest pipeline timeline, for Perfetto and for `wgpar project`: a Chrome trace of its
/// prefill and a picture of it; `None` when no pipeline ran.
fn pipeline_timeline(report: &CompareReport, out: &Path) -> Result<Option<(String, String)>> {
    let Some(m) = report
        .measurements
        .iter()
        .filter(|m| m.family == "pp" || m.family == "hybrid")
        .max_by_key(|m| (m.micro_batches, m.batch))
    else {
        return Ok(None);
    };
    m.timelines
        .0
        .write_chrome_trace(out.join("pipeline-prefill-trace.json"))?;
    let svg = crate::trace::timeline_svg(&m.timelines.0, 1200, 80 + 40 * 3 * m.devices as u32);
    write(&out.join("timeline.svg"), svg)?;
    Ok(Some((
        format!(
            "Timeline: {} prefill, batch {} (measured)",
            m.label, m.batch
        ),
        "timeline.svg".to_string(),
    )))
}

fn write(path: &Path, contents: impl AsRef<[u8]>) -> Result<()> {
    std::fs::write(path, contents).map_err(|e| io_err(path, e))
}

fn io_err(path: &Path, source: std::io::Error) -> WgparError {
    WgparError::Io {
        path: path.display().to_string(),
        source,
    }
}

fn chart_err(path: &str, message: String) -> WgparError {
    WgparError::Chart {
        path: path.into(),
        message,
    }
}
