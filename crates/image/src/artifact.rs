//! Baked templates in a registry: one OCI artifact per template, pushed
//! and pulled over the same protocol as images (`oci-client`).
//!
//! The artifact is an OCI image manifest whose configuration is the
//! daemon's description of the template ([`CONFIG_MEDIA_TYPE`], opaque
//! here) and whose blobs are, in order:
//!
//! 1. the snapshot's state ([`STATE_MEDIA_TYPE`], the VMM's JSON);
//! 2. the snapshot's memory, compressed with zstd ([`MEMORY_MEDIA_TYPE`]);
//! 3. for a template on a stored image, that image whole: its
//!    configuration, then its layers as the store received them, under
//!    their own media types. A registry keeps a blob once, so the layers
//!    an image and its templates share are stored, and pushed, once.
//!
//! A blob the registry has is not sent again; a blob the store has is not
//! downloaded again. Everything downloaded is checked against its digest.

use std::fs::File;
use std::io::{self, BufReader, BufWriter, Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use futures_util::StreamExt;
use oci_client::client::ClientConfig;
use oci_client::secrets::RegistryAuth;
use oci_client::{Client, Reference, RegistryOperation};
use oci_spec::image::{Descriptor, ImageManifest};
use rustix::fs::FlockOperation;

use crate::digest::{Digest, HashingWriter};
use crate::import::{self, Found, ImportError, MAX_JSON};
use crate::registry::{self, PullError, Registry};
use crate::store::{Image, Store, StoreLock};

/// The artifact's configuration: the daemon's record of the template.
pub const CONFIG_MEDIA_TYPE: &str = "application/vnd.forkbox.template.config.v1+json";
/// The snapshot's state, as its VMM wrote it.
pub const STATE_MEDIA_TYPE: &str = "application/vnd.forkbox.snapshot.state.v1+json";
/// The snapshot's guest memory, compressed with zstd.
pub const MEMORY_MEDIA_TYPE: &str = "application/vnd.forkbox.snapshot.memory.v1+zstd";
/// An image configuration carried in a template artifact.
const IMAGE_CONFIG_MEDIA_TYPE: &str = "application/vnd.oci.image.config.v1+json";
const MANIFEST_MEDIA_TYPE: &str = "application/vnd.oci.image.manifest.v1+json";
/// Bound on a snapshot's state (the VMM's JSON: vCPUs and devices).
pub const MAX_STATE: u64 = 64 << 20;

/// Progress of a push or a pull: `bytes` of the part `what` (of `total`)
/// have moved; `present` when the other side had it already.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Transfer {
    pub what: String,
    pub bytes: u64,
    pub total: u64,
    pub present: bool,
}

/// Where progress goes; called from the upload's own stream, so shared.
pub type OnTransfer = Arc<dyn Fn(Transfer) + Send + Sync>;

/// A snapshot's memory, compressed for a push: a temporary file.
pub struct PackedMemory {
    file: tempfile::TempPath,
    pub digest: Digest,
    pub bytes: u64,
}

impl PackedMemory {
    pub fn path(&self) -> &Path {
        &self.file
    }

    /// Keeps this packed memory as `at` (a hard link), its digest beside
    /// it in `at`.sha256, for [`PackedMemory::kept`]: a second push of the
    /// same snapshot is not compressed again.
    pub fn keep(&self, at: &Path) -> io::Result<()> {
        let sum = digest_path(at);
        let _ = std::fs::remove_file(at);
        std::fs::hard_link(&self.file, at)?;
        let tmp = tempfile::NamedTempFile::new_in(at.parent().unwrap_or(Path::new(".")))?;
        std::fs::write(tmp.path(), self.digest.to_string())?;
        tmp.persist(sum).map_err(|e| e.error)?;
        Ok(())
    }

    /// The packed memory kept as `at`, if there is one (with its digest),
    /// linked aside into `work` so that the snapshot's replacement loses
    /// nothing here.
    pub fn kept(at: &Path, work: &Path) -> io::Result<Option<Self>> {
        let Ok(text) = std::fs::read_to_string(digest_path(at)) else {
            return Ok(None);
        };
        let Ok(digest) = text.trim().parse::<Digest>() else {
            return Ok(None);
        };
        let aside = tempfile::Builder::new()
            .prefix(".tmp")
            .make_in(work, |p| std::fs::hard_link(at, p));
        let aside = match aside {
            Ok(f) => f.into_temp_path(),
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(e),
        };
        let bytes = std::fs::metadata(&aside)?.len();
        Ok(Some(Self {
            file: aside,
            digest,
            bytes,
        }))
    }
}

