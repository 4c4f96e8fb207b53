//! Results: a table on the terminal, `summary.json`, `requests.csv` (one row per request) and
//! two SVG plots (TTFT CDF; throughput and latency over time) in the output directory.

use crate::plot;
use crate::record::{RequestRecord, Stats, Summary};
use std::fmt::Write as _;
use std::path::Path;

pub fn write(dir: &Path, summary: &Summary, records: &[RequestRecord]) -> Result<(), String> {
    std::fs::create_dir_all(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let put = |name: &str, text: String| {
        let path = dir.join(name);
        std::fs::write(&path, text).map_err(|e| format!("{}: {e}", path.display()))
    };
    put(
        "summary.json",
        serde_json::to_string_pretty(summary).map_err(|e| e.to_string())?,
    )?;
    put("requests.csv", csv(records))?;
    put("ttft_cdf.svg", plot::ttft_cdf(records))?;
    put("over_time.svg", plot::over_time(records))?;
    Ok(())
}

fn csv(records: &[RequestRecord]) -> String {
    let mut s = String::from(
        "index,warmup,start_s,status,ttft_s,tpot_s,e2e_s,prompt_tokens,output_tokens,cached_tokens,replica,group,route,error\n",
    );
    let opt = |v: Option<f64>| v.map(|v| format!("{v:.6}")).unwrap_or_default();
    let num = |v: Option<u64>| v.map(|v| v.to_string()).unwrap_or_default();
    let quoted = |v: &Option<String>| v.as_deref().unwrap_or("").replace(['"', '\n', '\r'], " ");
    for r in records {
        let _ = writeln!(
            s,
            "{},{},{:.6},{},{},{},{:.6},{},{},{},{},{},\"{}\",\"{}\"",
            r.index,
            r.warmup,
            r.start_s,
            r.status,
            opt(r.ttft_s),
            opt(r.tpot_s()),
            r.e2e_s,
            num(r.prompt_tokens),
            num(r.output_tokens),
            num(r.cached_tokens),
            r.replica.as_deref().unwrap_or(""),
            r.group.as_deref().unwrap_or(""),
            quoted(&r.route),
            quoted(&r.error)
        );
    }
    s
}

/// The terminal table.
pub fn table(s: &Summary) -> String {
    let mut t = String::new();
    let ms = |x: f64| format!("{:>9.1}", x * 1000.0);
    let row = |t: &mut String, name: &str, st: &Stats| {
        let _ = writeln!(
            t,
            "{name:<10}{}{}{}{}",
            ms(st.mean),
            ms(st.p50),
            ms(st.p90),
            ms(st.p99)
        );
    };
    let _ = writeln!(
        t,
        "{:<10}{:>9}{:>9}{:>9}{:>9}",
        "ms", "mean", "p50", "p90", "p99"
    );
    row(&mut t, "TTFT", &s.ttft_s);
    row(&mut t, "TPOT", &s.tpot_s);
    row(&mut t, "ITL", &s.itl_s);
    row(&mut t, "e2e", &s.e2e_s);
    let _ = writeln!(
        t,
        "requests {} ok, {} failed, {} warm-up; {:.1} s; {:.2} req/s; {:.1} output tok/s",
        s.requests, s.failed, s.warmup, s.duration_s, s.requests_per_s, s.output_tokens_per_s
    );
    if let Some(g) = s.goodput_requests_per_s {
        let _ = writeln!(t, "goodput {g:.2} req/s within {:?}", s.slo);
    }
    let ideal = s
        .ideal_cached_token_ratio
        .map(|i| format!(" (ideal {i:.3})"))
        .unwrap_or_default();
    let _ = writeln!(t, "cached-token ratio {:.3}{ideal}", s.cached_token_ratio);
    if !s.requests_per_replica.is_empty() {
        let per: Vec<String> = s
            .requests_per_replica
            .iter()
            .map(|(k, v)| format!("{k}={v}"))
            .collect();
        let _ = writeln!(
            t,
            "per replica: {} (max/min {:.2})",
            per.join(" "),
            s.replica_imbalance
        );
    }
    let _ = writeln!(t, "({})", s.definitions);
    t
}
