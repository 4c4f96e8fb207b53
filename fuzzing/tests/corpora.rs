//! Replays every kept fuzz corpus (`fuzz/corpus/TARGET/`) through its target's check: what
//! the fuzzer once found stays fixed, on the stable toolchain, in every test run.
#![allow(clippy::unwrap_used, clippy::panic)]

use std::path::Path;

#[test]
fn every_corpus_input_passes_its_check() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../fuzz/corpus");
    for (name, check) in kvgate_fuzzing::TARGETS {
        let dir = root.join(name);
        let mut inputs: Vec<_> = std::fs::read_dir(&dir)
            .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
            .map(|e| e.unwrap().path())
            .collect();
        inputs.sort();
        assert!(!inputs.is_empty(), "no corpus for {name}");
        for input in &inputs {
            let data = std::fs::read(input).unwrap();
            if let Err(panic) = std::panic::catch_unwind(|| check(&data)) {
                let why = panic
                    .downcast_ref::<String>()
                    .cloned()
                    .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
                    .unwrap_or_default();
                panic!("{name}: {} fails: {why}", input.display());
            }
        }
        eprintln!("{name}: {} inputs", inputs.len());
    }
}
