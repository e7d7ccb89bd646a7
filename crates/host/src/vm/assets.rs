//! What a boot needs besides the image: the guest kernel, its initramfs
//! and the `forkbox-vmm` binary, found where the build puts them.

use std::path::{Path, PathBuf};

use crate::initramfs::{self};
use crate::kernel::Kernel;

use super::*;

/// Everything a boot needs besides the image: kernel, initramfs, VMM.
#[derive(Debug, Clone)]
pub struct Assets {
    pub kernel: Kernel,
    pub initramfs: PathBuf,
    /// The kernel's module tree as a disk ([`crate::image::modules_disk`]).
    pub modules: PathBuf,
    pub vmm: PathBuf,
}

impl Assets {
    /// Fetches or builds (once, cached) the guest kernel and initramfs and
    /// finds the `forkbox-vmm` and `forkbox-agent` binaries.
    pub fn prepare() -> Result<Self, VmError> {
        let kernel = Kernel::guest()?;
        let agent = find_binary("forkbox-agent", "FORKBOX_AGENT")?;
        let initramfs = initramfs::guest(&kernel, &agent)?;
        let modules = crate::image::modules_disk(&kernel)?;
        let vmm = find_binary("forkbox-vmm", "FORKBOX_VMM")?;
        Ok(Self {
            kernel,
            initramfs,
            modules,
            vmm,
        })
    }
}

/// Where the build puts forkbox's binaries, nearest first: next to the
/// running program (or its parent, for test binaries in `deps/`), and the
/// static agent's own target directory.
pub(crate) fn find_binary(name: &'static str, env: &str) -> Result<PathBuf, VmError> {
    if let Some(p) = std::env::var_os(env) {
        return Ok(PathBuf::from(p));
    }
    let mut looked = Vec::new();
    if let Some(dir) = std::env::current_exe()
        .ok()
        .and_then(|e| e.parent().map(Path::to_owned))
    {
        let mut candidates = Vec::new();
        for d in [Some(dir.as_path()), dir.parent()].into_iter().flatten() {
            if name == "forkbox-agent" {
                // target/<profile>/ → target/x86_64-unknown-linux-gnu/release/
                if let Some(target) = d.parent() {
                    candidates.push(target.join("x86_64-unknown-linux-gnu/release").join(name));
                }
            } else {
                candidates.push(d.join(name));
            }
        }
        for c in candidates {
            if c.is_file() {
                return Ok(c);
            }
            looked.push(c.display().to_string());
        }
    }
    Err(VmError::MissingBinary {
        name,
        looked: looked.join(", "),
    })
}
