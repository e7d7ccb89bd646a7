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

    /// COM1's registers and FIFO (call while the vCPUs are parked).
    pub fn serial_state(&self) -> vm_superio::serial::SerialState {
        match self.serial.lock() {
            Ok(s) => s.state(),
            Err(p) => p.into_inner().state(),
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

#[cfg(test)]
mod tests {
    use std::sync::{Arc, Mutex};

    use vm_superio::Serial;
    use vmm_sys_util::eventfd::EventFd;

    use super::*;
    use crate::serial::{Echo, IrqTrigger, SerialOutput, TailBuffer};

    fn bus() -> (PortBus, Arc<Mutex<TailBuffer>>) {
        let tail = Arc::new(Mutex::new(TailBuffer::default()));
        let irq = EventFd::new(0).expect("eventfd");
        let serial = Serial::new(
            IrqTrigger(irq),
            SerialOutput::new(None, Arc::clone(&tail), Echo::Off),
        );
        (PortBus::new(serial), tail)
    }

    #[test]
    fn write_com1_data_reaches_tail() {
        let (bus, tail) = bus();
        for b in b"hi\n" {
            assert_eq!(bus.write(COM1, &[*b]), None);
        }
        assert_eq!(tail.lock().expect("lock").contents(), b"hi\n");
    }

    #[test]
    fn write_i8042_fe_resets() {
        let (bus, _) = bus();
        assert_eq!(
            bus.write(I8042_COMMAND, &[0xfe]),
            Some(PortEvent::Reset(ResetCause::Keyboard))
        );
        assert_eq!(bus.write(I8042_COMMAND, &[0xd1]), None);
    }

    #[test]
    fn write_acpi_sleep_s5_powers_off_and_reset_register_resets() {
        let (bus, _) = bus();
        let s5 = (acpi::S5_SLEEP_TYPE << 2) | acpi::SLEEP_ENABLE;
        assert_eq!(
            bus.write(acpi::SLEEP_CONTROL_PORT, &[s5]),
            Some(PortEvent::PowerOff)
        );
        assert_eq!(
            bus.write(acpi::RESET_PORT, &[acpi::RESET_VALUE]),
            Some(PortEvent::Reset(ResetCause::Acpi))
        );
    }

    #[test]
    fn read_unknown_and_pci_ports_all_ones() {
        let (bus, _) = bus();
        let mut d = [0u8; 4];
        bus.read(0x1234, &mut d);
        assert_eq!(d, [0xff; 4]);
        bus.write(PCI_CONFIG_ADDRESS, &0x8000_0000u32.to_le_bytes());
        bus.read(0xcfc, &mut d);
        assert_eq!(d, [0xff; 4]);
    }

    #[test]
    fn read_i8042_status_ready() {
        let (bus, _) = bus();
        let mut d = [0xaa];
        bus.read(I8042_COMMAND, &mut d);
        assert_eq!(d, [0]);
    }
}
