//! A trial of Docker inside a sandbox: its own `dockerd` on a writable
//! disk, in the built-in `docker` image.

use forkbox_host::image::ImageName;
use forkbox_host::vm::{DiskSpec, Vm, VmSpec};

use super::*;

/// Waits (at most `secs`) for `dockerd` to answer `docker info`.
fn wait_for_dockerd(vm: &Vm, secs: u32) -> TestResult {
    // Bounded by the guest's clock, not by a count of tries: each `docker
    // info` takes its own time in the emulated host, and the log must be
    // read before the host's own limit gives up on the command.
    let script = format!(
        "s=$(date +%s); until docker info >/dev/null 2>&1; do \
         if [ $(($(date +%s) - s)) -gt {secs} ]; then {{ echo dockerd did not answer; \
         tail -n 30 /var/log/dockerd.log; tail -n 20 /var/log/containerd.log; ps -eo pid,stat,etime,time,args; cat /proc/loadavg; }} >&2; exit 1; fi; \
         sleep 1; done; echo $(($(date +%s) - s))"
    );
    let took = answer_within(vm, &script, Duration::from_secs(u64::from(secs) + 60))?;
    eprintln!("docker trial: dockerd answered after {} s", took.trim());
    Ok(())
}

/// busybox-static as a one-file image in the inner Docker (`bb:1`),
/// imported from a tarball made in the guest: no registry.
fn import_busybox(vm: &Vm) -> TestResult {
    let busybox = forkbox_host::debs::unpacked("busybox-static")
        .map_err(|e| format!("{e:#}"))?
        .join("bin/busybox");
    let mut file = std::fs::File::open(&busybox).map_err(|e| format!("{e}"))?;
    vm.agent()
        .write_file_with("/tmp/bb/bin/busybox", 0o755, true, &mut file)
        .map_err(|e| format!("copying busybox in: {e:#}"))?;
    sh(
        vm.agent(),
        "cd /tmp/bb && for a in sh echo cat httpd wget sleep mkdir ls date; do ln -s busybox bin/$a; done && \
         tar -C /tmp/bb -c . | docker import - bb:1 >/dev/null && docker images --format '{{.Repository}}:{{.Tag}}'",
    )
    .and_then(|out| {
        check(
            out.lines().any(|l| l == "bb:1"),
            format!("docker images after the import: {out:?}"),
        )
    })
}

/// The built-in `docker` image runs its own `dockerd` on a writable disk:
/// an image imported from a tarball runs, a Dockerfile `FROM` it builds,
/// and a container started before a fork runs on in both children, each
/// its own.
pub(crate) fn docker_in_a_sandbox_runs_builds_and_forks_with_containers() -> TestResult {
    let volume = forkbox_host::volume::empty_ext4(4096).map_err(|e| format!("{e:#}"))?;
    let mut vm = boot(VmSpec {
        image: ImageName::Docker.into(),
        memory_mib: 2048,
        disks: vec![DiskSpec {
            base: volume,
            mount: "/var/lib/docker".into(),
        }],
        ..VmSpec::default()
    });
    sh(vm.agent(), forkbox_host::image::DOCKERD_START)?;
    wait_for_dockerd(&vm, 300)?;
    import_busybox(&vm)?;
    let hi = sh(vm.agent(), "docker run --rm bb:1 echo hi from a container")?;
    check(
        hi == "hi from a container\n",
        format!("docker run said {hi:?}"),
    )?;
    let built = sh(
        vm.agent(),
        "mkdir -p /tmp/ctx && printf 'FROM bb:1\\nRUN echo built > /built\\n' > /tmp/ctx/Dockerfile && \
         DOCKER_BUILDKIT=0 docker build -q -t bb:2 /tmp/ctx >/dev/null && docker run --rm bb:2 cat /built",
    )?;
    check(
        built == "built\n",
        format!("the built image holds {built:?}"),
    )?;
    // A container that counts, forked while it runs.
    sh(
        vm.agent(),
        "mkdir -p /var/lib/docker/count && docker run -d --name counter -v /var/lib/docker/count:/c bb:1 \
         sh -c 'i=0; while true; do i=$((i+1)); echo $i > /c/n; sleep 0.2; done' >/dev/null && sleep 2",
    )?;
    let children = fork(&mut vm, 2)?;
    for (i, child) in children.iter().enumerate() {
        let out = answer_within(
            child,
            &format!(
                "a=$(cat /var/lib/docker/count/n); sleep 2; b=$(cat /var/lib/docker/count/n); echo $a $b; \
                 docker exec counter sh -c 'echo child{i} > /c/mine' && cat /var/lib/docker/count/mine"
            ),
            Duration::from_secs(300),
        )?;
        let mut w = out.split_whitespace();
        let a: u64 = w.next().and_then(|x| x.parse().ok()).unwrap_or(0);
        let b: u64 = w.next().and_then(|x| x.parse().ok()).unwrap_or(0);
        check(
            b > a && a > 0,
            format!("child {i}: the container's counter {a} -> {b}"),
        )?;
        check(
            w.next() == Some(format!("child{i}").as_str()),
            format!("child {i}: docker exec wrote {out:?}"),
        )?;
    }
    let theirs = sh(
        vm.agent(),
        "cat /var/lib/docker/count/mine 2>/dev/null || echo none",
    )?;
    check(
        theirs == "none\n",
        format!("the parent sees a child's write: {theirs:?}"),
    )
}
