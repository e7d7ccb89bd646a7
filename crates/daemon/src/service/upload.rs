//! A request body streamed into an agent call: file, tar and stdin
//! uploads reach the guest as they arrive, so the daemon holds at most
//! [`CHUNKS_IN_FLIGHT`] chunks of an upload, never the whole of it.
//!
//! A task reads the body and passes its chunks through a bounded channel
//! to the blocking agent call, which reads them as an [`std::io::Read`].
//! The task counts the bytes and stops at the upload's limit; the reader
//! waits for the next chunk at most as long as an agent call may take.
//! Why an upload stopped early is kept, so that the daemon answers with
//! the client's fault (413, 400), not the guest's or its own
//! ([`Daemon::upload_with_agent`]).

use std::io::{self, Read};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::{Body, Bytes};
use tokio::sync::mpsc;

use forkbox_proto::client::{AgentClient, ClientError};

use super::{Daemon, DaemonError};
use crate::core::SandboxId;

/// Chunks of one upload between the request and the guest (hyper's are
/// up to a few tens of KiB each).
pub const CHUNKS_IN_FLIGHT: usize = 4;

/// Why an upload's body did not reach its end.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum UploadFailure {
    /// More than `limit` bytes came (a body without a length that turned
    /// out too long); the first `limit` went to the guest.
    TooLarge { limit: u64 },
    /// The client's body broke off (it hung up, or its encoding was bad).
    Broken(String),
    /// No byte came for this long.
    Idle(Duration),
}

impl UploadFailure {
    /// The daemon's answer: the client's fault, saying what the guest got.
    pub fn into_error(self, written: &str) -> DaemonError {
        match self {
            UploadFailure::TooLarge { limit } => DaemonError::TooLarge {
                message: format!(
                    "the request body is over the upload limit of {limit} bytes (forkboxd \
                     --max-upload-bytes); {written} holds what came before it"
                ),
            },
            UploadFailure::Broken(why) => DaemonError::Invalid(format!(
                "the request body broke off ({why}); {written} holds what came before it"
            )),
            UploadFailure::Idle(after) => DaemonError::Invalid(format!(
                "the request body stopped: nothing came for {} s; {written} holds what came \
                 before it",
                after.as_secs()
            )),
        }
    }
}

/// A request body as a blocking reader (see the module's doc).
pub struct Upload {
    chunks: mpsc::Receiver<Result<Bytes, UploadFailure>>,
    current: Bytes,
    idle: Duration,
    runtime: tokio::runtime::Handle,
    failure: Arc<Mutex<Option<UploadFailure>>>,
}

impl Upload {
    /// Starts reading `body` (at most `limit` bytes; waits of at most
    /// `idle` for each chunk). Call from within the runtime.
    pub fn start(body: Body, limit: u64, idle: Duration) -> Self {
        let (tx, chunks) = mpsc::channel(CHUNKS_IN_FLIGHT);
        tokio::spawn(pump(body, limit, tx));
        Self {
            chunks,
            current: Bytes::new(),
            idle,
            runtime: tokio::runtime::Handle::current(),
            failure: Arc::default(),
        }
    }

    /// Why the upload stopped early, once it has; to be read after the
    /// agent call that read it (from a clone of [`Upload::failure_slot`]).
    pub fn failure_slot(&self) -> Arc<Mutex<Option<UploadFailure>>> {
        Arc::clone(&self.failure)
    }

    fn fail(&self, failure: UploadFailure) -> io::Error {
        let e = io::Error::other(format!("the upload stopped: {failure:?}"));
        *self.failure.lock().expect("upload failure") = Some(failure);
        e
    }
}

/// Why the upload behind `slot` stopped early, if it did.
pub fn failure(slot: &Mutex<Option<UploadFailure>>) -> Option<UploadFailure> {
    slot.lock().expect("upload failure").clone()
}

impl Daemon {
    /// Runs `op` on sandbox `id`'s agent, uploading `data` into `into`
    /// (what the guest receives, for the error: "guest file /f"). When the
    /// body stopped early, the answer is the client's fault, whatever the
    /// agent call made of the cut.
    pub(super) async fn upload_with_agent(
        &self,
        id: &SandboxId,
        mut data: Upload,
        into: String,
        op: impl FnOnce(&AgentClient, &mut Upload) -> Result<u64, ClientError> + Send + 'static,
    ) -> Result<u64, DaemonError> {
        let failed = data.failure_slot();
        let r = self.with_agent(id, move |a| op(a, &mut data)).await;
        match failure(&failed) {
            Some(f) => Err(f.into_error(&into)),
            None => r,
        }
    }
}

