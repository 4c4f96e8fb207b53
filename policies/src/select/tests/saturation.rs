//! Saturation: what a holder keeps and what it yields at its load cap, its floor, a full KV
//! cache and a full queue.

use super::*;

#[test]
fn saturated_holder_yields_its_prefix() {
    let mut p = policy_with(3, unfloored());
    let f = features(7, &[1, 2]);
    let idle = view(&[0, 0, 0]);
    let owner = p.select(&f, FleetView { replicas: &idle }).ranked[0].replica;
    p.record(owner, &f);
    let mut loads = [0u32; 3];
    loads[owner.0 as usize] = 5; // bound = ceil(1.25 * 6 / 3) = 3
    let busy = view(&loads);
    let d = p.select(&f, FleetView { replicas: &busy });
    assert_eq!(d.load_bound, 3);
    assert_ne!(d.ranked[0].replica, owner);
    let held = d.ranked.iter().find(|c| c.replica == owner).unwrap();
    assert!(held.saturated && held.signals[Signal::Prefix] == 0.0);
}

#[test]
fn below_the_min_load_cap_a_holder_keeps_its_prefix() {
    // 5 in flight on the holder: over ceil(1.25 * 6 / 3) = 3, under a floor of 8.
    let config = PolicyConfig {
        min_load_cap: 8,
        cached_load_bonus: 0.0,
        ..bounded_load()
    };
    let mut p = policy_with(3, config);
    let f = features(7, &[1, 2]);
    let owner = place_on_idle(&mut p, &f);
    let mut loads = [0u32; 3];
    loads[owner.0 as usize] = 5;
    let d = p.select(
        &f,
        FleetView {
            replicas: &view(&loads),
        },
    );
    assert_eq!(d.load_bound, 8);
    let held = d.ranked.iter().find(|c| c.replica == owner).unwrap();
    assert!(!held.saturated && held.signals[Signal::Prefix] == 1.0);
    // At the floor it yields as it would at any cap.
    loads[owner.0 as usize] = 8;
    let d = p.select(
        &f,
        FleetView {
            replicas: &view(&loads),
        },
    );
    let held = d.ranked.iter().find(|c| c.replica == owner).unwrap();
    assert!(held.saturated && held.signals[Signal::Prefix] == 0.0);
    // One of four gateways counts a quarter of the fleet's requests: its floor is 8 / 4.
    p.set_gateways(4, 4);
    loads[owner.0 as usize] = 2;
    let d = p.select(
        &f,
        FleetView {
            replicas: &view(&loads),
        },
    );
    assert_eq!(d.load_bound, 2);
    let held = d.ranked.iter().find(|c| c.replica == owner).unwrap();
    assert!(held.saturated);
}

#[test]
fn a_holder_with_a_full_cache_keeps_its_prompt_but_not_its_stickiness() {
    let mut p = policy_with(2, PolicyConfig::default());
    let f = RequestFeatures {
        prompt_tokens: 2_000,
        ..features(7, &[1, 2, 3, 4])
    };
    let home = place_on_idle(&mut p, &f);
    let mut fleet = view(&[4, 0]);
    // Every block of its cache in use: it frees some as its requests finish, while the other
    // replica would compute the whole prompt again.
    fleet[home.0 as usize].kv_usage = Some(1.0);
    let d = p.select(&f, FleetView { replicas: &fleet });
    assert_eq!(d.ranked[0].replica, home);
    assert!(d.ranked[0].saturated);
    assert_eq!(d.ranked[0].signals[Signal::Prefix], 0.0);
    assert_eq!(d.ranked[0].signals[Signal::Prefill], 1.0);
    // A queue at its limit is a hard one: the prompt goes elsewhere.
    fleet[home.0 as usize].waiting = PolicyConfig::default().queue_saturation;
    let d = p.select(&f, FleetView { replicas: &fleet });
    assert_ne!(d.ranked[0].replica, home);
}
