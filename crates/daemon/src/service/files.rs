//! A running sandbox's files, through its guest agent: read, write,
//! remove, list, stat, mkdir, and directories as tar archives. Paths are
//! the guest's, absolute.

use forkbox_proto::{DirEntry, FileStat};

use super::{Daemon, DaemonError};
use crate::core::SandboxId;

impl Daemon {
    /// A whole guest file.
    pub async fn read_file(&self, id: &SandboxId, path: String) -> Result<Vec<u8>, DaemonError> {
        self.with_agent(id, move |a| {
            let mut buf = Vec::new();
            a.read_file(&path, &mut buf).map(|_| buf)
        })
        .await
    }

    /// Writes a guest file with permission bits `mode`, creating its
    /// parent directories; returns the bytes written.
    pub async fn write_file(
        &self,
        id: &SandboxId,
        path: String,
        mode: u32,
        data: impl AsRef<[u8]> + Send + 'static,
    ) -> Result<u64, DaemonError> {
        self.with_agent(id, move |a| {
            a.write_file_with(&path, mode, true, &mut data.as_ref())
        })
        .await
    }

    /// Removes a file, symlink or empty directory (with `recursive`, a
    /// tree).
    pub async fn remove_path(
        &self,
        id: &SandboxId,
        path: String,
        recursive: bool,
    ) -> Result<(), DaemonError> {
        self.with_agent(id, move |a| a.remove(&path, recursive))
            .await
    }

    pub async fn list_dir(
        &self,
        id: &SandboxId,
        path: String,
    ) -> Result<Vec<DirEntry>, DaemonError> {
        self.with_agent(id, move |a| a.list_dir(&path)).await
    }

    /// `lstat` of a guest path.
    pub async fn stat(&self, id: &SandboxId, path: String) -> Result<FileStat, DaemonError> {
        self.with_agent(id, move |a| a.stat(&path)).await
    }

    /// `mkdir -p`, new directories mode 755.
    pub async fn mkdir(&self, id: &SandboxId, path: String) -> Result<(), DaemonError> {
        self.with_agent(id, move |a| a.mkdir(&path, 0o755)).await
    }

    /// A guest directory as a tar archive.
    pub async fn download_tar(&self, id: &SandboxId, path: String) -> Result<Vec<u8>, DaemonError> {
        self.with_agent(id, move |a| {
            let mut buf = Vec::new();
            a.download_tar(&path, &mut buf).map(|_| buf)
        })
        .await
    }

    /// Unpacks a tar archive into a guest directory; returns the bytes
    /// read.
    pub async fn upload_tar(
        &self,
        id: &SandboxId,
        path: String,
        archive: impl AsRef<[u8]> + Send + 'static,
    ) -> Result<u64, DaemonError> {
        self.with_agent(id, move |a| a.upload_tar(&path, &mut archive.as_ref()))
            .await
    }
}
