//! The content-addressed store, one directory:
//!
//! ```text
//! blobs/sha256/<hex>      manifests, configurations and layer blobs, as
//!                         received, each checked against its digest
//! layers/<diff_id>.erofs  each layer unpacked once, keyed by the digest of
//!                         its uncompressed tar (the same layer compressed
//!                         two ways is still one file)
//! images/<id>.json        an image: its layers (bottom first) and run
//!                         configuration; its id is its configuration's digest
//! refs/<name>             a name (`registry/repo:tag`) → an image id
//! pins/<holder>           an image something outside the store needs (a
//!                         daemon's template): never removed while pinned
//! tmp/                    work in progress, renamed into place when done
//! lock                    shared by writers, exclusive for removal
//! ```
//!
//! Everything lands by rename, so a crash or a bad input mid-import leaves
//! only `tmp/` debris (cleared by [`Store::gc`]) and never a half file
//! under a digest.

use std::collections::{BTreeMap, HashSet};
use std::fs::{self, File};
use std::io::{self, Read, Write};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

use rustix::fs::FlockOperation;

use crate::digest::{Digest, HashingWriter};
use crate::layer::{self, LayerError, Unpacked};

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("the image store at {path}")]
    Io {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("blob {expected} arrived as {found} ({bytes} bytes): corrupt or substituted")]
    DigestMismatch {
        expected: Digest,
        found: Digest,
        bytes: u64,
    },
    #[error("blob {digest} is {found} bytes, not the {expected} its descriptor says")]
    SizeMismatch {
        digest: Digest,
        expected: u64,
        found: u64,
    },
    #[error("blob {digest} is larger than the {limit} bytes allowed for it")]
    TooLarge { digest: Digest, limit: u64 },
    #[error("layer {diff_id}")]
    Layer {
        diff_id: Digest,
        #[source]
        source: LayerError,
    },
    #[error("no image `{0}` in the store (see `forkbox image ls`)")]
    NoImage(String),
    #[error("`{name}` could be any of {count} images: give more of its id")]
    Ambiguous { name: String, count: usize },
    #[error("image {id} is in use by {by}: remove that first")]
    InUse { id: Digest, by: String },
    #[error("image record {path} is unreadable (remove it, then import the image again)")]
    BadRecord {
        path: PathBuf,
        #[source]
        source: serde_json::Error,
    },
    #[error("`{0}` is not an image name (a letter or digit, then letters, digits and `._-/:@`, no `..`; at most 255 characters)")]
    BadName(String),
}

/// An image in the store.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Image {
    /// The digest of its configuration: the same image has the same id
    /// whichever way (registry, archive) it arrived.
    pub id: Digest,
    /// Bottom first.
    pub layers: Vec<LayerRef>,
    pub config: RunConfig,
    /// The manifest it arrived with, when it had one (kept as a blob).
    pub manifest: Option<Digest>,
    /// When the image says it was made (RFC 3339), if it says.
    pub created: Option<String>,
}

impl Image {
    /// Bytes of its layers' erofs files.
    pub fn layer_bytes(&self, store: &Store) -> u64 {
        self.layers
            .iter()
            .filter_map(|l| fs::metadata(store.layer_path(&l.diff_id)).ok())
            .map(|m| m.len())
            .sum()
    }
}

/// One layer of an image.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct LayerRef {
    /// The blob as received (compressed).
    pub blob: Digest,
    /// The digest of the uncompressed tar: the erofs file's key.
    pub diff_id: Digest,
    pub media_type: String,
    /// Bytes of the blob.
    pub size: u64,
}

/// What an image's configuration says about running it.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct RunConfig {
    /// `NAME=value` pairs.
    pub env: Vec<String>,
    pub working_dir: Option<String>,
    /// `user`, `uid`, `user:group` or `uid:gid`.
    pub user: Option<String>,
    pub entrypoint: Vec<String>,
    pub cmd: Vec<String>,
}

/// What [`Store::gc`] removed.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Collected {
    pub images: usize,
    pub blobs: usize,
    pub layers: usize,
    pub bytes: u64,
}

/// The store at one directory.
#[derive(Debug, Clone)]
pub struct Store {
    root: PathBuf,
}

/// A lock on the store: shared while adding, exclusive while removing.
#[derive(Debug)]
pub struct StoreLock {
    _file: File,
}