fn digest_path(at: &Path) -> PathBuf {
    let mut name = at.as_os_str().to_owned();
    name.push(".sha256");
    PathBuf::from(name)
}

/// Compresses the guest memory file `memory` into a temporary file in
/// `work` (zstd, whose frames of zeros cost next to nothing: the file is
/// sparse). Blocking: seconds for a large guest.
pub fn pack_memory(memory: File, work: &Path) -> io::Result<PackedMemory> {
    let file = tempfile::NamedTempFile::new_in(work)?;
    let mut input = BufReader::with_capacity(1 << 20, memory);
    let out = HashingWriter::new(BufWriter::with_capacity(1 << 20, file.reopen()?));
    let mut encoder = zstd::Encoder::new(out, 3)?;
    io::copy(&mut input, &mut encoder)?;
    let (out, digest, bytes) = encoder.finish()?.finish();
    out.into_inner().map_err(|e| e.into_error())?.sync_all()?;
    Ok(PackedMemory {
        file: file.into_temp_path(),
        digest,
        bytes,
    })
}

/// Decompresses a pulled memory blob into `into` (created, sparse: a
/// block of zeros is skipped, not written), refusing more than `limit`
/// bytes (the guest's memory size: a blob that says more is not its
/// memory). Returns the bytes the guest memory has.
pub fn unpack_memory(packed: &Path, into: &Path, limit: u64) -> io::Result<u64> {
    const BLOCK: usize = 64 << 10;
    let mut decoder = zstd::Decoder::new(File::open(packed)?)?;
    let mut out = File::options().write(true).create_new(true).open(into)?;
    let mut buf = vec![0u8; BLOCK];
    let mut at: u64 = 0;
    loop {
        let n = read_full(&mut decoder, &mut buf)?;
        if n == 0 {
            break;
        }
        at += n as u64;
        if at > limit {
            return Err(io::Error::other(format!(
                "the memory blob holds more than the guest's {limit} bytes"
            )));
        }
        if buf[..n].iter().all(|&b| b == 0) {
            out.seek(SeekFrom::Current(n as i64))?;
        } else {
            out.write_all(&buf[..n])?;
        }
    }
    out.set_len(at)?;
    out.sync_all()?;
    Ok(at)
}

/// Reads until `buf` is full or the input ends.
fn read_full(r: &mut impl Read, buf: &mut [u8]) -> io::Result<usize> {
    let mut n = 0;
    while n < buf.len() {
        match r.read(&mut buf[n..]) {
            Ok(0) => break,
            Ok(k) => n += k,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(n)
}

/// What a push sends.
pub struct TemplatePush<'a> {
    /// The daemon's record of the template (JSON).
    pub config: Vec<u8>,
    /// The snapshot's `state.json`.
    pub state: &'a Path,
    pub memory: &'a PackedMemory,
    /// The stored image it boots, sent whole, and the store holding it.
    pub image: Option<(&'a Store, &'a Image)>,
}

/// What a push did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Pushed {
    /// The artifact's manifest.
    pub digest: Digest,
    /// Bytes sent, and bytes the registry had already.
    pub sent: u64,
    pub present: u64,
}

/// One blob of an artifact to push.
struct Part {
    what: String,
    media_type: String,
    digest: Digest,
    size: u64,
    path: PathBuf,
}

impl Part {
    fn of_file(what: &str, media_type: &str, path: &Path) -> Result<Self, PullError> {
        let file = File::open(path).map_err(|e| write_err(what, e))?;
        let mut hashing = crate::digest::HashingReader::new(file.take(MAX_STATE + 1));
        io::copy(&mut hashing, &mut io::sink()).map_err(|e| write_err(what, e))?;
        let (digest, size) = hashing.finish().map_err(|e| write_err(what, e))?;
        if size > MAX_STATE {
            return Err(write_err(
                what,
                io::Error::other(format!("larger than {MAX_STATE} bytes")),
            ));
        }
        Ok(Self {
            what: what.into(),
            media_type: media_type.into(),
            digest,
            size,
            path: path.to_owned(),
        })
    }

    fn descriptor(&self) -> serde_json::Value {
        serde_json::json!({
            "mediaType": self.media_type,
            "digest": self.digest.to_string(),
            "size": self.size,
        })
    }
}

fn write_err(what: &str, source: io::Error) -> PullError {
    PullError::Write {
        what: what.into(),
        source,
    }
}

