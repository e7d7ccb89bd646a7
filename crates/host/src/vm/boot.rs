//! Starting a VM: a boot from the kernel and an image (booted again when
//! the emulated host resets or stalls a guest before its agent is up), a
//! restore from a snapshot, and adopting a VM another process started.

use std::ops::ControlFlow;
use std::path::Path;
use std::process::Stdio;
use std::time::{Duration, Instant};

use forkbox_proto::client::{AgentClient, ClientError};
use forkbox_proto::AGENT_PORT;
use rustix::process::Signal;

use crate::control::Control;
use crate::poll::{self, TimedOut};
use crate::testbed;

use super::*;

impl Vm {
    /// Boots `spec.image` with `spec`'s shape (and network, if it has one:
    /// a virtio-net device behind the VMM's userspace gateway, egress
    /// decided by its policy, checked again by a broker in this process
    /// which opens the allowed connections; the guest at 10.0.2.15/24 with
    /// 10.0.2.2 as gateway and DNS server) and waits for the agent.
    ///
    /// A guest that resets before its agent is ready is booted again, up
    /// to twice; one that stays silent past the boot timeout, once (a fresh
    /// VMM each time; the old one is killed), with a warning and the serial
    /// tail: in the emulated host an early reset (a triple fault) or hang
    /// happens now and then under load (see docs/SPEC.md). Any other
    /// failure, or one more of the same, is returned.
    pub fn boot(assets: &Assets, spec: &VmSpec) -> Result<Self, VmError> {
        spec.shape().validate()?;
        let image = spec.image.prepare()?;
        // A reset costs a boot of seconds; a hang costs the boot timeout.
        let (mut resets, mut hangs) = (0, 0);
        loop {
            match Self::boot_once(assets, &image, spec) {
                Err(
                    e @ VmError::DiedDuringBoot {
                        code: Some(vmm_exit::RESET),
                        ..
                    },
                ) if resets < 2 => {
                    resets += 1;
                    // The error's text carries the serial tail.
                    tracing::warn!(cause = %e, "booting once more");
                }
                Err(e @ VmError::NeverReady { .. }) if hangs < 1 => {
                    hangs += 1;
                    tracing::warn!(cause = %e, "booting once more");
                }
                other => return other,
            }
        }
    }

