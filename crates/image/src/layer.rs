//! One layer: a (compressed) tar blob unpacked into a directory, its OCI
//! whiteouts turned into what overlayfs reads (a `0:0` character device for
//! a removed path, `trusted.overlay.opaque=y` on an opaque directory), then
//! packed into a read-only erofs file by `mkfs.erofs`.
//!
//! Unpacking keeps every file's owner, mode (setuid bits included), times,
//! device numbers and extended attributes, so it needs root. It never
//! leaves the directory it unpacks into: a path with `..` or an absolute
//! path is refused, and so is an entry reached through a symbolic link the
//! layer made. Symbolic links are stored as written; they resolve inside
//! the guest, never here.

use std::ffi::OsStr;
use std::fs::{self, File};
use std::io::{self, BufReader, Read};
use std::path::{Component, Path, PathBuf};
use std::process::Command;

use rustix::fs::{AtFlags, FileType, Mode, Timespec, Timestamps, XattrFlags, CWD};
use rustix::process::{Gid, Uid};

use crate::digest::{Digest, HashingReader};

/// The prefix of an OCI whiteout's name.
const WHITEOUT: &str = ".wh.";
/// The name that makes its directory opaque.
const OPAQUE: &str = ".wh..wh..opq";
/// Extended attributes overlayfs reads from a lower layer. A layer may not
/// set them itself: they would redirect or hide paths of other layers.
const OVERLAY_XATTRS: &str = "trusted.overlay.";

