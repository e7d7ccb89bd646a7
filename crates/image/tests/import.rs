//! Importing images built here (an OCI layout and a `docker save` archive
//! of the same layers) into a store, then reading the erofs layers back
//! through the host's kernel: each mounted, then stacked by overlayfs as
//! the guest stacks them. Needs root (unpacking keeps owners and makes
//! device nodes; mounting), as `make test` runs; without it these fail,
//! saying so.

use std::fs;
use std::os::unix::fs::{FileTypeExt, MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::Command;

use forkbox_image::store::StoreError;
use forkbox_image::{import, Digest, ImportError, Store};

mod common;
use common::*;

/// An OCI layout at `dir` holding `layers` (tar, compressed blob) as one
/// image tagged `tag`.
fn oci_layout(dir: &Path, layers: &[(Vec<u8>, Vec<u8>)], tag: &str) -> Digest {
    let blobs = dir.join("blobs/sha256");
    fs::create_dir_all(&blobs).expect("blobs");
    let put = |bytes: &[u8]| {
        let d = Digest::of(bytes);
        fs::write(blobs.join(d.hex()), bytes).expect("blob");
        d
    };
    let diff_ids: Vec<Digest> = layers.iter().map(|(tar, _)| Digest::of(tar)).collect();
    let cfg = config(&diff_ids);
    let cfg_digest = put(&cfg);
    let layer_descs: Vec<serde_json::Value> = layers
        .iter()
        .map(|(_, blob)| {
            serde_json::json!({
                "mediaType": "application/vnd.oci.image.layer.v1.tar+gzip",
                "digest": put(blob).to_string(),
                "size": blob.len(),
            })
        })
        .collect();
    let manifest = serde_json::to_vec(&serde_json::json!({
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {"mediaType": "application/vnd.oci.image.config.v1+json", "digest": cfg_digest.to_string(), "size": cfg.len()},
        "layers": layer_descs,
    }))
    .expect("manifest");
    let m = put(&manifest);
    let index = serde_json::json!({
        "schemaVersion": 2,
        "manifests": [{
            "mediaType": "application/vnd.oci.image.manifest.v1+json",
            "digest": m.to_string(),
            "size": manifest.len(),
            "annotations": {"org.opencontainers.image.ref.name": tag}
        }]
    });
    fs::write(
        dir.join("index.json"),
        serde_json::to_vec(&index).expect("index"),
    )
    .expect("index");
    fs::write(dir.join("oci-layout"), br#"{"imageLayoutVersion":"1.0.0"}"#).expect("layout");
    cfg_digest
}

/// A mount, undone when dropped.
struct Mounted(PathBuf);

impl Mounted {
    fn new(args: &[&str], at: &Path) -> Self {
        fs::create_dir_all(at).expect("mount point");
        let out = Command::new("mount")
            .args(args)
            .arg(at)
            .output()
            .expect("run mount");
        assert!(
            out.status.success(),
            "mount {args:?}: {} (these tests need root)",
            String::from_utf8_lossy(&out.stderr)
        );
        Mounted(at.to_owned())
    }
}

impl Drop for Mounted {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg(&self.0).status();
    }
}

fn xattr(path: &Path, name: &str) -> Option<Vec<u8>> {
    let mut buf = vec![0u8; 256];
    let n = rustix::fs::lgetxattr(path, name, &mut buf).ok()?;
    buf.truncate(n);
    Some(buf)
}

#[test]
fn import_oci_layout_unpacks_layers_that_overlayfs_stacks_as_the_image() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let store = Store::open(&tmp.path().join("store")).expect("store");
    let (base, top) = (base_layer(), top_layer());
    let layout = tmp.path().join("layout");
    let id = oci_layout(
        &layout,
        &[(base.clone(), gzip(&base)), (top.clone(), gzip(&top))],
        "v1",
    );
    let mut events = 0;
    let imported =
        import(&store, &layout, Some("local/task:v1"), &mut |_| events += 1).expect("import");
    assert_eq!(imported.image.id, id);
    assert_eq!((imported.unpacked, events), (2, 4));
    assert_eq!(imported.names, vec!["local/task:v1".to_owned()]);
    let image = store.resolve("local/task:v1").expect("by name");
    assert_eq!(image, imported.image);
    assert_eq!(image.config.user.as_deref(), Some("1000:1000"));
    assert_eq!(image.config.working_dir.as_deref(), Some("/home/user"));
    assert_eq!(image.config.env, ["PATH=/usr/bin:/bin", "LANG=C.UTF-8"]);
    assert_eq!(image.config.cmd, ["/bin/sh"]);
    assert_eq!(image.layers[0].diff_id, Digest::of(&base));
    assert!(image.manifest.is_some_and(|m| store.blob_path(&m).exists()));

    // Each layer as the kernel reads it.
    let lower = store.layer_path(&image.layers[0].diff_id);
    let upper = store.layer_path(&image.layers[1].diff_id);
    let b = Mounted::new(
        &[
            "-t",
            "erofs",
            "-o",
            "ro,loop",
            lower.to_str().expect("utf-8"),
        ],
        &tmp.path().join("b"),
    );
    let t = Mounted::new(
        &[
            "-t",
            "erofs",
            "-o",
            "ro,loop",
            upper.to_str().expect("utf-8"),
        ],
        &tmp.path().join("t"),
    );
    let tool = fs::metadata(b.0.join("usr/bin/tool")).expect("tool");
    assert_eq!(tool.mode() & 0o7777, 0o4755, "setuid kept");
    assert_eq!(
        fs::metadata(b.0.join("usr/bin/tool2"))
            .expect("tool2")
            .ino(),
        tool.ino()
    );
    assert_eq!(tool.mtime(), 1_700_000_000);
    let home = fs::metadata(b.0.join("home/user")).expect("home");
    assert_eq!(
        (home.uid(), home.gid(), home.mode() & 0o7777),
        (1000, 1000, 0o700)
    );
    assert_eq!(
        fs::metadata(b.0.join("tmp")).expect("tmp").mode() & 0o7777,
        0o1777
    );
    assert_eq!(
        fs::read_link(b.0.join("bin")).expect("bin"),
        Path::new("usr/bin")
    );
    assert_eq!(
        fs::read_link(b.0.join("abs")).expect("abs"),
        Path::new("/etc/passwd")
    );
    assert!(fs::symlink_metadata(b.0.join("run-fifo"))
        .expect("fifo")
        .file_type()
        .is_fifo());
    let null = fs::symlink_metadata(b.0.join("null")).expect("null");
    assert!(null.file_type().is_char_device() && null.rdev() == rustix::fs::makedev(1, 3));
    assert_eq!(
        xattr(&b.0.join("usr/bin/ping"), "security.capability").map(|v| v.len()),
        Some(20)
    );
    assert!(b.0.join("etc/sneaky").exists());
    assert_eq!(
        xattr(&b.0.join("etc/sneaky"), "trusted.overlay.opaque"),
        None
    );
    let gone = fs::symlink_metadata(t.0.join("etc/passwd")).expect("whiteout");
    assert!(gone.file_type().is_char_device() && gone.rdev() == 0);
    assert_eq!(
        xattr(&t.0.join("tmp"), "trusted.overlay.opaque").as_deref(),
        Some(&b"y"[..])
    );

    // Stacked, as the guest does.
    let options = format!("ro,lowerdir={}:{}", t.0.display(), b.0.display());
    let merged = Mounted::new(
        &["-t", "overlay", "overlay", "-o", &options],
        &tmp.path().join("m"),
    );
    let m = &merged.0;
    assert!(!m.join("etc/passwd").exists(), "the whiteout hides it");
    assert_eq!(
        fs::read_to_string(m.join("etc/motd")).expect("motd"),
        "top\n"
    );
    assert_eq!(
        fs::read_to_string(m.join("etc/added")).expect("added"),
        "added\n"
    );
    assert!(!m.join("tmp/old").exists(), "the opaque directory hides it");
    assert_eq!(fs::read_to_string(m.join("tmp/new")).expect("new"), "new\n");
    assert_eq!(
        fs::read_to_string(m.join("bin/tool")).expect("through bin"),
        "#!/bin/sh\n"
    );
    assert_eq!(
        fs::read_to_string(m.join("home/user/notes")).expect("notes"),
        "mine\n"
    );

    // The same layers merged into one tree (a writable disk's files) are
    // what overlayfs shows, entry for entry.
    let (work, tree) = (tmp.path().join("work"), tmp.path().join("tree"));
    fs::create_dir(&work).expect("work");
    fs::create_dir(&tree).expect("tree");
    let layers: Vec<(PathBuf, Digest)> = image
        .layers
        .iter()
        .map(|l| (store.blob_path(&l.blob), l.diff_id.clone()))
        .collect();
    forkbox_image::layer::unpack_merged(&layers, &work, &tree).expect("merged");
    assert_eq!(listing(&tree), listing(m));
    assert!(!tree.join("etc/passwd").exists() && !tree.join("tmp/old").exists());
    assert_eq!(xattr(&tree.join("tmp"), "trusted.overlay.opaque"), None);
    assert_eq!(
        fs::metadata(tree.join("usr/bin/tool")).expect("tool").ino(),
        fs::metadata(tree.join("usr/bin/tool2"))
            .expect("tool2")
            .ino(),
        "hard links kept"
    );
    assert_eq!(
        fs::read_dir(&work).expect("work").count(),
        0,
        "nothing left"
    );
}

