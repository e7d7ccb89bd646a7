//! Writes the hand-made seeds of every target into `fuzz/corpus/<target>/`
//! (`cargo run --example seeds` in fuzz/): valid inputs that reach each
//! parser's main paths, from which fuzzing starts. Files that fuzzing
//! found sit beside them.

use std::path::Path;
use std::time::Duration;

use forkbox_proto::frame::encode_frame;
use forkbox_proto::{
    encode_control, BootInfo, ExecRequest, ExecResult, ExitStatus, FileKind, FileStat, FrameKind,
    Hello, Request, Response, StreamSummary, PROTOCOL_VERSION,
};
use simple_dns::{Name, Packet, Question, CLASS, TYPE};

fn put(target: &str, name: &str, data: &[u8]) {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../corpus")
        .join(target);
    std::fs::create_dir_all(&dir).expect("corpus directory");
    std::fs::write(dir.join(format!("seed-{name}")), data).expect("write a seed");
}

/// A guest memory image with `writes` at their addresses.
fn image(writes: &[(usize, &[u8])]) -> Vec<u8> {
    let end = writes.iter().map(|(a, d)| a + d.len()).max().unwrap_or(0);
    let mut m = vec![0u8; end];
    for (at, d) in writes {
        m[*at..at + d.len()].copy_from_slice(d);
    }
    m
}

fn desc(addr: u64, len: u32, flags: u16, next: u16) -> [u8; 16] {
    let mut d = [0u8; 16];
    d[0..8].copy_from_slice(&addr.to_le_bytes());
    d[8..12].copy_from_slice(&len.to_le_bytes());
    d[12..14].copy_from_slice(&flags.to_le_bytes());
    d[14..16].copy_from_slice(&next.to_le_bytes());
    d
}

fn table(descs: &[[u8; 16]]) -> Vec<u8> {
    descs.concat()
}

fn chains() {
    let with = |size: u16, flags: u8, head: u16, mem: Vec<u8>| {
        let mut v = size.wrapping_sub(1).to_le_bytes().to_vec();
        v.push(flags);
        v.extend_from_slice(&head.to_le_bytes());
        v.extend(mem);
        v
    };
    let t = table(&[desc(0x1000, 100, 1, 1), desc(0x2000, 50, 2, 0)]);
    put(
        "virtio_chain",
        "read-write",
        &with(16, 0, 0, image(&[(0, &t)])),
    );
    let t = table(&[desc(0x400, 48, 4, 0)]);
    let ind = table(&[
        desc(0x1000, 16, 1, 1),
        desc(0x1100, 16, 1, 2),
        desc(0x2000, 64, 2, 0),
    ]);
    put(
        "virtio_chain",
        "indirect",
        &with(16, 1, 0, image(&[(0, &t), (0x400, &ind)])),
    );
    let t = table(&[desc(0x1000, 16, 1, 1), desc(0x1000, 16, 1, 0)]);
    put("virtio_chain", "loop", &with(16, 0, 0, image(&[(0, &t)])));
    let t = table(&[desc(0x7f00, 0x200, 1, 1), desc(0xc000, 0x100, 2, 0)]);
    put(
        "virtio_chain",
        "edge-of-region",
        &with(8, 0, 0, image(&[(0, &t)])),
    );
}

fn blk() {
    // Ring::at(0, 16): table at 0, avail at 0x100, used at 0x128.
    let request = |kind: u32, sector: u64, data_len: u32| {
        let t = table(&[
            desc(0x1000, 16, 1, 1),
            desc(0x2000, data_len, if kind == 1 { 1 } else { 2 } | 1, 2),
            desc(0x3000, 1, 2, 0),
        ]);
        let mut hdr = [0u8; 16];
        hdr[0..4].copy_from_slice(&kind.to_le_bytes());
        hdr[8..16].copy_from_slice(&sector.to_le_bytes());
        let avail = [0u8, 0, 1, 0, 0, 0];
        let mut v = vec![0u8];
        v.extend(image(&[
            (0, &t),
            (0x100, &avail),
            (0x1000, &hdr),
            (0x3000, &[0xff]),
        ]));
        v
    };
    put("virtio_blk", "read", &request(0, 2, 1024));
    put("virtio_blk", "write", &request(1, 0, 512));
    put("virtio_blk", "flush", &request(4, 0, 0));
    put("virtio_blk", "get-id", &request(8, 0, 20));
    put("virtio_blk", "read-past-end", &request(0, 15, 1024));
}