fn registry_err(
    what: impl Into<String>,
) -> impl FnOnce(oci_client::errors::OciDistributionError) -> PullError {
    let what = what.into();
    move |source| PullError::Registry { what, source }
}

fn connect(registry: &Registry) -> (Client, RegistryAuth) {
    let client = Client::new(ClientConfig {
        protocol: registry::protocol(registry),
        ..Default::default()
    });
    (client, registry::auth(registry))
}

/// Pushes a template as `reference` (`host[:port]/repository:tag`).
pub async fn push_template(
    reference: &str,
    registry: &Registry,
    push: TemplatePush<'_>,
    progress: OnTransfer,
) -> Result<Pushed, PullError> {
    let mut parts = vec![
        Part::of_file("state", STATE_MEDIA_TYPE, push.state)?,
        Part {
            what: "memory".into(),
            media_type: MEMORY_MEDIA_TYPE.into(),
            digest: push.memory.digest.clone(),
            size: push.memory.bytes,
            path: push.memory.path().to_owned(),
        },
    ];
    // The image's blobs are read under the store's lock: a `gc` waits.
    let _lock = match push.image {
        Some((store, image)) => {
            let lock = store.lock(FlockOperation::LockShared)?;
            parts.push(Part {
                what: "image config".into(),
                media_type: IMAGE_CONFIG_MEDIA_TYPE.into(),
                digest: image.id.clone(),
                size: file_size(&store.blob_path(&image.id))?,
                path: store.blob_path(&image.id),
            });
            parts.extend(layer_parts(store, image));
            Some(lock)
        }
        None => None,
    };
    let sources = match push.image {
        Some((store, _)) => holders(store),
        None => Vec::new(),
    };
    let config = (CONFIG_MEDIA_TYPE, push.config);
    push_parts(reference, registry, config, &parts, &sources, progress).await
}

/// Pushes a stored image as `reference`: its configuration and its
/// layers as the store received them, under an OCI manifest. Blobs the
/// registry has are not sent again.
pub async fn push_image(
    store: &Store,
    image: &Image,
    reference: &str,
    registry: &Registry,
    progress: OnTransfer,
) -> Result<Pushed, PullError> {
    let _lock = store.lock(FlockOperation::LockShared)?;
    let config = store.read_blob(&image.id, MAX_JSON)?;
    let parts: Vec<Part> = layer_parts(store, image).collect();
    let sources = holders(store);
    let pushed = push_parts(
        reference,
        registry,
        (IMAGE_CONFIG_MEDIA_TYPE, config),
        &parts,
        &sources,
        progress,
    )
    .await?;
    // Known by that name now: a later push of an image sharing its layers
    // to the same registry mounts them from there.
    store.tag(reference, &image.id)?;
    Ok(pushed)
}

/// Repositories known to hold blobs: each image name in the store that
/// is a registry reference (where it was pulled from or pushed to), with
/// its image's blobs.
fn holders(store: &Store) -> Vec<(Reference, Vec<Digest>)> {
    let names = store.names().unwrap_or_default();
    names
        .into_iter()
        .filter_map(|(name, id)| {
            let reference = name.parse::<Reference>().ok()?;
            let image = store.image(&id).ok()?;
            let blobs = image.layers.iter().map(|l| l.blob.clone());
            Some((reference, blobs.chain([image.id]).collect()))
        })
        .collect()
}

fn layer_parts<'a>(store: &'a Store, image: &'a Image) -> impl Iterator<Item = Part> + 'a {
    let count = image.layers.len();
    image.layers.iter().enumerate().map(move |(i, layer)| Part {
        what: format!("layer {}/{count}", i + 1),
        media_type: layer.media_type.clone(),
        digest: layer.blob.clone(),
        size: layer.size,
        path: store.blob_path(&layer.blob),
    })
}

