//! A writer for the `newc` cpio format, the one the Linux kernel unpacks as
//! an initramfs. Only what an initramfs needs: directories, regular files
//! and symlinks, all owned by root, with fixed timestamps so the same inputs
//! give the same bytes.

use std::io::{self, Write};

const MAGIC: &str = "070701";
const S_IFDIR: u32 = 0o040000;
const S_IFREG: u32 = 0o100000;
const S_IFLNK: u32 = 0o120000;

/// Streams cpio entries into `W`; call [`CpioWriter::finish`] at the end.
pub struct CpioWriter<W: Write> {
    out: W,
    written: u64,
    next_ino: u32,
}

impl<W: Write> CpioWriter<W> {
    pub fn new(out: W) -> Self {
        Self {
            out,
            written: 0,
            next_ino: 1,
        }
    }

    pub fn dir(&mut self, path: &str, mode: u32) -> io::Result<()> {
        self.entry(path, S_IFDIR | (mode & 0o7777), 2, &[])
    }

    pub fn file(&mut self, path: &str, mode: u32, data: &[u8]) -> io::Result<()> {
        self.entry(path, S_IFREG | (mode & 0o7777), 1, data)
    }

    pub fn symlink(&mut self, path: &str, target: &str) -> io::Result<()> {
        self.entry(path, S_IFLNK | 0o777, 1, target.as_bytes())
    }

    /// Writes the trailer and returns the inner writer.
    pub fn finish(mut self) -> io::Result<W> {
        self.entry("TRAILER!!!", 0, 1, &[])?;
        Ok(self.out)
    }

    fn entry(&mut self, path: &str, mode: u32, nlink: u32, data: &[u8]) -> io::Result<()> {
        let path = path.trim_start_matches('/');
        let ino = self.next_ino;
        self.next_ino += 1;
        let data_len = u32::try_from(data.len())
            .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "cpio entry over 4 GiB"))?;
        let name_len = path.len() + 1;
        let header = format!(
            "{MAGIC}{ino:08x}{mode:08x}{uid:08x}{gid:08x}{nlink:08x}{mtime:08x}{size:08x}\
             {devmajor:08x}{devminor:08x}{rdevmajor:08x}{rdevminor:08x}{namesize:08x}{check:08x}",
            uid = 0,
            gid = 0,
            mtime = 0,
            size = data_len,
            devmajor = 0,
            devminor = 0,
            rdevmajor = 0,
            rdevminor = 0,
            namesize = name_len,
            check = 0,
        );
        self.put(header.as_bytes())?;
        self.put(path.as_bytes())?;
        self.put(&[0])?;
        self.pad()?;
        self.put(data)?;
        self.pad()
    }

    fn put(&mut self, bytes: &[u8]) -> io::Result<()> {
        self.out.write_all(bytes)?;
        self.written += bytes.len() as u64;
        Ok(())
    }

    fn pad(&mut self) -> io::Result<()> {
        let pad = (4 - (self.written % 4) as usize) % 4;
        self.put(&[0u8; 3][..pad])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpio_archive_lists_with_gnu_cpio() {
        let mut w = CpioWriter::new(Vec::new());
        w.dir("etc", 0o755).expect("dir");
        w.file("etc/hello", 0o644, b"hi there\n").expect("file");
        w.symlink("link", "etc/hello").expect("symlink");
        let bytes = w.finish().expect("finish");
        assert_eq!(bytes.len() % 4, 0);
        // Every header starts 4-byte aligned with the newc magic.
        assert!(bytes.starts_with(b"070701"));
        let text = String::from_utf8_lossy(&bytes);
        assert!(text.contains("etc/hello\0"));
        assert!(text.contains("TRAILER!!!\0"));
        {
            // GNU cpio (installed by `make`) must unpack it like the kernel does.
            let dir = tempfile::tempdir().expect("tempdir");
            let mut child = std::process::Command::new("cpio")
                .args(["-idm", "--quiet"])
                .current_dir(dir.path())
                .stdin(std::process::Stdio::piped())
                .spawn()
                .expect("spawn cpio");
            child
                .stdin
                .take()
                .expect("stdin")
                .write_all(&bytes)
                .expect("write");
            assert!(child.wait().expect("wait").success());
            let hello = std::fs::read(dir.path().join("link")).expect("read through symlink");
            assert_eq!(hello, b"hi there\n");
        }
    }
}