#[derive(Debug, thiserror::Error)]
pub enum LayerError {
    #[error("importing a layer needs root: it keeps each file's owner and device numbers and writes overlayfs whiteouts (run it as root, or through forkboxd)")]
    NotRoot,
    #[error("reading the layer")]
    Read(#[source] io::Error),
    #[error("layer entry `{path}`: {why}")]
    BadEntry { path: String, why: &'static str },
    #[error("unpacking `{path}`")]
    Write {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("the layer's content is {found}, not the {expected} its image names (a corrupt or substituted layer)")]
    DiffIdMismatch { expected: Digest, found: Digest },
    #[error("cannot run mkfs.erofs (install it: `apt-get install erofs-utils`)")]
    MkfsMissing(#[source] io::Error),
    #[error("mkfs.erofs failed: {0}")]
    Mkfs(String),
}

/// A layer's compression, from the first bytes of its blob (the media
/// type says the same for a well-formed image; the bytes cannot lie).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Compression {
    None,
    Gzip,
    Zstd,
}

impl Compression {
    pub fn sniff(head: &[u8]) -> Self {
        match head {
            [0x1f, 0x8b, ..] => Compression::Gzip,
            [0x28, 0xb5, 0x2f, 0xfd, ..] => Compression::Zstd,
            _ => Compression::None,
        }
    }
}

/// What unpacking one layer made.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Unpacked {
    /// Entries written (files, directories, links, devices, whiteouts).
    pub entries: u64,
    /// Bytes of the uncompressed tar stream.
    pub tar_bytes: u64,
    /// Bytes of the erofs file.
    pub erofs_bytes: u64,
}

/// Unpacks the layer blob at `blob` under `work` and packs it into the
/// erofs file `out`. The tar stream's digest must be `diff_id` (the
/// image's configuration names it); `out` is written only when it is.
pub fn convert(
    blob: &Path,
    diff_id: &Digest,
    work: &Path,
    out: &Path,
) -> Result<Unpacked, LayerError> {
    if !rustix::process::geteuid().is_root() {
        return Err(LayerError::NotRoot);
    }
    let root = work.join("root");
    fs::create_dir(&root).map_err(write_err(&root))?;
    let mut stats = unpack(blob, diff_id, &root)?;
    // The layer's root: overlayfs takes a directory's attributes from the
    // uppermost layer that has it, and the sandbox's upper layer has `/`.
    fs::set_permissions(&root, std::os::unix::fs::PermissionsExt::from_mode(0o755))
        .map_err(write_err(&root))?;
    let output = Command::new("mkfs.erofs")
        .args(["--quiet", "--preserve-mtime"])
        .arg(out)
        .arg(&root)
        .output()
        .map_err(LayerError::MkfsMissing)?;
    if !output.status.success() {
        let stderr = String::from_utf8_lossy(&output.stderr);
        return Err(LayerError::Mkfs(stderr.trim().to_owned()));
    }
    stats.erofs_bytes = fs::metadata(out).map_err(write_err(out))?.len();
    Ok(stats)
}

/// Unpacks an image's layers (their blobs, bottom first) into the empty
/// directory `root` as one tree, the files a guest sees through overlayfs:
/// a whiteout removes what lower layers put at its path, an opaque
/// directory what they put in it, and an upper layer's entry replaces a
/// lower one's. Each layer is unpacked (checked against its `diff_id`)
/// under `work`, on the same file system as `root`, and moved into place.
/// For a writable disk that starts with an image's files. Needs root.
pub fn unpack_merged(
    layers: &[(PathBuf, Digest)],
    work: &Path,
    root: &Path,
) -> Result<u64, LayerError> {
    if !rustix::process::geteuid().is_root() {
        return Err(LayerError::NotRoot);
    }
    let mut entries = 0;
    for (i, (blob, diff_id)) in layers.iter().enumerate() {
        let dir = work.join(format!("layer-{i}"));
        fs::create_dir(&dir).map_err(write_err(&dir))?;
        let (unpacked, hides) = unpack_with(blob, diff_id, &dir, Whiteouts::Listed)?;
        entries += unpacked.entries;
        // What the layer hides of the layers below goes first; then its
        // own entries go over what is left.
        for rel in &hides {
            if let Some(lower) = inside(root, rel) {
                let meta = fs::symlink_metadata(&lower).ok();
                remove_any(&lower, meta.as_ref())?;
            }
        }
        merge_into(&dir, root)?;
        fs::remove_dir(&dir).map_err(write_err(&dir))?;
    }
    Ok(entries)
}

/// `rel` under `root` if every directory on the way is one (not a
/// symbolic link a lower layer made: a whiteout behind one hides nothing
/// there, and nothing outside `root` is ever touched).
fn inside(root: &Path, rel: &Path) -> Option<PathBuf> {
    let mut at = root.to_path_buf();
    let mut names = rel.components().peekable();
    while let Some(name) = names.next() {
        at.push(name);
        if names.peek().is_some() && !fs::symlink_metadata(&at).ok()?.is_dir() {
            return None;
        }
    }
    Some(at)
}

/// Moves the unpacked layer `from` over the tree `to` (see
/// [`unpack_merged`]), leaving `from` empty.
fn merge_into(from: &Path, to: &Path) -> Result<(), LayerError> {
    for entry in fs::read_dir(from).map_err(LayerError::Read)? {
        let entry = entry.map_err(LayerError::Read)?;
        let (src, dst) = (entry.path(), to.join(entry.file_name()));
        let meta = fs::symlink_metadata(&src).map_err(LayerError::Read)?;
        let lower = fs::symlink_metadata(&dst).ok();
        if meta.is_dir() && lower.as_ref().is_some_and(|m| m.is_dir()) {
            // Both layers have the directory: the upper one's entries go
            // in, and its attributes win.
            merge_into(&src, &dst)?;
            copy_attributes(&meta, &dst)?;
            fs::remove_dir(&src).map_err(write_err(&src))?;
        } else {
            remove_any(&dst, lower.as_ref())?;
            fs::rename(&src, &dst).map_err(write_err(&dst))?;
        }
    }
    // Moving entries in and out touched the directory's time.
    let meta = fs::symlink_metadata(from).map_err(LayerError::Read)?;
    copy_attributes(&meta, to)
}

/// Removes `path` whatever it is (`meta`: what is there, if anything).
fn remove_any(path: &Path, meta: Option<&fs::Metadata>) -> Result<(), LayerError> {
    match meta {
        None => Ok(()),
        Some(m) if m.is_dir() => fs::remove_dir_all(path).map_err(write_err(path)),
        Some(_) => fs::remove_file(path).map_err(write_err(path)),
    }
}

/// Gives the directory `to` the owner, mode and modification time `meta`
/// (another directory's) has.
fn copy_attributes(meta: &fs::Metadata, to: &Path) -> Result<(), LayerError> {
    use std::os::unix::fs::{MetadataExt, PermissionsExt};
    let owner = (
        Some(Uid::from_raw(meta.uid())),
        Some(Gid::from_raw(meta.gid())),
    );
    rustix::fs::chownat(CWD, to, owner.0, owner.1, AtFlags::SYMLINK_NOFOLLOW)
        .map_err(|e| write_err(to)(e.into()))?;
    fs::set_permissions(to, fs::Permissions::from_mode(meta.mode() & 0o7777))
        .map_err(write_err(to))?;
    set_mtime(to, meta.mtime().max(0) as u64).map_err(|e| e.at(to))
}

/// Unpacks the blob into `root` (an empty directory), checking its digest.
fn unpack(blob: &Path, diff_id: &Digest, root: &Path) -> Result<Unpacked, LayerError> {
    unpack_with(blob, diff_id, root, Whiteouts::Overlayfs).map(|(u, _)| u)
}

/// What becomes of a layer's whiteouts and opaque directories.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Whiteouts {
    /// Written as overlayfs reads them: a `0:0` character device, the
    /// `trusted.overlay.opaque` attribute.
    Overlayfs,
    /// Listed (the paths of the layers below they hide), nothing written
    /// for them: for [`unpack_merged`], which needs neither device nodes
    /// nor `trusted.*` attributes, so it also works where the host's own
    /// file system is an overlayfs (which refuses both).
    Listed,
}