/// Sends each of `parts` the registry lacks, then `config` (its media
/// type and bytes) and the manifest naming them, as `reference`. A blob
/// another repository of the same registry holds (one of `sources`) is
/// mounted from there, not sent: a registry answers for blobs per
/// repository.
async fn push_parts(
    reference: &str,
    registry: &Registry,
    (config_type, config): (&str, Vec<u8>),
    parts: &[Part],
    sources: &[(Reference, Vec<Digest>)],
    progress: OnTransfer,
) -> Result<Pushed, PullError> {
    let target: Reference = reference
        .parse()
        .map_err(|_| PullError::Reference(reference.to_owned()))?;
    if target.digest().is_some() {
        return Err(PullError::Reference(format!(
            "{reference} (a push names a tag, not a digest)"
        )));
    }
    let (client, auth) = connect(registry);
    client
        .auth(&target, &auth, RegistryOperation::Push)
        .await
        .map_err(registry_err(format!("pushing to {}", target.whole())))?;
    let (mut sent, mut present) = (0, 0);
    for part in parts {
        let digest = part.digest.to_string();
        let have = client
            .blob_exists(&target, &digest)
            .await
            .map_err(registry_err(format!("asking for blob {digest}")))?;
        let have = have || mounted(&client, &target, sources, &part.digest).await;
        if have {
            present += part.size;
            progress(Transfer {
                what: part.what.clone(),
                bytes: part.size,
                total: part.size,
                present: true,
            });
            continue;
        }
        upload(&client, &target, part, progress.clone()).await?;
        sent += part.size;
    }
    let config_digest = Digest::of(&config);
    client
        .push_blob(&target, config.clone(), &config_digest.to_string())
        .await
        .map_err(registry_err("pushing the configuration"))?;
    sent += config.len() as u64;
    let manifest = serde_json::json!({
        "schemaVersion": 2,
        "mediaType": MANIFEST_MEDIA_TYPE,
        "config": {
            "mediaType": config_type,
            "digest": config_digest.to_string(),
            "size": config.len(),
        },
        "layers": parts.iter().map(Part::descriptor).collect::<Vec<_>>(),
    });
    let bytes = serde_json::to_vec(&manifest).expect("a manifest serializes");
    let digest = Digest::of(&bytes);
    client
        .push_manifest_raw(
            &target,
            bytes.clone(),
            MANIFEST_MEDIA_TYPE.parse().expect("a header value"),
        )
        .await
        .map_err(registry_err(format!(
            "pushing the manifest of {}",
            target.whole()
        )))?;
    sent += bytes.len() as u64;
    Ok(Pushed {
        digest,
        sent,
        present,
    })
}

/// Whether the blob `digest` could be mounted into `target`'s repository
/// from another repository of the same registry known to hold it.
async fn mounted(
    client: &Client,
    target: &Reference,
    sources: &[(Reference, Vec<Digest>)],
    digest: &Digest,
) -> bool {
    for (source, blobs) in sources {
        let there = source.resolve_registry() == target.resolve_registry()
            && source.repository() != target.repository()
            && blobs.contains(digest);
        if there
            && client
                .mount_blob(target, source, &digest.to_string())
                .await
                .is_ok()
        {
            return true;
        }
    }
    false
}

fn file_size(path: &Path) -> Result<u64, PullError> {
    std::fs::metadata(path)
        .map(|m| m.len())
        .map_err(|e| write_err(&path.display().to_string(), e))
}

/// Sends `part`'s file, in chunks of 4 MiB, saying how far it got.
async fn upload(
    client: &Client,
    target: &Reference,
    part: &Part,
    progress: OnTransfer,
) -> Result<(), PullError> {
    const CHUNK: usize = 4 << 20;
    let file = File::open(&part.path).map_err(|e| write_err(&part.what, e))?;
    let (what, total) = (part.what.clone(), part.size);
    let stream = futures_util::stream::unfold((file, 0u64), move |(mut file, done)| {
        let (what, progress) = (what.clone(), progress.clone());
        async move {
            let mut buf = vec![0u8; CHUNK];
            match read_full(&mut file, &mut buf) {
                Ok(0) => None,
                Ok(n) => {
                    buf.truncate(n);
                    let done = done + n as u64;
                    progress(Transfer {
                        what,
                        bytes: done,
                        total,
                        present: false,
                    });
                    Some((Ok(bytes::Bytes::from(buf)), (file, done)))
                }
                Err(e) => Some((
                    Err(oci_client::errors::OciDistributionError::IoError(e)),
                    (file, total),
                )),
            }
        }
    });
    client
        .push_blob_stream(target, stream, &part.digest.to_string(), Some(total))
        .await
        .map_err(registry_err(format!(
            "pushing {} ({})",
            part.what, part.digest
        )))?;
    Ok(())
}

/// A pulled template, ready to be put in place by the daemon.
pub struct PulledTemplate {
    /// The daemon's record of the template (JSON, at most 4 MiB).
    pub config: Vec<u8>,
    /// The snapshot's state as pushed (its files' paths are the pusher's).
    pub state: Vec<u8>,
    /// The compressed memory (see [`unpack_memory`]).
    pub memory: PulledMemory,
    /// The stored image it boots, now in the store (unnamed: pin it).
    pub image: Option<Image>,
    /// The artifact's manifest, and the bytes downloaded.
    pub digest: Digest,
    pub downloaded: u64,
}