    /// One boot of `image` (the VMM's root disk arguments and the guest's
    /// root options), no second chance.
    fn boot_once(
        assets: &Assets,
        (image_args, root_cmdline): &(Vec<String>, String),
        spec: &VmSpec,
    ) -> Result<Self, VmError> {
        become_subreaper()?;
        // Before the VMM maps its RAM: the kernel aligns memfd mappings to
        // 2 MiB only while huge pages are allowed for them.
        crate::hugepages::allow_for_zygotes();
        let user = VmmUser::new()?;
        let dir = vm_dir("forkbox-vm-", user)?;
        let cgroup = vm_cgroup(
            dir.path(),
            Limits::for_vm(spec.vcpus, spec.memory_mib),
            spec.require_jail,
        )?;
        let paths = paths_in(dir.path());
        let (vsock, serial) = (paths.vsock_uds.clone(), paths.serial_log.clone());
        let mut cmd = vmm_command(&assets.vmm, &spec.vmm_env, user);
        if let Some(dir) = cgroup.dir() {
            // The VMM joins it first thing, before it opens anything.
            cmd.arg("--cgroup").arg(dir);
        }
        let mut cmdline =
            GUEST_CMDLINE.to_owned() + root_cmdline + MODULES_CMDLINE + &disks_cmdline(&spec.disks);
        for (i, disk) in spec.disks.iter().enumerate() {
            let top = new_top(dir.path(), i)?;
            cmd.arg("--writable-disk")
                .arg(&disk.base)
                .arg("--writable-top")
                .arg(&top);
        }
        let net = match &spec.network {
            Some(network) => {
                let (net, args) = VmNet::start_for_vmm(dir.path(), network)?;
                cmd.args(args);
                cmdline.push_str(NET_CMDLINE);
                Some(net)
            }
            None => None,
        };
        cmd.arg("--kernel")
            .arg(&assets.kernel.vmlinuz)
            .arg("--initramfs")
            .arg(&assets.initramfs)
            .args(["--cmdline", &cmdline])
            .args(["--vcpus", &spec.vcpus.to_string()])
            .args(["--memory-mib", &spec.memory_mib.to_string()])
            .args(image_args)
            // The module tree: vdb, after the root (`MODULES_CMDLINE`).
            .arg("--disk")
            .arg(&assets.modules)
            .arg("--vsock-uds")
            .arg(&vsock)
            .arg("--serial-log")
            .arg(&serial)
            .arg("--control")
            .arg(&paths.control)
            .arg("--orphan-grace-secs")
            .arg(spec.orphan_grace.as_secs().max(1).to_string())
            .stdin(Stdio::null())
            .stdout(Stdio::null());
        if spec.serial_to_stderr {
            cmd.arg("--serial-stdout");
        }
        if spec.require_jail {
            cmd.arg("--require-jail");
        }
        cmd.args(jail_args(dir.path()).map_err(VmError::Io)?);
        let start = Instant::now();
        let mut child = cmd.spawn().map_err(VmError::Spawn)?;
        if let Err(e) = limit_vmm(child.id()) {
            let _ = child.kill();
            let _ = child.wait();
            return Err(e);
        }
        let agent = AgentClient::hybrid_vsock(&vsock, AGENT_PORT);
        let control = Control::new(paths.control.clone());
        let mut owner = None;
        let ready = poll::until(start + spec.boot_timeout, Duration::from_millis(5), || {
            // Owned as soon as it listens: its orphan grace runs from its
            // start, and a boot in the emulated host can take a while.
            if owner.is_none() && paths.control.exists() {
                owner = control.own().ok();
            }
            if let Ok(Some(status)) = child.try_wait() {
                return ControlFlow::Break(Err(VmError::DiedDuringBoot {
                    how: describe_exit(status),
                    serial_tail: testbed::tail(&serial, 30),
                    code: status.code(),
                }));
            }
            if !vsock.exists() {
                return ControlFlow::Continue(());
            }
            match agent.wait_ready(Duration::from_millis(500)) {
                Ok(_) if owner.is_none() => ControlFlow::Continue(()),
                Ok(_) => ControlFlow::Break(Ok(())),
                Err(e @ ClientError::VersionMismatch { .. }) => {
                    ControlFlow::Break(Err(VmError::Handshake(e)))
                }
                Err(_) => ControlFlow::Continue(()),
            }
        })
        .unwrap_or_else(|TimedOut(())| {
            Err(VmError::NeverReady {
                secs: spec.boot_timeout.as_secs(),
                vcpus: where_vcpus_are(&Control::new(paths.control.clone())),
                serial_tail: testbed::tail(&serial, 30),
            })
        });
        if let Err(e) = ready {
            // Reaps a VMM that died; stops one that never answered.
            let _ = child.kill();
            let _ = child.wait();
            return Err(e);
        }
        Ok(Self {
            vmm: Some(Vmm::Spawned(child)),
            dir,
            agent: agent.with_handshake_timeout(AGENT_HANDSHAKE),
            control,
            state: RunState::Running,
            boot_time: start.elapsed(),
            after_fork: None,
            vmm_answered: None,
            replaced: None,
            net,
            owner,
            user,
            cgroup: cgroup.take(),
            disks: u8::try_from(spec.disks.len()).unwrap_or(u8::MAX),
        })
    }

