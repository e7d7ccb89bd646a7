//! The real agent binary (`serve --listen unix:`) driven by the real client.

use std::fs;
use std::io::{Read, Write};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::thread;
use std::time::{Duration, Instant};

use forkbox_proto::frame::{encode_header, read_frame, write_frame};
use forkbox_proto::User;
use forkbox_proto::{
    decode_control, encode_control, AgentClient, ClientError, ErrorKind, ExecRequest, ExitStatus,
    FileKind, FrameKind, OutputStream, Request, Response, MAX_FRAME_LEN,
};
use sha2::{Digest, Sha256};

struct Agent {
    child: Child,
    dir: tempfile::TempDir,
    sock: PathBuf,
}

impl Agent {
    fn start() -> Self {
        let dir = tempfile::tempdir().expect("tempdir");
        let sock = dir.path().join("agent.sock");
        let child = Command::new(env!("CARGO_BIN_EXE_forkbox-agent"))
            .arg("serve")
            .arg("--listen")
            .arg(format!("unix:{}", sock.display()))
            .spawn()
            .expect("start agent");
        let agent = Self { child, dir, sock };
        agent
            .client()
            .wait_ready(Duration::from_secs(20))
            .expect("agent ready");
        agent
    }

    fn client(&self) -> AgentClient {
        AgentClient::unix(&self.sock)
    }

    /// A scratch path inside the test's temp dir, as a string.
    fn path(&self, rel: &str) -> String {
        self.dir.path().join(rel).display().to_string()
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

struct Output {
    stdout: Vec<u8>,
    stderr: Vec<u8>,
    result: forkbox_proto::ExecResult,
}

fn run(client: &AgentClient, req: &ExecRequest, stdin: Option<&[u8]>) -> Output {
    let (mut stdout, mut stderr) = (Vec::new(), Vec::new());
    let mut input = stdin.map(|b| b.to_vec());
    let mut cursor = input.as_mut().map(|b| std::io::Cursor::new(b.as_slice()));
    let result = client
        .exec(
            req,
            cursor.as_mut().map(|c| c as &mut (dyn Read + Send)),
            &mut |stream, bytes| match stream {
                OutputStream::Stdout => stdout.extend_from_slice(bytes),
                OutputStream::Stderr => stderr.extend_from_slice(bytes),
            },
        )
        .expect("exec");
    Output {
        stdout,
        stderr,
        result,
    }
}

/// Polls until `pid` no longer exists (killed and reaped). Bounded.
fn wait_gone(pid: u32) -> bool {
    let deadline = Instant::now() + Duration::from_secs(10);
    while Instant::now() < deadline {
        if !Path::new(&format!("/proc/{pid}")).exists() {
            return true;
        }
        thread::sleep(Duration::from_millis(10));
    }
    false
}

fn deterministic_bytes(len: usize) -> Vec<u8> {
    let mut state: u64 = 0x1234_5678_9ABC_DEF1;
    (0..len)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state as u8
        })
        .collect()
}

#[test]
fn exec_exit_code_propagates() {
    let agent = Agent::start();
    let out = run(
        &agent.client(),
        &ExecRequest::shell("echo hi; exit 3"),
        None,
    );
    assert_eq!(out.result.status, ExitStatus::Code(3));
    assert_eq!(out.stdout, b"hi\n");
    assert!(!out.result.timed_out);
}

#[test]
fn exec_argv_env_and_cwd_applied() {
    let agent = Agent::start();
    let req = ExecRequest::argv(["sh", "-c", "echo $FOO; pwd"])
        .env("FOO", "bar")
        .cwd(agent.dir.path().display().to_string());
    let out = run(&agent.client(), &req, None);
    let expected = format!("bar\n{}\n", agent.dir.path().display());
    assert_eq!(String::from_utf8_lossy(&out.stdout), expected);
    assert!(out.result.success());
}

#[test]
fn exec_killed_by_signal_reports_signal() {
    let agent = Agent::start();
    let out = run(&agent.client(), &ExecRequest::shell("kill -9 $$"), None);
    assert_eq!(out.result.status, ExitStatus::Signal(9));
    assert_eq!(out.result.exit_code(), None);
}

#[test]
fn exec_stderr_streamed_separately() {
    let agent = Agent::start();
    let out = run(
        &agent.client(),
        &ExecRequest::shell("echo out; echo err >&2"),
        None,
    );
    assert_eq!(out.stdout, b"out\n");
    assert_eq!(out.stderr, b"err\n");
    assert_eq!(out.result.stdout.total_bytes, 4);
    assert_eq!(out.result.stderr.total_bytes, 4);
}

#[test]
fn exec_stdin_roundtrips() {
    let agent = Agent::start();
    let input = deterministic_bytes(3 * 1024 * 1024 + 17);
    let out = run(&agent.client(), &ExecRequest::argv(["cat"]), Some(&input));
    assert!(out.result.success());
    assert_eq!(out.stdout.len(), input.len());
    assert!(out.stdout == input);
}

#[test]
fn exec_stdin_unread_still_completes() {
    let agent = Agent::start();
    let input = deterministic_bytes(8 * 1024 * 1024);
    let out = run(&agent.client(), &ExecRequest::argv(["true"]), Some(&input));
    assert_eq!(out.result.status, ExitStatus::Code(0));
}