impl Store {
    /// Opens (making it, owner-only, where missing) the store at `root`.
    pub fn open(root: &Path) -> Result<Self, StoreError> {
        let store = Self {
            root: root.to_owned(),
        };
        for dir in ["blobs/sha256", "layers", "images", "refs", "pins", "tmp"] {
            let path = root.join(dir);
            fs::create_dir_all(&path).map_err(io_err(&path))?;
        }
        // Layer files are read by the VMMs' users: the store's own
        // directories may be crossed, not listed. (Set only when they are
        // not so: a store on a read-only mount, as the emulated host sees
        // this machine's, opens to be read.)
        for dir in ["", "layers"] {
            let path = root.join(dir);
            let mode = fs::metadata(&path)
                .map_err(io_err(&path))?
                .permissions()
                .mode();
            if mode & 0o7777 != 0o711 {
                fs::set_permissions(&path, fs::Permissions::from_mode(0o711))
                    .map_err(io_err(&path))?;
            }
        }
        Ok(store)
    }

    pub fn root(&self) -> &Path {
        &self.root
    }

    pub fn lock(&self, op: FlockOperation) -> Result<StoreLock, StoreError> {
        let path = self.root.join("lock");
        let file = File::options()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&path)
            .map_err(io_err(&path))?;
        rustix::fs::flock(&file, op).map_err(|e| io_err(&path)(e.into()))?;
        Ok(StoreLock { _file: file })
    }

    pub fn blob_path(&self, digest: &Digest) -> PathBuf {
        self.root.join("blobs/sha256").join(digest.hex())
    }

    pub fn layer_path(&self, diff_id: &Digest) -> PathBuf {
        self.root
            .join("layers")
            .join(format!("{}.erofs", diff_id.hex()))
    }

    fn image_path(&self, id: &Digest) -> PathBuf {
        self.root.join("images").join(format!("{}.json", id.hex()))
    }

    /// A fresh directory under `tmp/`, removed when dropped.
    pub fn work_dir(&self) -> Result<tempfile::TempDir, StoreError> {
        let tmp = self.root.join("tmp");
        tempfile::Builder::new()
            .prefix("work-")
            .tempdir_in(&tmp)
            .map_err(io_err(&tmp))
    }

    /// Stores what `from` yields as the blob `digest`, unless the store
    /// has it. `size`, when known, must match, and nothing past `limit`
    /// bytes is read. Returns whether it was stored now.
    pub fn put_blob(
        &self,
        digest: &Digest,
        size: Option<u64>,
        limit: u64,
        from: impl Read,
    ) -> Result<bool, StoreError> {
        let path = self.blob_path(digest);
        if path.exists() {
            return Ok(false);
        }
        let tmp = self.root.join("tmp");
        let staged = tempfile::NamedTempFile::new_in(&tmp).map_err(io_err(&tmp))?;
        let mut writer = HashingWriter::new(io::BufWriter::new(staged));
        let copied = io::copy(&mut from.take(limit.saturating_add(1)), &mut writer);
        copied.map_err(io_err(&path))?;
        let (buffered, found, bytes) = writer.finish();
        if bytes > limit {
            return Err(StoreError::TooLarge {
                digest: digest.clone(),
                limit,
            });
        }
        if let Some(expected) = size.filter(|&s| s != bytes) {
            return Err(StoreError::SizeMismatch {
                digest: digest.clone(),
                expected,
                found: bytes,
            });
        }
        if &found != digest {
            return Err(StoreError::DigestMismatch {
                expected: digest.clone(),
                found,
                bytes,
            });
        }
        let staged = buffered
            .into_inner()
            .map_err(|e| io_err(&path)(e.into_error()))?;
        staged.as_file().sync_all().map_err(io_err(&path))?;
        staged.persist(&path).map_err(|e| io_err(&path)(e.error))?;
        Ok(true)
    }

    /// Reads a small blob (a manifest, a configuration) whole.
    pub fn read_blob(&self, digest: &Digest, limit: u64) -> Result<Vec<u8>, StoreError> {
        let path = self.blob_path(digest);
        let file = File::open(&path).map_err(io_err(&path))?;
        let mut bytes = Vec::new();
        file.take(limit + 1)
            .read_to_end(&mut bytes)
            .map_err(io_err(&path))?;
        if bytes.len() as u64 > limit {
            return Err(StoreError::TooLarge {
                digest: digest.clone(),
                limit,
            });
        }
        Ok(bytes)
    }

    /// The erofs file of the layer `diff_id`, unpacked from the blob
    /// `blob` unless the store has it. Returns what unpacking made, when
    /// it ran.
    pub fn ensure_layer(
        &self,
        blob: &Digest,
        diff_id: &Digest,
    ) -> Result<Option<Unpacked>, StoreError> {
        let out = self.layer_path(diff_id);
        if out.exists() {
            return Ok(None);
        }
        let work = self.work_dir()?;
        let staged = work.path().join("layer.erofs");
        let unpacked = layer::convert(&self.blob_path(blob), diff_id, work.path(), &staged)
            .map_err(|source| StoreError::Layer {
                diff_id: diff_id.clone(),
                source,
            })?;
        fs::set_permissions(&staged, fs::Permissions::from_mode(0o644)).map_err(io_err(&staged))?;
        fs::rename(&staged, &out).map_err(io_err(&out))?;
        Ok(Some(unpacked))
    }

    /// Records `image` (its blobs and layers already stored).
    pub fn put_image(&self, image: &Image) -> Result<(), StoreError> {
        let path = self.image_path(&image.id);
        let json = serde_json::to_vec_pretty(image).map_err(|e| io_err(&path)(e.into()))?;
        write_atomically(&self.root.join("tmp"), &path, &json)
    }

    pub fn image(&self, id: &Digest) -> Result<Image, StoreError> {
        let path = self.image_path(id);
        let bytes = match fs::read(&path) {
            Ok(b) => b,
            Err(e) if e.kind() == io::ErrorKind::NotFound => {
                return Err(StoreError::NoImage(id.to_string()))
            }
            Err(e) => return Err(io_err(&path)(e)),
        };
        serde_json::from_slice(&bytes).map_err(|source| StoreError::BadRecord { path, source })
    }

    /// Points the name `name` at the image `id`.
    pub fn tag(&self, name: &str, id: &Digest) -> Result<(), StoreError> {
        let path = self.ref_path(name)?;
        write_atomically(&self.root.join("tmp"), &path, id.to_string().as_bytes())
    }

    fn ref_path(&self, name: &str) -> Result<PathBuf, StoreError> {
        if !is_name(name) {
            return Err(StoreError::BadName(name.to_owned()));
        }
        // One file per name: `/` is the only character a name has that a
        // file name cannot, and `%` is not allowed in names.
        Ok(self.root.join("refs").join(name.replace('/', "%")))
    }

    /// Every name and the image it names.
    pub fn names(&self) -> Result<BTreeMap<String, Digest>, StoreError> {
        let dir = self.root.join("refs");
        let mut names = BTreeMap::new();
        for entry in fs::read_dir(&dir).map_err(io_err(&dir))? {
            let entry = entry.map_err(io_err(&dir))?;
            let name = entry.file_name().to_string_lossy().replace('%', "/");
            let text = fs::read_to_string(entry.path()).map_err(io_err(&entry.path()))?;
            if let Ok(id) = text.trim().parse() {
                names.insert(name, id);
            }
        }
        Ok(names)
    }

    /// Every image's id.
    pub fn ids(&self) -> Result<Vec<Digest>, StoreError> {
        let dir = self.root.join("images");
        let mut ids = Vec::new();
        for entry in fs::read_dir(&dir).map_err(io_err(&dir))? {
            let entry = entry.map_err(io_err(&dir))?;
            let name = entry.file_name();
            let Some(hex) = name.to_str().and_then(|n| n.strip_suffix(".json")) else {
                continue;
            };
            if let Ok(id) = format!("sha256:{hex}").parse() {
                ids.push(id);
            }
        }
        ids.sort();
        Ok(ids)
    }

    /// The image `name` names: a name in `refs/`, a full id, or an id's
    /// first digits (at least 4, as `forkbox image ls` prints 12).
    pub fn resolve(&self, name: &str) -> Result<Image, StoreError> {
        if let Ok(id) = name.parse::<Digest>() {
            return self.image(&id);
        }
        if let Ok(path) = self.ref_path(name) {
            if let Ok(text) = fs::read_to_string(&path) {
                if let Ok(id) = text.trim().parse::<Digest>() {
                    return self.image(&id);
                }
            }
        }
        let hex = name.strip_prefix("sha256:").unwrap_or(name);
        if hex.len() >= 4 && hex.chars().all(|c| c.is_ascii_hexdigit()) {
            let found: Vec<Digest> = self
                .ids()?
                .into_iter()
                .filter(|id| id.hex().starts_with(&hex.to_ascii_lowercase()))
                .collect();
            match found.as_slice() {
                [id] => return self.image(id),
                [] => {}
                _ => {
                    return Err(StoreError::Ambiguous {
                        name: name.to_owned(),
                        count: found.len(),
                    })
                }
            }
        }
        Err(StoreError::NoImage(name.to_owned()))
    }

    /// Marks the image `id` as needed by `holder` (for example a daemon's
    /// template), replacing what `holder` pinned before: [`Store::remove`]
    /// refuses it and [`Store::gc`] keeps it until [`Store::unpin`].
    pub fn pin(&self, holder: &str, id: &Digest) -> Result<(), StoreError> {
        let path = self.root.join("pins").join(hex::encode(holder));
        let text = format!("{id}\n{holder}\n");
        write_atomically(&self.root.join("tmp"), &path, text.as_bytes())
    }

    /// Forgets what `holder` pinned (nothing, if it pinned nothing).
    pub fn unpin(&self, holder: &str) -> Result<(), StoreError> {
        let path = self.root.join("pins").join(hex::encode(holder));
        match fs::remove_file(&path) {
            Err(e) if e.kind() != io::ErrorKind::NotFound => Err(io_err(&path)(e)),
            _ => Ok(()),
        }
    }

    /// Every holder and the image it pinned.
    pub fn pins(&self) -> Result<BTreeMap<String, Digest>, StoreError> {
        let dir = self.root.join("pins");
        let mut pins = BTreeMap::new();
        for entry in fs::read_dir(&dir).map_err(io_err(&dir))? {
            let entry = entry.map_err(io_err(&dir))?;
            let text = fs::read_to_string(entry.path()).map_err(io_err(&entry.path()))?;
            let mut lines = text.lines();
            if let (Some(Ok(id)), Some(holder)) = (lines.next().map(str::parse), lines.next()) {
                pins.insert(holder.to_owned(), id);
            }
        }
        Ok(pins)
    }

    /// Removes the name `name`, or (given an id) the image and every name
    /// of it; a pinned image's last name stays. The image's files go at
    /// the next [`Store::gc`].
    pub fn remove(&self, name: &str) -> Result<Digest, StoreError> {
        let _lock = self.lock(FlockOperation::LockExclusive)?;
        let image = self.resolve(name)?;
        let names = self.names()?;
        let is_name = names.contains_key(name);
        let others = names
            .iter()
            .filter(|(n, id)| **id == image.id && n.as_str() != name)
            .count();
        // The last name of an image, or its id: the image itself goes.
        if !is_name || others == 0 {
            let pins = self.pins()?;
            if let Some((by, _)) = pins.into_iter().find(|(_, id)| *id == image.id) {
                return Err(StoreError::InUse { id: image.id, by });
            }
        }
        if is_name {
            let path = self.ref_path(name)?;
            fs::remove_file(&path).map_err(io_err(&path))?;
            if others > 0 {
                return Ok(image.id);
            }
        } else {
            for (n, id) in &names {
                if *id == image.id {
                    let path = self.ref_path(n)?;
                    fs::remove_file(&path).map_err(io_err(&path))?;
                }
            }
        }
        let path = self.image_path(&image.id);
        fs::remove_file(&path).map_err(io_err(&path))?;
        Ok(image.id)
    }

    /// Removes every image with no name and no pin, then every blob and
    /// layer file no remaining image uses, and `tmp/` debris of imports
    /// that did not finish.
    pub fn gc(&self) -> Result<Collected, StoreError> {
        let _lock = self.lock(FlockOperation::LockExclusive)?;
        let mut collected = Collected::default();
        let keep: HashSet<Digest> = self.pins()?.into_values().collect();
        let named: HashSet<Digest> = self.names()?.into_values().collect();
        let (mut blobs, mut layers) = (HashSet::new(), HashSet::new());
        for id in self.ids()? {
            if !named.contains(&id) && !keep.contains(&id) {
                let path = self.image_path(&id);
                fs::remove_file(&path).map_err(io_err(&path))?;
                collected.images += 1;
                continue;
            }
            let image = self.image(&id)?;
            blobs.insert(image.id.hex().to_owned());
            blobs.extend(image.manifest.iter().map(|m| m.hex().to_owned()));
            for layer in &image.layers {
                blobs.insert(layer.blob.hex().to_owned());
                layers.insert(format!("{}.erofs", layer.diff_id.hex()));
            }
        }
        let (b, l, t) = (
            self.root.join("blobs/sha256"),
            self.root.join("layers"),
            self.root.join("tmp"),
        );
        let (n, bytes) = sweep(&b, &|name| blobs.contains(name))?;
        collected.blobs += n;
        collected.bytes += bytes;
        let (n, bytes) = sweep(&l, &|name| layers.contains(name))?;
        collected.layers += n;
        collected.bytes += bytes;
        // Holding the exclusive lock, no import is under way.
        collected.bytes += sweep(&t, &|_| false)?.1;
        Ok(collected)
    }
}

