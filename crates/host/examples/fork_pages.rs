//! Where an idle fork child's memory goes. Forks N children of a zygote,
//! runs one exec in each and prints what the host's `/proc/meminfo` gained
//! per child; then forks one more and follows the guest pages it writes
//! (its copy-on-write copies of the zygote's memory file, read from the
//! VMM's `/proc/PID/pagemap`) through the after-fork hook and a few execs,
//! naming them by the guest kernel's page flags (`/proc/kpageflags`).
//!
//! Inside the test bed (or directly on a host with VMX/SVM):
//! `forkbox testbed run -- target/release/examples/fork_pages [MiB] [N]`
//! (`COLD=1`: no exec in the zygote before it is made).

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use anyhow::Context;
use forkbox_host::vm::{Assets, Vm, VmSpec};
use forkbox_proto::ExecRequest;

/// `/proc/kpageflags` bits worth naming (Documentation/admin-guide/mm/pagemap.rst).
const FLAGS: &[(u32, &str)] = &[
    (5, "lru"),
    (7, "slab"),
    (10, "buddy"),
    (11, "mmap"),
    (12, "anon"),
    (15, "compound"),
    (16, "compound"),
    (26, "pgtable"),
    (32, "reserved"),
];

fn class(flags: u64) -> String {
    let mut names: Vec<&str> = FLAGS
        .iter()
        .filter(|(bit, _)| flags & (1 << bit) != 0)
        .map(|(_, n)| *n)
        .collect();
    names.dedup();
    if names.is_empty() {
        "no flags (kernel stacks, vmalloc, page frags, per-CPU free lists)".into()
    } else {
        names.join(",")
    }
}

/// Guest page frame numbers the VMM `pid` holds privately: its
/// copy-on-write copies of the zygote's memory file.
fn written_pfns(pid: u32) -> anyhow::Result<BTreeSet<u64>> {
    Ok(forkbox_host::measure::guest_pages_written(pid)?)
}

/// How the zygote `pid`'s memory file fills its 2 MiB regions: a
/// histogram of data pages per region (holes are zero pages).
fn zygote_regions(pid: u32) -> anyhow::Result<BTreeMap<&'static str, usize>> {
    let fd = std::fs::read_dir(format!("/proc/{pid}/fd"))?
        .filter_map(Result::ok)
        .find(|e| {
            std::fs::read_link(e.path())
                .is_ok_and(|l| l.to_string_lossy().contains("forkbox-zygote-ram"))
        })
        .context("the zygote has no memory file open")?;
    let file = std::fs::File::open(fd.path())?;
    let mut data = vec![false; file.metadata()?.len().div_ceil(4096) as usize];
    forkbox_vmm::memory::file_data_pages(&file, 0, &mut data)?;
    let per_region = data.chunks(512).map(|r| r.iter().filter(|&&d| d).count());
    let mut hist = BTreeMap::new();
    for n in per_region {
        let bucket = match n {
            0 => "0 empty",
            1..=63 => "1 1-63 pages",
            64..=255 => "2 64-255 pages",
            256..=511 => "3 256-511 pages",
            _ => "4 full",
        };
        *hist.entry(bucket).or_default() += 1;
    }
    Ok(hist)
}

/// Per child: the 2 MiB regions of guest RAM its page tables map (each
/// costs the host a page-table page unless mapped whole) and the kB of
/// them mapped whole (`ShmemPmdMapped` in smaps).
fn child_regions(pid: u32) -> anyhow::Result<(usize, u64)> {
    let pages = forkbox_host::measure::guest_pages(pid)?;
    let regions: BTreeSet<u64> = pages.mapped.iter().map(|p| p / 512).collect();
    let smaps = std::fs::read_to_string(format!("/proc/{pid}/smaps_rollup"))?;
    let pmd = forkbox_host::measure::kib_field(&smaps, "ShmemPmdMapped:").unwrap_or(0);
    Ok((regions.len(), pmd))
}

fn meminfo() -> anyhow::Result<BTreeMap<String, u64>> {
    Ok(forkbox_host::measure::meminfo()?)
}

fn exec_true(vm: &Vm) -> anyhow::Result<()> {
    let r = vm
        .agent()
        .exec(&ExecRequest::argv(["true"]), None, &mut |_, _| {})?;
    anyhow::ensure!(r.success(), "true failed: {r:?}");
    Ok(())
}

/// The guest-physical range of an `/proc/iomem` entry such as "Kernel data".
fn iomem_range(iomem: &str, name: &str) -> Option<(u64, u64)> {
    let line = iomem.lines().find(|l| l.trim_end().ends_with(name))?;
    let (a, b) = line.trim().split(' ').next()?.split_once('-')?;
    Some((
        u64::from_str_radix(a, 16).ok()?,
        u64::from_str_radix(b, 16).ok()?,
    ))
}

