//! What the host's `/proc` says about VMM processes and memory (a VMM's
//! guest pages, its own overhead, a process's PSS and RSS, its state and
//! CPU time, `/proc/meminfo`, the CPU's flags), and the guest's own clock:
//! the figures benchmarks, VM trials and forkboxd's status measure. The
//! one reader of `/proc` in forkbox-host and its users (the VMM keeps its
//! own: it must not depend on this crate).

/// The guest's CLOCK_REALTIME in seconds, to the microsecond: busybox
/// `date` has no `%N`, its `adjtimex` prints `time.tv_sec` and
/// `time.tv_usec`. For the `minimal` image (busybox).
pub fn guest_clock(agent: &forkbox_proto::AgentClient) -> anyhow::Result<f64> {
    let script = "busybox adjtimex | sed -n 's/^ *time.tv_sec: *//p; s/^ *time.tv_usec: *//p'";
    let mut out = Vec::new();
    let r = agent.exec(
        &forkbox_proto::ExecRequest::shell(script),
        None,
        &mut |_, b| out.extend_from_slice(b),
    )?;
    let out = String::from_utf8_lossy(&out);
    anyhow::ensure!(r.success(), "`{script}` failed in the guest: {r:?}");
    let nums: Vec<f64> = out
        .split_whitespace()
        .filter_map(|w| w.parse().ok())
        .collect();
    match nums[..] {
        [sec, usec] => Ok(sec + usec / 1e6),
        _ => anyhow::bail!("the guest's adjtimex said {out:?}"),
    }
}

/// A `Key:   N kB` field (`key` with its colon) of `/proc/meminfo`,
/// `/proc/PID/status` or a `smaps_rollup`, in KiB; a field without a
/// unit (`FDSize:`) reads as its number.
pub fn kib_field(text: &str, key: &str) -> Option<u64> {
    text.lines().find_map(|l| kib(l.strip_prefix(key)?))
}

/// The `N kB` after a field's colon, in KiB.
fn kib(value: &str) -> Option<u64> {
    value.trim().trim_end_matches("kB").trim().parse().ok()
}

/// The host's `MemAvailable`, in KiB.
pub fn mem_available_kib() -> Option<u64> {
    kib_field(
        &std::fs::read_to_string("/proc/meminfo").ok()?,
        "MemAvailable:",
    )
}

/// A process's proportional set size in KiB: its private pages plus its
/// share of the pages it shares (a fork child with its zygote and
/// siblings).
pub fn pss_kib(pid: u32) -> Option<u64> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/smaps_rollup")).ok()?;
    kib_field(&text, "Pss:")
}

/// A process's resident memory in KiB (`VmRSS`), if readable.
pub fn rss_kib(pid: u32) -> Option<u64> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    kib_field(&text, "VmRSS:")
}

/// The whole of `/proc/meminfo`, in KiB by field name (`HugePages_*`
/// counts are left out).
pub fn meminfo() -> std::io::Result<std::collections::BTreeMap<String, u64>> {
    Ok(parse_meminfo(&std::fs::read_to_string("/proc/meminfo")?))
}

/// `/proc/meminfo`'s text (the host's or a guest's), in KiB by field name.
pub fn parse_meminfo(text: &str) -> std::collections::BTreeMap<String, u64> {
    text.lines()
        .filter(|l| l.ends_with(" kB"))
        .filter_map(|l| {
            let (k, v) = l.split_once(':')?;
            Some((k.to_owned(), kib(v)?))
        })
        .collect()
}

/// The fields of `/proc/PID/stat` forkbox reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Stat {
    /// `R`, `S`, `D`, `Z` (a zombie), `X` (dead)...
    pub state: char,
    /// Time spent in user mode, in clock ticks.
    pub utime: u64,
    /// Time spent in kernel mode, in clock ticks.
    pub stime: u64,
}

impl Stat {
    /// Parses `/proc/PID/stat`'s text.
    pub fn parse(text: &str) -> Option<Self> {
        // The fields after the command name, which is in parentheses and
        // may contain spaces and parentheses itself.
        let rest = text.rsplit_once(')')?.1;
        let f: Vec<&str> = rest.split_whitespace().collect();
        Some(Self {
            state: f.first()?.chars().next()?,
            utime: f.get(11)?.parse().ok()?,
            stime: f.get(12)?.parse().ok()?,
        })
    }

    /// `pid`'s, if it is there to read.
    pub fn of(pid: u32) -> Option<Self> {
        Self::parse(&std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?)
    }

    /// A zombie (or dead) waiting to be reaped.
    pub fn exited(&self) -> bool {
        matches!(self.state, 'Z' | 'X')
    }

    /// CPU time, user plus system. Clock ticks are `USER_HZ`, which Linux
    /// fixes at 100 on x86.
    pub fn cpu_time(&self) -> std::time::Duration {
        std::time::Duration::from_millis((self.utime + self.stime) * 10)
    }
}