/// [`unpack`], whiteouts done as `how` says; with [`Whiteouts::Listed`],
/// the paths they hide.
fn unpack_with(
    blob: &Path,
    diff_id: &Digest,
    root: &Path,
    how: Whiteouts,
) -> Result<(Unpacked, Vec<PathBuf>), LayerError> {
    let mut file = BufReader::new(File::open(blob).map_err(LayerError::Read)?);
    let head = io::BufRead::fill_buf(&mut file).map_err(LayerError::Read)?;
    let stream: Box<dyn Read> = match Compression::sniff(head) {
        Compression::None => Box::new(file),
        Compression::Gzip => Box::new(flate2::read::MultiGzDecoder::new(file)),
        Compression::Zstd => {
            Box::new(zstd::stream::read::Decoder::with_buffer(file).map_err(LayerError::Read)?)
        }
    };
    let mut hashing = HashingReader::new(stream);
    let mut unpacker = Unpacker::new(root);
    unpacker.whiteouts = how;
    {
        let mut archive = tar::Archive::new(&mut hashing);
        for entry in archive.entries().map_err(LayerError::Read)? {
            unpacker.entry(entry.map_err(LayerError::Read)?)?;
        }
    }
    let (found, tar_bytes) = hashing.finish().map_err(LayerError::Read)?;
    if &found != diff_id {
        return Err(LayerError::DiffIdMismatch {
            expected: diff_id.clone(),
            found,
        });
    }
    unpacker.finish()?;
    Ok((
        Unpacked {
            entries: unpacker.entries,
            tar_bytes,
            erofs_bytes: 0,
        },
        unpacker.hides,
    ))
}

/// Where a tar entry goes.
#[derive(Debug, PartialEq, Eq)]
enum Target {
    /// The layer's root itself (`./`): nothing to write.
    Root,
    /// An ordinary entry at this relative path.
    Path(PathBuf),
    /// A whiteout: this path of a lower layer is removed.
    Whiteout(PathBuf),
    /// This directory hides the lower layers' contents of it.
    Opaque(PathBuf),
}

/// A path inside the layer: relative, with no `..`; `.` components dropped.
pub(crate) fn relative_path(raw: &Path) -> Result<PathBuf, &'static str> {
    let mut out = PathBuf::new();
    for c in raw.components() {
        match c {
            Component::Normal(name) => out.push(name),
            Component::CurDir => {}
            Component::ParentDir => return Err("has a `..` component"),
            Component::RootDir | Component::Prefix(_) => return Err("is absolute"),
        }
    }
    Ok(out)
}

fn classify(raw: &Path) -> Result<Target, &'static str> {
    let path = relative_path(raw)?;
    let Some(name) = path.file_name().and_then(OsStr::to_str) else {
        return Ok(if path.as_os_str().is_empty() {
            Target::Root
        } else {
            Target::Path(path)
        });
    };
    let parent = path.parent().unwrap_or(Path::new("")).to_owned();
    if name == OPAQUE {
        return Ok(Target::Opaque(parent));
    }
    match name.strip_prefix(WHITEOUT) {
        Some("") => Err("is a whiteout of nothing"),
        Some(hidden) if hidden.starts_with(WHITEOUT) => Err("is an unknown whiteout kind"),
        Some(hidden) => Ok(Target::Whiteout(parent.join(hidden))),
        None => Ok(Target::Path(path)),
    }
}

