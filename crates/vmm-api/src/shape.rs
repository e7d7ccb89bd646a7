//! A VM's shape (vCPUs, guest RAM) and the one check of it against the
//! VMM's limits, so that every caller (the VMM's command line, the forkbox
//! VM runner, the daemon's templates) refuses the same shapes, with the
//! same words, before anything boots.

use std::fmt;

/// Fewest and most vCPUs the VMM runs. These are the VMM's limits as its
/// command line has always enforced them; raising one is a change to the
/// VMM, made here, and every caller follows.
pub const MIN_VCPUS: u8 = 1;
pub const MAX_VCPUS: u8 = 8;
/// Smallest and largest guest RAM the VMM maps, in MiB.
pub const MIN_MEMORY_MIB: u64 = 128;
pub const MAX_MEMORY_MIB: u64 = 16 * 1024;

/// How big a VM is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct VmShape {
    pub vcpus: u8,
    pub memory_mib: u64,
}

/// Why a VM's shape is not one the VMM runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ShapeError {
    Vcpus(u8),
    MemoryMib(u64),
}

impl fmt::Display for ShapeError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ShapeError::Vcpus(n) => {
                write!(f, "vcpus must be {MIN_VCPUS}-{MAX_VCPUS}, not {n}")
            }
            ShapeError::MemoryMib(n) => write!(
                f,
                "memory_mib must be {MIN_MEMORY_MIB}-{MAX_MEMORY_MIB}, not {n}"
            ),
        }
    }
}

impl std::error::Error for ShapeError {}

impl VmShape {
    /// Whether the VMM runs a VM of this shape (vCPUs checked first).
    pub fn validate(&self) -> Result<(), ShapeError> {
        if !(MIN_VCPUS..=MAX_VCPUS).contains(&self.vcpus) {
            return Err(ShapeError::Vcpus(self.vcpus));
        }
        if !(MIN_MEMORY_MIB..=MAX_MEMORY_MIB).contains(&self.memory_mib) {
            return Err(ShapeError::MemoryMib(self.memory_mib));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shape(vcpus: u8, memory_mib: u64) -> Result<(), ShapeError> {
        VmShape { vcpus, memory_mib }.validate()
    }

    #[test]
    fn validate_vcpu_bounds_inclusive() {
        assert_eq!(shape(0, 512), Err(ShapeError::Vcpus(0)));
        assert_eq!(shape(1, 512), Ok(()));
        assert_eq!(shape(8, 512), Ok(()));
        assert_eq!(shape(9, 512), Err(ShapeError::Vcpus(9)));
        assert_eq!(shape(u8::MAX, 512), Err(ShapeError::Vcpus(255)));
    }

    #[test]
    fn validate_memory_bounds_inclusive() {
        assert_eq!(shape(1, 0), Err(ShapeError::MemoryMib(0)));
        assert_eq!(shape(1, 127), Err(ShapeError::MemoryMib(127)));
        assert_eq!(shape(1, 128), Ok(()));
        assert_eq!(shape(1, 16384), Ok(()));
        assert_eq!(shape(1, 16385), Err(ShapeError::MemoryMib(16385)));
        assert_eq!(shape(1, u64::MAX), Err(ShapeError::MemoryMib(u64::MAX)));
    }

    #[test]
    fn validate_both_wrong_names_vcpus_first() {
        assert_eq!(shape(0, 1), Err(ShapeError::Vcpus(0)));
    }

    #[test]
    fn shape_error_text_names_field_range_and_value() {
        assert_eq!(
            ShapeError::Vcpus(32).to_string(),
            "vcpus must be 1-8, not 32"
        );
        assert_eq!(
            ShapeError::MemoryMib(64).to_string(),
            "memory_mib must be 128-16384, not 64"
        );
    }
}
