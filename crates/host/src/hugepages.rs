//! Huge pages for zygote memory.
//!
//! A zygote's memory file is a memfd, and the kernel gives a memfd 2 MiB
//! pages only if `/sys/kernel/mm/transparent_hugepage/shmem_enabled`
//! allows it. With `advise`, a memfd gets them where its mapping asks
//! (`MADV_HUGEPAGE`), which the VMM does for the dense 2 MiB regions of a
//! zygote's RAM, and the kernel places memfd mappings at 2 MiB boundaries,
//! so that a fork child maps such a region with one page-table entry on
//! the host and in KVM's nested page tables until it writes there: fewer
//! page faults on a fork's first command, fewer page tables per child
//! (docs/SPEC.md has the numbers).
//!
//! Most distributions ship `never`. Before the first VMM boots,
//! [`allow_for_zygotes`] turns `never` into `advise`, which changes nothing
//! for memory that does not ask for huge pages, and says so; any other
//! setting (`deny` to keep forkbox from huge pages) is left as it is.

use std::path::Path;
use std::sync::Once;

/// Where the kernel takes the huge-page policy for memfds and shared memory.
pub const SHMEM_ENABLED: &str = "/sys/kernel/mm/transparent_hugepage/shmem_enabled";

/// The selected value of a `shmem_enabled` file, e.g. `never` out of
/// `always within_size advise [never] deny force`.
pub fn selected(text: &str) -> Option<&str> {
    text.split_whitespace()
        .find_map(|w| w.strip_prefix('[')?.strip_suffix(']'))
}

/// What [`allow`] did.
#[derive(Debug, PartialEq, Eq)]
pub enum Outcome {
    /// The kernel has no such file (no transparent huge pages).
    Unsupported,
    /// Left as it was: `advise` or more, or `deny`.
    Kept(String),
    /// `never` became `advise`.
    Enabled,
    /// `never`, and it could not be changed.
    Failed(String),
}

/// Turns `never` in the `shmem_enabled` file at `path` into `advise`.
pub fn allow(path: &Path) -> Outcome {
    let Ok(text) = std::fs::read_to_string(path) else {
        return Outcome::Unsupported;
    };
    match selected(&text) {
        Some("never") => match std::fs::write(path, "advise") {
            Ok(()) => Outcome::Enabled,
            Err(e) => Outcome::Failed(e.to_string()),
        },
        Some(other) => Outcome::Kept(other.to_owned()),
        None => Outcome::Failed(format!("cannot read its setting from {text:?}")),
    }
}

/// [`allow`] on the host's file, once per process, saying what it changed
/// or why it could not.
pub fn allow_for_zygotes() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| match allow(Path::new(SHMEM_ENABLED)) {
        // A warning although it worked: a host-wide setting changed, which
        // the user should hear of at the default level (docs/SPEC.md).
        Outcome::Enabled => tracing::warn!(
            path = SHMEM_ENABLED,
            "never -> advise, so that zygote memory can use 2 MiB pages (faster forks); \
             memory that does not ask for them is unchanged; write `deny` there to keep \
             forkbox from them"
        ),
        Outcome::Failed(e) => tracing::warn!(
            path = SHMEM_ENABLED,
            cause = %e,
            "zygote memory stays in 4 KiB pages: the setting is `never` and cannot be \
             set to `advise`; forks work, with more page faults each. As root: echo \
             advise > {SHMEM_ENABLED}"
        ),
        Outcome::Unsupported | Outcome::Kept(_) => {}
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn selected_reads_the_bracketed_word() {
        assert_eq!(
            selected("always within_size advise [never] deny force\n"),
            Some("never")
        );
        assert_eq!(selected("[advise] never"), Some("advise"));
        assert_eq!(selected("always never"), None);
    }

    #[test]
    fn allow_turns_never_into_advise_and_keeps_the_rest() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("shmem_enabled");
        std::fs::write(&path, "always within_size advise [never] deny force\n").expect("write");
        assert_eq!(allow(&path), Outcome::Enabled);
        assert_eq!(std::fs::read_to_string(&path).expect("read"), "advise");
        for kept in ["advise", "deny", "within_size"] {
            std::fs::write(&path, format!("always [{kept}] never")).expect("write");
            assert_eq!(allow(&path), Outcome::Kept(kept.to_owned()));
        }
        assert_eq!(allow(&dir.path().join("absent")), Outcome::Unsupported);
    }
}
