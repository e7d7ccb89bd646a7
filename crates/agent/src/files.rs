//! File requests: read, write, list, stat, mkdir, remove, tar download
//! and upload. Every path must be absolute.
//!
//! Tar upload refuses (does not skip) entries that would land outside the
//! target: absolute paths, `..` components, hard links pointing outside,
//! and writes through symlinks (a symlink entry followed by an entry
//! below it, or an existing symlink in the way). This is checked before
//! each entry against the file system as it is at that moment; a process
//! in the guest racing the upload could still swap a directory for a
//! symlink (the guest is the user's anyway; the host is not at risk).

use std::fs::{self, DirBuilder, OpenOptions};
use std::io::{self, BufWriter, Read, Write};
use std::os::fd::AsFd;
use std::os::unix::fs::{DirBuilderExt, MetadataExt, OpenOptionsExt, PermissionsExt};
use std::os::unix::net::UnixStream;
use std::path::{Component, Path, PathBuf};

use forkbox_proto::frame::{read_frame, write_frame};
use forkbox_proto::{
    AgentError, DirEntry, ErrorKind, FileKind, FileStat, FrameKind, Response, DATA_CHUNK,
    MAX_FRAME_LEN,
};

use crate::server::send;
use crate::sys;

/// Directory entries per `Entries` frame: ~300 bytes of JSON each keeps a
/// batch far below the frame limit.
const ENTRIES_PER_BATCH: usize = 1000;

fn io_err(what: &str, path: &str, e: &io::Error) -> AgentError {
    AgentError::new(ErrorKind::from_io(e.kind()), format!("{what} {path}: {e}"))
}

fn absolute(path: &str) -> Result<&Path, AgentError> {
    let p = Path::new(path);
    if p.is_absolute() {
        Ok(p)
    } else {
        Err(AgentError::new(
            ErrorKind::InvalidRequest,
            format!("path {path:?} is not absolute"),
        ))
    }
}

fn gone(e: &io::Error) -> AgentError {
    AgentError::new(ErrorKind::Io, format!("connection lost: {e}"))
}

fn too_large(what: &str, path: &str, max: u64) -> AgentError {
    AgentError::new(
        ErrorKind::TooLarge,
        format!("{what} {path} is larger than the limit of {max} bytes"),
    )
}

/// Streams a file; with `max_bytes`, refuses a regular file larger than
/// that at once and stops anything else (a device, a FIFO, a file that
/// grows) once more would be sent.
pub fn read_file(conn: &UnixStream, path: &str, max_bytes: Option<u64>) -> Result<(), AgentError> {
    let p = absolute(path)?;
    // Non-blocking open: a FIFO nobody writes opens (and reads as empty)
    // instead of holding this thread in `open`; reads block again below.
    let file = OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK)
        .open(p)
        .map_err(|e| io_err("open", path, &e))?;
    sys::set_blocking(file.as_fd()).map_err(|e| io_err("open", path, &e))?;
    let meta = file.metadata().map_err(|e| io_err("stat", path, &e))?;
    if meta.is_dir() {
        return Err(AgentError::new(
            ErrorKind::IsADirectory,
            format!("{path} is a directory"),
        ));
    }
    if let Some(max) = max_bytes.filter(|m| meta.is_file() && meta.len() > *m) {
        return Err(AgentError::new(
            ErrorKind::TooLarge,
            format!(
                "file {path} is {} bytes, over the limit of {max} bytes",
                meta.len()
            ),
        ));
    }
    let mut buf = Vec::with_capacity(DATA_CHUNK);
    let mut bytes = 0u64;
    let mut w = conn;
    loop {
        let n = match sys::read_into(file.as_fd(), &mut buf) {
            Ok(0) => break,
            Ok(n) => n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(io_err("read", path, &e)),
        };
        if let Some(max) = max_bytes.filter(|m| bytes + n as u64 > *m) {
            // Up to the limit exactly: a cut stream is told by its length.
            let room = (max - bytes) as usize;
            if room > 0 {
                write_frame(&mut w, FrameKind::Data, &buf[..room]).map_err(|e| gone(&e))?;
            }
            return Err(too_large("file", path, max));
        }
        write_frame(&mut w, FrameKind::Data, &buf[..n]).map_err(|e| gone(&e))?;
        bytes += n as u64;
    }
    send(conn, &Response::Done { bytes }).map_err(|e| gone(&e))
}