/// A pulled template's compressed memory. With a store, it is a blob of
/// the store, downloaded as an image's blobs are (a pull that stopped
/// resumes where it stopped), and kept from a `gc` while this is held:
/// [`PulledMemory::unpacked`] removes it once it is of no more use, and a
/// pull that failed after the download leaves it for the next one (or a
/// `gc`). Without a store, a temporary file.
pub struct PulledMemory {
    path: PathBuf,
    in_store: Option<StoreLock>,
    _temp: Option<tempfile::NamedTempFile>,
}

impl PulledMemory {
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Done with: a blob of the store is removed.
    pub fn unpacked(self) {
        if self.in_store.is_some() {
            let _ = std::fs::remove_file(&self.path);
        }
    }
}

/// Pulls the template artifact `reference` names: its record, state and
/// memory (into the store, or a temporary file in `work` without one), and
/// its image, if it has one, into `store`.
pub async fn pull_template(
    store: Option<&Store>,
    reference: &str,
    registry: &Registry,
    work: &Path,
    progress: OnTransfer,
) -> Result<PulledTemplate, PullError> {
    let source: Reference = reference
        .parse()
        .map_err(|_| PullError::Reference(reference.to_owned()))?;
    let (client, auth) = connect(registry);
    let (bytes, digest) = registry::manifest(&client, &source, &auth, source.digest()).await?;
    let manifest: ImageManifest = import::json(&bytes, "the manifest")?;
    let config_type = manifest.config().media_type().to_string();
    if config_type != CONFIG_MEDIA_TYPE {
        return Err(PullError::NotATemplate {
            reference: reference.to_owned(),
            config: config_type,
        });
    }
    let mut downloaded = bytes.len() as u64;
    let config = small_blob(&client, &source, manifest.config(), MAX_JSON).await?;
    downloaded += config.len() as u64;
    let layers = manifest.layers();
    let kind = |i: usize| layers.get(i).map(|d| d.media_type().to_string());
    if kind(0).as_deref() != Some(STATE_MEDIA_TYPE) || kind(1).as_deref() != Some(MEMORY_MEDIA_TYPE)
    {
        return Err(PullError::Artifact(format!(
            "{reference} has no snapshot (state, then memory) as its first two blobs"
        )));
    }
    let state = small_blob(&client, &source, &layers[0], MAX_STATE).await?;
    downloaded += state.len() as u64;
    let memory = match store {
        Some(store) => {
            let lock = store.lock(FlockOperation::LockShared)?;
            let blob = Digest::try_from(layers[1].digest()).map_err(ImportError::from)?;
            if !store.blob_path(&blob).exists() {
                downloaded += layers[1].size();
            }
            let on = progress.clone();
            let mut each = move |p: import::Progress<'_>| {
                if let import::Progress::Fetched { bytes, total, .. } = p {
                    on(Transfer {
                        what: "memory".into(),
                        bytes,
                        total,
                        present: false,
                    });
                }
            };
            registry::fetch(&client, &source, store, &layers[1], Some((0, 1)), &mut each).await?;
            PulledMemory {
                path: store.blob_path(&blob),
                in_store: Some(lock),
                _temp: None,
            }
        }
        None => {
            let temp = tempfile::NamedTempFile::new_in(work).map_err(|e| write_err("memory", e))?;
            downloaded += big_blob(&client, &source, &layers[1], temp.path(), &progress).await?;
            PulledMemory {
                path: temp.path().to_owned(),
                in_store: None,
                _temp: Some(temp),
            }
        }
    };
    let image = match &layers[2..] {
        [] => None,
        [config, image_layers @ ..] => {
            let Some(store) = store else {
                return Err(PullError::Artifact(format!(
                    "{reference} carries its image, and this daemon has no image store"
                )));
            };
            if config.media_type().to_string() != IMAGE_CONFIG_MEDIA_TYPE {
                return Err(PullError::Artifact(format!(
                    "{reference}: its third blob is a {}, not an image configuration",
                    config.media_type()
                )));
            }
            let image_config = small_blob(&client, &source, config, MAX_JSON).await?;
            downloaded += image_config.len() as u64;
            let _lock = store.lock(FlockOperation::LockShared)?;
            let count = image_layers.len();
            let mut found = Vec::with_capacity(count);
            for (index, d) in image_layers.iter().enumerate() {
                let (blob, media_type) = registry::layer_of(d)?;
                let what = format!("layer {}/{count}", index + 1);
                if store.blob_path(&blob).exists() {
                    progress(Transfer {
                        what,
                        bytes: d.size(),
                        total: d.size(),
                        present: true,
                    });
                } else {
                    let on = progress.clone();
                    let mut each = move |p: import::Progress<'_>| {
                        if let import::Progress::Fetched { bytes, total, .. } = p {
                            on(Transfer {
                                what: what.clone(),
                                bytes,
                                total,
                                present: false,
                            });
                        }
                    };
                    let layer = Some((index, count));
                    registry::fetch(&client, &source, store, d, layer, &mut each).await?;
                    downloaded += d.size();
                }
                found.push((store.blob_path(&blob), Some(blob), media_type));
            }
            let found = Found {
                names: Vec::new(),
                manifest: None,
                config: image_config,
                layers: found,
            };
            let on = progress.clone();
            let mut each = move |p: import::Progress<'_>| {
                if let import::Progress::LayerStart {
                    index,
                    count,
                    bytes,
                    ..
                } = p
                {
                    on(Transfer {
                        what: format!("unpacking layer {}/{count}", index + 1),
                        bytes: 0,
                        total: bytes,
                        present: false,
                    });
                }
            };
            Some(import::finish(store, found, &mut each)?.image)
        }
    };
    Ok(PulledTemplate {
        config,
        state,
        memory,
        image,
        digest,
        downloaded,
    })
}

