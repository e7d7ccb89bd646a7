//! Reading structured values off the fuzz input: every read succeeds
//! (zeros past the end), so a short input is just a short run.

pub struct Input<'a> {
    data: &'a [u8],
}

impl<'a> Input<'a> {
    pub fn new(data: &'a [u8]) -> Self {
        Self { data }
    }

    pub fn is_empty(&self) -> bool {
        self.data.is_empty()
    }

    pub fn u8(&mut self) -> u8 {
        match self.data.split_first() {
            Some((&b, rest)) => {
                self.data = rest;
                b
            }
            None => 0,
        }
    }

    pub fn u16(&mut self) -> u16 {
        u16::from_le_bytes([self.u8(), self.u8()])
    }

    pub fn u32(&mut self) -> u32 {
        u32::from_le_bytes([self.u8(), self.u8(), self.u8(), self.u8()])
    }

    /// Up to `n` bytes (fewer at the end of the input).
    pub fn bytes(&mut self, n: usize) -> &'a [u8] {
        let n = n.min(self.data.len());
        let (head, rest) = self.data.split_at(n);
        self.data = rest;
        head
    }

    /// Exactly `N` bytes, zero-padded.
    pub fn array<const N: usize>(&mut self) -> [u8; N] {
        let mut out = [0u8; N];
        let got = self.bytes(N);
        out[..got.len()].copy_from_slice(got);
        out
    }

    /// What is left.
    pub fn rest(&mut self) -> &'a [u8] {
        let all = self.data;
        self.data = &[];
        all
    }
}

/// Blocks SIGPIPE in the calling thread (and the threads it starts): a
/// write to a socket whose peer is gone then fails with EPIPE, as in the
/// VMM and every Rust binary (whose runtime ignores SIGPIPE), instead of
/// killing the fuzzer, whose `main` is libFuzzer's.
pub fn no_sigpipe() {
    match vmm_sys_util::signal::block_signal(libc::SIGPIPE) {
        Ok(()) | Err(vmm_sys_util::signal::Error::SignalAlreadyBlocked(_)) => {}
        Err(e) => panic!("cannot block SIGPIPE: {e}"),
    }
}