fn mmio() {
    // Register operations: (op, offset[, value]); op bits 0-2 the kind
    // (0 read, 1 write, 2 kick, 3 save and restore, 4 device events),
    // bits 6-7 the width (2: four bytes).
    let read = |off: u16| [&[0x80u8][..], &off.to_le_bytes()].concat();
    let write =
        |off: u16, v: u32| [&[0x81u8][..], &off.to_le_bytes(), &v.to_le_bytes(), &[0; 4]].concat();
    let kick = [0x82u8, 0, 0, 0].to_vec();
    let fork = [0x83u8, 0, 0].to_vec();
    let events = [0x84u8, 0, 0].to_vec();
    // The driver's bring-up of a 16-entry queue as Ring::at(0, 16) lays it
    // out (table 0, avail 0x100, used 0x128): ACKNOWLEDGE, DRIVER,
    // VERSION_1 accepted, FEATURES_OK, the queue, DRIVER_OK.
    let init: Vec<u8> = [
        read(0x0),
        read(0x4),
        read(0x8),
        write(0x70, 1),
        write(0x70, 3),
        read(0x10),
        write(0x24, 1),
        write(0x20, 1),
        write(0x70, 0xb),
        write(0x30, 0),
        read(0x34),
        write(0x38, 16),
        write(0x80, 0),
        write(0x90, 0x100),
        write(0xa0, 0x128),
        write(0x44, 1),
        write(0x70, 0xf),
    ]
    .concat();
    // One read request waiting in the ring.
    let t = table(&[
        desc(0x200, 16, 1, 1),
        desc(0x300, 64, 3, 2),
        desc(0x3f0, 1, 2, 0),
    ]);
    let mem = image(&[(0, &t), (0x100, &[0, 0, 1, 0, 0, 0]), (0x3f0, &[0xff])]);
    let with_mem = |ops: &[Vec<u8>]| {
        let mut v = (mem.len() as u16).to_le_bytes().to_vec();
        v.extend(&mem);
        v.extend(ops.concat());
        v
    };
    put(
        "virtio_mmio",
        "driver-init-kick-fork",
        &with_mem(&[
            init.clone(),
            kick.clone(),
            fork.clone(),
            read(0x60),
            write(0x64, 1),
            events,
        ]),
    );
    put(
        "virtio_mmio",
        "fork-with-a-request-pending",
        &with_mem(&[init.clone(), fork.clone(), kick.clone()]),
    );
    put(
        "virtio_mmio",
        "reset-midway",
        &with_mem(&[init.clone(), kick.clone(), write(0x70, 0), fork, init, kick]),
    );
}

fn broker() {
    // A policy selector, then the datagram.
    let req = |policy: u8, json: &str| [&[policy][..], json.as_bytes()].concat();
    let seeds: [(&str, u8, &str); 8] = [
        (
            "host-port-allowed",
            2,
            r#"{"op":"connect","id":1,"name":"host.forkbox.internal","address":"10.0.2.2","port":8080}"#,
        ),
        (
            "host-port-denied",
            2,
            r#"{"op":"connect","id":2,"address":"10.0.2.2","port":22}"#,
        ),
        (
            "name-rule-public",
            2,
            r#"{"op":"connect","id":3,"name":"a.example.org","address":"93.184.216.34","port":443}"#,
        ),
        (
            "star-private",
            1,
            r#"{"op":"connect","id":4,"name":"db.internal","address":"10.1.2.3","port":5432}"#,
        ),
        (
            "star-host-address",
            1,
            r#"{"op":"connect","id":5,"address":"198.51.100.7","port":80}"#,
        ),
        (
            "cidr-private",
            3,
            r#"{"op":"connect","id":6,"address":"10.1.200.1","port":22}"#,
        ),
        (
            "deny-all",
            0,
            r#"{"op":"connect","id":7,"address":"203.0.113.9","port":443}"#,
        ),
        (
            "resolve",
            1,
            r#"{"op":"resolve","id":8,"name":"example.org"}"#,
        ),
    ];
    for (name, policy, json) in seeds {
        put("broker_requests", name, &req(policy, json));
    }
}

