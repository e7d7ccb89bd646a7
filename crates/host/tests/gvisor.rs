//! gVisor sandboxes, natively (no emulated host): `runsc` from the
//! Makefile's install, the static agent from the build, the `minimal`
//! image. None is skipped: without `runsc` these fail and say how to get it.

use std::io::{Read, Write};
use std::net::TcpListener;
use std::sync::Arc;

use forkbox_host::gvisor::{Runsc, Sandbox, SandboxNet, SandboxSpec};
use forkbox_host::image::ImageName;
use forkbox_proto::client::AgentClient;
use forkbox_proto::{ExecRequest, HookStep, OutputStream, User};

fn runsc(dir: &tempfile::TempDir) -> Arc<Runsc> {
    Arc::new(Runsc::find(dir.path()).unwrap_or_else(|e| panic!("{}", error_chain(&e))))
}

fn spec() -> SandboxSpec {
    SandboxSpec::image(ImageName::Minimal).unwrap_or_else(|e| panic!("{}", error_chain(&e)))
}

fn error_chain(e: &dyn std::error::Error) -> String {
    forkbox_proto::error_chain(e)
}

/// Runs `script` as `user` (root when `None`); returns (exit code, stdout).
fn sh(agent: &AgentClient, script: &str, user: Option<&str>) -> (Option<i32>, String) {
    let mut req = ExecRequest::shell(script);
    req.user = user.map(|u| User::Name(u.into()));
    let mut out = Vec::new();
    let result = agent
        .exec(&req, None, &mut |stream, bytes| {
            if stream == OutputStream::Stdout {
                out.extend_from_slice(bytes);
            }
        })
        .unwrap_or_else(|e| panic!("exec {script:?}: {}", error_chain(&e)));
    (
        result.exit_code(),
        String::from_utf8_lossy(&out).into_owned(),
    )
}

fn start(runsc: &Arc<Runsc>, spec: &SandboxSpec) -> Sandbox {
    Sandbox::start(runsc, spec).unwrap_or_else(|e| panic!("start: {}", error_chain(&e)))
}

#[test]
fn a_sandbox_runs_commands_as_root_and_as_the_policy_user() {
    let dir = tempfile::tempdir().expect("tempdir");
    let runsc = runsc(&dir);
    let sandbox = start(&runsc, &spec());
    let agent = sandbox.agent();
    assert_eq!(
        sh(&agent, "id -u; echo hi >&2; exit 3", None),
        (Some(3), "0\n".into())
    );
    assert_eq!(
        sh(&agent, "id -un", Some("user")),
        (Some(0), "user\n".into())
    );
    // The policy user cannot write root's files; root's writes stay in the
    // sandbox's overlay, not in the image's files on the host.
    let (code, _) = sh(&agent, "echo x > /etc/hosts", Some("user"));
    assert_ne!(code, Some(0), "the policy user wrote /etc/hosts");
    assert_eq!(
        sh(&agent, "echo sandboxed > /etc/motd && cat /etc/motd", None).1,
        "sandboxed\n"
    );
    assert!(
        !spec().rootfs.join("etc/motd").exists(),
        "a sandbox's write reached the image's files on the host"
    );
    let hello = sandbox.hello().expect("hello");
    assert!(hello.boot.pid1, "the agent is not the sandbox's PID 1");
    // Its console is the host's console log, root's to write.
    assert_eq!(sh(&agent, "echo by-root > /dev/console", None).0, Some(0));
    assert_ne!(
        sh(&agent, "echo by-user > /dev/console", Some("user")).0,
        Some(0)
    );
    let console = sandbox.console();
    assert!(
        console.contains("by-root") && !console.contains("by-user"),
        "{console}"
    );
}

