//! Debian packages as build inputs: fetched with `apt-get download` (so the
//! machine's own apt sources and proxies apply) and unpacked with
//! `dpkg-deb -x` into the cache, once per exact package version.

use std::path::{Path, PathBuf};
use std::process::Command;

use crate::cache;

#[derive(Debug, thiserror::Error)]
pub enum DebError {
    #[error("`apt-get download {package}` failed: {stderr}\n  (run `apt-get update` first; on a machine without apt, install the package by hand)")]
    Download { package: String, stderr: String },
    #[error("cannot run {tool}: is it installed? (`make deps` installs everything forkbox needs)")]
    Tool {
        tool: &'static str,
        #[source]
        source: std::io::Error,
    },
    #[error("`dpkg-deb -x {deb}` failed: {stderr}")]
    Unpack { deb: PathBuf, stderr: String },
    #[error("cache I/O on {path}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

fn io_err(path: &Path) -> impl FnOnce(std::io::Error) -> DebError + '_ {
    move |source| DebError::Io {
        path: path.to_owned(),
        source,
    }
}

/// Returns the directory a package is unpacked in, downloading and
/// unpacking it first if the cache does not have it yet.
pub fn unpacked(package: &str) -> Result<PathBuf, DebError> {
    let root = cache::root().join("debs");
    let dir = root.join(package);
    if dir.join(".complete").exists() {
        return Ok(dir);
    }
    std::fs::create_dir_all(&root).map_err(io_err(&root))?;
    let _lock = cache::lock(&format!("deb-{package}")).map_err(io_err(&root))?;
    if dir.join(".complete").exists() {
        // Another process unpacked it while we waited.
        return Ok(dir);
    }
    let deb = download(package, &root)?;
    let staging = cache::staging_path(&dir);
    let _ = std::fs::remove_dir_all(&staging);
    std::fs::create_dir_all(&staging).map_err(io_err(&staging))?;
    let out = Command::new("dpkg-deb")
        .arg("-x")
        .arg(&deb)
        .arg(&staging)
        .output()
        .map_err(|source| DebError::Tool {
            tool: "dpkg-deb",
            source,
        })?;
    if !out.status.success() {
        return Err(DebError::Unpack {
            deb,
            stderr: String::from_utf8_lossy(&out.stderr).trim().to_owned(),
        });
    }
    std::fs::write(
        staging.join(".complete"),
        deb.file_name().unwrap_or_default().as_encoded_bytes(),
    )
    .map_err(io_err(&staging))?;
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::rename(&staging, &dir).map_err(io_err(&dir))?;
    Ok(dir)
}

/// Downloads `package`'s .deb into `dir` and returns its path.
fn download(package: &str, dir: &Path) -> Result<PathBuf, DebError> {
    eprintln!("forkbox: downloading Debian package {package}");
    let out = Command::new("apt-get")
        .args(["download", "-q", "-o", "APT::Sandbox::User=root", package])
        .current_dir(dir)
        .output()
        .map_err(|source| DebError::Tool {
            tool: "apt-get",
            source,
        })?;
    if !out.status.success() {
        return Err(DebError::Download {
            package: package.to_owned(),
            stderr: String::from_utf8_lossy(&out.stderr).trim().to_owned(),
        });
    }
    let prefix = format!("{package}_");
    let mut found = std::fs::read_dir(dir)
        .map_err(io_err(dir))?
        .filter_map(Result::ok)
        .map(|e| e.path())
        .filter(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with(&prefix) && n.ends_with(".deb"))
        })
        .collect::<Vec<_>>();
    found.sort();
    found.pop().ok_or_else(|| DebError::Download {
        package: package.to_owned(),
        stderr: "apt-get reported success but left no .deb".into(),
    })
}

/// The package a metapackage currently depends on (`apt-cache depends`),
/// e.g. `linux-image-cloud-amd64` → `linux-image-6.1.0-57-cloud-amd64`.
pub fn resolve_metapackage(meta: &str) -> Option<String> {
    let out = Command::new("apt-cache")
        .args(["depends", meta])
        .output()
        .ok()?;
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .find_map(|l| l.trim().strip_prefix("Depends: "))
        .map(|s| s.trim().to_owned())
}
