//! The CLI's unpacking of a tar archive a guest sent (`forkbox cp
//! SANDBOX:/DIR LOCAL`): `forkbox::unpack`.
//!
//! Input: the archive's bytes. What must hold beyond "no panic", whether
//! the unpacking ends or stops at a member it refuses: nothing is made
//! outside the target directory (its parent holds only the target and a
//! sibling, and the sibling stays empty); inside it there are only
//! regular files, directories and symbolic links, none setuid, setgid or
//! sticky, and each link's target, taken from the link's own directory,
//! stays inside.

use std::os::unix::fs::PermissionsExt;
use std::path::{Component, Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

pub fn tar_unpack(data: &[u8]) {
    static RUN: AtomicU64 = AtomicU64::new(0);
    let base = std::env::temp_dir().join(format!(
        "forkbox-fuzz-unpack-{}-{}",
        std::process::id(),
        RUN.fetch_add(1, Ordering::Relaxed)
    ));
    let (root, outside) = (base.join("root"), base.join("outside"));
    for dir in [&root, &outside] {
        std::fs::create_dir_all(dir).expect("the fuzz target's directories");
    }
    let _ = forkbox::unpack::unpack(data, &root);
    let mut names: Vec<_> = std::fs::read_dir(&base)
        .expect("read the base")
        .map(|e| e.expect("an entry").file_name())
        .collect();
    names.sort();
    assert_eq!(names, ["outside", "root"], "made beside the target");
    assert!(
        std::fs::read_dir(&outside).expect("read").next().is_none(),
        "made in a sibling of the target"
    );
    let real_root = std::fs::canonicalize(&root).expect("the target");
    check_tree(&root, Path::new(""), &real_root);
    remove(&base);
}

/// Every entry under `dir` (`rel` inside the target): its kind, its mode
/// bits, and where a link leads.
fn check_tree(dir: &Path, rel: &Path, real_root: &Path) {
    for entry in std::fs::read_dir(dir).expect("read a directory it made") {
        let entry = entry.expect("an entry");
        let path = entry.path();
        let inside = rel.join(entry.file_name());
        let meta = std::fs::symlink_metadata(&path).expect("lstat");
        let kind = meta.file_type();
        if kind.is_symlink() {
            let target = std::fs::read_link(&path).expect("readlink");
            assert!(
                stays_inside(rel, &target),
                "link {} -> {} leads out",
                inside.display(),
                target.display()
            );
            // Links through links: where it really leads, if anywhere.
            if let Ok(real) = std::fs::canonicalize(&path) {
                assert!(
                    real.starts_with(real_root),
                    "link {} really leads to {}",
                    inside.display(),
                    real.display()
                );
            }
            continue;
        }
        assert!(
            kind.is_file() || kind.is_dir(),
            "{} is neither a file, a directory nor a link: {kind:?}",
            inside.display()
        );
        let special = meta.permissions().mode() & 0o7000;
        assert_eq!(
            special,
            0,
            "{} keeps mode bits {special:o}",
            inside.display()
        );
        if kind.is_dir() {
            check_tree(&path, &inside, real_root);
        }
    }
}

/// Whether `target`, read from the directory `from` (relative to the
/// target directory), names a path inside it.
fn stays_inside(from: &Path, target: &Path) -> bool {
    let mut at: Vec<Component> = from.components().collect();
    for c in target.components() {
        match c {
            Component::Normal(_) => at.push(c),
            Component::CurDir => {}
            Component::ParentDir => {
                if at.pop().is_none() {
                    return false;
                }
            }
            Component::RootDir | Component::Prefix(_) => return false,
        }
    }
    true
}

/// Removes the run's directories, whatever modes the archive gave them.
fn remove(base: &PathBuf) {
    fn open_up(dir: &Path) {
        let _ = std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700));
        if let Ok(entries) = std::fs::read_dir(dir) {
            for e in entries.flatten() {
                if e.file_type().is_ok_and(|t| t.is_dir()) {
                    open_up(&e.path());
                }
            }
        }
    }
    open_up(base);
    std::fs::remove_dir_all(base).expect("remove the fuzz target's directories");
}
