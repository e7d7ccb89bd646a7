//! `forkbox image`: the built-in images, and the image store (OCI images
//! imported from a file; each layer stored and unpacked once).

use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context;
use clap::Subcommand;
use forkbox_host::image::{self, ImageName};
use forkbox_image::{Progress, Store};
use indicatif::{ProgressBar, ProgressStyle};

#[derive(Debug, Subcommand)]
pub enum ImageCmd {
    /// Build a built-in image (`minimal`, `debian` or `docker`; cached, so a second
    /// build is instant) and print its path.
    Build { name: ImageName },
    /// Import an image from an OCI image layout (a directory, or a tar of
    /// one: `skopeo copy … oci-archive:`) or a `docker save` archive.
    Import {
        path: PathBuf,
        /// The name to give it (and, where the file holds several images,
        /// which one). Without it, the names the file gives are kept.
        #[arg(long)]
        name: Option<String>,
    },
    /// Pull an image from a registry (`host[:port]/repo:tag` or
    /// `…@sha256:…`); multi-platform images give their linux/amd64 one. A
    /// download that stops resumes at the next pull.
    Pull {
        reference: String,
        /// Speak plain HTTP (a registry on loopback), not HTTPS.
        #[arg(long)]
        plain_http: bool,
        /// Basic auth (bearer tokens are fetched as the registry asks);
        /// the password comes from `FORKBOX_REGISTRY_PASSWORD`.
        #[arg(long)]
        user: Option<String>,
    },
    /// Push a stored image (a name or an id) to a registry as
    /// `host[:port]/repo:tag`: its configuration and its layers as the
    /// store received them; blobs the registry has are not sent.
    Push {
        name: String,
        reference: String,
        #[arg(long)]
        plain_http: bool,
        /// Basic auth or a token server's; the password comes from
        /// `FORKBOX_REGISTRY_PASSWORD`.
        #[arg(long)]
        user: Option<String>,
    },
    /// List the store's images: names, ids, layers and sizes.
    Ls {
        #[arg(long)]
        json: bool,
    },
    /// Remove a name; given an id, the image and all its names. A
    /// template's image is kept until the template goes.
    Rm { name: String },
    /// Delete what no image name or template needs: images, blobs,
    /// layers, and what an interrupted import left.
    Gc,
}

/// The store forkbox and forkboxd share, under the cache.
pub fn store() -> anyhow::Result<Store> {
    let root = forkbox_host::cache::root().join("store");
    Store::open(&root).with_context(|| format!("opening the image store at {}", root.display()))
}

pub fn run(cmd: ImageCmd) -> anyhow::Result<i32> {
    match cmd {
        ImageCmd::Build { name } => {
            let path = image::ensure(name)?;
            println!("{}", path.display());
        }
        ImageCmd::Import { path, name } => {
            let store = store()?;
            let mut progress = LayerBars::default();
            let imported =
                forkbox_image::import(&store, &path, name.as_deref(), &mut |p| progress.event(p))
                    .with_context(|| format!("importing {}", path.display()))?;
            progress.finish();
            report("imported", &store, &imported);
        }
        ImageCmd::Pull {
            reference,
            plain_http,
            user,
        } => {
            let store = store()?;
            let registry = registry(plain_http, user)?;
            let rt = runtime()?;
            let mut progress = LayerBars::default();
            let pulled = rt
                .block_on(forkbox_image::pull(
                    &store,
                    &reference,
                    &registry,
                    &mut |p| progress.event(p),
                ))
                .with_context(|| format!("pulling {reference}"))?;
            progress.finish();
            report("pulled", &store, &pulled);
        }
        ImageCmd::Push {
            name,
            reference,
            plain_http,
            user,
        } => {
            let store = store()?;
            let image = store.resolve(&name)?;
            let registry = registry(plain_http, user)?;
            let bar = ProgressBar::new_spinner();
            bar.enable_steady_tick(Duration::from_millis(120));
            let shown = bar.clone();
            let on: forkbox_image::artifact::OnTransfer = std::sync::Arc::new(move |t| {
                shown.set_message(if t.present {
                    format!("{}: in the registry already", t.what)
                } else {
                    format!("{}: {:.1} of {:.1} MiB", t.what, mib(t.bytes), mib(t.total))
                });
            });
            let pushed = runtime()?
                .block_on(forkbox_image::artifact::push_image(
                    &store, &image, &reference, &registry, on,
                ))
                .with_context(|| format!("pushing {name} to {reference}"));
            bar.finish_and_clear();
            let pushed = pushed?;
            eprintln!(
                "forkbox: pushed {} as {reference} ({}): {:.1} MiB sent, {:.1} MiB the registry had",
                image.id.short(),
                pushed.digest,
                mib(pushed.sent),
                mib(pushed.present)
            );
        }
        ImageCmd::Ls { json } => ls(&store()?, json)?,
        ImageCmd::Rm { name } => {
            let id = store()?.remove(&name)?;
            eprintln!(
                "forkbox: removed {name} ({}); `forkbox image gc` frees its files",
                id.short()
            );
        }
        ImageCmd::Gc => {
            let c = store()?.gc()?;
            eprintln!(
                "forkbox: removed {} images, {} blobs and {} layers: {:.1} MiB freed",
                c.images,
                c.blobs,
                c.layers,
                mib(c.bytes)
            );
        }
    }
    Ok(0)
}

