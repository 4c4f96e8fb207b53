#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| kvgate_fuzzing::gguf_file(data));