struct Unpacker {
    root: PathBuf,
    entries: u64,
    /// Directories and their times, set last: writing inside a directory
    /// changes its modification time.
    dirs: Vec<(PathBuf, u64)>,
    whiteouts: Whiteouts,
    /// With [`Whiteouts::Listed`]: the paths of lower layers this one hides.
    hides: Vec<PathBuf>,
}

impl Unpacker {
    fn new(root: &Path) -> Self {
        Self {
            root: root.to_owned(),
            entries: 0,
            dirs: Vec::new(),
            whiteouts: Whiteouts::Overlayfs,
            hides: Vec::new(),
        }
    }

    fn entry<R: Read>(&mut self, mut entry: tar::Entry<'_, R>) -> Result<(), LayerError> {
        let raw = entry.path().map_err(LayerError::Read)?.into_owned();
        let bad = |why| LayerError::BadEntry {
            path: raw.display().to_string(),
            why,
        };
        self.entries += 1;
        match classify(&raw).map_err(bad)? {
            Target::Root => Ok(()),
            Target::Opaque(rel) if self.whiteouts == Whiteouts::Listed => {
                // The directory hides everything below it; it is this
                // layer's own (made, if the layer names it nowhere else).
                self.dir(&rel).map_err(&bad)?;
                self.hides.push(rel);
                Ok(())
            }
            Target::Whiteout(rel) if self.whiteouts == Whiteouts::Listed => {
                self.place(&rel).map_err(&bad)?;
                self.hides.push(rel);
                Ok(())
            }
            Target::Opaque(dir) => {
                let dir = self.dir(&dir).map_err(&bad)?;
                rustix::fs::lsetxattr(&dir, "trusted.overlay.opaque", b"y", XattrFlags::empty())
                    .map_err(|e| write_err(&dir)(e.into()))
            }
            Target::Whiteout(path) => {
                let at = self.place(&path).map_err(&bad)?;
                let dev = rustix::fs::makedev(0, 0);
                rustix::fs::mknodat(CWD, &at, FileType::CharacterDevice, Mode::empty(), dev)
                    .map_err(|e| write_err(&at)(e.into()))
            }
            Target::Path(path) => self.write(&mut entry, &path).map_err(|e| match e {
                Placed::Bad(why) => bad(why),
                Placed::Io(e) => e,
            }),
        }
    }

