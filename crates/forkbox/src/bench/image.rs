//! `forkbox bench image`: importing images into a fresh image store. Each
//! run imports an image (a base layer of the chosen size and a small
//! one), then a second image on the same base, then the first again, and
//! sizes what the store holds. Then the same two images through a
//! registry (`docker-registry` on loopback): pushed once, and pulled into
//! a fresh store each run, the first and then the second, of which only
//! the small layer should come. Runs here, not in the emulated host: no
//! VM is involved (it needs root, for the layers' owners, and
//! `mkfs.erofs`).

use std::path::Path;
use std::time::Instant;

use anyhow::Context;
use forkbox_image::{Digest, Store};
use serde_json::json;

use super::Stats;

#[derive(Debug, clap::Args)]
pub struct Options {
    /// The shared base layer's size in MiB (random bytes in files of
    /// 4 KiB, 64 KiB and 1 MiB, in 16 directories).
    #[arg(long, default_value_t = 64)]
    pub base_mib: u64,
    #[arg(long, default_value_t = 5)]
    pub runs: usize,
    #[arg(long)]
    pub json: bool,
}

pub fn run(opts: &Options) -> anyhow::Result<serde_json::Value> {
    anyhow::ensure!(opts.runs > 0, "--runs must be at least 1");
    let work = tempfile::Builder::new()
        .prefix("forkbox-bench-image-")
        .tempdir()
        .context("a work directory")?;
    eprintln!("bench image: writing a {} MiB base layer", opts.base_mib);
    let base = base_layer(opts.base_mib << 20);
    let (a, b) = (work.path().join("a.tar"), work.path().join("b.tar"));
    docker_archive(&a, &[&base, &small_layer("a")], "bench/a:1")?;
    docker_archive(&b, &[&base, &small_layer("b")], "bench/b:1")?;
    drop(base);
    let (mut first, mut shared, mut again) = (Vec::new(), Vec::new(), Vec::new());
    let mut stored = None;
    for run in 0..opts.runs {
        eprintln!("bench image: run {}/{}", run + 1, opts.runs);
        let dir = work.path().join("store");
        let store = Store::open(&dir).context("a fresh store")?;
        for (archive, into) in [(&a, &mut first), (&b, &mut shared), (&a, &mut again)] {
            let start = Instant::now();
            forkbox_image::import(&store, archive, None, &mut |_| {})
                .with_context(|| format!("importing {}", archive.display()))?;
            into.push(start.elapsed());
        }
        if stored.is_none() {
            stored = Some(layer_files(&dir.join("layers"))?);
        }
        drop(store);
        std::fs::remove_dir_all(&dir).context("removing the run's store")?;
    }
    let (files, bytes) = stored.unwrap_or_default();
    let pulls = through_a_registry(opts, work.path(), &a, &b)?;
    let (first, shared, again) = (
        Stats::from_durations(&first),
        Stats::from_durations(&shared),
        Stats::from_durations(&again),
    );
    let mib_s = opts.base_mib as f64 / (first.p50_ms / 1000.0);
    Ok(json!({
        "base_mib": opts.base_mib,
        "runs": opts.runs,
        "first_import": first,
        "second_image_same_base": shared,
        "first_again": again,
        "ratio_second_to_first_p50": shared.p50_ms / first.p50_ms,
        "ratio_again_to_first_p50": again.p50_ms / first.p50_ms,
        "first_import_mib_per_s": mib_s,
        "store_after_both": {"layer_files": files, "layer_mib": bytes as f64 / 1048576.0,
                             "layers_named_by_the_images": 4},
        "registry": pulls,
    }))
}

