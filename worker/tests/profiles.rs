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