/// How to reach a registry: `--user`'s password from the environment.
fn registry(plain_http: bool, user: Option<String>) -> anyhow::Result<forkbox_image::Registry> {
    let auth = match user {
        Some(u) => {
            let password = std::env::var("FORKBOX_REGISTRY_PASSWORD")
                .context("--user needs the password in FORKBOX_REGISTRY_PASSWORD")?;
            Some((u, password))
        }
        None => None,
    };
    Ok(forkbox_image::Registry { auth, plain_http })
}

fn runtime() -> anyhow::Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("starting the async runtime")
}

fn ls(store: &Store, json: bool) -> anyhow::Result<()> {
    let names = store.names()?;
    let pins = store.pins()?;
    let mut rows = Vec::new();
    for id in store.ids()? {
        let image = store.image(&id)?;
        let named: Vec<&String> = names
            .iter()
            .filter(|(_, i)| **i == id)
            .map(|(n, _)| n)
            .collect();
        let held: Vec<&String> = pins
            .iter()
            .filter(|(_, i)| **i == id)
            .map(|(h, _)| h)
            .collect();
        rows.push(serde_json::json!({
            "id": id.to_string(),
            "names": named,
            "layers": image.layers.len(),
            "bytes": image.layer_bytes(store),
            "created": image.created,
            "used_by": held,
        }));
    }
    if json {
        println!("{}", serde_json::to_string_pretty(&rows)?);
        return Ok(());
    }
    println!(
        "{:<40} {:<12} {:>6} {:>10}  USED BY",
        "NAME", "ID", "LAYERS", "SIZE"
    );
    for row in &rows {
        let names: Vec<&str> = row["names"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|n| n.as_str())
            .collect();
        let used = row["used_by"].as_array().map_or(0, Vec::len);
        let id = row["id"].as_str().unwrap_or_default();
        let short = id
            .strip_prefix("sha256:")
            .unwrap_or(id)
            .get(..12)
            .unwrap_or(id);
        let size = format!("{:.1} MiB", mib(row["bytes"].as_u64().unwrap_or(0)));
        let layers = row["layers"].as_u64().unwrap_or(0);
        let name = if names.is_empty() {
            "<none>".to_owned()
        } else {
            names.join(", ")
        };
        let used = if used == 0 {
            "-".to_owned()
        } else {
            format!("{used} template(s)")
        };
        println!("{name:<40} {short:<12} {layers:>6} {size:>10}  {used}");
    }
    Ok(())
}

/// What an import or pull stored, on stderr; the image's id on stdout.
fn report(done: &str, store: &Store, imported: &forkbox_image::Imported) {
    let image = &imported.image;
    eprintln!(
        "forkbox: {done} {} ({} layers, {} unpacked now, {:.1} MiB of layers)",
        image.id.short(),
        image.layers.len(),
        imported.unpacked,
        mib(image.layer_bytes(store)),
    );
    for n in &imported.names {
        eprintln!("forkbox: named {n}");
    }
    println!("{}", image.id);
}

fn mib(bytes: u64) -> f64 {
    bytes as f64 / (1 << 20) as f64
}

/// A line per layer: a spinner while it is stored and unpacked, then what
/// it cost (or that the store had it).
#[derive(Default)]
struct LayerBars {
    bar: Option<ProgressBar>,
}

impl LayerBars {
    fn event(&mut self, p: Progress<'_>) {
        match p {
            Progress::LayerStart {
                index,
                count,
                diff_id,
                bytes,
            } => {
                let bar = ProgressBar::new_spinner();
                bar.set_style(
                    ProgressStyle::with_template("{spinner} {elapsed:>4} {msg}")
                        .expect("the template is valid"),
                );
                bar.enable_steady_tick(Duration::from_millis(120));
                bar.set_message(format!(
                    "layer {}/{count} {} ({:.1} MiB): storing and unpacking",
                    index + 1,
                    diff_id.short(),
                    mib(bytes)
                ));
                self.bar = Some(bar);
            }
            Progress::Fetched {
                index,
                count,
                blob,
                bytes,
                total,
            } => {
                let bar = self.bar.get_or_insert_with(|| {
                    let bar = ProgressBar::new(total);
                    bar.set_style(
                        ProgressStyle::with_template(
                            "{bar:30} {bytes:>10}/{total_bytes:<10} {msg}",
                        )
                        .expect("the template is valid"),
                    );
                    bar.set_message(format!(
                        "layer {}/{count} {}: downloading",
                        index + 1,
                        blob.short()
                    ));
                    bar
                });
                bar.set_position(bytes);
                if bytes >= total {
                    bar.finish_and_clear();
                    self.bar = None;
                }
            }
            Progress::LayerDone { index, unpacked } => {
                let Some(bar) = self.bar.take() else { return };
                let msg = bar.message();
                let head = msg.split(": ").next().unwrap_or_default().to_owned();
                let done = match unpacked {
                    Some(u) => format!(
                        "{head}: {} entries, {:.1} MiB of erofs",
                        u.entries,
                        mib(u.erofs_bytes)
                    ),
                    None => format!("{head}: already in the store"),
                };
                let _ = index;
                bar.finish_with_message(done);
            }
        }
    }

    fn finish(&mut self) {
        if let Some(bar) = self.bar.take() {
            bar.finish_and_clear();
        }
    }
}
