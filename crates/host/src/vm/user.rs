//! The user a VMM runs as. A VMM started by root gives root up once its
//! VM is built (`forkbox-vmm --run-as`), for a user and group of its own:
//! one number, made up per booted VM from a range no account uses, and
//! shared by its fork children (a process without privileges cannot
//! change user). A VMM its guest took over can then open, connect to and
//! signal only what that user may: not root's sockets (the daemon's API,
//! the service manager's), files or processes, and not another VM's
//! directory.
//!
//! The VM's directory stays ours (it is how a restarted daemon knows it
//! made it); the VMM writes there through its group: the directory is
//! group-writable for the VMM's group and for no one else, and so is each
//! socket there that the VMM connects to (its network broker's).

use std::os::unix::fs::PermissionsExt;
use std::path::Path;

use super::VmError;

/// The first number handed out, and how many there are: far above the
/// ranges of system and login accounts and of container id maps.
const FIRST: u32 = 0x6000_0000;
const COUNT: u32 = 1 << 24;

/// A VMM's own user and group (the same number).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct VmmUser(u32);

impl VmmUser {
    /// A new one for a VMM we are about to boot, if we are root (a VMM
    /// started by anyone else runs as its starter, who has nothing to
    /// give up). Two VMs sharing one by chance (1 in 16 million) lose
    /// only the separation between them.
    pub(super) fn new() -> Result<Option<Self>, VmError> {
        if !rustix::process::geteuid().is_root() {
            return Ok(None);
        }
        let mut bytes = [0u8; 4];
        rustix::rand::getrandom(&mut bytes, rustix::rand::GetRandomFlags::empty())
            .map_err(|e| VmError::Entropy(e.into()))?;
        Ok(Some(Self(FIRST + u32::from_le_bytes(bytes) % COUNT)))
    }

    /// The user of the VMM whose directory is `dir` (its group), if it
    /// has one of its own: a VM another process booted, adopted.
    pub(super) fn of_dir(dir: &Path) -> Option<Self> {
        use std::os::unix::fs::MetadataExt;
        let gid = std::fs::symlink_metadata(dir).ok()?.gid();
        (FIRST..FIRST + COUNT).contains(&gid).then_some(Self(gid))
    }

    /// `forkbox-vmm --run-as`'s value.
    pub(super) fn arg(self) -> String {
        format!("{0}:{0}", self.0)
    }

    /// Lets the VMM write in `dir` (ours): its group, `rwx` for it.
    pub(super) fn grant_dir(self, dir: &Path) -> std::io::Result<()> {
        self.grant(dir, 0o770)
    }

    fn grant(self, path: &Path, mode: u32) -> std::io::Result<()> {
        std::os::unix::fs::lchown(path, None, Some(self.0))
            .and_then(|()| std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode)))
            .map_err(|e| {
                std::io::Error::new(
                    e.kind(),
                    format!(
                        "cannot open {} to the VMM's group {}: {e}",
                        path.display(),
                        self.0
                    ),
                )
            })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::MetadataExt;

    #[test]
    fn new_is_in_the_range_for_root_and_none_otherwise() {
        match VmmUser::new().expect("random bytes") {
            Some(VmmUser(n)) => {
                assert!(rustix::process::geteuid().is_root());
                assert!((FIRST..FIRST + COUNT).contains(&n), "{n:#x}");
                assert_eq!(VmmUser(n).arg(), format!("{n}:{n}"));
            }
            None => assert!(!rustix::process::geteuid().is_root()),
        }
    }

    #[test]
    fn granted_dir_is_the_vmms_group_and_found_again_from_it() {
        let Some(user) = VmmUser::new().expect("random bytes") else {
            // Not root: chown to another group is refused, which is why no
            // user is made then.
            assert!(!rustix::process::geteuid().is_root());
            return;
        };
        let dir = tempfile::tempdir().expect("tempdir");
        assert_eq!(
            VmmUser::of_dir(dir.path()),
            None,
            "a directory nobody granted"
        );
        user.grant_dir(dir.path()).expect("grant");
        let meta = std::fs::metadata(dir.path()).expect("stat");
        assert_eq!(meta.uid(), 0, "still ours");
        assert_eq!(meta.gid(), user.0);
        assert_eq!(meta.mode() & 0o777, 0o770);
        assert_eq!(VmmUser::of_dir(dir.path()), Some(user));
    }
}