    /// Takes back a VM that another process (a daemon that died) started:
    /// its VMM must answer on the control socket in `h.dir` with the
    /// recorded pid. The VM keeps its run state. A VM with a network is
    /// served a broker again, with `network`'s policy (the broker of the
    /// process that died is gone with it): its VMM is handed two links to
    /// it, which it takes on the guest's next connection or lookup.
    /// `network.egress_log` must be where the VMM was started to write it
    /// (`None`: its directory's).
    pub fn adopt(h: &VmHandle, network: Option<&NetworkSpec>) -> Result<Vm, VmError> {
        let not = |why: String| VmError::NotAdoptable {
            dir: h.dir.clone(),
            why,
        };
        if !h.dir_is_ours() {
            return Err(not(
                "it is not a VM directory this user made in the temporary directory".into(),
            ));
        }
        let paths = paths_in(&h.dir);
        let control = Control::new(paths.control);
        let status = control.status()?;
        if status.pid != h.pid {
            return Err(not(format!("it has pid {}, not {}", status.pid, h.pid)));
        }
        let state = status.state;
        let pidfd = pidfd_of(h.pid)?;
        let owner = control.own()?;
        let user = VmmUser::of_dir(&h.dir);
        // Its cgroup, if it was given one; its limits are what its fork
        // children get.
        let cgroup = crate::cgroup::hierarchy().ok().and_then(|hier| {
            let cgroup = hier
                .existing(cgroup_name(&h.dir), shape_limits(&status))
                .ok()?;
            cgroup.dir().is_dir().then_some(cgroup)
        });
        let net = match network {
            Some(n) => {
                // The dead broker's socket file.
                let _ = std::fs::remove_file(VmNet::broker_path(&h.dir));
                let net = VmNet::start(&h.dir, n.policy.clone(), n.egress_log.clone())?;
                let links = forkbox_net::broker::link::BrokerLinks::connect(net.broker.path())
                    .map_err(VmError::Io)?;
                control.broker(&links)?;
                Some(net)
            }
            None => None,
        };
        Ok(Vm {
            vmm: Some(Vmm::Forked { pid: h.pid, pidfd }),
            dir: VmDir(h.dir.clone()),
            agent: agent_client(&paths.vsock_uds),
            control,
            state,
            boot_time: Duration::ZERO,
            after_fork: None,
            vmm_answered: None,
            replaced: None,
            net,
            owner: Some(owner),
            user,
            cgroup,
            disks: status.writable_disks,
        })
    }

    /// Lets the VM run on without this process, as when the process dies:
    /// its VMM and directory stay, its broker stops (the guest's new
    /// connections fail until a process adopts it with a network). What
    /// [`adopt`](Self::adopt) needs is returned.
    pub fn detach(mut self) -> VmHandle {
        let handle = self.handle();
        self.net = None;
        self.cgroup = None;
        // Neither killed nor waited for: dropping a `Child` does neither.
        self.vmm = None;
        self.dir.keep();
        handle
    }

    /// Clears away a VM that cannot be adopted: kills its VMM if `h.pid`
    /// is still a `forkbox-vmm` process, and removes its directory.
    pub fn discard(h: &VmHandle) {
        let exe = std::fs::read_link(format!("/proc/{}/exe", h.pid)).ok();
        let is_vmm = exe
            .as_deref()
            .and_then(Path::file_name)
            .is_some_and(|n| n == "forkbox-vmm");
        if is_vmm {
            if let Ok(fd) = pidfd_of(h.pid) {
                let _ = rustix::process::pidfd_send_signal(&fd, Signal::KILL);
                pidfd_exited(&fd, Duration::from_secs(5));
            }
        }
        if let Ok(hier) = crate::cgroup::hierarchy() {
            let _ = hier.remove(cgroup_name(&h.dir));
        }
        // Removed only if it is one we made: compared after
        // canonicalizing, never as text (`/tmp/../home` starts with `/tmp`).
        if h.dir_is_ours() {
            let _ = std::fs::remove_dir_all(&h.dir);
        }
    }