/// Whether `name` can name an image (or be an id): a letter or digit,
/// then letters, digits and `._-/:@`, no `..`, at most 255 characters.
pub fn is_name(name: &str) -> bool {
    let allowed = |c: char| c.is_ascii_alphanumeric() || "._-/:@".contains(c);
    name.starts_with(|c: char| c.is_ascii_alphanumeric())
        && name.len() <= 255
        && name.chars().all(allowed)
        && !name.contains("..")
}

/// Removes what `keep` does not name in `dir`; returns how many entries
/// and bytes went.
fn sweep(dir: &Path, keep: &dyn Fn(&str) -> bool) -> Result<(usize, u64), StoreError> {
    let (mut count, mut bytes) = (0, 0);
    for entry in fs::read_dir(dir).map_err(io_err(dir))? {
        let entry = entry.map_err(io_err(dir))?;
        if keep(&entry.file_name().to_string_lossy()) {
            continue;
        }
        let path = entry.path();
        let meta = fs::symlink_metadata(&path).map_err(io_err(&path))?;
        if meta.is_dir() {
            fs::remove_dir_all(&path).map_err(io_err(&path))?;
        } else {
            bytes += meta.len();
            fs::remove_file(&path).map_err(io_err(&path))?;
        }
        count += 1;
    }
    Ok((count, bytes))
}

