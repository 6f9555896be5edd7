//! SVG charts of a comparison (plotters): generation throughput against batch size per
//! strategy, measured and projected; and a stacked breakdown of device-time into compute,
//! communication and bubble.

use plotters::coord::types::RangedCoordf64;
use plotters::coord::Shift;
use plotters::prelude::*;

use super::{CompareReport, ScaleSection};

const PALETTE: [RGBColor; 10] = [
    RGBColor(31, 119, 180),
    RGBColor(255, 127, 14),
    RGBColor(44, 160, 44),
    RGBColor(214, 39, 40),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
    RGBColor(227, 119, 194),
    RGBColor(127, 127, 127),
    RGBColor(188, 189, 34),
    RGBColor(23, 190, 207),
];

fn labels(r: &CompareReport) -> Vec<String> {
    let mut v: Vec<String> = Vec::new();
    for m in &r.measurements {
        if !v.contains(&m.label) {
            v.push(m.label.clone());
        }
    }
    v
}

type Series = Vec<(String, Vec<(f64, f64)>)>;

/// Generation tokens/s against batch, one line per strategy: a panel for the measured
/// machine and one per projected profile (log scale: profiles differ by orders of magnitude).
pub fn throughput_svg(r: &CompareReport) -> Result<String, String> {
    let names = labels(r);
    let mut panels: Vec<(String, Series)> = Vec::new();
    let measured: Series = names
        .iter()
        .map(|n| {
            let pts = r
                .measurements
                .iter()
                .filter(|m| &m.label == n)
                .map(|m| (m.batch as f64, m.tg_tps.mean))
                .collect();
            (n.clone(), pts)
        })
        .collect();
    panels.push(("this machine (measured)".into(), measured));
    for p in r.profile_names() {
        let series: Series = names
            .iter()
            .map(|n| {
                let pts = r
                    .measurements
                    .iter()
                    .filter(|m| &m.label == n)
                    .filter_map(|m| {
                        m.projected
                            .iter()
                            .find(|x| x.key() == p)
                            .map(|x| (m.batch as f64, x.tg_tps))
                    })
                    .collect();
                (n.clone(), pts)
            })
            .collect();
        panels.push((p.to_string(), series));
    }
    panels_svg(&panels, "batch (sequences)", "generated tokens/s")
}

/// Side-by-side panels of lines (log-scale y), one line per named series.
fn panels_svg(panels: &[(String, Series)], x_desc: &str, y_desc: &str) -> Result<String, String> {
    let mut svg = String::new();
    {
        let width = 480 * panels.len() as u32;
        let root = SVGBackend::with_string(&mut svg, (width, 420)).into_drawing_area();
        root.fill(&WHITE).map_err(|e| e.to_string())?;
        let areas = root.split_evenly((1, panels.len()));
        for (area, (title, series)) in areas.iter().zip(panels) {
            let xs: Vec<f64> = series
                .iter()
                .flat_map(|(_, p)| p.iter().map(|q| q.0))
                .collect();
            let ys: Vec<f64> = series
                .iter()
                .flat_map(|(_, p)| p.iter().map(|q| q.1))
                .filter(|y| *y > 0.0)
                .collect();
            if xs.is_empty() || ys.is_empty() {
                continue;
            }
            let x_max = xs.iter().cloned().fold(1.0, f64::max) * 1.1;
            let y_min = ys.iter().cloned().fold(f64::INFINITY, f64::min) * 0.5;
            let y_max = ys.iter().cloned().fold(0.0, f64::max) * 2.0;
            let mut chart = ChartBuilder::on(area)
                .caption(title, ("sans-serif", 16))
                .margin(10)
                .x_label_area_size(35)
                .y_label_area_size(60)
                .build_cartesian_2d(0.5f64..x_max, (y_min..y_max).log_scale())
                .map_err(|e| e.to_string())?;
            chart
                .configure_mesh()
                .x_desc(x_desc)
                .y_desc(y_desc)
                .draw()
                .map_err(|e| e.to_string())?;
            for (i, (name, pts)) in series.iter().enumerate() {
                if pts.is_empty() {
                    continue;
                }
                let color = PALETTE[i % PALETTE.len()];
                chart
                    .draw_series(LineSeries::new(pts.clone(), color.stroke_width(2)))
                    .map_err(|e| e.to_string())?
                    .label(name.clone())
                    .legend(move |(x, y)| {
                        PathElement::new(vec![(x, y), (x + 16, y)], color.stroke_width(2))
                    });
                chart
                    .draw_series(pts.iter().map(|&p| Circle::new(p, 3, color.filled())))
                    .map_err(|e| e.to_string())?;
            }
            chart
                .configure_series_labels()
                .background_style(WHITE.mix(0.8))
                .border_style(BLACK)
                .position(SeriesLabelPosition::UpperLeft)
                .draw()
                .map_err(|e| e.to_string())?;
        }
        root.present().map_err(|e| e.to_string())?;
    }
    Ok(svg)
}

