//! What every handler parses first: the sandbox (and process) a path
//! names, with the daemon to ask ([`OnSandbox`], [`OnProcess`]); JSON
//! bodies and query strings whose rejections are 400s in our error
//! format; seconds, pids and policies.

use std::collections::HashMap;
use std::time::Duration;

use axum::body::{Bytes, HttpBody};
use axum::extract::{FromRequest, FromRequestParts, Path, Request};
use axum::http::request::Parts;
use axum::http::StatusCode;
use axum::Json;

use super::error::{ApiError, ApiResult};
use super::{AppState, MAX_COMMAND_BODY, MAX_JSON_BODY};
use crate::core::SandboxId;
use crate::network::NetworkPolicy;
use crate::service::{chain, Daemon, Upload};

/// A request about one sandbox (`/sandboxes/{id}/...`): the daemon and
/// the sandbox's id. An id that cannot be one is a 404.
pub(super) struct OnSandbox {
    pub(super) daemon: Daemon,
    pub(super) id: SandboxId,
}

impl FromRequestParts<AppState> for OnSandbox {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, st: &AppState) -> ApiResult<Self> {
        let params = path_params(parts, st).await?;
        Ok(Self {
            daemon: st.daemon.clone(),
            id: sandbox_id(param(&params, "id")?)?,
        })
    }
}

/// A request about one process of a sandbox
/// (`/sandboxes/{id}/processes/{pid}/...`). A pid that is not a number
/// is a 400.
pub(super) struct OnProcess {
    pub(super) daemon: Daemon,
    pub(super) id: SandboxId,
    pub(super) pid: u32,
}

impl FromRequestParts<AppState> for OnProcess {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, st: &AppState) -> ApiResult<Self> {
        let params = path_params(parts, st).await?;
        Ok(Self {
            daemon: st.daemon.clone(),
            id: sandbox_id(param(&params, "id")?)?,
            pid: pid_of(param(&params, "pid")?)?,
        })
    }
}

async fn path_params(parts: &mut Parts, st: &AppState) -> ApiResult<HashMap<String, String>> {
    Path::<HashMap<String, String>>::from_request_parts(parts, st)
        .await
        .map(|Path(p)| p)
        .map_err(|rej| ApiError::BadRequest(format!("malformed path: {}", rej.body_text())))
}

/// A path parameter the route defines.
pub(super) fn param<'a>(params: &'a HashMap<String, String>, name: &str) -> ApiResult<&'a str> {
    params
        .get(name)
        .map(String::as_str)
        .ok_or_else(|| ApiError::NotFound(format!("no path parameter {name:?}")))
}

/// `axum::Json` whose rejections are 400s (413 over the body limit) in
/// our error format.
pub(super) struct JsonBody<T>(pub(super) T);

impl<T: serde::de::DeserializeOwned> FromRequest<AppState> for JsonBody<T> {
    type Rejection = ApiError;

    async fn from_request(req: Request, st: &AppState) -> Result<Self, Self::Rejection> {
        match Json::<T>::from_request(req, st).await {
            Ok(Json(v)) => Ok(Self(v)),
            Err(rej) if rej.status() == StatusCode::PAYLOAD_TOO_LARGE => Err(too_large(st)),
            Err(rej) => Err(ApiError::BadRequest(format!(
                "malformed request body: {}",
                rej.body_text()
            ))),
        }
    }
}

/// A whole request body (an upload, or JSON that may be empty), its
/// rejections in our error format (413 over the route's limit).
pub(super) struct RawBody(pub(super) Bytes);

impl FromRequest<AppState> for RawBody {
    type Rejection = ApiError;

    async fn from_request(req: Request, st: &AppState) -> Result<Self, Self::Rejection> {
        match Bytes::from_request(req, st).await {
            Ok(b) => Ok(Self(b)),
            Err(rej) if rej.status() == StatusCode::PAYLOAD_TOO_LARGE => Err(too_large(st)),
            Err(rej) => Err(ApiError::BadRequest(format!(
                "unreadable request body: {}",
                rej.body_text()
            ))),
        }
    }
}

