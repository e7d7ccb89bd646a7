//! Golden volumes: the read-only bases of writable disks
//! ([`crate::vm::DiskSpec`]). An empty one is an ext4 file system made once
//! per size in the cache, sparse (a 10 GiB volume takes about 4 MiB of host
//! disk); every VM whose disk starts empty shares that one file, and only
//! the blocks a VM writes cost it host disk (`forkbox_devices`' overlay).
//!
//! It is made the same way every time by the same e2fsprogs (a fixed
//! UUID, hash seed and time), and named by that version: a snapshot's
//! disk holds only the blocks its VM changed, which must sit on the very
//! bytes they were written over, after a cache is cleared too.
//!
//! Its inode tables are left for the kernel to initialise lazily
//! (`lazy_itable_init`), which the guest is told not to do
//! (`noinit_itable` when the agent mounts it): otherwise every sandbox
//! would write them in full, into blocks of its own.

use std::path::{Path, PathBuf};
use std::process::Command;

use crate::cache;

/// Smallest volume: room for ext4's journal and a little data.
pub const MIN_MIB: u32 = 16;
/// Largest volume: 1 TiB (only written blocks take host disk).
pub const MAX_MIB: u32 = 1 << 20;

#[derive(Debug, thiserror::Error)]
pub enum VolumeError {
    #[error("a volume of {0} MiB: it must be {MIN_MIB} MiB to {MAX_MIB} MiB")]
    Size(u32),
    #[error("the volume cache {path}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("cannot run mke2fs (install e2fsprogs)")]
    Spawn(#[source] std::io::Error),
    #[error("cannot lay out the files of volume {name}: {why}")]
    Fill { name: String, why: String },
    #[error("mke2fs failed making {path}: {stderr}")]
    Mkfs { path: PathBuf, stderr: String },
}

/// The empty ext4 volume of `size_mib` MiB, made in the cache on first use.
pub fn empty_ext4(size_mib: u32) -> Result<PathBuf, VolumeError> {
    empty_ext4_in(&cache::root().join("volumes"), size_mib)
}

/// The version of `mke2fs` (`1.47.0`), asked once.
fn mke2fs_version() -> Result<String, VolumeError> {
    static VERSION: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    if let Some(v) = VERSION.get() {
        return Ok(v.clone());
    }
    let out = Command::new("mke2fs")
        .arg("-V")
        .output()
        .map_err(VolumeError::Spawn)?;
    // "mke2fs 1.47.0 (5-Feb-2023)" on stderr.
    let text = String::from_utf8_lossy(&out.stderr).into_owned();
    let version = text
        .split_whitespace()
        .nth(1)
        .filter(|v| v.chars().all(|c| c.is_ascii_alphanumeric() || c == '.'))
        .unwrap_or("unknown")
        .to_owned();
    Ok(VERSION.get_or_init(|| version).clone())
}

/// [`empty_ext4`] in `dir`.
fn empty_ext4_in(dir: &Path, size_mib: u32) -> Result<PathBuf, VolumeError> {
    let version = mke2fs_version()?;
    let name = format!("empty-ext4-{version}-{size_mib}m");
    make_in(dir, size_mib, &name, None)
}

/// What fills a volume's root before `mke2fs` copies it in: called with an
/// empty directory to fill and another to work in, both on the cache's
/// file system.
pub type Fill<'a> = &'a dyn Fn(&Path, &Path) -> Result<(), String>;

/// An ext4 volume of `size_mib` MiB holding the files `fill` writes (an
/// image's, for a disk that starts with them), made once per `key` and
/// size in the cache. Unlike an empty one it is not the same bytes when
/// made again (`mke2fs -d` copies each file's change time, which is when
/// it was unpacked), so its name ends with a digest of its data: a
/// snapshot taken over one such volume never restores over another.
pub fn ext4_with_files(size_mib: u32, key: &str, fill: Fill<'_>) -> Result<PathBuf, VolumeError> {
    let version = mke2fs_version()?;
    let name = format!("files-{key}-{size_mib}m-ext4-{version}");
    make_in(&cache::root().join("volumes"), size_mib, &name, Some(fill))
}

/// The volume named `name` (with [`data_digest`] after it when `fill`ed)
/// in `dir`, made there unless it is.
fn make_in(
    dir: &Path,
    size_mib: u32,
    name: &str,
    fill: Option<Fill<'_>>,
) -> Result<PathBuf, VolumeError> {
    if !(MIN_MIB..=MAX_MIB).contains(&size_mib) {
        return Err(VolumeError::Size(size_mib));
    }
    let io = |path: &Path| {
        let path = path.to_path_buf();
        move |source| VolumeError::Io { path, source }
    };
    let made = || -> Option<PathBuf> {
        if fill.is_none() {
            let path = dir.join(format!("{name}.img"));
            return path.exists().then_some(path);
        }
        let prefix = format!("{name}-");
        std::fs::read_dir(dir)
            .ok()?
            .flatten()
            .map(|e| e.path())
            .find(|p| {
                p.file_name()
                    .and_then(|n| n.to_str())
                    .is_some_and(|n| n.starts_with(&prefix) && n.ends_with(".img"))
            })
    };
    if let Some(path) = made() {
        return Ok(path);
    }
    std::fs::create_dir_all(dir).map_err(io(dir))?;
    // Another process making the same volume: wait for it.
    let lock_path = dir.join(format!(".{name}.lock"));
    let lock = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&lock_path)
        .map_err(io(&lock_path))?;
    lock.lock().map_err(io(&lock_path))?;
    if let Some(path) = made() {
        return Ok(path);
    }
    let staging = cache::staging_path(&dir.join(format!("{name}.img")));
    // The files, if any, in a directory beside it, gone when done.
    let files = match fill {
        Some(fill) => {
            let work = tempfile::Builder::new()
                .prefix(".fill-")
                .tempdir_in(dir)
                .map_err(io(dir))?;
            let (root, scratch) = (work.path().join("root"), work.path().join("work"));
            for d in [&root, &scratch] {
                std::fs::create_dir(d).map_err(io(d))?;
            }
            fill(&root, &scratch).map_err(|why| VolumeError::Fill {
                name: name.to_owned(),
                why,
            })?;
            Some((work, root))
        }
        None => None,
    };
    let mut mke2fs = Command::new("mke2fs");
    // 4 KiB blocks whatever the size: the disk's logical block size.
    mke2fs
        .args([
            "-q",
            "-t",
            "ext4",
            "-b",
            "4096",
            "-m",
            "0",
            "-L",
            "forkbox-disk",
        ])
        .args([
            "-E",
            "lazy_itable_init=1,lazy_journal_init=1,nodiscard,root_owner=0:0,\
             hash_seed=6f726b62-6f78-4000-8000-686173680000",
        ])
        .args(["-U", "6f726b62-6f78-4000-8000-766f6c756d65"]);
    if let Some((_, root)) = &files {
        mke2fs.arg("-d").arg(root);
    }
    let out = mke2fs
        .arg(&staging)
        .arg(format!("{size_mib}M"))
        .env("E2FSPROGS_FAKE_TIME", "1")
        .output()
        .map_err(VolumeError::Spawn)?;
    drop(files);
    let path = dir.join(format!("{name}.img"));
    if !out.status.success() {
        let _ = std::fs::remove_file(&staging);
        return Err(VolumeError::Mkfs {
            path,
            stderr: String::from_utf8_lossy(&out.stderr).trim().to_owned(),
        });
    }
    let path = match fill {
        Some(_) => {
            let digest = data_digest(&staging).map_err(io(&staging))?;
            dir.join(format!("{name}-{}.img", &digest[..16]))
        }
        None => path,
    };
    // Read-only from now on: it is the base of every disk made from it.
    let readonly: std::fs::Permissions = std::os::unix::fs::PermissionsExt::from_mode(0o444);
    std::fs::set_permissions(&staging, readonly).map_err(io(&staging))?;
    std::fs::rename(&staging, &path).map_err(io(&path))?;
    Ok(path)
}

