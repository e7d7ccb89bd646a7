//! forkboxd where a part of the VMMs' jail cannot be set up: it says so
//! once, loudly, and `--require-jail` refuses to start.

#[path = "../../vmm/tests/support/unprivileged.rs"]
mod unprivileged;

use std::process::Output;

/// forkboxd run without privileges, with `args`, on the KVM backend (the
/// jail is its VMMs'; where microVMs cannot run, `auto` would be gVisor).
fn unprivileged_forkboxd(args: &[&str]) -> Output {
    let (_dir, mut cmd) =
        unprivileged::command(std::path::Path::new(env!("CARGO_BIN_EXE_forkboxd")));
    cmd.args(["--no-state", "--backend", "kvm"])
        .args(args)
        .env_remove("FORKBOX_TOKEN")
        .output()
        .expect("run forkboxd (and setpriv, from util-linux)")
}

#[test]
fn forkboxd_without_cap_sys_admin_says_so_and_require_jail_refuses() {
    // TCP without a token: refused after the jail's check, wherever this
    // runs, so the daemon never starts.
    let tcp = ["--listen", "tcp://127.0.0.1:1"];
    let refused = unprivileged_forkboxd(&[&tcp[..], &["--require-jail"]].concat());
    let err = String::from_utf8_lossy(&refused.stderr);
    assert!(!refused.status.success(), "{err}");
    assert!(
        err.contains("--require-jail refuses to run without it") && err.contains("CAP_SYS_ADMIN"),
        "{err}"
    );
    // Without the flag it goes on, after one loud warning.
    let warned = unprivileged_forkboxd(&tcp);
    let err = String::from_utf8_lossy(&warned.stderr);
    assert!(
        err.matches("JAIL IS INCOMPLETE").count() == 1 && err.contains("needs a bearer token"),
        "{err}"
    );
    // Nobody may make cgroups at the top of the hierarchy.
    assert!(err.contains("no cgroup of their own"), "{err}");
}
