//! The oracle's bound, checked on a run: no policy's mean, P50 or P90 TTFT below the oracle's.

use kvgate_bench::Summary;

/// Every way a policy beat the oracle in `results` (name, summary), as text; `None` when no
/// oracle ran.
pub fn oracle_bound(results: &[(String, Summary)]) -> Option<Result<(), Vec<String>>> {
    let (_, oracle) = results.iter().find(|(n, _)| n == "oracle")?;
    let beaten: Vec<String> = results
        .iter()
        .filter(|(n, _)| n != "oracle")
        .flat_map(|(n, s)| {
            [
                ("mean", s.ttft_s.mean, oracle.ttft_s.mean),
                ("P50", s.ttft_s.p50, oracle.ttft_s.p50),
                ("P90", s.ttft_s.p90, oracle.ttft_s.p90),
            ]
            .into_iter()
            .filter(|(_, theirs, ours)| theirs < ours)
            .map(move |(q, theirs, ours)| {
                format!(
                    "{n}'s {q} TTFT {:.1} ms < the oracle's {:.1} ms",
                    theirs * 1e3,
                    ours * 1e3
                )
            })
        })
        .collect();
    Some(if beaten.is_empty() {
        Ok(())
    } else {
        Err(beaten)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn summary(p50: f64, p90: f64) -> Summary {
        let mut s = kvgate_bench::summarize(&[], Default::default(), None, Default::default());
        s.ttft_s.p50 = p50;
        s.ttft_s.p90 = p90;
        s
    }

    #[test]
    fn a_policy_below_the_oracle_breaks_the_bound() {
        let oracle = ("oracle".to_string(), summary(0.010, 0.050));
        let slower = ("kvgate".to_string(), summary(0.010, 0.060));
        assert_eq!(oracle_bound(std::slice::from_ref(&slower)), None);
        assert_eq!(
            oracle_bound(&[slower.clone(), oracle.clone()]),
            Some(Ok(()))
        );
        let faster = ("llm-d".to_string(), summary(0.011, 0.040));
        assert_eq!(
            oracle_bound(&[oracle, slower, faster]),
            Some(Err(vec![
                "llm-d's P90 TTFT 40.0 ms < the oracle's 50.0 ms".to_string()
            ]))
        );
    }
}