fn vsock_hdr(op: u16, len: u32, flags: u32) -> Vec<u8> {
    let mut h = Vec::new();
    h.extend_from_slice(&3u64.to_le_bytes());
    h.extend_from_slice(&2u64.to_le_bytes());
    h.extend_from_slice(&1024u32.to_le_bytes());
    h.extend_from_slice(&1024u32.to_le_bytes());
    h.extend_from_slice(&len.to_le_bytes());
    h.extend_from_slice(&1u16.to_le_bytes());
    h.extend_from_slice(&op.to_le_bytes());
    h.extend_from_slice(&flags.to_le_bytes());
    h.extend_from_slice(&65536u32.to_le_bytes());
    h.extend_from_slice(&0u32.to_le_bytes());
    h
}

fn vsock() {
    let packet = |op: u16, payload: &[u8], flags: u32, layout: u8| {
        let mut v = vec![1u8];
        v.extend(vsock_hdr(op, payload.len() as u32, flags));
        v.extend_from_slice(&(payload.len() as u16).to_le_bytes());
        v.push(layout);
        v.extend_from_slice(payload);
        v
    };
    let client_write = |bytes: &[u8]| {
        let mut v = vec![3u8];
        v.extend_from_slice(&(bytes.len() as u16).to_le_bytes());
        v.extend_from_slice(bytes);
        v
    };
    let mut s = vec![0u8, 3, 8];
    s.extend(packet(2, b"", 0, 0)); // RESPONSE
    s.extend(client_write(b"hello"));
    s.extend([0u8, 2]);
    s.extend(packet(5, b"world", 0, 1)); // RW
    s.push(4);
    s.extend(packet(6, b"", 0, 0)); // CREDIT_UPDATE
    s.extend(packet(7, b"", 0, 0)); // CREDIT_REQUEST
    s.extend([0u8, 4]);
    s.extend(packet(4, b"", 3, 0)); // SHUTDOWN both
    s.extend([0u8, 4, 4]);
    put("vsock_packets", "connection", &s);

    let mut s = vec![0u8, 3, 8];
    s.extend(packet(2, b"", 0, 0));
    s.extend(packet(5, &[0x5a; 3000], 0, 2));
    s.extend([5u8, 0, 8, 0, 2]);
    s.extend(packet(3, b"", 0, 0)); // RST
    s.extend([0u8, 2, 9]);
    put("vsock_packets", "half-close-and-reset", &s);

    let mut s = vec![0u8, 3, 8];
    s.extend(packet(1, b"", 0, 0)); // a guest-initiated REQUEST
    s.extend([7u8, 0, 0, 44]);
    s.extend(vsock_hdr(5, 0, 0));
    s.extend([2u8, 1, 0, 0, 0, 0, 44, 0, 0]);
    s.extend([6u8, 1, 0xff, 0xff, 0, 4]);
    put("vsock_packets", "raw-and-hostile-ring", &s);
}

const GUEST_MAC: [u8; 6] = [0x02, 0, 0, 0, 0, 0x0f];
const GATEWAY_MAC: [u8; 6] = [0x02, 0x46, 0x42, 0x00, 0x00, 0x02];

fn ipv4_frame(proto: u8, dst: [u8; 4], l4: &[u8]) -> Vec<u8> {
    let mut f = Vec::new();
    f.extend_from_slice(&GATEWAY_MAC);
    f.extend_from_slice(&GUEST_MAC);
    f.extend_from_slice(&[0x08, 0x00]);
    let total = (20 + l4.len()) as u16;
    f.extend_from_slice(&[0x45, 0]);
    f.extend_from_slice(&total.to_be_bytes());
    f.extend_from_slice(&[0, 1, 0x40, 0, 64, proto, 0, 0]);
    f.extend_from_slice(&[10, 0, 2, 15]);
    f.extend_from_slice(&dst);
    f.extend_from_slice(l4);
    forkbox_fuzz_targets::fix_checksums(&mut f);
    f
}

