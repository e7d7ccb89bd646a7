//! `/sandboxes/{id}/files`: guest files: read, write, remove, list,
//! stat, mkdir, and directories as tar archives.

use axum::body::{Body, Bytes};
use axum::extract::RawQuery;
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::Response;
use axum::Json;
use futures_util::StreamExt;
use serde::{Deserialize, Serialize};
use tokio::sync::mpsc;
use utoipa::{IntoParams, ToSchema};

use super::commands::acting_user;
use super::error::{report, ApiError, ApiErrorBody, ApiResult, ErrorDetail};
use super::extract::{query, OnSandbox, UploadBody};
use crate::service::{Daemon, Download, Transfer};

/// A download answers only once this much of it arrived (or all of it):
/// a smaller file gets a `Content-Length` and any failure up to then a
/// status of its own; past it, the rest streams.
const DOWNLOAD_PEEK: usize = 1 << 20;

/// The header that tells a download's size limit.
pub(super) const MAX_BYTES_HEADER: &str = "x-forkbox-max-bytes";

/// The media type of a framed download, which a client asks for with
/// `Accept`. The body is frames, each a kind byte, a 4-byte big-endian
/// length and that many bytes: [`FRAME_DATA`] (the file's or archive's
/// bytes), then one [`FRAME_END`] (all of it came) or [`FRAME_FAILED`]
/// (JSON `{"status": N, "error": {kind, message, infrastructure, …}}`,
/// what an error response would have said). A download that fails after
/// its answer started says why, and the body still ends cleanly: a body
/// without its last frame means the daemon or the connection went away.
pub(super) const FRAMES: &str = "application/vnd.forkbox.frames";
pub(super) const FRAME_DATA: u8 = 0;
pub(super) const FRAME_END: u8 = 1;
pub(super) const FRAME_FAILED: u8 = 2;

/// How a download's body is written.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Framing {
    /// The bytes themselves. A failure after the answer started closes
    /// the connection without the chunked encoding's last chunk; bytes
    /// hyper still held are lost with it, so the count that arrives says
    /// nothing.
    Raw,
    /// [`FRAMES`].
    Frames,
}

impl Framing {
    fn of(headers: &HeaderMap) -> Self {
        let asked = headers
            .get_all(header::ACCEPT)
            .iter()
            .filter_map(|v| v.to_str().ok())
            .flat_map(|v| v.split(','))
            .any(|t| t.split(';').next().map(str::trim) == Some(FRAMES));
        if asked {
            Self::Frames
        } else {
            Self::Raw
        }
    }
}

fn frame(kind: u8, payload: &[u8]) -> Bytes {
    let len = u32::try_from(payload.len()).expect("a download frame is under 4 GiB");
    let mut b = Vec::with_capacity(5 + payload.len());
    b.push(kind);
    b.extend_from_slice(&len.to_be_bytes());
    b.extend_from_slice(payload);
    Bytes::from(b)
}

/// How a download's stream went on after its answer started.
enum Part {
    Data(Vec<u8>),
    End,
    /// Counted and logged; its status and body as an error response.
    Failed(StatusCode, ErrorDetail),
}

#[derive(Debug, Deserialize, IntoParams)]
#[serde(deny_unknown_fields)]
pub(super) struct DownloadQuery {
    /// An absolute guest path.
    path: String,
    /// Stop (413, kind `too_large`) past this many bytes. Default
    /// 256 MiB; at most the daemon's `--max-download-bytes` (4 GiB by
    /// default).
    max_bytes: Option<u64>,
    /// Whose rights the call acts with: a user name or a numeric uid;
    /// default the image's unprivileged user (`user` in the built-in
    /// images; a stored image's `User` unless root, else uid 1000; `root`
    /// must be asked for). The guest's kernel checks every path as that
    /// user's.
    user: Option<String>,
}

#[derive(Debug, Deserialize, IntoParams)]
#[serde(deny_unknown_fields)]
pub(super) struct PathQuery {
    /// An absolute guest path.
    path: String,
    /// Whose rights the call acts with: a user name or a numeric uid;
    /// default the image's unprivileged user (`user` in the built-in
    /// images; a stored image's `User` unless root, else uid 1000; `root`
    /// must be asked for). The guest's kernel checks every path as that
    /// user's.
    user: Option<String>,
}

#[derive(Debug, Deserialize, IntoParams)]
#[serde(deny_unknown_fields)]
pub(super) struct WriteQuery {
    path: String,
    /// Permission bits in octal (default 644).
    mode: Option<String>,
    /// Whose rights the call acts with: a user name or a numeric uid;
    /// default the image's unprivileged user (`user` in the built-in
    /// images; a stored image's `User` unless root, else uid 1000; `root`
    /// must be asked for). The guest's kernel checks every path as that
    /// user's.
    user: Option<String>,
}

#[derive(Debug, Deserialize, IntoParams)]
#[serde(deny_unknown_fields)]
pub(super) struct RemoveQuery {
    path: String,
    /// Remove a whole tree.
    recursive: Option<bool>,
    /// Whose rights the call acts with: a user name or a numeric uid;
    /// default the image's unprivileged user (`user` in the built-in
    /// images; a stored image's `User` unless root, else uid 1000; `root`
    /// must be asked for). The guest's kernel checks every path as that
    /// user's.
    user: Option<String>,
}