#[test]
fn exec_64mib_stdout_byte_exact() {
    let agent = Agent::start();
    let file = agent.dir.path().join("big");
    let data = deterministic_bytes(64 * 1024 * 1024);
    fs::write(&file, &data).expect("write big file");
    let client = agent.client();
    let mut hasher = Sha256::new();
    let mut n = 0u64;
    let start = Instant::now();
    let result = client
        .exec(
            &ExecRequest::argv(["cat".to_string(), file.display().to_string()]),
            None,
            &mut |stream, bytes| {
                assert_eq!(stream, OutputStream::Stdout);
                hasher.update(bytes);
                n += bytes.len() as u64;
            },
        )
        .expect("exec");
    let secs = start.elapsed().as_secs_f64();
    let profile = if cfg!(debug_assertions) {
        "debug"
    } else {
        "release"
    };
    eprintln!(
        "64 MiB stdout in {secs:.3} s ({:.0} MiB/s, {profile} build)",
        64.0 / secs
    );
    assert!(result.success());
    assert_eq!(n, data.len() as u64);
    assert_eq!(result.stdout.total_bytes, data.len() as u64);
    assert!(!result.stdout.truncated);
    assert_eq!(hasher.finalize()[..], Sha256::digest(&data)[..]);
}

#[test]
fn exec_output_cap_truncates_and_counts() {
    let agent = Agent::start();
    let req =
        ExecRequest::shell("head -c 300000 /dev/zero; head -c 10 /dev/zero >&2").output_cap(1000);
    let out = run(&agent.client(), &req, None);
    assert_eq!(out.stdout.len(), 1000);
    assert_eq!(out.result.stdout.total_bytes, 300_000);
    assert!(out.result.stdout.truncated);
    assert_eq!(out.stderr.len(), 10);
    assert!(!out.result.stderr.truncated);
    assert!(out.result.success());
}

#[test]
fn exec_timeout_kills_process_group() {
    let agent = Agent::start();
    // The grandchild sleeper shares the group and holds stdout open.
    let req = ExecRequest::shell("sleep 1000 & echo $!; wait").timeout(Duration::from_millis(300));
    let out = run(&agent.client(), &req, None);
    assert!(out.result.timed_out);
    assert_eq!(out.result.status, ExitStatus::Signal(9));
    let pid: u32 = String::from_utf8_lossy(&out.stdout)
        .trim()
        .parse()
        .expect("grandchild pid");
    assert!(wait_gone(pid), "grandchild {pid} survived the timeout");
}

#[test]
fn exec_concurrent_requests_all_complete() {
    let agent = Agent::start();
    let client = agent.client();
    thread::scope(|s| {
        let handles: Vec<_> = (0..8)
            .map(|i| {
                let client = client.clone();
                s.spawn(move || {
                    let req = ExecRequest::shell(format!("sleep 0.2; echo {i}"));
                    let out = run(&client, &req, None);
                    assert_eq!(out.stdout, format!("{i}\n").into_bytes());
                    assert!(out.result.success());
                })
            })
            .collect();
        for h in handles {
            h.join().expect("exec thread");
        }
    });
}

#[test]
fn exec_as_user_drops_privileges() {
    if !rustix::process::geteuid().is_root() {
        eprintln!("skipped: needs root to switch users");
        return;
    }
    let agent = Agent::start();
    let client = agent.client();
    let req = ExecRequest::shell("id -u; id -g; echo $HOME").user(User::Uid(12345));
    let out = run(&client, &req, None);
    assert_eq!(String::from_utf8_lossy(&out.stdout), "12345\n12345\n/\n");
    let req = ExecRequest::shell("id -un; pwd").user(User::Name("nobody".into()));
    let out = run(&client, &req, None);
    assert_eq!(String::from_utf8_lossy(&out.stdout), "nobody\n/\n");
    let err = client
        .exec(
            &ExecRequest::argv(["true"]).user(User::Name("forkbox-no-such-user".into())),
            None,
            &mut |_, _| {},
        )
        .expect_err("unknown user");
    assert_eq!(
        err.agent_error().map(|e| e.kind),
        Some(ErrorKind::InvalidRequest)
    );
}

/// File requests as a user are checked by the kernel as that user's: a
/// link to a root-only file is refused, not followed as root, and what the
/// user writes is theirs.
#[test]
fn files_as_user_act_with_that_users_rights() {
    assert!(
        rustix::process::geteuid().is_root(),
        "this test switches users: run it as root"
    );
    let agent = Agent::start();
    let shared = agent.dir.path().join("shared");
    fs::create_dir(&shared).expect("mkdir");
    fs::set_permissions(agent.dir.path(), fs::Permissions::from_mode(0o755)).expect("chmod");
    fs::set_permissions(&shared, fs::Permissions::from_mode(0o755)).expect("chmod");
    let secret = shared.join("expected-answer");
    fs::write(&secret, "42").expect("write");
    fs::set_permissions(&secret, fs::Permissions::from_mode(0o600)).expect("chmod");
    std::os::unix::fs::symlink(&secret, shared.join("answer")).expect("symlink");
    let open = agent.dir.path().join("open");
    fs::create_dir(&open).expect("mkdir");
    fs::set_permissions(&open, fs::Permissions::from_mode(0o777)).expect("chmod");

    let nobody = agent
        .client()
        .with_file_user(Some(User::Name("nobody".into())));
    for path in ["shared/answer", "shared/expected-answer"] {
        let err = nobody
            .read_file(&agent.path(path), &mut Vec::new())
            .expect_err("root-only");
        assert_eq!(
            err.agent_error().map(|e| e.kind),
            Some(ErrorKind::PermissionDenied),
            "{path}: {err}"
        );
    }
    let err = nobody
        .write_file(&agent.path("shared/planted"), 0o644, &mut &b"x"[..])
        .expect_err("root's directory");
    assert_eq!(
        err.agent_error().map(|e| e.kind),
        Some(ErrorKind::PermissionDenied),
        "{err}"
    );
    nobody
        .write_file(&agent.path("open/mine"), 0o644, &mut &b"mine"[..])
        .expect("a directory anyone may write");
    let meta = fs::metadata(open.join("mine")).expect("written");
    assert_eq!(
        std::os::unix::fs::MetadataExt::uid(&meta),
        65534,
        "owned by nobody"
    );
    // Root, asked without a user, still reads it: the agent itself is
    // unchanged by a user's request.
    let mut root_read = Vec::new();
    agent
        .client()
        .read_file(&agent.path("shared/answer"), &mut root_read)
        .expect("root");
    assert_eq!(root_read, b"42");
}