fn syn(dst: [u8; 4], port: u16) -> Vec<u8> {
    let mut t = Vec::new();
    t.extend_from_slice(&40000u16.to_be_bytes());
    t.extend_from_slice(&port.to_be_bytes());
    t.extend_from_slice(&1000u32.to_be_bytes());
    t.extend_from_slice(&0u32.to_be_bytes());
    t.extend_from_slice(&[0x50, 0x02, 0xff, 0xff, 0, 0, 0, 0]);
    ipv4_frame(6, dst, &t)
}

fn dns_query(id: u16, name: &str, qtype: TYPE) -> Vec<u8> {
    let mut p = Packet::new_query(id);
    p.set_flags(simple_dns::PacketFlag::RECURSION_DESIRED);
    p.questions.push(Question::new(
        Name::new_unchecked(name),
        qtype.into(),
        CLASS::IN.into(),
        false,
    ));
    p.build_bytes_vec().expect("a query builds")
}

fn udp_dns(query: &[u8]) -> Vec<u8> {
    let mut u = Vec::new();
    u.extend_from_slice(&40001u16.to_be_bytes());
    u.extend_from_slice(&53u16.to_be_bytes());
    u.extend_from_slice(&((8 + query.len()) as u16).to_be_bytes());
    u.extend_from_slice(&[0, 0]);
    u.extend_from_slice(query);
    ipv4_frame(17, [10, 0, 2, 2], &u)
}

fn arp_request() -> Vec<u8> {
    let mut f = Vec::new();
    f.extend_from_slice(&[0xff; 6]);
    f.extend_from_slice(&GUEST_MAC);
    f.extend_from_slice(&[0x08, 0x06, 0, 1, 0x08, 0, 6, 4, 0, 1]);
    f.extend_from_slice(&GUEST_MAC);
    f.extend_from_slice(&[10, 0, 2, 15]);
    f.extend_from_slice(&[0; 6]);
    f.extend_from_slice(&[10, 0, 2, 2]);
    f
}

fn gateway() {
    let frame_op = |f: &[u8]| {
        let mut v = vec![0u8];
        v.extend_from_slice(&(f.len() as u16).to_le_bytes());
        v.push(1);
        v.extend_from_slice(f);
        v
    };
    let tick = [1u8, 0xe8, 0x03];
    for (mode, name) in [(0u8, "echo"), (1, "defer"), (2, "refuse")] {
        let mut s = vec![mode];
        s.extend(frame_op(&arp_request()));
        s.extend(frame_op(&udp_dns(&dns_query(
            7,
            "www.example.com",
            TYPE::A,
        ))));
        s.push(3);
        s.extend(frame_op(&syn([93, 184, 216, 34], 80)));
        s.extend(frame_op(&syn([10, 0, 2, 2], 8080)));
        s.extend(frame_op(&syn([1, 1, 1, 1], 22)));
        s.extend([2u8, 0]);
        s.extend(tick);
        s.push(3);
        s.extend([4u8, 1]);
        s.extend(frame_op(&syn([93, 184, 216, 34], 25)));
        s.extend(tick);
        s.push(5);
        s.push(3);
        put("gateway_frames", name, &s);
    }
}

fn dns() {
    for (i, (name, qtype)) in [
        ("www.example.com", TYPE::A),
        ("www.example.com", TYPE::AAAA),
        ("host.forkbox.internal", TYPE::A),
        ("blocked.example.com", TYPE::A),
        ("many.example.com", TYPE::A),
        ("fail.example.com", TYPE::A),
        ("foo", TYPE::A),
    ]
    .into_iter()
    .enumerate()
    {
        let mut v = vec![(i % 2) as u8];
        v.extend(dns_query(i as u16, name, qtype));
        put("dns_query", &format!("{i}-{name}-{qtype:?}"), &v);
    }
}