pub fn write_file(
    conn: &UnixStream,
    path: &str,
    mode: u32,
    create_parents: bool,
) -> Result<(), AgentError> {
    let p = absolute(path)?;
    if create_parents {
        if let Some(parent) = p.parent() {
            fs::create_dir_all(parent).map_err(|e| io_err("create parents of", path, &e))?;
        }
    }
    let mut file = OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(mode & 0o7777)
        .open(p)
        .map_err(|e| io_err("create", path, &e))?;
    // `mode` above is filtered by the umask and ignored for existing files.
    file.set_permissions(fs::Permissions::from_mode(mode & 0o7777))
        .map_err(|e| io_err("chmod", path, &e))?;
    send(conn, &Response::Ready).map_err(|e| gone(&e))?;
    let mut source = FrameSource::new(conn);
    let copied = io::copy(&mut source, &mut file);
    let bytes = match copied {
        Ok(n) => n,
        Err(e) if source.failed => return Err(gone(&e)),
        Err(e) => {
            source.drain();
            return Err(io_err("write", path, &e));
        }
    };
    file.sync_data().map_err(|e| io_err("sync", path, &e))?;
    send(conn, &Response::Done { bytes }).map_err(|e| gone(&e))
}

/// A path's `lstat` as the protocol carries it.
pub(crate) fn file_stat(meta: &fs::Metadata) -> FileStat {
    let ft = meta.file_type();
    let kind = if ft.is_symlink() {
        FileKind::Symlink
    } else if ft.is_dir() {
        FileKind::Dir
    } else if ft.is_file() {
        FileKind::File
    } else {
        FileKind::Other
    };
    FileStat {
        kind,
        size: meta.len(),
        mode: meta.mode() & 0o7777,
        mtime: meta.mtime(),
        uid: meta.uid(),
        gid: meta.gid(),
    }
}

pub fn list_dir(conn: &UnixStream, path: &str) -> Result<(), AgentError> {
    let p = absolute(path)?;
    let dir = fs::read_dir(p).map_err(|e| io_err("list", path, &e))?;
    let mut batch = Vec::new();
    let mut count = 0u64;
    for entry in dir {
        let entry = entry.map_err(|e| io_err("list", path, &e))?;
        // An entry removed while listing is simply skipped.
        let Ok(meta) = fs::symlink_metadata(entry.path()) else {
            continue;
        };
        batch.push(DirEntry {
            name: entry.file_name().to_string_lossy().into_owned(),
            stat: file_stat(&meta),
        });
        count += 1;
        if batch.len() == ENTRIES_PER_BATCH {
            let entries = std::mem::take(&mut batch);
            send(conn, &Response::Entries { entries }).map_err(|e| gone(&e))?;
        }
    }
    if !batch.is_empty() {
        send(conn, &Response::Entries { entries: batch }).map_err(|e| gone(&e))?;
    }
    send(conn, &Response::Done { bytes: count }).map_err(|e| gone(&e))
}

pub fn stat(path: &str) -> Result<Response, AgentError> {
    let meta = fs::symlink_metadata(absolute(path)?).map_err(|e| io_err("stat", path, &e))?;
    Ok(Response::Stat {
        stat: file_stat(&meta),
    })
}

pub fn mkdir(path: &str, mode: u32) -> Result<Response, AgentError> {
    DirBuilder::new()
        .recursive(true)
        .mode(mode & 0o7777)
        .create(absolute(path)?)
        .map_err(|e| io_err("mkdir", path, &e))?;
    Ok(Response::Ok)
}

pub fn remove(path: &str, recursive: bool) -> Result<Response, AgentError> {
    let p = absolute(path)?;
    if p == Path::new("/") {
        return Err(AgentError::new(
            ErrorKind::InvalidRequest,
            "refusing to remove /",
        ));
    }
    let meta = fs::symlink_metadata(p).map_err(|e| io_err("remove", path, &e))?;
    let res = if !meta.is_dir() {
        fs::remove_file(p)
    } else if recursive {
        fs::remove_dir_all(p)
    } else {
        fs::remove_dir(p)
    };
    res.map_err(|e| io_err("remove", path, &e))?;
    Ok(Response::Ok)
}

