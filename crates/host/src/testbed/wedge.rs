//! Telling a wedged emulated CPU from a busy or idle one, from what QEMU's
//! monitor says of it.
//!
//! Seen on 2026-12-05 (docs/SPEC.md, "Fork reliability"): an emulated
//! host's only CPU kept running at full speed on one instruction for half
//! an hour, its local APIC timer expired with its vector (236) pending in
//! `IRR`, interrupts enabled, and an NMI from the monitor changed nothing.
//! A real CPU takes a pending, unmasked interrupt at the next instruction
//! boundary, so a CPU that shows the same instruction and the same
//! deliverable interrupt in every sample over a minute and more is not
//! running the emulated host's kernel any more: QEMU's TCG is stuck (the
//! instruction was in a nested guest, where the monitor cannot even read
//! it). The test bed ends such a host as it would a crashed one.
//!
//! The likely mechanism (read in QEMU's source, not yet seen in a
//! debugger): QEMU 10.0's `helper_vmrun` sets `CPU_INTERRUPT_VIRQ` in the
//! CPU's `interrupt_request` with a plain read-modify-write, on the vCPU
//! thread without the big lock, while the APIC timer, on the main loop's
//! thread, sets `CPU_INTERRUPT_POLL` in the same word; when the two meet,
//! the timer's bit is lost, the vector stays in `IRR` and nothing tells the
//! CPU again (fixed in QEMU 10.2 by atomic updates of that word). Any later
//! interrupt raised from outside the vCPU sets the bit again, so before
//! giving a host up the test bed nudges a CPU that has owed the same
//! interrupt at the same instruction for one sampling period with a key
//! press from the monitor (the keyboard's interrupt comes from the main
//! loop), and counts the nudges that let it go on.

use std::time::{Duration, Instant};

/// What one sample says of one emulated CPU.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CpuSample {
    pub rip: u64,
    pub halted: bool,
    pub interrupts_enabled: bool,
    /// The highest vector in the local APIC's `IRR` that its priority
    /// (`PPR`) lets through, if any.
    pub deliverable: Option<u8>,
}

impl CpuSample {
    /// Reads `info registers` and `info lapic` output of one CPU; `None`
    /// when either lacks what is needed.
    pub fn parse(registers: &str, lapic: &str) -> Option<Self> {
        let rip = field(registers, "RIP=").and_then(|v| u64::from_str_radix(v, 16).ok())?;
        let flags = field(registers, "RFL=").and_then(|v| u64::from_str_radix(v, 16).ok())?;
        let halted = field(registers, "HLT=")? == "1";
        let ppr = lapic.split_whitespace().skip_while(|w| *w != "PPR").nth(1);
        let ppr = ppr.and_then(|v| u8::from_str_radix(v.trim_start_matches("0x"), 16).ok())?;
        let irr = lapic
            .lines()
            .find_map(|l| l.trim_start().strip_prefix("IRR"))
            .unwrap_or("");
        let deliverable = irr
            .split_whitespace()
            .filter_map(|v| v.parse::<u8>().ok())
            .filter(|v| v >> 4 > ppr >> 4)
            .max();
        Some(Self {
            rip,
            halted,
            interrupts_enabled: flags & (1 << 9) != 0,
            deliverable,
        })
    }

    /// An interrupt this CPU should be taking.
    fn owes_an_interrupt(&self) -> bool {
        self.interrupts_enabled && self.deliverable.is_some()
    }
}

/// The value after `key` up to the next blank (`RIP=ffffffff81000000`).
fn field<'a>(text: &'a str, key: &str) -> Option<&'a str> {
    let at = text.find(key)? + key.len();
    text[at..].split_whitespace().next()
}

/// Samples of one CPU over time; says when it has been wedged long enough.
#[derive(Debug, Default)]
pub struct Watch {
    since: Option<(Instant, CpuSample)>,
}

impl Watch {
    /// How long, as of `now`, the CPU has shown the same instruction with
    /// the same interrupt owed (`None`: it owed nothing at the last sample).
    pub fn stuck(&self, now: Instant) -> Option<Duration> {
        self.since
            .as_ref()
            .map(|(start, _)| now.duration_since(*start))
    }