    /// The host path of the directory `rel`, made (0755, root's) with its
    /// parents where missing. A symbolic link on the way is refused.
    fn dir(&self, rel: &Path) -> Result<PathBuf, &'static str> {
        let mut at = self.root.clone();
        for name in rel.components() {
            at.push(name);
            match fs::symlink_metadata(&at) {
                Ok(m) if m.is_dir() => {}
                Ok(m) if m.is_symlink() => return Err("is reached through a symbolic link"),
                Ok(_) => return Err("is inside something that is not a directory"),
                Err(e) if e.kind() == io::ErrorKind::NotFound => {
                    fs::create_dir(&at).map_err(|_| "has a parent that cannot be made")?;
                }
                Err(_) => return Err("has a parent that cannot be read"),
            }
        }
        Ok(at)
    }

    /// The host path for the entry `rel`, its parents made and whatever
    /// was there removed (a directory over a directory stays: the new
    /// entry only sets its attributes).
    fn place(&self, rel: &Path) -> Result<PathBuf, &'static str> {
        let parent = self.dir(rel.parent().unwrap_or(Path::new("")))?;
        let at = parent.join(rel.file_name().ok_or("has no name")?);
        match fs::symlink_metadata(&at) {
            Ok(m) if m.is_dir() => {
                fs::remove_dir_all(&at).map_err(|_| "cannot replace a directory")?
            }
            Ok(_) => fs::remove_file(&at).map_err(|_| "cannot replace a file")?,
            Err(_) => {}
        }
        Ok(at)
    }

    fn write<R: Read>(&mut self, entry: &mut tar::Entry<'_, R>, rel: &Path) -> Result<(), Placed> {
        let header = entry.header();
        let kind = header.entry_type();
        let mode = header.mode().map_err(read)? & 0o7777;
        let (uid, gid) = (header.uid().map_err(read)?, header.gid().map_err(read)?);
        let mtime = header.mtime().map_err(read)?;
        let uid = u32::try_from(uid).map_err(|_| Placed::Bad("has an owner beyond 32 bits"))?;
        let gid = u32::try_from(gid).map_err(|_| Placed::Bad("has a group beyond 32 bits"))?;
        let at = match kind {
            tar::EntryType::Directory => {
                let at = self.dir(rel)?;
                self.dirs.push((at.clone(), mtime));
                at
            }
            tar::EntryType::Regular | tar::EntryType::Continuous => {
                let at = self.place(rel)?;
                let mut file = File::create_new(&at).map_err(write_err(&at))?;
                io::copy(entry, &mut file).map_err(write_err(&at))?;
                at
            }
            tar::EntryType::Symlink => {
                let target = entry
                    .link_name()
                    .map_err(read)?
                    .ok_or(Placed::Bad("is a link to nothing"))?;
                let at = self.place(rel)?;
                std::os::unix::fs::symlink(&target, &at).map_err(write_err(&at))?;
                at
            }
            tar::EntryType::Link => {
                let target = entry
                    .link_name()
                    .map_err(read)?
                    .ok_or(Placed::Bad("is a link to nothing"))?;
                let target = relative_path(&target)
                    .map_err(|_| Placed::Bad("is a hard link out of the layer"))?;
                let source = self.dir(target.parent().unwrap_or(Path::new("")))?;
                let source = source.join(
                    target
                        .file_name()
                        .ok_or(Placed::Bad("is a hard link to the root"))?,
                );
                match fs::symlink_metadata(&source) {
                    Ok(m) if !m.is_dir() => {}
                    _ => return Err(Placed::Bad("is a hard link to a file this layer does not have (links into lower layers are not supported)")),
                }
                let at = self.place(rel)?;
                fs::hard_link(&source, &at).map_err(write_err(&at))?;
                // A hard link shares its target's inode: nothing more to set.
                return Ok(());
            }
            tar::EntryType::Char | tar::EntryType::Block | tar::EntryType::Fifo => {
                let at = self.place(rel)?;
                let file_type = match kind {
                    tar::EntryType::Char => FileType::CharacterDevice,
                    tar::EntryType::Block => FileType::BlockDevice,
                    _ => FileType::Fifo,
                };
                // A FIFO has no device numbers (tools leave the fields blank).
                let dev = if kind == tar::EntryType::Fifo {
                    rustix::fs::makedev(0, 0)
                } else {
                    let major = header.device_major().map_err(read)?.unwrap_or(0);
                    let minor = header.device_minor().map_err(read)?.unwrap_or(0);
                    rustix::fs::makedev(major, minor)
                };
                rustix::fs::mknodat(CWD, &at, file_type, Mode::empty(), dev)
                    .map_err(|e| write_err(&at)(e.into()))?;
                at
            }
            _ => {
                return Err(Placed::Bad(
                    "is of a kind forkbox does not unpack (sparse or vendor-specific)",
                ))
            }
        };
        rustix::fs::chownat(
            CWD,
            &at,
            Some(Uid::from_raw(uid)),
            Some(Gid::from_raw(gid)),
            AtFlags::SYMLINK_NOFOLLOW,
        )
        .map_err(|e| write_err(&at)(e.into()))?;
        if kind != tar::EntryType::Symlink {
            // After the owner: chown clears the setuid and setgid bits.
            rustix::fs::chmod(&at, Mode::from_raw_mode(mode))
                .map_err(|e| write_err(&at)(e.into()))?;
        }
        // After the owner too: chown drops `security.capability`.
        self.xattrs(entry, &at)?;
        if kind != tar::EntryType::Directory {
            set_mtime(&at, mtime)?;
        }
        Ok(())
    }

    /// The entry's extended attributes (PAX `SCHILY.xattr.*` records), but
    /// none of overlayfs's own.
    fn xattrs<R: Read>(&self, entry: &mut tar::Entry<'_, R>, at: &Path) -> Result<(), Placed> {
        let Some(pax) = entry.pax_extensions().map_err(read)? else {
            return Ok(());
        };
        for ext in pax {
            let ext = ext.map_err(read)?;
            let Some(name) = ext.key().ok().and_then(|k| k.strip_prefix("SCHILY.xattr.")) else {
                continue;
            };
            if name.starts_with(OVERLAY_XATTRS) {
                tracing::warn!(path = %at.display(), name, "an overlayfs attribute in a layer, dropped");
                continue;
            }
            rustix::fs::lsetxattr(at, name, ext.value_bytes(), XattrFlags::empty())
                .map_err(|e| write_err(at)(e.into()))?;
        }
        Ok(())
    }

    /// Directories' times, deepest first, now that nothing more is written.
    fn finish(&mut self) -> Result<(), LayerError> {
        for (dir, mtime) in self.dirs.drain(..).rev() {
            set_mtime(&dir, mtime).map_err(|e| e.at(&dir))?;
        }
        Ok(())
    }
}

