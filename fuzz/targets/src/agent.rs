//! The agent protocol: frames and control messages, both ways.
//!
//! [`agent_frames`] (sans-IO). Input: a byte choosing how the stream is
//! cut into reads, then the stream. What must hold: the incremental
//! [`Decoder`] and the blocking [`read_frame`] find the same frames;
//! re-encoding them gives back the bytes they came from; a control body
//! that decodes as the agent's `Request` (what the agent parses) or as a
//! `Response` or `Hello` (what the client parses) re-encodes to JSON that
//! decodes to the same message.
//!
//! [`agent_client`]: the host's [`AgentClient`] against a hostile agent on
//! a real unix socket. Input: a byte choosing the call (exec, read file,
//! list, stat, tar download, spawn, wait, attach, ...), then everything the
//! "agent" sends. What must hold: the call ends (the agent's end of the
//! stream ends it at the latest), and a bounded read never hands its
//! caller more than its bound.

use std::io::{Read, Write};
use std::net::Shutdown;
use std::os::unix::net::UnixListener;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use forkbox_proto::frame::{encode_frame, read_frame, Decoder, Frame, FrameError};
use forkbox_proto::{
    decode_control, encode_control, AgentClient, ExecRequest, FrameKind, Hello, Request, Response,
    MAX_FRAME_LEN,
};

use crate::input::Input;

pub fn agent_frames(data: &[u8]) {
    let mut input = Input::new(data);
    let cut = usize::from(input.u8()) % 61 + 1;
    // A small limit too, so that oversized frames occur.
    let max_len = if cut % 2 == 0 { MAX_FRAME_LEN } else { 64 };
    let stream = input.rest();

    let mut dec = Decoder::new(max_len);
    let mut from_decoder: Vec<Frame> = Vec::new();
    let mut poisoned = false;
    'feed: for chunk in stream.chunks(cut) {
        dec.push(chunk);
        loop {
            match dec.next_frame() {
                Ok(Some(f)) => from_decoder.push(f),
                Ok(None) => break,
                Err(_) => {
                    poisoned = true;
                    break 'feed;
                }
            }
        }
    }
    if !poisoned {
        assert!(
            dec.buffered() < 5 + max_len as usize,
            "{} bytes buffered",
            dec.buffered()
        );
    }

    let mut reader = stream;
    let mut from_reader: Vec<Frame> = Vec::new();
    let reader_error = loop {
        match read_frame(&mut reader, max_len) {
            Ok(Some(f)) => from_reader.push(f),
            Ok(None) => break None,
            Err(e) => break Some(e),
        }
    };
    assert_eq!(from_decoder, from_reader);
    // A bad header poisons both; a stream cut inside a frame is an
    // unfinished frame for one and an unexpected EOF for the other.
    assert_eq!(
        poisoned,
        matches!(
            reader_error,
            Some(FrameError::UnknownKind(_) | FrameError::Oversized { .. })
        )
    );

    let mut encoded = Vec::new();
    for f in &from_decoder {
        assert!(f.body.len() <= max_len as usize);
        encode_frame(f.kind, &f.body, &mut encoded).expect("a decoded frame encodes");
    }
    assert_eq!(encoded, stream[..encoded.len()], "re-encoded frames differ");

    for f in from_decoder.iter().filter(|f| f.kind == FrameKind::Control) {
        roundtrip::<Request>(&f.body);
        roundtrip::<Response>(&f.body);
        roundtrip::<Hello>(&f.body);
    }
}

fn roundtrip<T>(body: &[u8])
where
    T: serde::Serialize + serde::de::DeserializeOwned + PartialEq + std::fmt::Debug,
{
    let Ok(msg) = decode_control::<T>(body) else {
        return;
    };
    let again = encode_control(&msg);
    let back: T = decode_control(&again).unwrap_or_else(|e| {
        panic!(
            "{} does not decode back: {e}",
            String::from_utf8_lossy(&again)
        )
    });
    assert_eq!(back, msg);
}

static NEXT_SOCKET: AtomicU64 = AtomicU64::new(0);

pub fn agent_client(data: &[u8]) {
    crate::input::no_sigpipe();
    let mut input = Input::new(data);
    let call = input.u8();
    let limit = u64::from(input.u16());
    let agent_sends = input.rest();

    let path = std::env::temp_dir().join(format!(
        "forkbox-fuzz-agent-{}-{}.sock",
        std::process::id(),
        NEXT_SOCKET.fetch_add(1, Ordering::Relaxed)
    ));
    let _ = std::fs::remove_file(&path);
    let listener = UnixListener::bind(&path).expect("bind the fake agent's socket");
    // A deadline only so that a hang shows as an error, not a stuck run.
    let client = AgentClient::unix(&path).with_call_timeout(Duration::from_secs(20));
    std::thread::scope(|s| {
        let agent = s.spawn(move || {
            let Ok((mut conn, _)) = listener.accept() else {
                return;
            };
            // The client writes its request first and may stop reading at
            // any point: both sides are bounded by the input's size.
            let _ = conn.write_all(agent_sends);
            let _ = conn.shutdown(Shutdown::Write);
            let mut sink = [0u8; 4096];
            while matches!(conn.read(&mut sink), Ok(n) if n > 0) {}
        });
        run_call(&client, call, limit);
        agent.join().expect("the fake agent thread");
    });
    let _ = std::fs::remove_file(&path);
}

/// Bytes written, for calls with a bound.
#[derive(Default)]
struct Counter(u64);

impl Write for Counter {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        self.0 += b.len() as u64;
        Ok(b.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

fn run_call(client: &AgentClient, call: u8, limit: u64) {
    let exec = ExecRequest::shell("echo hi");
    let mut out = Counter::default();
    match call % 12 {
        0 => {
            let _ = client.ping();
        }
        1 => {
            let _ = client.exec(&exec, None, &mut |_, _| {});
        }
        2 => {
            let r = client.read_file_max("/f", Some(limit), &mut out);
            assert!(
                out.0 <= limit,
                "{} bytes read past a bound of {limit}",
                out.0
            );
            if let Ok(n) = r {
                assert_eq!(n, out.0);
            }
        }
        3 => {
            let _ = client.list_dir("/");
        }
        4 => {
            let _ = client.stat("/f");
        }
        5 => {
            let r = client.download_tar_max("/", Some(limit), &mut out);
            assert!(
                out.0 <= limit,
                "{} bytes of tar past a bound of {limit}",
                out.0
            );
            if let Ok(n) = r {
                assert_eq!(n, out.0);
            }
        }
        6 => {
            let _ = client.write_file("/f", 0o644, &mut &b"sixteen bytes..."[..]);
        }
        7 => {
            let _ = client.spawn(&exec);
        }
        8 => {
            let _ = client.processes();
        }
        9 => {
            let _ = client.wait_process(1, Some(Duration::from_secs(1)));
        }
        10 => {
            let _ = client.attach_process(1, true, &mut |_, _| {});
        }
        _ => {
            let _ = client.after_fork(1_700_000_000_000_000_000, vec![7; 64]);
        }
    }
}
