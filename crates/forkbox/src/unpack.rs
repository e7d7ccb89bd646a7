//! Unpacking a tar archive that came out of a guest (`forkbox cp
//! SANDBOX:/DIR LOCAL`): the guest wrote every byte of it, so every member
//! is checked before anything is made for it, and a member that cannot be
//! unpacked safely stops the unpacking with an error naming it (nothing is
//! skipped silently; what came before it stays).
//!
//! What holds: nothing is written outside the target directory (no
//! absolute names, no `..`, never through a symbolic link, whether the
//! archive made it or it was there); a symbolic link is made only if it
//! stays inside the target (relative, its `..` only leading and no more of
//! them than its depth), a hard link only to a regular file already inside
//! it; only regular files, directories and those links are made (devices,
//! FIFOs, sparse files are refused); modes keep their permission bits
//! only (no setuid, setgid or sticky bit); owners are never changed.

use std::io::Read;
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::{Component, Path, PathBuf};

use tar::EntryType;

/// Why an archive from a guest was not unpacked.
#[derive(Debug, thiserror::Error)]
pub enum UnpackError {
    #[error("member {member:?} has an absolute path: members must name paths inside the target")]
    Absolute { member: String },
    #[error("member {member:?} names `..`: it would leave the target directory")]
    DotDot { member: String },
    #[error("member {member:?} is a {kind}: only files, directories and links inside the target are unpacked")]
    Kind { member: String, kind: String },
    #[error("member {member:?} is a symbolic link to {target:?}, which leads out of the target directory")]
    SymlinkOut { member: String, target: String },
    #[error("member {member:?} is a hard link to {target:?}, which {why}")]
    HardLink {
        member: String,
        target: String,
        why: &'static str,
    },
    #[error("member {member:?} would be written through {link}, a symbolic link")]
    ThroughLink { member: String, link: PathBuf },
    #[error("member {member:?} would replace {path}, {what}")]
    Replace {
        member: String,
        path: PathBuf,
        what: &'static str,
    },
    #[error("member {member:?}")]
    Io {
        member: String,
        #[source]
        source: std::io::Error,
    },
    #[error("reading the archive")]
    Archive(#[source] std::io::Error),
}

/// What was unpacked.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Unpacked {
    pub members: u64,
    pub file_bytes: u64,
}

