//! The trace a run records: written to `--trace` and summarised.

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