/// Streams a directory as a tar archive; with `max_bytes`, stops (with
/// [`ErrorKind::TooLarge`]) once the archive would pass it.
pub fn download_tar(
    conn: &UnixStream,
    path: &str,
    max_bytes: Option<u64>,
) -> Result<(), AgentError> {
    let p = absolute(path)?;
    let meta = fs::metadata(p).map_err(|e| io_err("open", path, &e))?;
    if !meta.is_dir() {
        return Err(AgentError::new(
            ErrorKind::NotADirectory,
            format!("{path} is not a directory"),
        ));
    }
    let sink = FrameSink {
        conn,
        bytes: 0,
        max: max_bytes,
        over: false,
    };
    let mut builder = tar::Builder::new(BufWriter::with_capacity(DATA_CHUNK, sink));
    builder.follow_symlinks(false);
    let over = |b: &mut tar::Builder<BufWriter<FrameSink<'_>>>| b.get_mut().get_ref().over;
    let appended = builder.append_dir_all(".", p);
    if let (true, Some(max)) = (over(&mut builder), max_bytes) {
        return Err(too_large("the archive of", path, max));
    }
    appended.map_err(|e| io_err("archive", path, &e))?;
    builder.finish().map_err(|e| io_err("archive", path, &e))?;
    if let (true, Some(max)) = (over(&mut builder), max_bytes) {
        return Err(too_large("the archive of", path, max));
    }
    let sink = builder
        .into_inner()
        .map_err(|e| io_err("archive", path, &e))?;
    let sink = match sink.into_inner() {
        Ok(sink) => sink,
        Err(e) => {
            let (e, w) = e.into_parts();
            return Err(match max_bytes.filter(|_| w.get_ref().over) {
                Some(max) => too_large("the archive of", path, max),
                None => io_err("archive", path, &e),
            });
        }
    };
    send(conn, &Response::Done { bytes: sink.bytes }).map_err(|e| gone(&e))
}

pub fn upload_tar(conn: &UnixStream, path: &str) -> Result<(), AgentError> {
    let target = absolute(path)?;
    fs::create_dir_all(target).map_err(|e| io_err("create", path, &e))?;
    let target = fs::canonicalize(target).map_err(|e| io_err("resolve", path, &e))?;
    send(conn, &Response::Ready).map_err(|e| gone(&e))?;
    let mut source = FrameSource::new(conn);
    let result = unpack(&mut source, &target);
    if source.failed {
        return Err(AgentError::new(
            ErrorKind::Io,
            "connection lost during upload",
        ));
    }
    // Read what is left of the stream (tar padding, or everything after a
    // refused entry) so the client gets our answer, not a broken pipe.
    source.drain();
    result?;
    send(
        conn,
        &Response::Done {
            bytes: source.bytes,
        },
    )
    .map_err(|e| gone(&e))
}

fn unpack(source: &mut FrameSource<'_>, target: &Path) -> Result<(), AgentError> {
    let mut archive = tar::Archive::new(source);
    archive.set_preserve_permissions(true);
    archive.set_preserve_mtime(true);
    archive.set_overwrite(true);
    archive.set_unpack_xattrs(false);
    let bad = |e: &io::Error| AgentError::new(ErrorKind::InvalidRequest, format!("tar: {e}"));
    for entry in archive.entries().map_err(|e| bad(&e))? {
        let mut entry = entry.map_err(|e| bad(&e))?;
        let name = entry.path().map_err(|e| bad(&e))?.into_owned();
        let rel = contained(&name)?;
        if rel.as_os_str().is_empty() {
            continue; // the archive's root ("./")
        }
        let dst = target.join(&rel);
        no_symlink_between(target, &dst)?;
        if entry.header().entry_type().is_hard_link() {
            if let Some(link) = entry.link_name().map_err(|e| bad(&e))? {
                let src = target.join(contained(&link)?);
                no_symlink_between(target, &src)?;
            }
        }
        // Never write through a symlink that is already at `dst`.
        if let Ok(meta) = fs::symlink_metadata(&dst) {
            if meta.file_type().is_symlink() {
                fs::remove_file(&dst).map_err(|e| io_err("replace", &dst.to_string_lossy(), &e))?;
            }
        }
        let unpacked = entry
            .unpack_in(target)
            .map_err(|e| io_err("unpack", &name.to_string_lossy(), &e))?;
        if !unpacked {
            return Err(escape(&name));
        }
    }
    Ok(())
}

fn escape(name: &Path) -> AgentError {
    AgentError::new(
        ErrorKind::InvalidRequest,
        format!("tar entry {} escapes the target directory", name.display()),
    )
}