/// A failure to write one entry: the layer's fault or the host's.
enum Placed {
    Bad(&'static str),
    Io(LayerError),
}

impl Placed {
    /// The failure as the layer's error at `path`.
    fn at(self, path: &Path) -> LayerError {
        match self {
            Placed::Io(e) => e,
            Placed::Bad(why) => LayerError::BadEntry {
                path: path.display().to_string(),
                why,
            },
        }
    }
}

impl From<&'static str> for Placed {
    fn from(why: &'static str) -> Self {
        Placed::Bad(why)
    }
}

impl From<LayerError> for Placed {
    fn from(e: LayerError) -> Self {
        Placed::Io(e)
    }
}

fn read(e: io::Error) -> Placed {
    Placed::Io(LayerError::Read(e))
}

fn write_err(path: &Path) -> impl FnOnce(io::Error) -> LayerError + '_ {
    move |source| LayerError::Write {
        path: path.to_owned(),
        source,
    }
}

fn set_mtime(at: &Path, mtime: u64) -> Result<(), Placed> {
    let t = Timespec {
        tv_sec: i64::try_from(mtime).unwrap_or(i64::MAX),
        tv_nsec: 0,
    };
    let times = Timestamps {
        last_access: t,
        last_modification: t,
    };
    rustix::fs::utimensat(CWD, at, &times, AtFlags::SYMLINK_NOFOLLOW)
        .map_err(|e| Placed::Io(write_err(at)(e.into())))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn classify_paths_whiteouts_and_opaque_directories() {
        let p = |s: &str| classify(Path::new(s));
        assert_eq!(p("./"), Ok(Target::Root));
        assert_eq!(p("etc/passwd"), Ok(Target::Path("etc/passwd".into())));
        assert_eq!(p("./etc/./passwd"), Ok(Target::Path("etc/passwd".into())));
        assert_eq!(
            p("etc/.wh.passwd"),
            Ok(Target::Whiteout("etc/passwd".into()))
        );
        assert_eq!(p(".wh.tmp"), Ok(Target::Whiteout("tmp".into())));
        assert_eq!(
            p("var/cache/.wh..wh..opq"),
            Ok(Target::Opaque("var/cache".into()))
        );
        assert_eq!(p(".wh..wh..opq"), Ok(Target::Opaque("".into())));
        assert!(p("etc/.wh.").is_err());
        assert!(p("etc/.wh..wh.plnk").is_err());
    }

    #[test]
    fn classify_escaping_paths_refused() {
        for bad in ["../etc/passwd", "a/../../b", "/etc/passwd", "a/../.wh.b"] {
            assert!(classify(Path::new(bad)).is_err(), "{bad}");
        }
    }

    #[test]
    fn compression_sniffed_from_magic() {
        assert_eq!(Compression::sniff(&[0x1f, 0x8b, 8, 0]), Compression::Gzip);
        assert_eq!(
            Compression::sniff(&[0x28, 0xb5, 0x2f, 0xfd]),
            Compression::Zstd
        );
        assert_eq!(Compression::sniff(b"etc/"), Compression::None);
        assert_eq!(Compression::sniff(&[]), Compression::None);
    }
}
