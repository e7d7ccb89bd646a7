//! Initramfs images built by forkbox: the guest's (the agent as `/init` plus
//! the kernel modules it loads) and the emulated host's (busybox, a shell
//! script as `/init`, kvm and 9p modules). Each is an uncompressed newc
//! cpio, cached by the digest of everything in it.

use std::path::{Path, PathBuf};

use crate::cache::{self, Key};
use crate::cpio::CpioWriter;
use crate::kernel::{Kernel, KernelError};

/// Modules the guest agent needs: the virtio-mmio transport, the root
/// disk, the agent channel, the overlay root, the file system of image
/// layers (loaded only for a layered root, `forkbox.layers=N`) and the
/// network (loaded only when the command line has `forkbox.net=1`).
pub const GUEST_MODULES: &[&str] = &[
    "virtio_mmio",
    "virtio_blk",
    "vmw_vsock_virtio_transport",
    "overlay",
    "erofs",
    "virtio_net",
];

#[derive(Debug, thiserror::Error)]
pub enum InitramfsError {
    #[error(transparent)]
    Kernel(#[from] KernelError),
    #[error("reading {path}")]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("writing {path}")]
    Write {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{0} is not a static executable: the guest has no libc to load it (build it with `make agent`)")]
    NotStatic(PathBuf),
}

/// One file to place in an initramfs.
pub struct Entry {
    pub path: String,
    pub mode: u32,
    pub data: Vec<u8>,
}

/// Builds (or finds in the cache) an initramfs holding `entries` plus the
/// kernel modules `modules` resolve to, listed in load order in
/// `/forkbox/modules.list` as absolute paths.
pub fn build(
    name: &str,
    kernel: &Kernel,
    modules: &[&str],
    entries: Vec<Entry>,
    symlinks: &[(&str, &str)],
) -> Result<PathBuf, InitramfsError> {
    let order = kernel.resolve_modules(modules)?;
    let mut key = Key::new("initramfs-v1");
    key.add(name.as_bytes()).add(kernel.version.as_bytes());
    let mut module_files = Vec::new();
    for rel in &order {
        let path = kernel.modules_dir.join(rel);
        let data = read(&path)?;
        key.add(rel.as_bytes()).add(&data);
        module_files.push((format!("lib/modules/{}/{rel}", kernel.version), data));
    }
    for e in &entries {
        key.add(e.path.as_bytes())
            .add(&e.mode.to_le_bytes())
            .add(&e.data);
    }
    for (link, target) in symlinks {
        key.add(link.as_bytes()).add(target.as_bytes());
    }
    let out = cache::root()
        .join("initramfs")
        .join(format!("{name}-{}.cpio", key.finish()));
    if out.exists() {
        return Ok(out);
    }

    let list: String = module_files
        .iter()
        .map(|(p, _)| format!("/{p}\n"))
        .collect();
    let mut dirs = std::collections::BTreeSet::new();
    let all_paths = module_files
        .iter()
        .map(|(p, _)| p.as_str())
        .chain(entries.iter().map(|e| e.path.as_str()))
        .chain(symlinks.iter().map(|(l, _)| *l))
        .chain(["forkbox/modules.list"]);
    for p in all_paths {
        let mut parent = Path::new(p.trim_start_matches('/')).parent();
        while let Some(d) = parent.filter(|d| !d.as_os_str().is_empty()) {
            dirs.insert(d.to_string_lossy().into_owned());
            parent = d.parent();
        }
    }

    let mut w = CpioWriter::new(Vec::new());
    let write_err = |source| InitramfsError::Write {
        path: out.clone(),
        source,
    };
    for d in ["dev", "proc", "sys", "tmp", "run"] {
        dirs.insert(d.into());
    }
    for d in &dirs {
        w.dir(d, 0o755).map_err(write_err)?;
    }
    for (p, data) in &module_files {
        w.file(p, 0o644, data).map_err(write_err)?;
    }
    w.file("forkbox/modules.list", 0o644, list.as_bytes())
        .map_err(write_err)?;
    for e in &entries {
        w.file(&e.path, e.mode, &e.data).map_err(write_err)?;
    }
    for (link, target) in symlinks {
        w.symlink(link, target).map_err(write_err)?;
    }
    let bytes = w.finish().map_err(write_err)?;
    write_atomic(&out, &bytes)?;
    Ok(out)
}

/// The guest initramfs: `agent` as `/init` plus [`GUEST_MODULES`].
pub fn guest(kernel: &Kernel, agent: &Path) -> Result<PathBuf, InitramfsError> {
    let data = read(agent)?;
    if !is_static_elf(&data) {
        return Err(InitramfsError::NotStatic(agent.to_owned()));
    }
    let init = Entry {
        path: "init".into(),
        mode: 0o755,
        data,
    };
    build("guest", kernel, GUEST_MODULES, vec![init], &[])
}

pub(crate) fn read(path: &Path) -> Result<Vec<u8>, InitramfsError> {
    std::fs::read(path).map_err(|source| InitramfsError::Read {
        path: path.to_owned(),
        source,
    })
}

pub(crate) fn write_atomic(path: &Path, bytes: &[u8]) -> Result<(), InitramfsError> {
    let err = |source| InitramfsError::Write {
        path: path.to_owned(),
        source,
    };
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).map_err(err)?;
    }
    let staging = cache::staging_path(path);
    std::fs::write(&staging, bytes).map_err(err)?;
    std::fs::rename(&staging, path).map_err(err)
}

/// True for a 64-bit ELF executable without a `PT_INTERP` program header,
/// i.e. one the kernel can run with no dynamic loader present.
pub fn is_static_elf(data: &[u8]) -> bool {
    const PT_INTERP: u32 = 3;
    if data.len() < 64 || &data[..4] != b"\x7fELF" || data[4] != 2 {
        return false;
    }
    let u16_at = |o: usize| u16::from_le_bytes([data[o], data[o + 1]]) as usize;
    let phoff = u64::from_le_bytes(data[0x20..0x28].try_into().unwrap_or_default()) as usize;
    let (phentsize, phnum) = (u16_at(0x36), u16_at(0x38));
    (0..phnum).all(|i| {
        let at = phoff + i * phentsize;
        match data.get(at..at + 4) {
            Some(t) => u32::from_le_bytes([t[0], t[1], t[2], t[3]]) != PT_INTERP,
            None => false,
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn is_static_elf_dynamic_binary_is_not() {
        let sh = std::fs::read("/bin/sh").expect("read /bin/sh");
        assert!(!is_static_elf(&sh));
    }

    #[test]
    fn is_static_elf_busybox_static_is() {
        // busybox-static is installed by `make deps`.
        let bb = std::fs::read("/bin/busybox").expect("read /bin/busybox");
        assert!(is_static_elf(&bb));
    }

    #[test]
    fn is_static_elf_garbage_is_not() {
        assert!(!is_static_elf(
            b"not an elf at all, just some bytes here........................."
        ));
        assert!(!is_static_elf(b""));
    }
}