#[test]
fn protected_paths_are_out_of_a_users_hands_and_their_digest_sees_every_change() {
    assert!(
        rustix::process::geteuid().is_root(),
        "this test switches users: run it as root"
    );
    let agent = Agent::start();
    // A task directory the policy's user owns, as a template's would be.
    let task = agent.dir.path().join("task");
    fs::create_dir_all(task.join("tests")).expect("mkdir");
    fs::set_permissions(agent.dir.path(), fs::Permissions::from_mode(0o755)).expect("chmod");
    std::os::unix::fs::chown(&task, Some(65534), Some(65534)).expect("chown to nobody");
    // Protected files are immutable: take that back before the temporary
    // directory is removed, however the test ends.
    let mutable = || {
        Command::new("chattr")
            .arg("-R")
            .arg("-i")
            .args([task.join("tests"), task.join("grade.sh")])
            .status()
            .is_ok_and(|s| s.success())
    };
    struct Finally<F: Fn() -> bool>(F);
    impl<F: Fn() -> bool> Drop for Finally<F> {
        fn drop(&mut self) {
            (self.0)();
        }
    }
    let _mutable = Finally(mutable);
    fs::write(task.join("tests/test_it.py"), "assert add(1, 2) == 3\n").expect("write");
    fs::write(task.join("grade.sh"), "#!/bin/sh\npytest\n").expect("write");
    fs::set_permissions(task.join("grade.sh"), fs::Permissions::from_mode(0o777)).expect("chmod");
    std::os::unix::fs::symlink("tests/test_it.py", task.join("link")).expect("symlink");
    let protected = vec![agent.path("task/tests"), agent.path("task/grade.sh")];
    let client = agent.client();
    client.protect(&protected).expect("protect");
    let before = client.digest(&protected).expect("digest");
    let paths: Vec<&str> = before.iter().map(|e| e.path.as_str()).collect();
    assert_eq!(
        paths,
        [
            agent.path("task/grade.sh"),
            agent.path("task/tests"),
            agent.path("task/tests/test_it.py"),
        ]
    );
    let grader = &before[0];
    assert_eq!((grader.uid, grader.gid, grader.mode), (0, 0, 0o755));
    assert_eq!(grader.size, 17);
    assert_eq!(
        grader.content,
        format!("{:x}", Sha256::digest(b"#!/bin/sh\npytest\n"))
    );
    assert_eq!(client.digest(&protected).expect("again"), before, "stable");

    // nobody owns the task directory, yet may not edit, replace, rename
    // or remove what is protected in it, though it may write beside it.
    let nobody = |script: &str| {
        run(
            &client,
            &ExecRequest::shell(script.to_owned())
                .cwd(agent.path("task"))
                .user(User::Name("nobody".into())),
            None,
        )
    };
    for hack in [
        "echo 'exit 0' > grade.sh",
        "rm -f grade.sh",
        "mv grade.sh old.sh",
        "rm -rf tests",
        "mv tests old-tests",
        "echo pass > tests/test_it.py",
        "touch tests/conftest.py",
        "chmod 777 grade.sh",
    ] {
        let out = nobody(hack);
        assert_ne!(out.result.exit_code(), Some(0), "{hack:?} succeeded");
    }
    assert_eq!(nobody("echo mine > notes.txt").result.exit_code(), Some(0));
    assert_eq!(client.digest(&protected).expect("digest"), before);

    // Root can change it (after `chattr -i`, as a root policy could), and
    // the digest sees each kind of change.
    assert!(mutable(), "chattr -i");
    fs::write(task.join("tests/conftest.py"), "").expect("add");
    fs::write(task.join("grade.sh"), "#!/bin/sh\nexit 0\n").expect("edit");
    let after = client.digest(&protected).expect("digest");
    assert_eq!(after.len(), 4);
    assert_ne!(after[0].content, before[0].content);
    assert!(after.iter().any(|e| e.path.ends_with("conftest.py")));
    fs::remove_dir_all(task.join("tests")).expect("remove");
    let gone = client
        .digest(&protected)
        .expect("a missing path has no entries");
    assert_eq!(gone.len(), 1);

    let err = client.protect(&["relative".into()]).expect_err("relative");
    assert_eq!(
        err.agent_error().map(|e| e.kind),
        Some(ErrorKind::InvalidRequest)
    );
    let err = client
        .protect(&[agent.path("task/none")])
        .expect_err("missing");
    assert_eq!(err.agent_error().map(|e| e.kind), Some(ErrorKind::NotFound));
}

