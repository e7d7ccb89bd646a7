//! What of the `forkbox` command other crates use: its template files
//! (read by `forkbox template bake --file`) and its unpacking of a guest's
//! tar archive (`forkbox cp SANDBOX:/DIR LOCAL`), both fuzzed by `fuzz/`.
#![forbid(unsafe_code)]

pub mod template_file;
pub mod unpack;
