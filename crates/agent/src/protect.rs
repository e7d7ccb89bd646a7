//! Protected paths: what a template's grader and tests stand on. `Protect`
//! takes them out of every user's hands but root's: everything under them
//! becomes root's, loses write permission for group and others, and is
//! made immutable (`chattr +i`), so that no user but root can write,
//! rename or remove it, or add to a protected directory, even inside a
//! directory that user owns. `Digest` records what is there, so the host
//! can tell later whether anything changed.
//!
//! Links are never followed: a protected tree's link is recorded as the
//! link (its target), and a protected path that is a link stays one.
//!
//! In a gVisor sandbox, which has no immutable attribute, each protected
//! path is instead mounted on itself read-only after the same change of
//! owner and mode: nothing under it can be written, and it cannot be
//! renamed or removed (`EBUSY`), by any user, as with `chattr +i`; root
//! can unmount it, as root can `chattr -i` on a microVM, and the digest
//! check sees what follows either way. A protected path that is a link is
//! left a link (a mount would follow it).

use std::fs::{self, File, Metadata, OpenOptions};
use std::io::{self, Read};
use std::os::unix::fs::{MetadataExt, OpenOptionsExt, PermissionsExt};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};

use forkbox_proto::client::MAX_DIR_ENTRIES;
use forkbox_proto::{AgentError, DigestEntry, ErrorKind, FileKind, Response};
use sha2::{Digest as _, Sha256};

use crate::fork::RunsOn;
use crate::server::send;
use crate::{files, sys};

/// Digest entries per `Digests` frame: ~250 bytes of JSON each keeps a
/// batch far below the frame limit.
const ENTRIES_PER_BATCH: usize = 1000;

fn io_err(what: &str, path: &Path, e: &io::Error) -> AgentError {
    AgentError::new(
        ErrorKind::from_io(e.kind()),
        format!("{what} {}: {e}", path.display()),
    )
}

fn absolute(path: &str) -> Result<&Path, AgentError> {
    let p = Path::new(path);
    if p.is_absolute() && p != Path::new("/") {
        Ok(p)
    } else {
        Err(AgentError::new(
            ErrorKind::InvalidRequest,
            format!("protected path {path:?} must be absolute and not /"),
        ))
    }
}

/// Every path under `root` (itself first), links not followed, each
/// directory's entries in name order; `visit` gets each with its `lstat`.
/// Stops with `TooManyEntries`-style `InvalidRequest` past
/// [`MAX_DIR_ENTRIES`].
fn walk(
    root: &Path,
    visit: &mut dyn FnMut(&Path, &Metadata) -> Result<(), AgentError>,
) -> Result<u64, AgentError> {
    let mut stack = vec![root.to_path_buf()];
    let mut count = 0u64;
    while let Some(path) = stack.pop() {
        let meta = match fs::symlink_metadata(&path) {
            Ok(m) => m,
            // Removed while walking: not there.
            Err(e) if e.kind() == io::ErrorKind::NotFound && path != root => continue,
            Err(e) => return Err(io_err("stat", &path, &e)),
        };
        count += 1;
        if count > MAX_DIR_ENTRIES as u64 {
            return Err(AgentError::new(
                ErrorKind::InvalidRequest,
                format!(
                    "{} holds more than {MAX_DIR_ENTRIES} entries; protect less",
                    root.display()
                ),
            ));
        }
        visit(&path, &meta)?;
        if meta.is_dir() {
            let mut names: Vec<PathBuf> = fs::read_dir(&path)
                .map_err(|e| io_err("list", &path, &e))?
                .filter_map(|e| e.ok().map(|e| e.path()))
                .collect();
            // Popped in reverse: name order.
            names.sort_unstable_by(|a, b| b.cmp(a));
            stack.extend(names);
        }
    }
    Ok(count)
}

