//! `forkbox cp SRC DST`: one side is `SANDBOX:PATH`. A directory travels
//! as one tar stream (`/files/tar`), a file through `/files`. Like `cp -r`:
//! copying onto an existing directory puts SRC inside it.

use std::path::{Path, PathBuf};

use crate::client::{segment, with_query, Body, Client, FRAMES};
use anyhow::{bail, Context};
use clap::Args;
use hyper::Method;
use serde::Deserialize;

use super::{print_json, SandboxId};
use forkbox::unpack;

#[derive(Args)]
pub struct CpArgs {
    /// A local path, or SANDBOX:/PATH in the guest.
    #[arg(value_parser = Location::parse)]
    src: Location,
    /// A local path, or SANDBOX:/PATH in the guest (the other side of SRC).
    #[arg(value_parser = Location::parse)]
    dst: Location,
    /// Print what was written as JSON (`path`, `bytes`).
    #[arg(long)]
    json: bool,
    /// The guest user whose rights the copy acts with (default `user`, the
    /// image's unprivileged user; `--user root` for root's).
    #[arg(long)]
    user: Option<String>,
}

/// One side of a copy.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Location {
    Local(PathBuf),
    Guest { sandbox: SandboxId, path: String },
}

impl Location {
    /// `SANDBOX:/PATH` is the guest side: whatever comes before the first
    /// `:` must read as a sandbox id (so `./a:b` and `/x:y` stay local).
    pub fn parse(s: &str) -> Result<Self, String> {
        if let Some((before, path)) = s.split_once(':') {
            if let Ok(sandbox) = before.parse::<SandboxId>() {
                if !path.starts_with('/') {
                    return Err(format!(
                        "{s:?}: the guest path must be absolute ({before}:/PATH)"
                    ));
                }
                return Ok(Self::Guest {
                    sandbox,
                    path: path.into(),
                });
            }
        }
        if s.is_empty() {
            return Err("an empty path".into());
        }
        Ok(Self::Local(s.into()))
    }
}

/// `GET /sandboxes/{id}/files/stat`, the part used here.
#[derive(Deserialize)]
struct Stat {
    kind: String,
    #[serde(default)]
    mode: u32,
}

pub fn run(client: &Client, args: CpArgs) -> anyhow::Result<i32> {
    let user = args.user.as_deref();
    let (path, bytes) = match (args.src, args.dst) {
        (Location::Local(src), Location::Guest { sandbox, path }) => {
            upload(client, &src, &Guest { sandbox, user }, &path)?
        }
        (Location::Guest { sandbox, path }, Location::Local(dst)) => {
            download(client, &Guest { sandbox, user }, &path, &dst)?
        }
        (Location::Local(_), Location::Local(_)) => {
            bail!("neither side is in a sandbox: name one as SANDBOX:/PATH")
        }
        (Location::Guest { .. }, Location::Guest { .. }) => {
            bail!("both sides are in sandboxes: copy through a local path")
        }
    };
    if args.json {
        print_json(&serde_json::json!({ "path": path, "bytes": bytes }))?;
    }
    Ok(0)
}

/// The guest side of a copy: its sandbox, and whose rights it acts with
/// (`None`: the daemon's default user).
struct Guest<'a> {
    sandbox: SandboxId,
    user: Option<&'a str>,
}

impl Guest<'_> {
    /// `/sandboxes/{id}/{what}?path=…[&user=…]` and `more` query pairs.
    fn url(&self, what: &str, path: &str, more: &[(&str, &str)]) -> String {
        let mut query = vec![("path", path)];
        query.extend(self.user.map(|u| ("user", u)));
        query.extend(more.iter().copied());
        with_query(
            &format!("/sandboxes/{}/{what}", segment(self.sandbox.as_str())),
            query,
        )
    }
}

fn stat(client: &Client, guest: &Guest<'_>, path: &str) -> anyhow::Result<Option<Stat>> {
    match client.get::<Stat>(&guest.url("files/stat", path, &[])) {
        Ok(s) => Ok(Some(s)),
        Err(e)
            if e.api().is_some_and(|a| {
                a.kind == "not_found" || a.guest_kind.as_deref() == Some("not_found")
            }) =>
        {
            Ok(None)
        }
        Err(e) => Err(e.into()),
    }
}

/// The last component of a guest path (`""` for `/`).
fn guest_basename(path: &str) -> &str {
    path.trim_end_matches('/').rsplit('/').next().unwrap_or("")
}

/// `dir/name` in the guest.
fn guest_join(dir: &str, name: &str) -> String {
    format!("{}/{name}", dir.trim_end_matches('/'))
}

#[derive(Deserialize)]
struct Written {
    path: String,
    bytes: u64,
}

