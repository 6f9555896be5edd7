//! A timeline drawn as an SVG picture: one row per track, one box per span, colored by kind and
//! labelled with its micro-batch, with a time axis and a legend. Plain text output, no
//! dependencies, so reports can embed it.

use std::fmt::Write as _;

use super::span::{Span, SpanKind, Track};
use super::timeline::{track_order, Timeline};

/// Drawing options of [`timeline_svg_with`].
#[derive(Debug, Clone, PartialEq)]
pub struct SvgOptions {
    /// Picture width, pixels.
    pub width: u32,
    /// Picture height, pixels.
    pub height: u32,
    /// Heading drawn above the rows (none when empty).
    pub title: String,
    /// Only spans overlapping this window, microseconds since the timeline's epoch; `None`
    /// draws everything.
    pub window_us: Option<(f64, f64)>,
}

impl SvgOptions {
    /// Options for a `width` x `height` picture of the whole timeline, without a title.
    pub fn new(width: u32, height: u32) -> Self {
        Self {
            width,
            height,
            title: String::new(),
            window_us: None,
        }
    }
}

/// The timeline as an SVG document of `width` x `height` pixels (see [`timeline_svg_with`]).
pub fn timeline_svg(timeline: &Timeline, width: u32, height: u32) -> String {
    timeline_svg_with(timeline, &SvgOptions::new(width, height))
}

/// Fill color of each span kind (a palette that stays apart for common color blindness).
fn color(kind: SpanKind, microbatch: Option<u32>) -> &'static str {
    // Alternate two shades of compute per micro-batch, so neighbours stay distinguishable.
    let odd = microbatch.is_some_and(|m| m % 2 == 1);
    match kind {
        SpanKind::Compute if odd => "#6baed6",
        SpanKind::Compute => "#2171b5",
        SpanKind::DeviceToHost => "#e6550d",
        SpanKind::HostToDevice => "#31a354",
        SpanKind::HostReduce => "#756bb1",
        SpanKind::Collective => "#d62728",
        SpanKind::Wait => "#bdbdbd",
    }
}

fn escape(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&apos;"),
            _ => out.push(c),
        }
    }
    out
}

/// A round tick step (1, 2 or 5 times a power of ten) giving about `ticks` ticks over `span`.
fn tick_step(span: f64, ticks: f64) -> f64 {
    let raw = (span / ticks).max(f64::MIN_POSITIVE);
    let magnitude = 10f64.powf(raw.log10().floor());
    let norm = raw / magnitude;
    let nice = if norm < 1.5 {
        1.0
    } else if norm < 3.5 {
        2.0
    } else if norm < 7.5 {
        5.0
    } else {
        10.0
    };
    nice * magnitude
}

/// Time label in the unit that suits the axis step.
fn time_label(us: f64, step_us: f64) -> String {
    if step_us >= 1e5 {
        format!("{} s", trim(us / 1e6))
    } else if step_us >= 100.0 {
        format!("{} ms", trim(us / 1e3))
    } else {
        format!("{} us", trim(us))
    }
}

fn trim(v: f64) -> String {
    let s = format!("{v:.3}");
    let s = s.trim_end_matches('0').trim_end_matches('.');
    if s == "-0" {
        "0".into()
    } else {
        s.into()
    }
}

fn tooltip(s: &Span) -> String {
    let mut t = format!("{} ({}) {:.1} us", s.name, s.kind.label(), s.dur_us());
    if let Some(m) = s.microbatch {
        let _ = write!(t, ", micro-batch {m}");
    }
    if let Some(l) = s.layer {
        let _ = write!(t, ", layer {l}");
    }
    if s.bytes > 0 {
        let _ = write!(t, ", {} bytes", s.bytes);
    }
    t
}

/// The timeline as an SVG document: a row per track (a device's compute row, then its d2h and
/// h2d rows; the host last), a box per span colored by kind, micro-batch numbers in the boxes
/// wide enough to hold them, a time axis from the first span's start, and a legend of the
/// kinds present. Tooltips (`<title>`) carry each span's name, kind, duration and indices.
pub fn timeline_svg_with(timeline: &Timeline, opts: &SvgOptions) -> String {
    let spans: Vec<&Span> = timeline
        .spans
        .iter()
        .filter(|s| match opts.window_us {
            Some((a, b)) => s.end_us() >= a && s.start_us() <= b,
            None => true,
        })
        .collect();
    let mut tracks: Vec<Track> = spans.iter().map(|s| s.track.clone()).collect();
    tracks.sort_by_key(track_order);
    tracks.dedup();
    let frame = Frame::new(opts, time_window(&spans, opts.window_us), tracks.len());
    let mut out = String::new();
    frame.header(&mut out, &opts.title);
    frame.legend(&mut out, &spans);
    frame.rows(&mut out, &tracks);
    frame.axis(&mut out);
    frame.boxes(&mut out, &spans, &tracks);
    out.push_str("</svg>\n");
    out
}