/// Every entry under `root`: its path, kind, owner, mode, size, and its
/// bytes or link target.
fn listing(root: &Path) -> Vec<String> {
    let mut out = Vec::new();
    let mut stack = vec![root.to_path_buf()];
    while let Some(dir) = stack.pop() {
        for entry in fs::read_dir(&dir).expect("read_dir") {
            let path = entry.expect("entry").path();
            let meta = fs::symlink_metadata(&path).expect("meta");
            let rel = path
                .strip_prefix(root)
                .expect("inside")
                .display()
                .to_string();
            let what = if meta.is_dir() {
                stack.push(path.clone());
                "dir".to_owned()
            } else if meta.file_type().is_symlink() {
                format!("-> {}", fs::read_link(&path).expect("link").display())
            } else if meta.is_file() {
                format!("{:?}", fs::read(&path).expect("file"))
            } else {
                format!("special {:x}", meta.rdev())
            };
            out.push(format!(
                "{rel} {}:{} {:o} {what}",
                meta.uid(),
                meta.gid(),
                meta.mode()
            ));
        }
    }
    out.sort();
    out
}

#[test]
fn import_shared_base_is_stored_and_unpacked_once_whatever_the_format() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let store = Store::open(&tmp.path().join("store")).expect("store");
    let base = base_layer();
    let top_a = top_layer();
    let top_b = layer(&[E::File("etc/b", 0o644, 0, b"b\n")]);
    let layout = tmp.path().join("a");
    oci_layout(
        &layout,
        &[(base.clone(), gzip(&base)), (top_a.clone(), gzip(&top_a))],
        "a",
    );
    let a = import(&store, &layout, Some("a:1"), &mut |_| {}).expect("a");
    assert_eq!(a.unpacked, 2);
    // The same image again: nothing unpacked, nothing new stored.
    let again = import(&store, &layout, Some("a:2"), &mut |_| {}).expect("a again");
    assert_eq!((again.unpacked, &again.image), (0, &a.image));
    // Another image on the same base, from a `docker save` archive (its
    // layers uncompressed): only its own layer is unpacked.
    let archive = tmp.path().join("b.tar");
    let b_id = docker_archive(&archive, &[base.clone(), top_b.clone()], "b:1");
    let b = import(&store, &archive, None, &mut |_| {}).expect("b");
    assert_eq!((b.image.id.clone(), b.unpacked), (b_id, 1));
    assert_eq!(b.names, vec!["b:1".to_owned()]);
    assert_eq!(b.image.layers[0].diff_id, a.image.layers[0].diff_id);
    assert_eq!(
        fs::read_dir(store.root().join("layers"))
            .expect("layers")
            .count(),
        3
    );
    store.pin("template t", &a.image.id).expect("pin");
    // a:2 still names it: only the name goes, pinned or not.
    assert_eq!(store.remove("a:1").expect("a:1"), a.image.id);
    assert!(matches!(store.remove("a:2"), Err(StoreError::InUse { .. })));
    store.remove("b:1").expect("remove b");
    let collected = store.gc().expect("gc");
    // b's own layer went, and its three blobs (configuration and two
    // uncompressed layers: a stores the base gzip'd); the base layer stays.
    assert_eq!((collected.layers, collected.blobs), (1, 3));
    assert!(store.layer_path(&a.image.layers[0].diff_id).exists());
    assert!(store.resolve("a:2").is_ok());
}

