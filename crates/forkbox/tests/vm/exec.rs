//! VM trials of the guest agent: commands (exit codes, signals, stdin,
//! large output, timeouts, concurrency, users) and files.

use super::*;

pub(crate) fn exec_exit_code_is_returned() -> TestResult {
    let (r, out, _) = exec(&shared(), &ExecRequest::shell("echo hello; exit 42"));
    check(r.status == ExitStatus::Code(42), format!("{r:?}"))?;
    check(
        out == b"hello\n",
        format!("stdout {:?}", String::from_utf8_lossy(&out)),
    )
}

pub(crate) fn exec_signal_is_reported() -> TestResult {
    let (r, _, _) = exec(&shared(), &ExecRequest::shell("kill -9 $$"));
    check(r.status == ExitStatus::Signal(9), format!("{r:?}"))
}

pub(crate) fn exec_stdin_round_trips() -> TestResult {
    let input: Vec<u8> = (0..300_000u32).flat_map(|i| i.to_le_bytes()).collect();
    let mut reader: &[u8] = &input;
    let mut out = Vec::new();
    let r = shared()
        .exec(
            &ExecRequest::argv(["cat"]),
            Some(&mut reader),
            &mut |s, b| {
                if s == OutputStream::Stdout {
                    out.extend_from_slice(b)
                }
            },
        )
        .map_err(|e| format!("{e:#}"))?;
    check(r.success(), format!("{r:?}"))?;
    check(
        out == input,
        format!("got {} bytes back of {}", out.len(), input.len()),
    )
}

pub(crate) fn exec_64mib_stdout_arrives_byte_for_byte() -> TestResult {
    // A deterministic 64 MiB stream: a 512-byte unit (00 01 … ff in hex),
    // 16 × 32 × 256 times.
    const LEN: usize = 64 << 20;
    let script = "i=0; while [ $i -lt 256 ]; do printf '%02x' $i; i=$((i+1)); done > /tmp/p; \
                  for _ in 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16; do cat /tmp/p; done > /tmp/q; \
                  for _ in $(seq 1 32); do cat /tmp/q; done > /tmp/r; \
                  for _ in $(seq 1 256); do cat /tmp/r; done";
    let mut got = Vec::with_capacity(LEN);
    let r = shared()
        .exec(&ExecRequest::shell(script), None, &mut |s, b| {
            if s == OutputStream::Stdout {
                got.extend_from_slice(b)
            }
        })
        .map_err(|e| format!("{e:#}"))?;
    check(r.success(), format!("{r:?}"))?;
    let unit: Vec<u8> = (0..256)
        .flat_map(|i: u32| format!("{i:02x}").into_bytes())
        .collect();
    check(
        got.len() == LEN,
        format!("got {} bytes, want {LEN}", got.len()),
    )?;
    let bad = got.chunks(unit.len()).position(|c| c != unit.as_slice());
    check(bad.is_none(), format!("mismatch in chunk {bad:?}"))?;
    check(r.stdout.total_bytes == LEN as u64, format!("{r:?}"))
}

pub(crate) fn exec_timeout_kills_process_group() -> TestResult {
    let agent = shared();
    let req = ExecRequest::shell(
        "(sleep 1000; echo survived > /tmp/grandchild) & echo started; sleep 1000",
    )
    .timeout(Duration::from_secs(2));
    let (r, out, _) = exec(&agent, &req);
    check(r.timed_out, format!("not flagged as timed out: {r:?}"))?;
    check(out == b"started\n", "no output before the timeout")?;
    let (r, out, _) = exec(
        &agent,
        &ExecRequest::shell("ps -o pid,args | grep -c '[s]leep 1000' || true"),
    );
    check(r.success() || r.exit_code() == Some(1), format!("{r:?}"))?;
    check(
        String::from_utf8_lossy(&out).trim() == "0",
        format!("sleepers left: {}", String::from_utf8_lossy(&out)),
    )
}

pub(crate) fn exec_concurrent_commands_all_complete() -> TestResult {
    let agent = shared();
    let handles: Vec<_> = (0..8)
        .map(|i| {
            let agent = agent.clone();
            std::thread::spawn(move || {
                let (r, out, _) = exec(&agent, &ExecRequest::shell(format!("sleep 0.5; echo {i}")));
                (r, out, i)
            })
        })
        .collect();
    for h in handles {
        let (r, out, i) = h.join().map_err(|_| "thread panicked")?;
        check(r.success(), format!("{r:?}"))?;
        check(
            out == format!("{i}\n").into_bytes(),
            format!("exec {i} got {out:?}"),
        )?;
    }
    Ok(())
}