    /// Starts a VMM from the snapshot in `dir`, resumes it if it comes up
    /// paused, and runs the after-fork hook (clock, RNG) before returning.
    /// A snapshot of a VM with a network needs `network` (its policy and
    /// egress log, served by a broker of its own, as at boot); the VMM
    /// refuses to start without it.
    ///
    /// With `expect`, the snapshot's state must name exactly that image's
    /// files and that shape: the VMM that wrote it may have been a guest's,
    /// and the restoring VMM opens the files its state names (a path to a
    /// host file would become the guest's disk).
    pub fn restore(
        assets: &Assets,
        snapshot: &Path,
        network: Option<&NetworkSpec>,
        expect: Option<&Expected>,
    ) -> Result<Vm, VmError> {
        if let Some(expect) = expect {
            expect.check(snapshot, &assets.modules)?;
        }
        become_subreaper()?;
        let start = Instant::now();
        let user = VmmUser::new()?;
        let dir = vm_dir("forkbox-restore-", user)?;
        let paths = paths_in(dir.path());
        let mut cmd = vmm_command(&assets.vmm, &[], user);
        let net = match network {
            Some(n) => {
                let (net, args) = VmNet::start_for_vmm(dir.path(), n)?;
                cmd.args(args);
                Some(net)
            }
            None => None,
        };
        let disks = read_hardware(snapshot)?.writable.len();
        for i in 0..disks {
            cmd.arg("--writable-top").arg(new_top(dir.path(), i)?);
        }
        let mut child = cmd
            .arg("--restore")
            .arg(snapshot)
            .arg("--control")
            .arg(&paths.control)
            .arg("--vsock-uds")
            .arg(&paths.vsock_uds)
            .arg("--serial-log")
            .arg(&paths.serial_log)
            .arg("--orphan-grace-secs")
            .arg(ORPHAN_GRACE.as_secs().to_string())
            .args(jail_args(dir.path()).map_err(VmError::Io)?)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .spawn()
            .map_err(VmError::Spawn)?;
        if let Err(e) = limit_vmm(child.id()) {
            let _ = child.kill();
            let _ = child.wait();
            return Err(e);
        }
        let mut vm = Vm {
            vmm: Some(Vmm::Spawned(child)),
            agent: agent_client(&paths.vsock_uds),
            control: Control::new(paths.control),
            dir,
            state: RunState::Running,
            boot_time: Duration::ZERO,
            after_fork: None,
            vmm_answered: None,
            replaced: None,
            net,
            owner: None,
            user,
            cgroup: None,
            disks: u8::try_from(disks).unwrap_or(u8::MAX),
        };
        let status = poll::until(
            start + AFTER_FORK_TIMEOUT,
            Duration::from_millis(5),
            || match vm.control.status() {
                Err(e) if !vm.has_exited() => ControlFlow::Continue(e),
                done => ControlFlow::Break(done),
            },
        )
        .unwrap_or_else(|TimedOut(e)| Err(e))
        .map_err(|e| VmError::DiedDuringBoot {
            how: format!("no control socket: {e}"),
            serial_tail: vm.serial_tail(30),
            code: None,
        })?;
        let cgroup = vm_cgroup(vm.dir.path(), shape_limits(&status), false)?;
        if let Some(cgroup) = &cgroup.0 {
            cgroup
                .add(vm.pid())
                .map_err(|e| VmError::Cgroup(e.to_string()))?;
        }
        vm.cgroup = cgroup.take();
        vm.owner = Some(vm.control.own()?);
        if status.state != RunState::Running {
            vm.resume()?;
        }
        vm.after_fork_hook(AFTER_FORK_TIMEOUT, None)?;
        vm.boot_time = start.elapsed();
        Ok(vm)
    }
}

/// Writable disk `i`'s top for a VMM started in `dir`: an empty file the
/// VMM opens and unlinks before it enters its root.
fn new_top(dir: &Path, i: usize) -> Result<PathBuf, VmError> {
    let top = dir.join(format!("top-{i}"));
    std::fs::File::create(&top).map_err(|e| VmError::Io(io_context(e, &top)))?;
    Ok(top)
}

/// The VMM's jail arguments: `--root`, an empty directory made in its VM
/// directory `dir` for it to build its own root in. Nothing in that root
/// is writable, and no VM's directory (its own, its fork children's) is
/// in it: what it writes it opens before it enters, and its fork
/// children's endpoints are sent with the fork request.
fn jail_args(dir: &Path) -> std::io::Result<[std::ffi::OsString; 2]> {
    let root = dir.join("root");
    std::fs::create_dir(&root)?;
    Ok(["--root".into(), root.into_os_string()])
}

/// What a snapshot must be of to be restored ([`Vm::restore`]).
#[derive(Debug, Clone)]
pub struct Expected {
    pub image: RootImage,
    pub vcpus: u8,
    pub memory_mib: u32,
    /// Its writable disks' golden volumes, in order.
    pub volumes: Vec<PathBuf>,
}

/// What a snapshot's `state.json` says its VM is made of (the parts the
/// host checks).
#[derive(serde::Deserialize)]
struct Hardware {
    vcpus: u8,
    memory_mib: u64,
    #[serde(default)]
    layers: Vec<PathBuf>,
    disks: Vec<PathBuf>,
    #[serde(default)]
    writable: Vec<Writable>,
}

#[derive(serde::Deserialize)]
struct Writable {
    base: PathBuf,
}

