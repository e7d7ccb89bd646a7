//! Pulling an image from a registry, over the OCI distribution protocol
//! (`oci-client`: anonymous, basic or bearer-token auth, the token asked
//! for as the registry's challenge says; plain HTTP only when asked, for a
//! registry on loopback).
//!
//! Every blob is downloaded into `tmp/partial-<digest>` and checked
//! against its digest as it enters the store; a pull that stops (the
//! registry went away, the process was killed) leaves the part it had, and
//! the next pull of any image with that blob asks the registry for the
//! rest only (a ranged request). Blobs the store has are not downloaded.

use std::fs::{self, File, OpenOptions};
use std::io::{self, Write};

use futures_util::StreamExt;
use oci_client::client::{BlobResponse, ClientConfig, ClientProtocol};
use oci_client::manifest::OciDescriptor;
use oci_client::secrets::RegistryAuth;
use oci_client::{Client, Reference};
use oci_spec::image::{Descriptor, ImageIndex, ImageManifest};
use rustix::fs::FlockOperation;

use crate::digest::Digest;
use crate::import::{self, Found, ImportError, Imported, Progress, MAX_JSON};
use crate::store::{Store, StoreError};

/// The manifest kinds a pull accepts.
const ACCEPTED: [&str; 4] = [
    "application/vnd.oci.image.manifest.v1+json",
    "application/vnd.oci.image.index.v1+json",
    "application/vnd.docker.distribution.manifest.v2+json",
    "application/vnd.docker.distribution.manifest.list.v2+json",
];

/// How to reach a registry.
#[derive(Debug, Clone, Default)]
pub struct Registry {
    /// `None`: anonymous (a registry that answers with a token challenge
    /// gets an anonymous token request).
    pub auth: Option<(String, String)>,
    /// Speak HTTP, not HTTPS (a registry on loopback).
    pub plain_http: bool,
}