/// The time range drawn: the window asked for, else from the first span's start to the last
/// span's end.
fn time_window(spans: &[&Span], window_us: Option<(f64, f64)>) -> (f64, f64) {
    if let Some((a, b)) = window_us.filter(|(a, b)| b > a) {
        return (a, b);
    }
    let a = (spans.iter().map(|s| s.start_us())).fold(f64::INFINITY, f64::min);
    let b = (spans.iter().map(|s| s.end_us())).fold(f64::NEG_INFINITY, f64::max);
    if a.is_finite() && b > a {
        (a, b)
    } else {
        (0.0, 1.0)
    }
}

/// The drawing's geometry: its size, margins, the plot's width, a row's height and the time
/// range across the plot.
struct Frame {
    width: f64,
    height: f64,
    label_w: f64,
    right: f64,
    top: f64,
    plot_w: f64,
    row_h: f64,
    rows: f64,
    t0: f64,
    t1: f64,
}

impl Frame {
    fn new(opts: &SvgOptions, (t0, t1): (f64, f64), tracks: usize) -> Self {
        let width = opts.width.max(200) as f64;
        let height = opts.height.max(80) as f64;
        let (label_w, right, bottom) = (96.0, 16.0, 34.0);
        let top = if opts.title.is_empty() { 30.0 } else { 52.0 };
        let rows = tracks.max(1) as f64;
        Self {
            width,
            height,
            label_w,
            right,
            top,
            plot_w: (width - label_w - right).max(10.0),
            row_h: ((height - top - bottom) / rows).max(6.0),
            rows,
            t0,
            t1,
        }
    }

    fn x_of(&self, us: f64) -> f64 {
        self.label_w + (us - self.t0) / (self.t1 - self.t0) * self.plot_w
    }

    /// The document's opening, white background and title.
    fn header(&self, out: &mut String, title: &str) {
        let (width, height, label_w) = (self.width, self.height, self.label_w);
        let _ = writeln!(
            out,
            r#"<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" viewBox="0 0 {width} {height}" font-family="sans-serif" font-size="11">"#
        );
        let _ = writeln!(
            out,
            r#"<rect x="0" y="0" width="{width}" height="{height}" fill="white"/>"#
        );
        if !title.is_empty() {
            let _ = writeln!(
                out,
                r#"<text x="{label_w}" y="20" font-size="14" font-weight="bold">{}</text>"#,
                escape(title)
            );
        }
    }

    /// The kinds present, right-aligned above the rows.
    fn legend(&self, out: &mut String, spans: &[&Span]) {
        let present: Vec<SpanKind> = SpanKind::ALL
            .iter()
            .copied()
            .filter(|k| spans.iter().any(|s| s.kind == *k))
            .collect();
        let mut lx = self.width - self.right - 90.0 * present.len() as f64;
        for k in &present {
            let _ = writeln!(
                out,
                r#"<rect x="{lx:.1}" y="{:.1}" width="10" height="10" fill="{}"/><text x="{:.1}" y="{:.1}">{}</text>"#,
                self.top - 20.0,
                color(*k, None),
                lx + 14.0,
                self.top - 11.0,
                k.label()
            );
            lx += 90.0;
        }
    }

    /// Rows: alternating background, label on the left.
    fn rows(&self, out: &mut String, tracks: &[Track]) {
        let (label_w, plot_w, row_h) = (self.label_w, self.plot_w, self.row_h);
        for (r, track) in tracks.iter().enumerate() {
            let y = self.top + r as f64 * row_h;
            if r % 2 == 0 {
                let _ = writeln!(
                    out,
                    r##"<rect x="{label_w}" y="{y:.1}" width="{plot_w:.1}" height="{row_h:.1}" fill="#f4f4f4"/>"##
                );
            }
            let _ = writeln!(
                out,
                r#"<text x="{:.1}" y="{:.1}" text-anchor="end">{}</text>"#,
                label_w - 6.0,
                y + row_h / 2.0 + 4.0,
                escape(&track.to_string())
            );
        }
    }

    /// The time axis with round ticks.
    fn axis(&self, out: &mut String) {
        let (label_w, top) = (self.label_w, self.top);
        let axis_y = top + self.rows * self.row_h;
        let _ = writeln!(
            out,
            r#"<line x1="{label_w}" y1="{axis_y:.1}" x2="{:.1}" y2="{axis_y:.1}" stroke="black"/>"#,
            label_w + self.plot_w
        );
        let span = self.t1 - self.t0;
        let step = tick_step(span, 8.0);
        let mut tick = 0.0;
        while tick <= span * (1.0 + 1e-9) {
            let x = self.x_of(self.t0 + tick);
            let _ = writeln!(
                out,
                r##"<line x1="{x:.1}" y1="{top:.1}" x2="{x:.1}" y2="{:.1}" stroke="#cccccc" stroke-width="0.5"/><text x="{x:.1}" y="{:.1}" text-anchor="middle">{}</text>"##,
                axis_y + 4.0,
                axis_y + 16.0,
                time_label(tick, step)
            );
            tick += step;
        }
    }

