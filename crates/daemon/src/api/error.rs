//! The API's errors: [`ApiError`], its status codes and its JSON body
//! (`{"error": {"kind", "message", "infrastructure", ...}}`), and the one
//! place errors are counted and rendered ([`report`]).

use std::sync::Arc;

use axum::extract::{Request, State};
use axum::http::StatusCode;
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::Json;
use forkbox_proto::{AgentError, ErrorKind as GuestKind};
use serde::Serialize;
use utoipa::ToSchema;

use super::AppState;
use crate::service::{chain, Daemon, DaemonError, Reply, SandboxInfo};

/// The JSON body of every error.
#[derive(Debug, Serialize, ToSchema)]
pub struct ApiErrorBody {
    pub error: ErrorDetail,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct ErrorDetail {
    /// `invalid_request`, `unauthorized`, `not_found`, `conflict`,
    /// `capacity`, `unsupported`, `guest` (the guest refused a file
    /// operation, or nothing listens on a guest port), `timeout` (a
    /// process still ran when a wait ended), `guest_timeout` (the guest
    /// did not finish an agent call within its deadline; 504),
    /// `too_large` (a request body, file or archive over its limit; 413),
    /// `template_failed`, `infrastructure`.
    pub kind: String,
    pub message: String,
    /// True when the sandbox infrastructure failed (mask, don't score).
    pub infrastructure: bool,
    /// For `guest`: the guest's error class (`not_found`, …).
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(value_type = Option<String>)]
    pub guest_kind: Option<GuestKind>,
    /// For `template_failed`: the step and the tail of its output.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub step: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub output: Option<String>,
}

#[derive(Debug)]
pub enum ApiError {
    BadRequest(String),
    NotFound(String),
    Unauthorized,
    /// A wait ended before what it waited for.
    Timeout(String),
    /// A request body over its route's limit.
    TooLarge(String),
    Daemon(DaemonError),
}

impl From<DaemonError> for ApiError {
    fn from(e: DaemonError) -> Self {
        Self::Daemon(e)
    }
}

impl ApiError {
    pub(super) fn status(&self) -> StatusCode {
        match self {
            Self::BadRequest(_) => StatusCode::BAD_REQUEST,
            Self::NotFound(_) => StatusCode::NOT_FOUND,
            Self::Unauthorized => StatusCode::UNAUTHORIZED,
            Self::Timeout(_) => StatusCode::REQUEST_TIMEOUT,
            Self::TooLarge(_) => StatusCode::PAYLOAD_TOO_LARGE,
            Self::Daemon(e) => match e {
                DaemonError::Invalid(_) | DaemonError::BadTemplate(_) => StatusCode::BAD_REQUEST,
                DaemonError::NoSandbox(_) | DaemonError::NoTemplate(_) => StatusCode::NOT_FOUND,
                DaemonError::TemplateExists(_)
                | DaemonError::State(_)
                | DaemonError::Busy(_)
                | DaemonError::NoNetwork(_) => StatusCode::CONFLICT,
                DaemonError::Capacity { .. } => StatusCode::TOO_MANY_REQUESTS,
                DaemonError::Unsupported(_) => StatusCode::NOT_IMPLEMENTED,
                DaemonError::Guest(g) => match g.kind {
                    GuestKind::NotFound => StatusCode::NOT_FOUND,
                    GuestKind::PermissionDenied => StatusCode::FORBIDDEN,
                    GuestKind::AlreadyExists
                    | GuestKind::DirectoryNotEmpty
                    | GuestKind::ConnectionRefused => StatusCode::CONFLICT,
                    GuestKind::Io | GuestKind::Internal | GuestKind::Protocol => {
                        StatusCode::INTERNAL_SERVER_ERROR
                    }
                    _ => StatusCode::BAD_REQUEST,
                },
                DaemonError::Recipe { .. } => StatusCode::UNPROCESSABLE_ENTITY,
                DaemonError::GuestTimeout { .. } => StatusCode::GATEWAY_TIMEOUT,
                DaemonError::GuestEnded { .. } => StatusCode::GONE,
                DaemonError::TooLarge { .. } => StatusCode::PAYLOAD_TOO_LARGE,
                DaemonError::Infrastructure { .. } => StatusCode::BAD_GATEWAY,
            },
        }
    }

    fn detail(&self) -> ErrorDetail {
        let plain = |kind: &str, message: String| ErrorDetail {
            kind: kind.into(),
            message,
            infrastructure: false,
            guest_kind: None,
            step: None,
            output: None,
        };
        match self {
            Self::BadRequest(m) => plain("invalid_request", m.clone()),
            Self::NotFound(m) => plain("not_found", m.clone()),
            Self::Timeout(m) => plain("timeout", m.clone()),
            Self::TooLarge(m) => plain("too_large", m.clone()),
            Self::Unauthorized => plain(
                "unauthorized",
                "missing or wrong bearer token (Authorization: Bearer …)".into(),
            ),
            Self::Daemon(e) => {
                let mut d = plain(e.kind(), chain(e));
                d.infrastructure = e.is_infrastructure();
                match e {
                    DaemonError::Guest(AgentError { kind, message }) => {
                        d.guest_kind = Some(*kind);
                        d.message = message.clone();
                    }
                    DaemonError::Recipe { step, output, .. } => {
                        d.step = Some(step.clone());
                        d.output = Some(output.clone());
                    }
                    _ => {}
                }
                d
            }
        }
    }
}

/// An error response whose body [`report_errors`] has yet to write.
#[derive(Clone)]
struct Unreported(Arc<ApiError>);

impl IntoResponse for ApiError {
    /// The status only: the router's [`report_errors`] layer counts the
    /// error and writes its JSON body.
    fn into_response(self) -> Response {
        let mut r = self.status().into_response();
        r.extensions_mut().insert(Unreported(Arc::new(self)));
        r
    }
}

/// Every error the API shows goes through here, once: the daemon's are
/// counted by kind in `/metrics` (the edge's own, such as a malformed
/// body, are not), then it is rendered. Error responses come here through
/// [`report_errors`]; errors inside a `200` answer (a fork child's, a
/// stream's last event) are reported by their handler.
pub(super) fn report(daemon: &Daemon, e: &ApiError) -> ErrorDetail {
    if let ApiError::Daemon(d) = e {
        daemon.count_error(d);
    }
    e.detail()
}

/// The router's outermost layer: writes the body of every error response.
pub(super) async fn report_errors(
    State(st): State<AppState>,
    req: Request,
    next: Next,
) -> Response {
    let mut response = next.run(req).await;
    let Some(Unreported(e)) = response.extensions_mut().remove::<Unreported>() else {
        return response;
    };
    let body = ApiErrorBody {
        error: report(&st.daemon, &e),
    };
    (response.status(), Json(body)).into_response()
}

pub(super) type ApiResult<T> = Result<T, ApiError>;

pub(super) fn one(reply: Reply) -> ApiResult<Json<SandboxInfo>> {
    match reply {
        Reply::Sandbox(i) => Ok(Json(*i)),
        other => Err(unexpected(other)),
    }
}

pub(super) fn unexpected(r: Reply) -> ApiError {
    ApiError::Daemon(DaemonError::Infrastructure {
        what: format!("the daemon answered with an unexpected reply: {r:?}"),
        cause: None,
    })
}