/// A file, tar or stdin upload, streamed to the guest as it arrives
/// ([`Upload`]). A body whose `Content-Length` is over the daemon's
/// `--max-upload-bytes` is refused (413) before the guest is touched; one
/// without a length is cut at the limit.
pub(super) struct UploadBody(pub(super) Upload);

impl FromRequest<AppState> for UploadBody {
    type Rejection = ApiError;

    async fn from_request(req: Request, st: &AppState) -> Result<Self, Self::Rejection> {
        let bounds = st.daemon.bounds();
        let limit = u64::try_from(bounds.upload_max).unwrap_or(u64::MAX);
        // Exact when the request has a `Content-Length` (hyper's bodies
        // take it from there).
        if HttpBody::size_hint(req.body())
            .exact()
            .is_some_and(|n| n > limit)
        {
            return Err(too_large(st));
        }
        // A client may pause between chunks as long as an agent call may
        // wait on the guest.
        Ok(Self(Upload::start(
            req.into_body(),
            limit,
            bounds.agent_call,
        )))
    }
}

fn too_large(st: &AppState) -> ApiError {
    ApiError::TooLarge(format!(
        "the request body is over this route's limit: {MAX_JSON_BODY} bytes for JSON, \
         {MAX_COMMAND_BODY} for a command (its stdin inline), {} for a file, tar or stdin \
         upload (forkboxd --max-upload-bytes)",
        st.daemon.bounds().upload_max
    ))
}

/// Query parameters whose rejections are 400s in our error format.
pub(super) fn query<T: serde::de::DeserializeOwned>(raw: Option<String>) -> ApiResult<T> {
    serde_urlencoded::from_str(raw.as_deref().unwrap_or(""))
        .map_err(|e| ApiError::BadRequest(format!("malformed query string: {e}")))
}

pub(super) fn sandbox_id(s: &str) -> ApiResult<SandboxId> {
    SandboxId::parse(s).ok_or_else(|| ApiError::NotFound(format!("no sandbox {s}")))
}

/// Checks every rule of a policy: a bad one is a 400 naming it.
pub(super) fn policy(p: NetworkPolicy) -> ApiResult<forkbox_net::policy::Policy> {
    p.parse().map_err(|e| ApiError::BadRequest(chain(&e)))
}

/// Longest duration a request may give: ten years. Anything longer is a
/// mistake, and would overflow a deadline (`Instant` + it) somewhere.
pub(super) const MAX_SECS: u64 = 10 * 365 * 24 * 3600;

/// Seconds from a request: a number from 0 to [`MAX_SECS`]; negative,
/// NaN, infinite or longer is a 400.
pub(super) fn secs(v: Option<f64>, what: &str) -> ApiResult<Option<Duration>> {
    v.map(|s| {
        Duration::try_from_secs_f64(s)
            .ok()
            .filter(|d| d.as_secs() < MAX_SECS || *d == Duration::from_secs(MAX_SECS))
            .ok_or_else(|| {
                ApiError::BadRequest(format!(
                    "{what} = {s}: expected a number of seconds from 0 to {MAX_SECS} (ten years)"
                ))
            })
    })
    .transpose()
}

pub(super) fn pid_of(s: &str) -> ApiResult<u32> {
    s.parse()
        .map_err(|_| ApiError::BadRequest(format!("pid {s:?}: expected a process id")))
}

/// A JSON body that may also be empty (then every field takes its default).
pub(super) fn optional_json<T: Default + serde::de::DeserializeOwned>(
    body: &Bytes,
) -> ApiResult<T> {
    if body.iter().all(u8::is_ascii_whitespace) {
        return Ok(T::default());
    }
    serde_json::from_slice(body)
        .map_err(|e| ApiError::BadRequest(format!("malformed request body: {e}")))
}