#[test]
fn a_sandbox_reaches_no_host_address() {
    // A server on the host's loopback: the sandbox's loopback is its own,
    // and it has no other network.
    let server = TcpListener::bind("127.0.0.1:0").expect("bind");
    let port = server.local_addr().expect("addr").port();
    server.set_nonblocking(true).expect("nonblocking");
    let dir = tempfile::tempdir().expect("tempdir");
    let runsc = runsc(&dir);
    let sandbox = start(&runsc, &spec());
    let (code, out) = sh(
        &sandbox.agent(),
        &format!(
            "echo hi | nc -w 2 127.0.0.1 {port}; echo \"nc=$?\"; ip -o link 2>/dev/null | wc -l"
        ),
        None,
    );
    assert_eq!(code, Some(0), "{out}");
    assert!(
        out.contains("nc=1"),
        "nc reached the host's loopback: {out}"
    );
    assert!(
        server.accept().is_err(),
        "the host's server was connected to from the sandbox"
    );
}

/// A loopback server that answers each connection with `reply`, on a
/// thread of its own, for as long as the test runs.
fn serve(reply: &'static str) -> u16 {
    let server = TcpListener::bind("127.0.0.1:0").expect("bind");
    let port = server.local_addr().expect("addr").port();
    std::thread::spawn(move || {
        for mut conn in server.incoming().flatten() {
            let _ = conn.write_all(reply.as_bytes());
        }
    });
    port
}

/// A network whose policy allows the host's loopback at `port` only.
fn net(port: u16, log: &std::path::Path) -> SandboxNet {
    let json = serde_json::json!({ "allow_out": [format!("host.forkbox.internal:{port}")] });
    SandboxNet {
        policy: serde_json::from_value(json).expect("policy"),
        egress_log: Some(log.to_owned()),
    }
}

/// `nc` from the sandbox to the host's loopback at `port`, by name.
fn fetch(agent: &AgentClient, port: u16) -> String {
    sh(
        agent,
        &format!("nc -w 5 host.forkbox.internal {port} </dev/null; echo \" nc=$?\""),
        Some("user"),
    )
    .1
}

#[test]
fn a_sandbox_with_a_network_reaches_what_its_policy_allows_and_is_logged() {
    let (allowed, other) = (serve("allowed\n"), serve("other\n"));
    let dir = tempfile::tempdir().expect("tempdir");
    let runsc = runsc(&dir);
    let log = dir.path().join("egress.jsonl");
    let mut spec = spec();
    spec.net = Some(net(allowed, &log));
    let sandbox = start(&runsc, &spec);
    let agent = sandbox.agent();
    assert_eq!(fetch(&agent, allowed), "allowed\n nc=0\n");
    let denied = fetch(&agent, other);
    assert!(
        !denied.contains("other") && !denied.contains("nc=0"),
        "a port the policy does not allow was reached: {denied:?}"
    );
    let log = std::fs::read_to_string(&log).expect("egress log");
    let records: Vec<serde_json::Value> = log
        .lines()
        .map(|l| serde_json::from_str(l).expect("a JSON line"))
        .collect();
    let logged = |port: u16, verdict: &str| {
        records
            .iter()
            .any(|r| r["protocol"] == "tcp" && r["port"] == port && r["verdict"] == verdict)
    };
    assert!(
        logged(allowed, "allow"),
        "no allowed record for {allowed}: {log}"
    );
    assert!(logged(other, "deny"), "no denied record for {other}: {log}");
}

#[test]
fn a_networked_sandboxs_forks_have_their_own_gateways_and_it_keeps_its_own() {
    let port = serve("hi\n");
    let dir = tempfile::tempdir().expect("tempdir");
    let runsc = runsc(&dir);
    let mut spec = spec();
    spec.net = Some(net(port, &dir.path().join("parent.jsonl")));
    let parent = start(&runsc, &spec);
    assert_eq!(fetch(&parent.agent(), port), "hi\n nc=0\n");
    let image = dir.path().join("checkpoint");
    parent
        .checkpoint(&image)
        .unwrap_or_else(|e| panic!("checkpoint: {}\n{}", error_chain(&e), parent.console()));
    // The parent's gateway connects again after the checkpoint.
    assert_eq!(fetch(&parent.agent(), port), "hi\n nc=0\n");
    let child_log = dir.path().join("child.jsonl");
    let mut child_spec = spec.clone();
    child_spec.net = Some(net(port, &child_log));
    let (child, _) = Sandbox::restore(&runsc, &child_spec, &image, None)
        .unwrap_or_else(|e| panic!("restore: {}", error_chain(&e)));
    assert_eq!(fetch(&child.agent(), port), "hi\n nc=0\n");
    let logged = std::fs::read_to_string(&child_log).expect("the child's egress log");
    let connections = logged
        .lines()
        .filter(|l| l.contains("\"protocol\":\"tcp\""))
        .count();
    assert_eq!(
        connections, 1,
        "the child's log holds its one connection: {logged}"
    );
}