impl Read for Upload {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        while self.current.is_empty() {
            let next = self
                .runtime
                .block_on(tokio::time::timeout(self.idle, self.chunks.recv()));
            match next {
                Err(_) => return Err(self.fail(UploadFailure::Idle(self.idle))),
                Ok(None) => return Ok(0),
                Ok(Some(Err(f))) => return Err(self.fail(f)),
                Ok(Some(Ok(chunk))) => self.current = chunk,
            }
        }
        let n = buf.len().min(self.current.len());
        buf[..n].copy_from_slice(&self.current[..n]);
        let _ = self.current.split_to(n);
        Ok(n)
    }
}

/// Moves `body` into `tx` chunk by chunk, at most `limit` bytes; a reader
/// that went away ends it.
async fn pump(body: Body, limit: u64, tx: mpsc::Sender<Result<Bytes, UploadFailure>>) {
    let mut body = body.into_data_stream();
    let mut seen = 0u64;
    while let Some(chunk) = futures_util::StreamExt::next(&mut body).await {
        let item = match chunk {
            Err(e) => Err(UploadFailure::Broken(e.to_string())),
            Ok(mut chunk) => {
                seen = seen.saturating_add(chunk.len() as u64);
                if seen > limit {
                    // The bytes up to the limit go first, then the failure.
                    let over = usize::try_from(seen - limit).unwrap_or(usize::MAX);
                    chunk.truncate(chunk.len().saturating_sub(over));
                    if !chunk.is_empty() && tx.send(Ok(chunk)).await.is_err() {
                        return;
                    }
                    Err(UploadFailure::TooLarge { limit })
                } else {
                    Ok(chunk)
                }
            }
        };
        let last = item.is_err();
        if tx.send(item).await.is_err() || last {
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn read_all(mut u: Upload) -> (io::Result<Vec<u8>>, Option<UploadFailure>) {
        let slot = u.failure_slot();
        let mut out = Vec::new();
        let r = u.read_to_end(&mut out).map(|_| out);
        (r, failure(&slot))
    }

    fn chunked(chunks: Vec<Result<Vec<u8>, &'static str>>) -> Body {
        let stream = futures_util::stream::iter(
            chunks
                .into_iter()
                .map(|c| c.map(Bytes::from).map_err(io::Error::other)),
        );
        Body::from_stream(stream)
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_upload_arrives_whole_in_order() {
        let body = chunked(vec![Ok(b"ab".to_vec()), Ok(b"cde".to_vec()), Ok(vec![])]);
        let u = Upload::start(body, 5, Duration::from_secs(5));
        let (r, f) = tokio::task::spawn_blocking(move || read_all(u))
            .await
            .expect("join");
        assert_eq!(r.expect("read"), b"abcde");
        assert_eq!(f, None);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_upload_over_its_limit_gives_the_limit_then_fails() {
        let body = chunked(vec![Ok(b"abc".to_vec()), Ok(b"defg".to_vec())]);
        let u = Upload::start(body, 5, Duration::from_secs(5));
        let (r, f) = tokio::task::spawn_blocking(move || {
            let mut u = u;
            let slot = u.failure_slot();
            let mut got = Vec::new();
            let mut buf = [0u8; 16];
            let err = loop {
                match u.read(&mut buf) {
                    Ok(0) => break None,
                    Ok(n) => got.extend_from_slice(&buf[..n]),
                    Err(e) => break Some(e),
                }
            };
            ((got, err), failure(&slot))
        })
        .await
        .expect("join");
        assert_eq!(r.0, b"abcde", "exactly the limit reaches the guest");
        assert!(r.1.is_some(), "then the read fails");
        assert_eq!(f, Some(UploadFailure::TooLarge { limit: 5 }));
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_body_that_breaks_off_or_stalls_says_so() {
        let body = chunked(vec![Ok(b"ab".to_vec()), Err("reset by peer")]);
        let u = Upload::start(body, 100, Duration::from_secs(5));
        let (r, f) = tokio::task::spawn_blocking(move || read_all(u))
            .await
            .expect("join");
        assert!(r.is_err());
        assert!(
            matches!(f, Some(UploadFailure::Broken(ref w)) if w.contains("reset by peer")),
            "{f:?}"
        );

        // A body that never sends its next chunk.
        let (_keep, rx) = mpsc::channel::<Result<Bytes, io::Error>>(1);
        let body = Body::from_stream(tokio_stream_from(rx));
        let u = Upload::start(body, 100, Duration::from_millis(200));
        let (r, f) = tokio::task::spawn_blocking(move || read_all(u))
            .await
            .expect("join");
        assert!(r.is_err());
        assert_eq!(f, Some(UploadFailure::Idle(Duration::from_millis(200))));
    }

    /// A stream of what `rx` receives.
    fn tokio_stream_from(
        rx: mpsc::Receiver<Result<Bytes, io::Error>>,
    ) -> impl futures_util::Stream<Item = Result<Bytes, io::Error>> {
        futures_util::stream::unfold(rx, |mut rx| async move { rx.recv().await.map(|v| (v, rx)) })
    }
}