fn exec_result() -> ExecResult {
    ExecResult {
        status: ExitStatus::Code(0),
        timed_out: false,
        duration: Duration::from_millis(12),
        stdout: StreamSummary {
            total_bytes: 3,
            truncated: false,
        },
        stderr: StreamSummary::default(),
    }
}

fn hello() -> Vec<u8> {
    let h = Hello {
        protocol_version: PROTOCOL_VERSION,
        agent_version: "0.1.0".into(),
        boot: BootInfo::default(),
    };
    let mut v = Vec::new();
    encode_frame(FrameKind::Control, &encode_control(&h), &mut v).expect("frame");
    v
}

fn control<T: serde::Serialize>(msg: &T) -> Vec<u8> {
    let mut v = Vec::new();
    encode_frame(FrameKind::Control, &encode_control(msg), &mut v).expect("frame");
    v
}

fn data(kind: FrameKind, body: &[u8]) -> Vec<u8> {
    let mut v = Vec::new();
    encode_frame(kind, body, &mut v).expect("frame");
    v
}

fn agent() {
    let exec = Request::Exec {
        exec: ExecRequest::shell("echo hi")
            .env("A", "1")
            .timeout(Duration::from_secs(3)),
        stdin: true,
    };
    let mut s = vec![2u8];
    s.extend(hello());
    s.extend(control(&exec));
    s.extend(data(FrameKind::Data, b"stdin"));
    s.extend(data(FrameKind::Eof, b""));
    s.extend(data(FrameKind::Stdout, b"hi\n"));
    s.extend(control(&Response::Exec {
        result: exec_result(),
    }));
    put("agent_frames", "exec", &s);
    let mut s = vec![5u8];
    s.extend(control(&Request::ReadFile {
        path: "/etc/hostname".into(),
        max_bytes: Some(10),
    }));
    s.extend(control(&Response::Done { bytes: 3 }));
    s.extend([9u8, 1, 0, 0, 0, 0]);
    put("agent_frames", "bad-kind", &s);

    let stat = FileStat {
        kind: FileKind::File,
        size: 3,
        mode: 0o644,
        mtime: 0,
        uid: 0,
        gid: 0,
    };
    let calls: Vec<(u8, Vec<Vec<u8>>)> = vec![
        (0, vec![control(&Response::Pong)]),
        (
            1,
            vec![
                data(FrameKind::Stdout, b"hi\n"),
                data(FrameKind::Stderr, b"!"),
                control(&Response::Exec {
                    result: exec_result(),
                }),
            ],
        ),
        (
            2,
            vec![
                data(FrameKind::Data, b"abc"),
                control(&Response::Done { bytes: 3 }),
            ],
        ),
        (
            2,
            vec![
                data(FrameKind::Data, &[7; 100]),
                control(&Response::Done { bytes: 100 }),
            ],
        ),
        (
            3,
            vec![
                control(&Response::Entries {
                    entries: vec![forkbox_proto::DirEntry {
                        name: "f".into(),
                        stat: stat.clone(),
                    }],
                }),
                control(&Response::Done { bytes: 0 }),
            ],
        ),
        (4, vec![control(&Response::Stat { stat })]),
        (
            5,
            vec![
                data(FrameKind::Data, &[0; 512]),
                control(&Response::Done { bytes: 512 }),
            ],
        ),
        (
            6,
            vec![
                control(&Response::Ready),
                control(&Response::Done { bytes: 16 }),
            ],
        ),
        (7, vec![control(&Response::Spawned { pid: 42 })]),
        (8, vec![control(&Response::Processes { processes: vec![] })]),
        (
            9,
            vec![control(&Response::Waited {
                result: Some(exec_result()),
            })],
        ),
        (
            10,
            vec![
                data(FrameKind::Stdout, b"x"),
                control(&Response::Attached {
                    dropped: 0,
                    result: None,
                }),
            ],
        ),
    ];
    for (i, (call, frames)) in calls.into_iter().enumerate() {
        let mut s = vec![call];
        s.extend_from_slice(&64u16.to_le_bytes());
        s.extend(hello());
        for f in frames {
            s.extend(f);
        }
        put("agent_client", &format!("{i}-call-{call}"), &s);
    }
}