#[test]
fn a_checkpoint_refuses_open_connections_by_name_and_the_sandbox_goes_on() {
    // A server that holds each connection open until the test ends.
    let server = TcpListener::bind("127.0.0.1:0").expect("bind");
    let port = server.local_addr().expect("addr").port();
    std::thread::spawn(move || {
        let held: Vec<_> = server.incoming().flatten().collect();
        drop(held);
    });
    let dir = tempfile::tempdir().expect("tempdir");
    let runsc = runsc(&dir);
    let mut spec = spec();
    spec.net = Some(net(port, &dir.path().join("egress.jsonl")));
    let sandbox = start(&runsc, &spec);
    let agent = sandbox.agent();
    let holder = agent
        .spawn(&ExecRequest::shell(format!(
            "sleep 1000 | nc host.forkbox.internal {port}"
        )))
        .expect("spawn");
    let (_, established) = sh(
        &agent,
        "for i in $(seq 50); do grep -q ' 01 ' /proc/net/tcp && echo up && break; sleep 0.1; done",
        None,
    );
    assert_eq!(established, "up\n", "the connection did not open");
    let image = dir.path().join("checkpoint");
    let refused = sandbox
        .checkpoint_within(&image, std::time::Duration::from_secs(2))
        .expect_err("a checkpoint with an open connection");
    let why = error_chain(&refused);
    assert!(
        why.contains("did not close") && why.contains("established"),
        "{why}"
    );
    // Still serving, its connection kept; once it ends, the checkpoint is made.
    assert_eq!(sh(&agent, "grep -c ' 01 ' /proc/net/tcp", None).1, "1\n");
    agent.kill_process(holder, 9).expect("kill");
    sandbox
        .checkpoint(&image)
        .unwrap_or_else(|e| panic!("checkpoint: {}", error_chain(&e)));
    assert_eq!(sh(&agent, "true", None).0, Some(0));
}

#[test]
fn forks_of_a_running_sandbox_start_from_its_state_and_write_their_own() {
    let dir = tempfile::tempdir().expect("tempdir");
    let runsc = runsc(&dir);
    let spec = spec();
    let parent = start(&runsc, &spec);
    let agent = parent.agent();
    assert_eq!(
        sh(&agent, "echo parent > /home/user/state", Some("user")).0,
        Some(0)
    );
    // A process running through the checkpoint: every copy has it.
    let bg = agent
        .spawn(&ExecRequest::shell("echo up > /tmp/bg; exec sleep 1000"))
        .expect("spawn");
    let image = dir.path().join("checkpoint");
    parent
        .checkpoint(&image)
        .unwrap_or_else(|e| panic!("checkpoint: {}", error_chain(&e)));
    // The parent goes on, and its writes are not its children's.
    assert_eq!(sh(&agent, "echo later > /home/user/state", None).0, Some(0));

    let children: Vec<Sandbox> = (0..3)
        .map(|i| {
            let (child, report) = Sandbox::restore(&runsc, &spec, &image, None)
                .unwrap_or_else(|e| panic!("restore {i}: {}", error_chain(&e)));
            assert!(
                matches!(report.clock, HookStep::Skipped { .. }),
                "{report:?}"
            );
            assert!(matches!(report.rng, HookStep::Skipped { .. }), "{report:?}");
            child
        })
        .collect();
    for (i, child) in children.iter().enumerate() {
        let agent = child.agent();
        assert_eq!(
            sh(&agent, "cat /home/user/state", None).1,
            "parent\n",
            "child {i}"
        );
        assert_eq!(sh(&agent, "cat /tmp/bg", None).1, "up\n", "child {i}");
        let processes = agent.processes().expect("processes");
        assert!(
            processes.iter().any(|p| p.pid == bg),
            "child {i} lost the parent's background process {bg}: {processes:?}"
        );
        let script = format!("echo child{i} > /home/user/state");
        assert_eq!(sh(&agent, &script, Some("user")).0, Some(0));
    }
    for (i, child) in children.iter().enumerate() {
        assert_eq!(
            sh(&child.agent(), "cat /home/user/state", None).1,
            format!("child{i}\n")
        );
    }
    assert_eq!(sh(&agent, "cat /home/user/state", None).1, "later\n");
    // Each copy draws its own randomness.
    let draws: Vec<String> = children
        .iter()
        .map(|c| sh(&c.agent(), "head -c 16 /dev/urandom | od -An -tx1", None).1)
        .collect();
    assert_ne!(draws[0], draws[1]);
    assert_ne!(draws[1], draws[2]);
}

