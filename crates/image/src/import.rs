//! Importing an image from a file: an OCI image layout (a directory, or a
//! tar of one, as `skopeo copy … oci-archive:` or `docker save` since
//! Docker 25 write) or a `docker save` archive of the older kind
//! (`manifest.json`, a configuration and one `layer.tar` per layer).
//!
//! Nothing in the file is trusted: every blob is checked against its
//! digest as it enters the store, every layer against the digest its
//! configuration names, and an archive is extracted (regular files and
//! directories only, no path leaving the directory) before it is read.

use std::fs::{self, File};
use std::io::{self, Read};
use std::path::{Path, PathBuf};

use oci_spec::image::{
    Arch, Descriptor, ImageConfiguration, ImageIndex, ImageManifest, MediaType, Os,
};
use rustix::fs::FlockOperation;

use crate::digest::{Digest, DigestError, HashingReader};
use crate::layer::Unpacked;
use crate::store::{Image, LayerRef, RunConfig, Store, StoreError};

/// Largest manifest, index or configuration read (they are JSON).
pub const MAX_JSON: u64 = 4 << 20;
/// Most layers an image may have: the guest stacks them with overlayfs,
/// one partition of its image disk each.
pub const MAX_LAYERS: usize = 128;

/// The annotation OCI layouts name a manifest by (`skopeo copy … oci:DIR:TAG`).
const REF_NAME: &str = "org.opencontainers.image.ref.name";
/// The annotation containerd and Docker name a manifest by, in full.
const IMAGE_NAME: &str = "io.containerd.image.name";

#[derive(Debug, thiserror::Error)]
pub enum ImportError {
    #[error("cannot read {path}")]
    Read {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("{0} is neither an OCI image layout (index.json) nor a `docker save` archive (manifest.json)")]
    UnknownFormat(PathBuf),
    #[error("{what} is not valid JSON of its kind")]
    Json {
        what: String,
        #[source]
        source: serde_json::Error,
    },
    #[error(transparent)]
    Digest(#[from] DigestError),
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error("the file holds {count} images ({names}): name the one to import")]
    WhichImage { count: usize, names: String },
    #[error("the file has no image named `{name}` (it has: {names})")]
    NoSuchName { name: String, names: String },
    #[error("no linux/amd64 image in the index (it has: {0})")]
    NoPlatform(String),
    #[error("the image is for {os}/{arch}; forkbox runs linux/amd64")]
    WrongPlatform { os: String, arch: String },
    #[error("{what} has media type `{media_type}`, which forkbox does not import")]
    MediaType { what: String, media_type: String },
    #[error("the image has {layers} layers but its configuration names {diff_ids}")]
    LayerCount { layers: usize, diff_ids: usize },
    #[error("the image has {0} layers; forkbox stacks at most {MAX_LAYERS}")]
    TooManyLayers(usize),
    #[error("archive entry `{0}` leaves the archive or is not a plain file or directory")]
    BadArchiveEntry(String),
}

/// What an import reports as it goes.
#[derive(Debug)]
pub enum Progress<'a> {
    /// A layer, before it is stored and unpacked.
    LayerStart {
        index: usize,
        count: usize,
        diff_id: &'a Digest,
        bytes: u64,
    },
    /// That layer, done: `unpacked` is `None` when the store had it.
    LayerDone {
        index: usize,
        unpacked: Option<Unpacked>,
    },
    /// A layer's blob, downloading: `bytes` of `total` are here.
    Fetched {
        index: usize,
        count: usize,
        blob: &'a Digest,
        bytes: u64,
        total: u64,
    },
}

/// An imported image and the names it was given.
#[derive(Debug)]
pub struct Imported {
    pub image: Image,
    pub names: Vec<String>,
    /// Layers unpacked now (the others the store had).
    pub unpacked: usize,
}