    /// A box per span (a sliver of margin keeps neighbouring rows apart), with its
    /// micro-batch number where the box is wide enough.
    fn boxes(&self, out: &mut String, spans: &[&Span], tracks: &[Track]) {
        for s in spans {
            let Some(r) = tracks.iter().position(|t| *t == s.track) else {
                continue;
            };
            let y = self.top + r as f64 * self.row_h + self.row_h * 0.12;
            let h = self.row_h * 0.76;
            let x0 = self.x_of(s.start_us().max(self.t0));
            let x1 = self.x_of(s.end_us().min(self.t1));
            let w = (x1 - x0).max(0.5);
            let _ = writeln!(
                out,
                r#"<rect x="{x0:.2}" y="{y:.1}" width="{w:.2}" height="{h:.1}" fill="{}"><title>{}</title></rect>"#,
                color(s.kind, s.microbatch),
                escape(&tooltip(s))
            );
            let Some(m) = s.microbatch else {
                continue;
            };
            let text = m.to_string();
            // About 7 px per digit at 11 px type.
            if w >= 7.0 * text.len() as f64 + 4.0 && h >= 10.0 {
                let _ = writeln!(
                    out,
                    r#"<text x="{:.1}" y="{:.1}" text-anchor="middle" fill="white">{text}</text>"#,
                    x0 + w / 2.0,
                    y + h / 2.0 + 4.0
                );
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::trace::SpanAttrs;

    fn pipeline() -> Timeline {
        let mut t = Timeline::new();
        for m in 0..3u32 {
            let c = t.push_us(
                SpanAttrs::compute("stage0", 0).microbatch(m),
                m as f64 * 100.0,
                100.0,
            );
            let d = t.push_us(
                SpanAttrs::d2h("x<y", 0, 64).microbatch(m).after(c),
                m as f64 * 100.0 + 100.0,
                10.0,
            );
            t.push_us(
                SpanAttrs::compute("stage1", 1).microbatch(m).after(d),
                m as f64 * 100.0 + 110.0,
                100.0,
            );
        }
        t
    }

    #[test]
    fn one_row_per_track_one_box_per_span_and_labels() {
        // 288 px of plot for 310 us: a compute box is 93 px wide, a copy 9 px.
        let svg = timeline_svg(&pipeline(), 400, 200);
        assert!(svg.starts_with("<svg") && svg.trim_end().ends_with("</svg>"));
        // Rows in track order, with labels.
        let rows: Vec<usize> = ["gpu0<", "gpu0 d2h<", "gpu1<"]
            .iter()
            .map(|l| svg.find(&format!(">{l}")).unwrap())
            .collect();
        assert!(rows[0] < rows[1] && rows[1] < rows[2]);
        // 9 span boxes with tooltips; names are escaped.
        assert_eq!(svg.matches("<title>").count(), 9);
        assert!(svg.contains("x&lt;y (d2h)"));
        assert!(!svg.contains("x<y"));
        // Micro-batch numbers in the wide compute boxes, not in the thin copies.
        assert_eq!(svg.matches(r#"fill="white">1</text>"#).count(), 2);
        // Legend names the kinds present only.
        assert!(svg.contains(">compute</text>") && svg.contains(">d2h</text>"));
        assert!(!svg.contains(">collective</text>"));
        // The time axis starts at 0 and uses round steps.
        assert!(svg.contains(">0 us</text>") && svg.contains(">50 us</text>"));
    }

    #[test]
    fn a_window_keeps_only_overlapping_spans() {
        let mut opts = SvgOptions::new(600, 150);
        opts.window_us = Some((0.0, 105.0));
        opts.title = "fill".into();
        let svg = timeline_svg_with(&pipeline(), &opts);
        // stage0 mb 0 and 1 (which starts at 100) and the first copy.
        assert_eq!(svg.matches("<title>").count(), 3, "{svg}");
        assert!(svg.contains(">fill</text>"));
    }

    #[test]
    fn ticks_are_round() {
        assert_eq!(tick_step(1000.0, 8.0), 100.0);
        assert_eq!(tick_step(2_600_000.0, 8.0), 200_000.0);
        assert_eq!(tick_step(4_000_000.0, 8.0), 500_000.0);
        assert_eq!(time_label(500_000.0, 500_000.0), "0.5 s");
        assert_eq!(time_label(1500.0, 500.0), "1.5 ms");
        assert_eq!(trim(2.0), "2");
    }

    #[test]
    fn empty_timeline_still_draws() {
        let svg = timeline_svg(&Timeline::new(), 300, 100);
        assert!(svg.contains("</svg>"));
        assert_eq!(svg.matches("<title>").count(), 0);
    }
}
