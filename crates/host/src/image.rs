//! Guest root filesystem images, built from Debian packages: `minimal`
//! (busybox-static, seconds to build) and `debian` (a bookworm minbase made
//! by mmdebstrap, with python3, git, procps and ca-certificates). Each is a
//! read-only ext4 image file (the guest kernel has ext4 built in), built
//! once and cached under the digest of its recipe and inputs.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use crate::cache::{self, Key};
use crate::debs::{self, DebError};

/// The images forkbox knows how to build.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ImageName {
    Minimal,
    Debian,
    /// Debian with Docker from Debian's packages (`docker.io`,
    /// `docker-compose`): a sandbox runs its own `dockerd` on a writable
    /// disk (docs: README, "Docker in a sandbox").
    Docker,
}

impl ImageName {
    pub const ALL: [ImageName; 3] = [ImageName::Minimal, ImageName::Debian, ImageName::Docker];

    pub fn as_str(self) -> &'static str {
        match self {
            ImageName::Minimal => "minimal",
            ImageName::Debian => "debian",
            ImageName::Docker => "docker",
        }
    }
}

impl std::fmt::Display for ImageName {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::str::FromStr for ImageName {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        Self::ALL
            .into_iter()
            .find(|i| i.as_str() == s)
            .ok_or_else(|| {
                format!("no image `{s}`: the images are `minimal`, `debian` and `docker`")
            })
    }
}

/// Packages added to the bookworm minbase of the `debian` image.
pub const DEBIAN_PACKAGES: &[&str] = &["python3", "git", "procps", "ca-certificates"];
/// Packages added to the bookworm minbase of the `docker` image: Docker
/// 20.10 and Compose 1.29 as Debian packages them, and what they call
/// (`iptables` for its networks, `kmod` for the kernel's modules).
pub const DOCKER_PACKAGES: &[&str] = &[
    "docker.io",
    "docker-compose",
    "iptables",
    "kmod",
    "procps",
    "ca-certificates",
];
const DEBIAN_SUITE: &str = "bookworm";

/// How the `docker` image's `dockerd` is started (the built-in `docker`
/// template's setup): in a session of its own, so that it outlives the
/// command that starts it, with its log in `/var/log/dockerd.log`.
///
/// `containerd` is started first and waited for (10 minutes at most), and
/// `dockerd` told to use it: a `dockerd` that starts its own gives up
/// when that one is not up within its fixed 60 s, which a loaded host (the
/// emulated one running two VMs) missed (containerd's log:
/// `/var/log/containerd.log`).
pub const DOCKERD_START: &str = "setsid sh -c 'containerd >/var/log/containerd.log 2>&1 & \
     i=0; until [ -S /run/containerd/containerd.sock ]; do i=$((i+1)); \
     if [ $i -gt 1200 ]; then echo containerd did not start; exit 1; fi; sleep 0.5; done; \
     exec dockerd --containerd=/run/containerd/containerd.sock --log-level=warn' \
     >/var/log/dockerd.log 2>&1 </dev/null &";

/// The unprivileged user every image has (uid/gid 1000).
pub const USER: &str = "user";

