#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| ferry_fuzz::volume_id::run(data));
