#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| kvgate_fuzzing::prefix_index(data));