/// Whether process `pid` has exited: gone, or a zombie (or dead) waiting
/// to be reaped.
pub fn exited(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .map_or(true, |text| Stat::parse(&text).is_some_and(|s| s.exited()))
}

/// CPU time (user plus system) of process `pid`, if readable.
pub fn cpu_time(pid: u32) -> Option<std::time::Duration> {
    Stat::of(pid).map(|s| s.cpu_time())
}

/// Whether `/proc/cpuinfo`'s text lists any of `flags` on a `flags` line.
pub fn cpuinfo_has_flag(cpuinfo: &str, flags: &[&str]) -> bool {
    cpuinfo
        .lines()
        .filter(|l| l.starts_with("flags"))
        .any(|l| l.split_whitespace().any(|f| flags.contains(&f)))
}

/// Whether this host's CPU has any of `flags` (false if `/proc/cpuinfo`
/// is unreadable).
pub fn cpu_has_flag(flags: &[&str]) -> bool {
    std::fs::read_to_string("/proc/cpuinfo").is_ok_and(|c| cpuinfo_has_flag(&c, flags))
}

/// Guest RAM a VMM process holds privately, in KiB: the pages of its
/// guest-RAM memfd mappings that are present and not backed by the memory
/// file (`/proc/PID/pagemap`). For a fork child of a zygote, the pages
/// the guest wrote since the fork (copy-on-write copies of the zygote's
/// memory file); a booted VM's RAM is anonymous and not counted here.
pub fn guest_pages_written_kib(pid: u32) -> std::io::Result<u64> {
    Ok(guest_pages_written(pid)?.len() as u64 * 4)
}

/// The pages [`guest_pages_written_kib`] counts, as page numbers in the
/// memory file (below 3 GiB, the guest-physical page frame numbers).
pub fn guest_pages_written(pid: u32) -> std::io::Result<std::collections::BTreeSet<u64>> {
    Ok(guest_pages(pid)?.written)
}

/// A VMM's guest-RAM pages as its page tables map them (page numbers in
/// the memory file).
#[derive(Debug, Default)]
pub struct GuestPages {
    /// Present in the process's page tables: read or written.
    pub mapped: std::collections::BTreeSet<u64>,
    /// Present and not backed by the memory file: private copies.
    pub written: std::collections::BTreeSet<u64>,
}

/// Walks `/proc/PID/pagemap` over the VMM `pid`'s guest-RAM mappings.
pub fn guest_pages(pid: u32) -> std::io::Result<GuestPages> {
    use std::io::{Read, Seek, SeekFrom};
    let maps = std::fs::read_to_string(format!("/proc/{pid}/maps"))?;
    let mut pagemap = std::fs::File::open(format!("/proc/{pid}/pagemap"))?;
    let mut pages = GuestPages::default();
    // (start, end, file offset) of each guest-RAM mapping.
    let ranges = maps
        .lines()
        .filter(|l| GUEST_RAM_MEMFDS.iter().any(|m| l.contains(m)))
        .filter_map(|l| {
            let mut f = l.split_whitespace();
            let (a, b) = f.next()?.split_once('-')?;
            let offset = f.nth(1)?;
            Some((
                u64::from_str_radix(a, 16).ok()?,
                u64::from_str_radix(b, 16).ok()?,
                u64::from_str_radix(offset, 16).ok()?,
            ))
        });
    let mut buf = vec![0u8; 8 * 4096];
    for (start, end, offset) in ranges {
        let mut page = start / 4096;
        while page < end / 4096 {
            let n = ((end / 4096 - page) as usize).min(4096);
            pagemap.seek(SeekFrom::Start(page * 8))?;
            pagemap.read_exact(&mut buf[..n * 8])?;
            for (i, e) in buf[..n * 8].chunks_exact(8).enumerate() {
                let e = u64::from_le_bytes(e.try_into().expect("8 bytes"));
                let at = offset / 4096 + page - start / 4096 + i as u64;
                if e & PM_PRESENT != 0 {
                    pages.mapped.insert(at);
                    if e & PM_FILE == 0 {
                        pages.written.insert(at);
                    }
                }
            }
            page += n as u64;
        }
    }
    Ok(pages)
}

/// The memfd a VMM maps a zygote's guest RAM from (which its fork
/// children inherit). A booted VM's RAM is anonymous memory advised
/// `MADV_DONTDUMP` (`dd` in smaps' `VmFlags`), which the VMM advises
/// nothing else.
const GUEST_RAM_MEMFDS: [&str; 1] = ["memfd:forkbox-zygote-ram"];

/// Where KVM keeps its counters per VM (debugfs).
const KVM_DEBUGFS: &str = "/sys/kernel/debug/kvm";

