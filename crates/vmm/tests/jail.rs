//! forkbox-vmm with `--require-jail` where it cannot leave the host's
//! network namespace: it refuses to run, saying why (no KVM needed: it
//! stops before opening anything).

mod support {
    pub mod unprivileged;
}

#[test]
fn vmm_require_jail_without_cap_sys_admin_refuses_to_run() {
    let (_dir, mut cmd) =
        support::unprivileged::command(std::path::Path::new(env!("CARGO_BIN_EXE_forkbox-vmm")));
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
