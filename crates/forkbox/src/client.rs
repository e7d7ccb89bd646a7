//! The client of forkboxd's HTTP+JSON API, as the `forkbox` CLI uses it.
//!
//! Blocking calls over HTTP/1 on a current-thread tokio runtime, one
//! connection per request, to a unix socket or a TCP address. Where the
//! daemon is: [`Endpoint::from_env`] (`FORKBOX_URL`, else the socket
//! forkboxd listens on by default). Streams (NDJSON) are read line by line
//! with [`Response::next_line`].
//!
//! Owns no knowledge of the API's shapes beyond its error body: callers
//! pick the paths and the JSON.

use std::io;
use std::path::PathBuf;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::header::{HeaderValue, ACCEPT, AUTHORIZATION, CONTENT_TYPE, HOST};
use hyper::{Method, Request, StatusCode};
use hyper_util::rt::TokioIo;
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

/// Where forkboxd listens.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Endpoint {
    /// `unix:///path/to/forkbox.sock`
    Unix(PathBuf),
    /// `http://host:port` (also `tcp://host:port`, forkboxd's own spelling).
    Tcp { authority: String },
}

impl std::str::FromStr for Endpoint {
    type Err = ClientError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let bad = || ClientError::BadUrl(s.into());
        if let Some(path) = s.strip_prefix("unix://") {
            if !path.starts_with('/') {
                return Err(bad());
            }
            return Ok(Self::Unix(path.into()));
        }
        let rest = s
            .strip_prefix("http://")
            .or_else(|| s.strip_prefix("tcp://"))
            .ok_or_else(bad)?;
        let authority = rest.strip_suffix('/').unwrap_or(rest);
        let port_ok = authority
            .rsplit_once(':')
            .is_some_and(|(host, port)| !host.is_empty() && port.parse::<u16>().is_ok());
        if !port_ok || authority.contains('/') {
            return Err(bad());
        }
        Ok(Self::Tcp {
            authority: authority.into(),
        })
    }
}

impl std::fmt::Display for Endpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Unix(p) => write!(f, "unix://{}", p.display()),
            Self::Tcp { authority } => write!(f, "http://{authority}"),
        }
    }
}

impl Endpoint {
    /// `FORKBOX_URL`, else forkboxd's default socket.
    pub fn from_env() -> Result<Self, ClientError> {
        match std::env::var("FORKBOX_URL") {
            Ok(url) if !url.is_empty() => url.parse(),
            _ => forkbox_host::socket::default_socket(
                rustix::process::geteuid().is_root(),
                std::env::var("XDG_RUNTIME_DIR").ok().as_deref(),
            )
            .map(Self::Unix)
            .ok_or(ClientError::NoDefault),
        }
    }
}

/// The `error` object of forkboxd's error bodies.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ApiError {
    pub kind: String,
    pub message: String,
    /// The sandbox machinery failed, not the request.
    #[serde(default)]
    pub infrastructure: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub guest_kind: Option<String>,
    /// For `template_failed`: the failed step and its output.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub step: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub output: Option<String>,
}

