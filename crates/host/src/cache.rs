//! Where forkbox keeps what it builds and downloads: one cache directory,
//! every entry named by the digest of what went into it, written to a
//! temporary name and renamed into place so a half-built entry is never seen.

use std::path::{Path, PathBuf};

use sha2::{Digest, Sha256};

/// The cache root: `$FORKBOX_CACHE`, else `$XDG_CACHE_HOME/forkbox`, else
/// `~/.cache/forkbox`.
pub fn root() -> PathBuf {
    if let Some(dir) = std::env::var_os("FORKBOX_CACHE") {
        return PathBuf::from(dir);
    }
    if let Some(dir) = std::env::var_os("XDG_CACHE_HOME") {
        return PathBuf::from(dir).join("forkbox");
    }
    let home = std::env::var_os("HOME").unwrap_or_else(|| "/root".into());
    PathBuf::from(home).join(".cache").join("forkbox")
}

/// A content key: the hex SHA-256 of everything that determines an entry.
#[derive(Default)]
pub struct Key(Sha256);

impl Key {
    pub fn new(kind: &str) -> Self {
        let mut key = Self::default();
        key.add(kind.as_bytes());
        key
    }

    /// Adds one input, length-prefixed so that inputs cannot run together.
    pub fn add(&mut self, bytes: &[u8]) -> &mut Self {
        self.0.update((bytes.len() as u64).to_le_bytes());
        self.0.update(bytes);
        self
    }

    /// Adds the bytes of a file.
    pub fn add_file(&mut self, path: &Path) -> std::io::Result<&mut Self> {
        let bytes = std::fs::read(path)?;
        Ok(self.add(&bytes))
    }

    /// The first 16 bytes of the digest, in hex: enough to tell entries apart.
    pub fn finish(self) -> String {
        hex::encode(&self.0.finalize()[..16])
    }
}

/// Takes the cache-wide lock `name` (blocking until other processes
/// building the same entry are done); it is released when the returned file
/// is dropped. Builders check for their entry again after taking it.
pub fn lock(name: &str) -> std::io::Result<std::fs::File> {
    let dir = root().join("locks");
    std::fs::create_dir_all(&dir)?;
    let file = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(dir.join(format!("{name}.lock")))?;
    file.lock()?;
    Ok(file)
}

/// A sibling path to build into before renaming onto `path`, its own to
/// this call: two threads of one process building the same entry at once
/// (two test-bed shards preparing their initramfs) must not share one, or
/// the second rename finds the first's staging file gone.
pub fn staging_path(path: &Path) -> PathBuf {
    static CALLS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let call = CALLS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let mut name = path.file_name().unwrap_or_default().to_os_string();
    name.push(format!(".tmp-{}-{call}", std::process::id()));
    path.with_file_name(name)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn staging_paths_differ_between_calls_of_one_process() {
        let out = Path::new("/cache/initramfs/testbed-abc.cpio");
        let (a, b) = (staging_path(out), staging_path(out));
        assert_ne!(a, b);
        assert_eq!(a.parent(), out.parent());
    }

    #[test]
    fn key_same_inputs_same_digest() {
        let mut a = Key::new("x");
        a.add(b"one").add(b"two");
        let mut b = Key::new("x");
        b.add(b"one").add(b"two");
        assert_eq!(a.finish(), b.finish());
    }

    #[test]
    fn key_inputs_do_not_run_together() {
        let mut a = Key::new("x");
        a.add(b"ab").add(b"c");
        let mut b = Key::new("x");
        b.add(b"a").add(b"bc");
        assert_ne!(a.finish(), b.finish());
    }
}