#[test]
fn exec_missing_binary_exit_127() {
    let agent = Agent::start();
    let out = run(
        &agent.client(),
        &ExecRequest::argv(["forkbox-no-such-command"]),
        None,
    );
    assert_eq!(out.result.status, ExitStatus::Code(127));
    assert_eq!(
        String::from_utf8_lossy(&out.stderr),
        "forkbox: forkbox-no-such-command: command not found\n"
    );
}

#[test]
fn exec_not_executable_exit_126() {
    let agent = Agent::start();
    let path = agent.path("noexec");
    fs::write(&path, "#!/bin/sh\necho hi\n").expect("write");
    fs::set_permissions(&path, fs::Permissions::from_mode(0o644)).expect("chmod");
    let out = run(&agent.client(), &ExecRequest::argv([path.as_str()]), None);
    assert_eq!(out.result.status, ExitStatus::Code(126));
}

#[test]
fn exec_missing_cwd_agent_error() {
    let agent = Agent::start();
    let err = agent
        .client()
        .exec(
            &ExecRequest::argv(["true"]).cwd("/nonexistent/forkbox"),
            None,
            &mut |_, _| {},
        )
        .expect_err("bad cwd");
    assert_eq!(err.agent_error().map(|e| e.kind), Some(ErrorKind::NotFound));
}

#[test]
fn exec_client_disconnect_kills_command() {
    let agent = Agent::start();
    let mut s = UnixStream::connect(&agent.sock).expect("connect");
    let hello = read_frame(&mut s, MAX_FRAME_LEN)
        .expect("hello")
        .expect("hello");
    assert_eq!(hello.kind, FrameKind::Control);
    let req = Request::Exec {
        exec: ExecRequest::shell("sleep 1000 & echo $!; wait"),
        stdin: false,
    };
    write_frame(&mut s, FrameKind::Control, &encode_control(&req)).expect("request");
    let frame = read_frame(&mut s, MAX_FRAME_LEN)
        .expect("read")
        .expect("pid");
    assert_eq!(frame.kind, FrameKind::Stdout);
    let pid: u32 = String::from_utf8_lossy(&frame.body)
        .trim()
        .parse()
        .expect("pid");
    drop(s);
    assert!(wait_gone(pid), "sleeper {pid} survived the disconnect");
}

#[test]
fn exec_disconnect_while_stdin_blocked_kills_command() {
    let agent = Agent::start();
    let mut s = UnixStream::connect(&agent.sock).expect("connect");
    read_frame(&mut s, MAX_FRAME_LEN)
        .expect("hello")
        .expect("hello");
    // The command never reads stdin, so the agent's stdin writer blocks.
    let req = Request::Exec {
        exec: ExecRequest::shell("sleep 1000 & echo $!; wait"),
        stdin: true,
    };
    write_frame(&mut s, FrameKind::Control, &encode_control(&req)).expect("request");
    let frame = read_frame(&mut s, MAX_FRAME_LEN)
        .expect("read")
        .expect("pid");
    let pid: u32 = String::from_utf8_lossy(&frame.body)
        .trim()
        .parse()
        .expect("pid");
    // Fill the pipe and the socket buffers: a write that times out means
    // nobody on the other side is reading any more.
    s.set_write_timeout(Some(Duration::from_millis(300)))
        .expect("timeout");
    let chunk = vec![0u8; 64 * 1024];
    while write_frame(&mut s, FrameKind::Data, &chunk).is_ok() {}
    s.shutdown(std::net::Shutdown::Both).expect("shutdown");
    drop(s);
    assert!(wait_gone(pid), "sleeper {pid} survived the disconnect");
}

#[test]
fn server_oversized_frame_answered_with_error() {
    let agent = Agent::start();
    let mut s = UnixStream::connect(&agent.sock).expect("connect");
    read_frame(&mut s, MAX_FRAME_LEN)
        .expect("hello")
        .expect("hello");
    s.write_all(&encode_header(FrameKind::Control, MAX_FRAME_LEN + 1))
        .expect("header");
    let frame = read_frame(&mut s, MAX_FRAME_LEN)
        .expect("read")
        .expect("reply");
    match decode_control::<Response>(&frame.body).expect("response") {
        Response::Error { error } => assert_eq!(error.kind, ErrorKind::Protocol),
        other => panic!("unexpected {other:?}"),
    }
}

#[test]
fn server_garbage_request_answered_with_error() {
    let agent = Agent::start();
    let mut s = UnixStream::connect(&agent.sock).expect("connect");
    read_frame(&mut s, MAX_FRAME_LEN)
        .expect("hello")
        .expect("hello");
    write_frame(&mut s, FrameKind::Control, b"{not json").expect("garbage");
    let frame = read_frame(&mut s, MAX_FRAME_LEN)
        .expect("read")
        .expect("reply");
    match decode_control::<Response>(&frame.body).expect("response") {
        Response::Error { error } => assert_eq!(error.kind, ErrorKind::InvalidRequest),
        other => panic!("unexpected {other:?}"),
    }
}

#[test]
fn files_write_read_roundtrip_preserves_mode() {
    let agent = Agent::start();
    let client = agent.client();
    let path = agent.path("f.bin");
    let data = deterministic_bytes(2 * 1024 * 1024 + 5);
    let written = client
        .write_file(&path, 0o640, &mut data.as_slice())
        .expect("write");
    assert_eq!(written, data.len() as u64);
    let stat = client.stat(&path).expect("stat");
    assert_eq!(stat.kind, FileKind::File);
    assert_eq!(stat.mode, 0o640);
    assert_eq!(stat.size, data.len() as u64);
    let mut back = Vec::new();
    assert_eq!(
        client.read_file(&path, &mut back).expect("read"),
        data.len() as u64
    );
    assert!(back == data);
}