pub(super) fn guest_path(p: String) -> ApiResult<String> {
    if !p.starts_with('/') {
        return Err(ApiError::BadRequest(format!("path {p:?} must be absolute")));
    }
    Ok(p)
}

#[derive(Debug, Serialize, ToSchema)]
pub struct FileStatJson {
    /// `file`, `dir`, `symlink` or `other`.
    pub kind: String,
    pub size: u64,
    pub mode: u32,
    pub mtime: i64,
    pub uid: u32,
    pub gid: u32,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct DirEntryJson {
    pub name: String,
    /// The entry's absolute path.
    pub path: String,
    #[serde(flatten)]
    pub stat: FileStatJson,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct Written {
    pub path: String,
    pub bytes: u64,
}

pub(super) fn stat_json(s: &forkbox_proto::FileStat) -> FileStatJson {
    FileStatJson {
        kind: serde_json::to_value(s.kind)
            .ok()
            .and_then(|v| v.as_str().map(str::to_owned))
            .unwrap_or_default(),
        size: s.size,
        mode: s.mode,
        mtime: s.mtime,
        uid: s.uid,
        gid: s.gid,
    }
}

/// Reads a guest file (raw bytes), streamed, up to `max_bytes`. Over the
/// limit: 413 (kind `too_large`) when that is known before the answer
/// starts (a regular file's size, within its first MiB, or a limit of at
/// most 1 MiB); otherwise the body stops short and the connection is
/// closed without the chunked encoding's last chunk, which HTTP clients
/// report as an incomplete read. With `Accept:
/// application/vnd.forkbox.frames` the body is framed instead, and a
/// failure after the answer started is its last frame (see the README's
/// "Files").
#[utoipa::path(get, path = "/sandboxes/{id}/files", params(("id" = String, Path), DownloadQuery),
    responses((status = 200, content_type = "application/octet-stream", description = "the file's bytes"),
              (status = 400, body = ApiErrorBody), (status = 404, body = ApiErrorBody),
              (status = 413, body = ApiErrorBody), (status = 504, body = ApiErrorBody)))]
pub(super) async fn file_read(
    OnSandbox { daemon, id }: OnSandbox,
    RawQuery(raw): RawQuery,
    headers: HeaderMap,
) -> ApiResult<Response> {
    let framing = Framing::of(&headers);
    download(
        daemon,
        id,
        Transfer::File,
        raw,
        ("application/octet-stream", framing),
    )
    .await
}

async fn download(
    daemon: Daemon,
    id: crate::core::SandboxId,
    what: Transfer,
    raw: Option<String>,
    form: (&'static str, Framing),
) -> ApiResult<Response> {
    let q: DownloadQuery = query(raw)?;
    let path = guest_path(q.path)?;
    let bounds = daemon.bounds();
    let max = match q.max_bytes {
        None => bounds.download_default.min(bounds.download_max),
        Some(m) if m > bounds.download_max => {
            return Err(ApiError::BadRequest(format!(
                "max_bytes {m} is over the daemon's limit of {} (forkboxd --max-download-bytes)",
                bounds.download_max
            )))
        }
        Some(m) => m,
    };
    let rx = daemon.download(
        &id,
        acting_user(daemon.default_user(&id), q.user),
        what,
        path,
        max,
    )?;
    download_response(daemon, rx, form, max).await
}

/// The service's download channel closed without saying how it ended.
fn download_cut() -> ApiError {
    ApiError::Daemon(crate::service::DaemonError::Infrastructure {
        what: "the download's stream ended without its end".into(),
        cause: None,
    })
}

/// Waits for the first [`DOWNLOAD_PEEK`] bytes (or the end) of a
/// download, then answers: whole, as an error, or streamed.
async fn download_response(
    daemon: Daemon,
    mut rx: mpsc::Receiver<Download>,
    (content_type, framing): (&'static str, Framing),
    max: u64,
) -> ApiResult<Response> {
    let mut head: Vec<u8> = Vec::new();
    let whole = loop {
        match rx.recv().await {
            Some(Download::Data(b)) => {
                head.extend(b);
                // At the limit, nothing but the end can follow: wait for
                // it, so that a limit of at most a MiB is a whole answer
                // or a 413, never a cut stream.
                if head.len() >= DOWNLOAD_PEEK && (head.len() as u64) < max {
                    break false;
                }
            }
            Some(Download::Done(_)) => break true,
            Some(Download::Failed(e)) => return Err(e.into()),
            None => return Err(download_cut()),
        }
    };
    let body = match (whole, framing) {
        (true, Framing::Raw) => Body::from(head),
        (true, Framing::Frames) => {
            let mut b = frame(FRAME_DATA, &head).to_vec();
            b.extend_from_slice(&frame(FRAME_END, &[]));
            Body::from(b)
        }
        (false, _) => {
            let rest = futures_util::stream::unfold(Some(rx), move |rx| {
                let daemon = daemon.clone();
                async move {
                    let mut rx = rx?;
                    let part = match rx.recv().await {
                        Some(Download::Data(b)) => return Some((Part::Data(b), Some(rx))),
                        Some(Download::Done(_)) => Part::End,
                        Some(Download::Failed(e)) => failed(&daemon, e.into()),
                        None => failed(&daemon, download_cut()),
                    };
                    Some((part, None))
                }
            });
            let head = futures_util::stream::once(async move { Part::Data(head) });
            let parts = head.chain(rest);
            match framing {
                Framing::Raw => Body::from_stream(parts.filter_map(|p| async move {
                    match p {
                        Part::Data(b) => Some(Ok(Bytes::from(b))),
                        Part::End => None,
                        Part::Failed(_, d) => Some(Err(std::io::Error::other(d.message))),
                    }
                })),
                Framing::Frames => Body::from_stream(parts.map(|p| {
                    Ok::<_, std::convert::Infallible>(match p {
                        Part::Data(b) => frame(FRAME_DATA, &b),
                        Part::End => frame(FRAME_END, &[]),
                        Part::Failed(status, error) => {
                            let body = serde_json::json!({
                                "status": status.as_u16(),
                                "error": error,
                            });
                            frame(FRAME_FAILED, body.to_string().as_bytes())
                        }
                    })
                })),
            }
        }
    };
    let mut r = Response::new(body);
    let h = r.headers_mut();
    let content_type = match framing {
        Framing::Raw => content_type,
        Framing::Frames => FRAMES,
    };
    h.insert(header::CONTENT_TYPE, HeaderValue::from_static(content_type));
    h.insert(MAX_BYTES_HEADER, HeaderValue::from(max));
    Ok(r)
}

/// A download that failed after its answer started: counted here, once,
/// and logged.
fn failed(daemon: &Daemon, e: ApiError) -> Part {
    let detail = report(daemon, &e);
    tracing::info!(kind = %detail.kind, "a download failed mid-stream: {}", detail.message);
    Part::Failed(e.status(), detail)
}

/// Writes a guest file from the raw request body, creating parent
/// directories. The body is at most the daemon's `--max-upload-bytes`
/// (1 GiB by default; over it: 413).
#[utoipa::path(put, path = "/sandboxes/{id}/files", params(("id" = String, Path), WriteQuery),
    request_body(content = Vec<u8>, content_type = "application/octet-stream"),
    responses((status = 200, body = Written), (status = 400, body = ApiErrorBody),
              (status = 413, body = ApiErrorBody)))]