fn main() -> anyhow::Result<()> {
    let mut args = std::env::args().skip(1);
    let mib: u32 = args.next().map_or(Ok(512), |s| s.parse())?;
    let n: usize = args.next().map_or(Ok(20), |s| s.parse())?;
    forkbox_host::vm::become_subreaper()?;
    let assets = Assets::prepare()?;
    let spec = VmSpec {
        memory_mib: mib,
        ..VmSpec::default()
    };
    let mut zygote = Vm::boot(&assets, &spec)?;
    let mut iomem = Vec::new();
    zygote.agent().read_file("/proc/iomem", &mut iomem)?;
    let iomem = String::from_utf8_lossy(&iomem).into_owned();
    let image = iomem_range(&iomem, ": Kernel data")
        .zip(iomem_range(&iomem, ": Kernel bss"))
        .map(|((data, _), (_, bss_end))| (data / 4096, bss_end / 4096));
    // The warm-up exec before the zygote is made, as the daemon's bake
    // does: without it every child reads busybox from the image on its
    // first exec (about 380 guest pages of page cache each).
    if std::env::var_os("COLD").is_none() {
        zygote.make_warm_zygote()?;
    } else {
        zygote.make_zygote()?;
    }
    std::thread::sleep(Duration::from_secs(1));
    println!("the zygote's memory file, 2 MiB regions by data pages:");
    for (bucket, n) in zygote_regions(zygote.pid())? {
        println!("{n:8}  {}", &bucket[2..]);
    }

    let before = meminfo()?;
    // Every child execs at once, as `forkbox bench fork`'s fan-out does.
    let children: Vec<Vm> = std::thread::scope(|s| {
        let hs: Vec<_> = zygote
            .fork(n)?
            .into_iter()
            .map(|c| {
                s.spawn(move || {
                    let c = c?;
                    exec_true(&c)?;
                    anyhow::Ok(c)
                })
            })
            .collect();
        // A child that fails is reported and left out.
        let children = hs
            .into_iter()
            .filter_map(|h| match h.join() {
                Ok(Ok(c)) => Some(c),
                Ok(Err(e)) => {
                    eprintln!("a child failed: {e:#}");
                    None
                }
                Err(_) => None,
            })
            .collect();
        anyhow::Ok(children)
    })?;
    let n = children.len();
    std::thread::sleep(Duration::from_secs(2));
    let after = meminfo()?;
    println!("{n} children of a {mib} MiB zygote, one exec each; /proc/meminfo per child, KiB:");
    for (k, b) in &before {
        let d = (after[k] as f64 - *b as f64) / n as f64;
        if d.abs() >= 4.0 {
            println!("{d:10.0}  {k}");
        }
    }
    let written: Vec<usize> = children
        .iter()
        .map(|c| written_pfns(c.pid()).map(|p| p.len()))
        .collect::<anyhow::Result<_>>()?;
    println!(
        "guest pages written per child: {:.0} (min {}, max {})",
        written.iter().sum::<usize>() as f64 / n as f64,
        written.iter().min().unwrap_or(&0),
        written.iter().max().unwrap_or(&0)
    );
    let regions: Vec<(usize, u64)> = children
        .iter()
        .map(|c| child_regions(c.pid()))
        .collect::<anyhow::Result<_>>()?;
    println!(
        "2 MiB regions of guest RAM mapped per child: {:.0}; mapped whole: {:.0} kB",
        regions.iter().map(|r| r.0).sum::<usize>() as f64 / n as f64,
        regions.iter().map(|r| r.1).sum::<u64>() as f64 / n as f64,
    );
    if let Some((most, _)) = written.iter().enumerate().max_by_key(|(_, w)| **w) {
        println!(
            "serial log of the child that wrote the most:\n{}",
            children[most].serial_tail(25)
        );
    }
    drop(children);

    println!("\none more child, step by step (guest pages written since the fork):");
    let c = zygote.fork(1)?.pop().context("no child")??;
    let forked = written_pfns(c.pid())?;
    println!("  fork + AfterFork      {:5}", forked.len());
    std::thread::sleep(Duration::from_secs(2));
    println!("  + 2 s idle            {:5}", written_pfns(c.pid())?.len());
    let guest_meminfo = |c: &Vm| -> anyhow::Result<BTreeMap<String, u64>> {
        let mut m = Vec::new();
        c.agent().read_file("/proc/meminfo", &mut m)?;
        Ok(forkbox_host::measure::parse_meminfo(
            &String::from_utf8_lossy(&m),
        ))
    };
    let g0 = guest_meminfo(&c)?;
    let before_exec = written_pfns(c.pid())?.len();
    exec_true(&c)?;
    let first_exec = written_pfns(c.pid())?;
    let g1 = guest_meminfo(&c)?;
    println!(
        "  (guest /proc/meminfo over the first exec, {} pages:",
        first_exec.len() - before_exec
    );
    for (k, v) in &g0 {
        let d = g1[k] as i64 - *v as i64;
        if d.abs() >= 16 {
            println!("      {d:+8} kB {k}");
        }
    }
    println!("  + exec true           {:5}", first_exec.len());
    exec_true(&c)?;
    println!("  + exec true           {:5}", written_pfns(c.pid())?.len());
    for _ in 0..10 {
        exec_true(&c)?;
    }
    println!("  + 10 x exec true      {:5}", written_pfns(c.pid())?.len());

    // The flags as they are now; a page may have changed use since.
    let mut flags = Vec::new();
    c.agent().read_file("/proc/kpageflags", &mut flags)?;
    let flags_of = |pfn: u64| {
        let i = pfn as usize * 8;
        flags
            .get(i..i + 8)
            .map_or(0, |b| u64::from_le_bytes(b.try_into().expect("8 bytes")))
    };
    let exec_only: BTreeSet<u64> = first_exec.difference(&forked).copied().collect();
    for (what, set) in [("fork + AfterFork", &forked), ("first exec", &exec_only)] {
        let mut by: BTreeMap<String, usize> = BTreeMap::new();
        for &pfn in set {
            let mut name = class(flags_of(pfn));
            if name == "reserved" {
                let in_image = image.is_some_and(|(a, b)| (a..=b).contains(&pfn));
                name += if in_image {
                    " (kernel .data/.bss)"
                } else {
                    " (early boot allocations: struct pages, per-CPU areas)"
                };
            }
            *by.entry(name).or_default() += 1;
        }
        let mut by: Vec<_> = by.into_iter().collect();
        by.sort_by_key(|(_, k)| std::cmp::Reverse(*k));
        println!("\npages written by the {what}, by guest page flags:");
        for (name, k) in by {
            println!("{k:6}  {name}");
        }
    }
    Ok(())
}
