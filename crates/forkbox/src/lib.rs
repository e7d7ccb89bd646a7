//! What of the `forkbox` command other crates use: its template files
//! (read by `forkbox template bake --file`, fuzzed by `fuzz/`).
#![forbid(unsafe_code)]

pub mod template_file;