#[derive(Debug, thiserror::Error)]
pub enum PullError {
    #[error("`{0}` is not an image reference (host[:port]/repository[:tag|@sha256:…])")]
    Reference(String),
    #[error("the registry, for {what}")]
    Registry {
        what: String,
        #[source]
        source: oci_client::errors::OciDistributionError,
    },
    #[error("the registry sent {what} as {found}, not the {expected} asked for")]
    Mismatch {
        what: String,
        expected: String,
        found: Digest,
    },
    #[error("writing {what} into the store")]
    Write {
        what: String,
        #[source]
        source: io::Error,
    },
    #[error(transparent)]
    Import(#[from] ImportError),
    #[error("`{reference}` is not a forkbox template (its configuration is a {config}): pull images with `forkbox image pull`")]
    NotATemplate { reference: String, config: String },
    #[error("{0}")]
    Artifact(String),
}

impl From<StoreError> for PullError {
    fn from(e: StoreError) -> Self {
        PullError::Import(ImportError::Store(e))
    }
}

/// Pulls `reference` into `store` and names it `reference` as written.
pub async fn pull(
    store: &Store,
    reference: &str,
    registry: &Registry,
    progress: &mut (dyn FnMut(Progress<'_>) + Send),
) -> Result<Imported, PullError> {
    let image: Reference = reference
        .parse()
        .map_err(|_| PullError::Reference(reference.to_owned()))?;
    let client = Client::new(ClientConfig {
        protocol: protocol(registry),
        ..Default::default()
    });
    let auth = auth(registry);
    let _lock = store.lock(FlockOperation::LockShared)?;
    let (bytes, digest) = manifest(&client, &image, &auth, image.digest()).await?;
    let (bytes, digest) = match media_type(&bytes).as_deref() {
        Some(
            "application/vnd.oci.image.index.v1+json"
            | "application/vnd.docker.distribution.manifest.list.v2+json",
        ) => {
            let index: ImageIndex = import::json(&bytes, "the image index")?;
            let chosen = import::pick_platform(index.manifests())?;
            let wanted = chosen.digest().to_string();
            let by_digest = image.clone_with_digest(wanted.clone());
            manifest(&client, &by_digest, &auth, Some(&wanted)).await?
        }
        _ => (bytes, digest),
    };
    let parsed: ImageManifest = import::json(&bytes, "the manifest")?;
    store.put_blob(&digest, None, MAX_JSON, &bytes[..])?;
    let config_digest = Digest::try_from(parsed.config().digest()).map_err(ImportError::from)?;
    fetch(&client, &image, store, parsed.config(), None, progress).await?;
    let config = store.read_blob(&config_digest, MAX_JSON)?;
    let count = parsed.layers().len();
    let mut layers = Vec::with_capacity(count);
    for (index, d) in parsed.layers().iter().enumerate() {
        let (blob, media_type) = layer_of(d)?;
        fetch(&client, &image, store, d, Some((index, count)), progress).await?;
        layers.push((store.blob_path(&blob), Some(blob), media_type));
    }
    let found = Found {
        names: vec![reference.to_owned()],
        manifest: Some(digest),
        config,
        layers,
    };
    let imported = import::finish(store, found, progress)?;
    store.tag(reference, &imported.image.id)?;
    Ok(imported)
}

pub(crate) fn protocol(registry: &Registry) -> ClientProtocol {
    if registry.plain_http {
        ClientProtocol::Http
    } else {
        ClientProtocol::Https
    }
}

pub(crate) fn auth(registry: &Registry) -> RegistryAuth {
    match &registry.auth {
        Some((user, password)) => RegistryAuth::Basic(user.clone(), password.clone()),
        None => RegistryAuth::Anonymous,
    }
}

/// The manifest `image` names, checked against `expected` (or its own
/// digest, where the reference names a tag).
pub(crate) async fn manifest(
    client: &Client,
    image: &Reference,
    auth: &RegistryAuth,
    expected: Option<&str>,
) -> Result<(Vec<u8>, Digest), PullError> {
    let (bytes, said) = client
        .pull_manifest_raw(image, auth, &ACCEPTED)
        .await
        .map_err(|source| PullError::Registry {
            what: format!("the manifest of {}", image.whole()),
            source,
        })?;
    if bytes.len() as u64 > MAX_JSON {
        return Err(PullError::Write {
            what: "the manifest".into(),
            source: io::Error::other(format!("larger than {MAX_JSON} bytes")),
        });
    }
    let found = Digest::of(&bytes);
    let expected = expected.unwrap_or(&said);
    if found.to_string() != expected {
        return Err(PullError::Mismatch {
            what: format!("the manifest of {}", image.whole()),
            expected: expected.to_owned(),
            found,
        });
    }
    Ok((bytes.to_vec(), found))
}

/// `d` as `oci-client` takes it.
pub(crate) fn descriptor(d: &Descriptor) -> OciDescriptor {
    OciDescriptor {
        media_type: d.media_type().to_string(),
        digest: d.digest().to_string(),
        size: i64::try_from(d.size()).unwrap_or(i64::MAX),
        urls: None,
        annotations: None,
        artifact_type: None,
    }
}

/// A layer's blob digest and media type, refused unless it is a layer.
pub(crate) fn layer_of(d: &Descriptor) -> Result<(Digest, String), PullError> {
    let media_type = d.media_type().to_string();
    if !import::is_layer(&media_type) {
        return Err(ImportError::MediaType {
            what: format!("layer {}", d.digest()),
            media_type,
        }
        .into());
    }
    let blob = Digest::try_from(d.digest()).map_err(ImportError::from)?;
    Ok((blob, media_type))
}

fn media_type(bytes: &[u8]) -> Option<String> {
    let v: serde_json::Value = serde_json::from_slice(bytes).ok()?;
    v.get("mediaType")?.as_str().map(str::to_owned)
}

/// Downloads the blob `d` into the store, unless it has it: resuming a
/// part an earlier pull left, checked against its digest as it enters.
pub(crate) async fn fetch(
    client: &Client,
    image: &Reference,
    store: &Store,
    d: &Descriptor,
    layer: Option<(usize, usize)>,
    progress: &mut (dyn FnMut(Progress<'_>) + Send),
) -> Result<(), PullError> {
    let digest = Digest::try_from(d.digest()).map_err(ImportError::from)?;
    if store.blob_path(&digest).exists() {
        return Ok(());
    }
    let partial = store
        .root()
        .join("tmp")
        .join(format!("partial-{}", digest.hex()));
    let write_err = |source| PullError::Write {
        what: format!("blob {digest}"),
        source,
    };
    let mut have = fs::metadata(&partial).map_or(0, |m| m.len());
    if have > d.size() {
        fs::remove_file(&partial).map_err(write_err)?;
        have = 0;
    }
    let descriptor = descriptor(d);
    if have < d.size() {
        let response = client
            .pull_blob_stream_partial(image, &descriptor, have, None)
            .await
            .map_err(|source| PullError::Registry {
                what: format!("blob {digest}"),
                source,
            })?;
        let (mut stream, resumed) = match response {
            BlobResponse::Partial(s) => (s, true),
            // The registry sent the whole blob: start again.
            BlobResponse::Full(s) => (s, false),
        };
        if !resumed {
            have = 0;
        }
        let mut file = OpenOptions::new()
            .create(true)
            .write(true)
            .append(resumed)
            .truncate(!resumed)
            .open(&partial)
            .map_err(write_err)?;
        while let Some(chunk) = stream.next().await {
            let chunk = chunk.map_err(|source| PullError::Write {
                what: format!("blob {digest} (the download stopped; pull again to resume)"),
                source,
            })?;
            file.write_all(&chunk).map_err(write_err)?;
            have += chunk.len() as u64;
            if have > d.size() {
                break;
            }
            if let Some((index, count)) = layer {
                progress(Progress::Fetched {
                    index,
                    count,
                    blob: &digest,
                    bytes: have,
                    total: d.size(),
                });
            }
        }
        file.sync_all().map_err(write_err)?;
    }
    let file = File::open(&partial).map_err(write_err)?;
    let stored = store.put_blob(&digest, Some(d.size()), d.size(), file);
    // Wrong bytes are of no use to a later pull either.
    if !matches!(stored, Err(StoreError::Io { .. })) {
        let _ = fs::remove_file(&partial);
    }
    stored?;
    Ok(())
}