/// A blob of at most `limit` bytes, read into memory and checked.
async fn small_blob(
    client: &Client,
    source: &Reference,
    d: &Descriptor,
    limit: u64,
) -> Result<Vec<u8>, PullError> {
    let what = format!("blob {}", d.digest());
    if d.size() > limit {
        return Err(PullError::Artifact(format!(
            "{what} says it has {} bytes; at most {limit} are taken",
            d.size()
        )));
    }
    let mut bytes = Vec::new();
    let mut stream = client
        .pull_blob_stream(source, &registry::descriptor(d))
        .await
        .map_err(registry_err(what.clone()))?;
    while let Some(chunk) = stream.next().await {
        let chunk = chunk.map_err(|e| write_err(&what, e))?;
        bytes.extend_from_slice(&chunk);
        if bytes.len() as u64 > limit {
            return Err(PullError::Artifact(format!(
                "{what} is larger than {limit} bytes"
            )));
        }
    }
    check(d, &Digest::of(&bytes))?;
    Ok(bytes)
}

/// A blob of any size, into the file `into`, checked; returns its size.
async fn big_blob(
    client: &Client,
    source: &Reference,
    d: &Descriptor,
    into: &Path,
    progress: &OnTransfer,
) -> Result<u64, PullError> {
    let what = format!("blob {}", d.digest());
    let file = File::options()
        .write(true)
        .truncate(true)
        .open(into)
        .map_err(|e| write_err(&what, e))?;
    let mut out = HashingWriter::new(BufWriter::with_capacity(1 << 20, file));
    let mut stream = client
        .pull_blob_stream(source, &registry::descriptor(d))
        .await
        .map_err(registry_err(what.clone()))?;
    let mut last = 0;
    while let Some(chunk) = stream.next().await {
        let chunk = chunk.map_err(|e| write_err(&what, e))?;
        out.write_all(&chunk).map_err(|e| write_err(&what, e))?;
        let got = out.bytes();
        if got > d.size() {
            return Err(PullError::Artifact(format!(
                "{what} is larger than the {} bytes its manifest says",
                d.size()
            )));
        }
        if got - last >= 4 << 20 || got == d.size() {
            last = got;
            progress(Transfer {
                what: "memory".into(),
                bytes: got,
                total: d.size(),
                present: false,
            });
        }
    }
    let (file, digest, bytes) = out.finish();
    file.into_inner()
        .map_err(|e| write_err(&what, e.into_error()))?
        .sync_all()
        .map_err(|e| write_err(&what, e))?;
    check(d, &digest)?;
    Ok(bytes)
}

fn check(d: &Descriptor, found: &Digest) -> Result<(), PullError> {
    if found.to_string() != d.digest().to_string() {
        return Err(PullError::Mismatch {
            what: format!("blob {}", d.digest()),
            expected: d.digest().to_string(),
            found: found.clone(),
        });
    }
    Ok(())
}