pub(super) async fn file_write(
    OnSandbox { daemon, id }: OnSandbox,
    RawQuery(raw): RawQuery,
    UploadBody(body): UploadBody,
) -> ApiResult<Json<Written>> {
    let q: WriteQuery = query(raw)?;
    let path = guest_path(q.path)?;
    let mode = match q.mode {
        None => 0o644,
        Some(m) => u32::from_str_radix(&m, 8)
            .ok()
            .filter(|m| *m <= 0o7777)
            .ok_or_else(|| {
                ApiError::BadRequest(format!("mode {m:?}: expected octal permission bits"))
            })?,
    };
    let bytes = daemon
        .write_file(
            &id,
            acting_user(daemon.default_user(&id), q.user),
            path.clone(),
            mode,
            body,
        )
        .await?;
    Ok(Json(Written { path, bytes }))
}

/// Removes a file, symlink or empty directory (`recursive=true`: a tree).
#[utoipa::path(delete, path = "/sandboxes/{id}/files", params(("id" = String, Path), RemoveQuery),
    responses((status = 204), (status = 404, body = ApiErrorBody)))]
pub(super) async fn file_remove(
    OnSandbox { daemon, id }: OnSandbox,
    RawQuery(raw): RawQuery,
) -> ApiResult<StatusCode> {
    let q: RemoveQuery = query(raw)?;
    let path = guest_path(q.path)?;
    let recursive = q.recursive.unwrap_or(false);
    daemon
        .remove_path(
            &id,
            acting_user(daemon.default_user(&id), q.user),
            path,
            recursive,
        )
        .await?;
    Ok(StatusCode::NO_CONTENT)
}

/// Lists a guest directory.
#[utoipa::path(get, path = "/sandboxes/{id}/files/list", params(("id" = String, Path), PathQuery),
    responses((status = 200, body = [DirEntryJson]), (status = 404, body = ApiErrorBody)))]
pub(super) async fn file_list(
    OnSandbox { daemon, id }: OnSandbox,
    RawQuery(raw): RawQuery,
) -> ApiResult<Json<Vec<DirEntryJson>>> {
    let q: PathQuery = query(raw)?;
    let path = guest_path(q.path)?;
    let entries = daemon
        .list_dir(
            &id,
            acting_user(daemon.default_user(&id), q.user),
            path.clone(),
        )
        .await?;
    let base = path.trim_end_matches('/');
    Ok(Json(
        entries
            .iter()
            .map(|e| DirEntryJson {
                name: e.name.clone(),
                path: format!("{base}/{}", e.name),
                stat: stat_json(&e.stat),
            })
            .collect(),
    ))
}

/// `lstat` of a guest path (404 when missing).
#[utoipa::path(get, path = "/sandboxes/{id}/files/stat", params(("id" = String, Path), PathQuery),
    responses((status = 200, body = FileStatJson), (status = 404, body = ApiErrorBody)))]
pub(super) async fn file_stat(
    OnSandbox { daemon, id }: OnSandbox,
    RawQuery(raw): RawQuery,
) -> ApiResult<Json<FileStatJson>> {
    let q: PathQuery = query(raw)?;
    let path = guest_path(q.path)?;
    Ok(Json(stat_json(
        &daemon
            .stat(&id, acting_user(daemon.default_user(&id), q.user), path)
            .await?,
    )))
}