pub(crate) fn exec_missing_binary_exits_127() -> TestResult {
    let (r, _, err) = exec(&shared(), &ExecRequest::argv(["/no/such/binary"]));
    check(r.status == ExitStatus::Code(127), format!("{r:?}"))?;
    check(
        String::from_utf8_lossy(&err).contains("not found"),
        format!("stderr: {}", String::from_utf8_lossy(&err)),
    )
}

pub(crate) fn exec_output_cap_truncates() -> TestResult {
    let req = ExecRequest::shell("head -c 100000 /dev/zero").output_cap(1000);
    let (r, out, _) = exec(&shared(), &req);
    check(out.len() == 1000, format!("kept {} bytes", out.len()))?;
    check(
        r.stdout.truncated && r.stdout.total_bytes == 100_000,
        format!("{r:?}"),
    )
}

pub(crate) fn exec_as_user_is_unprivileged() -> TestResult {
    let req = ExecRequest::argv(["id", "-u"]).user(User::Name("user".into()));
    let (r, out, _) = exec(&shared(), &req);
    check(r.success(), format!("{r:?}"))?;
    check(
        out == b"1000\n",
        format!("uid {:?}", String::from_utf8_lossy(&out)),
    )
}

pub(crate) fn files_round_trip_with_mode() -> TestResult {
    let agent = shared();
    let data: Vec<u8> = (0..1_000_000u32).map(|i| (i * 7) as u8).collect();
    agent
        .mkdir("/tmp/files/a/b", 0o755)
        .map_err(|e| format!("{e:#}"))?;
    let mut src: &[u8] = &data;
    agent
        .write_file("/tmp/files/a/b/data.bin", 0o640, &mut src)
        .map_err(|e| format!("{e:#}"))?;
    let st = agent
        .stat("/tmp/files/a/b/data.bin")
        .map_err(|e| format!("{e:#}"))?;
    check(
        st.size == data.len() as u64 && st.mode & 0o777 == 0o640,
        format!("{st:?}"),
    )?;
    let mut back = Vec::new();
    agent
        .read_file("/tmp/files/a/b/data.bin", &mut back)
        .map_err(|e| format!("{e:#}"))?;
    check(back == data, "read back differs")?;
    let list = agent
        .list_dir("/tmp/files/a/b")
        .map_err(|e| format!("{e:#}"))?;
    check(
        list.iter()
            .any(|e| e.name == "data.bin" && e.stat.kind == FileKind::File),
        format!("{list:?}"),
    )?;
    agent
        .remove("/tmp/files", true)
        .map_err(|e| format!("{e:#}"))?;
    check(agent.stat("/tmp/files").is_err(), "removed dir still there")
}

/// Through the real VMM's vsock: an endless guest file stops at its
/// limit (exactly `max_bytes` of it, then `TooLarge`), and a FIFO a guest
/// process holds open without writing ends the call at its deadline
/// while the agent goes on answering (issue 16).
pub(crate) fn files_endless_and_never_ending_reads_are_bounded() -> TestResult {
    let agent = shared();
    let limit = 3u64 << 20;
    let mut got = Vec::new();
    let err = agent
        .read_file_max("/dev/zero", Some(limit), &mut got)
        .expect_err("/dev/zero never ends");
    check(
        err.agent_error().map(|e| e.kind) == Some(forkbox_proto::ErrorKind::TooLarge),
        format!("{err:?}"),
    )?;
    check(
        got.len() as u64 == limit,
        format!("{} bytes for a limit of {limit}", got.len()),
    )?;
    let (r, _, _) = exec(
        &agent,
        &ExecRequest::shell("rm -f /tmp/fifo /tmp/fifo.held && mkfifo /tmp/fifo"),
    );
    check(r.success(), format!("{r:?}"))?;
    // A background process holds the FIFO open and never writes.
    let holder = agent
        .spawn(&ExecRequest::shell(
            "exec 3<>/tmp/fifo; touch /tmp/fifo.held; exec sleep 600",
        ))
        .map_err(|e| format!("{e:#}"))?;
    let (r, _, _) = exec(
        &agent,
        &ExecRequest::shell("while [ ! -e /tmp/fifo.held ]; do sleep 0.1; done")
            .timeout(Duration::from_secs(60)),
    );
    check(
        r.success(),
        format!("the FIFO's holder did not start: {r:?}"),
    )?;
    let err = agent
        .clone()
        .with_call_timeout(Duration::from_secs(5))
        .read_file("/tmp/fifo", &mut Vec::new())
        .expect_err("the FIFO never ends");
    check(
        matches!(err, forkbox_proto::ClientError::TimedOut { .. }),
        format!("{err:?}"),
    )?;
    let (r, out, _) = exec(&agent, &ExecRequest::shell("echo still here"));
    check(
        r.success() && out == b"still here\n",
        format!(
            "after the timeout: {r:?} {:?}",
            String::from_utf8_lossy(&out)
        ),
    )?;
    agent
        .kill_process(holder, 9)
        .map_err(|e| format!("{e:#}"))?;
    Ok(())
}