/// Pushes the images of archives `a` and `b` to a local registry once,
/// then pulls them into a fresh store per run.
fn through_a_registry(
    opts: &Options,
    work: &Path,
    a: &Path,
    b: &Path,
) -> anyhow::Result<serde_json::Value> {
    use forkbox_image::local_registry::LocalRegistry;
    use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
    use std::sync::Arc;
    let registry = LocalRegistry::start().context("starting a registry on loopback")?;
    let plain = forkbox_image::Registry {
        auth: None,
        plain_http: true,
    };
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let source = Store::open(&work.join("source")).context("a store")?;
    let mut refs = Vec::new();
    let mut push_ms = Vec::new();
    for (archive, name) in [(a, "a"), (b, "b")] {
        let image = forkbox_image::import(&source, archive, None, &mut |_| {})?.image;
        let reference = format!("{}/bench/{name}:1", registry.addr);
        let start = Instant::now();
        rt.block_on(forkbox_image::artifact::push_image(
            &source,
            &image,
            &reference,
            &plain,
            Arc::new(|_| {}),
        ))
        .with_context(|| format!("pushing {reference}"))?;
        push_ms.push(start.elapsed().as_secs_f64() * 1000.0);
        refs.push(reference);
    }
    let (mut first, mut second, fetched) = (Vec::new(), Vec::new(), Arc::new(AtomicU64::new(0)));
    for run in 0..opts.runs {
        eprintln!("bench image: registry pull {}/{}", run + 1, opts.runs);
        let dir = work.join("pulled");
        let store = Store::open(&dir).context("a fresh store")?;
        for (reference, into) in refs.iter().zip([&mut first, &mut second]) {
            fetched.store(0, Relaxed);
            let got = fetched.clone();
            let start = Instant::now();
            rt.block_on(forkbox_image::pull(&store, reference, &plain, &mut |p| {
                if let forkbox_image::Progress::Fetched { bytes, total, .. } = p {
                    if bytes == total {
                        got.fetch_add(total, Relaxed);
                    }
                }
            }))
            .with_context(|| format!("pulling {reference}"))?;
            into.push(start.elapsed());
        }
        drop(store);
        std::fs::remove_dir_all(&dir).context("removing the run's store")?;
    }
    let (first, second) = (
        Stats::from_durations(&first),
        Stats::from_durations(&second),
    );
    Ok(json!({
        "push_first_ms": push_ms[0],
        "push_second_same_base_ms": push_ms[1],
        "pull_first": first,
        "pull_first_mib_per_s": opts.base_mib as f64 / (first.p50_ms / 1000.0),
        "pull_second_same_base": second,
        "pull_second_downloaded_bytes": fetched.load(Relaxed),
        "ratio_pull_second_to_first_p50": second.p50_ms / first.p50_ms,
    }))
}

/// A layer tar of `bytes` of random data in files of 4 KiB, 64 KiB and
/// 1 MiB, in turn, spread over 16 directories.
fn base_layer(bytes: u64) -> Vec<u8> {
    let mut tar = tar::Builder::new(Vec::with_capacity(bytes as usize + (1 << 20)));
    let mut rng = 0x9e37_79b9_7f4a_7c15u64;
    let (mut written, mut i) = (0u64, 0usize);
    while written < bytes {
        let size = [4 << 10, 64 << 10, 1 << 20][i % 3].min(bytes - written) as usize;
        let data: Vec<u8> = (0..size.div_ceil(8))
            .flat_map(|_| {
                // xorshift64: incompressible enough, and the same each run.
                rng ^= rng << 13;
                rng ^= rng >> 7;
                rng ^= rng << 17;
                rng.to_le_bytes()
            })
            .take(size)
            .collect();
        append(&mut tar, &format!("d{}/f{i}", i % 16), &data);
        written += size as u64;
        i += 1;
    }
    tar.into_inner().expect("a tar in memory")
}

fn small_layer(name: &str) -> Vec<u8> {
    let mut tar = tar::Builder::new(Vec::new());
    append(&mut tar, &format!("etc/{name}"), name.as_bytes());
    tar.into_inner().expect("a tar in memory")
}

fn append(tar: &mut tar::Builder<Vec<u8>>, path: &str, data: &[u8]) {
    let mut h = tar::Header::new_gnu();
    h.set_entry_type(tar::EntryType::Regular);
    h.set_mode(0o644);
    h.set_uid(0);
    h.set_gid(0);
    h.set_mtime(0);
    h.set_size(data.len() as u64);
    tar.append_data(&mut h, path, data)
        .expect("a tar in memory");
}

/// Writes a `docker save` archive (uncompressed layers) of one image.
fn docker_archive(path: &Path, layers: &[&[u8]], tag: &str) -> anyhow::Result<()> {
    let diff_ids: Vec<String> = layers.iter().map(|l| Digest::of(l).to_string()).collect();
    let config = serde_json::to_vec(&json!({
        "architecture": "amd64",
        "os": "linux",
        "config": {"Env": ["PATH=/usr/bin:/bin"]},
        "rootfs": {"type": "layers", "diff_ids": diff_ids},
    }))?;
    let mut tar = tar::Builder::new(Vec::new());
    append(&mut tar, "config.json", &config);
    let mut names = Vec::new();
    for (i, layer) in layers.iter().enumerate() {
        let name = format!("layer{i}.tar");
        append(&mut tar, &name, layer);
        names.push(name);
    }
    let manifest = json!([{"Config": "config.json", "RepoTags": [tag], "Layers": names}]);
    append(&mut tar, "manifest.json", &serde_json::to_vec(&manifest)?);
    std::fs::write(path, tar.into_inner()?).with_context(|| format!("writing {}", path.display()))
}

/// The layer files in `dir` and their bytes on disk.
fn layer_files(dir: &Path) -> anyhow::Result<(usize, u64)> {
    use std::os::unix::fs::MetadataExt;
    let mut out = (0, 0);
    for e in std::fs::read_dir(dir).with_context(|| format!("reading {}", dir.display()))? {
        let meta = e?.metadata()?;
        if meta.is_file() {
            out.0 += 1;
            out.1 += meta.blocks() * 512;
        }
    }
    Ok(out)
}
