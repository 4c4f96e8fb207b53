//! Reading request traces: Mooncake JSONL (timestamps in ms, lengths, prefix block ids) and
//! Azure LLM inference CSV (timestamps, lengths).

use std::collections::HashSet;
use std::path::Path;

#[derive(Debug, Clone, PartialEq)]
pub struct TraceRequest {
    /// Seconds after the trace's first request.
    pub at_s: f64,
    pub input_length: usize,
    pub output_length: u32,
    pub hash_ids: Vec<u64>,
}

fn read(path: &Path) -> Result<String, String> {
    std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))
}

/// The first `limit` requests of a Mooncake trace.
pub fn mooncake(path: &Path, limit: usize) -> Result<Vec<TraceRequest>, String> {
    #[derive(serde::Deserialize)]
    struct Row {
        timestamp: f64,
        input_length: usize,
        output_length: u32,
        hash_ids: Vec<u64>,
    }
    let text = read(path)?;
    let mut out = Vec::new();
    for (i, line) in text
        .lines()
        .filter(|l| !l.trim().is_empty())
        .take(limit)
        .enumerate()
    {
        let row: Row = serde_json::from_str(line)
            .map_err(|e| format!("{} line {}: {e}", path.display(), i + 1))?;
        out.push(TraceRequest {
            at_s: row.timestamp / 1000.0,
            input_length: row.input_length,
            output_length: row.output_length,
            hash_ids: row.hash_ids,
        });
    }
    if let Some(first) = out.first().map(|r| r.at_s) {
        for r in &mut out {
            r.at_s -= first;
        }
    }
    Ok(out)
}

/// Share of prompt tokens an unbounded cache reuses, replaying in order: a block is reused
/// when its id was seen before (whole blocks; the trace's own definition).
pub fn mooncake_ideal_reuse(trace: &[TraceRequest], warmup: usize) -> f64 {
    let mut seen = HashSet::new();
    let (mut reused, mut total) = (0usize, 0usize);
    for (i, r) in trace.iter().enumerate() {
        let measured = i >= warmup;
        if measured {
            total += r.input_length;
        }
        let mut run = true;
        for (k, h) in r.hash_ids.iter().enumerate() {
            let fresh = seen.insert(*h);
            if run && !fresh {
                if measured {
                    reused += 512.min(r.input_length.saturating_sub(k * 512));
                }
            } else {
                run = false;
            }
        }
    }
    if total == 0 {
        0.0
    } else {
        reused as f64 / total as f64
    }
}

/// The first `limit` requests of an Azure trace (`TIMESTAMP,ContextTokens,GeneratedTokens`,
/// timestamps `YYYY-MM-DD HH:MM:SS.fffffff`).
pub fn azure(path: &Path, limit: usize) -> Result<Vec<TraceRequest>, String> {
    let text = read(path)?;
    let mut lines = text.lines();
    let header = lines.next().unwrap_or_default();
    if !header.starts_with("TIMESTAMP") {
        return Err(format!(
            "{}: expected a TIMESTAMP,ContextTokens,GeneratedTokens header",
            path.display()
        ));
    }
    let mut out = Vec::new();
    for (i, line) in lines
        .filter(|l| !l.trim().is_empty())
        .take(limit)
        .enumerate()
    {
        let bad = |what: &str| format!("{} line {}: {what}: {line:?}", path.display(), i + 2);
        let mut f = line.split(',');
        let (Some(ts), Some(input), Some(output)) = (f.next(), f.next(), f.next()) else {
            return Err(bad("expected three fields"));
        };
        out.push(TraceRequest {
            at_s: timestamp_s(ts).ok_or_else(|| bad("bad timestamp"))?,
            input_length: input.trim().parse().map_err(|_| bad("bad ContextTokens"))?,
            output_length: output
                .trim()
                .parse()
                .map_err(|_| bad("bad GeneratedTokens"))?,
            hash_ids: Vec::new(),
        });
    }
    if let Some(first) = out.first().map(|r| r.at_s) {
        for r in &mut out {
            r.at_s -= first;
        }
    }
    Ok(out)
}

/// Seconds since the Unix epoch of `YYYY-MM-DD HH:MM:SS[.frac]` (UTC).
fn timestamp_s(ts: &str) -> Option<f64> {
    let (date, time) = ts.trim().split_once(' ')?;
    let mut d = date.split('-').map(|p| p.parse::<i64>().ok());
    let (y, m, day) = (d.next()??, d.next()??, d.next()??);
    let mut t = time.split(':');
    let (h, min, s) = (
        t.next()?.parse::<f64>().ok()?,
        t.next()?.parse::<f64>().ok()?,
        t.next()?.parse::<f64>().ok()?,
    );
    Some(days_from_civil(y, m, day) as f64 * 86_400.0 + h * 3600.0 + min * 60.0 + s)
}

/// Days since 1970-01-01 of a proleptic Gregorian date (Howard Hinnant's algorithm).
fn days_from_civil(y: i64, m: i64, d: i64) -> i64 {
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let mp = (m + 9) % 12;
    let doy = (153 * mp + 2) / 5 + d - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timestamps_and_reuse() {
        assert_eq!(days_from_civil(1970, 1, 1), 0);
        assert_eq!(days_from_civil(2000, 3, 1), 11_017);
        let a = timestamp_s("2023-11-16 18:17:03.9799600").unwrap_or_default();
        let b = timestamp_s("2023-11-17 00:00:00").unwrap_or_default();
        assert!((b - a - (5.0 * 3600.0 + 42.0 * 60.0 + 56.02004)).abs() < 1e-6);
        let r = |ids: Vec<u64>, len| TraceRequest {
            at_s: 0.0,
            input_length: len,
            output_length: 1,
            hash_ids: ids,
        };
        // Second request reuses blocks 0 and 1 (1024 tokens) of its 1100.
        let trace = [r(vec![0, 1, 2], 1500), r(vec![0, 1, 3], 1100)];
        let reuse = mooncake_ideal_reuse(&trace, 0);
        assert!((reuse - 1024.0 / 2600.0).abs() < 1e-9, "{reuse}");
        // With the first as warm-up, only the second is measured.
        let reuse = mooncake_ideal_reuse(&trace, 1);
        assert!((reuse - 1024.0 / 1100.0).abs() < 1e-9, "{reuse}");
    }
}