/// Imports the image at `path` (a directory or a tar archive). `name`
/// picks one image where the file holds several, and names the image in
/// the store; without it, the names the file gives are kept.
pub fn import(
    store: &Store,
    path: &Path,
    name: Option<&str>,
    progress: &mut dyn FnMut(Progress<'_>),
) -> Result<Imported, ImportError> {
    let _lock = store.lock(FlockOperation::LockShared)?;
    let meta = fs::metadata(path).map_err(read_err(path))?;
    let work = store.work_dir()?;
    let dir = if meta.is_dir() {
        path.to_owned()
    } else {
        let dir = work.path().join("archive");
        extract(path, &dir)?;
        dir
    };
    let found = if dir.join("index.json").exists() {
        from_layout(store, &dir, name)?
    } else if dir.join("manifest.json").exists() {
        from_docker_archive(store, &dir, name)?
    } else {
        return Err(ImportError::UnknownFormat(path.to_owned()));
    };
    let imported = finish(store, found, progress)?;
    for n in &imported.names {
        store.tag(n, &imported.image.id)?;
    }
    Ok(imported)
}

/// An image found in a file or a registry, its layers not yet unpacked.
pub(crate) struct Found {
    pub(crate) names: Vec<String>,
    pub(crate) manifest: Option<Digest>,
    pub(crate) config: Vec<u8>,
    /// Each layer's blob file, digest (when the file says it), media type.
    pub(crate) layers: Vec<(PathBuf, Option<Digest>, String)>,
}

fn from_layout(store: &Store, dir: &Path, name: Option<&str>) -> Result<Found, ImportError> {
    let index: ImageIndex = json(&read_limited(&dir.join("index.json"))?, "index.json")?;
    let entries = index.manifests();
    let label = |d: &Descriptor| {
        let a = d.annotations().as_ref();
        a.and_then(|a| a.get(IMAGE_NAME).or_else(|| a.get(REF_NAME)))
            .cloned()
    };
    let listed = || {
        let names: Vec<String> = entries.iter().filter_map(label).collect();
        if names.is_empty() {
            "no names".to_owned()
        } else {
            names.join(", ")
        }
    };
    let chosen = match name {
        Some(n) if entries.len() > 1 => entries
            .iter()
            .find(|d| {
                let a = d.annotations().as_ref();
                let names = [IMAGE_NAME, REF_NAME].map(|k| a.and_then(|a| a.get(k)));
                names
                    .into_iter()
                    .flatten()
                    .any(|v| v == n || n.ends_with(&format!(":{v}")))
            })
            .ok_or_else(|| ImportError::NoSuchName {
                name: n.to_owned(),
                names: listed(),
            })?,
        _ => match entries.as_slice() {
            [one] => one,
            _ => {
                return Err(ImportError::WhichImage {
                    count: entries.len(),
                    names: listed(),
                })
            }
        },
    };
    let names = match name {
        Some(n) => vec![n.to_owned()],
        // A bare tag (`latest`) names nothing on its own.
        None => chosen
            .annotations()
            .as_ref()
            .and_then(|a| a.get(IMAGE_NAME))
            .cloned()
            .into_iter()
            .collect(),
    };
    let blob = |d: &Descriptor| -> Result<PathBuf, ImportError> {
        let digest = Digest::try_from(d.digest())?;
        Ok(dir.join("blobs/sha256").join(digest.hex()))
    };
    let mut manifest_desc = chosen.clone();
    if is_index(manifest_desc.media_type()) {
        let bytes = checked_json_blob(&blob(&manifest_desc)?, &manifest_desc)?;
        let inner: ImageIndex = json(&bytes, "the image index")?;
        manifest_desc = pick_platform(inner.manifests())?.clone();
    }
    if !is_manifest(manifest_desc.media_type()) {
        return Err(ImportError::MediaType {
            what: "the manifest".into(),
            media_type: manifest_desc.media_type().to_string(),
        });
    }
    let manifest_bytes = checked_json_blob(&blob(&manifest_desc)?, &manifest_desc)?;
    let manifest: ImageManifest = json(&manifest_bytes, "the manifest")?;
    let manifest_digest = Digest::of(&manifest_bytes);
    store.put_blob(&manifest_digest, None, MAX_JSON, &manifest_bytes[..])?;
    let config = checked_json_blob(&blob(manifest.config())?, manifest.config())?;
    let mut layers = Vec::new();
    for d in manifest.layers() {
        let media_type = d.media_type().to_string();
        if !is_layer(&media_type) {
            return Err(ImportError::MediaType {
                what: format!("layer {}", d.digest()),
                media_type,
            });
        }
        layers.push((blob(d)?, Some(Digest::try_from(d.digest())?), media_type));
    }
    Ok(Found {
        names,
        manifest: Some(manifest_digest),
        config,
        layers,
    })
}

/// One image of a `docker save` archive's `manifest.json`.
#[derive(serde::Deserialize)]
#[serde(rename_all = "PascalCase")]
struct DockerEntry {
    config: String,
    #[serde(default)]
    repo_tags: Option<Vec<String>>,
    layers: Vec<String>,
}

fn from_docker_archive(
    _store: &Store,
    dir: &Path,
    name: Option<&str>,
) -> Result<Found, ImportError> {
    let entries: Vec<DockerEntry> =
        json(&read_limited(&dir.join("manifest.json"))?, "manifest.json")?;
    let tags = |e: &DockerEntry| e.repo_tags.clone().unwrap_or_default();
    let listed = || {
        let all: Vec<String> = entries.iter().flat_map(tags).collect();
        if all.is_empty() {
            "no names".to_owned()
        } else {
            all.join(", ")
        }
    };
    let chosen = match (name, entries.as_slice()) {
        (_, [one]) => one,
        (Some(n), _) => entries
            .iter()
            .find(|e| tags(e).iter().any(|t| t == n))
            .ok_or_else(|| ImportError::NoSuchName {
                name: n.to_owned(),
                names: listed(),
            })?,
        (None, _) => {
            return Err(ImportError::WhichImage {
                count: entries.len(),
                names: listed(),
            })
        }
    };
    let inside = |rel: &str| -> Result<PathBuf, ImportError> {
        let rel = crate::layer::relative_path(Path::new(rel))
            .map_err(|_| ImportError::BadArchiveEntry(rel.to_owned()))?;
        Ok(dir.join(rel))
    };
    let config = read_limited(&inside(&chosen.config)?)?;
    let mut layers = Vec::new();
    for l in &chosen.layers {
        // A tar, gzip'd or not; the unpacker tells them apart.
        layers.push((
            inside(l)?,
            None,
            "application/vnd.docker.image.rootfs.diff.tar".to_owned(),
        ));
    }
    let names = match name {
        Some(n) => vec![n.to_owned()],
        None => tags(chosen),
    };
    Ok(Found {
        names,
        manifest: None,
        config,
        layers,
    })
}

/// Stores the configuration and layers of `found` and records the image.
pub(crate) fn finish(
    store: &Store,
    found: Found,
    progress: &mut dyn FnMut(Progress<'_>),
) -> Result<Imported, ImportError> {
    let config: ImageConfiguration = json(&found.config, "the image configuration")?;
    if *config.os() != Os::Linux || *config.architecture() != Arch::Amd64 {
        return Err(ImportError::WrongPlatform {
            os: config.os().to_string(),
            arch: config.architecture().to_string(),
        });
    }
    let diff_ids = config.rootfs().diff_ids();
    if diff_ids.len() != found.layers.len() {
        return Err(ImportError::LayerCount {
            layers: found.layers.len(),
            diff_ids: diff_ids.len(),
        });
    }
    if found.layers.len() > MAX_LAYERS {
        return Err(ImportError::TooManyLayers(found.layers.len()));
    }
    let id = Digest::of(&found.config);
    store.put_blob(&id, None, MAX_JSON, &found.config[..])?;
    let count = found.layers.len();
    let mut layers = Vec::with_capacity(count);
    let mut unpacked_count = 0;
    for (index, ((file, digest, media_type), diff_id)) in
        found.layers.into_iter().zip(diff_ids).enumerate()
    {
        let diff_id: Digest = diff_id.parse()?;
        let bytes = fs::metadata(&file).map_err(read_err(&file))?.len();
        progress(Progress::LayerStart {
            index,
            count,
            diff_id: &diff_id,
            bytes,
        });
        let blob = match digest {
            Some(d) => d,
            None => digest_of_file(&file)?,
        };
        if !store.blob_path(&blob).exists() {
            let reader = File::open(&file).map_err(read_err(&file))?;
            store.put_blob(&blob, Some(bytes), u64::MAX, reader)?;
        }
        let unpacked = store.ensure_layer(&blob, &diff_id)?;
        unpacked_count += usize::from(unpacked.is_some());
        progress(Progress::LayerDone { index, unpacked });
        layers.push(LayerRef {
            blob,
            diff_id,
            media_type,
            size: bytes,
        });
    }
    let run = config.config().as_ref();
    let image = Image {
        id,
        layers,
        config: RunConfig {
            env: run.and_then(|c| c.env().clone()).unwrap_or_default(),
            working_dir: run
                .and_then(|c| c.working_dir().clone())
                .filter(|w| !w.is_empty()),
            user: run.and_then(|c| c.user().clone()).filter(|u| !u.is_empty()),
            entrypoint: run.and_then(|c| c.entrypoint().clone()).unwrap_or_default(),
            cmd: run.and_then(|c| c.cmd().clone()).unwrap_or_default(),
        },
        manifest: found.manifest,
        created: config.created().clone(),
    };
    store.put_image(&image)?;
    Ok(Imported {
        image,
        names: found.names,
        unpacked: unpacked_count,
    })
}

fn is_index(m: &MediaType) -> bool {
    matches!(m, MediaType::ImageIndex)
        || m.to_string() == "application/vnd.docker.distribution.manifest.list.v2+json"
}

fn is_manifest(m: &MediaType) -> bool {
    matches!(m, MediaType::ImageManifest)
        || m.to_string() == "application/vnd.docker.distribution.manifest.v2+json"
}

pub(crate) fn is_layer(media_type: &str) -> bool {
    media_type.starts_with("application/vnd.oci.image.layer.")
        || media_type.starts_with("application/vnd.docker.image.rootfs.diff.tar")
}

/// The linux/amd64 entry of a multi-platform index.
pub(crate) fn pick_platform(entries: &[Descriptor]) -> Result<&Descriptor, ImportError> {
    entries
        .iter()
        .find(|d| {
            d.platform()
                .as_ref()
                .is_some_and(|p| *p.os() == Os::Linux && *p.architecture() == Arch::Amd64)
        })
        .ok_or_else(|| {
            let have: Vec<String> = entries
                .iter()
                .filter_map(|d| d.platform().as_ref())
                .map(|p| format!("{}/{}", p.os(), p.architecture()))
                .collect();
            ImportError::NoPlatform(have.join(", "))
        })
}

/// A small blob of the layout, checked against its descriptor.
fn checked_json_blob(path: &Path, d: &Descriptor) -> Result<Vec<u8>, ImportError> {
    let bytes = read_limited(path)?;
    let expected = Digest::try_from(d.digest())?;
    let found = Digest::of(&bytes);
    if found != expected || bytes.len() as u64 != d.size() {
        return Err(ImportError::Store(StoreError::DigestMismatch {
            expected,
            found,
            bytes: bytes.len() as u64,
        }));
    }
    Ok(bytes)
}

fn digest_of_file(path: &Path) -> Result<Digest, ImportError> {
    let file = File::open(path).map_err(read_err(path))?;
    let (digest, _) = HashingReader::new(io::BufReader::new(file))
        .finish()
        .map_err(read_err(path))?;
    Ok(digest)
}

fn read_limited(path: &Path) -> Result<Vec<u8>, ImportError> {
    let file = File::open(path).map_err(read_err(path))?;
    let mut bytes = Vec::new();
    file.take(MAX_JSON + 1)
        .read_to_end(&mut bytes)
        .map_err(read_err(path))?;
    if bytes.len() as u64 > MAX_JSON {
        return Err(ImportError::Read {
            path: path.to_owned(),
            source: io::Error::other(format!("larger than {MAX_JSON} bytes")),
        });
    }
    Ok(bytes)
}

pub(crate) fn json<T: serde::de::DeserializeOwned>(
    bytes: &[u8],
    what: &str,
) -> Result<T, ImportError> {
    serde_json::from_slice(bytes).map_err(|source| ImportError::Json {
        what: what.to_owned(),
        source,
    })
}

/// Extracts the tar archive `path` into `dir`: directories and regular
/// files only, each at a path inside `dir`.
fn extract(path: &Path, dir: &Path) -> Result<(), ImportError> {
    let file = File::open(path).map_err(read_err(path))?;
    fs::create_dir(dir).map_err(read_err(dir))?;
    let mut archive = tar::Archive::new(io::BufReader::new(file));
    for entry in archive.entries().map_err(read_err(path))? {
        let mut entry = entry.map_err(read_err(path))?;
        let raw = entry.path().map_err(read_err(path))?.into_owned();
        let shown = raw.display().to_string();
        let rel = crate::layer::relative_path(&raw)
            .map_err(|_| ImportError::BadArchiveEntry(shown.clone()))?;
        let at = dir.join(&rel);
        match entry.header().entry_type() {
            tar::EntryType::Directory => fs::create_dir_all(&at).map_err(read_err(&at))?,
            tar::EntryType::Regular | tar::EntryType::Continuous => {
                if let Some(parent) = at.parent() {
                    fs::create_dir_all(parent).map_err(read_err(parent))?;
                }
                let mut out = File::create_new(&at).map_err(read_err(&at))?;
                io::copy(&mut entry, &mut out).map_err(read_err(&at))?;
            }
            _ => return Err(ImportError::BadArchiveEntry(shown)),
        }
    }
    Ok(())
}

fn read_err(path: &Path) -> impl FnOnce(io::Error) -> ImportError + '_ {
    move |source| ImportError::Read {
        path: path.to_owned(),
        source,
    }
}
