//! The printable result of a projection: measured and projected numbers side by side.

use std::fmt;

use crate::trace::{SpanKind, Summary};

use super::project::{CollectivePolicy, HostGaps, ProjectOptions, StepBarriers};

/// Summed span durations of one kind, measured and projected (microseconds).
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct KindTotal {
    /// The kind.
    pub kind: SpanKind,
    /// Sum of measured durations.
    pub measured_us: f64,
    /// Sum of projected durations.
    pub projected_us: f64,
}

/// What `wgpar project` prints.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct ProjectionReport {
    /// Profile projected onto.
    pub profile: String,
    /// Engine whose figures were used (its label).
    pub engine: String,
    /// Collective paths the projection used (`host-staged`, `nccl-ring-nvlink`, ...).
    pub collectives_via: Vec<String>,
    /// Devices the profile has.
    pub profile_devices: usize,
    /// Devices the timeline uses.
    pub devices_used: usize,
    /// Spans replayed.
    pub spans: usize,
    /// Options used.
    pub options: ProjectOptions,
    /// Summary of the recorded timeline.
    pub measured: Summary,
    /// Summary of the projected timeline.
    pub projected: Summary,
    /// Time per span kind.
    pub by_kind: Vec<KindTotal>,
    /// Fixed host cost charged per compute span (one submission and its wait), summed over
    /// the projected compute spans, microseconds (0 where the profile has no
    /// `submit_overhead_us`).
    pub submit_overhead_us: f64,
    /// Caveats about the profile that change how far to trust the figures, one sentence each
    /// (e.g. a calibrated profile written before the submission cost was measured).
    pub notes: Vec<String>,
}

impl ProjectionReport {
    /// Projected makespan over measured makespan (0 when nothing was measured).
    pub fn speedup(&self) -> f64 {
        if self.projected.makespan_us > 0.0 {
            self.measured.makespan_us / self.projected.makespan_us
        } else {
            0.0
        }
    }
}

/// Microseconds in a readable unit; beyond 10^6 s (a profile with absurd figures can get
/// there) in scientific notation rather than hundreds of digits.
pub(crate) fn time(us: f64) -> String {
    if !us.is_finite() {
        format!("{us} us")
    } else if us >= 1e12 {
        format!("{:.3e} s", us / 1e6)
    } else if us >= 1e6 {
        format!("{:.3} s", us / 1e6)
    } else if us >= 1e3 {
        format!("{:.3} ms", us / 1e3)
    } else {
        format!("{us:.1} us")
    }
}

/// Bytes in a readable decimal unit (as link bandwidths are counted).
fn bytes(b: u64) -> String {
    let b = b as f64;
    if b >= 1e9 {
        format!("{:.2} GB", b / 1e9)
    } else if b >= 1e6 {
        format!("{:.2} MB", b / 1e6)
    } else if b >= 1e3 {
        format!("{:.2} kB", b / 1e3)
    } else {
        format!("{b} B")
    }
}

fn pct(x: f64) -> String {
    format!("{:.1} %", x * 100.0)
}

impl fmt::Display for ProjectionReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.fmt_header(f)?;
        writeln!(f)?;
        self.fmt_summary(f)?;
        if !self.by_kind.is_empty() {
            writeln!(f)?;
            writeln!(
                f,
                "  {:<22}{:>14}{:>14}",
                "time by kind (sum)", "measured", "projected"
            )?;
            for k in &self.by_kind {
                row(f, k.kind.label(), time(k.measured_us), time(k.projected_us))?;
            }
        }
        self.fmt_devices(f)?;
        let (m, p) = (&self.measured, &self.projected);
        if p.makespan_us > 0.0 && m.makespan_us > 0.0 {
            writeln!(f)?;
            writeln!(
                f,
                "  projected / measured makespan: {:.3} (speedup {:.2}x)",
                p.makespan_us / m.makespan_us,
                self.speedup()
            )?;
        }
        Ok(())
    }
}

/// One row of a measured / projected table.
fn row(f: &mut fmt::Formatter<'_>, name: &str, a: String, b: String) -> fmt::Result {
    writeln!(f, "  {name:<22}{a:>14}{b:>14}")
}

impl ProjectionReport {
    /// What was projected where, with which options, and the caveats.
    fn fmt_header(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let policy = match self.options.collectives {
            CollectivePolicy::AsRecorded => "collectives as recorded",
            CollectivePolicy::Best => "best collective algorithm",
        };
        let gaps = match self.options.host_gaps {
            HostGaps::Drop => "host gaps dropped",
            HostGaps::Keep => "host gaps kept",
        };
        let barriers = match self.options.barriers {
            StepBarriers::Idle => "steps split at idle instants",
            StepBarriers::Off => "no step barriers",
        };
        writeln!(
            f,
            "projection onto `{}` as `{}` runs it: {} of {} devices, {} spans ({policy}, {gaps}, {barriers})",
            self.profile, self.engine, self.devices_used, self.profile_devices, self.spans
        )?;
        if !self.collectives_via.is_empty() {
            writeln!(f, "collectives via: {}", self.collectives_via.join(", "))?;
        }
        if self.submit_overhead_us > 0.0 {
            writeln!(
                f,
                "fixed host cost of the submissions (in compute): {}",
                time(self.submit_overhead_us)
            )?;
        }
        for note in &self.notes {
            writeln!(f, "note: {note}")?;
        }
        Ok(())
    }

    /// The timelines' summaries side by side.
    fn fmt_summary(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let (m, p) = (&self.measured, &self.projected);
        writeln!(f, "  {:<22}{:>14}{:>14}", "", "measured", "projected")?;
        row(f, "makespan", time(m.makespan_us), time(p.makespan_us))?;
        row(f, "bubble share", pct(m.bubble_share), pct(p.bubble_share))?;
        row(f, "comm share", pct(m.comm_share), pct(p.comm_share))?;
        row(
            f,
            "exposed comm share",
            pct(m.exposed_comm_share),
            pct(p.exposed_comm_share),
        )?;
        row(
            f,
            "host reduce time",
            time(m.host_reduce_us),
            time(p.host_reduce_us),
        )?;
        row(
            f,
            "transfer bytes",
            bytes(m.transfer_bytes),
            bytes(p.transfer_bytes),
        )?;
        row(
            f,
            "collective bytes",
            bytes(m.collective_bytes),
            bytes(p.collective_bytes),
        )
    }

    /// Busy and communication time per device, measured and projected.
    fn fmt_devices(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let (m, p) = (&self.measured, &self.projected);
        if m.devices.is_empty() {
            return Ok(());
        }
        writeln!(f)?;
        writeln!(
            f,
            "  {:<8}{:>14}{:>14}{:>14}{:>14}",
            "device", "busy meas", "busy proj", "comm meas", "comm proj"
        )?;
        for (dm, dp) in m.devices.iter().zip(&p.devices) {
            writeln!(
                f,
                "  {:<8}{:>14}{:>14}{:>14}{:>14}",
                format!("gpu{}", dm.device),
                time(dm.busy_us),
                time(dp.busy_us),
                time(dm.comm_us),
                time(dp.comm_us)
            )?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn units_scale() {
        assert_eq!(time(12.34), "12.3 us");
        assert_eq!(time(12_345.0), "12.345 ms");
        assert_eq!(time(2.5e6), "2.500 s");
        assert_eq!(time(3e300), "3.000e294 s");
        assert_eq!(bytes(999), "999 B");
        assert_eq!(bytes(1_500_000), "1.50 MB");
        assert_eq!(pct(0.25), "25.0 %");
    }
}
