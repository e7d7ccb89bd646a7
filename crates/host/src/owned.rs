//! Paths the daemon trusts only if this user made them: its state
//! directory, its socket's directory, a socket it left behind.
//!
//! A directory is ours when it is a real directory (not a symbolic link),
//! owned by our effective uid, and neither group nor others may write it;
//! every directory above it is owned by root or by us, and writable by
//! others only with the sticky bit (as `/tmp`), so nobody else can swap
//! it out. A path naming `..` is refused before anything is looked at,
//! and every check is made on the canonical path, never on the text.

use std::os::unix::fs::{DirBuilderExt, FileTypeExt, MetadataExt};
use std::path::{Component, Path, PathBuf};

/// Why a path is not one the daemon may use.
#[derive(Debug, thiserror::Error)]
pub enum OwnedError {
    #[error("{path}: the path contains `..`; give it without `..`")]
    DotDot { path: PathBuf },
    #[error("{path} is a symbolic link; give the real directory, one this user made")]
    Symlink { path: PathBuf },
    #[error("{path} is not a directory")]
    NotDir { path: PathBuf },
    #[error(
        "{path} belongs to uid {owner}, not to this user (uid {us}): another user made it; \
         remove it or give a directory of your own"
    )]
    Owner { path: PathBuf, owner: u32, us: u32 },
    #[error(
        "{path} has mode {mode:03o}: group or others may write to it; \
         `chmod go-w {path}` or give a directory of your own"
    )]
    Writable { path: PathBuf, mode: u32 },
    #[error(
        "{path} is under {ancestor}, which {why}: another user could replace what is in it; \
         give a directory under one only root or this user may change"
    )]
    Ancestor {
        path: PathBuf,
        ancestor: PathBuf,
        why: String,
    },
    #[error(
        "{path} exists and is not a socket of this user (a {what}); \
         remove it yourself or listen somewhere else"
    )]
    NotOurSocket { path: PathBuf, what: String },
    #[error("creating {path}")]
    Create {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("looking at {path}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

/// Our effective uid.
pub fn euid() -> u32 {
    rustix::process::geteuid().as_raw()
}

/// Makes `path` (mode 0700, and any missing parent too) unless it exists,
/// then checks that it is ours (see the module's comment). Returns its
/// canonical path, the one to use from then on.
pub fn ensure_dir(path: &Path) -> Result<PathBuf, OwnedError> {
    ensure_dir_as(path, euid())
}

/// [`ensure_dir`] for the user `us` (tests pose as another user).
pub fn ensure_dir_as(path: &Path, us: u32) -> Result<PathBuf, OwnedError> {
    let path = absolute(path)?;
    // Not `exists()`: that follows a (dangling) symbolic link.
    if std::fs::symlink_metadata(&path).is_err() {
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(&path)
            .map_err(|source| OwnedError::Create {
                path: path.clone(),
                source,
            })?;
    }
    check_dir_as(&path, us)
}

/// Checks that the existing directory `path` is ours; its canonical path.
pub fn check_dir_as(path: &Path, us: u32) -> Result<PathBuf, OwnedError> {
    let path = absolute(path)?;
    let io = |source| OwnedError::Io {
        path: path.clone(),
        source,
    };
    let meta = std::fs::symlink_metadata(&path).map_err(io)?;
    if meta.file_type().is_symlink() {
        return Err(OwnedError::Symlink { path });
    }
    if !meta.is_dir() {
        return Err(OwnedError::NotDir { path });
    }
    if meta.uid() != us {
        return Err(OwnedError::Owner {
            path,
            owner: meta.uid(),
            us,
        });
    }
    let mode = meta.mode() & 0o7777;
    if mode & 0o022 != 0 {
        return Err(OwnedError::Writable { path, mode });
    }
    let canonical = std::fs::canonicalize(&path).map_err(io)?;
    check_ancestors_as(&canonical, us)?;
    Ok(canonical)
}

/// Checks every directory above the canonical path `path`: owned by root
/// or `us`, and writable by group or others only with the sticky bit.
pub fn check_ancestors_as(path: &Path, us: u32) -> Result<(), OwnedError> {
    for ancestor in path.ancestors().skip(1) {
        let meta = std::fs::metadata(ancestor).map_err(|source| OwnedError::Io {
            path: ancestor.to_owned(),
            source,
        })?;
        let why = if meta.uid() != 0 && meta.uid() != us {
            Some(format!("belongs to uid {}", meta.uid()))
        } else if meta.mode() & 0o022 != 0 && meta.mode() & 0o1000 == 0 {
            Some(format!(
                "has mode {:03o} (others may write to it, without the sticky bit)",
                meta.mode() & 0o7777
            ))
        } else {
            None
        };
        if let Some(why) = why {
            return Err(OwnedError::Ancestor {
                path: path.to_owned(),
                ancestor: ancestor.to_owned(),
                why,
            });
        }
    }
    Ok(())
}

/// Where a unix socket may be made: its directory is made (0700) when
/// missing and `private_dir` says it must be ours ([`ensure_dir`]), or
/// else only checked for its ancestors (a shared `/tmp` is fine, a
/// directory others may write without the sticky bit is not). A file
/// already at `path` must be a socket of ours (one a daemon left), never
/// anything else. Returns the socket's path with its directory canonical.
pub fn socket_path(path: &Path, private_dir: bool) -> Result<PathBuf, OwnedError> {
    socket_path_as(path, private_dir, euid())
}

/// [`socket_path`] for the user `us`.
pub fn socket_path_as(path: &Path, private_dir: bool, us: u32) -> Result<PathBuf, OwnedError> {
    let path = absolute(path)?;
    let (Some(dir), Some(name)) = (path.parent(), path.file_name()) else {
        return Err(OwnedError::NotOurSocket {
            path,
            what: "directory".into(),
        });
    };
    let dir = if private_dir {
        ensure_dir_as(dir, us)?
    } else {
        let canonical = std::fs::canonicalize(dir).map_err(|source| OwnedError::Io {
            path: dir.to_owned(),
            source,
        })?;
        // The directory itself counts as an ancestor of the socket.
        check_ancestors_as(&canonical.join(name), us)?;
        canonical
    };
    let path = dir.join(name);
    match std::fs::symlink_metadata(&path) {
        Ok(meta) => {
            let t = meta.file_type();
            let what = if t.is_symlink() {
                "symbolic link"
            } else if t.is_dir() {
                "directory"
            } else if !t.is_socket() {
                "file that is not a socket"
            } else if meta.uid() != us {
                "socket of another user"
            } else {
                return Ok(path);
            };
            Err(OwnedError::NotOurSocket {
                path,
                what: what.into(),
            })
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(path),
        Err(source) => Err(OwnedError::Io { path, source }),
    }
}

/// `path` made absolute (against the current directory), refused if any
/// component is `..` (which would make its text lie about where it is).
fn absolute(path: &Path) -> Result<PathBuf, OwnedError> {
    if path.components().any(|c| c == Component::ParentDir) {
        return Err(OwnedError::DotDot {
            path: path.to_owned(),
        });
    }
    std::path::absolute(path).map_err(|source| OwnedError::Io {
        path: path.to_owned(),
        source,
    })
}

/// Whether `dir` is `parent/<prefix>…` on disk, both compared after
/// canonicalizing: how a path read back from a file (the daemon's state)
/// is checked to be one of the directories it made before it is used,
/// let alone removed. `false` when either does not exist.
pub fn is_made_under(dir: &Path, parent: &Path, prefix: &str) -> bool {
    let (Ok(dir), Ok(parent)) = (std::fs::canonicalize(dir), std::fs::canonicalize(parent)) else {
        return false;
    };
    let named = dir
        .file_name()
        .and_then(|n| n.to_str())
        .is_some_and(|n| n.starts_with(prefix) && n.len() > prefix.len());
    let owned = std::fs::symlink_metadata(&dir).is_ok_and(|m| m.is_dir() && m.uid() == euid());
    named && owned && dir.parent() == Some(parent.as_path())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    fn chmod(p: &Path, mode: u32) {
        std::fs::set_permissions(p, std::fs::Permissions::from_mode(mode)).expect("chmod");
    }

    #[test]
    fn ensure_dir_missing_is_made_0700_and_returned_canonical() {
        let t = tempfile::tempdir().expect("tempdir");
        let want = t.path().join("a/b/./state");
        let got = ensure_dir(&want).expect("made");
        assert_eq!(
            got,
            std::fs::canonicalize(t.path())
                .expect("c")
                .join("a/b/state")
        );
        let mode = std::fs::metadata(&got).expect("meta").mode() & 0o777;
        assert_eq!(mode, 0o700);
        assert_eq!(
            std::fs::metadata(t.path().join("a")).expect("meta").mode() & 0o777,
            0o700,
            "missing parents are private too"
        );
        // Ours: a second run takes it as it is.
        assert_eq!(ensure_dir(&want).expect("again"), got);
    }

    #[test]
    fn ensure_dir_with_dotdot_is_refused_before_anything_is_made() {
        let t = tempfile::tempdir().expect("tempdir");
        let bad = t.path().join("x/../state");
        let e = ensure_dir(&bad).expect_err("`..`");
        assert!(matches!(e, OwnedError::DotDot { .. }), "{e}");
        assert!(e.to_string().contains("without `..`"), "{e}");
        assert!(!t.path().join("x").exists() && !t.path().join("state").exists());
    }

    #[test]
    fn ensure_dir_symlink_is_refused_even_to_our_own_dir() {
        let t = tempfile::tempdir().expect("tempdir");
        let real = t.path().join("real");
        std::fs::create_dir(&real).expect("mkdir");
        chmod(&real, 0o700);
        let link = t.path().join("link");
        std::os::unix::fs::symlink(&real, &link).expect("symlink");
        let e = ensure_dir(&link).expect_err("a symlink");
        assert!(matches!(e, OwnedError::Symlink { .. }), "{e}");
        assert!(e.to_string().contains("symbolic link"), "{e}");
    }

    #[test]
    fn ensure_dir_of_another_user_is_refused_naming_both_uids() {
        let t = tempfile::tempdir().expect("tempdir");
        let dir = t.path().join("state");
        std::fs::create_dir(&dir).expect("mkdir");
        chmod(&dir, 0o700);
        let owner = std::fs::metadata(&dir).expect("meta").uid();
        let other = owner.wrapping_add(4242);
        let e = ensure_dir_as(&dir, other).expect_err("not ours");
        match &e {
            OwnedError::Owner { owner: o, us, .. } => assert_eq!((*o, *us), (owner, other)),
            e => panic!("wrong error: {e}"),
        }
        assert!(e.to_string().contains("another user made it"), "{e}");
    }

    #[test]
    fn ensure_dir_group_or_world_writable_is_refused() {
        let t = tempfile::tempdir().expect("tempdir");
        for mode in [0o770, 0o702, 0o1777] {
            let dir = t.path().join(format!("d{mode:o}"));
            std::fs::create_dir(&dir).expect("mkdir");
            chmod(&dir, mode);
            let e = ensure_dir(&dir).expect_err("writable by others");
            assert!(matches!(e, OwnedError::Writable { .. }), "{mode:o}: {e}");
            assert!(e.to_string().contains("chmod go-w"), "{e}");
        }
    }

    #[test]
    fn ensure_dir_a_file_is_not_a_directory() {
        let t = tempfile::tempdir().expect("tempdir");
        let f = t.path().join("f");
        std::fs::write(&f, b"x").expect("write");
        assert!(matches!(
            ensure_dir(&f).expect_err("a file"),
            OwnedError::NotDir { .. }
        ));
    }

    #[test]
    fn ensure_dir_under_a_world_writable_dir_without_sticky_bit_is_refused() {
        let t = tempfile::tempdir().expect("tempdir");
        let open = t.path().join("open");
        std::fs::create_dir(&open).expect("mkdir");
        chmod(&open, 0o777);
        let e = ensure_dir(&open.join("state")).expect_err("swappable");
        assert!(matches!(e, OwnedError::Ancestor { .. }), "{e}");
        chmod(&open, 0o1777);
        ensure_dir(&open.join("state")).expect("sticky, as /tmp: fine");
    }

    #[test]
    fn socket_path_refuses_what_is_not_our_socket() {
        let t = tempfile::tempdir().expect("tempdir");
        let sock = t.path().join("f.sock");
        assert_eq!(
            socket_path(&sock, false).expect("free"),
            std::fs::canonicalize(t.path()).expect("c").join("f.sock")
        );
        std::fs::write(&sock, b"x").expect("write");
        let e = socket_path(&sock, false).expect_err("a file");
        assert!(e.to_string().contains("not a socket"), "{e}");
        std::fs::remove_file(&sock).expect("rm");
        std::os::unix::fs::symlink("/etc/passwd", &sock).expect("symlink");
        let e = socket_path(&sock, false).expect_err("a symlink");
        assert!(e.to_string().contains("symbolic link"), "{e}");
        std::fs::remove_file(&sock).expect("rm");
        let listener = std::os::unix::net::UnixListener::bind(&sock).expect("bind");
        socket_path(&sock, false).expect("our own socket, left behind");
        let owner = std::fs::symlink_metadata(&sock).expect("meta").uid();
        let e = socket_path_as(&sock, false, owner.wrapping_add(1)).expect_err("another's");
        assert!(e.to_string().contains("another user"), "{e}");
        drop(listener);
    }

    #[test]
    fn socket_path_private_dir_is_made_and_checked() {
        let t = tempfile::tempdir().expect("tempdir");
        let sock = t.path().join("forkbox/forkbox.sock");
        socket_path(&sock, true).expect("made");
        let dir = t.path().join("forkbox");
        assert_eq!(std::fs::metadata(&dir).expect("meta").mode() & 0o777, 0o700);
        chmod(&dir, 0o777);
        assert!(matches!(
            socket_path(&sock, true).expect_err("writable"),
            OwnedError::Writable { .. }
        ));
    }

    #[test]
    fn is_made_under_compares_canonical_paths_not_text() {
        let t = tempfile::tempdir().expect("tempdir");
        let made = t.path().join("forkbox-vm-abc");
        std::fs::create_dir(&made).expect("mkdir");
        let elsewhere = tempfile::tempdir().expect("tempdir");
        std::fs::create_dir(elsewhere.path().join("forkbox-vm-x")).expect("mkdir");
        assert!(is_made_under(&made, t.path(), "forkbox-vm-"));
        assert!(!is_made_under(&made, t.path(), "other-"));
        // Textually under the parent, really elsewhere.
        let sneaky = t
            .path()
            .join("..")
            .join(elsewhere.path().file_name().expect("name"))
            .join("forkbox-vm-x");
        assert!(sneaky.starts_with(t.path()) && sneaky.exists());
        assert!(!is_made_under(&sneaky, t.path(), "forkbox-vm-"));
        let link = t.path().join("forkbox-vm-link");
        std::os::unix::fs::symlink(elsewhere.path().join("forkbox-vm-x"), &link).expect("symlink");
        assert!(!is_made_under(&link, t.path(), "forkbox-vm-"));
        assert!(!is_made_under(
            &t.path().join("forkbox-vm-gone"),
            t.path(),
            "forkbox-vm-"
        ));
    }
}
