//! Trials of writable disks: a golden volume under a VM's own writes,
//! forked with its memory at one instant, saved in a snapshot.

use std::path::PathBuf;

use forkbox_host::vm::{DiskSpec, Expected, Vm, VmSpec};

use super::*;

/// The host-disk bytes of the files a VMM holds open whose names are
/// gone (a writable disk's top, a frozen layer): read through
/// `/proc/PID/fd`, which reaches an unlinked file.
fn unnamed_files_bytes(pid: u32) -> Result<Vec<u64>, Failed> {
    use std::os::unix::fs::MetadataExt;
    let dir = PathBuf::from(format!("/proc/{pid}/fd"));
    let mut sizes = Vec::new();
    for entry in std::fs::read_dir(&dir).map_err(|e| format!("{}: {e}", dir.display()))? {
        let path = entry.map_err(|e| e.to_string())?.path();
        let Ok(target) = std::fs::read_link(&path) else {
            continue;
        };
        let name = target.to_string_lossy();
        if name.contains("/.top-") || name.contains("/top-") {
            if let Ok(meta) = std::fs::metadata(&path) {
                sizes.push(meta.blocks() * 512);
            }
        }
    }
    Ok(sizes)
}

const MIB: u64 = 1 << 20;

/// A VM with a writable disk at `/data` over an empty 64 MiB volume:
/// it writes, forks while a write is still in its page cache, and each
/// relative sees the common past and only its own writes; the children's
/// tops hold only their own blocks; a snapshot of the parent restores
/// with its disk; a full disk is the guest's `ENOSPC`.
pub(crate) fn disk_writable_forks_with_memory_and_holds_only_written_blocks() -> TestResult {
    let volume = forkbox_host::volume::empty_ext4(64).map_err(|e| format!("{e:#}"))?;
    let spec = VmSpec {
        disks: vec![DiskSpec {
            base: volume.clone(),
            mount: "/data".into(),
        }],
        ..VmSpec::default()
    };
    let mut vm = boot(spec.clone());
    let agent = vm.agent().clone();
    let mounted = sh(&agent, "grep ' /data ' /proc/mounts")?;
    check(
        mounted.contains("ext4 rw"),
        format!("/data is not a writable ext4 mount: {mounted:?}"),
    )?;
    // 4 MiB synced; then 1 MiB left in the guest's page cache at the fork.
    let sums = sh(
        &agent,
        "head -c 4194304 /dev/urandom > /data/a && sync && \
         head -c 1048576 /dev/urandom > /data/unsynced && md5sum /data/a /data/unsynced",
    )?;
    let children = fork(&mut vm, 2)?;
    for (i, child) in children.iter().enumerate() {
        // From the disk, not the page cache: what was in the cache at the
        // fork went to this child's own disk when it flushed.
        let got = answer_within(
            child,
            "sync && echo 3 > /proc/sys/vm/drop_caches && md5sum /data/a /data/unsynced",
            Duration::from_secs(120),
        )?;
        check(
            got == sums,
            format!("child {i} reads {got:?}, its parent wrote {sums:?}"),
        )?;
        sh(
            child.agent(),
            &format!("head -c 8388608 /dev/zero | tr '\\0' 'c' > /data/child{i} && sync"),
        )?;
    }
    sh(&agent, "rm /data/a && echo parent > /data/p && sync")?;
    let listing = |vm: &Vm| {
        sh(
            vm.agent(),
            "cd /data && ls | grep -v lost+found | tr '\\n' ' '",
        )
    };
    check(
        listing(&vm)? == "p unsynced ",
        format!("the parent sees {:?}", listing(&vm)?),
    )?;
    for (i, child) in children.iter().enumerate() {
        let want = format!("a child{i} unsynced ");
        let seen = listing(child)?;
        check(
            seen == want,
            format!("child {i} sees {seen:?}, not {want:?}"),
        )?;
        // Its own top: its 8 MiB and ext4's metadata, not the 64 MiB
        // disk nor its parent's 5 MiB.
        let tops = unnamed_files_bytes(child.pid())?;
        let own = tops.iter().copied().max().unwrap_or(0);
        check(
            (8 * MIB..24 * MIB).contains(&own),
            format!("child {i}'s largest unnamed file holds {own} bytes (its files: {tops:?})"),
        )?;
    }
    // A snapshot of the parent, restored: its disk comes back with it.
    let snap = tempfile::tempdir().map_err(|e| e.to_string())?;
    vm.snapshot(snap.path())
        .map_err(|e| format!("snapshot: {e:#}"))?;
    let saved = std::fs::metadata(snap.path().join(forkbox_host::vm::snapshot_disk_file(0)))
        .map_err(|e| format!("the snapshot's disk file: {e}"))?;
    {
        use std::os::unix::fs::MetadataExt;
        let held = saved.blocks() * 512;
        check(
            saved.len() == 64 * MIB && (MIB..24 * MIB).contains(&held),
            format!("the disk file is {} bytes holding {held}", saved.len()),
        )?;
    }
    let expect = Expected {
        image: spec.image.clone(),
        vcpus: spec.vcpus,
        memory_mib: spec.memory_mib,
        volumes: vec![volume],
    };
    let restored = Vm::restore(assets(), snap.path(), None, Some(&expect))
        .map_err(|e| format!("restore: {e:#}"))?;
    let back = sh(
        restored.agent(),
        "echo 3 > /proc/sys/vm/drop_caches; cat /data/p; md5sum /data/unsynced",
    )?;
    let unsynced_sum = sums.lines().nth(1).unwrap_or_default();
    check(
        back == format!("parent\n{unsynced_sum}\n"),
        format!("the restored VM reads {back:?}"),
    )?;
    // A full disk is the guest's: its command fails, the VM goes on.
    let full = exec(
        restored.agent(),
        &ExecRequest::shell("dd if=/dev/zero of=/data/fill bs=1M 2>&1; sync"),
    );
    let said = String::from_utf8_lossy(&full.1).into_owned();
    check(
        said.contains("No space left on device"),
        format!("filling the disk said {said:?}"),
    )?;
    sh(restored.agent(), "rm /data/fill && echo room > /data/after")?;
    check(
        sh(restored.agent(), "cat /data/after")? == "room\n",
        "the disk takes writes again once space is freed",
    )?;
    Ok(())
}
