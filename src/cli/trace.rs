//! The trace a run records: written to `--trace` and summarised, with the devices' labels for
//! its metadata.

use wgpar::trace::Recorder;
use wgpar::Result;

/// Writes the recorded timeline to `--trace` and summarises it.
pub(super) fn write_trace(recorder: &Recorder, path: &str) -> Result<()> {
    let timeline = recorder.timeline();
    timeline.write_chrome_trace(path)?;
    outln!(
        "trace: {} spans written to {path} (open in https://ui.perfetto.dev)",
        timeline.spans.len()
    )?;
    if let Some(line) = timeline.device_time_line() {
        outln!("  {line}")?;
    }
    Ok(())
}

/// The devices' adapters for a trace's metadata: their labels, `; `-separated.
pub(super) fn adapter_labels(gpus: &[std::sync::Arc<wgpar::device::Gpu>]) -> String {
    let labels: Vec<String> = gpus.iter().map(|g| g.info().label()).collect();
    labels.join("; ")
}
