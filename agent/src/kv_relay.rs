//! Relaying a kvgate worker's KV events into reports: each report carries the event batches
//! published since the previous one (`GET /kv/events?from=N&follow=false`), after a whole
//! snapshot (`GET /kv/snapshot`) whenever the relay has lost the thread: at start, after the
//! worker restarted, when the worker no longer retains the batches it needs, or when a
//! gateway asked for one.

use crate::http;
use kvgate_protocol::kv_events::{KvEventBatch, KvSnapshot, KV_EVENTS_VERSION};
use kvgate_protocol::telemetry::KvUpdate;
use std::time::Duration;

#[derive(Debug, Default)]
pub struct KvRelay {
    /// The next batch to relay; `None` until a snapshot sets it.
    next: Option<u64>,
    /// The worker instance `next` belongs to.
    instance: u64,
}

impl KvRelay {
    /// The next report's KV update for the worker at `url`, whose instance is `instance`.
    pub async fn update(
        &mut self,
        url: &str,
        instance: u64,
        timeout: Duration,
    ) -> Result<KvUpdate, String> {
        if instance != self.instance {
            self.instance = instance;
            self.next = None;
        }
        let mut update = KvUpdate::default();
        for _ in 0..2 {
            let from = match self.next {
                Some(from) => from,
                None => {
                    let snapshot = fetch_snapshot(url, timeout).await?;
                    self.next = Some(snapshot.seq + 1);
                    let from = snapshot.seq + 1;
                    update = KvUpdate {
                        snapshot: Some(snapshot),
                        batches: Vec::new(),
                    };
                    from
                }
            };
            let path = format!("/kv/events?from={from}&follow=false");
            let (status, body) = http::request(http::Method::GET, url, &path, &[], None, timeout)
                .await
                .map_err(|e| e.to_string())?;
            match status {
                200 => {
                    update.batches = parse_batches(&body)?;
                    if let Some(last) = update.batches.last() {
                        self.next = Some(last.seq + 1);
                    }
                    return Ok(update);
                }
                // The batches it needs are gone: start over from a snapshot (once).
                410 => self.next = None,
                other => return Err(format!("{url}{path}: status {other}")),
            }
        }
        Err(format!("{url}: KV events keep moving past each snapshot"))
    }

    /// A gateway lost track: the next update starts with a snapshot.
    pub fn resync(&mut self) {
        self.next = None;
    }
}

async fn fetch_snapshot(url: &str, timeout: Duration) -> Result<KvSnapshot, String> {
    let text = http::get_text(url, "/kv/snapshot", timeout)
        .await
        .map_err(|e| e.to_string())?;
    let snapshot: KvSnapshot =
        serde_json::from_str(&text).map_err(|e| format!("{url}/kv/snapshot: {e}"))?;
    check_version(snapshot.version)?;
    Ok(snapshot)
}

/// NDJSON batches, in sequence.
fn parse_batches(body: &[u8]) -> Result<Vec<KvEventBatch>, String> {
    let mut batches: Vec<KvEventBatch> = Vec::new();
    for line in body.split(|&b| b == b'\n').filter(|l| !l.is_empty()) {
        let batch: KvEventBatch =
            serde_json::from_slice(line).map_err(|e| format!("/kv/events: {e}"))?;
        check_version(batch.version)?;
        if let Some(prev) = batches.last() {
            if batch.seq != prev.seq + 1 {
                return Err(format!(
                    "/kv/events: batch {} follows {}",
                    batch.seq, prev.seq
                ));
            }
        }
        batches.push(batch);
    }
    Ok(batches)
}

fn check_version(version: u32) -> Result<(), String> {
    if version == KV_EVENTS_VERSION {
        Ok(())
    } else {
        Err(format!(
            "KV events version {version} is not supported (this agent speaks {KV_EVENTS_VERSION})"
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn batches_must_be_in_sequence() {
        let line = |seq: u64| {
            format!("{{\"version\":1,\"seq\":{seq},\"events\":[{{\"type\":\"all_cleared\"}}]}}\n")
        };
        let ok = format!("{}{}", line(4), line(5));
        assert_eq!(parse_batches(ok.as_bytes()).map(|b| b.len()), Ok(2));
        let gap = format!("{}{}", line(4), line(6));
        assert!(parse_batches(gap.as_bytes()).is_err());
        assert_eq!(parse_batches(b"").map(|b| b.len()), Ok(0));
        assert!(parse_batches(b"{\"version\":9,\"seq\":1,\"events\":[]}").is_err());
    }
}