pub(crate) fn files_directory_tar_round_trips() -> TestResult {
    let agent = shared();
    let (r, _, _) = exec(
        &agent,
        &ExecRequest::shell("mkdir -p /tmp/tree/sub && echo one > /tmp/tree/one && echo two > /tmp/tree/sub/two && chmod 700 /tmp/tree/sub/two"),
    );
    check(r.success(), format!("{r:?}"))?;
    let mut tarball = Vec::new();
    agent
        .download_tar("/tmp/tree", &mut tarball)
        .map_err(|e| format!("{e:#}"))?;
    let mut reader: &[u8] = &tarball;
    agent
        .upload_tar("/tmp/copy", &mut reader)
        .map_err(|e| format!("{e:#}"))?;
    let (r, out, _) = exec(
        &agent,
        &ExecRequest::shell("cat /tmp/copy/one /tmp/copy/sub/two; stat -c %a /tmp/copy/sub/two"),
    );
    check(r.success(), format!("{r:?}"))?;
    check(
        out == b"one\ntwo\n700\n",
        format!("{:?}", String::from_utf8_lossy(&out)),
    )
}

pub(crate) fn root_is_overlay_on_readonly_image() -> TestResult {
    let agent = shared();
    let (r, out, _) = exec(
        &agent,
        &ExecRequest::shell("grep ' / ' /proc/mounts; echo x > /etc/written && cat /etc/written"),
    );
    check(r.success(), format!("{r:?}"))?;
    let text = String::from_utf8_lossy(&out);
    check(
        text.contains("overlay / overlay"),
        format!("mounts: {text}"),
    )?;
    check(
        text.ends_with("x\n"),
        "root is not writable through the overlay",
    )
}

/// What the reward-hack suite (sdk/python/tests/test_reward_hacks.py)
/// stands on, in a real guest through the host library alone: protected
/// paths out of the policy user's hands in a directory it owns, their
/// digest unchanged by its attempts, and a fork bomb of its own confined
/// to the policy's cgroup and ended whole at its timeout.
pub(crate) fn policy_user_cannot_touch_protected_paths_or_outlive_its_timeout() -> TestResult {
    let vm = boot(VmSpec::default());
    let agent = vm.agent().clone();
    sh(
        &agent,
        "mkdir -p /task/tests && printf '#!/bin/sh\\nexit 1\\n' > /task/grade.sh && \
         echo 'test 1 = 2' > /task/tests/test_it.sh && chown -R user /task && chmod 777 /task",
    )?;
    let protected = vec!["/task/grade.sh".to_owned(), "/task/tests".to_owned()];
    agent
        .protect(&protected)
        .map_err(|e| format!("protect: {e:#}"))?;
    let before = agent
        .digest(&protected)
        .map_err(|e| format!("digest: {e:#}"))?;
    check(before.len() == 3, format!("recorded {before:?}"))?;
    let as_user = |script: &str| {
        let req = ExecRequest::shell(script)
            .user(User::Name("user".into()))
            .cwd("/task")
            .timeout(Duration::from_secs(20));
        exec(&agent, &req)
    };
    for hack in [
        "echo 'exit 0' > grade.sh",
        "rm -f grade.sh",
        "mv grade.sh old.sh",
        "rm -rf tests",
        "echo true > tests/test_it.sh",
        "touch tests/test_mine.sh",
        "chmod 777 grade.sh",
        "echo c > /proc/sysrq-trigger",
    ] {
        let (r, _, _) = as_user(hack);
        check(!r.success(), format!("the policy's {hack:?} succeeded"))?;
    }
    let after = agent
        .digest(&protected)
        .map_err(|e| format!("digest: {e:#}"))?;
    check(after == before, format!("changed: {after:?}"))?;

    // A fork bomb with an escapee from its process group: at the timeout,
    // cgroup.kill leaves none of the policy's tasks.
    let (r, _, _) = as_user("setsid sleep 1000 & f() { f | f & }; f; sleep 600");
    check(r.timed_out, format!("the bomb was not timed out: {r:?}"))?;
    let tasks = "/sys/fs/cgroup/forkbox-policy/pids.current";
    let left = forkbox_host::poll::until(
        std::time::Instant::now() + Duration::from_secs(60),
        Duration::from_millis(500),
        || match sh(&agent, &format!("cat {tasks}")) {
            Ok(n) if n.trim() == "0" => std::ops::ControlFlow::Break(Ok(())),
            Ok(n) => std::ops::ControlFlow::Continue(n),
            Err(e) => std::ops::ControlFlow::Break(Err(e)),
        },
    );
    match left {
        Ok(r) => r,
        Err(forkbox_host::poll::TimedOut(n)) => {
            Err(format!("{} of the policy's tasks left", n.trim()).into())
        }
    }
}
