#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| forkbox_fuzz_targets::tar_unpack(data));
