//! The signals a decision weighs, one enum indexing weights, scores and names alike: adding a
//! signal is one variant here, and the config, explain, `x-kvgate-route` and metrics all follow.

use serde::de::{Deserializer, MapAccess, Visitor};
use serde::ser::{SerializeMap, Serializer};
use serde::{Deserialize, Serialize};
use std::fmt;
use std::ops::{Index, IndexMut};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Signal {
    /// Fraction of the prompt's prefix the replica is believed to hold.
    Prefix,
    /// 1 for the bounded-load consistent-hash owner of the prompt's first chunks.
    Ring,
    /// 1 for an idle replica, falling towards 0 as its load (requests in flight from this
    /// gateway plus those its agent reports queued) nears the fleet's busiest.
    Load,
    /// 1 for the replica with the least prefill ahead of this request's first token (its
    /// prefill backlog plus the share of the prompt it does not hold), falling as that work
    /// grows: a replica with one prompt's length more work than the least scores at most 0.5.
    Prefill,
    /// 1 unless the replica's agent reports are stale (then 0).
    Fresh,
    /// For the replica the request's session is bound to, unless it is saturated: the share
    /// of the prompt the prefix index does not show it holding (1 for a prompt it cannot
    /// place); 0 elsewhere.
    Session,
    /// The fraction of its KV cache free, as its agent reports (1 without reports).
    Kv,
    /// Adapter residency: 1 resident, 0.5 a free slot, 0 neither.
    Adapter,
    /// For a prompt of a new group that no replica holds any of: 1 for a replica that placed
    /// no new group's blocks recently, 0.5 for one that placed its fair share, 0 for twice
    /// that or more, or when saturated (0 for every replica when the prompt is not such a
    /// one). Groups recur: where the first request lands, the rest follow.
    Spread,
}

impl Signal {
    pub const COUNT: usize = 9;
    pub const ALL: [Signal; Signal::COUNT] = [
        Signal::Prefix,
        Signal::Ring,
        Signal::Load,
        Signal::Prefill,
        Signal::Fresh,
        Signal::Session,
        Signal::Kv,
        Signal::Adapter,
        Signal::Spread,
    ];

    /// Its name in the config, explain output and headers.
    pub fn name(self) -> &'static str {
        match self {
            Signal::Prefix => "prefix",
            Signal::Ring => "ring",
            Signal::Load => "load",
            Signal::Prefill => "prefill",
            Signal::Fresh => "fresh",
            Signal::Session => "session",
            Signal::Kv => "kv",
            Signal::Adapter => "adapter",
            Signal::Spread => "spread",
        }
    }

    pub fn from_name(name: &str) -> Option<Signal> {
        Signal::ALL.into_iter().find(|s| s.name() == name)
    }

    /// Every name, for error messages.
    pub fn names() -> String {
        Signal::ALL.map(Signal::name).join(", ")
    }
}

/// A value per signal.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct BySignal(pub [f64; Signal::COUNT]);

impl BySignal {
    pub fn iter(&self) -> impl Iterator<Item = (Signal, f64)> + '_ {
        Signal::ALL.into_iter().map(|s| (s, self[s]))
    }

    /// The weighted sum of `self` by `weights`.
    pub fn weighted(&self, weights: &BySignal) -> f64 {
        self.iter().map(|(s, v)| v * weights[s]).sum()
    }
}

impl Index<Signal> for BySignal {
    type Output = f64;
    fn index(&self, s: Signal) -> &f64 {
        &self.0[s as usize]
    }
}

impl IndexMut<Signal> for BySignal {
    fn index_mut(&mut self, s: Signal) -> &mut f64 {
        &mut self.0[s as usize]
    }
}

/// Written as a map from each signal's name to its value.
impl Serialize for BySignal {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        let mut map = serializer.serialize_map(Some(Signal::COUNT))?;
        for (s, v) in self.iter() {
            map.serialize_entry(s.name(), &v)?;
        }
        map.end()
    }
}

/// Read from a map of signal names; a name not given keeps its value in `base`.
pub(crate) fn read_map<'de, D: Deserializer<'de>>(
    deserializer: D,
    base: BySignal,
) -> Result<BySignal, D::Error> {
    struct Names(BySignal);
    impl<'de> Visitor<'de> for Names {
        type Value = BySignal;
        fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
            write!(f, "a map of signal names ({}) to numbers", Signal::names())
        }
        fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<BySignal, A::Error> {
            let mut values = self.0;
            while let Some(name) = map.next_key::<String>()? {
                let Some(s) = Signal::from_name(&name) else {
                    return Err(serde::de::Error::custom(format!(
                        "unknown signal `{name}` (known: {})",
                        Signal::names()
                    )));
                };
                values[s] = map.next_value()?;
            }
            Ok(values)
        }
    }
    deserializer.deserialize_map(Names(base))
}

impl<'de> Deserialize<'de> for BySignal {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        read_map(deserializer, BySignal::default())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_signal_has_its_own_name_and_slot() {
        for (i, s) in Signal::ALL.into_iter().enumerate() {
            assert_eq!(s as usize, i);
            assert_eq!(Signal::from_name(s.name()), Some(s));
        }
        let mut names: Vec<&str> = Signal::ALL.map(Signal::name).to_vec();
        names.dedup();
        assert_eq!(names.len(), Signal::COUNT);
    }

    #[test]
    fn reads_and_writes_a_map_by_name() {
        let v: BySignal = serde_json::from_str(r#"{"prefix": 2, "kv": 0.5}"#).unwrap();
        assert_eq!(v[Signal::Prefix], 2.0);
        assert_eq!(v[Signal::Kv], 0.5);
        assert_eq!(v[Signal::Load], 0.0);
        let back: BySignal = serde_json::from_value(serde_json::to_value(v).unwrap()).unwrap();
        assert_eq!(back, v);
        let e = serde_json::from_str::<BySignal>(r#"{"prefx": 1}"#).unwrap_err();
        assert!(e.to_string().contains("unknown signal `prefx`"), "{e}");
    }
}