/// Unpacks `archive` into the existing directory `root` (see the module's
/// comment for what is refused).
pub fn unpack(archive: impl Read, root: &Path) -> Result<Unpacked, UnpackError> {
    let root = std::fs::canonicalize(root).map_err(|source| UnpackError::Io {
        member: String::new(),
        source,
    })?;
    let mut ar = tar::Archive::new(archive);
    let mut done = Unpacked::default();
    // Directory modes are set last, deepest first, so that a read-only
    // directory can still be filled.
    let mut dir_modes: Vec<(PathBuf, u32)> = Vec::new();
    for entry in ar.entries().map_err(UnpackError::Archive)? {
        let mut entry = entry.map_err(UnpackError::Archive)?;
        let member = String::from_utf8_lossy(&entry.path_bytes()).into_owned();
        let kind = entry.header().entry_type();
        if kind == EntryType::XGlobalHeader {
            continue; // metadata for the archive, no file
        }
        let mode = entry.header().mode().map_err(UnpackError::Archive)? & 0o777;
        let rel = inside(&member, &entry.path().map_err(UnpackError::Archive)?)?;
        let io = |source| UnpackError::Io {
            member: member.clone(),
            source,
        };
        if rel.as_os_str().is_empty() {
            if kind == EntryType::Directory {
                continue; // the target itself (`./`): left as it is
            }
            return Err(UnpackError::Replace {
                member,
                path: root,
                what: "the target directory",
            });
        }
        make_parents(&root, &rel, &member)?;
        let dest = root.join(&rel);
        match kind {
            EntryType::Directory => {
                match std::fs::symlink_metadata(&dest) {
                    Ok(m) if m.is_dir() => {}
                    Ok(_) => {
                        std::fs::remove_file(&dest).map_err(io)?;
                        std::fs::create_dir(&dest).map_err(io)?;
                    }
                    Err(_) => std::fs::create_dir(&dest).map_err(io)?,
                }
                dir_modes.push((dest, mode));
            }
            EntryType::Regular | EntryType::Continuous => {
                clear(&dest, &member)?;
                let mut file = std::fs::OpenOptions::new()
                    .write(true)
                    .create_new(true)
                    // O_CREAT|O_EXCL: never opens through a link.
                    .mode(0o600)
                    .open(&dest)
                    .map_err(io)?;
                done.file_bytes += std::io::copy(&mut entry, &mut file).map_err(io)?;
                file.set_permissions(std::fs::Permissions::from_mode(mode))
                    .map_err(io)?;
            }
            EntryType::Symlink => {
                let target = link_name(&entry, &member)?;
                if !symlink_stays_inside(&rel, &target) {
                    return Err(UnpackError::SymlinkOut {
                        member,
                        target: target.display().to_string(),
                    });
                }
                clear(&dest, &member)?;
                std::os::unix::fs::symlink(&target, &dest).map_err(io)?;
            }
            EntryType::Link => {
                let target = link_name(&entry, &member)?;
                let shown = target.display().to_string();
                let bad = |why| UnpackError::HardLink {
                    member: member.clone(),
                    target: shown.clone(),
                    why,
                };
                let linked = match inside(&shown, &target) {
                    Ok(t) if !t.as_os_str().is_empty() => t,
                    _ => return Err(bad("is not a path inside the target")),
                };
                if check_parents(&root, &linked).is_err() {
                    return Err(bad("lies behind a symbolic link"));
                }
                match std::fs::symlink_metadata(root.join(&linked)) {
                    Ok(m) if m.is_file() => {}
                    Ok(_) => return Err(bad("is not a regular file")),
                    Err(_) => return Err(bad("was not unpacked before it")),
                }
                clear(&dest, &member)?;
                std::fs::hard_link(root.join(&linked), &dest).map_err(io)?;
            }
            other => {
                return Err(UnpackError::Kind {
                    member,
                    kind: kind_name(other),
                })
            }
        }
        done.members += 1;
    }
    for (dir, mode) in dir_modes.iter().rev() {
        if std::fs::symlink_metadata(dir).is_ok_and(|m| m.is_dir()) {
            std::fs::set_permissions(dir, std::fs::Permissions::from_mode(*mode)).map_err(
                |source| UnpackError::Io {
                    member: dir.display().to_string(),
                    source,
                },
            )?;
        }
    }
    Ok(done)
}

/// A member's path as a relative path with only normal components (empty
/// for the target itself): absolute paths and `..` are refused.
fn inside(member: &str, path: &Path) -> Result<PathBuf, UnpackError> {
    let mut rel = PathBuf::new();
    for c in path.components() {
        match c {
            Component::Normal(n) => rel.push(n),
            Component::CurDir => {}
            Component::RootDir | Component::Prefix(_) => {
                return Err(UnpackError::Absolute {
                    member: member.into(),
                })
            }
            Component::ParentDir => {
                return Err(UnpackError::DotDot {
                    member: member.into(),
                })
            }
        }
    }
    Ok(rel)
}

/// The directories above `rel` in `root`, each a real directory: made if
/// missing, an error if one is a symbolic link or a file.
fn make_parents(root: &Path, rel: &Path, member: &str) -> Result<(), UnpackError> {
    let mut dir = root.to_owned();
    let Some(parent) = rel.parent() else {
        return Ok(());
    };
    for c in parent.components() {
        dir.push(c);
        match std::fs::symlink_metadata(&dir) {
            Ok(m) if m.is_dir() => {}
            Ok(m) if m.file_type().is_symlink() => {
                return Err(UnpackError::ThroughLink {
                    member: member.into(),
                    link: dir,
                })
            }
            Ok(_) => {
                return Err(UnpackError::Replace {
                    member: member.into(),
                    path: dir,
                    what: "a file, with a directory",
                })
            }
            Err(_) => std::fs::create_dir(&dir).map_err(|source| UnpackError::Io {
                member: member.into(),
                source,
            })?,
        }
    }
    Ok(())
}

