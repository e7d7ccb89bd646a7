//! Running one of our binaries without privileges, for the tests of what
//! it does then (shared by the VMM's and the daemon's jail tests).

use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::process::Command;

/// A command running a copy of `exe` (in a directory every user may
/// enter) as `nobody` when we are root, as ourselves otherwise. Keep the
/// directory until the command has run.
pub fn command(exe: &Path) -> (tempfile::TempDir, Command) {
    let dir = tempfile::tempdir().expect("temporary directory");
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).expect("chmod");
    let copy = dir.path().join(exe.file_name().expect("a binary's name"));
    std::fs::copy(exe, &copy).expect("copy the binary");
    // /proc/self belongs to our effective user.
    let root =
        std::os::unix::fs::MetadataExt::uid(&std::fs::metadata("/proc/self").expect("/proc/self"))
            == 0;
    let cmd = if root {
        let mut c = Command::new("setpriv");
        c.args(["--reuid", "65534", "--regid", "65534", "--clear-groups"])
            .arg(&copy);
        c
    } else {
        Command::new(&copy)
    };
    (dir, cmd)
}
