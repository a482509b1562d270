#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| ferry_fuzz::node_paths::run(data));