/// Whether every directory above `rel` in `root` is a real directory.
fn check_parents(root: &Path, rel: &Path) -> Result<(), ()> {
    let mut dir = root.to_owned();
    for c in rel.parent().into_iter().flat_map(Path::components) {
        dir.push(c);
        if !std::fs::symlink_metadata(&dir).is_ok_and(|m| m.is_dir()) {
            return Err(());
        }
    }
    Ok(())
}

/// Removes what is at `dest` (never following a link) so that a member
/// can take its place; a directory is not replaced.
fn clear(dest: &Path, member: &str) -> Result<(), UnpackError> {
    match std::fs::symlink_metadata(dest) {
        Ok(m) if m.is_dir() => Err(UnpackError::Replace {
            member: member.into(),
            path: dest.to_owned(),
            what: "a directory",
        }),
        Ok(_) => std::fs::remove_file(dest).map_err(|source| UnpackError::Io {
            member: member.into(),
            source,
        }),
        Err(_) => Ok(()),
    }
}

fn link_name<R: Read>(entry: &tar::Entry<'_, R>, member: &str) -> Result<PathBuf, UnpackError> {
    match entry.link_name() {
        Ok(Some(t)) if !t.as_os_str().is_empty() => Ok(t.into_owned()),
        Ok(_) => Err(UnpackError::HardLink {
            member: member.into(),
            target: String::new(),
            why: "is empty",
        }),
        Err(e) => Err(UnpackError::Archive(e)),
    }
}

/// Whether a symbolic link at `rel` to `target` resolves inside the
/// target directory whatever the other links there are: `target` is
/// relative, its `..` all come first and are no more than the link's
/// depth. Each directory it then descends into is inside, and each link
/// it meets there obeys the same rule, so no chain of links leaves.
fn symlink_stays_inside(rel: &Path, target: &Path) -> bool {
    let depth = rel.components().count() - 1;
    let mut ups = 0;
    let mut descended = false;
    for c in target.components() {
        match c {
            Component::ParentDir if !descended => ups += 1,
            Component::ParentDir | Component::RootDir | Component::Prefix(_) => return false,
            Component::CurDir => {}
            Component::Normal(_) => descended = true,
        }
    }
    ups <= depth
}