fn policy() {
    for (i, rule) in [
        "pypi.example.org",
        "pypi.example.org:443",
        "*.debian.org",
        "10.1.0.0/16",
        "10.1.2.3",
        "2001:db8::/32",
        "[2001:db8::/32]:443",
        "*:443",
        "name.example:8000-8999",
        "name.example:*",
        "host.forkbox.internal:8080",
        "Bücher.Example.",
        "::ffff:10.1.2.3",
    ]
    .into_iter()
    .enumerate()
    {
        let mut v = vec![0u8];
        v.extend([
            10, 1, 2, 3, 0x20, 0x01, 0x0d, 0xb8, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 0xbb, 1, 0, 0,
        ]);
        v.extend_from_slice(rule.as_bytes());
        put("policy_rules", &format!("rule-{i}"), &v);
    }
    for (i, json) in [
        r#"{"allow_out": ["*.debian.org:80", "10.0.0.0/8"], "deny_out": ["evil.debian.org"]}"#,
        r#"{"allow_out": ["*"]}"#,
        r#"{"deny_out": ["*"], "allow_out": ["host.forkbox.internal:8080"]}"#,
        r#"{"allow_out": ["x:99999"]}"#,
    ]
    .into_iter()
    .enumerate()
    {
        let mut v = vec![1u8];
        v.extend([
            127, 0, 0, 1, 0xfe, 0x80, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 80, 0, 0, 0,
        ]);
        v.extend_from_slice(json.as_bytes());
        put("policy_rules", &format!("policy-{i}"), &v);
    }
}

fn template() {
    for (i, json) in [
        r#"{"name":"py","image":"debian","setup":["apt-get install -y python3"],"ready":{"file":"/tmp"}}"#,
        r#"{"name":"web","image":"minimal","vcpus":2,"memory_mib":1024,"ready":{"tcp_port":8000},"ready_timeout_secs":30,"envs":{"A":"1"}}"#,
        r#"{"name":"net","image":"minimal","network":{"allow_out":["mirror.local:80"]},"ready":{"http_url":"http://127.0.0.1/it's"}}"#,
        r#"{"name":"../x","image":"ubuntu","vcpus":0,"memory_mib":1}"#,
        r#"{"name":"cmd","image":"debian","ready":{"command":"test -e /ok"},"setup":[]}"#,
    ]
    .into_iter()
    .enumerate()
    {
        put("template_spec", &format!("{i}"), json.as_bytes());
    }
}

fn net() {
    // Ring::at(0, 16) for rx (table 0, avail 0x100, used 0x128) and
    // Ring::at(0x200, 16) for tx (table 0x200, avail 0x300, used 0x328).
    let with = |ops: &[u8], frames: &[u16], mem: Vec<u8>| {
        let mut v = vec![ops.len() as u8];
        v.extend_from_slice(ops);
        v.push(frames.len() as u8);
        for f in frames {
            v.extend_from_slice(&f.to_le_bytes());
        }
        v.extend(mem);
        v
    };
    // Two rx buffers (a header's descriptor, then a page, as Linux posts
    // them) and one tx frame (its header, then a 60-byte frame).
    let rx = table(&[
        desc(0x1000, 12, 2 | 1, 1),
        desc(0x2000, 4096, 2, 0),
        desc(0x3000, 12 + 1514, 2, 0),
    ]);
    let tx = table(&[desc(0x4000, 12, 1, 1), desc(0x5000, 60, 0, 0)]);
    let rx_avail = [0u8, 0, 2, 0, 0, 0, 2, 0];
    let tx_avail = [0u8, 0, 1, 0, 0, 0];
    let mem = image(&[
        (0, &rx),
        (0x100, &rx_avail),
        (0x200, &tx),
        (0x300, &tx_avail),
        (0x5000, &[0xab; 60]),
    ]);
    put(
        "virtio_net",
        "rx-tx",
        &with(&[2, 1, 0], &[60, 1514], mem.clone()),
    );
    put(
        "virtio_net",
        "fork-midway",
        &with(&[2, 3, 1, 2, 0], &[60, 4000, 100], mem.clone()),
    );
    put(
        "virtio_net",
        "reset-midway",
        &with(&[1, 4, 2, 0], &[100, 100], mem.clone()),
    );
    put(
        "virtio_net",
        "rx-too-small",
        &with(&[2], &[4096, 4096, 4096], mem),
    );
}

