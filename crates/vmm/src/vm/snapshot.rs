//! Pausing and resuming the vCPUs, capturing the whole machine as plain
//! data, and what is made of a paused machine here: a zygote (guest RAM
//! moved to a sealed memfd) and a snapshot on disk (`memory`,
//! `state.json`).

use std::fs::File;
use std::io::Write;
use std::sync::Arc;

use vm_memory::{GuestMemoryBackend, GuestMemoryRegion};

use forkbox_vmm_api::{self as api, RunState, Then};

use crate::memory::Copied;
use crate::prefault::WorkingSet;
use crate::state::{self, MachineState, SerialState, VcpuState, VmState};
use crate::vcpu::Paused;
use crate::virtio;

use super::{Machine, VmError};

impl Machine {
    /// Parks the vCPUs, stops device work, and captures the vCPUs and the
    /// VM-wide state while all are parked (a VM already paused returns what
    /// its pause captured).
    pub(super) fn pause(&mut self) -> Result<(Vec<VcpuState>, VmState), VmError> {
        let (states, _) = self.vcpus.pause()?;
        if self.run_state == RunState::Running {
            self.watch_devices(false);
            self.run_state = RunState::Paused;
        }
        let vm = match &self.paused_vm {
            Some(vm) => vm.clone(),
            None => {
                let vm = state::save_vm(&self.vm)?;
                self.paused_vm = Some(vm.clone());
                vm
            }
        };
        Ok((states, vm))
    }

    /// Where every vCPU is; a running VM is paused for the read and resumed.
    pub(super) fn report_vcpus(&mut self) -> Result<Vec<api::VcpuReport>, VmError> {
        let was_running = self.run_state == RunState::Running;
        let (vcpus, _) = self.pause()?;
        if was_running {
            self.resume();
        }
        Ok(vcpus.iter().map(state::vcpu_report).collect())
    }

    pub(super) fn resume(&mut self) {
        if self.run_state != RunState::Running {
            self.watch_devices(true);
            self.run_state = RunState::Running;
        }
        self.paused_vm = None;
        self.vcpus.resume();
    }

    /// The whole VM as plain data (vCPUs and VM-wide state already
    /// captured in one pause).
    pub(super) fn capture(
        &self,
        (vcpus, vm): (Vec<VcpuState>, VmState),
    ) -> Result<MachineState, VmError> {
        Ok(MachineState {
            format_version: state::FORMAT_VERSION,
            state_format: state::state_format(),
            hardware: self.hw.clone(),
            vm,
            vcpus,
            serial: SerialState::from_superio(&self.pio.serial_state()),
            devices: self
                .slots
                .iter()
                .map(|s| virtio::lock(&s.device).save())
                .collect(),
        })
    }

    pub(super) fn zygote(&mut self) -> Result<Copied, VmError> {
        self.pause()?;
        // Paused already: the proof, at once.
        let (_, paused) = self.vcpus.pause()?;
        let ram = Arc::get_mut(&mut self.ram).ok_or(VmError::RamShared)?;
        let copied = ram.rebase_to_sealed_memfd(&paused)?;
        tracing::info!(
            bytes = copied.bytes,
            huge_bytes = copied.huge_bytes,
            "zygote: guest RAM now a sealed memfd"
        );
        self.run_state = RunState::Zygote;
        Ok(copied)
    }

    /// What this zygote's children map before their guest runs, from now
    /// on (`prefault`, [`crate::prefault`]); an empty set forgets it.
    pub(super) fn set_working_set(
        &mut self,
        written: &[api::PageRange],
        read: &[api::PageRange],
    ) -> api::Response {
        if self.run_state != RunState::Zygote {
            return api::Response::error(format!(
                "prefault: only a zygote's children map pages ahead (this VM is {:?})",
                self.run_state
            ));
        }
        match WorkingSet::new(written, read, self.ram.pages()) {
            Ok(set) => {
                let (written, read) = set.pages();
                tracing::info!(written, read, "zygote: its children map these pages ahead");
                self.working_set = set;
                api::Response::Done
            }
            Err(e) => api::Response::error(e),
        }
    }

    /// Writes the snapshot into `memory`, `state` and `disks`, one per
    /// writable disk (empty files the asker opened and will name).
    pub(super) fn snapshot(
        &mut self,
        memory: File,
        state: File,
        disks: Vec<File>,
        then: Then,
    ) -> Result<u64, VmError> {
        let captured = self.pause()?;
        let result = match self.vcpus.pause() {
            // Paused already: the proof, at once.
            Ok((_, paused)) => self.write_snapshot(memory, state, disks, captured, &paused),
            Err(e) => Err(e.into()),
        };
        if then == Then::Resume {
            self.resume();
        }
        result
    }

    /// Writes guest memory into `memory` (sparse), each writable disk's
    /// blocks above its base into its file of `disks` (sparse; their runs go
    /// into the state), and the state, as JSON, into `state`. They are new
    /// files the asker renames into place once answered: the snapshot may
    /// replace the one this VM was restored from, whose `memory` file is
    /// mapped here (truncating it in place would fault the guest), and
    /// whose disk files are layers of its disks.
    pub(super) fn write_snapshot(
        &self,
        memory: File,
        mut state: File,
        disks: Vec<File>,
        captured: (Vec<VcpuState>, VmState),
        paused: &Paused<'_>,
    ) -> Result<u64, VmError> {
        let mut saved = self.capture(captured)?;
        let werr = |what: &'static str| move |source| VmError::SnapshotWrite { what, source };
        let total: u64 = self.ram.memory().iter().map(|r| r.len()).sum();
        memory.set_len(total).map_err(werr("memory"))?;
        let mut written = self.ram.write_sparse_to(&memory, paused)?;
        memory.sync_all().map_err(werr("memory"))?;
        for ((disk, file), hw) in self
            .disks
            .iter()
            .zip(&disks)
            .zip(&mut saved.hardware.writable)
        {
            let disk = forkbox_devices::virtio::block::lock(disk);
            hw.saved = disk.save(file).map_err(werr("disk"))?;
            let blocks: u64 = hw.saved.iter().map(|(_, n)| n).sum();
            written += blocks * forkbox_devices::virtio::overlay::BLOCK;
        }
        let json = saved.to_json()?;
        state.write_all(&json).map_err(werr("state"))?;
        state.sync_all().map_err(werr("state"))?;
        written += json.len() as u64;
        Ok(written)
    }
}