/// A strategy's bar: its label, communication share and bubble share of device-time.
type Bar = (String, f64, f64);

/// The bar chart's plotting area: strategies along x, percent of device-time up.
type BarChart<'a, 'b> =
    ChartContext<'a, SVGBackend<'b>, Cartesian2d<RangedCoordf64, RangedCoordf64>>;

/// Colours of compute, communication and bubble / idle.
const SHARE_COLORS: [RGBColor; 3] = [
    RGBColor(44, 160, 44),
    RGBColor(214, 39, 40),
    RGBColor(200, 200, 200),
];

/// Stacked bars of device-time shares (compute / communication / bubble and idle) per
/// strategy at the largest batch: measured, then each profile.
pub fn breakdown_svg(r: &CompareReport) -> Result<String, String> {
    let panels = breakdown_panels(r);
    let mut svg = String::new();
    {
        let width = 480 * panels.len() as u32;
        let root = SVGBackend::with_string(&mut svg, (width, 420)).into_drawing_area();
        root.fill(&WHITE).map_err(|e| e.to_string())?;
        let areas = root.split_evenly((1, panels.len()));
        for (area, (title, bars)) in areas.iter().zip(&panels) {
            bar_panel(area, title, bars)?;
        }
        root.present().map_err(|e| e.to_string())?;
    }
    Ok(svg)
}

/// The panels of the breakdown at the largest batch: measured, then each projection.
fn breakdown_panels(r: &CompareReport) -> Vec<(String, Vec<Bar>)> {
    let batch = r.measurements.iter().map(|m| m.batch).max().unwrap_or(1);
    let rows: Vec<&super::Measurement> =
        r.measurements.iter().filter(|m| m.batch == batch).collect();
    let mut panels: Vec<(String, Vec<Bar>)> = vec![(
        format!("this machine, batch {batch} (measured)"),
        rows.iter()
            .map(|m| (m.label.clone(), m.comm_share, m.bubble_share))
            .collect(),
    )];
    for p in r.profile_names() {
        panels.push((
            format!("{p}, batch {batch}"),
            rows.iter()
                .filter_map(|m| {
                    m.projected
                        .iter()
                        .find(|x| x.key() == p)
                        .map(|x| (m.label.clone(), x.comm_share, x.bubble_share))
                })
                .collect(),
        ));
    }
    panels
}