fn kind_name(kind: EntryType) -> String {
    match kind {
        EntryType::Char => "character device".into(),
        EntryType::Block => "block device".into(),
        EntryType::Fifo => "FIFO".into(),
        EntryType::GNUSparse => "sparse file".into(),
        other => format!("member of type {:?}", other.as_byte() as char),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::MetadataExt;

    /// A member of a hand-built archive: names and link targets are
    /// written raw into the header, as a hostile guest would.
    struct M {
        name: &'static str,
        kind: EntryType,
        mode: u32,
        link: &'static str,
        data: &'static [u8],
    }

    fn file(name: &'static str, data: &'static [u8]) -> M {
        M {
            name,
            kind: EntryType::Regular,
            mode: 0o644,
            link: "",
            data,
        }
    }

    fn dir(name: &'static str) -> M {
        M {
            name,
            kind: EntryType::Directory,
            mode: 0o755,
            link: "",
            data: b"",
        }
    }

    fn link(name: &'static str, kind: EntryType, to: &'static str) -> M {
        M {
            name,
            kind,
            mode: 0o777,
            link: to,
            data: b"",
        }
    }

    fn archive(members: &[M]) -> Vec<u8> {
        let mut out = Vec::new();
        for m in members {
            let mut h = tar::Header::new_old();
            let raw = h.as_old_mut();
            raw.name[..m.name.len()].copy_from_slice(m.name.as_bytes());
            raw.linkname[..m.link.len()].copy_from_slice(m.link.as_bytes());
            h.set_entry_type(m.kind);
            h.set_mode(m.mode);
            h.set_size(m.data.len() as u64);
            h.set_cksum();
            out.extend_from_slice(h.as_bytes());
            out.extend_from_slice(m.data);
            out.resize(out.len().div_ceil(512) * 512, 0);
        }
        out.resize(out.len() + 1024, 0);
        out
    }

    fn unpack_into(members: &[M]) -> (tempfile::TempDir, Result<Unpacked, UnpackError>) {
        let t = tempfile::tempdir().expect("tempdir");
        std::fs::create_dir(t.path().join("out")).expect("mkdir");
        let r = unpack(archive(members).as_slice(), &t.path().join("out"));
        (t, r)
    }

    #[test]
    fn unpack_plain_tree_with_inside_links() {
        let (t, r) = unpack_into(&[
            dir("d/"),
            file("d/a.txt", b"hello"),
            dir("d/sub/"),
            link("d/sub/up", EntryType::Symlink, "../a.txt"),
            link("d/hard", EntryType::Link, "d/a.txt"),
        ]);
        let done = r.expect("unpacked");
        assert_eq!(done.file_bytes, 5);
        let out = t.path().join("out");
        assert_eq!(
            std::fs::read(out.join("d/sub/up")).expect("via link"),
            b"hello"
        );
        assert_eq!(
            std::fs::metadata(out.join("d/hard")).expect("meta").ino(),
            std::fs::metadata(out.join("d/a.txt")).expect("meta").ino()
        );
    }

    #[test]
    fn unpack_absolute_member_is_refused_by_name() {
        let (t, r) = unpack_into(&[file("/tmp/forkbox-evil", b"x")]);
        let e = r.expect_err("absolute");
        assert!(matches!(e, UnpackError::Absolute { .. }), "{e}");
        assert!(e.to_string().contains("\"/tmp/forkbox-evil\""), "{e}");
        assert!(std::fs::read_dir(t.path().join("out"))
            .expect("ls")
            .next()
            .is_none());
    }

    #[test]
    fn unpack_dotdot_member_is_refused_and_nothing_lands_outside() {
        let (t, r) = unpack_into(&[file("a/../../escaped", b"x")]);
        let e = r.expect_err("`..`");
        assert!(matches!(e, UnpackError::DotDot { .. }), "{e}");
        assert!(e.to_string().contains("a/../../escaped"), "{e}");
        assert!(!t.path().join("escaped").exists());
    }

    #[test]
    fn unpack_symlink_then_file_through_it_is_refused() {
        let outside = tempfile::tempdir().expect("tempdir");
        let to: &'static str = Box::leak(outside.path().display().to_string().into_boxed_str());
        // The link itself points out: refused at once.
        let (_t, r) = unpack_into(&[link("esc", EntryType::Symlink, to)]);
        assert!(matches!(
            r.expect_err("out"),
            UnpackError::SymlinkOut { .. }
        ));
        for target in ["..", "../x", "a/../../x", "sub/.."] {
            let (_t, r) = unpack_into(&[link("esc", EntryType::Symlink, target)]);
            let e = r.expect_err(target);
            assert!(matches!(e, UnpackError::SymlinkOut { .. }), "{target}: {e}");
        }
        // A link that stays inside, then a file written through it.
        let (t, r) = unpack_into(&[
            dir("real/"),
            link("in", EntryType::Symlink, "real"),
            file("in/f", b"x"),
        ]);
        let e = r.expect_err("through a link");
        assert!(matches!(e, UnpackError::ThroughLink { .. }), "{e}");
        assert!(e.to_string().contains("\"in/f\""), "{e}");
        assert!(!t.path().join("out/real/f").exists());
        assert!(std::fs::read_dir(outside.path())
            .expect("ls")
            .next()
            .is_none());
    }

    #[test]
    fn unpack_file_over_a_link_replaces_the_link_not_its_target() {
        let outside = tempfile::tempdir().expect("tempdir");
        let victim = outside.path().join("victim");
        std::fs::write(&victim, b"keep").expect("write");
        let t = tempfile::tempdir().expect("tempdir");
        let out = t.path().join("out");
        std::fs::create_dir(&out).expect("mkdir");
        // Left there by someone: a link pointing out, named as a member.
        std::os::unix::fs::symlink(&victim, out.join("f")).expect("symlink");
        unpack(archive(&[file("f", b"new")]).as_slice(), &out).expect("unpacked");
        assert_eq!(std::fs::read(&victim).expect("read"), b"keep");
        assert!(std::fs::symlink_metadata(out.join("f"))
            .expect("meta")
            .is_file());
    }

    #[test]
    fn unpack_hard_link_out_is_refused() {
        for (target, why) in [
            ("/etc/passwd", "not a path inside"),
            ("../../etc/passwd", "not a path inside"),
            ("missing", "was not unpacked"),
        ] {
            let (t, r) = unpack_into(&[link("h", EntryType::Link, target)]);
            let e = r.expect_err(target);
            assert!(matches!(e, UnpackError::HardLink { .. }), "{target}: {e}");
            assert!(e.to_string().contains(why), "{target}: {e}");
            assert!(!t.path().join("out/h").exists());
        }
        // Through an inside link to a directory, to what that holds.
        let (_t, r) = unpack_into(&[
            dir("d/"),
            file("d/f", b"x"),
            link("l", EntryType::Symlink, "d"),
            link("h", EntryType::Link, "l/f"),
        ]);
        let e = r.expect_err("behind a link");
        assert!(e.to_string().contains("behind a symbolic link"), "{e}");
    }

    #[test]
    fn unpack_strips_setuid_setgid_and_sticky_bits() {
        let (t, r) = unpack_into(&[
            M {
                name: "suid",
                kind: EntryType::Regular,
                mode: 0o4755,
                link: "",
                data: b"#!/bin/sh\n",
            },
            M {
                name: "sgid",
                kind: EntryType::Regular,
                mode: 0o2755,
                link: "",
                data: b"",
            },
            M {
                name: "sticky/",
                kind: EntryType::Directory,
                mode: 0o3777,
                link: "",
                data: b"",
            },
        ]);
        r.expect("unpacked");
        let mode = |n: &str| {
            std::fs::metadata(t.path().join("out").join(n))
                .expect("meta")
                .mode()
        };
        assert_eq!(mode("suid") & 0o7777, 0o755);
        assert_eq!(mode("sgid") & 0o7777, 0o755);
        assert_eq!(mode("sticky") & 0o7777, 0o777);
    }

    #[test]
    fn unpack_device_nodes_and_fifos_are_refused_by_name() {
        for (kind, what) in [
            (EntryType::Char, "character device"),
            (EntryType::Block, "block device"),
            (EntryType::Fifo, "FIFO"),
        ] {
            let (t, r) = unpack_into(&[M {
                name: "dev/node",
                kind,
                mode: 0o666,
                link: "",
                data: b"",
            }]);
            let e = r.expect_err(what);
            assert!(matches!(e, UnpackError::Kind { .. }), "{e}");
            assert!(
                e.to_string().contains(what) && e.to_string().contains("dev/node"),
                "{e}"
            );
            assert!(!t.path().join("out/dev/node").exists());
        }
    }

    #[test]
    fn unpack_file_cannot_replace_a_directory() {
        let (_t, r) = unpack_into(&[dir("d/"), file("d/x", b"1"), file("d", b"2")]);
        assert!(matches!(r.expect_err("dir"), UnpackError::Replace { .. }));
    }

    #[test]
    fn symlink_rule_counts_leading_dotdot_against_depth() {
        let ok = |rel: &str, t: &str| symlink_stays_inside(Path::new(rel), Path::new(t));
        assert!(ok("a", "b"));
        assert!(ok("a/b/c", "../../x"));
        assert!(!ok("a/b/c", "../../../x"));
        assert!(!ok("a/b", "x/../../y"));
        assert!(!ok("a", "/etc"));
        assert!(ok("a/b", "./../c"));
    }
}