    /// Takes a sample made at `now`; returns how long the CPU has shown the
    /// same instruction with the same interrupt owed, once that is at
    /// least `after`.
    pub fn sample(
        &mut self,
        now: Instant,
        sample: Option<CpuSample>,
        after: Duration,
    ) -> Option<Duration> {
        let Some(sample) = sample.filter(CpuSample::owes_an_interrupt) else {
            self.since = None;
            return None;
        };
        match &self.since {
            Some((start, first)) if *first == sample => {
                let stuck = now.duration_since(*start);
                (stuck >= after).then_some(stuck)
            }
            _ => {
                self.since = Some((now, sample));
                None
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What the monitor said of the wedged host of 2026-12-05.
    const REGISTERS: &str = "CPU#0\nRAX=0000000000004000 RBX=ff36b4084139d480 RCX=ff36b4084124c180 RDX=0000000000000000\n\
        RIP=ffffffffabb02d54 RFL=00000246 [---Z-P-] CPL=0 II=0 A20=1 SMM=0 HLT=0\n";
    const LAPIC: &str = "dumping local APIC state for CPU 0 \n\
        LVTT\t 0x000000ec active-hi edge                 one-shot     Fixed  (vec 236)\n\
        Timer\t DCR=0x3 (divide by 16) initial_count = 122812 current_count = 0\n\
        ISR\t (none)\nIRR\t 236 \n\nAPR 0x00 TPR 0x10 DFR 0x0f LDR 0x01 PPR 0x10\n";

    #[test]
    fn the_wedged_hosts_cpu_owes_its_timer_interrupt() {
        let s = CpuSample::parse(REGISTERS, LAPIC).expect("parses");
        assert_eq!(
            s,
            CpuSample {
                rip: 0xffff_ffff_abb0_2d54,
                halted: false,
                interrupts_enabled: true,
                deliverable: Some(236),
            }
        );
        assert!(s.owes_an_interrupt());
    }

    #[test]
    fn an_idle_or_masked_or_blocked_cpu_owes_nothing() {
        let idle = LAPIC.replace("IRR\t 236 ", "IRR\t (none)");
        assert_eq!(
            CpuSample::parse(REGISTERS, &idle)
                .expect("idle")
                .deliverable,
            None
        );
        let masked = REGISTERS.replace("RFL=00000246", "RFL=00000046");
        assert!(!CpuSample::parse(&masked, LAPIC)
            .expect("masked")
            .owes_an_interrupt());
        // A priority at or above the vector's class holds it back.
        let blocked = LAPIC.replace("PPR 0x10", "PPR 0xe0");
        assert_eq!(
            CpuSample::parse(REGISTERS, &blocked)
                .expect("blocked")
                .deliverable,
            None
        );
        assert_eq!(CpuSample::parse("garbage", LAPIC), None);
    }

    #[test]
    fn only_the_same_owed_interrupt_at_the_same_instruction_for_long_is_a_wedge() {
        let t0 = Instant::now();
        let after = Duration::from_secs(90);
        let wedged = CpuSample::parse(REGISTERS, LAPIC);
        let mut w = Watch::default();
        assert_eq!(w.sample(t0, wedged.clone(), after), None);
        assert_eq!(
            w.sample(t0 + Duration::from_secs(60), wedged.clone(), after),
            None
        );
        assert_eq!(
            w.sample(t0 + Duration::from_secs(90), wedged.clone(), after),
            Some(Duration::from_secs(90))
        );
        // A CPU that moved on starts over, as does one that owes nothing.
        let mut w = Watch::default();
        let moved = CpuSample::parse(&REGISTERS.replace("abb02d54", "abb02d60"), LAPIC);
        w.sample(t0, wedged.clone(), after);
        assert_eq!(w.sample(t0 + Duration::from_secs(60), moved, after), None);
        assert_eq!(
            w.sample(t0 + Duration::from_secs(120), wedged.clone(), after),
            None
        );
        let idle = CpuSample::parse(REGISTERS, &LAPIC.replace("IRR\t 236 ", "IRR\t (none)"));
        assert_eq!(w.sample(t0 + Duration::from_secs(200), idle, after), None);
        assert_eq!(w.sample(t0 + Duration::from_secs(300), wedged, after), None);
        // A monitor that did not answer says nothing either way.
        assert_eq!(w.sample(t0 + Duration::from_secs(400), None, after), None);
    }

    #[test]
    fn stuck_counts_from_the_first_sample_of_the_same_owed_interrupt() {
        let t0 = Instant::now();
        let after = Duration::from_secs(120);
        let wedged = CpuSample::parse(REGISTERS, LAPIC);
        let mut w = Watch::default();
        assert_eq!(w.stuck(t0), None);
        w.sample(t0, wedged.clone(), after);
        assert_eq!(w.stuck(t0), Some(Duration::ZERO));
        w.sample(t0 + Duration::from_secs(15), wedged, after);
        assert_eq!(
            w.stuck(t0 + Duration::from_secs(15)),
            Some(Duration::from_secs(15))
        );
        // Once it has moved on (a nudge worked), it is not stuck.
        let moved = CpuSample::parse(&REGISTERS.replace("abb02d54", "abb02d60"), LAPIC);
        let idle = moved.map(|mut s| {
            s.deliverable = None;
            s
        });
        w.sample(t0 + Duration::from_secs(30), idle, after);
        assert_eq!(w.stuck(t0 + Duration::from_secs(30)), None);
    }
}