/// What a bad input leaves: an error that says what, and no image, name,
/// layer or work file in the store.
fn refused(store: &Store, path: &Path) -> String {
    let err = import(store, path, Some("bad:1"), &mut |_| {}).expect_err("refused");
    assert!(store.resolve("bad:1").is_err());
    assert_eq!(store.ids().expect("ids"), Vec::<Digest>::new());
    assert_eq!(
        fs::read_dir(store.root().join("layers"))
            .expect("layers")
            .count(),
        0
    );
    assert_eq!(
        fs::read_dir(store.root().join("tmp")).expect("tmp").count(),
        0
    );
    format!(
        "{:?} / {}",
        err,
        std::error::Error::source(&err)
            .map(|s| s.to_string())
            .unwrap_or_default()
    )
}

#[test]
fn import_bad_inputs_are_refused_and_leave_the_store_as_it_was() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let store = Store::open(&tmp.path().join("store")).expect("store");
    let base = base_layer();
    let mut n = 0;
    let mut case = |layers: &[(Vec<u8>, Vec<u8>)]| {
        n += 1;
        let dir = tmp.path().join(format!("case{n}"));
        oci_layout(&dir, layers, "t");
        dir
    };
    // A blob changed after its digest was taken.
    let dir = case(&[(base.clone(), gzip(&base))]);
    let blob = Digest::of(&gzip(&base));
    let path = dir.join("blobs/sha256").join(blob.hex());
    let mut bytes = fs::read(&path).expect("blob");
    let last = bytes.len() - 9;
    bytes[last] ^= 0xff;
    fs::write(&path, bytes).expect("corrupt");
    assert!(refused(&store, &dir).contains("DigestMismatch"));
    // A truncated layer.
    let dir = case(&[(base.clone(), gzip(&base)[..100].to_vec())]);
    let why = refused(&store, &dir);
    assert!(why.contains("Layer"), "{why}");
    // A layer whose content is not what the configuration names.
    let other = layer(&[E::File("x", 0o644, 0, b"x")]);
    let dir = case(&[(base.clone(), gzip(&other))]);
    assert!(refused(&store, &dir).contains("DiffIdMismatch"));
    for (name, kind, link) in [
        (&b"../escape"[..], tar::EntryType::Regular, ""),
        (b"/etc/abs", tar::EntryType::Regular, ""),
        (b"a/../../b", tar::EntryType::Directory, ""),
        (b"link", tar::EntryType::Link, "../../etc/shadow"),
        (b"link", tar::EntryType::Link, "/etc/shadow"),
        (b"link", tar::EntryType::Link, "etc/lower-only"),
    ] {
        let bad = layer(&[E::Raw(name, kind, link)]);
        let dir = case(&[(bad.clone(), gzip(&bad))]);
        let why = refused(&store, &dir);
        assert!(why.contains("BadEntry"), "{name:?} {link}: {why}");
    }
    // Writing through a symbolic link the layer made.
    let bad = layer(&[
        E::Symlink("etc", "/etc"),
        E::File("etc/owned", 0o644, 0, b"x"),
    ]);
    let dir = case(&[(bad.clone(), gzip(&bad))]);
    assert!(refused(&store, &dir).contains("symbolic link"));
    assert!(!Path::new("/etc/owned").exists());
    // Not an image at all.
    let empty = tmp.path().join("empty");
    fs::create_dir(&empty).expect("empty");
    assert!(matches!(
        import(&store, &empty, None, &mut |_| {}),
        Err(ImportError::UnknownFormat(_))
    ));
}

