//! Content digests: the store's only keys. forkbox stores and checks
//! `sha256` digests, the one algorithm every registry and image tool uses.

use std::fmt;
use std::io::{self, Read, Write};
use std::str::FromStr;

use sha2::{Digest as _, Sha256};

/// A `sha256:<64 lowercase hex digits>` digest.
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize, serde::Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct Digest {
    hex: String,
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum DigestError {
    #[error("`{0}` is not a digest (want sha256:<64 hex digits>)")]
    Malformed(String),
    #[error("digest `{0}` uses an algorithm forkbox does not check (only sha256)")]
    Algorithm(String),
}

impl Digest {
    /// The digest of `bytes`.
    pub fn of(bytes: &[u8]) -> Self {
        Self {
            hex: hex::encode(Sha256::digest(bytes)),
        }
    }

    /// The 64 hex digits, without the algorithm: a file name in the store.
    pub fn hex(&self) -> &str {
        &self.hex
    }

    /// The first 12 hex digits, as image tools print an id.
    pub fn short(&self) -> &str {
        &self.hex[..12]
    }
}

impl FromStr for Digest {
    type Err = DigestError;

    fn from_str(s: &str) -> Result<Self, DigestError> {
        let Some((algorithm, hex)) = s.split_once(':') else {
            return Err(DigestError::Malformed(s.to_owned()));
        };
        if algorithm != "sha256" {
            return Err(DigestError::Algorithm(s.to_owned()));
        }
        let lower_hex = |c: char| c.is_ascii_digit() || ('a'..='f').contains(&c);
        if hex.len() != 64 || !hex.chars().all(lower_hex) {
            return Err(DigestError::Malformed(s.to_owned()));
        }
        Ok(Self {
            hex: hex.to_owned(),
        })
    }
}

impl TryFrom<String> for Digest {
    type Error = DigestError;
    fn try_from(s: String) -> Result<Self, DigestError> {
        s.parse()
    }
}

impl From<Digest> for String {
    fn from(d: Digest) -> String {
        d.to_string()
    }
}

impl TryFrom<&oci_spec::image::Digest> for Digest {
    type Error = DigestError;
    fn try_from(d: &oci_spec::image::Digest) -> Result<Self, DigestError> {
        d.as_ref().parse()
    }
}

impl fmt::Display for Digest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "sha256:{}", self.hex)
    }
}

impl fmt::Debug for Digest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

/// Hashes everything read through it, counting the bytes.
pub struct HashingReader<R> {
    inner: R,
    hasher: Sha256,
    bytes: u64,
}

impl<R: Read> HashingReader<R> {
    pub fn new(inner: R) -> Self {
        Self {
            inner,
            hasher: Sha256::new(),
            bytes: 0,
        }
    }

    /// Reads what is left (a tar stream ends before its file does: the
    /// padding after the end blocks counts too) and returns the digest and
    /// the byte count.
    pub fn finish(mut self) -> io::Result<(Digest, u64)> {
        io::copy(&mut self, &mut io::sink())?;
        let hex = hex::encode(self.hasher.finalize());
        Ok((Digest { hex }, self.bytes))
    }
}

impl<R: Read> Read for HashingReader<R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let n = self.inner.read(buf)?;
        self.hasher.update(&buf[..n]);
        self.bytes += n as u64;
        Ok(n)
    }
}

/// Hashes everything written through it, counting the bytes.
pub struct HashingWriter<W> {
    inner: W,
    hasher: Sha256,
    bytes: u64,
}

impl<W: Write> HashingWriter<W> {
    pub fn new(inner: W) -> Self {
        Self {
            inner,
            hasher: Sha256::new(),
            bytes: 0,
        }
    }

    /// Bytes written so far.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    pub fn finish(self) -> (W, Digest, u64) {
        let hex = hex::encode(self.hasher.finalize());
        (self.inner, Digest { hex }, self.bytes)
    }
}

impl<W: Write> Write for HashingWriter<W> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        let n = self.inner.write(buf)?;
        self.hasher.update(&buf[..n]);
        self.bytes += n as u64;
        Ok(n)
    }

    fn flush(&mut self) -> io::Result<()> {
        self.inner.flush()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const EMPTY: &str = "sha256:e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855";

    #[test]
    fn digest_of_empty_input_is_the_known_one() {
        assert_eq!(Digest::of(b"").to_string(), EMPTY);
        assert_eq!(EMPTY.parse::<Digest>(), Ok(Digest::of(b"")));
    }

    #[test]
    fn digest_malformed_or_other_algorithm_refused() {
        for bad in [
            "",
            "sha256",
            "sha256:abc",
            &EMPTY.to_uppercase().replace("SHA256", "sha256"),
            &format!("{EMPTY}0"),
            "sha256:../../../../etc/passwd/aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa",
        ] {
            assert!(
                matches!(bad.parse::<Digest>(), Err(DigestError::Malformed(_))),
                "{bad}"
            );
        }
        let sha512 = format!("sha512:{}", "0".repeat(128));
        assert_eq!(
            sha512.parse::<Digest>(),
            Err(DigestError::Algorithm(sha512.clone()))
        );
    }

    #[test]
    fn hashing_reader_and_writer_agree_with_digest_of() {
        let data = vec![7u8; 100_000];
        let mut r = HashingReader::new(&data[..]);
        let mut first = [0u8; 10];
        r.read_exact(&mut first).expect("read");
        assert_eq!(r.finish().expect("finish"), (Digest::of(&data), 100_000));
        let mut w = HashingWriter::new(Vec::new());
        w.write_all(&data).expect("write");
        let (out, digest, n) = w.finish();
        assert_eq!((out, digest, n), (data.clone(), Digest::of(&data), 100_000));
    }
}
