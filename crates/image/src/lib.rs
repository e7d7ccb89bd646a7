//! forkbox's image store: OCI images imported from a file (an OCI layout
//! or a `docker save` archive), each blob kept once by its digest and each
//! layer unpacked once into a read-only erofs file that every VM using it
//! reads (so the host's page cache holds it once too).
//!
//! - [`digest`]: `sha256` digests, the store's keys, and hashing streams.
//! - [`store`]: the directory layout, blobs, layers, image records, names,
//!   removal and garbage collection.
//! - [`layer`]: a layer's tar into a directory (OCI whiteouts made
//!   overlayfs whiteouts), then into erofs by `mkfs.erofs`.
//! - [`import`]: an image file's manifest, configuration and layers into
//!   the store, everything checked against its digest.
//! - [`registry`]: the same from a registry (`oci-client`), each blob
//!   downloaded once, a stopped download resumed.
//! - [`local_registry`]: a real registry on loopback, for tests and
//!   benchmarks.
//! - [`artifact`]: a baked template (its snapshot, and its image whole)
//!   pushed to a registry as one OCI artifact and pulled from it.
//!
//! It does not depend on the rest of forkbox: the VM runner is given
//! layer files, not this crate's types.

#![forbid(unsafe_code)]

pub mod artifact;
pub mod digest;
pub mod import;
pub mod layer;
pub mod local_registry;
pub mod registry;
pub mod store;

pub use digest::Digest;
pub use import::{import, ImportError, Imported, Progress};
pub use registry::{pull, PullError, Registry};
pub use store::{Image, LayerRef, RunConfig, Store, StoreError};
