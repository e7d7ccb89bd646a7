//! Trials of images from the store: an OCI image built here (busybox in
//! a base layer, a top layer with a whiteout, an opaque directory and a
//! setuid file), imported, booted as a layered root, and forked.

use std::path::{Path, PathBuf};

use forkbox_host::vm::{RootImage, VmSpec};
use forkbox_image::{Digest, Store};

use super::*;

/// The fixture's name in the store; a new version of [`fixture_layers`]
/// takes a new name.
const FIXTURE: &str = "forkbox-test/layered:v1";

/// The store the trials use: forkbox's own, under the cache (the emulated
/// host reads it, read-only, at the same path).
fn store() -> Result<Store, Failed> {
    Store::open(&forkbox_host::cache::root().join("store")).map_err(|e| format!("{e:#}").into())
}

/// The fixture's layer files, bottom first, imported first if the store
/// lacks it (out here, before the emulated host starts: importing needs
/// root and a writable store).
pub(crate) fn fixture_layers() -> Result<Vec<PathBuf>, Failed> {
    let store = store()?;
    let image = match store.resolve(FIXTURE) {
        Ok(image) => image,
        Err(_) => {
            let dir = tempfile::tempdir().map_err(|e| e.to_string())?;
            write_layout(dir.path())?;
            forkbox_image::import(&store, dir.path(), Some(FIXTURE), &mut |_| {})
                .map_err(|e| format!("importing the fixture: {e:?}"))?
                .image
        }
    };
    Ok(image
        .layers
        .iter()
        .map(|l| store.layer_path(&l.diff_id))
        .collect())
}

fn entry(
    b: &mut tar::Builder<Vec<u8>>,
    kind: tar::EntryType,
    path: &str,
    mode: u32,
    data: &[u8],
    link: &str,
) {
    let mut h = tar::Header::new_ustar();
    h.set_entry_type(kind);
    h.set_mode(mode);
    h.set_uid(0);
    h.set_gid(0);
    h.set_mtime(1_700_000_000);
    h.set_size(data.len() as u64);
    let r = if link.is_empty() {
        b.append_data(&mut h, path, data)
    } else {
        b.append_link(&mut h, path, link)
    };
    r.expect("a tar entry in memory");
}

fn base_layer() -> Result<Vec<u8>, Failed> {
    let busybox_dir =
        forkbox_host::debs::unpacked("busybox-static").map_err(|e| format!("{e:#}"))?;
    let busybox = std::fs::read(busybox_dir.join("bin/busybox")).map_err(|e| e.to_string())?;
    let mut b = tar::Builder::new(Vec::new());
    use tar::EntryType::{Directory as D, Regular as F, Symlink as L};
    for dir in ["bin", "etc", "srv", "usr/bin", "home/user", "root", "run"] {
        entry(&mut b, D, dir, 0o755, b"", "");
    }
    entry(&mut b, D, "tmp", 0o1777, b"", "");
    entry(&mut b, F, "bin/busybox", 0o755, &busybox, "");
    for applet in [
        "sh", "cat", "ls", "stat", "echo", "grep", "id", "true", "sleep",
    ] {
        entry(&mut b, L, &format!("bin/{applet}"), 0o777, b"", "busybox");
    }
    entry(
        &mut b,
        F,
        "etc/passwd",
        0o644,
        b"root:x:0:0:root:/root:/bin/sh\nuser:x:1000:1000:user:/home/user:/bin/sh\n",
        "",
    );
    entry(
        &mut b,
        F,
        "etc/group",
        0o644,
        b"root:x:0:\nuser:x:1000:\n",
        "",
    );
    entry(&mut b, F, "etc/motd", 0o644, b"base\n", "");
    entry(&mut b, F, "etc/old", 0o644, b"old\n", "");
    entry(&mut b, F, "srv/from-base", 0o644, b"x\n", "");
    entry(&mut b, F, "usr/bin/tool", 0o4755, b"#!/bin/sh\n", "");
    b.into_inner().map_err(|e| e.to_string().into())
}

fn top_layer() -> Result<Vec<u8>, Failed> {
    let mut b = tar::Builder::new(Vec::new());
    use tar::EntryType::{Directory as D, Regular as F};
    entry(&mut b, D, "etc", 0o755, b"", "");
    entry(&mut b, F, "etc/.wh.old", 0o644, b"", "");
    entry(&mut b, F, "etc/motd", 0o644, b"top\n", "");
    entry(&mut b, D, "srv", 0o755, b"", "");
    entry(&mut b, F, "srv/.wh..wh..opq", 0o644, b"", "");
    entry(&mut b, F, "srv/from-top", 0o644, b"y\n", "");
    b.into_inner().map_err(|e| e.to_string().into())
}