/// KVM's counters of the VMs the process `pid` made (`PID-FD` directories
/// of KVM's debugfs), summed: `pf_taken` (nested-page faults the guest
/// took), `pf_fixed` (pages KVM mapped, a pre-fault's too), `exits`; a
/// counter this KVM does not keep is left out. `None` where debugfs is not mounted (as root:
/// `mount -t debugfs debugfs /sys/kernel/debug`) or KVM has no such
/// directory for it. A fork child's VM is made at the fork: its counts
/// start there.
pub fn kvm_vm_counters(pid: u32) -> Option<std::collections::BTreeMap<String, u64>> {
    kvm_vm_counters_in(std::path::Path::new(KVM_DEBUGFS), pid)
}

fn kvm_vm_counters_in(
    root: &std::path::Path,
    pid: u32,
) -> Option<std::collections::BTreeMap<String, u64>> {
    let prefix = format!("{pid}-");
    let mut out = std::collections::BTreeMap::new();
    let mut found = false;
    for entry in std::fs::read_dir(root).ok()?.flatten() {
        if !entry.file_name().to_string_lossy().starts_with(&prefix) {
            continue;
        }
        found = true;
        for name in ["pf_taken", "pf_fixed", "exits"] {
            let value = std::fs::read_to_string(entry.path().join(name))
                .ok()
                .and_then(|v| v.trim().parse::<u64>().ok());
            if let Some(value) = value {
                *out.entry(name.to_owned()).or_insert(0) += value;
            }
        }
    }
    found.then_some(out)
}

/// `/proc/PID/pagemap` entry bits (Documentation/admin-guide/mm/pagemap.rst).
const PM_PRESENT: u64 = 1 << 63;
const PM_FILE: u64 = 1 << 61;

/// VMM process memory that is not guest RAM, in KiB: the sum of `Rss` over
/// every mapping in `/proc/PID/smaps` except the guest-RAM memfds and the
/// anonymous guest RAM (advised `MADV_DONTDUMP`).
pub fn vmm_overhead_kib(pid: u32) -> std::io::Result<u64> {
    let smaps = std::fs::read_to_string(format!("/proc/{pid}/smaps"))?;
    Ok(overhead_from_smaps(&smaps))
}

