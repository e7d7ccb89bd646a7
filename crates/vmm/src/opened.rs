//! Files a VMM opens once, as the daemon's user, and its fork children
//! use again: `/dev/kvm` and the disk images. A VMM started by root runs
//! its guest as a user of its own (`lockdown::become_user`), who may not
//! open them (`/dev/kvm` is root's or the `kvm` group's, the images are
//! under root's cache); a fork child, which runs as that user from its
//! first instruction, makes its VM from the descriptors its parent
//! opened and keeps them (`fork::close_inherited` spares [`fds`]).

use std::collections::HashMap;
use std::fs::File;
use std::os::fd::{AsRawFd, FromRawFd, IntoRawFd, OwnedFd, RawFd};
use std::path::{Path, PathBuf};
use std::sync::{Mutex, OnceLock};

use kvm_ioctls::Kvm;

use crate::host::{kvm_open_error, HostError};

static KVM: OnceLock<OwnedFd> = OnceLock::new();
static DISKS: Mutex<Option<HashMap<PathBuf, File>>> = Mutex::new(None);

/// A handle on /dev/kvm: a duplicate of this process tree's descriptor,
/// opened on first use.
pub fn kvm() -> Result<Kvm, HostError> {
    let fd = match KVM.get() {
        Some(fd) => fd,
        None => {
            let file = std::fs::OpenOptions::new()
                .read(true)
                .write(true)
                .open("/dev/kvm")
                .map_err(|e| kvm_open_error(e.raw_os_error().unwrap_or(libc::EIO)))?;
            KVM.get_or_init(|| OwnedFd::from(file))
        }
    };
    let dup = fd.try_clone().map_err(HostError::KvmOpen)?;
    // SAFETY: `dup` is a descriptor of /dev/kvm that nothing else owns.
    Ok(unsafe { Kvm::from_raw_fd(dup.into_raw_fd()) })
}

/// The disk image at `path`, read-only: a duplicate of the descriptor
/// this process tree opened first.
pub fn disk(path: &Path) -> std::io::Result<File> {
    let mut disks = DISKS.lock().unwrap_or_else(|p| p.into_inner());
    let disks = disks.get_or_insert_with(HashMap::new);
    if let Some(file) = disks.get(path) {
        return file.try_clone();
    }
    let file = File::open(path)?;
    let dup = file.try_clone()?;
    disks.insert(path.to_owned(), file);
    Ok(dup)
}

/// The descriptors kept here, for a fork child to keep.
pub fn fds() -> Vec<RawFd> {
    let disks = DISKS.lock().unwrap_or_else(|p| p.into_inner());
    KVM.get()
        .map(|fd| fd.as_raw_fd())
        .into_iter()
        .chain(disks.iter().flat_map(|d| d.values().map(|f| f.as_raw_fd())))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Read;

    #[test]
    fn disk_opened_once_then_duplicated_even_after_its_path_is_gone() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("disk.img");
        std::fs::write(&path, b"image bytes").expect("write");
        let first = disk(&path).expect("first open");
        std::fs::remove_file(&path).expect("unlink");
        let mut again = disk(&path).expect("the kept descriptor, not the path");
        let mut text = String::new();
        again.read_to_string(&mut text).expect("read");
        assert_eq!(text, "image bytes");
        assert!(fds().contains(&{
            let d = DISKS.lock().expect("lock");
            d.as_ref().expect("map")[&path].as_raw_fd()
        }));
        drop(first);
    }
}
