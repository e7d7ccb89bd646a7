//! forkbox-vmm-api: what `forkbox-vmm` promises the processes that start
//! and steer it, written once for both ends.
//!
//! Owns the control socket's requests and answers (JSON lines, typed on
//! both sides), the VMM's process exit codes, the protocol's limits, and
//! the one validation of a VM's shape (vCPUs, memory) that the VMM's
//! command line, the forkbox VM runner and the daemon's templates share.
//! Plain data and serde only: it must not depend on KVM, on I/O, or on any
//! other forkbox crate, so either end can use it (and a fuzzer can drive it)
//! on its own.
//!
//! Module map:
//! - [`control`]: requests, answers, the vCPU report, encoding and decoding
//!   one line.
//! - [`shape`]: [`VmShape`] and its limits, checked by [`VmShape::validate`].
//! - [`exit_code`]: the VMM's process exit status.
//! - [`End`]: how the VM ended, in [`END_FILE`] beside its control socket.

#![forbid(unsafe_code)]

pub mod control;
pub mod shape;

pub use control::{
    decode_answer, AnswerError, ChildResult, ChildSpec, Done, Forked, PageRange, Request,
    RequestError, Response, RunState, Snapshotted, Status, Then, VcpuReport, Vcpus, VmmCounters,
    ZygoteMemory,
};
pub use shape::{ShapeError, VmShape};

/// Longest control request line, newline excluded.
pub const MAX_LINE: usize = 64 * 1024;
/// Most children one fork request may ask for; a caller that wants more
/// sends several requests. Their descriptors ([`ChildSpec::carried`],
/// at most [`MAX_FDS_PER_CHILD`] each) go in one `SCM_RIGHTS` message,
/// which the kernel caps at 253.
pub const MAX_CHILDREN_PER_FORK: usize = 32;

/// Most page ranges one `prefault` request names (written and read
/// together); with this many the request still fits in [`MAX_LINE`].
pub const MAX_PREFAULT_RANGES: usize = 2048;

/// Most pages a `prefault` request has each child copy ahead (16 MiB):
/// the guest decided what the learning child wrote, and each child is
/// charged for them before its guest runs. A child's first command writes
/// about 660 (docs/SPEC.md, "Fork cost").
pub const MAX_PREFAULT_WRITTEN: u64 = 4096;

/// Most writable disks one VM has.
pub const MAX_WRITABLE_DISKS: u8 = 4;

/// The file of a snapshot (beside its `state.json`) holding writable disk
/// `index`'s blocks above its base.
pub fn snapshot_disk_file(index: usize) -> String {
    format!("disk-{index}")
}

/// Most descriptors one fork child comes with ([`ChildSpec::carried`]):
/// 7, and one per writable disk.
pub const MAX_FDS_PER_CHILD: usize = 7 + MAX_WRITABLE_DISKS as usize;

/// Most descriptors one control request may carry: the kernel's cap on
/// one `SCM_RIGHTS` message (`SCM_MAX_FD`).
pub const MAX_FDS_PER_REQUEST: usize = 253;

/// Most children one fork request of a VM with `disks` writable disks
/// takes: [`MAX_CHILDREN_PER_FORK`], or fewer where their descriptors (and
/// the parent's new tops) would not fit one message.
pub fn children_per_request(disks: u8) -> usize {
    let disks = usize::from(disks.min(MAX_WRITABLE_DISKS));
    MAX_CHILDREN_PER_FORK.min((MAX_FDS_PER_REQUEST - disks) / (7 + disks))
}

/// Most a VM's serial log grows to; past it the guest's output is dropped
/// after one line saying so (a caller sizes its log budget by it).
pub const SERIAL_LOG_MAX_BYTES: u64 = 8 << 20;

/// Most a VM's egress log grows to (about 250 000 records); later records
/// are dropped.
pub const EGRESS_LOG_MAX_BYTES: u64 = 64 << 20;

/// `forkbox-vmm`'s process exit status: how the VM ended.
pub mod exit_code {
    /// The guest powered off (ACPI S5).
    pub const POWER_OFF: i32 = 0;
    /// The VMM itself failed (its error is on its stderr); also a command
    /// line it cannot use.
    pub const VMM_ERROR: i32 = 1;
    /// The guest reset (reboot, i8042, triple fault).
    pub const RESET: i32 = 2;
    /// The guest kernel panicked (then reset, `panic=-1`).
    pub const PANIC: i32 = 3;
}