#[test]
fn files_write_missing_parent_not_found_unless_asked() {
    let agent = Agent::start();
    let client = agent.client();
    let path = agent.path("a/b/c.txt");
    let err = client
        .write_file(&path, 0o600, &mut &b"x"[..])
        .expect_err("missing parent");
    assert_eq!(err.agent_error().map(|e| e.kind), Some(ErrorKind::NotFound));
    client
        .write_file_with(&path, 0o600, true, &mut &b"x"[..])
        .expect("create parents");
    assert_eq!(fs::read(&path).expect("read"), b"x");
}

#[test]
fn files_read_missing_not_found() {
    let agent = Agent::start();
    let err = agent
        .client()
        .read_file(&agent.path("nope"), &mut Vec::new())
        .expect_err("missing");
    assert_eq!(err.agent_error().map(|e| e.kind), Some(ErrorKind::NotFound));
}

#[test]
fn files_relative_path_invalid() {
    let agent = Agent::start();
    let err = agent.client().stat("etc/passwd").expect_err("relative");
    assert_eq!(
        err.agent_error().map(|e| e.kind),
        Some(ErrorKind::InvalidRequest)
    );
}

#[test]
fn files_mkdir_list_remove_cycle() {
    let agent = Agent::start();
    let client = agent.client();
    let root = agent.path("tree");
    client
        .mkdir(&format!("{root}/x/y"), 0o755)
        .expect("mkdir -p");
    client
        .mkdir(&format!("{root}/x/y"), 0o755)
        .expect("mkdir -p twice");
    client
        .write_file(&format!("{root}/f"), 0o600, &mut &b"abc"[..])
        .expect("write");
    std::os::unix::fs::symlink("f", format!("{root}/l")).expect("symlink");
    let mut entries = client.list_dir(&root).expect("list");
    entries.sort_by(|a, b| a.name.cmp(&b.name));
    let summary: Vec<_> = entries
        .iter()
        .map(|e| (e.name.as_str(), e.stat.kind, e.stat.size))
        .collect();
    assert_eq!(summary[0], ("f", FileKind::File, 3));
    assert_eq!(summary[1].0, "l");
    assert_eq!(summary[1].1, FileKind::Symlink);
    assert_eq!(summary[2].0, "x");
    assert_eq!(summary[2].1, FileKind::Dir);
    let err = client.remove(&root, false).expect_err("not empty");
    assert_eq!(
        err.agent_error().map(|e| e.kind),
        Some(ErrorKind::DirectoryNotEmpty)
    );
    client
        .remove(&format!("{root}/f"), false)
        .expect("remove file");
    client.remove(&root, true).expect("remove tree");
    let err = client.stat(&root).expect_err("gone");
    assert_eq!(err.agent_error().map(|e| e.kind), Some(ErrorKind::NotFound));
}

#[test]
fn files_list_large_dir_spans_batches() {
    let agent = Agent::start();
    let dir = agent.dir.path().join("many");
    fs::create_dir(&dir).expect("mkdir");
    for i in 0..2500 {
        fs::write(dir.join(format!("f{i}")), b"").expect("write");
    }
    let entries = agent
        .client()
        .list_dir(&dir.display().to_string())
        .expect("list");
    assert_eq!(entries.len(), 2500);
}

fn make_tree(root: &Path) {
    fs::create_dir_all(root.join("sub/deeper")).expect("mkdir");
    fs::write(root.join("a.txt"), b"hello").expect("write");
    fs::write(
        root.join("sub/deeper/big.bin"),
        deterministic_bytes(700_000),
    )
    .expect("write");
    fs::write(root.join("sub/run.sh"), b"#!/bin/sh\n").expect("write");
    fs::set_permissions(root.join("sub/run.sh"), fs::Permissions::from_mode(0o750)).expect("chmod");
    std::os::unix::fs::symlink("../a.txt", root.join("sub/link")).expect("symlink");
}

#[test]
fn tar_download_upload_roundtrip() {
    let agent = Agent::start();
    let client = agent.client();
    let src = agent.dir.path().join("src");
    make_tree(&src);
    let mut archive = Vec::new();
    let n = client
        .download_tar(&src.display().to_string(), &mut archive)
        .expect("download");
    assert_eq!(n, archive.len() as u64);
    let dst = agent.dir.path().join("dst");
    let up = client
        .upload_tar(&dst.display().to_string(), &mut archive.as_slice())
        .expect("upload");
    assert_eq!(up, archive.len() as u64);
    assert_eq!(fs::read(dst.join("a.txt")).expect("a"), b"hello");
    assert_eq!(
        fs::read(dst.join("sub/deeper/big.bin")).expect("big"),
        deterministic_bytes(700_000)
    );
    let mode = fs::metadata(dst.join("sub/run.sh"))
        .expect("run.sh")
        .permissions()
        .mode();
    assert_eq!(mode & 0o777, 0o750);
    assert_eq!(
        fs::read_link(dst.join("sub/link")).expect("link"),
        Path::new("../a.txt")
    );
}

/// A tar with one regular file whose raw name is `name` (bypassing the
/// `tar` crate's own path checks).
fn tar_with_raw_name(name: &[u8], body: &[u8]) -> Vec<u8> {
    let mut header = tar::Header::new_gnu();
    header.set_size(body.len() as u64);
    header.set_mode(0o644);
    header.set_entry_type(tar::EntryType::Regular);
    header.as_old_mut().name[..name.len()].copy_from_slice(name);
    header.set_cksum();
    let mut b = tar::Builder::new(Vec::new());
    b.append(&header, body).expect("append");
    b.into_inner().expect("finish")
}