pub fn protect(paths: &[String], runs_on: RunsOn) -> Result<Response, AgentError> {
    let mount = runs_on == RunsOn::Sandbox;
    if mount {
        // Protected again: its owner and modes change under last time's
        // mount, made again after.
        for path in paths {
            let _ = sys::unmount_detached(absolute(path)?);
        }
    }
    for path in paths {
        walk(absolute(path)?, &mut |p, meta| {
            let ft = meta.file_type();
            // A link cannot be made immutable (nor opened to try); it is
            // protected by its directory's being immutable. So are
            // devices, FIFOs and sockets, which are not opened either.
            let file = (ft.is_file() || ft.is_dir())
                .then(|| open_here(p))
                .transpose()?;
            let immutable = |on: bool| -> Result<(), AgentError> {
                match &file {
                    Some(f) if !mount => sys::set_immutable(f, on).map(drop).map_err(|e| {
                        io_err("setting the immutable attribute (chattr +i) of", p, &e)
                    }),
                    _ => Ok(()),
                }
            };
            immutable(false)?;
            std::os::unix::fs::lchown(p, Some(0), Some(0)).map_err(|e| io_err("chown", p, &e))?;
            if !ft.is_symlink() {
                // chown cleared a file's set-user and set-group bits: read
                // the mode again before taking write away.
                let mode = fs::symlink_metadata(p)
                    .map_err(|e| io_err("stat", p, &e))?
                    .mode();
                fs::set_permissions(p, fs::Permissions::from_mode(mode & 0o7755))
                    .map_err(|e| io_err("chmod", p, &e))?;
            }
            immutable(true)
        })?;
    }
    if mount {
        for path in paths {
            let path = absolute(path)?;
            let link = fs::symlink_metadata(path).is_ok_and(|m| m.file_type().is_symlink());
            if !link {
                sys::bind_read_only(path)
                    .map_err(|e| io_err("mounting read-only (a bind mount on itself)", path, &e))?;
            }
        }
    }
    Ok(Response::Ok)
}

/// Opens `path` to read, no following a link swapped in since its `lstat`
/// and no blocking on a FIFO swapped in.
fn open_here(path: &Path) -> Result<File, AgentError> {
    OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
        .open(path)
        .map_err(|e| io_err("open", path, &e))
}

pub fn digest(conn: &UnixStream, paths: &[String]) -> Result<(), AgentError> {
    let gone = |e: io::Error| AgentError::new(ErrorKind::Io, format!("connection lost: {e}"));
    let mut roots = paths
        .iter()
        .map(|p| absolute(p))
        .collect::<Result<Vec<_>, _>>()?;
    roots.sort_unstable();
    roots.dedup();
    let mut batch = Vec::new();
    let mut count = 0u64;
    for root in roots {
        if fs::symlink_metadata(root).is_err_and(|e| e.kind() == io::ErrorKind::NotFound) {
            continue;
        }
        count += walk(root, &mut |p, meta| {
            batch.push(entry(p, meta)?);
            if batch.len() == ENTRIES_PER_BATCH {
                let entries = std::mem::take(&mut batch);
                send(conn, &Response::Digests { entries }).map_err(gone)?;
            }
            Ok(())
        })?;
    }
    if !batch.is_empty() {
        send(conn, &Response::Digests { entries: batch }).map_err(gone)?;
    }
    send(conn, &Response::Done { bytes: count }).map_err(gone)
}

fn entry(path: &Path, meta: &Metadata) -> Result<DigestEntry, AgentError> {
    let stat = files::file_stat(meta);
    let content = match stat.kind {
        FileKind::Symlink => fs::read_link(path)
            .map_err(|e| io_err("readlink", path, &e))?
            .to_string_lossy()
            .into_owned(),
        FileKind::File => sha256_of(path)?,
        FileKind::Dir | FileKind::Other => String::new(),
    };
    Ok(DigestEntry {
        path: path.to_string_lossy().into_owned(),
        kind: stat.kind,
        mode: stat.mode,
        uid: stat.uid,
        gid: stat.gid,
        size: if stat.kind == FileKind::File {
            stat.size
        } else {
            0
        },
        content,
    })
}

fn sha256_of(path: &Path) -> Result<String, AgentError> {
    let mut file = open_here(path)?;
    let mut hash = Sha256::new();
    let mut buf = vec![0u8; 256 * 1024];
    loop {
        match file.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => hash.update(&buf[..n]),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(io_err("read", path, &e)),
        }
    }
    Ok(hash.finalize().iter().map(|b| format!("{b:02x}")).collect())
}
