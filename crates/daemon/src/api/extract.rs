//! What every handler parses first: the sandbox (and process) a path
//! names, with the daemon to ask ([`OnSandbox`], [`OnProcess`]); JSON
//! bodies and query strings whose rejections are 400s in our error
//! format; seconds, pids and policies.

use std::collections::HashMap;
use std::time::Duration;

use axum::body::Bytes;
use axum::extract::{FromRequest, FromRequestParts, Path, Request};
use axum::http::request::Parts;
use axum::Json;

use super::error::{ApiError, ApiResult};
use super::AppState;
use crate::core::SandboxId;
use crate::network::NetworkPolicy;
use crate::service::{chain, Daemon};

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

/// `axum::Json` whose rejections are 400s in our error format.
pub(super) struct JsonBody<T>(pub(super) T);

impl<S: Send + Sync, T: serde::de::DeserializeOwned> FromRequest<S> for JsonBody<T> {
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &S) -> Result<Self, Self::Rejection> {
        match Json::<T>::from_request(req, state).await {
            Ok(Json(v)) => Ok(Self(v)),
            Err(rej) => Err(ApiError::BadRequest(format!(
                "malformed request body: {}",
                rej.body_text()
            ))),
        }
    }
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

pub(super) fn secs(v: Option<f64>, what: &str) -> ApiResult<Option<Duration>> {
    v.map(|s| {
        Duration::try_from_secs_f64(s).map_err(|_| {
            ApiError::BadRequest(format!("{what} must be a non-negative number of seconds"))
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