#[test]
fn tar_upload_parent_escape_refused() {
    let agent = Agent::start();
    let dst = agent.dir.path().join("in");
    let archive = tar_with_raw_name(b"../escape.txt", b"pwned");
    let err = agent
        .client()
        .upload_tar(&dst.display().to_string(), &mut archive.as_slice())
        .expect_err("escape");
    assert_eq!(
        err.agent_error().map(|e| e.kind),
        Some(ErrorKind::InvalidRequest)
    );
    assert!(!agent.dir.path().join("escape.txt").exists());
}

#[test]
fn tar_upload_absolute_path_refused() {
    let agent = Agent::start();
    let target = agent.path("abs-escape.txt");
    let archive = tar_with_raw_name(target.as_bytes(), b"pwned");
    let err = agent
        .client()
        .upload_tar(&agent.path("in"), &mut archive.as_slice())
        .expect_err("absolute");
    assert!(matches!(err, ClientError::Agent(_)), "{err:?}");
    assert!(!Path::new(&target).exists());
}

#[test]
fn tar_upload_through_symlink_refused() {
    let agent = Agent::start();
    let outside = agent.dir.path().join("outside");
    fs::create_dir(&outside).expect("mkdir");
    let mut b = tar::Builder::new(Vec::new());
    let mut link = tar::Header::new_gnu();
    link.set_entry_type(tar::EntryType::Symlink);
    link.set_size(0);
    b.append_link(&mut link, "link", &outside)
        .expect("symlink entry");
    let mut file = tar::Header::new_gnu();
    file.set_size(5);
    file.set_mode(0o644);
    b.append_data(&mut file, "link/pwned", &b"pwned"[..])
        .expect("file entry");
    let archive = b.into_inner().expect("finish");
    let err = agent
        .client()
        .upload_tar(&agent.path("in"), &mut archive.as_slice())
        .expect_err("symlink trick");
    assert_eq!(
        err.agent_error().map(|e| e.kind),
        Some(ErrorKind::InvalidRequest)
    );
    assert!(!outside.join("pwned").exists());
}

#[test]
fn shutdown_serve_mode_exits_agent() {
    let mut agent = Agent::start();
    agent.client().shutdown().expect("shutdown");
    let status = agent.child.wait().expect("wait");
    assert!(status.success());
}

/// Starts `script` on a raw connection and returns the connection once
/// the command has printed its first line.
fn start_exec_raw(agent: &Agent, script: &str) -> UnixStream {
    let mut s = UnixStream::connect(&agent.sock).expect("connect");
    read_frame(&mut s, MAX_FRAME_LEN)
        .expect("hello")
        .expect("hello");
    let req = Request::Exec {
        exec: ExecRequest::shell(script),
        stdin: false,
    };
    write_frame(&mut s, FrameKind::Control, &encode_control(&req)).expect("request");
    let frame = read_frame(&mut s, MAX_FRAME_LEN)
        .expect("read")
        .expect("first line");
    assert_eq!(frame.kind, FrameKind::Stdout);
    s
}

#[test]
fn after_fork_serve_mode_skips_clock_and_rng() {
    let agent = Agent::start();
    let host_ns = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("clock")
        .as_nanos() as u64;
    // A time far in the past: were it applied, the host's clock would jump.
    let report = agent
        .client()
        .after_fork(host_ns - 3_600_000_000_000, vec![7; 64])
        .expect("after_fork");
    assert!(!report.clock.is_done(), "{report:?}");
    assert!(!report.rng.is_done(), "{report:?}");
    assert!(
        report.clock_offset_ns > 3_500_000_000_000,
        "offset {}",
        report.clock_offset_ns
    );
    assert!(report.interrupted.is_empty() && report.still_running.is_empty());
}

/// A seeded fork's seed is in every later command's environment; a fork
/// without one takes it away.
#[test]
fn after_fork_seed_reaches_commands_environment() {
    let agent = Agent::start();
    let client = agent.client();
    let seed_of = |client: &AgentClient| {
        let out = run(
            client,
            &ExecRequest::shell("echo \"${FORKBOX_SEED-none}\""),
            None,
        );
        String::from_utf8_lossy(&out.stdout).trim().to_owned()
    };
    assert_eq!(seed_of(&client), "none");
    client
        .after_fork_seeded(0, vec![7; 64], Some(1234))
        .expect("after_fork");
    assert_eq!(seed_of(&client), "1234");
    client.after_fork(0, vec![7; 64]).expect("after_fork");
    assert_eq!(seed_of(&client), "none");
}

#[test]
fn after_fork_short_entropy_is_refused() {
    let agent = Agent::start();
    let err = agent
        .client()
        .after_fork(0, vec![1; 63])
        .expect_err("63 bytes accepted");
    assert_eq!(
        err.agent_error().map(|e| e.kind),
        Some(ErrorKind::InvalidRequest),
        "{err}"
    );
}

#[test]
fn after_fork_reports_exec_whose_connection_was_reset_once() {
    let agent = Agent::start();
    let s = start_exec_raw(&agent, "echo started; sleep 1000");
    // What a fork child sees: the connection the exec belonged to is gone.
    drop(s);
    let report = agent
        .client()
        .after_fork(0, vec![7; 64])
        .expect("after_fork");
    assert_eq!(report.interrupted.len(), 1, "{report:?}");
    let e = &report.interrupted[0];
    assert_eq!(
        e.command,
        forkbox_proto::Command::Shell("echo started; sleep 1000".into())
    );
    assert_eq!(e.status, Some(ExitStatus::Signal(9)), "{report:?}");
    assert!(wait_gone(e.pid), "exec {} survived", e.pid);
    let again = agent
        .client()
        .after_fork(0, vec![7; 64])
        .expect("after_fork");
    assert!(again.interrupted.is_empty(), "reported twice: {again:?}");
}