fn overhead_from_smaps(smaps: &str) -> u64 {
    // One mapping at a time: its `VmFlags` line comes after its `Rss`.
    let mut total = 0;
    let mut rss = 0;
    let mut guest_ram = false;
    for line in smaps.lines() {
        let first = line.split_whitespace().next().unwrap_or("");
        if first.contains('-') && first.chars().all(|c| c.is_ascii_hexdigit() || c == '-') {
            guest_ram = GUEST_RAM_MEMFDS.iter().any(|m| line.contains(m));
            rss = 0;
        } else if let Some(rest) = line.strip_prefix("Rss:") {
            rss = kib(rest).unwrap_or(0);
        } else if let Some(flags) = line.strip_prefix("VmFlags:") {
            if !guest_ram && !flags.split_whitespace().any(|f| f == "dd") {
                total += rss;
            }
        }
    }
    total
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kib_field_reads_a_field() {
        let text = "MemTotal:       24000000 kB\nMemAvailable:   12345 kB\n";
        assert_eq!(kib_field(text, "MemAvailable:"), Some(12345));
        assert_eq!(kib_field(text, "Pss:"), None);
        assert!(mem_available_kib().is_some_and(|k| k > 0));
        assert!(pss_kib(std::process::id()).is_some_and(|k| k > 0));
        assert!(rss_kib(std::process::id()).is_some_and(|k| k > 0));
        let m = parse_meminfo(&format!("{text}HugePages_Total:       0\nHugetlb:  0 kB\n"));
        assert_eq!(m.get("MemAvailable"), Some(&12345));
        assert_eq!(m.get("MemTotal"), Some(&24_000_000));
        assert_eq!(m.get("Hugetlb"), Some(&0));
        assert!(!m.contains_key("HugePages_Total"));
        assert!(meminfo().is_ok_and(|m| m.contains_key("MemAvailable")));
    }

    #[test]
    fn stat_parse_reads_state_and_times_past_a_command_with_parentheses() {
        let text =
            "4242 (a (b) c) Z 1 4242 4242 0 -1 4194560 100 0 0 0 250 50 0 0 20 0 1 0 9 0 0\n";
        let s = Stat::parse(text).expect("parses");
        assert_eq!((s.state, s.utime, s.stime), ('Z', 250, 50));
        assert!(s.exited());
        assert_eq!(s.cpu_time(), std::time::Duration::from_secs(3));
        assert_eq!(Stat::parse("4242 (sh) R 1"), None);
        let me = Stat::of(std::process::id()).expect("our own stat");
        assert!(!me.exited());
        assert!(!exited(std::process::id()));
        assert!(cpu_time(std::process::id()).is_some());
        assert!(exited(u32::MAX));
    }

    #[test]
    fn cpuinfo_has_flag_reads_flags_lines_only() {
        let text = "model name\t: vmx inside\nflags\t\t: fpu sse2 svm\n";
        assert!(cpuinfo_has_flag(text, &["vmx", "svm"]));
        assert!(!cpuinfo_has_flag(text, &["vmx"]));
    }

    /// Guest RAM as a zygote's fork child maps it (a private mapping of a
    /// memfd): the pages written count, pages only read (backed by the
    /// file) do not.
    #[test]
    fn guest_pages_written_counts_private_copies_only() {
        use vm_memory::{Bytes, GuestAddress};
        let layout = forkbox_vmm::layout::MemoryLayout::new(16 << 20);
        let mut ram = forkbox_vmm::memory::GuestRam::new(&layout).expect("guest RAM");
        let vcpus = forkbox_vmm::vcpu::Vcpus::start(Vec::new()).expect("no vCPUs");
        let (_, paused) = vcpus.pause().expect("nothing to park");
        ram.rebase_to_sealed_memfd(&paused)
            .expect("a zygote's memfd");
        for page in [0u64, 5, 9] {
            ram.memory()
                .write_obj(1u8, GuestAddress(page * 4096))
                .expect("write");
        }
        for page in [2u64, 3] {
            let b: u8 = ram
                .memory()
                .read_obj(GuestAddress(page * 4096))
                .expect("read");
            assert_eq!(b, 0);
        }
        let kib = guest_pages_written_kib(std::process::id()).expect("pagemap");
        assert_eq!(kib, 12);
        let pages = guest_pages_written(std::process::id()).expect("pagemap");
        assert_eq!(pages.into_iter().collect::<Vec<_>>(), [0, 5, 9]);
    }

    /// A booted VM's guest RAM (anonymous) is not the VMM's overhead.
    #[test]
    fn vmm_overhead_leaves_out_booted_guest_ram() {
        use vm_memory::{Bytes, GuestAddress};
        let layout = forkbox_vmm::layout::MemoryLayout::new(64 << 20);
        let ram = forkbox_vmm::memory::GuestRam::new(&layout).expect("guest RAM");
        let before = vmm_overhead_kib(std::process::id()).expect("smaps");
        for page in 0..8192u64 {
            ram.memory()
                .write_obj(page, GuestAddress(page * 4096))
                .expect("write");
        }
        let after = vmm_overhead_kib(std::process::id()).expect("smaps");
        assert!(
            after < before + 8 * 1024,
            "32 MiB of guest RAM written, overhead {before} -> {after} KiB"
        );
    }

    #[test]
    fn kvm_counters_sum_a_process_s_vms_and_only_its() {
        let root = tempfile::tempdir().expect("tempdir");
        for (dir, fixed, exits) in [("42-11", 100, 7), ("42-12", 5, 1), ("420-11", 999, 999)] {
            let d = root.path().join(dir);
            std::fs::create_dir(&d).expect("dir");
            std::fs::write(d.join("pf_fixed"), format!("{fixed}\n")).expect("pf_fixed");
            std::fs::write(d.join("exits"), format!("{exits}\n")).expect("exits");
        }
        let c = kvm_vm_counters_in(root.path(), 42).expect("found");
        assert_eq!((c["pf_fixed"], c["exits"]), (105, 8));
        assert!(!c.contains_key("pf_taken"), "not kept here: left out");
        assert_eq!(kvm_vm_counters_in(root.path(), 7), None);
        assert_eq!(kvm_vm_counters_in(&root.path().join("none"), 42), None);
    }

    #[test]
    fn overhead_from_smaps_skips_guest_ram() {
        let smaps = "\
55d0c0000000-55d0c0100000 r-xp 00000000 08:01 123 /usr/bin/forkbox-vmm
Size:               1024 kB
Rss:                 800 kB
VmFlags: rd ex mr mw me
7f0000000000-7f0020000000 rw-p 00000000 00:00 0
Size:             524288 kB
Rss:              131072 kB
VmFlags: rd wr mr mw me nr dd
7f1000000000-7f1020000000 rw-p 00000000 00:01 6 /memfd:forkbox-zygote-ram (deleted)
Size:             524288 kB
Rss:               20480 kB
VmFlags: rd wr mr mw me nr
7f2000000000-7f2000200000 rw-p 00000000 00:00 0
Size:               2048 kB
Rss:                1024 kB
VmFlags: rd wr mr mw me ac
7ffd00000000-7ffd00021000 rw-p 00000000 00:00 0 [stack]
Size:                132 kB
Rss:                  24 kB
VmFlags: rd wr mr mw me gd ac
";
        assert_eq!(overhead_from_smaps(smaps), 800 + 1024 + 24);
    }
}