#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    #[error("{0:?}: expected unix:///PATH or http://HOST:PORT")]
    BadUrl(String),
    #[error("no daemon address: not root and $XDG_RUNTIME_DIR is unset; set FORKBOX_URL")]
    NoDefault,
    #[error("forkboxd is not reachable at {endpoint} (start it with `forkbox daemon`)")]
    Unreachable {
        endpoint: String,
        #[source]
        source: io::Error,
    },
    #[error("starting the client's runtime")]
    Runtime(#[source] io::Error),
    #[error("building the request")]
    Request(#[source] hyper::http::Error),
    #[error("talking to forkboxd")]
    Http(#[source] hyper::Error),
    #[error("forkboxd: {} ({}, {status})", .error.message, .error.kind)]
    Api { status: u16, error: Box<ApiError> },
    #[error("forkboxd answered {status} without a JSON error: {body}")]
    Status { status: u16, body: String },
    #[error("forkboxd sent JSON this client does not understand")]
    Decode(#[source] serde_json::Error),
    #[error("the download stopped after {received} bytes, before forkboxd said how it ended: forkboxd or the connection to it went away (see its log)")]
    Interrupted { received: u64 },
    #[error("a download frame of unknown kind {0}: is forkboxd newer than this client?")]
    Frame(u8),
}

/// The media type of a framed download (`GET …/files`, `…/files/tar`):
/// frames of a kind byte (0 data, 1 the end, 2 a failure with its JSON
/// error), a 4-byte big-endian length and the payload, so that a download
/// that fails after its answer started still says why.
pub const FRAMES: &str = "application/vnd.forkbox.frames";

impl ClientError {
    /// The daemon's error object, if it answered with one.
    pub fn api(&self) -> Option<&ApiError> {
        match self {
            Self::Api { error, .. } => Some(error),
            _ => None,
        }
    }
}

/// A request body.
#[derive(Debug, Clone)]
pub enum Body {
    Empty,
    Json(Vec<u8>),
    /// Raw bytes with their content type.
    Raw(Vec<u8>, &'static str),
}

impl Body {
    pub fn json(v: &impl Serialize) -> Self {
        Self::Json(serde_json::to_vec(v).expect("a JSON value always serializes"))
    }
}

/// A connection factory for one daemon.
pub struct Client {
    endpoint: Endpoint,
    token: Option<String>,
    rt: tokio::runtime::Runtime,
}

impl Client {
    pub fn new(endpoint: Endpoint, token: Option<String>) -> Result<Self, ClientError> {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_io()
            .build()
            .map_err(ClientError::Runtime)?;
        Ok(Self {
            endpoint,
            token: token.filter(|t| !t.is_empty()),
            rt,
        })
    }

    /// [`Endpoint::from_env`] and `FORKBOX_TOKEN`.
    pub fn from_env() -> Result<Self, ClientError> {
        Self::new(Endpoint::from_env()?, std::env::var("FORKBOX_TOKEN").ok())
    }

    /// Sends one request; any status comes back (see [`Response::ok`]).
    /// `accept`: the `Accept` header, e.g. `application/x-ndjson`.
    pub fn send(
        &self,
        method: Method,
        path_and_query: &str,
        body: Body,
        accept: Option<&'static str>,
    ) -> Result<Response<'_>, ClientError> {
        let host = match &self.endpoint {
            Endpoint::Unix(_) => "forkboxd",
            Endpoint::Tcp { authority } => authority,
        };
        let mut req = Request::builder()
            .method(method)
            .uri(path_and_query)
            .header(HOST, host);
        if let Some(t) = &self.token {
            req = req.header(AUTHORIZATION, format!("Bearer {t}"));
        }
        if let Some(a) = accept {
            req = req.header(ACCEPT, HeaderValue::from_static(a));
        }
        let (bytes, content_type) = match body {
            Body::Empty => (Vec::new(), None),
            Body::Json(b) => (b, Some("application/json")),
            Body::Raw(b, ct) => (b, Some(ct)),
        };
        if let Some(ct) = content_type {
            req = req.header(CONTENT_TYPE, ct);
        }
        let req = req
            .body(Full::new(Bytes::from(bytes)))
            .map_err(ClientError::Request)?;
        let resp = self.rt.block_on(async {
            let mut sender = match &self.endpoint {
                Endpoint::Unix(path) => {
                    let s = tokio::net::UnixStream::connect(path)
                        .await
                        .map_err(|e| self.unreachable(e))?;
                    self.handshake(s).await?
                }
                Endpoint::Tcp { authority } => {
                    let s = tokio::net::TcpStream::connect(authority.as_str())
                        .await
                        .map_err(|e| self.unreachable(e))?;
                    self.handshake(s).await?
                }
            };
            sender.send_request(req).await.map_err(ClientError::Http)
        })?;
        let (parts, body) = resp.into_parts();
        Ok(Response {
            status: parts.status,
            headers: parts.headers,
            body,
            rt: &self.rt,
            pending: Vec::new(),
            done: false,
        })
    }

    /// Sends a request and fails with the daemon's error unless it answers
    /// 2xx.
    pub fn call(
        &self,
        method: Method,
        path_and_query: &str,
        body: Body,
    ) -> Result<Response<'_>, ClientError> {
        self.send(method, path_and_query, body, None)?.ok()
    }

    /// `GET` and decode the JSON answer.
    pub fn get<T: DeserializeOwned>(&self, path_and_query: &str) -> Result<T, ClientError> {
        self.call(Method::GET, path_and_query, Body::Empty)?.json()
    }

    fn unreachable(&self, source: io::Error) -> ClientError {
        ClientError::Unreachable {
            endpoint: self.endpoint.to_string(),
            source,
        }
    }

    async fn handshake<S>(
        &self,
        stream: S,
    ) -> Result<hyper::client::conn::http1::SendRequest<Full<Bytes>>, ClientError>
    where
        S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
    {
        let (sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
            .await
            .map_err(ClientError::Http)?;
        // The connection makes progress while we block on this runtime
        // (sending, then reading the body); its errors surface there too.
        tokio::spawn(async move {
            let _ = conn.await;
        });
        Ok(sender)
    }
}

/// An answer whose body is read on demand.
pub struct Response<'c> {
    status: StatusCode,
    headers: hyper::HeaderMap,
    body: Incoming,
    rt: &'c tokio::runtime::Runtime,
    pending: Vec<u8>,
    done: bool,
}

impl Response<'_> {
    /// Itself when 2xx, else the daemon's error.
    pub fn ok(self) -> Result<Self, ClientError> {
        if self.status.is_success() {
            return Ok(self);
        }
        let status = self.status.as_u16();
        let body = self.bytes()?;
        #[derive(Deserialize)]
        struct ErrorBody {
            error: ApiError,
        }
        match serde_json::from_slice::<ErrorBody>(&body) {
            Ok(b) => Err(ClientError::Api {
                status,
                error: Box::new(b.error),
            }),
            Err(_) => Err(ClientError::Status {
                status,
                body: String::from_utf8_lossy(&body).into_owned(),
            }),
        }
    }

    /// The next chunk of the body, `None` at its end.
    pub fn next_chunk(&mut self) -> Result<Option<Bytes>, ClientError> {
        while !self.done {
            match self.rt.block_on(self.body.frame()) {
                None => self.done = true,
                Some(Err(e)) => return Err(ClientError::Http(e)),
                Some(Ok(frame)) => {
                    if let Ok(data) = frame.into_data() {
                        return Ok(Some(data));
                    }
                }
            }
        }
        Ok(None)
    }

    /// The next line of an NDJSON stream (without its newline), `None` at
    /// the end; a last line without a newline still counts.
    pub fn next_line(&mut self) -> Result<Option<Vec<u8>>, ClientError> {
        loop {
            if let Some(i) = self.pending.iter().position(|b| *b == b'\n') {
                let mut line: Vec<u8> = self.pending.drain(..=i).collect();
                line.pop();
                return Ok(Some(line));
            }
            match self.next_chunk()? {
                Some(c) => self.pending.extend_from_slice(&c),
                None if self.pending.is_empty() => return Ok(None),
                None => return Ok(Some(std::mem::take(&mut self.pending))),
            }
        }
    }

    /// The next NDJSON line decoded, skipping blank lines.
    pub fn next_json<T: DeserializeOwned>(&mut self) -> Result<Option<T>, ClientError> {
        while let Some(line) = self.next_line()? {
            if line.iter().all(u8::is_ascii_whitespace) {
                continue;
            }
            return serde_json::from_slice(&line)
                .map(Some)
                .map_err(ClientError::Decode);
        }
        Ok(None)
    }

    /// The whole body.
    pub fn bytes(mut self) -> Result<Vec<u8>, ClientError> {
        let mut out = std::mem::take(&mut self.pending);
        while let Some(c) = self.next_chunk()? {
            out.extend_from_slice(&c);
        }
        Ok(out)
    }

    /// A framed download's bytes ([`FRAMES`]): its data, or the error its
    /// failure frame names, or [`ClientError::Interrupted`] when the body
    /// ends before its end frame.
    pub fn framed_bytes(mut self) -> Result<Vec<u8>, ClientError> {
        // A daemon older than frames answers with the bytes themselves.
        let framed = self
            .headers
            .get(hyper::header::CONTENT_TYPE)
            .is_some_and(|t| t.as_bytes() == FRAMES.as_bytes());
        if !framed {
            return self.bytes();
        }
        let mut buf = std::mem::take(&mut self.pending);
        let mut out = Vec::new();
        loop {
            while let Some(head) = buf.get(..5) {
                let n = u32::from_be_bytes([head[1], head[2], head[3], head[4]]) as usize;
                let Some(payload) = buf.get(5..5 + n) else {
                    break;
                };
                match head[0] {
                    0 => out.extend_from_slice(payload),
                    1 => return Ok(out),
                    2 => {
                        #[derive(Deserialize)]
                        struct Failed {
                            status: u16,
                            error: ApiError,
                        }
                        let f: Failed =
                            serde_json::from_slice(payload).map_err(ClientError::Decode)?;
                        return Err(ClientError::Api {
                            status: f.status,
                            error: Box::new(f.error),
                        });
                    }
                    kind => return Err(ClientError::Frame(kind)),
                }
                buf.drain(..5 + n);
            }
            // A body that breaks off (a daemon that died mid-stream) is
            // interrupted, as one that ends without its end frame.
            match self.next_chunk() {
                Ok(Some(c)) => buf.extend_from_slice(&c),
                Ok(None) | Err(ClientError::Http(_)) => {
                    return Err(ClientError::Interrupted {
                        received: out.len() as u64,
                    })
                }
                Err(e) => return Err(e),
            }
        }
    }

    /// The whole body as JSON.
    pub fn json<T: DeserializeOwned>(self) -> Result<T, ClientError> {
        serde_json::from_slice(&self.bytes()?).map_err(ClientError::Decode)
    }
}

/// Characters left as they are in a path segment.
const SEGMENT: &percent_encoding::AsciiSet = &percent_encoding::NON_ALPHANUMERIC
    .remove(b'-')
    .remove(b'_')
    .remove(b'.')
    .remove(b'~');

/// `s` percent-encoded as one path segment.
pub fn segment(s: &str) -> String {
    percent_encoding::utf8_percent_encode(s, SEGMENT).to_string()
}

/// `path` with `pairs` as its query string (form-encoded).
pub fn with_query<'a>(path: &str, pairs: impl IntoIterator<Item = (&'a str, &'a str)>) -> String {
    let mut q = form_urlencoded::Serializer::new(String::new());
    let mut any = false;
    for (k, v) in pairs {
        q.append_pair(k, v);
        any = true;
    }
    if any {
        format!("{path}?{}", q.finish())
    } else {
        path.to_owned()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn endpoint_parses_unix_http_and_tcp() {
        assert_eq!(
            "unix:///tmp/f.sock".parse::<Endpoint>().expect("unix"),
            Endpoint::Unix("/tmp/f.sock".into())
        );
        assert_eq!(
            "http://127.0.0.1:7000".parse::<Endpoint>().expect("http"),
            Endpoint::Tcp {
                authority: "127.0.0.1:7000".into()
            }
        );
        assert_eq!(
            "http://box.local:7000/".parse::<Endpoint>().expect("slash"),
            Endpoint::Tcp {
                authority: "box.local:7000".into()
            }
        );
        assert_eq!(
            "tcp://[::1]:7000".parse::<Endpoint>().expect("tcp"),
            Endpoint::Tcp {
                authority: "[::1]:7000".into()
            }
        );
    }

    #[test]
    fn endpoint_bad_urls_are_refused() {
        for bad in [
            "unix://",
            "unix://relative.sock",
            "https://h:1",
            "http://nohost",
            "http://:80",
            "http://h:80/api",
            "h:80",
        ] {
            assert!(
                matches!(bad.parse::<Endpoint>(), Err(ClientError::BadUrl(_))),
                "{bad}"
            );
        }
    }

    #[test]
    fn endpoint_display_round_trips() {
        for s in ["unix:///run/forkbox/forkbox.sock", "http://h:1"] {
            assert_eq!(s.parse::<Endpoint>().expect("parse").to_string(), s);
        }
    }

    #[test]
    fn query_and_segment_are_encoded() {
        assert_eq!(
            with_query("/sandboxes/sb-1/files", [("path", "/a b/c&d")]),
            "/sandboxes/sb-1/files?path=%2Fa+b%2Fc%26d"
        );
        assert_eq!(with_query("/sandboxes", []), "/sandboxes");
        assert_eq!(segment("py-3.12"), "py-3.12");
        assert_eq!(segment("a/b c"), "a%2Fb%20c");
    }

    #[test]
    fn unreachable_daemon_says_to_start_it() {
        let dir = tempfile::tempdir().expect("tempdir");
        let c = Client::new(Endpoint::Unix(dir.path().join("none.sock")), None).expect("client");
        let e = c
            .get::<serde_json::Value>("/health")
            .expect_err("nothing listens there");
        assert!(e.to_string().contains("forkbox daemon"), "{e}");
    }

    /// A daemon on a unix socket that answers one request with `body`
    /// (HTTP/1.1, close-delimited).
    fn answering(body: Vec<u8>) -> (tempfile::TempDir, Client) {
        use std::io::{Read, Write};
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("d.sock");
        let listener = std::os::unix::net::UnixListener::bind(&path).expect("bind");
        std::thread::spawn(move || {
            let (mut conn, _) = listener.accept().expect("accept");
            let mut req = [0u8; 4096];
            let _ = conn.read(&mut req);
            let head =
                format!("HTTP/1.1 200 OK\r\ncontent-type: {FRAMES}\r\nconnection: close\r\n\r\n");
            let _ = conn.write_all(head.as_bytes());
            let _ = conn.write_all(&body);
        });
        let client = Client::new(Endpoint::Unix(path), None).expect("client");
        (dir, client)
    }

    fn frame(kind: u8, payload: &[u8]) -> Vec<u8> {
        let mut f = vec![kind];
        f.extend_from_slice(&(payload.len() as u32).to_be_bytes());
        f.extend_from_slice(payload);
        f
    }

    fn download(body: Vec<u8>) -> Result<Vec<u8>, ClientError> {
        let (_dir, client) = answering(body);
        client
            .send(Method::GET, "/f", Body::Empty, Some(FRAMES))?
            .ok()?
            .framed_bytes()
    }

    #[test]
    fn framed_download_is_its_data_or_the_error_its_last_frame_names() {
        let whole = [frame(0, b"hello "), frame(0, b"world"), frame(1, b"")].concat();
        assert_eq!(download(whole).expect("whole"), b"hello world");
        let why = br#"{"status":413,"error":{"kind":"too_large","message":"over 5 bytes","infrastructure":false}}"#;
        let cut = [frame(0, b"hello"), frame(2, why)].concat();
        match download(cut) {
            Err(ClientError::Api { status: 413, error }) => assert_eq!(error.kind, "too_large"),
            other => panic!("{other:?}"),
        }
        match download(frame(0, b"hel")[..6].to_vec()) {
            Err(ClientError::Interrupted { received: 0 }) => {}
            other => panic!("{other:?}"),
        }
        match download([frame(0, b"abc"), frame(9, b"")].concat()) {
            Err(ClientError::Frame(9)) => {}
            other => panic!("{other:?}"),
        }
    }
}
