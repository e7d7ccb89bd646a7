//! Replays the committed corpus (`fuzz/corpus/<target>/`) through every
//! fuzz target, on stable Rust: each file that once found something (a
//! crash, or new coverage) must keep passing. `make test` runs this; `make
//! fuzz` runs the targets under libFuzzer.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::{Path, PathBuf};

use forkbox_fuzz_targets::TARGETS;

fn fuzz_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("targets/ lies in fuzz/")
        .to_path_buf()
}

fn corpus_files(target: &str) -> Vec<PathBuf> {
    let dir = fuzz_dir().join("corpus").join(target);
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| {
            panic!(
                "{}: {e} (every target has a committed corpus)",
                dir.display()
            )
        })
        .map(|e| e.expect("corpus directory entry").path())
        .filter(|p| p.is_file())
        .collect();
    files.sort();
    files
}

#[test]
fn corpus_replays_through_every_target_without_a_failure() {
    let mut failures = Vec::new();
    let mut total = 0;
    for &(name, target) in TARGETS {
        let files = corpus_files(name);
        assert!(!files.is_empty(), "fuzz/corpus/{name}/ is empty");
        for file in files {
            let data = std::fs::read(&file).expect("read a corpus file");
            total += 1;
            if catch_unwind(AssertUnwindSafe(|| target(&data))).is_err() {
                failures.push(file.display().to_string());
            }
        }
    }
    assert!(
        failures.is_empty(),
        "{} of {total} corpus files fail (replay one with `cargo +nightly fuzz run <target> <file>` in fuzz/):\n{}",
        failures.len(),
        failures.join("\n")
    );
}

#[test]
fn corpus_targets_are_the_cargo_fuzz_targets() {
    let mut bins: Vec<String> = std::fs::read_dir(fuzz_dir().join("fuzz_targets"))
        .expect("fuzz/fuzz_targets")
        .map(|e| {
            let p = e.expect("fuzz target entry").path();
            p.file_stem()
                .expect("a target file")
                .to_string_lossy()
                .into_owned()
        })
        .collect();
    bins.sort();
    let mut names: Vec<String> = TARGETS.iter().map(|(n, _)| n.to_string()).collect();
    names.sort();
    assert_eq!(bins, names, "fuzz_targets/*.rs and TARGETS differ");
    let manifest = std::fs::read_to_string(fuzz_dir().join("Cargo.toml")).expect("fuzz/Cargo.toml");
    for name in &names {
        assert!(
            manifest.contains(&format!("name = \"{name}\"")),
            "fuzz/Cargo.toml has no [[bin]] {name}"
        );
    }
}

#[test]
fn corpus_targets_refuse_garbage_without_a_failure() {
    // Inputs no fuzzer needs to find: empty, tiny, all ones.
    for &(name, target) in TARGETS {
        for data in [&[][..], &[0][..], &[0xff; 7][..], &[1; 300][..]] {
            assert!(
                catch_unwind(AssertUnwindSafe(|| target(data))).is_ok(),
                "{name} fails on {data:?}"
            );
        }
    }
}
