//! A request's id: the client's `x-request-id` if it is sane, else one made here.

use pingora_core::protocols::http::ServerSession;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;

/// The longest client id kept.
const MAX_CLIENT_ID: usize = 128;

/// The client's `x-request-id` if it is sane (1 to 128 printable ASCII characters), else a new
/// one: this process's 16 hex digits, then a count of at least 8.
pub fn of(session: &ServerSession) -> String {
    if let Some(id) = session
        .get_header("x-request-id")
        .and_then(|v| v.to_str().ok())
    {
        if !id.is_empty() && id.len() <= MAX_CLIENT_ID && id.bytes().all(|b| b.is_ascii_graphic()) {
            return id.to_string();
        }
    }
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    made(process(), COUNTER.fetch_add(1, Ordering::Relaxed))
}

/// This process, as a hash of its start time and pid, so that gateways' ids differ.
fn process() -> u64 {
    static PROCESS: OnceLock<u64> = OnceLock::new();
    *PROCESS.get_or_init(|| {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64);
        xxhash_rust::xxh3::xxh3_64(
            &[
                nanos.to_le_bytes(),
                u64::from(std::process::id()).to_le_bytes(),
            ]
            .concat(),
        )
    })
}

/// `{process:016x}{count:08x}`, written digit by digit: `format!`'s padding machinery costs
/// about a microsecond, on every request that brings no id.
fn made(process: u64, count: u64) -> String {
    let count_digits = (16 - count.leading_zeros() / 4).max(8);
    let mut id = String::with_capacity(16 + count_digits as usize);
    push_hex(&mut id, process, 16);
    push_hex(&mut id, count, count_digits);
    id
}

/// `value`'s last `digits` hex digits, lowercase.
fn push_hex(out: &mut String, value: u64, digits: u32) {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    for i in (0..digits).rev() {
        out.push(char::from(HEX[(value >> (4 * i)) as usize & 0xf]));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn a_made_id_is_what_format_writes(process: u64, count: u64) {
            prop_assert_eq!(made(process, count), format!("{process:016x}{count:08x}"));
        }
    }

    #[test]
    fn made_ids_at_the_edges() {
        for (process, count) in [(0, 0), (u64::MAX, u64::MAX), (1, 0xffff_ffff), (1, 1 << 32)] {
            assert_eq!(made(process, count), format!("{process:016x}{count:08x}"));
        }
        assert_eq!(made(0xab, 7), "00000000000000ab00000007");
    }
}