#[derive(Debug, thiserror::Error)]
pub enum ImageError {
    #[error("fetching busybox-static")]
    Busybox(#[from] DebError),
    #[error("cannot run {tool} (install it: `apt-get install {package}`)")]
    Tool {
        tool: &'static str,
        package: &'static str,
        #[source]
        source: std::io::Error,
    },
    #[error("{tool} failed: {stderr}")]
    Failed { tool: &'static str, stderr: String },
    #[error("building the image in {path}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

fn io_err(path: &Path) -> impl FnOnce(std::io::Error) -> ImageError + '_ {
    move |source| ImageError::Io {
        path: path.to_owned(),
        source,
    }
}

/// Returns the path of the image file, building it first if needed.
pub fn ensure(name: ImageName) -> Result<PathBuf, ImageError> {
    // One builder per image at a time; the others find its result.
    let _lock = cache::lock(&format!("image-{}", name.as_str())).map_err(io_err(&cache::root()))?;
    match name {
        ImageName::Minimal => minimal(),
        ImageName::Debian => bookworm("debian", "image-debian-v1", DEBIAN_PACKAGES, &[]),
        // `user` in the `docker` group: the policy runs Docker, which
        // makes it root in its own guest (docs/SECURITY.md).
        ImageName::Docker => bookworm(
            "docker",
            "image-docker-v1",
            DOCKER_PACKAGES,
            &["chroot \"$1\" usermod -aG docker user"],
        ),
    }
}

/// The `sha256:…` digest of the built-in image's disk file, building it
/// first if need be: a snapshot made on one host restores on another only
/// over the same bytes (a pulled template checks it). Kept beside the
/// file in `<file>.sha256` once computed, since a built image never
/// changes; a cache that cannot be written (one mounted read-only) costs
/// a read of the file each time.
pub fn digest(name: ImageName) -> Result<String, ImageError> {
    use sha2::{Digest, Sha256};
    let path = ensure(name)?;
    let kept = path.with_extension("ext4.sha256");
    if let Ok(text) = std::fs::read_to_string(&kept) {
        if text.starts_with("sha256:") && text.len() == 71 {
            return Ok(text);
        }
    }
    let mut hasher = Sha256::new();
    let mut file = std::fs::File::open(&path).map_err(io_err(&path))?;
    std::io::copy(&mut file, &mut hasher).map_err(io_err(&path))?;
    let digest = format!("sha256:{}", hex::encode(hasher.finalize()));
    let _ = std::fs::write(&kept, &digest);
    Ok(digest)
}

/// The built-in image's files as a directory (its ext4 unpacked by
/// `debugfs rdump`, which keeps owners and modes), for a runtime that
/// takes a directory as a root (gVisor), with empty mount points for
/// `mount_points` (absolute paths; files where `(path, true)`). Made once
/// beside the image file; never written after.
pub fn rootfs_dir(name: ImageName, mount_points: &[(&str, bool)]) -> Result<PathBuf, ImageError> {
    let image = ensure(name)?;
    let mut key = Key::new("rootfs-dir-v1");
    key.add(image.to_string_lossy().as_bytes());
    for (path, file) in mount_points {
        key.add(path.as_bytes()).add(&[u8::from(*file)]);
    }
    let out = image.with_extension(format!("rootfs-{}", key.finish()));
    if out.is_dir() {
        return Ok(out);
    }
    let _lock =
        cache::lock(&format!("rootfs-{}", name.as_str())).map_err(io_err(&cache::root()))?;
    if out.is_dir() {
        return Ok(out);
    }
    let staging = cache::staging_path(&out);
    let _ = std::fs::remove_dir_all(&staging);
    std::fs::create_dir_all(&staging).map_err(io_err(&staging))?;
    let dump = format!("rdump / {}", staging.display());
    run_tool(
        Command::new("debugfs").arg("-R").arg(&dump).arg(&image),
        "debugfs",
        "e2fsprogs",
    )?;
    // debugfs says what it could not dump and still succeeds: a missing
    // file is found here rather than in a sandbox.
    if !staging.join("bin").exists() {
        return Err(ImageError::Failed {
            tool: "debugfs",
            stderr: format!("rdump of {} left no /bin", image.display()),
        });
    }
    for (path, file) in mount_points {
        let at = staging.join(path.trim_start_matches('/'));
        if let Some(parent) = at.parent() {
            std::fs::create_dir_all(parent).map_err(io_err(parent))?;
        }
        if *file {
            std::fs::write(&at, b"").map_err(io_err(&at))?;
        } else {
            std::fs::create_dir_all(&at).map_err(io_err(&at))?;
        }
    }
    std::fs::rename(&staging, &out).map_err(io_err(&out))?;
    Ok(out)
}

/// The guest kernel's whole module tree (`lib/modules/<version>`) as a
/// read-only erofs disk every VM is given beside its root, mounted at
/// `/lib/modules/<version>`: the kernel loads what a guest asks for
/// (overlay, bridge, veth, netfilter, ...) on demand, and no image is
/// made bigger by it. Made the same way every time (a fixed time, UUID
/// and owner; erofs sorts its directories), so every host with the same
/// kernel package and erofs-utils has the same bytes, which a snapshot's
/// guest may have read.
pub fn modules_disk(kernel: &crate::kernel::Kernel) -> Result<PathBuf, ImageError> {
    let mut key = Key::new("modules-erofs-v1");
    key.add(kernel.package.as_bytes())
        .add(kernel.version.as_bytes());
    let dep = kernel.modules_dir.join("modules.dep");
    key.add_file(&dep).map_err(io_err(&dep))?;
    let out = cache::root().join("images").join(format!(
        "modules-{}-{}.erofs",
        kernel.version,
        key.finish()
    ));
    if out.exists() {
        return Ok(out);
    }
    let _lock =
        cache::lock(&format!("modules-{}", kernel.version)).map_err(io_err(&cache::root()))?;
    if out.exists() {
        return Ok(out);
    }
    let parent = out.parent().unwrap_or(Path::new("."));
    std::fs::create_dir_all(parent).map_err(io_err(parent))?;
    let staging = cache::staging_path(&out);
    run_tool(
        Command::new("mkfs.erofs")
            .args(["--quiet", "-zlz4hc", "-T0", "--all-root"])
            .args(["-U", "6f726b62-6f78-4000-8000-6d6f64756c65"])
            .arg(&staging)
            .arg(&kernel.modules_dir),
        "mkfs.erofs",
        "erofs-utils",
    )?;
    std::fs::rename(&staging, &out).map_err(io_err(&out))?;
    Ok(out)
}

/// The busybox image.
fn minimal() -> Result<PathBuf, ImageError> {
    let busybox_dir = debs::unpacked("busybox-static")?;
    let busybox = busybox_dir.join("bin/busybox");
    let mut key = Key::new("image-minimal-v1");
    key.add_file(&busybox).map_err(io_err(&busybox))?;
    let out = image_path("minimal", key);
    if out.exists() {
        return Ok(out);
    }
    let start = Instant::now();
    eprintln!("forkbox: building image `minimal` from busybox-static");
    let root = tempfile::tempdir().map_err(io_err(Path::new("/tmp")))?;
    let r = root.path();
    for d in [
        "bin",
        "sbin",
        "usr/bin",
        "usr/sbin",
        "etc",
        "dev",
        "proc",
        "sys",
        "tmp",
        "run",
        "root",
        "home/user",
        "var/tmp",
        "mnt",
    ] {
        std::fs::create_dir_all(r.join(d)).map_err(io_err(r))?;
    }
    std::fs::copy(&busybox, r.join("bin/busybox")).map_err(io_err(&busybox))?;
    let list = run_tool(
        Command::new(&busybox).arg("--list-full"),
        "busybox",
        "busybox-static",
    )?;
    for applet in list.lines().map(str::trim).filter(|l| !l.is_empty()) {
        let link = r.join(applet);
        if applet == "bin/busybox" || link.exists() {
            continue;
        }
        // Relative links, so they resolve inside the guest's root.
        let depth = applet.matches('/').count();
        let target = format!("{}bin/busybox", "../".repeat(depth));
        std::os::unix::fs::symlink(target, &link).map_err(io_err(&link))?;
    }
    write_identity(r)?;
    std::fs::set_permissions(
        r.join("tmp"),
        std::os::unix::fs::PermissionsExt::from_mode(0o1777),
    )
    .map_err(io_err(r))?;
    make_ext4(r, &out)?;
    eprintln!(
        "forkbox: image `minimal` built in {:.1} s: {}",
        start.elapsed().as_secs_f64(),
        out.display()
    );
    Ok(out)
}

/// The Debian minbase image.
/// A built-in image `name`: the bookworm minbase with `packages`, then
/// `hooks` (mmdebstrap customize hooks, `$1` the root).
fn bookworm(
    name: &str,
    kind: &str,
    packages: &[&str],
    hooks: &[&str],
) -> Result<PathBuf, ImageError> {
    let mut key = Key::new(kind);
    key.add(DEBIAN_SUITE.as_bytes());
    for p in packages {
        key.add(p.as_bytes());
    }
    for h in hooks {
        key.add(h.as_bytes());
    }
    let out = image_path(name, key);
    if out.exists() {
        return Ok(out);
    }
    let start = Instant::now();
    eprintln!(
        "forkbox: building image `{name}` ({DEBIAN_SUITE} minbase + {}) with mmdebstrap; this takes a few minutes once",
        packages.join(", ")
    );
    let root = tempfile::tempdir().map_err(io_err(Path::new("/tmp")))?;
    let r = root.path();
    let status = Command::new("mmdebstrap")
        .args(["--variant=minbase", "--format=directory"])
        .arg(format!("--include={}", packages.join(",")))
        .arg("--customize-hook=chroot \"$1\" useradd --uid 1000 --create-home --shell /bin/sh user")
        .args(hooks.iter().map(|h| format!("--customize-hook={h}")))
        .arg("--customize-hook=rm -rf \"$1\"/var/cache/apt/archives/*.deb \"$1\"/var/lib/apt/lists/*")
        .arg(DEBIAN_SUITE)
        .arg(r)
        .status()
        .map_err(|source| ImageError::Tool {
            tool: "mmdebstrap",
            package: "mmdebstrap",
            source,
        })?;
    if !status.success() {
        return Err(ImageError::Failed {
            tool: "mmdebstrap",
            stderr: format!("exited with {status} (its output is above)"),
        });
    }
    std::fs::write(r.join("etc/hostname"), "forkbox\n").map_err(io_err(r))?;
    make_ext4(r, &out)?;
    eprintln!(
        "forkbox: image `{name}` built in {:.1} s: {}",
        start.elapsed().as_secs_f64(),
        out.display()
    );
    Ok(out)
}

fn image_path(name: &str, key: Key) -> PathBuf {
    cache::root()
        .join("images")
        .join(format!("{name}-{}.ext4", key.finish()))
}

/// `/etc/passwd`, `/etc/group` and friends for the busybox image: root and
/// the unprivileged `user`.
fn write_identity(root: &Path) -> Result<(), ImageError> {
    let files: &[(&str, &str)] = &[
        (
            "etc/passwd",
            "root:x:0:0:root:/root:/bin/sh\nuser:x:1000:1000:user:/home/user:/bin/sh\nnobody:x:65534:65534:nobody:/nonexistent:/bin/false\n",
        ),
        ("etc/group", "root:x:0:\nuser:x:1000:\nnogroup:x:65534:\n"),
        ("etc/hostname", "forkbox\n"),
        ("etc/hosts", "127.0.0.1 localhost\n127.0.1.1 forkbox\n"),
    ];
    for (path, text) in files {
        let p = root.join(path);
        std::fs::write(&p, text).map_err(io_err(&p))?;
    }
    let home = root.join("home/user");
    std::os::unix::fs::chown(&home, Some(1000), Some(1000)).map_err(io_err(&home))
}

/// Packs `dir` into an ext4 image at `out` sized to fit, written to a
/// staging name first.
fn make_ext4(dir: &Path, out: &Path) -> Result<(), ImageError> {
    let used = du_bytes(dir)?;
    // Room for metadata; the image is mounted read-only, so no free space
    // is needed beyond what mke2fs itself wants.
    let size_kib = (used / 1024) * 13 / 10 + 16 * 1024;
    let parent = out.parent().unwrap_or(Path::new("."));
    std::fs::create_dir_all(parent).map_err(io_err(parent))?;
    let staging = cache::staging_path(out);
    let _ = std::fs::remove_file(&staging);
    run_tool(
        Command::new("mke2fs")
            .args([
                "-q",
                "-t",
                "ext4",
                "-O",
                "^has_journal",
                "-m",
                "0",
                "-L",
                "forkbox-root",
            ])
            .args(["-E", "root_owner=0:0"])
            .arg("-d")
            .arg(dir)
            .arg(&staging)
            .arg(format!("{size_kib}k"))
            .env("E2FSPROGS_FAKE_TIME", "1"),
        "mke2fs",
        "e2fsprogs",
    )?;
    std::fs::rename(&staging, out).map_err(io_err(out))
}

fn du_bytes(dir: &Path) -> Result<u64, ImageError> {
    let out = run_tool(
        Command::new("du")
            .args(["-s", "-B1", "--apparent-size"])
            .arg(dir),
        "du",
        "coreutils",
    )?;
    Ok(out
        .split_whitespace()
        .next()
        .and_then(|n| n.parse().ok())
        .unwrap_or(0))
}

fn run_tool(
    cmd: &mut Command,
    tool: &'static str,
    package: &'static str,
) -> Result<String, ImageError> {
    let out = cmd.output().map_err(|source| ImageError::Tool {
        tool,
        package,
        source,
    })?;
    if !out.status.success() {
        return Err(ImageError::Failed {
            tool,
            stderr: String::from_utf8_lossy(&out.stderr).trim().to_owned(),
        });
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn make_ext4_image_holds_the_files() {
        let dir = tempfile::tempdir().expect("tempdir");
        std::fs::create_dir_all(dir.path().join("etc")).expect("mkdir");
        std::fs::write(dir.path().join("etc/greeting"), "hello from the image\n").expect("write");
        std::os::unix::fs::symlink("greeting", dir.path().join("etc/link")).expect("symlink");
        let out = tempfile::tempdir().expect("tempdir");
        let img = out.path().join("root.ext4");
        make_ext4(dir.path(), &img).expect("mke2fs");
        // debugfs (e2fsprogs) reads the image without mounting it.
        let cat = Command::new("debugfs")
            .args(["-R", "cat /etc/greeting"])
            .arg(&img)
            .output()
            .expect("debugfs");
        assert_eq!(
            String::from_utf8_lossy(&cat.stdout),
            "hello from the image\n"
        );
        let stat = Command::new("debugfs")
            .args(["-R", "stat /etc/link"])
            .arg(&img)
            .output()
            .expect("debugfs");
        assert!(String::from_utf8_lossy(&stat.stdout).contains("Fast link dest: \"greeting\""));
    }
}