/// An OCI image layout of the two layers at `dir`.
fn write_layout(dir: &Path) -> TestResult {
    let blobs = dir.join("blobs/sha256");
    std::fs::create_dir_all(&blobs).map_err(|e| e.to_string())?;
    let put = |bytes: &[u8]| -> Result<Digest, Failed> {
        let d = Digest::of(bytes);
        std::fs::write(blobs.join(d.hex()), bytes).map_err(|e| e.to_string())?;
        Ok(d)
    };
    let layers = [base_layer()?, top_layer()?];
    let config = serde_json::json!({
        "architecture": "amd64", "os": "linux",
        "config": {"Env": ["PATH=/bin:/usr/bin"], "WorkingDir": "/home/user"},
        "rootfs": {"type": "layers", "diff_ids": layers.iter().map(|l| Digest::of(l).to_string()).collect::<Vec<_>>()},
    })
    .to_string();
    let config_digest = put(config.as_bytes())?;
    let mut descriptors = Vec::new();
    for l in &layers {
        let d = put(l)?;
        descriptors.push(serde_json::json!({"mediaType": "application/vnd.oci.image.layer.v1.tar", "digest": d.to_string(), "size": l.len()}));
    }
    let manifest = serde_json::json!({
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {"mediaType": "application/vnd.oci.image.config.v1+json", "digest": config_digest.to_string(), "size": config.len()},
        "layers": descriptors,
    })
    .to_string();
    let m = put(manifest.as_bytes())?;
    let index = serde_json::json!({"schemaVersion": 2, "manifests": [{
        "mediaType": "application/vnd.oci.image.manifest.v1+json", "digest": m.to_string(), "size": manifest.len()}]});
    std::fs::write(dir.join("index.json"), index.to_string()).map_err(|e| e.to_string())?;
    std::fs::write(dir.join("oci-layout"), r#"{"imageLayoutVersion":"1.0.0"}"#)
        .map_err(|e| e.to_string())?;
    Ok(())
}

/// A VM booted from an imported image sees its layers stacked as the
/// image says (the top layer's file over the base's, a whiteout's file
/// gone, an opaque directory's lower entries hidden, a setuid bit kept),
/// writes over them in its own upper layer, and its fork children see the
/// same root and write their own.
pub(crate) fn image_layered_root_boots_stacks_and_forks() -> TestResult {
    let layers = fixture_layers()?;
    check(
        layers.len() == 2,
        format!("the fixture has 2 layers, not {layers:?}"),
    )?;
    let mut vm = boot(VmSpec {
        image: RootImage::Layers(layers),
        ..VmSpec::default()
    });
    let agent = vm.agent().clone();
    let seen = sh(
        &agent,
        "cat /etc/motd; ls /etc/old 2>&1 || echo no-old; ls /srv; stat -c %a:%u /usr/bin/tool; \
         grep ' / ' /proc/mounts",
    )?;
    let lines: Vec<&str> = seen.lines().collect();
    check(
        lines.first() == Some(&"top") && seen.contains("no-old") && !seen.contains("from-base"),
        format!("the layers are not stacked as the image says: {seen}"),
    )?;
    check(
        seen.contains("from-top") && seen.contains("4755:0"),
        format!("a new file or the setuid bit is missing: {seen}"),
    )?;
    check(
        seen.contains("overlay / overlay") && seen.contains("lowerdir=/.lower/2:/.lower/1"),
        format!("the root is not the two layers under an overlay: {seen}"),
    )?;
    sh(&agent, "echo parent > /etc/motd")?;
    let mut children = fork(&mut vm, 2)?;
    for (i, child) in children.iter_mut().enumerate() {
        let a = child.agent().clone();
        let got = sh(
            &a,
            &format!("cat /etc/motd; echo child{i} > /etc/motd; cat /etc/motd; cat /srv/from-top"),
        )?;
        check(
            got == format!("parent\nchild{i}\ny\n"),
            format!("child {i} of a layered VM read {got:?}"),
        )?;
    }
    let after = sh(&agent, "cat /etc/motd")?;
    check(
        after == "parent\n",
        format!("a child's write reached the parent: {after:?}"),
    )
}