/// Reads the hardware of the snapshot in `snapshot` (its `state.json`, at
/// most 64 MiB).
fn read_hardware(snapshot: &Path) -> Result<Hardware, VmError> {
    #[derive(serde::Deserialize)]
    struct State {
        hardware: Hardware,
    }
    let path = snapshot.join("state.json");
    let mut text = Vec::new();
    std::fs::File::open(&path)
        .and_then(|f| std::io::Read::read_to_end(&mut std::io::Read::take(f, 64 << 20), &mut text))
        .map_err(|e| VmError::Io(io_context(e, &path)))?;
    let state: State = serde_json::from_slice(&text).map_err(|e| VmError::SnapshotMismatch {
        dir: snapshot.to_owned(),
        why: format!("state.json: {e}"),
    })?;
    Ok(state.hardware)
}

impl Expected {
    /// The files its VMM is given: the image's layers, then its disks and
    /// the kernel's `modules` disk, as a snapshot's state records them.
    fn files(&self, modules: &Path) -> Result<(Vec<PathBuf>, Vec<PathBuf>), VmError> {
        let (layers, mut disks) = self.image.files()?;
        disks.push(modules.to_owned());
        Ok((layers, disks))
    }

    /// Reads the snapshot's hardware and compares it with this.
    fn check(&self, snapshot: &Path, modules: &Path) -> Result<(), VmError> {
        let bad = |why: String| VmError::SnapshotMismatch {
            dir: snapshot.to_owned(),
            why,
        };
        let hw = read_hardware(snapshot)?;
        let (layers, disks) = self.files(modules)?;
        if (hw.layers, hw.disks) != (layers, disks) {
            return Err(bad("it names other disk files than the image's".into()));
        }
        let volumes: Vec<PathBuf> = hw.writable.into_iter().map(|w| w.base).collect();
        if volumes != self.volumes {
            return Err(bad(
                "it names other golden volumes than its writable disks'".into(),
            ));
        }
        if (hw.vcpus, hw.memory_mib) != (self.vcpus, u64::from(self.memory_mib)) {
            return Err(bad(format!(
                "{} vCPUs and {} MiB, not {} and {}",
                hw.vcpus, hw.memory_mib, self.vcpus, self.memory_mib
            )));
        }
        Ok(())
    }
}

