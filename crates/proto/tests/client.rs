//! The client against scripted fake agents and fake VMM sockets.

use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::PathBuf;
use std::thread;
use std::time::Duration;

use forkbox_proto::frame::{encode_header, read_frame, write_frame};
use forkbox_proto::{
    encode_control, AgentClient, BootInfo, ClientError, FrameKind, Hello, Response, MAX_FRAME_LEN,
    PROTOCOL_VERSION,
};

fn socket_path(name: &str) -> (tempfile::TempDir, PathBuf) {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join(name);
    (dir, path)
}

fn hello(version: u32) -> Hello {
    Hello {
        protocol_version: version,
        agent_version: "test".into(),
        boot: BootInfo::default(),
    }
}

/// Serves `n` connections with `script`.
fn fake_agent(
    listener: UnixListener,
    n: usize,
    script: impl Fn(UnixStream) + Send + 'static,
) -> thread::JoinHandle<()> {
    thread::spawn(move || {
        for _ in 0..n {
            let (s, _) = listener.accept().expect("accept");
            script(s);
        }
    })
}

fn answer_ping(mut s: UnixStream) {
    write_frame(
        &mut s,
        FrameKind::Control,
        &encode_control(&hello(PROTOCOL_VERSION)),
    )
    .expect("hello");
    let req = read_frame(&mut s, MAX_FRAME_LEN)
        .expect("read")
        .expect("request");
    assert_eq!(req.kind, FrameKind::Control);
    write_frame(&mut s, FrameKind::Control, &encode_control(&Response::Pong)).expect("pong");
}

#[test]
fn wait_ready_version_mismatch_fails_fast() {
    let (_dir, path) = socket_path("a.sock");
    let listener = UnixListener::bind(&path).expect("bind");
    let server = fake_agent(listener, 1, |mut s| {
        let _ = write_frame(&mut s, FrameKind::Control, &encode_control(&hello(999)));
    });
    let err = AgentClient::unix(&path)
        .wait_ready(Duration::from_secs(30))
        .expect_err("mismatch");
    assert!(
        matches!(err, ClientError::VersionMismatch { client, agent: 999 } if client == PROTOCOL_VERSION),
        "{err:?}"
    );
    server.join().expect("server");
}

#[test]
fn client_oversized_frame_rejected() {
    let (_dir, path) = socket_path("a.sock");
    let listener = UnixListener::bind(&path).expect("bind");
    let server = fake_agent(listener, 1, |mut s| {
        let _ = write_frame(
            &mut s,
            FrameKind::Control,
            &encode_control(&hello(PROTOCOL_VERSION)),
        );
        let _ = read_frame(&mut s, MAX_FRAME_LEN);
        // Claims a 4 GiB body: the client must refuse without allocating.
        let _ = s.write_all(&encode_header(FrameKind::Stdout, u32::MAX));
    });
    let err = AgentClient::unix(&path).ping().expect_err("oversized");
    assert!(matches!(err, ClientError::Frame(_)), "{err:?}");
    server.join().expect("server");
}

#[test]
fn client_agent_dies_mid_call_reports_disconnect() {
    let (_dir, path) = socket_path("a.sock");
    let listener = UnixListener::bind(&path).expect("bind");
    let server = fake_agent(listener, 1, |mut s| {
        let _ = write_frame(
            &mut s,
            FrameKind::Control,
            &encode_control(&hello(PROTOCOL_VERSION)),
        );
        let _ = read_frame(&mut s, MAX_FRAME_LEN);
        let _ = write_frame(&mut s, FrameKind::Data, b"partial");
        // Dropped: the "agent" crashed.
    });
    let err = AgentClient::unix(&path)
        .read_file("/x", &mut Vec::new())
        .expect_err("dropped");
    assert!(matches!(err, ClientError::Disconnected(_)), "{err:?}");
    assert!(err.to_string().contains("the sandbox died"));
    server.join().expect("server");
}

#[test]
fn client_nothing_listening_reports_connect_error() {
    let (_dir, path) = socket_path("missing.sock");
    let err = AgentClient::unix(&path).ping().expect_err("no socket");
    assert!(matches!(err, ClientError::Connect { .. }), "{err:?}");
}

#[test]
fn hybrid_vsock_connect_ok_then_frames() {
    let (_dir, path) = socket_path("vsock.sock");
    let listener = UnixListener::bind(&path).expect("bind");
    let server = fake_agent(listener, 1, |s| {
        let mut line = String::new();
        let mut r = BufReader::new(s.try_clone().expect("clone"));
        r.read_line(&mut line).expect("line");
        assert_eq!(line, "CONNECT 1024\n");
        (&s).write_all(b"OK 1073741824\n").expect("ok");
        answer_ping(s);
    });
    let hello = AgentClient::hybrid_vsock(&path, 1024)
        .ping()
        .expect("ping through the fake VMM");
    assert_eq!(hello.protocol_version, PROTOCOL_VERSION);
    server.join().expect("server");
}

#[test]
fn hybrid_vsock_refused_is_not_ready_then_wait_ready_retries() {
    let (_dir, path) = socket_path("vsock.sock");
    let listener = UnixListener::bind(&path).expect("bind");
    // First two connections: the guest is not listening (VMM closes).
    // Third: the agent answers.
    let server = thread::spawn(move || {
        for i in 0..3 {
            let (s, _) = listener.accept().expect("accept");
            let mut r = BufReader::new(s.try_clone().expect("clone"));
            let mut line = String::new();
            r.read_line(&mut line).expect("line");
            if i < 2 {
                continue;
            }
            (&s).write_all(b"OK 5\n").expect("ok");
            answer_ping(s);
        }
    });
    let client = AgentClient::hybrid_vsock(&path, 1024);
    let first = client.ping().expect_err("not yet");
    assert!(matches!(first, ClientError::NotReady { .. }), "{first:?}");
    client
        .wait_ready(Duration::from_secs(30))
        .expect("ready on a later attempt");
    server.join().expect("server");
}