/// The entry's path as plain relative components, or a refusal.
fn contained(name: &Path) -> Result<PathBuf, AgentError> {
    let mut out = PathBuf::new();
    for c in name.components() {
        match c {
            Component::Normal(p) => out.push(p),
            Component::CurDir => {}
            Component::ParentDir | Component::RootDir | Component::Prefix(_) => {
                return Err(escape(name))
            }
        }
    }
    Ok(out)
}

/// Refuses if any existing directory between `root` (exclusive) and
/// `path` (exclusive) is a symlink.
fn no_symlink_between(root: &Path, path: &Path) -> Result<(), AgentError> {
    let Ok(rel) = path.strip_prefix(root) else {
        return Err(escape(path));
    };
    let mut cur = root.to_path_buf();
    let mut comps: Vec<_> = rel.components().collect();
    comps.pop();
    for c in comps {
        cur.push(c);
        match fs::symlink_metadata(&cur) {
            Ok(m) if m.file_type().is_symlink() => return Err(escape(rel)),
            Ok(_) => {}
            Err(_) => break, // does not exist yet: nothing below can either
        }
    }
    Ok(())
}

/// Reads the client's `Data` frames up to its `Eof`.
pub struct FrameSource<'a> {
    conn: &'a UnixStream,
    buf: Vec<u8>,
    pos: usize,
    eof: bool,
    /// The connection broke (as opposed to a local write error).
    failed: bool,
    /// Data bytes received.
    bytes: u64,
}

impl<'a> FrameSource<'a> {
    pub fn new(conn: &'a UnixStream) -> Self {
        Self {
            conn,
            buf: Vec::new(),
            pos: 0,
            eof: false,
            failed: false,
            bytes: 0,
        }
    }

    /// Discards frames up to `Eof`.
    pub fn drain(&mut self) {
        let mut sink = [0u8; 8192];
        while !self.eof && !self.failed {
            if self.read(&mut sink).is_err() {
                return;
            }
            self.pos = self.buf.len();
        }
    }
}

impl Read for FrameSource<'_> {
    fn read(&mut self, out: &mut [u8]) -> io::Result<usize> {
        while self.pos == self.buf.len() {
            if self.eof {
                return Ok(0);
            }
            let mut c = self.conn;
            match read_frame(&mut c, MAX_FRAME_LEN) {
                Ok(Some(f)) if f.kind == FrameKind::Data => {
                    self.bytes += f.body.len() as u64;
                    self.buf = f.body;
                    self.pos = 0;
                }
                Ok(Some(f)) if f.kind == FrameKind::Eof => self.eof = true,
                other => {
                    self.failed = true;
                    let why = match other {
                        Ok(Some(f)) => format!("unexpected {:?} frame in a data stream", f.kind),
                        Ok(None) => "client closed the stream before EOF".into(),
                        Err(e) => e.to_string(),
                    };
                    return Err(io::Error::new(io::ErrorKind::UnexpectedEof, why));
                }
            }
        }
        let n = out.len().min(self.buf.len() - self.pos);
        out[..n].copy_from_slice(&self.buf[self.pos..self.pos + n]);
        self.pos += n;
        Ok(n)
    }
}

/// Writes `Data` frames of at most `DATA_CHUNK` bytes.
struct FrameSink<'a> {
    conn: &'a UnixStream,
    bytes: u64,
    /// Fail writes that would pass this many bytes in all.
    max: Option<u64>,
    /// A write failed for passing `max`.
    over: bool,
}

impl Write for FrameSink<'_> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        let n = buf.len().min(DATA_CHUNK);
        if n == 0 {
            return Ok(0);
        }
        if let Some(max) = self.max.filter(|m| self.bytes + n as u64 > *m) {
            // Up to the limit exactly (a cut archive is told by its
            // length), then fail.
            let room = (max - self.bytes) as usize;
            if room > 0 {
                let mut c = self.conn;
                write_frame(&mut c, FrameKind::Data, &buf[..room])?;
                self.bytes += room as u64;
                return Ok(room);
            }
            self.over = true;
            return Err(io::Error::other("the archive passed its limit"));
        }
        let mut c = self.conn;
        write_frame(&mut c, FrameKind::Data, &buf[..n])?;
        self.bytes += n as u64;
        Ok(n)
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}
