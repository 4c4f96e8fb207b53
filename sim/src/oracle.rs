//! The oracle: the best routing found for a run by something that knows all of it in advance
//! (every arrival, every engine's step model), one TTFT figure at a time. For a figure (mean,
//! P50 or P90) it starts from the routes of every run it is given — the run's policies, the
//! peers', kvgate's presets, and the look-ahead that sends each request where its first token
//! comes soonest — keeps the lowest, and improves on it by local search. Each candidate is a
//! replay of whole routes through the same simulation, so each figure it reports is that of a
//! run like any other, and never above any start's. One routing need not be the lowest on
//! every figure at once (spreading a prefix over idle replicas lowers the median, keeping it
//! on one lowers the tail), so each figure has its own. No router could be deployed like this;
//! it is the bound the others are measured against.

use crate::config::SimConfig;
use crate::fleet::{simulate_with_progress, Outcome, Progress};
use crate::routers::{Router, Routes, Turn};
use kvgate_bench::{Job, Load, Stats};
use std::cmp::Ordering;
use std::collections::{HashMap, HashSet};
use std::sync::Arc;

/// The routing the search kept for one figure, and how it got there.
#[derive(Debug, Clone)]
pub struct Searched {
    pub figure: Figure,
    pub outcome: Outcome,
    /// The start it improved on.
    pub start: String,
    /// Replays run by the search (starts not counted), and how many of them it kept.
    pub replays: usize,
    pub kept: usize,
}

/// The TTFT figures the oracle searches for.
pub const FIGURES: [Figure; 3] = [Figure::Mean, Figure::P50, Figure::P90];

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Figure {
    Mean,
    P50,
    P90,
}

impl Figure {
    pub fn name(self) -> &'static str {
        match self {
            Figure::Mean => "mean",
            Figure::P50 => "p50",
            Figure::P90 => "p90",
        }
    }

    pub fn of(self, s: &Stats) -> f64 {
        match self {
            Figure::Mean => s.mean,
            Figure::P50 => s.p50,
            Figure::P90 => s.p90,
        }
    }

    /// Where in a run's TTFTs, sorted, lowering one lowers this figure: at and above its
    /// quantile (anywhere for the mean, where the slowest count most).
    fn quantile(self) -> Option<f64> {
        match self {
            Figure::Mean => None,
            Figure::P50 => Some(0.5),
            Figure::P90 => Some(0.9),
        }
    }
}

/// A run's routes with each turn's TTFT in it (warm-up left out, as in its summary).
#[derive(Clone)]
struct Candidate {
    outcome: Outcome,
    stats: Stats,
    ttft: HashMap<Turn, f64>,
}

impl Candidate {
    fn new(outcome: Outcome) -> Candidate {
        let by_id: HashMap<u64, f64> = outcome
            .records
            .iter()
            .filter(|r| !r.warmup && r.ok())
            .filter_map(|r| Some((r.index as u64, r.ttft_s?)))
            .collect();
        let ttft = outcome
            .routes
            .iter()
            .filter_map(|(turn, id, _)| Some((turn, *by_id.get(&id)?)))
            .collect();
        let summary = kvgate_bench::summarize(
            &outcome.records,
            Default::default(),
            None,
            Default::default(),
        );
        Candidate {
            stats: summary.ttft_s,
            ttft,
            outcome,
        }
    }

    fn ttft(&self, turn: Turn) -> f64 {
        self.ttft.get(&turn).copied().unwrap_or(f64::INFINITY)
    }

    /// Lower is better: the figure, then the other figures (the sum of all three).
    fn key(&self, figure: Figure) -> (f64, f64) {
        let s = &self.stats;
        (figure.of(s), s.mean + s.p50 + s.p90)
    }

    /// The turns whose TTFT sets `figure`, most telling first.
    fn setting(&self, figure: Figure) -> Vec<Turn> {
        let mut turns: Vec<(f64, Turn)> = self.ttft.iter().map(|(&t, &s)| (s, t)).collect();
        turns.sort_by(|a, b| a.0.total_cmp(&b.0).then(a.1.cmp(&b.1)));
        let n = turns.len();
        match figure.quantile() {
            None => turns.into_iter().rev().map(|(_, t)| t).collect(),
            Some(q) => {
                let at = ((q * (n.max(1) - 1) as f64).floor() as usize).min(n.saturating_sub(1));
                turns.into_iter().skip(at).map(|(_, t)| t).collect()
            }
        }
    }

    /// The turns in the order they were sent.
    fn sent_order(&self) -> Vec<Turn> {
        let mut order: Vec<(u64, Turn)> = self
            .outcome
            .routes
            .iter()
            .map(|(t, id, _)| (id, t))
            .collect();
        order.sort_unstable();
        order.into_iter().map(|(_, t)| t).collect()
    }
}

