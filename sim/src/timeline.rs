//! Each replica's load and KV use over a run: the samples, their CSV and their plots.

use std::fmt::Write as _;
use std::path::Path;

#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ReplicaSample {
    pub t_s: f64,
    pub replica: u32,
    pub running: u32,
    pub waiting: u32,
    pub kv_used: u32,
    pub kv_total: u32,
}

#[derive(Debug, Clone, Default)]
pub struct Timeline {
    names: Vec<String>,
    samples: Vec<ReplicaSample>,
}

/// Replicas drawn one line each; a larger fleet is drawn as its least, median and most loaded.
const LINES: usize = 8;

impl Timeline {
    pub fn new(names: Vec<String>) -> Self {
        Timeline {
            names,
            samples: Vec::new(),
        }
    }

    pub fn push(&mut self, sample: ReplicaSample) {
        self.samples.push(sample);
    }

    pub fn samples(&self) -> &[ReplicaSample] {
        &self.samples
    }

    pub fn to_csv(&self) -> String {
        let mut csv = String::from("t_s,replica,running,waiting,kv_blocks_used,kv_blocks_total\n");
        for s in &self.samples {
            let _ = writeln!(
                csv,
                "{:.3},{},{},{},{},{}",
                s.t_s, self.names[s.replica as usize], s.running, s.waiting, s.kv_used, s.kv_total
            );
        }
        csv
    }

    /// `replicas.csv`, `replica_load.svg` (requests running and waiting) and `replica_kv.svg`
    /// (fraction of KV blocks in use) in `dir`.
    pub fn write(&self, dir: &Path) -> Result<(), String> {
        let write = |name: &str, text: String| {
            let path = dir.join(name);
            std::fs::write(&path, text).map_err(|e| format!("cannot write {}: {e}", path.display()))
        };
        write("replicas.csv", self.to_csv())?;
        let load = self.series(|s| f64::from(s.running + s.waiting));
        write(
            "replica_load.svg",
            kvgate_bench::plot::lines(
                "Requests on each replica",
                "time (s)",
                "running + waiting",
                &load,
            ),
        )?;
        let kv = self.series(|s| f64::from(s.kv_used) / f64::from(s.kv_total.max(1)));
        write(
            "replica_kv.svg",
            kvgate_bench::plot::lines(
                "KV use on each replica",
                "time (s)",
                "fraction of blocks used",
                &kv,
            ),
        )
    }

    /// One line per replica, or for a larger fleet the least, median and most at each instant.
    fn series(&self, value: impl Fn(&ReplicaSample) -> f64) -> Vec<(String, Vec<(f64, f64)>)> {
        if self.names.len() <= LINES {
            return self
                .names
                .iter()
                .enumerate()
                .map(|(i, name)| {
                    let points = self
                        .samples
                        .iter()
                        .filter(|s| s.replica as usize == i)
                        .map(|s| (s.t_s, value(s)))
                        .collect();
                    (name.clone(), points)
                })
                .collect();
        }
        let mut lines: [Vec<(f64, f64)>; 3] = Default::default();
        for instant in self.samples.chunk_by(|a, b| a.t_s == b.t_s) {
            let mut values: Vec<f64> = instant.iter().map(&value).collect();
            values.sort_by(f64::total_cmp);
            let t = instant[0].t_s;
            lines[0].push((t, values[0]));
            lines[1].push((t, values[values.len() / 2]));
            lines[2].push((t, values[values.len() - 1]));
        }
        ["least", "median", "most"]
            .into_iter()
            .map(String::from)
            .zip(lines)
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(t_s: f64, replica: u32, running: u32) -> ReplicaSample {
        ReplicaSample {
            t_s,
            replica,
            running,
            waiting: 0,
            kv_used: running,
            kv_total: 10,
        }
    }

    #[test]
    fn a_large_fleet_is_drawn_as_its_spread() {
        let names: Vec<String> = (0..9).map(|i| format!("r{i}")).collect();
        let mut t = Timeline::new(names);
        // As the simulator samples: every replica at one instant, then the next instant.
        for (t_s, factor) in [(0.0, 1), (0.1, 2)] {
            for r in 0..9 {
                t.push(sample(t_s, r, factor * r));
            }
        }
        let series = t.series(|s| f64::from(s.running));
        assert_eq!(series.len(), 3);
        assert_eq!(series[0].1, vec![(0.0, 0.0), (0.1, 0.0)]);
        assert_eq!(series[1].1, vec![(0.0, 4.0), (0.1, 8.0)]);
        assert_eq!(series[2].1, vec![(0.0, 8.0), (0.1, 16.0)]);
        assert!(t.to_csv().contains("\n0.100,r8,16,0,16,10\n"));
    }
}