/// `mkdir -p`.
#[utoipa::path(post, path = "/sandboxes/{id}/files/mkdir", params(("id" = String, Path), PathQuery),
    responses((status = 204), (status = 409, body = ApiErrorBody)))]
pub(super) async fn file_mkdir(
    OnSandbox { daemon, id }: OnSandbox,
    RawQuery(raw): RawQuery,
) -> ApiResult<StatusCode> {
    let q: PathQuery = query(raw)?;
    let path = guest_path(q.path)?;
    daemon
        .mkdir(&id, acting_user(daemon.default_user(&id), q.user), path)
        .await?;
    Ok(StatusCode::NO_CONTENT)
}

/// Downloads a guest directory as a tar archive, streamed, up to
/// `max_bytes`; over it, as for a file read: 413 if known before the
/// answer starts, otherwise a cut stream.
#[utoipa::path(get, path = "/sandboxes/{id}/files/tar", params(("id" = String, Path), DownloadQuery),
    responses((status = 200, content_type = "application/x-tar", description = "the archive"),
              (status = 400, body = ApiErrorBody), (status = 404, body = ApiErrorBody),
              (status = 413, body = ApiErrorBody), (status = 504, body = ApiErrorBody)))]
pub(super) async fn tar_download(
    OnSandbox { daemon, id }: OnSandbox,
    RawQuery(raw): RawQuery,
    headers: HeaderMap,
) -> ApiResult<Response> {
    let framing = Framing::of(&headers);
    download(
        daemon,
        id,
        Transfer::Tar,
        raw,
        ("application/x-tar", framing),
    )
    .await
}

/// Unpacks a tar archive (the request body, at most the daemon's
/// `--max-upload-bytes`) into a guest directory.
#[utoipa::path(put, path = "/sandboxes/{id}/files/tar", params(("id" = String, Path), PathQuery),
    request_body(content = Vec<u8>, content_type = "application/x-tar"),
    responses((status = 200, body = Written), (status = 400, body = ApiErrorBody),
              (status = 413, body = ApiErrorBody)))]
pub(super) async fn tar_upload(
    OnSandbox { daemon, id }: OnSandbox,
    RawQuery(raw): RawQuery,
    UploadBody(body): UploadBody,
) -> ApiResult<Json<Written>> {
    let q: PathQuery = query(raw)?;
    let path = guest_path(q.path)?;
    let bytes = daemon
        .upload_tar(
            &id,
            acting_user(daemon.default_user(&id), q.user),
            path.clone(),
            body,
        )
        .await?;
    Ok(Json(Written { path, bytes }))
}

#[cfg(test)]
mod tests {
    use std::io::Read;
    use std::time::Duration;

    use forkbox_proto::frame::write_frame;
    use forkbox_proto::{encode_control, AgentError, ErrorKind, FrameKind, Request, Response};

    use super::{DOWNLOAD_PEEK, FRAMES, FRAME_DATA, FRAME_END, FRAME_FAILED};
    use crate::api::testing::*;
    use crate::service::Bounds;

    /// A sandbox whose agent answers every call with data frames of
    /// `chunk` bytes for as long as the client reads: its agent's
    /// directory (kept while it lives), the app and its id.
    async fn endless_sandbox(chunk: usize) -> (tempfile::TempDir, Router, String) {
        let dir = tempfile::tempdir().expect("tempdir");
        let sock = scripted_agent(dir.path(), move |conn, _| endless(conn, chunk));
        let app = app_with_agent_and(Some(sock), Bounds::default());
        let id = sandbox(&app).await;
        (dir, app, id)
    }

    /// Sends data frames of `chunk` bytes for as long as the client reads.
    fn endless(conn: &mut std::os::unix::net::UnixStream, chunk: usize) {
        let data = vec![0u8; chunk];
        while write_frame(conn, FrameKind::Data, &data).is_ok() {}
    }

    async fn get(app: &Router, uri: &str) -> axum::response::Response {
        let req = axum::http::Request::builder()
            .uri(uri)
            .body(Body::empty())
            .expect("request");
        app.clone().oneshot(req).await.expect("infallible")
    }

    async fn json(resp: axum::response::Response) -> serde_json::Value {
        let bytes = resp.into_body().collect().await.expect("body").to_bytes();
        serde_json::from_slice(&bytes).expect("a JSON body")
    }

    /// The message of an error response that must be `status`, of `kind`,
    /// and not the machinery's fault.
    async fn clients_fault(
        resp: axum::response::Response,
        status: StatusCode,
        kind: &str,
    ) -> String {
        assert_eq!(resp.status(), status);
        let err = json(resp).await;
        assert_eq!(err["error"]["kind"], kind, "{err}");
        assert_eq!(err["error"]["infrastructure"], false);
        err["error"]["message"]
            .as_str()
            .unwrap_or_default()
            .to_owned()
    }

