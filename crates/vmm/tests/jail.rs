//! forkbox-vmm with `--require-jail` where it cannot leave the host's
//! network namespace: it refuses to run, saying why (no KVM needed: it
//! stops before opening anything).

use std::os::unix::fs::PermissionsExt;
use std::process::Command;

#[test]
fn vmm_require_jail_without_cap_sys_admin_refuses_to_run() {
    let dir = tempfile::tempdir().expect("temporary directory");
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).expect("chmod");
    let exe = dir.path().join("forkbox-vmm");
    std::fs::copy(env!("CARGO_BIN_EXE_forkbox-vmm"), &exe).expect("copy forkbox-vmm");
    // /proc/self belongs to our effective user.
    let root =
        std::os::unix::fs::MetadataExt::uid(&std::fs::metadata("/proc/self").expect("/proc/self"))
            == 0;
    let mut cmd = if root {
        let mut c = Command::new("setpriv");
        c.args(["--reuid", "65534", "--regid", "65534", "--clear-groups"])
            .arg(&exe);
        c
    } else {
        Command::new(&exe)
    };
    let out = cmd
        .args(["--kernel", "/nonexistent", "--initramfs", "/nonexistent"])
        .args(["--cmdline", "console=ttyS0", "--require-jail"])
        .output()
        .expect("run forkbox-vmm (and setpriv, from util-linux)");
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(
        out.status.code(),
        Some(forkbox_vmm_api::exit_code::VMM_ERROR),
        "{err}"
    );
    assert!(
        err.contains("cannot leave the host's network namespace")
            && err.contains("--require-jail refuses to run without it"),
        "{err}"
    );
}
