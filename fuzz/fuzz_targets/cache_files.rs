#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| ferry_fuzz::cache_files::run(data));
