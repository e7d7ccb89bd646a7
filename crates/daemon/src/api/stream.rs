//! Streamed answers: one framing for every stream the API sends (NDJSON
//! lines, or server-sent events), and the events of a streamed command.

use std::convert::Infallible;

use axum::body::{Body, Bytes};
use axum::http::{header, HeaderMap, HeaderValue};
use axum::response::Response;
use serde::Serialize;
use tokio::sync::mpsc;
use utoipa::ToSchema;

use super::commands::ExecOutput;
use super::error::{ApiError, ErrorDetail};
use crate::service::{BakeEvent, DaemonError, RegistryEvent};

/// One NDJSON line (or SSE event) of a streamed command.
#[derive(Debug, Serialize, ToSchema)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum StreamEvent {
    Stdout { data: String },
    Stderr { data: String },
    Exit(ExecOutput),
    Error { error: ErrorDetail },
}

/// What a stream carries: JSON with a name for SSE's `event:` field.
pub(super) trait Event: Serialize + Send + 'static {
    fn name(&self) -> &'static str;
}

impl Event for StreamEvent {
    fn name(&self) -> &'static str {
        match self {
            Self::Stdout { .. } => "stdout",
            Self::Stderr { .. } => "stderr",
            Self::Exit(_) => "exit",
            Self::Error { .. } => "error",
        }
    }
}

impl Event for BakeEvent {
    fn name(&self) -> &'static str {
        match self {
            Self::Step { .. } => "step",
            Self::Output { .. } => "output",
            Self::Done { .. } => "done",
            Self::Failed(_) => "failed",
        }
    }
}

impl Event for RegistryEvent {
    fn name(&self) -> &'static str {
        match self {
            Self::Step { .. } => "step",
            Self::Progress { .. } => "progress",
            Self::Pushed { .. } => "pushed",
            Self::Pulled { .. } => "pulled",
            Self::Failed(_) => "failed",
        }
    }
}

/// How a stream's events are framed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Framing {
    /// `application/x-ndjson`: one JSON document a line.
    Ndjson,
    /// `text/event-stream`: `event: NAME` and `data: JSON`.
    Sse,
}

impl Framing {
    /// The framing the `Accept` header asks for among `offered`, if any
    /// (NDJSON first).
    pub(super) fn accepted(headers: &HeaderMap, offered: &[Framing]) -> Option<Framing> {
        let accept = headers
            .get(header::ACCEPT)
            .and_then(|v| v.to_str().ok())
            .unwrap_or("");
        offered
            .iter()
            .copied()
            .find(|f| accept.contains(f.content_type()))
    }

    fn content_type(self) -> &'static str {
        match self {
            Self::Ndjson => "application/x-ndjson",
            Self::Sse => "text/event-stream",
        }
    }

    fn frame<E: Event>(self, event: &E) -> String {
        let json = serde_json::to_string(event).unwrap_or_default();
        match self {
            Self::Ndjson => format!("{json}\n"),
            Self::Sse => format!("event: {}\ndata: {json}\n\n", event.name()),
        }
    }
}

/// A response streaming every event of `rx`, framed, as it comes.
pub(super) fn streamed<E: Event>(rx: mpsc::Receiver<E>, framing: Framing) -> Response {
    let stream = futures_util::stream::unfold(rx, move |mut rx| async move {
        let event = rx.recv().await?;
        let bytes = Bytes::from(framing.frame(&event));
        Some((Ok::<_, Infallible>(bytes), rx))
    });
    let mut r = Response::new(Body::from_stream(stream));
    r.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static(framing.content_type()),
    );
    r
}

/// Maps the events of `rx` to stream events as they come, until `map`
/// says the stream ends (`None`) or the client left.
pub(super) fn relay<T: Send + 'static>(
    mut rx: mpsc::Receiver<T>,
    mut map: impl FnMut(T) -> Option<StreamEvent> + Send + 'static,
) -> mpsc::Receiver<StreamEvent> {
    let (tx, events) = mpsc::channel(64);
    tokio::spawn(async move {
        while let Some(item) = rx.recv().await {
            let Some(event) = map(item) else { break };
            if tx.send(event).await.is_err() {
                break;
            }
        }
    });
    events
}

pub(super) fn unexpected_end() -> ApiError {
    ApiError::Daemon(DaemonError::Infrastructure {
        what: "the command's event stream ended without a result".into(),
        cause: None,
    })
}

/// One chunk of a command's output as a stream event, decoded with the
/// stream's own UTF-8 carry (`carry[0]` stdout, `carry[1]` stderr).
pub(super) fn output_event(
    carry: &mut [Vec<u8>; 2],
    s: forkbox_proto::OutputStream,
    bytes: Vec<u8>,
) -> StreamEvent {
    let data = utf8_chunk(&mut carry[s as usize], bytes);
    match s {
        forkbox_proto::OutputStream::Stdout => StreamEvent::Stdout { data },
        forkbox_proto::OutputStream::Stderr => StreamEvent::Stderr { data },
    }
}

/// Decodes `bytes` after `carry` as UTF-8, keeping an incomplete trailing
/// character for the next chunk; invalid bytes become U+FFFD.
fn utf8_chunk(carry: &mut Vec<u8>, bytes: Vec<u8>) -> String {
    carry.extend(bytes);
    let keep = match std::str::from_utf8(carry) {
        Ok(_) => 0,
        Err(e) if e.error_len().is_none() => carry.len() - e.valid_up_to(),
        Err(_) => 0,
    };
    let rest = carry.split_off(carry.len() - keep);
    let s = String::from_utf8_lossy(carry).into_owned();
    *carry = rest;
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn utf8_chunk_keeps_split_characters_whole() {
        let mut carry = Vec::new();
        let e = "é".as_bytes();
        assert_eq!(utf8_chunk(&mut carry, vec![b'a', e[0]]), "a");
        assert_eq!(utf8_chunk(&mut carry, vec![e[1], b'b']), "éb");
        assert_eq!(utf8_chunk(&mut carry, vec![0xff, b'c']), "\u{fffd}c");
    }
}
