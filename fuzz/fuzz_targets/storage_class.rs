#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| ferry_fuzz::storage_class::run(data));