fn template_file() {
    for (i, toml) in [
        "image = \"debian\"\nsetup = [\"apt-get install -y python3\"]\nready = { file = \"/tmp\" }\n",
        "image = \"minimal\"\nvcpus = 2\nmemory_mib = 1024\nready = { tcp_port = 8000 }\nready_timeout_secs = 30\n[envs]\nA = \"1\"\n",
        "name = \"fuzz\"\nimage = \"minimal\"\nprotect = [\"/task/tests\"]\n[network]\nallow_out = [\"mirror.local:80\"]\n",
        "image = \"debian\"\n[network]\nallow_out = [\"not a rule\"]\n",
        "image = \"debian\"\n[ready]\ncommand = \"test -e /ok\"\n",
    ]
    .into_iter()
    .enumerate()
    {
        put("template_file", &format!("{i}"), toml.as_bytes());
    }
}

/// One tar member with its name and link written as given (`tar`'s
/// builder refuses the hostile ones), then its data padded.
fn member(name: &str, kind: tar::EntryType, link: &str, mode: u32, data: &[u8]) -> Vec<u8> {
    let mut h = tar::Header::new_old();
    let old = h.as_old_mut();
    old.name[..name.len()].copy_from_slice(name.as_bytes());
    old.linkname[..link.len()].copy_from_slice(link.as_bytes());
    h.set_entry_type(kind);
    h.set_mode(mode);
    h.set_size(data.len() as u64);
    h.set_cksum();
    let mut out = h.as_bytes().to_vec();
    out.extend_from_slice(data);
    out.resize(out.len().div_ceil(512) * 512, 0);
    out
}

fn tar_unpack() {
    use tar::EntryType as T;
    let archives: [(&str, Vec<Vec<u8>>); 7] = [
        (
            "ordinary",
            vec![
                member("d/", T::Directory, "", 0o755, b""),
                member("d/f", T::Regular, "", 0o644, b"hello"),
                member("d/l", T::Symlink, "f", 0o777, b""),
                member("d/h", T::Link, "d/f", 0o644, b""),
            ],
        ),
        (
            "dotdot",
            vec![member("../escape", T::Regular, "", 0o644, b"x")],
        ),
        (
            "absolute",
            vec![member("/tmp/forkbox-fuzz-abs", T::Regular, "", 0o644, b"x")],
        ),
        (
            "through-a-link",
            vec![
                member("l", T::Symlink, "../outside", 0o777, b""),
                member("l/x", T::Regular, "", 0o644, b"x"),
            ],
        ),
        (
            "setuid",
            vec![member("s", T::Regular, "", 0o4755, b"#!/bin/sh\n")],
        ),
        ("device", vec![member("null", T::Char, "", 0o666, b"")]),
        (
            "link-up-then-down",
            vec![
                member("a/", T::Directory, "", 0o755, b""),
                member("a/up", T::Symlink, "..", 0o777, b""),
                member("a/up/b", T::Regular, "", 0o644, b"x"),
            ],
        ),
    ];
    for (name, members) in archives {
        let mut tar = members.concat();
        tar.extend_from_slice(&[0u8; 1024]);
        put("tar_unpack", name, &tar);
    }
}

fn main() {
    chains();
    blk();
    mmio();
    broker();
    vsock();
    gateway();
    dns();
    agent();
    policy();
    template();
    template_file();
    net();
    tar_unpack();
}
