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

#![forbid(unsafe_code)]

pub mod control;
pub mod shape;

pub use control::{
    decode_answer, AnswerError, ChildResult, ChildSpec, Done, Forked, Request, RequestError,
    Response, RunState, Snapshotted, Status, Then, VcpuReport, Vcpus, VmmCounters, ZygoteMemory,
};
pub use shape::{ShapeError, VmShape};

/// Longest control request line, newline excluded.
pub const MAX_LINE: usize = 64 * 1024;
/// Most children one fork request may ask for; a caller that wants more
/// sends several requests.
pub const MAX_CHILDREN_PER_FORK: usize = 64;

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
