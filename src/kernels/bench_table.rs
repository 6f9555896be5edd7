//! `wgpar bench kernels`' tables: every kernel's time and rates beside the given peaks, and
//! the roofline of the matmul rows against the copy kernel of the same run. A figure that was
//! not measured prints `n/a`.

use std::fmt::Write as _;

use super::bench::KernelBenchRow;
use super::roofline::COPY_KERNEL;
use crate::device::Gpu;

/// A figure, or `n/a` where it was not measured.
fn figure(v: Option<f64>, digits: usize) -> String {
    v.map_or("n/a".to_string(), |v| format!("{v:.digits$}"))
}

/// A rate with three significant digits (two decimals at least), so a slow kernel on a CPU
/// driver does not print as 0.00; `n/a` where it was not measured.
fn significant(v: Option<f64>) -> String {
    match v {
        Some(v) if v.is_finite() && v.abs() < 1.0 && v != 0.0 => {
            let digits = (2 - v.abs().log10().floor() as i32).clamp(2, 9) as usize;
            format!("{v:.digits$}")
        }
        other => figure(other, 2),
    }
}

/// `bench kernels`' tables for one device: every kernel's time and rates (each rate beside
/// its fraction of the given peak), then the roofline of the matmul rows.
pub fn render(
    gpu: &Gpu,
    rows: &[KernelBenchRow],
    peak_gflops: Option<f64>,
    peak_gbps: Option<f64>,
) -> String {
    let mut s = String::new();
    let _ = writeln!(
        s,
        "# {} driver: {} {}",
        gpu.describe(),
        gpu.info().driver,
        gpu.info().driver_info
    );
    let _ = writeln!(
        s,
        "{:<18} {:<20} {:<6} {:>11} {:>9} {:>7} {:>8} {:>7} {:>8} {:>8}  note",
        "kernel",
        "shape",
        "dtype",
        "median ms",
        "GFLOP/s",
        "peak",
        "GB/s",
        "peak",
        "x naive",
        "x today"
    );
    let frac = |v: Option<f64>, peak: Option<f64>| match (v, peak) {
        (Some(v), Some(p)) => format!("{}%", significant(Some(v / p * 100.0))),
        _ => "n/a".to_string(),
    };
    for r in rows {
        let note = match (r.winner, r.legacy) {
            (true, true) => "winner, today's",
            (true, false) => "winner",
            (false, true) => "today's",
            _ => "",
        };
        let _ = writeln!(
            s,
            "{:<18} {:<20} {:<6} {:>11.3} {:>9} {:>7} {:>8} {:>7} {:>8} {:>8}  {note}",
            r.kernel,
            r.shape,
            r.dtype,
            r.median_ms,
            significant(r.gflops),
            frac(r.gflops, peak_gflops),
            significant(r.gbps),
            frac(r.gbps, peak_gbps),
            significant(r.speedup_vs_naive),
            significant(r.speedup_vs_legacy)
        );
    }
    render_roofline(&mut s, rows, peak_gbps);
    s
}

/// The roofline table: every matmul row's weight bandwidth against the copy kernel's in the
/// same run (and against `--peak-gbps` when given); each shape's and type's fastest marked.
fn render_roofline(s: &mut String, rows: &[KernelBenchRow], peak_gbps: Option<f64>) {
    let matmuls: Vec<_> = rows.iter().filter(|r| r.weight_bytes.is_some()).collect();
    if matmuls.is_empty() {
        return;
    }
    let copy = rows.iter().find(|r| r.kernel == COPY_KERNEL);
    let copy_gbps = copy.and_then(|c| c.gbps);
    let _ = writeln!(
        s,
        "# roofline: {} of {} moved {} GB/s (bytes read + written over time, this run); \
         weight GB/s = the weights' bytes as stored, per second (x and y counted apart); bufs = \
         weight buffers the dispatches rotate through (1: the same weights, cache-friendly)",
        COPY_KERNEL,
        copy.map_or("n/a", |c| c.shape.as_str()),
        significant(copy_gbps)
    );
    let _ = writeln!(
        s,
        "{:<18} {:<20} {:<6} {:>11} {:>11} {:>5} {:>9} {:>11} {:>8} {:>9} {:>8}  note",
        "kernel",
        "shape",
        "dtype",
        "median ms",
        "weights MB",
        "bufs",
        "x+y KB",
        "weight GB/s",
        "of peak",
        "copy GB/s",
        "of copy"
    );
    let scaled = |b: Option<u64>, unit: f64| b.map(|b| b as f64 / unit);
    let percent = |f: Option<f64>| {
        f.map_or("n/a".to_string(), |f| {
            format!("{}%", significant(Some(f * 100.0)))
        })
    };
    for r in matmuls {
        let _ = writeln!(
            s,
            "{:<18} {:<20} {:<6} {:>11.3} {:>11} {:>5} {:>9} {:>11} {:>8} {:>9} {:>8}  {}",
            r.kernel,
            r.shape,
            r.dtype,
            r.median_ms,
            figure(scaled(r.weight_bytes, 1e6), 2),
            r.weight_buffers
                .map_or("n/a".to_string(), |b| b.to_string()),
            figure(scaled(r.xy_bytes, 1e3), 1),
            significant(r.weight_gbps),
            percent(r.weight_gbps.zip(peak_gbps).map(|(w, p)| w / p)),
            significant(copy_gbps),
            percent(r.of_copy),
            if r.winner { "winner" } else { "" }
        );
    }
}