/// The sha256 (hex) of a sparse file's data: each range `SEEK_DATA` finds,
/// its offset, length and bytes. Holes cost nothing to hash.
fn data_digest(path: &Path) -> std::io::Result<String> {
    use rustix::fs::SeekFrom;
    use sha2::Digest as _;
    use std::io::{Read, Seek};
    let mut file = std::fs::File::open(path)?;
    let len = file.metadata()?.len();
    let mut hash = sha2::Sha256::new();
    let mut pos = 0;
    let mut buf = vec![0u8; 1 << 20];
    while pos < len {
        let data = match rustix::fs::seek(&file, SeekFrom::Data(pos)) {
            Ok(at) => at,
            Err(rustix::io::Errno::NXIO) => break,
            Err(e) => return Err(e.into()),
        };
        let hole = rustix::fs::seek(&file, SeekFrom::Hole(data))?.min(len);
        hash.update(data.to_le_bytes());
        hash.update((hole - data).to_le_bytes());
        file.seek(std::io::SeekFrom::Start(data))?;
        let mut left = hole - data;
        while left > 0 {
            let n = buf.len().min(left as usize);
            file.read_exact(&mut buf[..n])?;
            hash.update(&buf[..n]);
            left -= n as u64;
        }
        pos = hole;
    }
    Ok(hex::encode(hash.finalize()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::MetadataExt;

    #[test]
    fn an_empty_volume_is_made_once_sparse_and_read_only() {
        let cache = tempfile::tempdir().expect("tempdir");
        let path = empty_ext4_in(cache.path(), 64).expect("made");
        let meta = std::fs::metadata(&path).expect("metadata");
        assert_eq!(meta.len(), 64 << 20);
        assert!(
            meta.blocks() * 512 < 32 << 20,
            "{} bytes held",
            meta.blocks() * 512
        );
        assert!(meta.permissions().readonly());
        // Made again elsewhere: the same bytes.
        let other = tempfile::tempdir().expect("tempdir");
        let twin = empty_ext4_in(other.path(), 64).expect("made");
        assert!(
            std::fs::read(&twin).expect("read") == std::fs::read(&path).expect("read"),
            "two empty volumes of one size differ"
        );
        let again = empty_ext4_in(cache.path(), 64).expect("cached");
        assert_eq!(again, path);
        assert_eq!(std::fs::metadata(&again).expect("meta").ino(), meta.ino());
        assert!(matches!(
            empty_ext4_in(cache.path(), 8),
            Err(VolumeError::Size(8))
        ));
    }

    #[test]
    fn a_volume_with_files_is_made_once_holds_them_and_is_named_by_its_data() {
        let cache = tempfile::tempdir().expect("tempdir");
        let calls = std::cell::Cell::new(0);
        let fill = |root: &Path, work: &Path| -> Result<(), String> {
            calls.set(calls.get() + 1);
            assert!(work.is_dir());
            std::fs::create_dir(root.join("repo")).map_err(|e| e.to_string())?;
            std::fs::write(root.join("repo/README"), b"hello from the image\n")
                .map_err(|e| e.to_string())
        };
        let path = make_in(cache.path(), 32, "files-k-32m", Some(&fill)).expect("made");
        let name = path.file_name().and_then(|n| n.to_str()).expect("name");
        assert!(name.starts_with("files-k-32m-") && name.len() == "files-k-32m-".len() + 16 + 4);
        assert!(std::fs::metadata(&path)
            .expect("meta")
            .permissions()
            .readonly());
        let out = Command::new("debugfs")
            .args(["-R", "cat /repo/README"])
            .arg(&path)
            .output()
            .expect("debugfs");
        assert_eq!(
            String::from_utf8_lossy(&out.stdout),
            "hello from the image\n"
        );
        let again = make_in(cache.path(), 32, "files-k-32m", Some(&fill)).expect("cached");
        assert_eq!((again, calls.get()), (path, 1), "made once");
        // Only the volume is left (and its lock): the files' directory went.
        let left: Vec<String> = std::fs::read_dir(cache.path())
            .expect("dir")
            .flatten()
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .filter(|n| !n.ends_with(".lock"))
            .collect();
        assert_eq!(left.len(), 1, "{left:?}");
        let failing = |_: &Path, _: &Path| Err("no such image".to_owned());
        let e = make_in(cache.path(), 32, "files-j-32m", Some(&failing)).expect_err("fails");
        assert!(e.to_string().contains("no such image"), "{e}");
    }
}
