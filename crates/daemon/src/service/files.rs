//! A running sandbox's files, through its guest agent: read, write,
//! remove, list, stat, mkdir, and directories as tar archives. Paths are
//! the guest's, absolute. Each call acts with a user's rights (`None`:
//! root's): the guest's kernel checks every path it walks as that user's.
//!
//! Reads and tar downloads stream ([`Download`]): the daemon holds a few
//! chunks of one at a time, never a whole file, and stops at the
//! download's size limit whatever the agent sends. Every call ends
//! within [`Bounds::agent_call`](super::Bounds).

use std::io;
use std::sync::Arc;

use forkbox_proto::client::{AgentClient, ClientError};
use forkbox_proto::{DirEntry, ErrorKind as GuestKind, FileStat, User};
use tokio::sync::mpsc;

use super::guest::LAST_EVENT_WAIT;
use super::{deadline_in, send_until, Daemon, DaemonError, Upload};
use crate::backend::BackendVm;
use crate::core::SandboxId;

/// One event of a streamed download: data as it comes, then `Done` with
/// the size, or `Failed`.
#[derive(Debug)]
pub enum Download {
    Data(Vec<u8>),
    Done(u64),
    Failed(DaemonError),
}

/// What a download fetches.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Transfer {
    /// A guest file.
    File,
    /// A guest directory as a tar archive.
    Tar,
}

/// Chunks (of at most `forkbox_proto::DATA_CHUNK`, 256 KiB) a download
/// holds between the agent and the client.
const DOWNLOAD_CHUNKS: usize = 4;

impl Daemon {
    /// Streams a guest file (`Transfer::File`) or directory as a tar
    /// archive (`Transfer::Tar`), at most `max_bytes` of it: past that,
    /// the download fails with [`DaemonError::TooLarge`]. Checks that the
    /// sandbox runs before returning.
    pub fn download(
        &self,
        id: &SandboxId,
        user: Option<User>,
        what: Transfer,
        path: String,
        max_bytes: u64,
    ) -> Result<mpsc::Receiver<Download>, DaemonError> {
        let machine = self.machine(id)?;
        let (tx, rx) = mpsc::channel(DOWNLOAD_CHUNKS);
        let this = self.clone();
        let id = id.clone();
        let within = self.bounds().agent_call;
        tokio::task::spawn_blocking(move || {
            let deadline = deadline_in(within);
            let mut sink = ChannelSink { tx: &tx, deadline };
            let agent = machine
                .agent()
                .with_call_timeout(within)
                .with_file_user(user);
            let max = Some(max_bytes);
            let r = match what {
                Transfer::File => agent.read_file_max(&path, max, &mut sink),
                Transfer::Tar => agent.download_tar_max(&path, max, &mut sink),
            };
            let event = match r {
                Ok(n) => Download::Done(n),
                Err(e) => {
                    super::guest::settle(&machine, &e);
                    Download::Failed(
                        this.download_failure(&id, &machine, e, what, &path, max_bytes),
                    )
                }
            };
            send_until(&tx, event, deadline_in(LAST_EVENT_WAIT));
        });
        Ok(rx)
    }

    fn download_failure(
        &self,
        id: &SandboxId,
        machine: &Arc<dyn BackendVm>,
        e: ClientError,
        what: Transfer,
        path: &str,
        max: u64,
    ) -> DaemonError {
        let thing = match what {
            Transfer::File => format!("guest file {path}"),
            Transfer::Tar => format!("the tar archive of guest directory {path}"),
        };
        let found = match &e {
            ClientError::Agent(a) if a.kind == GuestKind::TooLarge => a.message.clone(),
            ClientError::TooLarge { .. } => format!("{thing} is larger than {max} bytes"),
            _ => return self.agent_failure(id, machine, e),
        };
        DaemonError::TooLarge {
            message: format!(
                "{found}: over this download's limit of {max} bytes; ask for more with \
                 `max_bytes` (up to {}, forkboxd --max-download-bytes)",
                self.bounds().download_max
            ),
        }
    }

    /// Writes a guest file with permission bits `mode`, creating its
    /// parent directories; returns the bytes written.
    pub async fn write_file(
        &self,
        id: &SandboxId,
        user: Option<User>,
        path: String,
        mode: u32,
        data: Upload,
    ) -> Result<u64, DaemonError> {
        let into = format!("guest file {path}");
        self.upload_with_agent(id, data, into, move |a, data| {
            as_user(a, user).write_file_with(&path, mode, true, data)
        })
        .await
    }

    /// Removes a file, symlink or empty directory (with `recursive`, a
    /// tree).
    pub async fn remove_path(
        &self,
        id: &SandboxId,
        user: Option<User>,
        path: String,
        recursive: bool,
    ) -> Result<(), DaemonError> {
        self.with_agent(id, move |a| as_user(a, user).remove(&path, recursive))
            .await
    }

    pub async fn list_dir(
        &self,
        id: &SandboxId,
        user: Option<User>,
        path: String,
    ) -> Result<Vec<DirEntry>, DaemonError> {
        self.with_agent(id, move |a| as_user(a, user).list_dir(&path))
            .await
    }

    /// `lstat` of a guest path.
    pub async fn stat(
        &self,
        id: &SandboxId,
        user: Option<User>,
        path: String,
    ) -> Result<FileStat, DaemonError> {
        self.with_agent(id, move |a| as_user(a, user).stat(&path))
            .await
    }

    /// `mkdir -p`, new directories mode 755.
    pub async fn mkdir(
        &self,
        id: &SandboxId,
        user: Option<User>,
        path: String,
    ) -> Result<(), DaemonError> {
        self.with_agent(id, move |a| as_user(a, user).mkdir(&path, 0o755))
            .await
    }

    /// Unpacks a tar archive into a guest directory; returns the bytes
    /// read.
    pub async fn upload_tar(
        &self,
        id: &SandboxId,
        user: Option<User>,
        path: String,
        archive: Upload,
    ) -> Result<u64, DaemonError> {
        let into = format!("guest directory {path}");
        self.upload_with_agent(id, archive, into, move |a, archive| {
            as_user(a, user).upload_tar(&path, archive)
        })
        .await
    }
}

/// `agent` acting with `user`'s rights (`None`: root's).
fn as_user(agent: &AgentClient, user: Option<User>) -> AgentClient {
    agent.clone().with_file_user(user)
}

/// Where a download's bytes go: the channel to the client, each chunk
/// waiting for room at most until the call's deadline.
struct ChannelSink<'a> {
    tx: &'a mpsc::Sender<Download>,
    deadline: std::time::Instant,
}

impl io::Write for ChannelSink<'_> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        if send_until(self.tx, Download::Data(buf.to_vec()), self.deadline) {
            Ok(buf.len())
        } else {
            Err(io::Error::new(
                io::ErrorKind::BrokenPipe,
                "the client went away or stopped reading",
            ))
        }
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}