fn upload(
    client: &Client,
    src: &Path,
    guest: &Guest<'_>,
    dst: &str,
) -> anyhow::Result<(String, u64)> {
    let meta = std::fs::metadata(src).with_context(|| format!("reading {}", src.display()))?;
    let name = src
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let target = match stat(client, guest, dst)? {
        Some(s) if s.kind == "dir" && !name.is_empty() => guest_join(dst, &name),
        _ => dst.to_owned(),
    };
    let written: Written = if meta.is_dir() {
        let mut builder = tar::Builder::new(Vec::new());
        builder.follow_symlinks(false);
        builder
            .append_dir_all(".", src)
            .with_context(|| format!("archiving {}", src.display()))?;
        let archive = builder
            .into_inner()
            .with_context(|| format!("archiving {}", src.display()))?;
        client
            .call(
                Method::PUT,
                &guest.url("files/tar", &target, &[]),
                Body::Raw(archive, "application/x-tar"),
            )?
            .json()?
    } else {
        use std::os::unix::fs::PermissionsExt;
        let data = std::fs::read(src).with_context(|| format!("reading {}", src.display()))?;
        let mode = format!("{:o}", meta.permissions().mode() & 0o7777);
        let path = guest.url("files", &target, &[("mode", mode.as_str())]);
        client
            .call(
                Method::PUT,
                &path,
                Body::Raw(data, "application/octet-stream"),
            )?
            .json()?
    };
    Ok((written.path, written.bytes))
}

fn download(
    client: &Client,
    guest: &Guest<'_>,
    src: &str,
    dst: &Path,
) -> anyhow::Result<(String, u64)> {
    let Some(st) = stat(client, guest, src)? else {
        bail!("{}:{src}: no such file or directory", guest.sandbox);
    };
    let name = guest_basename(src);
    let target = if dst.is_dir() && !name.is_empty() {
        dst.join(name)
    } else {
        dst.to_owned()
    };
    let shown = target.display().to_string();
    if st.kind == "dir" {
        let archive = client
            .send(
                Method::GET,
                &guest.url("files/tar", src, &[]),
                Body::Empty,
                Some(FRAMES),
            )?
            .ok()?
            .framed_bytes()?;
        std::fs::create_dir_all(&target).with_context(|| format!("creating {shown}"))?;
        // The archive comes from the guest: `unpack` refuses any member
        // that would land outside `target`, pass through or make a link
        // leading out, or be a device; it strips setuid/setgid/sticky.
        unpack::unpack(archive.as_slice(), &target).with_context(|| {
            format!(
                "unpacking {}:{src} into {shown} (stopped at that member; what came before \
                 it is unpacked)",
                guest.sandbox
            )
        })?;
        Ok((shown, archive.len() as u64))
    } else {
        use std::os::unix::fs::PermissionsExt;
        let data = client
            .send(
                Method::GET,
                &guest.url("files", src, &[]),
                Body::Empty,
                Some(FRAMES),
            )?
            .ok()?
            .framed_bytes()?;
        std::fs::write(&target, &data).with_context(|| format!("writing {shown}"))?;
        // The guest's mode, without setuid, setgid or sticky bits.
        if st.mode & 0o777 != 0 {
            std::fs::set_permissions(&target, std::fs::Permissions::from_mode(st.mode & 0o777))
                .with_context(|| format!("setting the mode of {shown}"))?;
        }
        Ok((shown, data.len() as u64))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn guest(sb: &str, path: &str) -> Location {
        Location::Guest {
            sandbox: sb.parse().expect("id"),
            path: path.into(),
        }
    }

    #[test]
    fn location_sandbox_colon_path_is_the_guest() {
        assert_eq!(
            Location::parse("sb-00000001a3f09c11:/etc/hosts"),
            Ok(guest("sb-00000001a3f09c11", "/etc/hosts"))
        );
        assert_eq!(Location::parse("sb-1:/"), Ok(guest("sb-1", "/")));
        assert_eq!(
            Location::parse("sb-1:/a:b"),
            Ok(guest("sb-1", "/a:b")),
            "only the first colon splits"
        );
    }

    #[test]
    fn location_paths_with_slashes_or_no_colon_are_local() {
        for s in ["file.txt", "./a:b", "/x:y", "dir/", "../up:/x", ":/x"] {
            assert_eq!(Location::parse(s), Ok(Location::Local(s.into())), "{s}");
        }
    }

    #[test]
    fn location_relative_guest_path_is_refused() {
        assert!(Location::parse("sb-1:etc/hosts").is_err());
        assert!(Location::parse("sb-1:").is_err());
        assert!(Location::parse("").is_err());
    }

    #[test]
    fn guest_basename_and_join() {
        assert_eq!(guest_basename("/a/b"), "b");
        assert_eq!(guest_basename("/a/b/"), "b");
        assert_eq!(guest_basename("/"), "");
        assert_eq!(guest_join("/a/", "b"), "/a/b");
        assert_eq!(guest_join("/", "b"), "/b");
    }
}
