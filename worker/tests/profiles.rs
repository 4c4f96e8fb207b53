//! Every hardware profile in `config/profiles/` loads and validates, and gives sane figures.
#![allow(clippy::unwrap_used, clippy::panic)]

use kvgate_worker::backend::profile::Profile;

#[test]
fn every_profile_in_config_is_valid() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../config/profiles");
    let mut checked = 0;
    for entry in std::fs::read_dir(&dir).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_some_and(|e| e == "yaml") {
            let p = Profile::load(&path).unwrap_or_else(|e| panic!("{e}"));
            assert!(
                p.kv_capacity_tokens() > 100_000,
                "{}: KV capacity {}",
                path.display(),
                p.kv_capacity_tokens()
            );
            assert!(
                p.decode_tokens_per_second(1000) > 10.0,
                "{}",
                path.display()
            );
            checked += 1;
        }
    }
    assert!(
        checked >= 2,
        "expected the H200 and H100 profiles in {}",
        dir.display()
    );
}

#[test]
fn a_bad_profile_is_rejected_with_the_field() {
    let path = std::env::temp_dir().join(format!("kvgate-bad-profile-{}.yaml", std::process::id()));
    let good = std::fs::read_to_string(
        std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../config/profiles/h200-llama-3.1-8b-bf16.yaml"),
    )
    .unwrap();
    std::fs::write(&path, good.replace("bandwidth: 0.8", "bandwidth: 1.8")).unwrap();
    let e = Profile::load(&path).unwrap_err();
    assert!(e.contains("efficiency.bandwidth"), "{e}");
    std::fs::write(&path, good.replace("step_overhead_us", "step_overhed_us")).unwrap();
    assert!(Profile::load(&path)
        .unwrap_err()
        .contains("step_overhed_us"));
    std::fs::remove_file(&path).ok();
}

fn profiles() -> Vec<Profile> {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../config/profiles");
    let mut paths: Vec<_> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "yaml"))
        .collect();
    paths.sort();
    paths.iter().map(|p| Profile::load(p).unwrap()).collect()
}

proptest::proptest! {
    /// However a prefill is split over steps (each of at most `budget` of its tokens), and
    /// whatever other requests' slices share those steps, the steps take at least the floor
    /// for the fewest steps the budget allows; one step alone takes exactly its floor.
    #[test]
    fn no_split_of_a_prefill_beats_its_floor(
        start in 0usize..20_000,
        len in 1usize..20_000,
        budget in 1usize..4_096,
        cuts in proptest::collection::vec(0.0f64..1.0, 0..12),
        others in proptest::collection::vec((0usize..30_000, 1usize..64), 0..6),
    ) {
        for profile in profiles() {
            let steps = len.div_ceil(budget);
            let floor = profile.prefill_floor_seconds(start, len, budget);
            // A split into chunks of at most `budget`: the cuts' fractions, then the budget.
            let mut bounds: Vec<usize> = cuts.iter().map(|c| (c * len as f64) as usize).collect();
            bounds.extend([0, len]);
            bounds.sort_unstable();
            bounds.dedup();
            let mut total = 0.0;
            for pair in bounds.windows(2) {
                let mut at = pair[0];
                while at < pair[1] {
                    let n = (pair[1] - at).min(budget);
                    let slices = std::iter::once((start + at, n)).chain(others.iter().copied());
                    total += profile.step_seconds(slices);
                    at += n;
                }
            }
            proptest::prop_assert!(total >= floor * (1.0 - 1e-12), "{total} < {floor}");
            // Alone in the fewest steps, where full steps are compute-bound (as at the
            // scheduler's default budget), it is at most one token's step over the floor: the
            // floor is nearly reached, not just a bound.
            let alone: f64 = (0..steps)
                .map(|i| {
                    let at = i * budget;
                    profile.step_seconds(std::iter::once((start + at, (len - at).min(budget))))
                })
                .sum();
            let slack = profile.step_seconds(std::iter::once((start + len, 1)));
            proptest::prop_assert!(alone >= floor * (1.0 - 1e-12), "{alone} < {floor}");
            if budget >= 1_024 {
                proptest::prop_assert!(alone <= floor + slack, "{alone} > {floor} + {slack}");
            }
            if steps == 1 {
                let alone = profile.step_seconds(std::iter::once((start, len)));
                proptest::prop_assert_eq!(floor, alone);
            }
        }
    }
}