#[test]
fn a_checkpoint_waits_for_open_requests_and_says_which_are_left() {
    let dir = tempfile::tempdir().expect("tempdir");
    let runsc = runsc(&dir);
    let sandbox = start(&runsc, &spec());
    let agent = sandbox.agent();
    // A command streaming stdin holds its request open until stdin ends.
    let (reader, mut writer) = std::io::pipe().expect("pipe");
    let long = std::thread::spawn(move || {
        let mut reader: Box<dyn Read + Send> = Box::new(reader);
        let mut out = Vec::new();
        agent
            .exec(
                &ExecRequest::shell("cat"),
                Some(&mut *reader),
                &mut |_, b| out.extend_from_slice(b),
            )
            .map(|r| (r.exit_code(), out))
    });
    std::thread::sleep(std::time::Duration::from_millis(300));
    let image = dir.path().join("checkpoint");
    let err = sandbox
        .checkpoint_within(&image, std::time::Duration::from_millis(500))
        .expect_err("a checkpoint with a request open");
    let text = error_chain(&err);
    assert!(text.contains("1 other request(s) still open"), "{text}");
    // The open request was not harmed, and the sandbox serves again.
    writer.write_all(b"still here\n").expect("write");
    drop(writer);
    let (code, out) = long.join().expect("join").expect("exec");
    assert_eq!((code, out), (Some(0), b"still here\n".to_vec()));
    assert_eq!(sh(&sandbox.agent(), "echo back", None).1, "back\n");
    // With nothing open, it is made.
    sandbox
        .checkpoint(&image)
        .unwrap_or_else(|e| panic!("checkpoint: {}", error_chain(&e)));
}

#[test]
fn a_sandbox_whose_maker_lets_go_ends_itself() {
    let dir = tempfile::tempdir().expect("tempdir");
    let runsc = runsc(&dir);
    let sandbox = start(&runsc, &spec());
    assert!(!sandbox.ended());
    let pid = sandbox.pid().expect("the sandbox's pid");
    sandbox.release();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    while !sandbox.ended() {
        assert!(
            std::time::Instant::now() < deadline,
            "sandbox {pid} still runs 20 s after its maker let go:\n{}",
            sandbox.console()
        );
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    assert!(
        sandbox.console().contains("let go of this sandbox"),
        "{}",
        sandbox.console()
    );
}

#[test]
fn a_sandboxs_memory_is_its_limit() {
    let dir = tempfile::tempdir().expect("tempdir");
    let runsc = runsc(&dir);
    let spec = SandboxSpec {
        memory_mib: Some(256),
        cpus: Some(1),
        ..spec()
    };
    let sandbox = start(&runsc, &spec);
    let (code, out) = sh(&sandbox.agent(), "free -m | awk '/^Mem:/ {print $2}'", None);
    assert_eq!(code, Some(0));
    let total: u64 = out
        .trim()
        .parse()
        .unwrap_or_else(|_| panic!("free said {out:?}"));
    assert!(
        (200..=256).contains(&total),
        "the sandbox sees {total} MiB, not its 256"
    );
}
