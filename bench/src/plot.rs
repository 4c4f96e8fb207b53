//! Plain SVG plots, written by hand (no plotting dependency): a TTFT CDF, and throughput with
//! latency over time.

use crate::record::RequestRecord;
use std::fmt::Write as _;

const W: f64 = 640.0;
const H: f64 = 360.0;
const PAD: f64 = 50.0;

struct Frame {
    x_max: f64,
    y_max: f64,
    svg: String,
}

impl Frame {
    fn new(title: &str, x_label: &str, y_label: &str, x_max: f64, y_max: f64) -> Frame {
        let (x_max, y_max) = (x_max.max(1e-9), y_max.max(1e-9));
        let mut svg = format!(
            "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{W}\" height=\"{H}\" font-family=\"sans-serif\" font-size=\"12\">\n<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n<text x=\"{}\" y=\"20\" text-anchor=\"middle\" font-size=\"14\">{title}</text>\n",
            W / 2.0
        );
        let _ = writeln!(
            svg,
            "<line x1=\"{PAD}\" y1=\"{}\" x2=\"{}\" y2=\"{}\" stroke=\"black\"/><line x1=\"{PAD}\" y1=\"{PAD}\" x2=\"{PAD}\" y2=\"{}\" stroke=\"black\"/>",
            H - PAD, W - PAD, H - PAD, H - PAD
        );
        for k in 0..=4 {
            let f = f64::from(k) / 4.0;
            let (x, y) = (PAD + f * (W - 2.0 * PAD), H - PAD - f * (H - 2.0 * PAD));
            let _ = writeln!(
                svg,
                "<text x=\"{x}\" y=\"{}\" text-anchor=\"middle\">{}</text><text x=\"{}\" y=\"{y}\" text-anchor=\"end\">{}</text>",
                H - PAD + 16.0,
                short(f * x_max),
                PAD - 4.0,
                short(f * y_max)
            );
        }
        let _ = writeln!(
            svg,
            "<text x=\"{}\" y=\"{}\" text-anchor=\"middle\">{x_label}</text><text x=\"14\" y=\"{}\" transform=\"rotate(-90 14 {})\" text-anchor=\"middle\">{y_label}</text>",
            W / 2.0,
            H - 10.0,
            H / 2.0,
            H / 2.0
        );
        Frame { x_max, y_max, svg }
    }

    fn line(&mut self, points: &[(f64, f64)], colour: &str, label: &str, slot: usize) {
        let pts: Vec<String> = points
            .iter()
            .map(|&(x, y)| {
                format!(
                    "{:.1},{:.1}",
                    PAD + x / self.x_max * (W - 2.0 * PAD),
                    H - PAD - (y / self.y_max).min(1.0) * (H - 2.0 * PAD)
                )
            })
            .collect();
        let _ = writeln!(
            self.svg,
            "<polyline fill=\"none\" stroke=\"{colour}\" stroke-width=\"1.5\" points=\"{}\"/>\n<text x=\"{}\" y=\"{}\" fill=\"{colour}\">{label}</text>",
            pts.join(" "),
            W - PAD - 150.0,
            PAD + 14.0 * slot as f64
        );
    }

    fn finish(mut self) -> String {
        self.svg.push_str("</svg>\n");
        self.svg
    }
}

fn short(v: f64) -> String {
    if v >= 100.0 {
        format!("{v:.0}")
    } else if v >= 1.0 {
        format!("{v:.1}")
    } else {
        format!("{v:.3}")
    }
}

fn measured(records: &[RequestRecord]) -> impl Iterator<Item = &RequestRecord> {
    records.iter().filter(|r| !r.warmup && r.ok())
}

pub fn ttft_cdf(records: &[RequestRecord]) -> String {
    let mut ttft: Vec<f64> = measured(records).filter_map(|r| r.ttft_s).collect();
    ttft.sort_by(f64::total_cmp);
    let n = ttft.len().max(1) as f64;
    let points: Vec<(f64, f64)> = ttft
        .iter()
        .enumerate()
        .map(|(i, &t)| (t, (i + 1) as f64 / n))
        .collect();
    let mut f = Frame::new(
        "TTFT CDF",
        "TTFT (s)",
        "fraction of requests",
        ttft.last().copied().unwrap_or(1.0),
        1.0,
    );
    f.line(&points, "steelblue", "TTFT", 0);
    f.finish()
}

pub fn over_time(records: &[RequestRecord]) -> String {
    let ends: Vec<(f64, f64, u64)> = measured(records)
        .map(|r| (r.start_s + r.e2e_s, r.e2e_s, r.output_tokens.unwrap_or(0)))
        .collect();
    let last = ends.iter().map(|e| e.0).fold(0.0, f64::max);
    let buckets = 40usize;
    let width = (last / buckets as f64).max(1e-3);
    let mut tokens = vec![0u64; buckets + 1];
    let mut latency: Vec<Vec<f64>> = vec![Vec::new(); buckets + 1];
    for &(end, e2e, out) in &ends {
        let b = ((end / width) as usize).min(buckets);
        tokens[b] += out;
        latency[b].push(e2e);
    }
    let tput: Vec<(f64, f64)> = tokens
        .iter()
        .enumerate()
        .map(|(b, &t)| (b as f64 * width, t as f64 / width))
        .collect();
    let lat: Vec<(f64, f64)> = latency
        .iter()
        .enumerate()
        .filter(|(_, v)| !v.is_empty())
        .map(|(b, v)| (b as f64 * width, v.iter().sum::<f64>() / v.len() as f64))
        .collect();
    let t_max = tput.iter().map(|p| p.1).fold(0.0, f64::max);
    let l_max = lat.iter().map(|p| p.1).fold(0.0, f64::max);
    let mut f = Frame::new(
        "Throughput and latency over time",
        "time (s)",
        &format!("output tok/s (max {t_max:.0}); mean e2e scaled"),
        last,
        t_max,
    );
    f.line(&tput, "steelblue", "output tok/s", 0);
    let scaled: Vec<(f64, f64)> = lat
        .iter()
        .map(|&(x, y)| (x, y / l_max.max(1e-9) * t_max))
        .collect();
    f.line(
        &scaled,
        "darkorange",
        &format!("mean e2e (max {l_max:.2} s)"),
        1,
    );
    f.finish()
}

/// Colours of the lines of [`lines`], in order.
const COLOURS: [&str; 8] = [
    "steelblue",
    "darkorange",
    "seagreen",
    "crimson",
    "purple",
    "saddlebrown",
    "deeppink",
    "gray",
];

/// Up to eight named series of (x, y) points as lines on one plot.
pub fn lines(
    title: &str,
    x_label: &str,
    y_label: &str,
    series: &[(String, Vec<(f64, f64)>)],
) -> String {
    let points = || series.iter().flat_map(|(_, p)| p.iter());
    let x_max = points().map(|p| p.0).fold(0.0, f64::max);
    let y_max = points().map(|p| p.1).fold(0.0, f64::max);
    let mut f = Frame::new(title, x_label, y_label, x_max, y_max);
    for (slot, ((label, points), colour)) in series.iter().zip(COLOURS).enumerate() {
        f.line(points, colour, label, slot);
    }
    f.finish()
}
