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
    if !(MIN_MIB..=MAX_MIB).contains(&size_mib) {
        return Err(VolumeError::Size(size_mib));
    }
    let dir = dir.to_owned();
    let version = mke2fs_version()?;
    let path = dir.join(format!("empty-ext4-{version}-{size_mib}m.img"));
    if path.exists() {
        return Ok(path);
    }
    let io = |path: &PathBuf| {
        let path = path.clone();
        move |source| VolumeError::Io { path, source }
    };
    std::fs::create_dir_all(&dir).map_err(io(&dir))?;
    // Another process making the same volume: wait for it.
    let lock_path = dir.join(format!(".empty-ext4-{version}-{size_mib}m.lock"));
    let lock = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&lock_path)
        .map_err(io(&lock_path))?;
    lock.lock().map_err(io(&lock_path))?;
    if path.exists() {
        return Ok(path);
    }
    let staging = cache::staging_path(&path);
    let out = Command::new("mke2fs")
        // 4 KiB blocks whatever the size: the disk's logical block size.
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
        .args(["-U", "6f726b62-6f78-4000-8000-766f6c756d65"])
        .arg(&staging)
        .arg(format!("{size_mib}M"))
        .env("E2FSPROGS_FAKE_TIME", "1")
        .output()
        .map_err(VolumeError::Spawn)?;
    if !out.status.success() {
        let _ = std::fs::remove_file(&staging);
        return Err(VolumeError::Mkfs {
            path,
            stderr: String::from_utf8_lossy(&out.stderr).trim().to_owned(),
        });
    }
    // Read-only from now on: it is the base of every disk made from it.
    let readonly: std::fs::Permissions = std::os::unix::fs::PermissionsExt::from_mode(0o444);
    std::fs::set_permissions(&staging, readonly).map_err(io(&staging))?;
    std::fs::rename(&staging, &path).map_err(io(&path))?;
    Ok(path)
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
}
