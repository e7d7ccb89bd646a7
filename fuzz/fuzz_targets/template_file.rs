#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| forkbox_fuzz_targets::template_file(data));