fn write_atomically(tmp: &Path, path: &Path, bytes: &[u8]) -> Result<(), StoreError> {
    let mut staged = tempfile::NamedTempFile::new_in(tmp).map_err(io_err(tmp))?;
    staged.write_all(bytes).map_err(io_err(path))?;
    staged.as_file().sync_all().map_err(io_err(path))?;
    staged.persist(path).map_err(|e| io_err(path)(e.error))?;
    Ok(())
}

fn io_err(path: &Path) -> impl FnOnce(io::Error) -> StoreError + '_ {
    move |source| StoreError::Io {
        path: path.to_owned(),
        source,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn store() -> (tempfile::TempDir, Store) {
        let dir = tempfile::tempdir().expect("tempdir");
        let store = Store::open(&dir.path().join("store")).expect("open");
        (dir, store)
    }

    fn image(config: &[u8], layer_blobs: &[&[u8]]) -> Image {
        Image {
            id: Digest::of(config),
            layers: layer_blobs
                .iter()
                .map(|b| LayerRef {
                    blob: Digest::of(b),
                    diff_id: Digest::of(b),
                    media_type: "application/vnd.oci.image.layer.v1.tar".into(),
                    size: b.len() as u64,
                })
                .collect(),
            config: RunConfig::default(),
            manifest: None,
            created: None,
        }
    }

    #[test]
    fn put_blob_checks_digest_and_size_and_limit() {
        let (_dir, store) = store();
        let data = b"layer bytes";
        let d = Digest::of(data);
        let wrong = Digest::of(b"other");
        assert!(matches!(
            store.put_blob(&wrong, None, 1 << 20, &data[..]),
            Err(StoreError::DigestMismatch { .. })
        ));
        assert!(matches!(
            store.put_blob(&d, Some(3), 1 << 20, &data[..]),
            Err(StoreError::SizeMismatch { found: 11, .. })
        ));
        assert!(matches!(
            store.put_blob(&d, None, 5, &data[..]),
            Err(StoreError::TooLarge { limit: 5, .. })
        ));
        assert!(!store.blob_path(&wrong).exists() && !store.blob_path(&d).exists());
        assert_eq!(
            fs::read_dir(store.root().join("tmp")).expect("tmp").count(),
            0
        );
        assert!(store
            .put_blob(&d, Some(11), 1 << 20, &data[..])
            .expect("put"));
        assert!(!store
            .put_blob(&d, Some(11), 1 << 20, &data[..])
            .expect("again"));
        assert_eq!(store.read_blob(&d, 100).expect("read"), data);
        assert!(matches!(
            store.read_blob(&d, 4),
            Err(StoreError::TooLarge { .. })
        ));
    }

    #[test]
    fn resolve_by_name_id_and_prefix() {
        let (_dir, store) = store();
        let img = image(b"config", &[]);
        store.put_image(&img).expect("put");
        store
            .tag("localhost:5000/task/base:v1", &img.id)
            .expect("tag");
        assert_eq!(
            store.resolve("localhost:5000/task/base:v1").expect("name"),
            img
        );
        assert_eq!(store.resolve(&img.id.to_string()).expect("id"), img);
        assert_eq!(store.resolve(img.id.short()).expect("short"), img);
        assert!(matches!(
            store.resolve("nope:1"),
            Err(StoreError::NoImage(_))
        ));
        assert!(matches!(
            store.tag("../x", &img.id),
            Err(StoreError::BadName(_))
        ));
        assert!(matches!(
            store.tag("a%b", &img.id),
            Err(StoreError::BadName(_))
        ));
        let names = store.names().expect("names");
        assert_eq!(names.get("localhost:5000/task/base:v1"), Some(&img.id));
    }

    #[test]
    fn remove_refuses_an_image_in_use_and_gc_keeps_shared_blobs() {
        let (_dir, store) = store();
        let (base, top, other) = (b"base".as_slice(), b"top".as_slice(), b"other".as_slice());
        for b in [base, top, other] {
            store.put_blob(&Digest::of(b), None, 100, b).expect("blob");
        }
        let a = image(b"config a", &[base, top]);
        let b = image(b"config b", &[base]);
        let c = image(b"config c", &[other]);
        for (img, name) in [(&a, "a:1"), (&b, "b:1"), (&c, "c:1")] {
            store.put_image(img).expect("image");
            store.tag(name, &img.id).expect("tag");
        }
        store.tag("a:latest", &a.id).expect("tag");
        store.pin("daemon /run/x: template t", &a.id).expect("pin");
        // One of two names: only the name goes, pinned or not.
        assert_eq!(store.remove("a:latest").expect("name"), a.id);
        match store.remove("a:1") {
            Err(StoreError::InUse { by, .. }) => assert_eq!(by, "daemon /run/x: template t"),
            other => panic!("{other:?}"),
        }
        store.remove("b:1").expect("b");
        store.remove(&c.id.to_string()).expect("c by id");
        assert!(matches!(store.resolve("c:1"), Err(StoreError::NoImage(_))));
        let collected = store.gc().expect("gc");
        // b's record went with its last name; c's at once; `other` only
        // c used; `base` a still uses.
        assert_eq!((collected.images, collected.blobs), (0, 1));
        assert!(store.blob_path(&Digest::of(base)).exists());
        assert!(store.blob_path(&Digest::of(top)).exists());
        assert!(!store.blob_path(&Digest::of(other)).exists());
        assert_eq!(store.resolve("a:1").expect("a stays"), a);
        store.unpin("daemon /run/x: template t").expect("unpin");
        store.unpin("never pinned").expect("unpin nothing");
        assert_eq!(store.remove("a:1").expect("unpinned"), a.id);
    }

    #[test]
    fn gc_removes_unnamed_images_unless_pinned() {
        let (_dir, store) = store();
        let a = image(b"config a", &[]);
        let b = image(b"config b", &[]);
        store.put_image(&a).expect("a");
        store.put_image(&b).expect("b");
        store.pin("holder", &a.id).expect("pin");
        assert_eq!(store.pins().expect("pins").get("holder"), Some(&a.id));
        assert_eq!(store.gc().expect("gc").images, 1);
        assert_eq!(store.ids().expect("ids"), vec![a.id]);
    }
}
