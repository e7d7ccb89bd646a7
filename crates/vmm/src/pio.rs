//! The port I/O bus: COM1, the i8042 reset line, the ACPI sleep and reset
//! registers, and PCI config ports that answer "no device". Unknown ports
//! read as 0xff and ignore writes.

use std::sync::Mutex;

use crate::acpi::{self, SleepRequest};
use crate::serial::SerialDevice;

const COM1: u16 = crate::layout::COM1_PORT;
const COM_PORTS: u16 = 8;
const I8042_DATA: u16 = 0x60;
const I8042_COMMAND: u16 = 0x64;
const I8042_CMD_RESET: u8 = 0xfe;
const PCI_CONFIG_ADDRESS: u16 = 0xcf8;

/// A guest action on a port that ends the VM.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PortEvent {
    PowerOff,
    Reset(ResetCause),
}

/// How the guest asked for a reset.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ResetCause {
    /// 0xFE to the i8042 command port (`reboot=k`).
    Keyboard,
    /// The FADT reset register.
    Acpi,
    /// A triple fault (KVM_EXIT_SHUTDOWN) or KVM's reset system event.
    TripleFault,
}

pub struct PortBus {
    serial: Mutex<SerialDevice>,
}

impl PortBus {
    pub fn new(serial: SerialDevice) -> Self {
        Self {
            serial: Mutex::new(serial),
        }
    }

    fn with_serial<T>(&self, f: impl FnOnce(&mut SerialDevice) -> T) -> Option<T> {
        // A poisoned lock means another vCPU panicked mid-access; the
        // device is still usable byte by byte.
        let mut s = match self.serial.lock() {
            Ok(s) => s,
            Err(p) => p.into_inner(),
        };
        Some(f(&mut s))
    }

    /// An `in` from the guest.
    pub fn read(&self, port: u16, data: &mut [u8]) {
        data.fill(0xff);
        match port {
            p if (COM1..COM1 + COM_PORTS).contains(&p) => {
                if let Some(v) = self.with_serial(|s| s.read((p - COM1) as u8)) {
                    data[0] = v;
                }
            }
            // Status 0: output buffer empty, input buffer free (reset waits on it).
            I8042_COMMAND | I8042_DATA => data.fill(0),
            acpi::SLEEP_STATUS_PORT => data.fill(0),
            // Reading back the address latch would claim a PCI host bridge;
            // 0xff everywhere says there is none.
            PCI_CONFIG_ADDRESS..=0xcff => {}
            _ => {}
        }
    }

    /// An `out` from the guest; returns the event it triggers, if any.
    pub fn write(&self, port: u16, data: &[u8]) -> Option<PortEvent> {
        let first = *data.first()?;
        match port {
            p if (COM1..COM1 + COM_PORTS).contains(&p) => {
                self.with_serial(|s| {
                    if let Err(e) = s.write((p - COM1) as u8, first) {
                        tracing::warn!("serial write failed: {e:?}");
                    }
                });
                None
            }
            I8042_COMMAND if first == I8042_CMD_RESET => {
                Some(PortEvent::Reset(ResetCause::Keyboard))
            }
            acpi::SLEEP_CONTROL_PORT => match acpi::decode_sleep_control(first) {
                SleepRequest::PowerOff => Some(PortEvent::PowerOff),
                SleepRequest::Ignored => None,
            },
            acpi::RESET_PORT if first == acpi::RESET_VALUE => {
                Some(PortEvent::Reset(ResetCause::Acpi))
            }
            _ => {
                tracing::trace!(port, value = first, "ignored port write");
                None
            }
        }
    }
}