/// The runs a search starts from, each read once for every figure searched.
pub struct Starts(Vec<(String, Candidate)>);

impl Starts {
    /// `runs`: name and outcome, at least one.
    pub fn new(runs: Vec<(String, Outcome)>) -> Result<Starts, String> {
        if runs.is_empty() {
            return Err("the oracle needs at least one run to start from".into());
        }
        Ok(Starts(
            runs.into_iter()
                .map(|(name, outcome)| (name, Candidate::new(outcome)))
                .collect(),
        ))
    }
}

/// Searches for the routing of `jobs` with the lowest `figure`, starting from `starts`, with
/// at most `budget` replays.
pub fn search(
    config: &SimConfig,
    jobs: &[Job],
    load: Load,
    starts: &Starts,
    figure: Figure,
    budget: usize,
    progress: &mut dyn FnMut(Progress),
) -> Result<Searched, String> {
    let mut starts: Vec<&(String, Candidate)> = starts.0.iter().collect();
    starts.sort_by(|a, b| {
        let (ka, kb) = (a.1.key(figure), b.1.key(figure));
        ka.partial_cmp(&kb).unwrap_or(Ordering::Equal)
    });
    let (start, first) = starts[0];
    let mut search = Search {
        best: first.clone(),
        replays: 0,
        kept: 0,
    };
    let mut replay = |search: &mut Search, routes: Routes| -> Result<bool, String> {
        if routes == search.best.outcome.routes {
            return Ok(false);
        }
        search.replays += 1;
        let router = Router::Replay(Arc::new(routes));
        let tried = Candidate::new(simulate_with_progress(
            config, jobs, load, &router, progress,
        )?);
        let better = tried.key(figure) < search.best.key(figure);
        if better {
            search.kept += 1;
            search.best = tried;
        }
        Ok(better)
    };
    // Each turn where the run it was sent in gave it its soonest first token.
    for (_, other) in starts.iter().skip(1) {
        if search.replays >= budget {
            break;
        }
        let mut mixed = search.best.outcome.routes.clone();
        for (turn, _, replica) in other.outcome.routes.iter() {
            if other.ttft(turn) < search.best.ttft(turn) {
                mixed.set(turn, replica);
            }
        }
        replay(&mut search, mixed)?;
    }
    // A stretch of the run at a time (in the order turns were sent) routed as the runner-up
    // routed it.
    if let Some((_, model)) = starts.get(1) {
        for stretches in [4, 16] {
            let order = search.best.sent_order();
            let n = order.len();
            for stretch in 0..stretches {
                if search.replays >= budget {
                    break;
                }
                let mut mixed = search.best.outcome.routes.clone();
                for &turn in &order[stretch * n / stretches..(stretch + 1) * n / stretches] {
                    if let Some(replica) = model.outcome.routes.replica(turn) {
                        mixed.set(turn, replica);
                    }
                }
                replay(&mut search, mixed)?;
            }
        }
    }
    // The turns that set the figure, each to where some start served it soonest (or, where
    // every start sent it here, the next replica): many at once while that pays, fewer when
    // it does not.
    let elsewhere = |turn: Turn, here: usize| {
        starts
            .iter()
            .filter_map(|(_, c)| Some((c.ttft(turn), c.outcome.routes.replica(turn)?)))
            .filter(|&(_, r)| r != here)
            .min_by(|a, b| a.0.total_cmp(&b.0))
            .map_or((here + 1) % config.replicas, |(_, r)| r)
    };
    let mut batch = (search.best.ttft.len() / 16).max(1);
    let mut tried: HashSet<Turn> = HashSet::new();
    while search.replays < budget {
        let best = &search.best;
        let turns: Vec<Turn> = best
            .setting(figure)
            .into_iter()
            .filter(|t| !tried.contains(t))
            .take(batch)
            .collect();
        if turns.is_empty() {
            break;
        }
        let mut moved = best.outcome.routes.clone();
        for &turn in &turns {
            tried.insert(turn);
            if let Some(here) = moved.replica(turn) {
                moved.set(turn, elsewhere(turn, here));
            }
        }
        if replay(&mut search, moved)? {
            // What sets the figure has changed: every turn may be worth a try again.
            tried.clear();
        } else if batch > 1 {
            batch /= 2;
            for turn in turns {
                tried.remove(&turn);
            }
        }
    }
    Ok(Searched {
        figure,
        outcome: search.best.outcome,
        start: start.to_string(),
        replays: search.replays,
        kept: search.kept,
    })
}

struct Search {
    best: Candidate,
    replays: usize,
    kept: usize,
}