impl Expected {
    /// The state of a snapshot made on another host (a pulled template)
    /// made to name this host's files of the same image, so that
    /// [`Vm::restore`] finds them and [`Expected::check`] accepts them.
    /// Only the file names change: their count must be the image's, and
    /// the caller has checked that they are the same files (the same
    /// layers by digest, the same built-in disk by digest).
    pub fn rebase(&self, state: &[u8], modules: &Path) -> Result<Vec<u8>, VmError> {
        let bad = |why: String| VmError::SnapshotMismatch {
            dir: PathBuf::from("(pulled)"),
            why,
        };
        let mut state: serde_json::Value =
            serde_json::from_slice(state).map_err(|e| bad(format!("state.json: {e}")))?;
        let (layers, disks) = self.files(modules)?;
        let hardware = state
            .get_mut("hardware")
            .and_then(serde_json::Value::as_object_mut)
            .ok_or_else(|| bad("its state has no hardware".into()))?;
        for (key, ours) in [("layers", layers), ("disks", disks)] {
            let theirs = hardware.get(key).and_then(serde_json::Value::as_array);
            let count = theirs.map_or(0, Vec::len);
            if count != ours.len() {
                return Err(bad(format!(
                    "it has {count} {key}, and the image here {}",
                    ours.len()
                )));
            }
            hardware.insert(key.into(), serde_json::json!(ours));
        }
        let writable = hardware
            .get_mut("writable")
            .and_then(serde_json::Value::as_array_mut);
        let count = writable.as_ref().map_or(0, |w| w.len());
        if count != self.volumes.len() {
            return Err(bad(format!(
                "it has {count} writable disks, and the template here {}",
                self.volumes.len()
            )));
        }
        for (disk, ours) in writable.into_iter().flatten().zip(&self.volumes) {
            let disk = disk
                .as_object_mut()
                .ok_or_else(|| bad("a writable disk that is not an object".into()))?;
            disk.insert("base".into(), serde_json::json!(ours));
        }
        Ok(serde_json::to_vec(&state).expect("JSON serializes"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// This host's modules disk, in the tests' states.
    const MODULES: &str = "/cache/modules.erofs";

    /// A pulled snapshot names the pusher's files: rebased, it names
    /// ours and passes the check; another count of layers is refused.
    #[test]
    fn a_pulled_snapshot_is_rebased_onto_this_hosts_files() {
        let dir = tempfile::tempdir().expect("tempdir");
        let ours = vec![
            PathBuf::from("/here/a.erofs"),
            PathBuf::from("/here/b.erofs"),
        ];
        let expect = Expected {
            image: RootImage::Layers(ours.clone()),
            vcpus: 1,
            memory_mib: 256,
            volumes: Vec::new(),
        };
        let theirs = serde_json::json!({"format_version": 1, "vcpus": [{"x": 1}], "hardware": {
            "vcpus": 1, "memory_mib": 256, "layers": ["/there/a.erofs", "/there/b.erofs"],
            "disks": ["/there/modules.erofs"], "vsock": true, "net": true}});
        let rebased = expect
            .rebase(theirs.to_string().as_bytes(), Path::new(MODULES))
            .expect("rebase");
        std::fs::write(dir.path().join("state.json"), &rebased).expect("write");
        expect
            .check(dir.path(), Path::new(MODULES))
            .expect("names our files now");
        let v: serde_json::Value = serde_json::from_slice(&rebased).expect("json");
        assert_eq!(v["vcpus"], theirs["vcpus"], "the rest unchanged");
        let one = Expected {
            image: RootImage::Layers(ours[..1].to_vec()),
            ..expect
        };
        let e = one
            .rebase(theirs.to_string().as_bytes(), Path::new(MODULES))
            .expect_err("2 layers, not 1");
        assert!(matches!(e, VmError::SnapshotMismatch { .. }), "{e:?}");
    }

    /// A snapshot's state names the files its restoring VMM opens: one
    /// written by a guest's VMM naming a host file is refused.
    #[test]
    fn a_snapshot_naming_other_files_or_another_shape_is_refused() {
        let dir = tempfile::tempdir().expect("tempdir");
        let layers = vec![PathBuf::from("/store/layers/a.erofs")];
        let expect = Expected {
            image: RootImage::Layers(layers.clone()),
            vcpus: 2,
            memory_mib: 512,
            volumes: Vec::new(),
        };
        let write = |layers: &[PathBuf], disks: &[&str], vcpus: u8| {
            let state = serde_json::json!({"format_version": 1, "hardware": {
                "vcpus": vcpus, "memory_mib": 512, "layers": layers, "disks": disks,
                "vsock": true, "net": true}});
            std::fs::write(dir.path().join("state.json"), state.to_string()).expect("write");
        };
        write(&layers, &[MODULES], 2);
        expect
            .check(dir.path(), Path::new(MODULES))
            .expect("its own");
        for (layers, disks, vcpus) in [
            (&layers[..], &["/etc/shadow"][..], 2),
            (&[PathBuf::from("/dev/sda")][..], &[][..], 2),
            (&layers[..], &[MODULES][..], 8),
            (&layers[..], &[][..], 2),
        ] {
            write(layers, disks, vcpus);
            let e = expect
                .check(dir.path(), Path::new(MODULES))
                .expect_err("not its own");
            assert!(matches!(e, VmError::SnapshotMismatch { .. }), "{e:?}");
        }
        // A writable disk over a golden volume the template does not have.
        let state = serde_json::json!({"format_version": 1, "hardware": {
            "vcpus": 2, "memory_mib": 512, "layers": layers, "disks": [MODULES],
            "writable": [{"base": "/etc/shadow"}], "vsock": true, "net": true}});
        std::fs::write(dir.path().join("state.json"), state.to_string()).expect("write");
        let e = expect
            .check(dir.path(), Path::new(MODULES))
            .expect_err("not its volume");
        assert!(matches!(e, VmError::SnapshotMismatch { .. }), "{e:?}");
        let with_volume = Expected {
            volumes: vec!["/etc/shadow".into()],
            ..expect.clone()
        };
        with_volume
            .check(dir.path(), Path::new(MODULES))
            .expect("the volume it names");
        std::fs::write(dir.path().join("state.json"), "not json").expect("write");
        assert!(matches!(
            expect.check(dir.path(), Path::new(MODULES)),
            Err(VmError::SnapshotMismatch { .. })
        ));
    }
}
