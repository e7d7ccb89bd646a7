//! Test images built in memory: layers (tar, with whiteouts and the
//! entry kinds images have), their gzip, an image configuration.

#![allow(dead_code)]

use std::io::Write;

use forkbox_image::Digest;

/// One entry of a test layer.
pub enum E<'a> {
    Dir(&'a str, u32, u32),
    File(&'a str, u32, u32, &'a [u8]),
    Xattr(&'a str, &'a str, &'a [u8]),
    Symlink(&'a str, &'a str),
    Hardlink(&'a str, &'a str),
    Fifo(&'a str),
    Char(&'a str, u32, u32),
    /// A name written into the header as is, bypassing the tar crate's checks.
    Raw(&'a [u8], tar::EntryType, &'a str),
}

pub fn header(kind: tar::EntryType, mode: u32, uid: u64, size: u64) -> tar::Header {
    let mut h = tar::Header::new_ustar();
    h.set_entry_type(kind);
    h.set_mode(mode);
    h.set_uid(uid);
    h.set_gid(uid);
    h.set_size(size);
    h.set_mtime(1_700_000_000);
    h
}

pub fn layer(entries: &[E]) -> Vec<u8> {
    let mut b = tar::Builder::new(Vec::new());
    for e in entries {
        match *e {
            E::Dir(p, mode, uid) => {
                let mut h = header(tar::EntryType::Directory, mode, uid.into(), 0);
                b.append_data(&mut h, p, &[][..]).expect("dir");
            }
            E::File(p, mode, uid, data) => {
                let mut h = header(tar::EntryType::Regular, mode, uid.into(), data.len() as u64);
                b.append_data(&mut h, p, data).expect("file");
            }
            E::Xattr(p, name, value) => {
                let key = format!("SCHILY.xattr.{name}");
                b.append_pax_extensions([(key.as_str(), value)])
                    .expect("pax");
                let mut h = header(tar::EntryType::Regular, 0o644, 0, 1);
                b.append_data(&mut h, p, &b"x"[..]).expect("file");
            }
            E::Symlink(p, target) => {
                let mut h = header(tar::EntryType::Symlink, 0o777, 0, 0);
                b.append_link(&mut h, p, target).expect("symlink");
            }
            E::Hardlink(p, target) => {
                let mut h = header(tar::EntryType::Link, 0o644, 0, 0);
                b.append_link(&mut h, p, target).expect("hardlink");
            }
            E::Fifo(p) => {
                let mut h = header(tar::EntryType::Fifo, 0o644, 0, 0);
                b.append_data(&mut h, p, &[][..]).expect("fifo");
            }
            E::Char(p, major, minor) => {
                let mut h = header(tar::EntryType::Char, 0o666, 0, 0);
                h.set_device_major(major).expect("major");
                h.set_device_minor(minor).expect("minor");
                b.append_data(&mut h, p, &[][..]).expect("char");
            }
            E::Raw(name, kind, link) => {
                let mut h = header(kind, 0o644, 0, 0);
                h.as_old_mut().name[..name.len()].copy_from_slice(name);
                if !link.is_empty() {
                    h.as_old_mut().linkname[..link.len()].copy_from_slice(link.as_bytes());
                }
                h.set_cksum();
                b.append(&h, &[][..]).expect("raw");
            }
        }
    }
    b.into_inner().expect("tar")
}

pub fn gzip(data: &[u8]) -> Vec<u8> {
    let mut e = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
    e.write_all(data).expect("gzip");
    e.finish().expect("gzip")
}

pub fn base_layer() -> Vec<u8> {
    layer(&[
        E::Dir("etc", 0o755, 0),
        E::File("etc/passwd", 0o644, 0, b"root:x:0:0::/root:/bin/sh\n"),
        E::File("etc/motd", 0o644, 0, b"base\n"),
        E::Dir("tmp", 0o1777, 0),
        E::File("tmp/old", 0o644, 0, b"old\n"),
        E::Dir("usr/bin", 0o755, 0),
        E::File("usr/bin/tool", 0o4755, 0, b"#!/bin/sh\n"),
        E::Hardlink("usr/bin/tool2", "usr/bin/tool"),
        E::Symlink("bin", "usr/bin"),
        E::Symlink("abs", "/etc/passwd"),
        E::Dir("home/user", 0o700, 1000),
        E::File("home/user/notes", 0o600, 1000, b"mine\n"),
        E::Xattr(
            "usr/bin/ping",
            "security.capability",
            &[
                1, 0, 0, 2, 0, 0x20, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
            ],
        ),
        // overlayfs's own attribute: dropped, never in the layer.
        E::Xattr("etc/sneaky", "trusted.overlay.opaque", b"y"),
        E::Fifo("run-fifo"),
        E::Char("null", 1, 3),
    ])
}

pub fn top_layer() -> Vec<u8> {
    layer(&[
        E::File("etc/.wh.passwd", 0o644, 0, b""),
        E::Dir("tmp", 0o1777, 0),
        E::File("tmp/.wh..wh..opq", 0o644, 0, b""),
        E::File("tmp/new", 0o644, 0, b"new\n"),
        E::File("etc/motd", 0o644, 0, b"top\n"),
        E::File("etc/added", 0o640, 0, b"added\n"),
    ])
}

pub fn config(diff_ids: &[Digest]) -> Vec<u8> {
    serde_json::to_vec(&serde_json::json!({
        "architecture": "amd64",
        "os": "linux",
        "created": "2026-12-06T00:00:00Z",
        "config": {
            "Env": ["PATH=/usr/bin:/bin", "LANG=C.UTF-8"],
            "WorkingDir": "/home/user",
            "User": "1000:1000",
            "Cmd": ["/bin/sh"]
        },
        "rootfs": {"type": "layers", "diff_ids": diff_ids.iter().map(|d| d.to_string()).collect::<Vec<_>>()}
    }))
    .expect("config json")
}

/// A `docker save` archive of the older kind: uncompressed layers.
pub fn docker_archive(path: &std::path::Path, layers: &[Vec<u8>], tag: &str) -> Digest {
    let diff_ids: Vec<Digest> = layers.iter().map(|t| Digest::of(t)).collect();
    let cfg = config(&diff_ids);
    let id = Digest::of(&cfg);
    let mut b = tar::Builder::new(Vec::new());
    let mut add = |name: &str, data: &[u8]| {
        let mut h = header(tar::EntryType::Regular, 0o644, 0, data.len() as u64);
        b.append_data(&mut h, name, data).expect("entry");
    };
    add(&format!("{}.json", id.hex()), &cfg);
    let mut names = Vec::new();
    for (i, l) in layers.iter().enumerate() {
        let name = format!("layer{i}/layer.tar");
        add(&name, l);
        names.push(name);
    }
    let manifest = serde_json::json!([{"Config": format!("{}.json", id.hex()), "RepoTags": [tag], "Layers": names}]);
    add(
        "manifest.json",
        &serde_json::to_vec(&manifest).expect("manifest"),
    );
    std::fs::write(path, b.into_inner().expect("tar")).expect("archive");
    id
}