/// The file, beside a VMM's control socket, where it writes how its VM
/// ended ([`End::word`], a newline, then a sentence) just before it exits
/// (through a descriptor opened before it lost its view of the host: by
/// itself at its start, or by the asker of the fork that made it).
/// A forked VMM's exit status goes to its parent VMM, not to the process
/// that asked for the fork: this file is how that process learns whether
/// the guest ended the VM or something else did. No file: the VMM was
/// killed (a signal, the host's OOM killer) before it could write one.
pub const END_FILE: &str = "vmm-end";

/// Bytes of disk reserved for [`END_FILE`] when it is made (allocated past
/// its end, its size still 0), so that a VMM says how its VM ended even on
/// a disk that has filled up since (a VM that ends *because* the host's
/// disk is full); [`End::file_text`] fits in them.
pub const END_FILE_RESERVE: u64 = 4096;

/// Reserves [`END_FILE_RESERVE`] bytes of disk for the end note `file`,
/// just made (allocated past its end: it stays empty). Made by the VMM
/// for itself or by the asker of a fork for the child; where the file
/// system cannot (no `fallocate`), the note is written as before, if
/// there is room.
pub fn reserve_end_file(file: &std::fs::File) -> std::io::Result<()> {
    use rustix::fs::{fallocate, FallocateFlags};
    fallocate(file, FallocateFlags::KEEP_SIZE, 0, END_FILE_RESERVE).map_err(Into::into)
}

/// How a VM ended, as its VMM saw it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum End {
    /// The guest powered off (ACPI S5).
    PowerOff,
    /// The guest rebooted (the i8042 or the ACPI reset register).
    Reboot,
    /// A triple fault: KVM reset the vCPU. A guest kernel can cause one on
    /// purpose, but a wrong vCPU state after a fork or restore causes one
    /// too, so it is not counted as the guest's doing.
    TripleFault,
    /// The guest kernel panicked.
    Panic,
    /// The VMM failed (its error follows in the file and on its stderr).
    Error,
}

impl End {
    const ALL: [End; 5] = [
        End::PowerOff,
        End::Reboot,
        End::TripleFault,
        End::Panic,
        End::Error,
    ];

    /// The file's first line.
    pub fn word(self) -> &'static str {
        match self {
            End::PowerOff => "power_off",
            End::Reboot => "reboot",
            End::TripleFault => "triple_fault",
            End::Panic => "panic",
            End::Error => "error",
        }
    }

    /// The end a file's first line names.
    pub fn from_word(word: &str) -> Option<End> {
        Self::ALL.into_iter().find(|e| e.word() == word.trim())
    }

    /// Whether the guest itself ended the VM (powered off, rebooted,
    /// panicked): the guest's doing, which a trainer scores, as opposed to
    /// a failure of forkbox or the host, which it masks.
    pub fn by_guest(self) -> bool {
        matches!(self, End::PowerOff | End::Reboot | End::Panic)
    }

    /// The file's whole text for this end and its sentence, the sentence
    /// cut to fit [`END_FILE_RESERVE`].
    pub fn file_text(self, how: &str) -> String {
        let room = END_FILE_RESERVE as usize - self.word().len() - 2;
        let mut how = how.trim();
        if how.len() > room {
            let mut cut = room;
            while !how.is_char_boundary(cut) {
                cut -= 1;
            }
            how = &how[..cut];
        }
        format!("{}\n{}\n", self.word(), how)
    }

    /// The end and its sentence from the file's text; `None` for a text
    /// no VMM wrote.
    pub fn parse_file(text: &str) -> Option<(End, String)> {
        let (word, rest) = text.split_once('\n').unwrap_or((text, ""));
        Some((End::from_word(word)?, rest.trim().to_owned()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn end_file_round_trips_and_knows_whose_doing_it_was() {
        for end in End::ALL {
            let text = end.file_text("guest kernel panicked: Kernel panic - not syncing\n");
            assert_eq!(
                End::parse_file(&text),
                Some((
                    end,
                    "guest kernel panicked: Kernel panic - not syncing".into()
                ))
            );
        }
        assert!(End::PowerOff.by_guest() && End::Reboot.by_guest() && End::Panic.by_guest());
        assert!(!End::TripleFault.by_guest() && !End::Error.by_guest());
        assert_eq!(End::parse_file("crashed\n"), None);
        assert_eq!(End::parse_file(""), None);
    }

    #[test]
    fn an_end_file_fits_its_reserve_whatever_the_sentence() {
        let long = "é".repeat(3000);
        let text = End::Error.file_text(&long);
        assert!(text.len() <= END_FILE_RESERVE as usize, "{}", text.len());
        let (end, how) = End::parse_file(&text).expect("parses");
        assert_eq!(end, End::Error);
        assert!(how.len() > 4000 && long.starts_with(&how));
    }
}