#[test]
fn import_layer_tmp_is_world_unreadable_and_layers_readable() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let store = Store::open(&tmp.path().join("store")).expect("store");
    let base = base_layer();
    let layout = tmp.path().join("l");
    oci_layout(&layout, &[(base.clone(), gzip(&base))], "t");
    let image = import(&store, &layout, None, &mut |_| {})
        .expect("import")
        .image;
    let layer = fs::metadata(store.layer_path(&image.layers[0].diff_id)).expect("layer");
    assert_eq!(layer.permissions().mode() & 0o777, 0o644);
    let layers = fs::metadata(store.root().join("layers")).expect("layers dir");
    assert_eq!(layers.permissions().mode() & 0o777, 0o711);
    // Without a name, an OCI layout's bare tag names nothing.
    assert!(store.names().expect("names").is_empty());
}

/// Layers merged into one tree never reach outside it: a whiteout or an
/// opaque directory behind a symbolic link a lower layer made hides
/// nothing there, and an upper entry replaces the link, never writes
/// through it.
#[test]
fn merged_layers_never_follow_a_lower_layers_links_out() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let outside = tmp.path().join("outside");
    fs::create_dir(&outside).expect("outside");
    fs::write(outside.join("victim"), b"keep me\n").expect("victim");
    let target = outside.to_str().expect("utf-8");
    let lower = layer(&[E::Symlink("repo", target), E::Symlink("cache", target)]);
    let upper = layer(&[
        E::File("repo/.wh.victim", 0o644, 0, b""),
        E::Dir("cache", 0o755, 0),
        E::File("cache/.wh..wh..opq", 0o644, 0, b""),
        E::File("cache/new", 0o644, 0, b"new\n"),
    ]);
    let blobs = tmp.path().join("blobs");
    fs::create_dir(&blobs).expect("blobs");
    let layers: Vec<(PathBuf, Digest)> = [lower, upper]
        .iter()
        .enumerate()
        .map(|(i, tar)| {
            let path = blobs.join(i.to_string());
            fs::write(&path, gzip(tar)).expect("blob");
            (path, Digest::of(tar))
        })
        .collect();
    let (work, tree) = (tmp.path().join("work"), tmp.path().join("tree"));
    fs::create_dir(&work).expect("work");
    fs::create_dir(&tree).expect("tree");
    forkbox_image::layer::unpack_merged(&layers, &work, &tree).expect("merged");
    assert_eq!(
        fs::read(outside.join("victim")).expect("kept"),
        b"keep me\n"
    );
    assert_eq!(fs::read_dir(&outside).expect("outside").count(), 1);
    // The upper layer's `repo` (a directory: its whiteout is in one) is
    // what overlayfs shows too: empty, over the link.
    assert!(fs::symlink_metadata(tree.join("repo"))
        .expect("repo")
        .is_dir());
    assert_eq!(fs::read_dir(tree.join("repo")).expect("repo").count(), 0);
    assert!(fs::symlink_metadata(tree.join("cache"))
        .expect("cache")
        .is_dir());
    assert_eq!(fs::read(tree.join("cache/new")).expect("new"), b"new\n");
    // A bad digest: nothing merged past the check.
    let wrong = vec![(layers[1].0.clone(), Digest::of(b"other"))];
    let (w2, t2) = (tmp.path().join("w2"), tmp.path().join("t2"));
    fs::create_dir(&w2).expect("w2");
    fs::create_dir(&t2).expect("t2");
    let e = forkbox_image::layer::unpack_merged(&wrong, &w2, &t2).expect_err("refused");
    assert!(e.to_string().contains("not the"), "{e}");
    assert_eq!(fs::read_dir(&t2).expect("t2").count(), 0);
}