/// One panel of stacked bars, with the strategy names above them and a legend.
fn bar_panel(
    area: &DrawingArea<SVGBackend<'_>, Shift>,
    title: &str,
    bars: &[Bar],
) -> Result<(), String> {
    let n = bars.len().max(1);
    let mut chart = ChartBuilder::on(area)
        .caption(title, ("sans-serif", 16))
        .margin(10)
        .x_label_area_size(60)
        .y_label_area_size(50)
        .build_cartesian_2d(0.0f64..n as f64, 0.0f64..140.0)
        .map_err(|e| e.to_string())?;
    chart
        .configure_mesh()
        .disable_x_mesh()
        .x_labels(0)
        // The space above 100 % holds the strategy names and the legend.
        .y_label_formatter(&|y| {
            if *y <= 100.0 {
                format!("{y:.0}")
            } else {
                String::new()
            }
        })
        .y_desc("% of device-time")
        .draw()
        .map_err(|e| e.to_string())?;
    // Strategy names above their bars (axis labels would be thinned out by plotters).
    for (i, (name, _, _)) in bars.iter().enumerate() {
        chart
            .draw_series(std::iter::once(Text::new(
                name.clone(),
                (i as f64 + 0.1, 104.0 + 6.0 * (i % 2) as f64),
                ("sans-serif", 11).into_font(),
            )))
            .map_err(|e| e.to_string())?;
    }
    for (i, &(_, comm, bubble)) in bars.iter().enumerate() {
        stacked_bar(&mut chart, i, comm, bubble)?;
    }
    share_legend(&mut chart)
}

/// The bar of strategy `i`: compute, communication, then bubble / idle up to 100 %.
fn stacked_bar(
    chart: &mut BarChart<'_, '_>,
    i: usize,
    comm: f64,
    bubble: f64,
) -> Result<(), String> {
    let comm = comm * 100.0;
    // Communication counts inside the non-compute time; the rest is bubble/idle.
    let idle = (bubble * 100.0 - comm).max(0.0);
    let compute = (100.0 - comm - idle).max(0.0);
    let x0 = i as f64 + 0.15;
    let x1 = i as f64 + 0.85;
    let segments = [
        (0.0, compute),
        (compute, compute + comm),
        (compute + comm, 100.0),
    ];
    for (k, (lo, hi)) in segments.iter().enumerate() {
        chart
            .draw_series(std::iter::once(Rectangle::new(
                [(x0, *lo), (x1, *hi)],
                SHARE_COLORS[k].filled(),
            )))
            .map_err(|e| e.to_string())?;
    }
    Ok(())
}

/// The legend of the three shares (empty series carry its entries).
fn share_legend<'a, 'b: 'a>(chart: &mut BarChart<'a, 'b>) -> Result<(), String> {
    for (k, name) in ["compute", "communication", "bubble / idle"]
        .iter()
        .enumerate()
    {
        let color = SHARE_COLORS[k];
        chart
            .draw_series(std::iter::once(Rectangle::new(
                [(0.0, 0.0), (0.0, 0.0)],
                color.filled(),
            )))
            .map_err(|e| e.to_string())?
            .label(*name)
            .legend(move |(x, y)| Rectangle::new([(x, y - 5), (x + 12, y + 5)], color.filled()));
    }
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .position(SeriesLabelPosition::UpperRight)
        .draw()
        .map_err(|e| e.to_string())
}

/// The modeled-at-scale section in one chart: decode tokens/s against batch, a panel per
/// (question, profile), a line per (engine, strategy); configurations that do not fit are left
/// out.
pub fn scale_svg(scale: &ScaleSection) -> Result<String, String> {
    let mut panels: Vec<(String, Series)> = Vec::new();
    for case in &scale.cases {
        let mut profiles: Vec<&str> = Vec::new();
        for r in &case.rows {
            if !profiles.contains(&r.profile.as_str()) {
                profiles.push(&r.profile);
            }
        }
        for profile in profiles {
            let mut series: Series = Vec::new();
            for r in case.rows.iter().filter(|r| r.profile == profile && r.fits) {
                let name = format!("{} {}", r.engine, r.strategy);
                let Some(tps) = r.decode_tps else { continue };
                match series.iter_mut().find(|(n, _)| *n == name) {
                    Some((_, pts)) => pts.push((r.batch as f64, tps)),
                    None => series.push((name, vec![(r.batch as f64, tps)])),
                }
            }
            panels.push((format!("{} on {profile}", case.model), series));
        }
    }
    panels_svg(&panels, "batch (sequences)", "modeled decode tokens/s")
}