    /// Also: a read that names no user acts as the image's unprivileged
    /// user.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn file_read_of_a_small_file_is_whole_with_its_length() {
        let dir = tempfile::tempdir().expect("tempdir");
        let sock = scripted_agent(dir.path(), |conn, req| {
            let Request::AsUser { user, request } = req else {
                panic!("not as a user: {req:?}")
            };
            assert_eq!(user, forkbox_proto::User::Name("user".into()));
            assert!(
                matches!(
                    *request,
                    Request::ReadFile {
                        max_bytes: Some(_),
                        ..
                    }
                ),
                "{request:?}"
            );
            write_frame(conn, FrameKind::Data, b"hello").expect("data");
            let done = Response::Done { bytes: 5 };
            write_frame(conn, FrameKind::Control, &encode_control(&done)).expect("done");
        });
        let app = app_with_agent_and(Some(sock), Bounds::default());
        let id = sandbox(&app).await;
        let resp = get(&app, &format!("/sandboxes/{id}/files?path=/f")).await;
        assert_eq!(resp.status(), StatusCode::OK);
        assert_eq!(resp.headers()[header::CONTENT_LENGTH], "5");
        assert_eq!(
            resp.headers()["x-forkbox-max-bytes"],
            (256u64 << 20).to_string().as_str()
        );
        let body = resp.into_body().collect().await.expect("body").to_bytes();
        assert_eq!(&body[..], b"hello");
    }

    /// The agent ignores the limit and sends forever: the daemon stops at
    /// the limit itself. Under the first MiB, that is a 413.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn file_read_from_an_agent_ignoring_the_limit_is_413() {
        let (_dir, app, id) = endless_sandbox(4096).await;
        let resp = get(
            &app,
            &format!("/sandboxes/{id}/files?path=/dev/zero&max_bytes=10000"),
        )
        .await;
        let msg = clients_fault(resp, StatusCode::PAYLOAD_TOO_LARGE, "too_large").await;
        assert!(
            msg.contains("10000 bytes") && msg.contains("max_bytes"),
            "{msg}"
        );
        assert!(msg.contains("--max-download-bytes"), "{msg}");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn tar_download_the_agent_refuses_as_too_large_is_413_with_its_reason() {
        let dir = tempfile::tempdir().expect("tempdir");
        let sock = scripted_agent(dir.path(), |conn, req| {
            // Asked as root: the request goes as it is.
            let Request::DownloadTar { max_bytes, .. } = req else {
                panic!("{req:?}")
            };
            assert_eq!(max_bytes, Some(777));
            let e = Response::Error {
                error: AgentError::new(
                    ErrorKind::TooLarge,
                    "the archive of /d is larger than the limit of 777 bytes",
                ),
            };
            let _ = write_frame(conn, FrameKind::Control, &encode_control(&e));
        });
        let app = app_with_agent_and(Some(sock), Bounds::default());
        let id = sandbox(&app).await;
        let resp = get(
            &app,
            &format!("/sandboxes/{id}/files/tar?path=/d&max_bytes=777&user=root"),
        )
        .await;
        assert_eq!(resp.status(), StatusCode::PAYLOAD_TOO_LARGE);
        let err = json(resp).await;
        let msg = err["error"]["message"].as_str().unwrap_or_default();
        assert!(
            msg.contains("the archive of /d") && msg.contains("max_bytes"),
            "{msg}"
        );
    }

    /// Past the first MiB the answer has started: the stream is cut, and
    /// the client never gets more than the limit.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn file_read_over_the_limit_mid_stream_cuts_the_body_at_the_limit() {
        let (_dir, app, id) = endless_sandbox(64 * 1024).await;
        let limit = 3u64 << 20;
        let resp = get(
            &app,
            &format!("/sandboxes/{id}/files?path=/dev/zero&max_bytes={limit}"),
        )
        .await;
        assert_eq!(resp.status(), StatusCode::OK);
        assert!(resp.headers().get(header::CONTENT_LENGTH).is_none());
        let mut body = resp.into_body();
        let mut got = 0u64;
        let ended = loop {
            match body.frame().await {
                Some(Ok(f)) => got += f.data_ref().map_or(0, |d| d.len() as u64),
                Some(Err(e)) => break Some(e),
                None => break None,
            }
        };
        let e = ended.expect("the body ends with an error, not cleanly");
        assert!(e.to_string().contains("max_bytes"), "{e}");
        assert_eq!(got, limit, "cut at the limit exactly");
        let text = metrics_text(&app).await;
        assert!(
            text.contains("forkbox_errors_total{kind=\"too_large\"} 1"),
            "{text}"
        );
    }

    /// A limit of at most the peek: a file of unknown size over it is a
    /// 413 before anything streams, even when it reaches the peek.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn file_read_over_a_limit_of_a_mib_is_413_not_a_cut_stream() {
        let (_dir, app, id) = endless_sandbox(64 * 1024).await;
        let resp = get(
            &app,
            &format!("/sandboxes/{id}/files?path=/dev/zero&max_bytes={DOWNLOAD_PEEK}"),
        )
        .await;
        clients_fault(resp, StatusCode::PAYLOAD_TOO_LARGE, "too_large").await;
    }

    /// Decodes an HTTP/1.1 chunked body: its bytes, and whether it ended
    /// with the last chunk.
    fn dechunk(mut b: &[u8]) -> (Vec<u8>, bool) {
        let mut out = Vec::new();
        loop {
            let Some(i) = b.windows(2).position(|w| w == b"\r\n") else {
                return (out, false);
            };
            let size = std::str::from_utf8(&b[..i]).expect("chunk size");
            let n = usize::from_str_radix(size.trim(), 16).expect("hex chunk size");
            b = &b[i + 2..];
            if n == 0 {
                return (out, b.starts_with(b"\r\n"));
            }
            if b.len() < n + 2 {
                out.extend_from_slice(&b[..b.len().min(n)]);
                return (out, false);
            }
            out.extend_from_slice(&b[..n]);
            b = &b[n + 2..];
        }
    }

    /// A download over a real HTTP connection, read slowly so that the
    /// server holds bytes it has not yet sent: (head, body bytes, whether
    /// the body ended with its last chunk).
    async fn download_over_http(app: Router, uri: &str, accept: &str) -> (String, Vec<u8>, bool) {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let addr = listener.local_addr().expect("addr");
        tokio::spawn(async move { axum::serve(listener, app).await });
        let mut conn = tokio::net::TcpStream::connect(addr).await.expect("connect");
        let req = format!(
            "GET {uri} HTTP/1.1\r\nHost: forkboxd\r\nAccept: {accept}\r\nConnection: close\r\n\r\n"
        );
        conn.write_all(req.as_bytes()).await.expect("request");
        let mut got = Vec::new();
        let mut buf = vec![0u8; 16 * 1024];
        loop {
            match conn.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => got.extend_from_slice(&buf[..n]),
            }
            tokio::time::sleep(Duration::from_micros(200)).await;
        }
        let split = got
            .windows(4)
            .position(|w| w == b"\r\n\r\n")
            .expect("a response head");
        let head = String::from_utf8_lossy(&got[..split]).into_owned();
        let (body, ended) = dechunk(&got[split + 4..]);
        (head, body, ended)
    }

    /// Frames of a framed download: (kind, payload) each.
    fn frames(mut b: &[u8]) -> Vec<(u8, Vec<u8>)> {
        let mut out = Vec::new();
        while b.len() >= 5 {
            let n = u32::from_be_bytes(b[1..5].try_into().expect("4 bytes")) as usize;
            assert!(b.len() >= 5 + n, "a frame cut short");
            out.push((b[0], b[5..5 + n].to_vec()));
            b = &b[5 + n..];
        }
        assert!(b.is_empty(), "{} bytes after the last frame", b.len());
        out
    }

    /// Past the first MiB the answer has started. Raw, the connection is
    /// closed without the last chunk; framed, every byte up to the limit
    /// arrives, then a frame saying why it stopped, then a clean end.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_download_cut_mid_stream_over_http_is_incomplete_raw_and_says_why_framed() {
        let (_dir, app, id) = endless_sandbox(64 * 1024).await;
        let limit = 3usize << 20;
        let uri = format!("/sandboxes/{id}/files?path=/dev/zero&max_bytes={limit}");
        let (head, body, ended) = download_over_http(app.clone(), &uri, "*/*").await;
        assert!(head.starts_with("HTTP/1.1 200"), "{head}");
        assert!(
            !ended,
            "a raw cut has no last chunk ({} bytes came)",
            body.len()
        );
        let (head, body, ended) = download_over_http(app, &uri, FRAMES).await;
        assert!(head.starts_with("HTTP/1.1 200"), "{head}");
        assert!(head.contains(FRAMES), "{head}");
        assert!(ended, "a framed cut ends cleanly");
        let frames = frames(&body);
        let (last, data) = frames.split_last().expect("frames");
        assert!(data.iter().all(|(k, _)| *k == FRAME_DATA));
        let bytes: usize = data.iter().map(|(_, d)| d.len()).sum();
        assert_eq!(bytes, limit, "every byte up to the limit");
        assert_eq!(last.0, FRAME_FAILED);
        let why: serde_json::Value = serde_json::from_slice(&last.1).expect("JSON");
        assert_eq!(why["status"], 413, "{why}");
        assert_eq!(why["error"]["kind"], "too_large", "{why}");
        assert_eq!(why["error"]["infrastructure"], false, "{why}");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_whole_framed_download_is_its_data_then_its_end() {
        let dir = tempfile::tempdir().expect("tempdir");
        let sock = scripted_agent(dir.path(), |conn, _| {
            write_frame(conn, FrameKind::Data, b"hello").expect("data");
            let done = Response::Done { bytes: 5 };
            write_frame(conn, FrameKind::Control, &encode_control(&done)).expect("done");
        });
        let app = app_with_agent_and(Some(sock), Bounds::default());
        let id = sandbox(&app).await;
        let req = axum::http::Request::builder()
            .uri(format!("/sandboxes/{id}/files?path=/f"))
            .header(header::ACCEPT, format!("application/json, {FRAMES}; q=0.9"))
            .body(Body::empty())
            .expect("request");
        let resp = app.clone().oneshot(req).await.expect("infallible");
        assert_eq!(resp.status(), StatusCode::OK);
        assert_eq!(resp.headers()[header::CONTENT_TYPE], FRAMES);
        let body = resp.into_body().collect().await.expect("body").to_bytes();
        assert_eq!(
            frames(&body),
            vec![(FRAME_DATA, b"hello".to_vec()), (FRAME_END, Vec::new())]
        );
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn file_read_max_bytes_over_the_daemon_s_limit_is_400() {
        let app = app_with_agent_and(
            None,
            Bounds {
                download_max: 1000,
                ..Bounds::default()
            },
        );
        let id = sandbox(&app).await;
        let resp = get(
            &app,
            &format!("/sandboxes/{id}/files?path=/f&max_bytes=1001"),
        )
        .await;
        assert_eq!(resp.status(), StatusCode::BAD_REQUEST);
        let msg = json(resp).await["error"]["message"]
            .as_str()
            .unwrap_or_default()
            .to_owned();
        assert!(msg.contains("--max-download-bytes"), "{msg}");
    }

    /// A FIFO nobody writes, as the guest sees it: the agent never
    /// answers. The call ends at its deadline, the guest's fault.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn file_read_the_guest_never_answers_is_504_guest_timeout() {
        let dir = tempfile::tempdir().expect("tempdir");
        let sock = scripted_agent(dir.path(), |conn, _| {
            let _ = conn.read(&mut [0u8; 1]);
        });
        let bounds = Bounds {
            agent_call: Duration::from_millis(200),
            ..Bounds::default()
        };
        let app = app_with_agent_and(Some(sock), bounds);
        let id = sandbox(&app).await;
        let resp = get(&app, &format!("/sandboxes/{id}/files?path=/fifo")).await;
        assert_eq!(resp.status(), StatusCode::GATEWAY_TIMEOUT);
        let err = json(resp).await;
        assert_eq!(err["error"]["kind"], "guest_timeout", "{err}");
        assert_eq!(err["error"]["infrastructure"], false);
        // The sandbox is not blamed on the machinery: it still runs.
        let (_, info) = call(&app, "GET", &format!("/sandboxes/{id}"), "").await;
        assert_eq!(info["state"], "running");
    }

    #[tokio::test]
    async fn file_upload_over_the_upload_limit_is_413_json() {
        let app = app_with_agent_and(
            None,
            Bounds {
                upload_max: 1000,
                ..Bounds::default()
            },
        );
        let id = sandbox(&app).await;
        let req = axum::http::Request::builder()
            .method("PUT")
            .uri(format!("/sandboxes/{id}/files?path=/f"))
            .body(Body::from(vec![0u8; 1001]))
            .expect("request");
        let resp = app.clone().oneshot(req).await.expect("infallible");
        assert_eq!(resp.status(), StatusCode::PAYLOAD_TOO_LARGE);
        let err = json(resp).await;
        assert_eq!(err["error"]["kind"], "too_large", "{err}");
        let msg = err["error"]["message"].as_str().unwrap_or_default();
        assert!(msg.contains("--max-upload-bytes"), "{msg}");
    }
    /// An agent that takes one upload: `Ready`, then data frames until
    /// the end frame (answered `Done`) or a cut; what it got goes to `got`.
    fn receiving_agent(
        dir: &std::path::Path,
        got: Arc<std::sync::Mutex<Vec<(u64, bool)>>>,
    ) -> std::path::PathBuf {
        use forkbox_proto::frame::read_frame;
        scripted_agent(dir, move |conn, _| {
            write_frame(conn, FrameKind::Control, &encode_control(&Response::Ready))
                .expect("ready");
            let mut bytes = 0u64;
            let ended = loop {
                match read_frame(conn, forkbox_proto::MAX_FRAME_LEN) {
                    Ok(Some(f)) if f.kind == FrameKind::Data => bytes += f.body.len() as u64,
                    Ok(Some(f)) => break f.kind == FrameKind::Eof,
                    _ => break false,
                }
            };
            got.lock().expect("got").push((bytes, ended));
            let done = Response::Done { bytes };
            let _ = write_frame(conn, FrameKind::Control, &encode_control(&done));
        })
    }

    /// What the receiving agent got, once it has (within 5 s).
    async fn received(got: &std::sync::Mutex<Vec<(u64, bool)>>) -> (u64, bool) {
        for _ in 0..500 {
            if let Some(&g) = got.lock().expect("got").first() {
                return g;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        panic!("the agent got no upload");
    }

    /// A request body of `chunks` with no length, as a chunked upload.
    fn chunked(chunks: Vec<Vec<u8>>) -> Body {
        Body::from_stream(futures_util::stream::iter(
            chunks.into_iter().map(Ok::<_, std::io::Error>),
        ))
    }

    async fn put(app: &Router, uri: &str, body: Body) -> axum::response::Response {
        let req = axum::http::Request::builder()
            .method("PUT")
            .uri(uri)
            .body(body)
            .expect("request");
        app.clone().oneshot(req).await.expect("infallible")
    }

    /// A streamed upload reaches the agent whole, chunk after chunk.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn file_upload_without_a_length_streams_whole_to_the_agent() {
        let dir = tempfile::tempdir().expect("tempdir");
        let got = Arc::default();
        let sock = receiving_agent(dir.path(), Arc::clone(&got));
        let app = app_with_agent_and(Some(sock), Bounds::default());
        let id = sandbox(&app).await;
        let body = chunked((0..64).map(|i| vec![i as u8; 100_000]).collect());
        let resp = put(&app, &format!("/sandboxes/{id}/files?path=/f"), body).await;
        assert_eq!(resp.status(), StatusCode::OK);
        assert_eq!(json(resp).await["bytes"], 6_400_000);
        assert_eq!(*got.lock().expect("got"), vec![(6_400_000, true)]);
    }

    /// The daemon holds a few chunks of an upload, never the whole: with
    /// an agent slower than the client, the body is read only as far
    /// ahead of the agent as the chunks in flight and the socket buffers.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn file_upload_is_read_only_a_few_chunks_ahead_of_a_slow_agent() {
        use forkbox_proto::frame::read_frame;
        use std::sync::atomic::{AtomicU64, Ordering};
        const CHUNK: u64 = 100_000;
        const CHUNKS: u64 = 128;
        let produced = Arc::new(AtomicU64::new(0));
        let lead = Arc::new(AtomicU64::new(0));
        let dir = tempfile::tempdir().expect("tempdir");
        let (p, l) = (Arc::clone(&produced), Arc::clone(&lead));
        let sock = scripted_agent(dir.path(), move |conn, _| {
            write_frame(conn, FrameKind::Control, &encode_control(&Response::Ready))
                .expect("ready");
            let mut bytes = 0u64;
            while let Ok(Some(f)) = read_frame(conn, forkbox_proto::MAX_FRAME_LEN) {
                if f.kind != FrameKind::Data {
                    break;
                }
                bytes += f.body.len() as u64;
                l.fetch_max(
                    p.load(Ordering::SeqCst).saturating_sub(bytes),
                    Ordering::SeqCst,
                );
                std::thread::sleep(Duration::from_micros(500));
            }
            let done = Response::Done { bytes };
            let _ = write_frame(conn, FrameKind::Control, &encode_control(&done));
        });
        let app = app_with_agent_and(Some(sock), Bounds::default());
        let id = sandbox(&app).await;
        let p = Arc::clone(&produced);
        let body = Body::from_stream(futures_util::stream::unfold(0u64, move |i| {
            let p = Arc::clone(&p);
            async move {
                (i < CHUNKS).then(|| {
                    p.fetch_add(CHUNK, Ordering::SeqCst);
                    (Ok::<_, std::io::Error>(vec![1u8; CHUNK as usize]), i + 1)
                })
            }
        }));
        let resp = put(&app, &format!("/sandboxes/{id}/files?path=/f"), body).await;
        assert_eq!(resp.status(), StatusCode::OK);
        assert_eq!(json(resp).await["bytes"], CHUNK * CHUNKS);
        let lead = lead.load(Ordering::SeqCst);
        // Chunks in flight, the one being read and the one being sent, and
        // what the socket buffers: far below the 12.8 MB upload.
        assert!(
            lead <= 2_000_000,
            "the body was read {lead} bytes ahead of the agent"
        );
    }

    /// Without a length, an upload over the limit is cut there: the guest
    /// got exactly the limit, the client a 413 that says so.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn file_upload_without_a_length_over_the_limit_is_cut_at_it_and_413() {
        let dir = tempfile::tempdir().expect("tempdir");
        let got = Arc::default();
        let sock = receiving_agent(dir.path(), Arc::clone(&got));
        let bounds = Bounds {
            upload_max: 250_000,
            ..Bounds::default()
        };
        let app = app_with_agent_and(Some(sock), bounds);
        let id = sandbox(&app).await;
        let body = chunked((0..8).map(|_| vec![7u8; 100_000]).collect());
        let resp = put(&app, &format!("/sandboxes/{id}/files?path=/f"), body).await;
        let msg = clients_fault(resp, StatusCode::PAYLOAD_TOO_LARGE, "too_large").await;
        assert!(
            msg.contains("250000") && msg.contains("guest file /f"),
            "{msg}"
        );
        // The daemon answers without waiting for the agent's last word.
        let got = received(&got).await;
        assert_eq!(got.0, 250_000, "the guest got exactly the limit");
        // The sandbox is not blamed: it still runs.
        let (_, info) = call(&app, "GET", &format!("/sandboxes/{id}"), "").await;
        assert_eq!(info["state"], "running");
    }

    /// With a length over the limit, nothing reaches the guest.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn file_upload_with_a_length_over_the_limit_never_reaches_the_agent() {
        let dir = tempfile::tempdir().expect("tempdir");
        let got: Arc<std::sync::Mutex<Vec<(u64, bool)>>> = Arc::default();
        let sock = receiving_agent(dir.path(), Arc::clone(&got));
        let bounds = Bounds {
            upload_max: 1000,
            ..Bounds::default()
        };
        let app = app_with_agent_and(Some(sock), bounds);
        let id = sandbox(&app).await;
        for uri in [
            format!("/sandboxes/{id}/files?path=/f"),
            format!("/sandboxes/{id}/files/tar?path=/d"),
        ] {
            let resp = put(&app, &uri, Body::from(vec![0u8; 1001])).await;
            assert_eq!(resp.status(), StatusCode::PAYLOAD_TOO_LARGE, "{uri}");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert!(got.lock().expect("got").is_empty());
    }

    /// A client whose body breaks off: a 400 saying what the guest holds,
    /// and the agent saw the upload end early, not a whole file.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn file_upload_whose_body_breaks_off_is_the_clients_400() {
        let dir = tempfile::tempdir().expect("tempdir");
        let got = Arc::default();
        let sock = receiving_agent(dir.path(), Arc::clone(&got));
        let app = app_with_agent_and(Some(sock), Bounds::default());
        let id = sandbox(&app).await;
        let body = Body::from_stream(futures_util::stream::iter(vec![
            Ok(vec![1u8; 1000]),
            Err(std::io::Error::other("connection reset")),
        ]));
        let resp = put(&app, &format!("/sandboxes/{id}/files?path=/f"), body).await;
        let msg = clients_fault(resp, StatusCode::BAD_REQUEST, "invalid_request").await;
        assert!(
            msg.contains("broke off") && msg.contains("connection reset"),
            "{msg}"
        );
        assert_eq!(received(&got).await.0, 1000);
    }
}