#[test]
fn after_fork_lists_exec_with_live_connection_as_running() {
    let agent = Agent::start();
    let mut s = start_exec_raw(&agent, "echo started; sleep 2; echo done");
    let report = agent
        .client()
        .after_fork(0, vec![7; 64])
        .expect("after_fork");
    assert!(report.interrupted.is_empty(), "{report:?}");
    assert_eq!(report.still_running.len(), 1, "{report:?}");
    assert_eq!(report.still_running[0].status, None);
    // It goes on and answers its client.
    let mut got_done = false;
    loop {
        let f = read_frame(&mut s, MAX_FRAME_LEN)
            .expect("read")
            .expect("frame");
        match f.kind {
            FrameKind::Stdout => got_done |= f.body.starts_with(b"done"),
            FrameKind::Control => {
                let resp: Response = decode_control(&f.body).expect("response");
                assert!(
                    matches!(resp, Response::Exec { ref result } if result.success()),
                    "{resp:?}"
                );
                break;
            }
            other => panic!("unexpected {other:?}"),
        }
    }
    assert!(got_done);
}

// ---------------------------------------------------------------- ports

#[test]
fn port_relay_echoes_bytes_both_ways() {
    let agent = Agent::start();
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let port = listener.local_addr().expect("addr").port();
    let server = thread::spawn(move || {
        let (mut s, _) = listener.accept().expect("accept");
        let mut buf = [0u8; 5];
        s.read_exact(&mut buf).expect("read");
        s.write_all(&buf).expect("write");
        s.write_all(b" world").expect("write");
    });
    let mut stream = agent.client().connect_port(port).expect("connect_port");
    stream.write_all(b"hello").expect("write");
    let mut got = Vec::new();
    stream.read_to_end(&mut got).expect("read");
    assert_eq!(got, b"hello world");
    server.join().expect("server");
}

#[test]
fn port_refused_is_connection_refused_error() {
    let agent = Agent::start();
    let port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        l.local_addr().expect("addr").port()
    };
    let err = agent.client().connect_port(port).expect_err("refused");
    let a = err.agent_error().expect("agent error");
    assert_eq!(a.kind, ErrorKind::ConnectionRefused);
    assert!(
        a.message.contains(&format!("guest port {port}")),
        "{}",
        a.message
    );
}

// ---------------------------------------------------------------- background

fn attach_all(
    client: &AgentClient,
    pid: u32,
    follow: bool,
) -> (Vec<u8>, Option<forkbox_proto::ExecResult>) {
    let mut out = Vec::new();
    let (dropped, result) = client
        .attach_process(pid, follow, &mut |_, b| out.extend_from_slice(b))
        .expect("attach");
    assert_eq!(dropped, 0);
    (out, result)
}

#[test]
fn background_stdin_wait_and_reattach() {
    let agent = Agent::start();
    let client = agent.client();
    let pid = client
        .spawn(&ExecRequest::shell(
            "echo start; read line; echo got:$line; exit 4",
        ))
        .expect("spawn");
    let sent = client
        .process_stdin(pid, true, &mut &b"abc\n"[..])
        .expect("stdin");
    assert_eq!(sent, 4);
    let result = client
        .wait_process(pid, Some(Duration::from_secs(20)))
        .expect("wait")
        .expect("ended");
    assert_eq!(result.status, ExitStatus::Code(4));
    let (out, result) = attach_all(&client, pid, false);
    assert_eq!(out, b"start\ngot:abc\n");
    assert_eq!(result.map(|r| r.status), Some(ExitStatus::Code(4)));
    let listed = client.processes().expect("list");
    assert!(listed
        .iter()
        .any(|p| p.pid == pid && p.background && p.result.is_some()));
}

#[test]
fn background_wait_times_out_then_kill_ends_it() {
    let agent = Agent::start();
    let client = agent.client();
    let pid = client
        .spawn(&ExecRequest::shell("sleep 30"))
        .expect("spawn");
    let waited = client
        .wait_process(pid, Some(Duration::from_millis(100)))
        .expect("wait");
    assert!(waited.is_none());
    assert!(client
        .processes()
        .expect("list")
        .iter()
        .any(|p| p.pid == pid && p.result.is_none()));
    client.kill_process(pid, 15).expect("kill");
    let result = client
        .wait_process(pid, Some(Duration::from_secs(20)))
        .expect("wait")
        .expect("ended");
    assert_eq!(result.status, ExitStatus::Signal(15));
    assert!(wait_gone(pid));
    let err = client.kill_process(pid, 9).expect_err("not running");
    assert_eq!(err.agent_error().map(|a| a.kind), Some(ErrorKind::NotFound));
}

#[test]
fn background_attach_follow_streams_until_exit() {
    let agent = Agent::start();
    let client = agent.client();
    let pid = client
        .spawn(&ExecRequest::shell(
            "for i in 1 2 3; do echo $i; sleep 0.1; done; echo e >&2",
        ))
        .expect("spawn");
    let (out, result) = attach_all(&client, pid, true);
    assert_eq!(out, b"1\n2\n3\ne\n");
    assert_eq!(result.map(|r| r.status), Some(ExitStatus::Code(0)));
}

