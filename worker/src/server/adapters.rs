//! LoRA adapters as the sim backend serves them: names only (the sim computes no weights), so
//! that adapter-aware routing can be tested end to end. Some are resident from the start; others
//! in a catalog load on first use into a free slot, evicting the least recently used one when
//! all `max_loras` slots are taken, as vLLM does.

/// The adapters a worker serves.
#[derive(Debug, Clone, Default)]
pub struct AdapterSet {
    /// Resident adapters, least recently used first.
    resident: Vec<String>,
    /// Adapters that may be loaded (the resident ones included).
    catalog: Vec<String>,
    slots: usize,
}

impl AdapterSet {
    /// `resident` are loaded now; `catalog` may be loaded later; `slots` bounds how many are
    /// resident at once.
    pub fn new(
        resident: Vec<String>,
        catalog: Vec<String>,
        slots: usize,
    ) -> Result<AdapterSet, String> {
        if resident.len() > slots {
            return Err(format!(
                "{} adapters to load but --max-loras is {slots}",
                resident.len()
            ));
        }
        let mut all = resident.clone();
        all.extend(catalog.into_iter().filter(|c| !resident.contains(c)));
        if let Some(bad) = all.iter().find(|a| a.trim().is_empty()) {
            return Err(format!("adapter name `{bad}` is empty"));
        }
        Ok(AdapterSet {
            resident,
            catalog: all,
            slots,
        })
    }

    /// Makes `name` resident (loading it if it is in the catalog); false if it is unknown.
    pub fn admit(&mut self, name: &str) -> bool {
        if let Some(i) = self.resident.iter().position(|a| a == name) {
            let a = self.resident.remove(i);
            self.resident.push(a);
            return true;
        }
        if self.slots == 0 || !self.catalog.iter().any(|a| a == name) {
            return false;
        }
        if self.resident.len() == self.slots {
            self.resident.remove(0);
        }
        self.resident.push(name.to_string());
        true
    }

    pub fn resident(&self) -> &[String] {
        &self.resident
    }

    pub fn slots_free(&self) -> usize {
        self.slots - self.resident.len()
    }

    pub fn max_loras(&self) -> usize {
        self.slots
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn adapters_load_on_demand_and_evict_the_least_recently_used() {
        let mut s = AdapterSet::new(vec!["a".into()], vec!["b".into(), "c".into()], 2).unwrap();
        assert_eq!(s.slots_free(), 1);
        assert!(s.admit("b"));
        assert_eq!(s.slots_free(), 0);
        assert!(s.admit("a")); // a is now the most recent
        assert!(s.admit("c")); // evicts b
        assert_eq!(s.resident(), ["a", "c"]);
        assert!(!s.admit("zzz"));
        assert!(AdapterSet::new(vec!["a".into(), "b".into()], vec![], 1).is_err());
        assert!(!AdapterSet::default().admit("a"));
    }
}