#[test]
fn background_survives_the_connection_that_started_it() {
    let agent = Agent::start();
    let client = agent.client();
    let pid = client
        .spawn(&ExecRequest::shell("sleep 0.3; echo late"))
        .expect("spawn");
    // The spawning connection is gone; the process runs on.
    let result = client
        .wait_process(pid, Some(Duration::from_secs(20)))
        .expect("wait")
        .expect("ended");
    assert!(result.success());
    assert_eq!(attach_all(&client, pid, false).0, b"late\n");
}

#[test]
fn background_unknown_pid_is_not_found() {
    let agent = Agent::start();
    let err = agent
        .client()
        .wait_process(999_999, None)
        .expect_err("unknown");
    assert_eq!(err.agent_error().map(|a| a.kind), Some(ErrorKind::NotFound));
}

#[test]
fn files_read_over_max_bytes_refused_before_any_data() {
    let agent = Agent::start();
    let client = agent.client();
    let path = agent.path("big.bin");
    fs::write(&path, deterministic_bytes(1000)).expect("write");
    let mut got = Vec::new();
    let err = client
        .read_file_max(&path, Some(999), &mut got)
        .expect_err("over the limit");
    assert_eq!(err.agent_error().map(|e| e.kind), Some(ErrorKind::TooLarge));
    assert!(
        got.is_empty(),
        "{} bytes sent before the refusal",
        got.len()
    );
    // Exactly at the limit is fine.
    assert_eq!(
        client
            .read_file_max(&path, Some(1000), &mut got)
            .expect("at the limit"),
        1000
    );
}

#[test]
fn files_read_endless_device_stops_at_max_bytes() {
    let agent = Agent::start();
    let mut got = Vec::new();
    let err = agent
        .client()
        .read_file_max("/dev/zero", Some(3 << 20), &mut got)
        .expect_err("endless");
    // The agent stops itself; whatever it sent stays within the limit.
    assert_eq!(err.agent_error().map(|e| e.kind), Some(ErrorKind::TooLarge));
    assert_eq!(got.len(), 3 << 20, "up to the limit exactly");
}

#[test]
fn files_read_fifo_without_writer_reads_empty() {
    let agent = Agent::start();
    let path = agent.path("fifo");
    let made = Command::new("mkfifo").arg(&path).status().expect("mkfifo");
    assert!(made.success());
    let client = agent.client().with_call_timeout(Duration::from_secs(20));
    let mut got = Vec::new();
    assert_eq!(client.read_file(&path, &mut got).expect("read"), 0);
}

#[test]
fn files_read_fifo_that_never_ends_times_out_on_the_client() {
    let agent = Agent::start();
    let path = agent.path("fifo");
    let made = Command::new("mkfifo").arg(&path).status().expect("mkfifo");
    assert!(made.success());
    // A writer that holds the FIFO open and never writes.
    let _writer = fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(&path)
        .expect("open the fifo");
    let client = agent.client().with_call_timeout(Duration::from_millis(300));
    let err = client
        .read_file(&path, &mut Vec::new())
        .expect_err("never ends");
    assert!(matches!(err, ClientError::TimedOut { .. }), "{err:?}");
}

#[test]
fn tar_download_over_max_bytes_stops_with_too_large() {
    let agent = Agent::start();
    let client = agent.client();
    let src = agent.dir.path().join("src");
    make_tree(&src);
    let dir = src.display().to_string();
    let mut whole = Vec::new();
    let n = client.download_tar(&dir, &mut whole).expect("whole");
    let mut got = Vec::new();
    let err = client
        .download_tar_max(&dir, Some(n / 2), &mut got)
        .expect_err("over the limit");
    assert_eq!(err.agent_error().map(|e| e.kind), Some(ErrorKind::TooLarge));
    assert_eq!(got.len() as u64, n / 2, "up to the limit exactly");
    let mut again = Vec::new();
    assert_eq!(
        client
            .download_tar_max(&dir, Some(n), &mut again)
            .expect("at the limit"),
        n
    );
}

#[test]
fn exec_past_the_call_timeout_is_timed_out() {
    let agent = Agent::start();
    let client = agent.client().with_call_timeout(Duration::from_millis(300));
    let err = client
        .exec(&ExecRequest::shell("sleep 5"), None, &mut |_, _| {})
        .expect_err("deadline");
    assert!(matches!(err, ClientError::TimedOut { .. }), "{err:?}");
    // A call within its deadline is unaffected.
    let ok = agent
        .client()
        .with_call_timeout(Duration::from_secs(20))
        .exec(&ExecRequest::shell("true"), None, &mut |_, _| {})
        .expect("within");
    assert!(ok.success());
}

/// A timeout past what an `Instant` holds is no timeout, not a panic of
/// the exec's thread (which left the client without an answer).
#[test]
fn exec_with_an_overflowing_timeout_runs_as_without_one() {
    let agent = Agent::start();
    let client = agent.client().with_call_timeout(Duration::from_secs(20));
    let req = ExecRequest::shell("echo ok").timeout(Duration::MAX);
    let out = run(&client, &req, None);
    assert!(out.result.success(), "{:?}", out.result);
    assert_eq!(out.stdout, b"ok\n");
    let waited = client
        .wait_process(
            client.spawn(&ExecRequest::shell("true")).expect("spawn"),
            Some(Duration::MAX),
        )
        .expect("wait");
    assert!(waited.is_some_and(|r| r.success()));
}
