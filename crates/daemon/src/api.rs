//! The HTTP+JSON edge: parses requests into typed commands for
//! [`Daemon`], turns replies and errors into responses, and describes
//! itself in an OpenAPI document (`/openapi.json`).
//!
//! Errors are JSON: `{"error": {"kind", "message", "infrastructure"}}`;
//! `infrastructure: true` means the sandbox machinery failed, not the
//! request or the user's command.

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::extract::{DefaultBodyLimit, FromRequest, Path, RawQuery, Request, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{delete, get, post};
use axum::{Json, Router};
use forkbox_proto::{
    AgentError, ErrorKind as GuestKind, ExecRequest, ExecResult, ExitStatus, User,
};
use serde::{Deserialize, Serialize};
use tokio::sync::mpsc;
use utoipa::{IntoParams, OpenApi, ToSchema};

use crate::core::{DeathCause, ExpiryAction, Labels, SandboxId, SandboxState};
use crate::network::NetworkPolicy;
use crate::service::{
    chain, AttachEvent, BakeEvent, BakeFailure, Command, CreateSandbox, Daemon, DaemonError,
    ExecEvent, NetworkInfo, PortForwardInfo, Reply, SandboxInfo, SandboxMetrics,
};
use crate::template::{Readiness, TemplateInfo, TemplateSpec, TemplateState};

/// Largest request body for file and tar uploads.
pub const MAX_UPLOAD: usize = 1 << 30;

#[derive(OpenApi)]
#[openapi(
    info(
        title = "forkboxd",
        description = "The forkbox daemon: sandboxes, commands, background processes, files, ports, templates."
    ),
    paths(
        health,
        metrics,
        templates_list,
        template_create,
        template_get,
        template_bake,
        template_delete,
        sandbox_create,
        sandbox_list,
        sandbox_kill_by_label,
        sandbox_get,
        sandbox_kill,
        sandbox_timeout,
        sandbox_pause,
        sandbox_resume,
        sandbox_fork,
        sandbox_snapshot,
        sandbox_logs,
        network_get,
        network_set,
        egress_log,
        command_run,
        process_list,
        process_wait,
        process_kill,
        process_stdin,
        process_output,
        ports_list,
        port_open,
        port_close,
        file_read,
        file_write,
        file_remove,
        file_list,
        file_stat,
        file_mkdir,
        tar_download,
        tar_upload
    ),
    components(schemas(
        ApiErrorBody,
        ErrorDetail,
        SandboxInfo,
        SandboxMetrics,
        SandboxState,
        ExpiryAction,
        DeathCause,
        TemplateSpec,
        TemplateInfo,
        TemplateState,
        Readiness,
        BakeEvent,
        BakeFailure,
        ForkChild,
        SnapshotBody,
        CreateBody,
        TimeoutBody,
        ForkBody,
        KillByLabelBody,
        Killed,
        ExecBody,
        ExecOutput,
        StreamEvent,
        ProcessStarted,
        ProcessJson,
        WaitBody,
        KillBody,
        StdinWritten,
        ProcessOutput,
        PortBody,
        PortForwardInfo,
        FileStatJson,
        DirEntryJson,
        Written,
        SandboxId,
        NetworkPolicy,
        NetworkInfo,
        EgressLog,
        EgressRecordDoc
    ))
)]
pub struct ApiDoc;

/// The generated OpenAPI document, pretty-printed (what `docs/openapi.json`
/// holds).
pub fn openapi_json() -> String {
    let mut s = ApiDoc::openapi()
        .to_pretty_json()
        .expect("the OpenAPI document serializes");
    s.push('\n');
    s
}

#[derive(Clone)]
struct AppState {
    daemon: Daemon,
    token: Option<String>,
}

/// The whole API. With `token`, every request but `/health` needs
/// `Authorization: Bearer <token>`.
pub fn router(daemon: Daemon, token: Option<String>) -> Router {
    let state = AppState { daemon, token };
    let sandbox = Router::new()
        .route("/", get(sandbox_get).delete(sandbox_kill))
        .route("/timeout", post(sandbox_timeout))
        .route("/pause", post(sandbox_pause))
        .route("/resume", post(sandbox_resume))
        .route("/fork", post(sandbox_fork))
        .route("/snapshot", post(sandbox_snapshot))
        .route("/logs", get(sandbox_logs))
        .route("/network", get(network_get).post(network_set))
        .route("/egress", get(egress_log))
        .route("/commands", post(command_run))
        .route("/processes", get(process_list))
        .route("/processes/{pid}/wait", post(process_wait))
        .route("/processes/{pid}/kill", post(process_kill))
        .route("/processes/{pid}/stdin", post(process_stdin))
        .route("/processes/{pid}/output", get(process_output))
        .route("/ports", get(ports_list).post(port_open))
        .route("/ports/{port}", delete(port_close))
        .route("/files", get(file_read).put(file_write).delete(file_remove))
        .route("/files/list", get(file_list))
        .route("/files/stat", get(file_stat))
        .route("/files/mkdir", post(file_mkdir))
        .route("/files/tar", get(tar_download).put(tar_upload));
    Router::new()
        .route("/health", get(health))
        .route("/metrics", get(metrics))
        .route(
            "/openapi.json",
            get(|| async { ([(header::CONTENT_TYPE, "application/json")], openapi_json()) }),
        )
        .route("/templates", get(templates_list).post(template_create))
        .route(
            "/templates/{name}",
            get(template_get).delete(template_delete),
        )
        .route("/templates/{name}/bake", post(template_bake))
        .route("/sandboxes", get(sandbox_list).post(sandbox_create))
        .route("/sandboxes/kill", post(sandbox_kill_by_label))
        .nest("/sandboxes/{id}", sandbox)
        .fallback(|| async { ApiError::NotFound("no such route".into()) })
        .layer(DefaultBodyLimit::max(MAX_UPLOAD))
        .layer(middleware::from_fn_with_state(state.clone(), authorize))
        .with_state(state)
}

async fn authorize(State(st): State<AppState>, req: Request, next: Next) -> Response {
    if let Some(token) = &st.token {
        if req.uri().path() != "/health" {
            let given = req
                .headers()
                .get(header::AUTHORIZATION)
                .and_then(|v| v.to_str().ok())
                .and_then(|v| v.strip_prefix("Bearer "));
            if !given.is_some_and(|g| constant_time_eq(g.as_bytes(), token.as_bytes())) {
                return ApiError::Unauthorized.into_response();
            }
        }
    }
    next.run(req).await
}

fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

// ---------------------------------------------------------------- errors

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
    /// process still ran when a wait ended), `template_failed`,
    /// `infrastructure`.
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
    Daemon(DaemonError),
}

impl From<DaemonError> for ApiError {
    fn from(e: DaemonError) -> Self {
        Self::Daemon(e)
    }
}

impl ApiError {
    fn status(&self) -> StatusCode {
        match self {
            Self::BadRequest(_) => StatusCode::BAD_REQUEST,
            Self::NotFound(_) => StatusCode::NOT_FOUND,
            Self::Unauthorized => StatusCode::UNAUTHORIZED,
            Self::Timeout(_) => StatusCode::REQUEST_TIMEOUT,
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

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        (
            self.status(),
            Json(ApiErrorBody {
                error: self.detail(),
            }),
        )
            .into_response()
    }
}

type ApiResult<T> = Result<T, ApiError>;

/// `axum::Json` whose rejections are 400s in our error format.
struct JsonBody<T>(T);

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
fn query<T: serde::de::DeserializeOwned>(raw: Option<String>) -> ApiResult<T> {
    serde_urlencoded::from_str(raw.as_deref().unwrap_or(""))
        .map_err(|e| ApiError::BadRequest(format!("malformed query string: {e}")))
}

fn sandbox_id(s: &str) -> ApiResult<SandboxId> {
    SandboxId::parse(s).ok_or_else(|| ApiError::NotFound(format!("no sandbox {s}")))
}

fn counted<T>(d: &Daemon, r: ApiResult<T>) -> ApiResult<T> {
    if let Err(ApiError::Daemon(e)) = &r {
        d.count_error(e);
    }
    r
}

fn one(reply: Reply) -> ApiResult<Json<SandboxInfo>> {
    match reply {
        Reply::Sandbox(i) => Ok(Json(*i)),
        other => Err(unexpected(other)),
    }
}

fn unexpected(r: Reply) -> ApiError {
    ApiError::Daemon(DaemonError::Infrastructure {
        what: format!("the daemon answered with an unexpected reply: {r:?}"),
        cause: None,
    })
}

// ---------------------------------------------------------------- misc

#[derive(Serialize)]
struct Health {
    status: &'static str,
    version: &'static str,
}

/// Liveness; needs no token.
#[utoipa::path(get, path = "/health", responses((status = 200, description = "the daemon is up")))]
async fn health() -> Json<serde_json::Value> {
    Json(serde_json::json!(Health {
        status: "ok",
        version: env!("CARGO_PKG_VERSION"),
    }))
}

/// Prometheus text format.
#[utoipa::path(get, path = "/metrics", responses((status = 200, description = "metrics", content_type = "text/plain")))]
async fn metrics(State(st): State<AppState>) -> impl IntoResponse {
    (
        [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
        st.daemon.metrics_text(),
    )
}

// ---------------------------------------------------------------- templates

/// Built-in, baked and snapshot templates, with their zygotes' state.
#[utoipa::path(get, path = "/templates", responses((status = 200, body = [TemplateInfo])))]
async fn templates_list(State(st): State<AppState>) -> Json<Vec<TemplateInfo>> {
    Json(st.daemon.templates())
}

/// Registers and bakes a template: boot, setup commands, readiness check,
/// then the VM is paused as the template's zygote, which every sandbox
/// created from it forks. Streams NDJSON [`BakeEvent`]s; the last line is
/// `done` or `failed` (a failed template is unregistered again).
#[utoipa::path(post, path = "/templates", request_body = TemplateSpec,
    responses((status = 200, description = "NDJSON stream of bake events", body = BakeEvent, content_type = "application/x-ndjson"),
              (status = 400, body = ApiErrorBody), (status = 409, body = ApiErrorBody)))]
async fn template_create(
    State(st): State<AppState>,
    JsonBody(spec): JsonBody<TemplateSpec>,
) -> ApiResult<Response> {
    let rx = counted(&st.daemon, st.daemon.bake(spec).map_err(ApiError::from))?;
    Ok(ndjson(rx, |e| {
        serde_json::to_string(&e).unwrap_or_default()
    }))
}

#[utoipa::path(get, path = "/templates/{name}", params(("name" = String, Path)),
    responses((status = 200, body = TemplateInfo), (status = 404, body = ApiErrorBody)))]
async fn template_get(
    State(st): State<AppState>,
    Path(name): Path<String>,
) -> ApiResult<Json<TemplateInfo>> {
    Ok(Json(st.daemon.template(&name)?))
}

/// Bakes a registered template that has no zygote yet (the built-in
/// `minimal` and `debian`, or one whose last bake failed). Streams the
/// same NDJSON events as `POST /templates`; a template already baked
/// answers with one `done` line, one being baked is waited for.
#[utoipa::path(post, path = "/templates/{name}/bake", params(("name" = String, Path)),
    responses((status = 200, description = "NDJSON stream of bake events", body = BakeEvent, content_type = "application/x-ndjson"),
              (status = 404, body = ApiErrorBody)))]
async fn template_bake(
    State(st): State<AppState>,
    Path(name): Path<String>,
) -> ApiResult<Response> {
    let rx = counted(
        &st.daemon,
        st.daemon.bake_named(&name).map_err(ApiError::from),
    )?;
    Ok(ndjson(rx, |e| {
        serde_json::to_string(&e).unwrap_or_default()
    }))
}

#[utoipa::path(delete, path = "/templates/{name}", params(("name" = String, Path)),
    responses((status = 204), (status = 400, body = ApiErrorBody), (status = 404, body = ApiErrorBody)))]
async fn template_delete(
    State(st): State<AppState>,
    Path(name): Path<String>,
) -> ApiResult<StatusCode> {
    st.daemon.delete_template(&name)?;
    Ok(StatusCode::NO_CONTENT)
}

// ---------------------------------------------------------------- sandboxes

/// `POST /sandboxes`.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct CreateBody {
    /// A template name (`minimal`, `debian`, or a baked one).
    pub template: String,
    /// Time-to-live in seconds from ready; `null`: until killed.
    #[serde(default)]
    pub timeout_secs: Option<f64>,
    #[serde(default)]
    pub on_timeout: ExpiryAction,
    #[serde(default)]
    pub metadata: Labels,
    /// Environment for every command in the sandbox.
    #[serde(default)]
    pub envs: BTreeMap<String, String>,
    /// Longest wait for room under the caps, in seconds (default: the
    /// daemon's `--create-wait`; 0: fail at once).
    #[serde(default)]
    pub wait_secs: Option<f64>,
    /// What the sandbox may reach; absent: nothing (egress denied). Never
    /// the template's bake policy.
    #[serde(default)]
    pub network: Option<NetworkPolicy>,
}

/// Checks every rule of a policy: a bad one is a 400 naming it.
fn policy(p: NetworkPolicy) -> ApiResult<forkbox_net::policy::Policy> {
    p.parse().map_err(|e| ApiError::BadRequest(chain(&e)))
}

fn secs(v: Option<f64>, what: &str) -> ApiResult<Option<Duration>> {
    v.map(|s| {
        Duration::try_from_secs_f64(s).map_err(|_| {
            ApiError::BadRequest(format!("{what} must be a non-negative number of seconds"))
        })
    })
    .transpose()
}

/// Creates a sandbox and waits until it is ready: a copy-on-write fork of
/// the template's zygote. A template not baked yet is baked first (the
/// first creation from `debian` takes its boot; later ones a fork). Its
/// egress is `network`, or nothing; a bad rule is a 400 and nothing is
/// made.
#[utoipa::path(post, path = "/sandboxes", request_body = CreateBody,
    responses((status = 201, body = SandboxInfo), (status = 400, body = ApiErrorBody),
              (status = 404, body = ApiErrorBody), (status = 429, body = ApiErrorBody),
              (status = 502, body = ApiErrorBody)))]
async fn sandbox_create(
    State(st): State<AppState>,
    JsonBody(b): JsonBody<CreateBody>,
) -> ApiResult<(StatusCode, Json<SandboxInfo>)> {
    let network = b.network.map(policy).transpose()?;
    let cmd = Command::Create(CreateSandbox {
        template: b.template,
        ttl: secs(b.timeout_secs, "timeout_secs")?,
        on_expiry: b.on_timeout,
        labels: b.metadata,
        envs: b.envs,
        wait: secs(b.wait_secs, "wait_secs")?,
        network,
    });
    let info = one(counted(
        &st.daemon,
        st.daemon.execute(cmd).await.map_err(ApiError::from),
    )?)?;
    Ok((StatusCode::CREATED, info))
}

/// Query of `GET /sandboxes`.
#[derive(Debug, Deserialize, IntoParams)]
#[allow(dead_code)] // documents the query; parsed by hand (repeated keys)
struct ListQuery {
    /// `key=value`; repeat to require several labels.
    label: Option<Vec<String>>,
    /// Include dead sandboxes still remembered.
    all: Option<bool>,
}

fn labels_of(pairs: &[(String, String)]) -> ApiResult<Labels> {
    let mut labels = Labels::new();
    for (k, v) in pairs {
        if k != "label" {
            continue;
        }
        let (lk, lv) = v
            .split_once('=')
            .ok_or_else(|| ApiError::BadRequest(format!("label {v:?}: expected key=value")))?;
        labels.insert(lk.into(), lv.into());
    }
    Ok(labels)
}

/// Lists live sandboxes, filtered by labels.
#[utoipa::path(get, path = "/sandboxes", params(ListQuery),
    responses((status = 200, body = [SandboxInfo]), (status = 400, body = ApiErrorBody)))]
async fn sandbox_list(
    State(st): State<AppState>,
    RawQuery(raw): RawQuery,
) -> ApiResult<Json<Vec<SandboxInfo>>> {
    let pairs: Vec<(String, String)> = query(raw)?;
    for (k, _) in &pairs {
        if k != "label" && k != "all" {
            return Err(ApiError::BadRequest(format!(
                "unknown query parameter {k:?}"
            )));
        }
    }
    let include_dead = pairs.iter().any(|(k, v)| k == "all" && v == "true");
    match st
        .daemon
        .execute(Command::List {
            labels: labels_of(&pairs)?,
            include_dead,
        })
        .await?
    {
        Reply::Sandboxes(v) => Ok(Json(v)),
        other => Err(unexpected(other)),
    }
}

#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct KillByLabelBody {
    /// Every label must match; at least one.
    pub metadata: Labels,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct Killed {
    pub killed: Vec<SandboxId>,
}

/// Kills every live sandbox carrying all the given labels.
#[utoipa::path(post, path = "/sandboxes/kill", request_body = KillByLabelBody,
    responses((status = 200, body = Killed), (status = 400, body = ApiErrorBody)))]
async fn sandbox_kill_by_label(
    State(st): State<AppState>,
    JsonBody(b): JsonBody<KillByLabelBody>,
) -> ApiResult<Json<Killed>> {
    let r = st
        .daemon
        .execute(Command::KillByLabel { labels: b.metadata })
        .await;
    match counted(&st.daemon, r.map_err(ApiError::from))? {
        Reply::Killed(killed) => Ok(Json(Killed { killed })),
        other => Err(unexpected(other)),
    }
}

/// Query of `GET /sandboxes/{id}/logs`.
#[derive(Debug, Deserialize, IntoParams)]
#[serde(deny_unknown_fields)]
struct LogsQuery {
    /// How many of the last lines (default 200, at most 10000).
    lines: Option<usize>,
}

/// The sandbox's serial console, its last lines: kernel and agent
/// messages since it started (a fork child's since its fork). Commands'
/// output is not here; it goes to their callers.
#[utoipa::path(get, path = "/sandboxes/{id}/logs", params(("id" = String, Path), LogsQuery),
    responses((status = 200, description = "the console's last lines", content_type = "text/plain"),
              (status = 404, body = ApiErrorBody)))]
async fn sandbox_logs(
    State(st): State<AppState>,
    Path(id): Path<String>,
    RawQuery(raw): RawQuery,
) -> ApiResult<Response> {
    let id = sandbox_id(&id)?;
    let q: LogsQuery = query(raw)?;
    let lines = q.lines.unwrap_or(200).clamp(1, 10_000);
    let text = counted(
        &st.daemon,
        st.daemon.console(&id, lines).await.map_err(ApiError::from),
    )?;
    Ok(([(header::CONTENT_TYPE, "text/plain; charset=utf-8")], text).into_response())
}

/// The egress policy of a running or paused sandbox. `active: false`: a
/// sandbox without a network broker (re-adopted from state an older
/// daemon wrote), which opens no new connection.
#[utoipa::path(get, path = "/sandboxes/{id}/network", params(("id" = String, Path)),
    responses((status = 200, body = NetworkInfo), (status = 404, body = ApiErrorBody),
              (status = 409, body = ApiErrorBody)))]
async fn network_get(
    State(st): State<AppState>,
    Path(id): Path<String>,
) -> ApiResult<Json<NetworkInfo>> {
    let id = sandbox_id(&id)?;
    let r = st.daemon.execute(Command::Network { id }).await;
    network_reply(counted(&st.daemon, r.map_err(ApiError::from))?)
}

/// Replaces a running or paused sandbox's egress policy: new connections
/// and DNS lookups follow it, open connections stay. Answers the policy
/// in force, rules in normal form. A bad rule is a 400 naming it.
#[utoipa::path(post, path = "/sandboxes/{id}/network", params(("id" = String, Path)), request_body = NetworkPolicy,
    responses((status = 200, body = NetworkInfo), (status = 400, body = ApiErrorBody),
              (status = 404, body = ApiErrorBody), (status = 409, body = ApiErrorBody),
              (status = 502, body = ApiErrorBody)))]
async fn network_set(
    State(st): State<AppState>,
    Path(id): Path<String>,
    JsonBody(b): JsonBody<NetworkPolicy>,
) -> ApiResult<Json<NetworkInfo>> {
    let id = sandbox_id(&id)?;
    let policy = policy(b)?;
    let r = st.daemon.execute(Command::SetNetwork { id, policy }).await;
    network_reply(counted(&st.daemon, r.map_err(ApiError::from))?)
}

fn network_reply(r: Reply) -> ApiResult<Json<NetworkInfo>> {
    match r {
        Reply::Network(n) => Ok(Json(n)),
        other => Err(unexpected(other)),
    }
}

/// Query of `GET /sandboxes/{id}/egress`.
#[derive(Debug, Deserialize, IntoParams)]
#[serde(deny_unknown_fields)]
struct EgressQuery {
    /// How many of the last records (default 1000, at most 100000).
    limit: Option<usize>,
}

/// The last records of a sandbox's egress log.
#[derive(Debug, Serialize, ToSchema)]
pub struct EgressLog {
    /// Oldest first.
    #[schema(value_type = Vec<EgressRecordDoc>)]
    pub records: Vec<forkbox_net::log::EgressRecord>,
}

/// One attempt of a sandbox to reach out, allowed or not. For DNS, `name`
/// is the name asked, `port` 53 and `answers` the addresses given; for
/// TCP, `address:port` is where the guest connected and `name` the name
/// it had looked up for it, if any.
#[derive(Debug, Serialize, ToSchema)]
#[schema(as = EgressRecord)]
#[allow(dead_code)] // documents `forkbox_net::log::EgressRecord`'s JSON
pub struct EgressRecordDoc {
    /// When the attempt began, milliseconds since the Unix epoch.
    time_ms: u64,
    sandbox: SandboxId,
    /// `tcp`, `udp` or `dns`.
    protocol: String,
    name: Option<String>,
    address: Option<String>,
    port: u16,
    /// `allow` or `deny`.
    verdict: String,
    /// `rule` (see `rule`), `no_rule` (default deny), `special_address`
    /// (loopback, link-local, multicast…), `udp_not_allowed`, `limit`
    /// (too many at once), `connect_failed` (allowed, but the connection
    /// failed: see `error`), `not_found` (allowed, but the name did not
    /// resolve).
    reason: String,
    /// The rule that decided, in normal form.
    rule: Option<String>,
    answers: Option<Vec<String>>,
    /// Bytes from the guest to the destination, and back.
    bytes_out: u64,
    bytes_in: u64,
    /// From the attempt to the close of the connection (0 for refusals).
    duration_ms: u64,
    error: Option<String>,
}

/// What the sandbox tried to reach: the last records of its egress log,
/// oldest first (DNS lookups and TCP connections, allowed or denied, with
/// the rule that decided and the bytes moved). Dead sandboxes' logs stay
/// readable until the daemon's `--egress-log-ttl` after their death.
#[utoipa::path(get, path = "/sandboxes/{id}/egress", params(("id" = String, Path), EgressQuery),
    responses((status = 200, body = EgressLog), (status = 400, body = ApiErrorBody),
              (status = 404, body = ApiErrorBody)))]
async fn egress_log(
    State(st): State<AppState>,
    Path(id): Path<String>,
    RawQuery(raw): RawQuery,
) -> ApiResult<Json<EgressLog>> {
    let id = sandbox_id(&id)?;
    let q: EgressQuery = query(raw)?;
    let limit = q.limit.unwrap_or(1000).clamp(1, 100_000);
    let records = counted(
        &st.daemon,
        st.daemon.egress(&id, limit).await.map_err(ApiError::from),
    )?;
    Ok(Json(EgressLog { records }))
}

/// State, metadata, TTL, lineage and VMM metrics of one sandbox (dead ones
/// too, while remembered).
#[utoipa::path(get, path = "/sandboxes/{id}", params(("id" = String, Path)),
    responses((status = 200, body = SandboxInfo), (status = 404, body = ApiErrorBody)))]
async fn sandbox_get(
    State(st): State<AppState>,
    Path(id): Path<String>,
) -> ApiResult<Json<SandboxInfo>> {
    let id = sandbox_id(&id)?;
    one(st.daemon.execute(Command::Info { id }).await?)
}

/// Kills a sandbox. Its VM is stopped off the request path.
#[utoipa::path(delete, path = "/sandboxes/{id}", params(("id" = String, Path)),
    responses((status = 204), (status = 404, body = ApiErrorBody), (status = 409, body = ApiErrorBody)))]
async fn sandbox_kill(State(st): State<AppState>, Path(id): Path<String>) -> ApiResult<StatusCode> {
    let id = sandbox_id(&id)?;
    counted(
        &st.daemon,
        st.daemon
            .execute(Command::Kill { id })
            .await
            .map_err(ApiError::from),
    )?;
    Ok(StatusCode::NO_CONTENT)
}

#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct TimeoutBody {
    /// New time-to-live in seconds from now; `null` removes it.
    pub timeout_secs: Option<f64>,
    #[serde(default)]
    pub on_timeout: Option<ExpiryAction>,
}

/// Changes a sandbox's time-to-live (counted from now).
#[utoipa::path(post, path = "/sandboxes/{id}/timeout", params(("id" = String, Path)), request_body = TimeoutBody,
    responses((status = 200, body = SandboxInfo), (status = 404, body = ApiErrorBody), (status = 409, body = ApiErrorBody), (status = 502, body = ApiErrorBody)))]
async fn sandbox_timeout(
    State(st): State<AppState>,
    Path(id): Path<String>,
    JsonBody(b): JsonBody<TimeoutBody>,
) -> ApiResult<Json<SandboxInfo>> {
    let id = sandbox_id(&id)?;
    let cmd = Command::SetTimeout {
        id,
        ttl: secs(b.timeout_secs, "timeout_secs")?,
        on_expiry: b.on_timeout,
    };
    one(counted(
        &st.daemon,
        st.daemon.execute(cmd).await.map_err(ApiError::from),
    )?)
}

/// Pauses a running sandbox: its vCPUs stop, its memory stays; commands
/// and file calls are refused until it resumes.
#[utoipa::path(post, path = "/sandboxes/{id}/pause", params(("id" = String, Path)),
    responses((status = 200, body = SandboxInfo), (status = 404, body = ApiErrorBody), (status = 409, body = ApiErrorBody), (status = 502, body = ApiErrorBody)))]
async fn sandbox_pause(
    State(st): State<AppState>,
    Path(id): Path<String>,
) -> ApiResult<Json<SandboxInfo>> {
    let id = sandbox_id(&id)?;
    one(counted(
        &st.daemon,
        st.daemon
            .execute(Command::Pause { id })
            .await
            .map_err(ApiError::from),
    )?)
}

/// Resumes a paused sandbox.
#[utoipa::path(post, path = "/sandboxes/{id}/resume", params(("id" = String, Path)),
    responses((status = 200, body = SandboxInfo), (status = 404, body = ApiErrorBody), (status = 409, body = ApiErrorBody), (status = 502, body = ApiErrorBody)))]
async fn sandbox_resume(
    State(st): State<AppState>,
    Path(id): Path<String>,
) -> ApiResult<Json<SandboxInfo>> {
    let id = sandbox_id(&id)?;
    one(counted(
        &st.daemon,
        st.daemon
            .execute(Command::Resume { id })
            .await
            .map_err(ApiError::from),
    )?)
}

#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ForkBody {
    /// 1-256 children.
    pub count: u32,
}

/// One child of a fork: `sandbox`, or `error` when this child failed on
/// its own (past the live cap, or it did not come up).
#[derive(Debug, Serialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum ForkChild {
    Sandbox(Box<SandboxInfo>),
    Error(ErrorDetail),
}

/// Forks a running or paused sandbox into `count` copy-on-write children,
/// which inherit its labels, time-to-live, environment and current egress
/// policy (each logs its egress on its own) and run at once; the parent
/// keeps its state. One entry per child, in order. The request as a whole
/// fails (an error status) only when no child could be made.
#[utoipa::path(post, path = "/sandboxes/{id}/fork", params(("id" = String, Path)), request_body = ForkBody,
    responses((status = 200, body = [ForkChild]), (status = 404, body = ApiErrorBody),
              (status = 409, body = ApiErrorBody), (status = 502, body = ApiErrorBody)))]
async fn sandbox_fork(
    State(st): State<AppState>,
    Path(id): Path<String>,
    JsonBody(b): JsonBody<ForkBody>,
) -> ApiResult<Json<Vec<ForkChild>>> {
    let id = sandbox_id(&id)?;
    let r = st
        .daemon
        .execute(Command::Fork { id, count: b.count })
        .await;
    match counted(&st.daemon, r.map_err(ApiError::from))? {
        Reply::Forked(children) => Ok(Json(
            children
                .into_iter()
                .map(|c| match c {
                    Ok(info) => ForkChild::Sandbox(Box::new(info)),
                    Err(e) => {
                        st.daemon.count_error(&e);
                        ForkChild::Error(ApiError::Daemon(e).detail())
                    }
                })
                .collect(),
        )),
        other => Err(unexpected(other)),
    }
}

#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct SnapshotBody {
    /// The new template's name.
    pub name: String,
}

/// Makes a new template from a running or paused sandbox's current state:
/// its zygote is a fork of the sandbox, so sandboxes created from it start
/// where this one is now. The sandbox keeps running (or stays paused).
#[utoipa::path(post, path = "/sandboxes/{id}/snapshot", params(("id" = String, Path)), request_body = SnapshotBody,
    responses((status = 201, body = TemplateInfo), (status = 400, body = ApiErrorBody), (status = 404, body = ApiErrorBody),
              (status = 409, body = ApiErrorBody), (status = 502, body = ApiErrorBody)))]
async fn sandbox_snapshot(
    State(st): State<AppState>,
    Path(id): Path<String>,
    JsonBody(b): JsonBody<SnapshotBody>,
) -> ApiResult<(StatusCode, Json<TemplateInfo>)> {
    let id = sandbox_id(&id)?;
    let r = st.daemon.snapshot(&id, b.name).await;
    let t = counted(&st.daemon, r.map_err(ApiError::from))?;
    Ok((StatusCode::CREATED, Json(t)))
}

// ---------------------------------------------------------------- commands

/// `POST /sandboxes/{id}/commands`: `cmd` (run by `/bin/sh -c`) or `argv`.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ExecBody {
    #[serde(default)]
    pub cmd: Option<String>,
    #[serde(default)]
    pub argv: Option<Vec<String>>,
    #[serde(default)]
    pub envs: BTreeMap<String, String>,
    #[serde(default)]
    pub cwd: Option<String>,
    /// A user name or a numeric uid; default root.
    #[serde(default)]
    pub user: Option<String>,
    /// Wall-clock limit in seconds; on expiry the process group is killed
    /// and `timed_out` is true.
    #[serde(default)]
    pub timeout_secs: Option<f64>,
    /// Bytes given to the command's standard input (UTF-8 text).
    #[serde(default)]
    pub stdin: Option<String>,
    /// Per-stream output cap in bytes (buffered form default: 16 MiB).
    #[serde(default)]
    pub output_cap: Option<u64>,
    /// Start it in the background and answer at once with its `pid`
    /// (`ProcessStarted`); then see `/processes`. Its stdin (after
    /// `stdin`, if given) stays open for `/processes/{pid}/stdin`; the
    /// guest keeps its last 1 MiB of output.
    #[serde(default)]
    pub background: bool,
}

/// A background process started.
#[derive(Debug, Serialize, ToSchema)]
pub struct ProcessStarted {
    /// Its process id (and process group id) in the guest.
    pub pid: u32,
}

/// The result of a command. A non-zero exit is not an error.
#[derive(Debug, Serialize, ToSchema)]
pub struct ExecOutput {
    /// Absent in streams (the output came as events).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub stdout: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub stderr: Option<String>,
    /// `null` if a signal ended the command.
    pub exit_code: Option<i32>,
    pub signal: Option<i32>,
    pub timed_out: bool,
    pub duration_ms: f64,
    pub stdout_truncated: bool,
    pub stderr_truncated: bool,
}

/// One NDJSON line (or SSE event) of a streamed command.
#[derive(Debug, Serialize, ToSchema)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum StreamEvent {
    Stdout { data: String },
    Stderr { data: String },
    Exit(ExecOutput),
    Error { error: ErrorDetail },
}

impl StreamEvent {
    fn name(&self) -> &'static str {
        match self {
            Self::Stdout { .. } => "stdout",
            Self::Stderr { .. } => "stderr",
            Self::Exit(_) => "exit",
            Self::Error { .. } => "error",
        }
    }
}

const DEFAULT_BUFFERED_CAP: u64 = 16 << 20;

fn exec_request(b: ExecBody, buffered: bool) -> ApiResult<(ExecRequest, Option<Vec<u8>>)> {
    let mut req = match (b.cmd, b.argv) {
        (Some(c), None) => ExecRequest::shell(c),
        (None, Some(a)) if !a.is_empty() => ExecRequest::argv(a),
        _ => {
            return Err(ApiError::BadRequest(
                "give exactly one of `cmd` (a shell command) or `argv` (non-empty)".into(),
            ))
        }
    };
    req.env = b.envs;
    req.cwd = b.cwd;
    req.user = b.user.map(|u| match u.parse::<u32>() {
        Ok(uid) => User::Uid(uid),
        Err(_) => User::Name(u),
    });
    req.timeout = secs(b.timeout_secs, "timeout_secs")?;
    req.output_cap = b.output_cap.or(buffered.then_some(DEFAULT_BUFFERED_CAP));
    Ok((req, b.stdin.map(String::into_bytes)))
}

fn exit_output(r: &ExecResult, stdout: Option<String>, stderr: Option<String>) -> ExecOutput {
    ExecOutput {
        stdout,
        stderr,
        exit_code: match r.status {
            ExitStatus::Code(c) => Some(c),
            ExitStatus::Signal(_) => None,
        },
        signal: r.signal(),
        timed_out: r.timed_out,
        duration_ms: r.duration.as_secs_f64() * 1000.0,
        stdout_truncated: r.stdout.truncated,
        stderr_truncated: r.stderr.truncated,
    }
}

/// Runs a command. With `Accept: application/x-ndjson` (or
/// `text/event-stream`) output streams as [`StreamEvent`]s while it is
/// produced, ending with `exit` (or `error`); otherwise the answer is one
/// [`ExecOutput`] once it ends. A non-zero exit is a 200. With
/// `background: true` the answer is a [`ProcessStarted`] at once.
#[utoipa::path(post, path = "/sandboxes/{id}/commands", params(("id" = String, Path)), request_body = ExecBody,
    responses((status = 200, body = ExecOutput, description = "buffered result, an NDJSON/SSE stream of StreamEvent, or (background) a ProcessStarted"),
              (status = 400, body = ApiErrorBody), (status = 404, body = ApiErrorBody),
              (status = 409, body = ApiErrorBody), (status = 502, body = ApiErrorBody)))]
async fn command_run(
    State(st): State<AppState>,
    Path(id): Path<String>,
    headers: HeaderMap,
    JsonBody(b): JsonBody<ExecBody>,
) -> ApiResult<Response> {
    let id = sandbox_id(&id)?;
    let accept = headers
        .get(header::ACCEPT)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("");
    let mode = if accept.contains("application/x-ndjson") {
        Some(false)
    } else if accept.contains("text/event-stream") {
        Some(true)
    } else {
        None
    };
    if b.background {
        let (req, stdin) = exec_request(b, false)?;
        let pid = counted(
            &st.daemon,
            st.daemon
                .spawn_process(&id, req, stdin)
                .await
                .map_err(ApiError::from),
        )?;
        return Ok(Json(ProcessStarted { pid }).into_response());
    }
    let (req, stdin) = exec_request(b, mode.is_none())?;
    let mut rx = counted(
        &st.daemon,
        st.daemon.exec(&id, req, stdin).map_err(ApiError::from),
    )?;
    let Some(sse) = mode else {
        let (mut out, mut err) = (Vec::new(), Vec::new());
        while let Some(ev) = rx.recv().await {
            match ev {
                ExecEvent::Output(forkbox_proto::OutputStream::Stdout, b) => out.extend(b),
                ExecEvent::Output(forkbox_proto::OutputStream::Stderr, b) => err.extend(b),
                ExecEvent::Exit(r) => {
                    return Ok(Json(exit_output(
                        &r,
                        Some(String::from_utf8_lossy(&out).into_owned()),
                        Some(String::from_utf8_lossy(&err).into_owned()),
                    ))
                    .into_response())
                }
                ExecEvent::Failed(e) => return Err(e.into()),
            }
        }
        return Err(unexpected_end());
    };
    let (tx, events) = mpsc::channel::<StreamEvent>(64);
    tokio::spawn(async move {
        let mut carry = [Vec::new(), Vec::new()];
        while let Some(ev) = rx.recv().await {
            let event = match ev {
                ExecEvent::Output(s, bytes) => output_event(&mut carry, s, bytes),
                ExecEvent::Exit(r) => StreamEvent::Exit(exit_output(&r, None, None)),
                ExecEvent::Failed(e) => StreamEvent::Error {
                    error: ApiError::from(e).detail(),
                },
            };
            if tx.send(event).await.is_err() {
                break;
            }
        }
    });
    Ok(if sse {
        let mut r = stream_response(events, |e| {
            format!(
                "event: {}\ndata: {}\n\n",
                e.name(),
                serde_json::to_string(&e).unwrap_or_default()
            )
        });
        r.headers_mut().insert(
            header::CONTENT_TYPE,
            header::HeaderValue::from_static("text/event-stream"),
        );
        r
    } else {
        ndjson(events, |e| serde_json::to_string(&e).unwrap_or_default())
    })
}

fn unexpected_end() -> ApiError {
    ApiError::Daemon(DaemonError::Infrastructure {
        what: "the command's event stream ended without a result".into(),
        cause: None,
    })
}

/// One chunk of a command's output as a stream event, decoded with the
/// stream's own UTF-8 carry (`carry[0]` stdout, `carry[1]` stderr).
fn output_event(
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

fn ndjson<T: Send + 'static>(rx: mpsc::Receiver<T>, line: fn(T) -> String) -> Response {
    let mut r = stream_response(rx, move |e| {
        let mut s = line(e);
        s.push('\n');
        s
    });
    r.headers_mut().insert(
        header::CONTENT_TYPE,
        header::HeaderValue::from_static("application/x-ndjson"),
    );
    r
}

fn stream_response<T: Send + 'static>(
    rx: mpsc::Receiver<T>,
    render: impl Fn(T) -> String + Send + 'static,
) -> Response {
    let stream = futures_util::stream::unfold((rx, render), |(mut rx, render)| async move {
        let item = rx.recv().await?;
        let bytes = Bytes::from(render(item));
        Some((Ok::<_, Infallible>(bytes), (rx, render)))
    });
    Response::new(Body::from_stream(stream))
}

// ---------------------------------------------------------------- processes

fn pid_of(s: &str) -> ApiResult<u32> {
    s.parse()
        .map_err(|_| ApiError::BadRequest(format!("pid {s:?}: expected a process id")))
}

/// A JSON body that may also be empty (then every field takes its default).
fn optional_json<T: Default + serde::de::DeserializeOwned>(body: &Bytes) -> ApiResult<T> {
    if body.iter().all(u8::is_ascii_whitespace) {
        return Ok(T::default());
    }
    serde_json::from_slice(body)
        .map_err(|e| ApiError::BadRequest(format!("malformed request body: {e}")))
}

/// A process the guest agent tracks: a background process (running, or
/// among the last 64 that ended), or a command a client is waiting on.
#[derive(Debug, Serialize, ToSchema)]
pub struct ProcessJson {
    pub pid: u32,
    /// The shell command, if it was started as one.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cmd: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub argv: Option<Vec<String>>,
    /// Started with `background: true`.
    pub background: bool,
    pub running: bool,
    /// How long it has run (until it ended, if it did).
    pub duration_ms: f64,
    /// How it ended (its output is at `/output`); `null` while it runs.
    pub result: Option<ExecOutput>,
}

fn process_json(p: forkbox_proto::ProcessInfo) -> ProcessJson {
    let (cmd, argv) = match p.command {
        forkbox_proto::Command::Shell(s) => (Some(s), None),
        forkbox_proto::Command::Argv(a) => (None, Some(a)),
    };
    ProcessJson {
        pid: p.pid,
        cmd,
        argv,
        background: p.background,
        running: p.result.is_none(),
        duration_ms: p.ran_for.as_secs_f64() * 1000.0,
        result: p.result.as_ref().map(|r| exit_output(r, None, None)),
    }
}

/// Lists the sandbox's background processes (running, and the last 64
/// that ended) and the commands running with a client.
#[utoipa::path(get, path = "/sandboxes/{id}/processes", params(("id" = String, Path)),
    responses((status = 200, body = [ProcessJson]), (status = 404, body = ApiErrorBody),
              (status = 502, body = ApiErrorBody)))]
async fn process_list(
    State(st): State<AppState>,
    Path(id): Path<String>,
) -> ApiResult<Json<Vec<ProcessJson>>> {
    let id = sandbox_id(&id)?;
    let r = st.daemon.process(&id, |a| a.processes()).await;
    let list = counted(&st.daemon, r.map_err(ApiError::from))?;
    Ok(Json(list.into_iter().map(process_json).collect()))
}

/// `POST …/processes/{pid}/wait` (the body may be empty).
#[derive(Debug, Default, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct WaitBody {
    /// Longest wait in seconds (none: until it ends).
    #[serde(default)]
    pub timeout_secs: Option<f64>,
}

/// Waits for a background process to end; answers its result with the
/// output the guest kept (its last 1 MiB; `*_truncated` when some was
/// dropped). Still running at `timeout_secs`: 408, kind `timeout`.
#[utoipa::path(post, path = "/sandboxes/{id}/processes/{pid}/wait",
    params(("id" = String, Path), ("pid" = u32, Path)), request_body = WaitBody,
    responses((status = 200, body = ExecOutput), (status = 404, body = ApiErrorBody),
              (status = 408, body = ApiErrorBody), (status = 502, body = ApiErrorBody)))]
async fn process_wait(
    State(st): State<AppState>,
    Path((id, pid)): Path<(String, String)>,
    body: Bytes,
) -> ApiResult<Json<ExecOutput>> {
    let id = sandbox_id(&id)?;
    let pid = pid_of(&pid)?;
    let b: WaitBody = optional_json(&body)?;
    let timeout = secs(b.timeout_secs, "timeout_secs")?;
    let r = st
        .daemon
        .process(&id, move |a| {
            let Some(result) = a.wait_process(pid, timeout)? else {
                return Ok(None);
            };
            let (mut out, mut err) = (Vec::new(), Vec::new());
            let (dropped, _) = a.attach_process(pid, false, &mut |s, bytes| match s {
                forkbox_proto::OutputStream::Stdout => out.extend_from_slice(bytes),
                forkbox_proto::OutputStream::Stderr => err.extend_from_slice(bytes),
            })?;
            Ok(Some((result, out, err, dropped)))
        })
        .await;
    match counted(&st.daemon, r.map_err(ApiError::from))? {
        None => Err(ApiError::Timeout(format!(
            "process {pid} still runs after {:.3} s",
            timeout.unwrap_or_default().as_secs_f64()
        ))),
        Some((result, out, err, dropped)) => {
            let mut o = exit_output(
                &result,
                Some(String::from_utf8_lossy(&out).into_owned()),
                Some(String::from_utf8_lossy(&err).into_owned()),
            );
            o.stdout_truncated |= dropped > 0;
            o.stderr_truncated |= dropped > 0;
            Ok(Json(o))
        }
    }
}

/// `POST …/processes/{pid}/kill` (the body may be empty).
#[derive(Debug, Default, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct KillBody {
    /// Signal number sent to the process group (default 9, SIGKILL).
    #[serde(default)]
    pub signal: Option<i32>,
}

/// Signals a running process's group (background or not).
#[utoipa::path(post, path = "/sandboxes/{id}/processes/{pid}/kill",
    params(("id" = String, Path), ("pid" = u32, Path)), request_body = KillBody,
    responses((status = 204), (status = 404, body = ApiErrorBody), (status = 502, body = ApiErrorBody)))]
async fn process_kill(
    State(st): State<AppState>,
    Path((id, pid)): Path<(String, String)>,
    body: Bytes,
) -> ApiResult<StatusCode> {
    let id = sandbox_id(&id)?;
    let pid = pid_of(&pid)?;
    let b: KillBody = optional_json(&body)?;
    let signal = b.signal.unwrap_or(libc::SIGKILL);
    let r = st
        .daemon
        .process(&id, move |a| a.kill_process(pid, signal))
        .await;
    counted(&st.daemon, r.map_err(ApiError::from))?;
    Ok(StatusCode::NO_CONTENT)
}

#[derive(Debug, Deserialize, IntoParams)]
#[serde(deny_unknown_fields)]
struct StdinQuery {
    /// Close the process's stdin after these bytes (it sees EOF).
    close: Option<bool>,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct StdinWritten {
    pub bytes: u64,
}

/// Writes the raw request body to a background process's stdin.
#[utoipa::path(post, path = "/sandboxes/{id}/processes/{pid}/stdin",
    params(("id" = String, Path), ("pid" = u32, Path), StdinQuery),
    request_body(content = Vec<u8>, content_type = "application/octet-stream"),
    responses((status = 200, body = StdinWritten), (status = 400, body = ApiErrorBody),
              (status = 404, body = ApiErrorBody)))]
async fn process_stdin(
    State(st): State<AppState>,
    Path((id, pid)): Path<(String, String)>,
    RawQuery(raw): RawQuery,
    body: Bytes,
) -> ApiResult<Json<StdinWritten>> {
    let id = sandbox_id(&id)?;
    let pid = pid_of(&pid)?;
    let q: StdinQuery = query(raw)?;
    let close = q.close.unwrap_or(false);
    let r = st
        .daemon
        .process(&id, move |a| {
            a.process_stdin(pid, close, &mut body.as_ref())
        })
        .await;
    let bytes = counted(&st.daemon, r.map_err(ApiError::from))?;
    Ok(Json(StdinWritten { bytes }))
}

#[derive(Debug, Deserialize, IntoParams)]
#[serde(deny_unknown_fields)]
struct OutputQuery {
    /// Go on with the output as it comes until the process ends.
    follow: Option<bool>,
}

/// A background process's output so far.
#[derive(Debug, Serialize, ToSchema)]
pub struct ProcessOutput {
    pub stdout: String,
    pub stderr: String,
    /// Bytes of output the guest's bounded buffer (1 MiB) dropped.
    pub dropped_bytes: u64,
    pub running: bool,
    /// How it ended; `null` while it runs.
    pub result: Option<ExecOutput>,
}

/// Reattaches to a background process: the output the guest kept, and
/// with `follow=true` its output as it comes until it ends. With `Accept:
/// application/x-ndjson`, [`StreamEvent`]s (`stdout`, `stderr`, then
/// `exit` once it ended; without `follow` a running process's stream ends
/// without `exit`); otherwise one [`ProcessOutput`].
#[utoipa::path(get, path = "/sandboxes/{id}/processes/{pid}/output",
    params(("id" = String, Path), ("pid" = u32, Path), OutputQuery),
    responses((status = 200, body = ProcessOutput, description = "buffered, or an NDJSON stream of StreamEvent"),
              (status = 404, body = ApiErrorBody), (status = 502, body = ApiErrorBody)))]
async fn process_output(
    State(st): State<AppState>,
    Path((id, pid)): Path<(String, String)>,
    RawQuery(raw): RawQuery,
    headers: HeaderMap,
) -> ApiResult<Response> {
    let id = sandbox_id(&id)?;
    let pid = pid_of(&pid)?;
    let q: OutputQuery = query(raw)?;
    let streamed = headers
        .get(header::ACCEPT)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|a| a.contains("application/x-ndjson"));
    let mut rx = counted(
        &st.daemon,
        st.daemon
            .attach(&id, pid, q.follow.unwrap_or(false))
            .map_err(ApiError::from),
    )?;
    if !streamed {
        let (mut out, mut err) = (Vec::new(), Vec::new());
        while let Some(ev) = rx.recv().await {
            match ev {
                AttachEvent::Output(forkbox_proto::OutputStream::Stdout, b) => out.extend(b),
                AttachEvent::Output(forkbox_proto::OutputStream::Stderr, b) => err.extend(b),
                AttachEvent::End { dropped, result } => {
                    return Ok(Json(ProcessOutput {
                        stdout: String::from_utf8_lossy(&out).into_owned(),
                        stderr: String::from_utf8_lossy(&err).into_owned(),
                        dropped_bytes: dropped,
                        running: result.is_none(),
                        result: result.as_ref().map(|r| exit_output(r, None, None)),
                    })
                    .into_response())
                }
                AttachEvent::Failed(e) => return Err(e.into()),
            }
        }
        return Err(unexpected_end());
    }
    let (tx, events) = mpsc::channel::<StreamEvent>(64);
    tokio::spawn(async move {
        let mut carry = [Vec::new(), Vec::new()];
        while let Some(ev) = rx.recv().await {
            let event = match ev {
                AttachEvent::Output(s, bytes) => output_event(&mut carry, s, bytes),
                AttachEvent::End {
                    result: Some(r), ..
                } => StreamEvent::Exit(exit_output(&r, None, None)),
                AttachEvent::End { result: None, .. } => break,
                AttachEvent::Failed(e) => StreamEvent::Error {
                    error: ApiError::from(e).detail(),
                },
            };
            if tx.send(event).await.is_err() {
                break;
            }
        }
    });
    Ok(ndjson(events, |e| {
        serde_json::to_string(&e).unwrap_or_default()
    }))
}

// ---------------------------------------------------------------- ports

/// `POST /sandboxes/{id}/ports`.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct PortBody {
    /// The guest TCP port (on the guest's 127.0.0.1).
    pub port: u16,
    /// First check that the guest port accepts (one connection, closed at
    /// once); default true.
    #[serde(default)]
    pub check: Option<bool>,
    /// With `check`: keep retrying a refusing port this many seconds (a
    /// server still starting); default 0.
    #[serde(default)]
    pub wait_secs: Option<f64>,
}

/// Opens a forward of a guest TCP port: the daemon listens on
/// `127.0.0.1:NNNNN` of the host and relays each connection to the guest
/// port through the guest agent (no guest network needed). Opening an
/// open port answers the same forward. A guest port that refuses: 409,
/// kind `guest`, `guest_kind` `connection_refused`; later connections it
/// refuses are reset. Every forward closes when the sandbox dies.
#[utoipa::path(post, path = "/sandboxes/{id}/ports", params(("id" = String, Path)), request_body = PortBody,
    responses((status = 200, body = PortForwardInfo), (status = 404, body = ApiErrorBody),
              (status = 409, body = ApiErrorBody), (status = 502, body = ApiErrorBody)))]
async fn port_open(
    State(st): State<AppState>,
    Path(id): Path<String>,
    JsonBody(b): JsonBody<PortBody>,
) -> ApiResult<Json<PortForwardInfo>> {
    let id = sandbox_id(&id)?;
    let wait = secs(b.wait_secs, "wait_secs")?.unwrap_or_default();
    let r = st
        .daemon
        .open_port(&id, b.port, b.check.unwrap_or(true), wait)
        .await;
    Ok(Json(counted(&st.daemon, r.map_err(ApiError::from))?))
}

/// The sandbox's open port forwards.
#[utoipa::path(get, path = "/sandboxes/{id}/ports", params(("id" = String, Path)),
    responses((status = 200, body = [PortForwardInfo]), (status = 404, body = ApiErrorBody)))]
async fn ports_list(
    State(st): State<AppState>,
    Path(id): Path<String>,
) -> ApiResult<Json<Vec<PortForwardInfo>>> {
    let id = sandbox_id(&id)?;
    Ok(Json(counted(
        &st.daemon,
        st.daemon.ports(&id).map_err(ApiError::from),
    )?))
}

/// Closes a port forward and its connections.
#[utoipa::path(delete, path = "/sandboxes/{id}/ports/{port}",
    params(("id" = String, Path), ("port" = u16, Path)),
    responses((status = 204), (status = 404, body = ApiErrorBody)))]
async fn port_close(
    State(st): State<AppState>,
    Path((id, port)): Path<(String, String)>,
) -> ApiResult<StatusCode> {
    let id = sandbox_id(&id)?;
    let port: u16 = port
        .parse()
        .map_err(|_| ApiError::BadRequest(format!("port {port:?}: expected 1-65535")))?;
    if counted(
        &st.daemon,
        st.daemon.close_port(&id, port).map_err(ApiError::from),
    )? {
        Ok(StatusCode::NO_CONTENT)
    } else {
        Err(ApiError::NotFound(format!(
            "no forward of guest port {port}"
        )))
    }
}

// ---------------------------------------------------------------- files

#[derive(Debug, Deserialize, IntoParams)]
#[serde(deny_unknown_fields)]
struct PathQuery {
    /// An absolute guest path.
    path: String,
}

#[derive(Debug, Deserialize, IntoParams)]
#[serde(deny_unknown_fields)]
struct WriteQuery {
    path: String,
    /// Permission bits in octal (default 644).
    mode: Option<String>,
}

#[derive(Debug, Deserialize, IntoParams)]
#[serde(deny_unknown_fields)]
struct RemoveQuery {
    path: String,
    /// Remove a whole tree.
    recursive: Option<bool>,
}

fn guest_path(p: String) -> ApiResult<String> {
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

fn stat_json(s: &forkbox_proto::FileStat) -> FileStatJson {
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

/// Reads a guest file (raw bytes).
#[utoipa::path(get, path = "/sandboxes/{id}/files", params(("id" = String, Path), PathQuery),
    responses((status = 200, content_type = "application/octet-stream", description = "the file's bytes"),
              (status = 404, body = ApiErrorBody)))]
async fn file_read(
    State(st): State<AppState>,
    Path(id): Path<String>,
    RawQuery(raw): RawQuery,
) -> ApiResult<Response> {
    let id = sandbox_id(&id)?;
    let q: PathQuery = query(raw)?;
    let path = guest_path(q.path)?;
    let data = st
        .daemon
        .files(&id, move |a| {
            let mut buf = Vec::new();
            a.read_file(&path, &mut buf).map(|_| buf)
        })
        .await;
    let data = counted(&st.daemon, data.map_err(ApiError::from))?;
    Ok(([(header::CONTENT_TYPE, "application/octet-stream")], data).into_response())
}

/// Writes a guest file from the raw request body, creating parent
/// directories.
#[utoipa::path(put, path = "/sandboxes/{id}/files", params(("id" = String, Path), WriteQuery),
    request_body(content = Vec<u8>, content_type = "application/octet-stream"),
    responses((status = 200, body = Written), (status = 400, body = ApiErrorBody)))]
async fn file_write(
    State(st): State<AppState>,
    Path(id): Path<String>,
    RawQuery(raw): RawQuery,
    body: Bytes,
) -> ApiResult<Json<Written>> {
    let id = sandbox_id(&id)?;
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
    let p = path.clone();
    let r = st
        .daemon
        .files(&id, move |a| {
            a.write_file_with(&p, mode, true, &mut body.as_ref())
        })
        .await;
    let bytes = counted(&st.daemon, r.map_err(ApiError::from))?;
    Ok(Json(Written { path, bytes }))
}

/// Removes a file, symlink or empty directory (`recursive=true`: a tree).
#[utoipa::path(delete, path = "/sandboxes/{id}/files", params(("id" = String, Path), RemoveQuery),
    responses((status = 204), (status = 404, body = ApiErrorBody)))]
async fn file_remove(
    State(st): State<AppState>,
    Path(id): Path<String>,
    RawQuery(raw): RawQuery,
) -> ApiResult<StatusCode> {
    let id = sandbox_id(&id)?;
    let q: RemoveQuery = query(raw)?;
    let path = guest_path(q.path)?;
    let recursive = q.recursive.unwrap_or(false);
    let r = st
        .daemon
        .files(&id, move |a| a.remove(&path, recursive))
        .await;
    counted(&st.daemon, r.map_err(ApiError::from))?;
    Ok(StatusCode::NO_CONTENT)
}

/// Lists a guest directory.
#[utoipa::path(get, path = "/sandboxes/{id}/files/list", params(("id" = String, Path), PathQuery),
    responses((status = 200, body = [DirEntryJson]), (status = 404, body = ApiErrorBody)))]
async fn file_list(
    State(st): State<AppState>,
    Path(id): Path<String>,
    RawQuery(raw): RawQuery,
) -> ApiResult<Json<Vec<DirEntryJson>>> {
    let id = sandbox_id(&id)?;
    let q: PathQuery = query(raw)?;
    let path = guest_path(q.path)?;
    let p = path.clone();
    let r = st.daemon.files(&id, move |a| a.list_dir(&p)).await;
    let entries = counted(&st.daemon, r.map_err(ApiError::from))?;
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
async fn file_stat(
    State(st): State<AppState>,
    Path(id): Path<String>,
    RawQuery(raw): RawQuery,
) -> ApiResult<Json<FileStatJson>> {
    let id = sandbox_id(&id)?;
    let q: PathQuery = query(raw)?;
    let path = guest_path(q.path)?;
    let r = st.daemon.files(&id, move |a| a.stat(&path)).await;
    Ok(Json(stat_json(&counted(
        &st.daemon,
        r.map_err(ApiError::from),
    )?)))
}

/// `mkdir -p`.
#[utoipa::path(post, path = "/sandboxes/{id}/files/mkdir", params(("id" = String, Path), PathQuery),
    responses((status = 204), (status = 409, body = ApiErrorBody)))]
async fn file_mkdir(
    State(st): State<AppState>,
    Path(id): Path<String>,
    RawQuery(raw): RawQuery,
) -> ApiResult<StatusCode> {
    let id = sandbox_id(&id)?;
    let q: PathQuery = query(raw)?;
    let path = guest_path(q.path)?;
    let r = st.daemon.files(&id, move |a| a.mkdir(&path, 0o755)).await;
    counted(&st.daemon, r.map_err(ApiError::from))?;
    Ok(StatusCode::NO_CONTENT)
}

/// Downloads a guest directory as a tar archive.
#[utoipa::path(get, path = "/sandboxes/{id}/files/tar", params(("id" = String, Path), PathQuery),
    responses((status = 200, content_type = "application/x-tar", description = "the archive"), (status = 404, body = ApiErrorBody)))]
async fn tar_download(
    State(st): State<AppState>,
    Path(id): Path<String>,
    RawQuery(raw): RawQuery,
) -> ApiResult<Response> {
    let id = sandbox_id(&id)?;
    let q: PathQuery = query(raw)?;
    let path = guest_path(q.path)?;
    let r = st
        .daemon
        .files(&id, move |a| {
            let mut buf = Vec::new();
            a.download_tar(&path, &mut buf).map(|_| buf)
        })
        .await;
    let data = counted(&st.daemon, r.map_err(ApiError::from))?;
    Ok(([(header::CONTENT_TYPE, "application/x-tar")], data).into_response())
}

/// Unpacks a tar archive (the request body) into a guest directory.
#[utoipa::path(put, path = "/sandboxes/{id}/files/tar", params(("id" = String, Path), PathQuery),
    request_body(content = Vec<u8>, content_type = "application/x-tar"),
    responses((status = 200, body = Written), (status = 400, body = ApiErrorBody)))]
async fn tar_upload(
    State(st): State<AppState>,
    Path(id): Path<String>,
    RawQuery(raw): RawQuery,
    body: Bytes,
) -> ApiResult<Json<Written>> {
    let id = sandbox_id(&id)?;
    let q: PathQuery = query(raw)?;
    let path = guest_path(q.path)?;
    let p = path.clone();
    let r = st
        .daemon
        .files(&id, move |a| a.upload_tar(&p, &mut body.as_ref()))
        .await;
    let bytes = counted(&st.daemon, r.map_err(ApiError::from))?;
    Ok(Json(Written { path, bytes }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::fake::Fake;
    use crate::service::Config;
    use http_body_util::BodyExt;
    use std::sync::Arc;
    use tower::ServiceExt;

    fn app(token: Option<&str>) -> Router {
        let mut config = Config::default();
        config.limits.max_live = 4;
        let d = Daemon::new(Arc::new(Fake::default()), config).expect("daemon");
        router(d, token.map(str::to_owned))
    }

    async fn call(
        app: &Router,
        method: &str,
        uri: &str,
        body: &str,
    ) -> (StatusCode, serde_json::Value) {
        let req = axum::http::Request::builder()
            .method(method)
            .uri(uri)
            .header(header::CONTENT_TYPE, "application/json")
            .body(Body::from(body.to_owned()))
            .expect("request");
        let resp = app.clone().oneshot(req).await.expect("infallible");
        let status = resp.status();
        let bytes = resp.into_body().collect().await.expect("body").to_bytes();
        let json = serde_json::from_slice(&bytes).unwrap_or(serde_json::Value::Null);
        (status, json)
    }

    #[test]
    fn openapi_document_matches_docs_openapi_json() {
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../../docs/openapi.json");
        let committed = std::fs::read_to_string(path).unwrap_or_default();
        assert!(
            committed == openapi_json(),
            "docs/openapi.json is stale: regenerate it with `target/release/forkboxd openapi > docs/openapi.json`"
        );
    }

    #[tokio::test]
    async fn create_list_info_kill_round_trip() {
        let app = app(None);
        let (st, info) = call(
            &app,
            "POST",
            "/sandboxes",
            r#"{"template":"minimal","metadata":{"run":"a"},"timeout_secs":60}"#,
        )
        .await;
        assert_eq!(st, StatusCode::CREATED, "{info}");
        let id = info["id"].as_str().expect("id").to_owned();
        assert_eq!(info["state"], "running");
        assert_eq!(info["started_by"], "fork");
        let (st, list) = call(&app, "GET", "/sandboxes?label=run=a", "").await;
        assert_eq!(st, StatusCode::OK);
        assert_eq!(list.as_array().map(Vec::len), Some(1));
        let (_, list) = call(&app, "GET", "/sandboxes?label=run=b", "").await;
        assert_eq!(list.as_array().map(Vec::len), Some(0));
        let (st, _) = call(&app, "DELETE", &format!("/sandboxes/{id}"), "").await;
        assert_eq!(st, StatusCode::NO_CONTENT);
        let (st, info) = call(&app, "GET", &format!("/sandboxes/{id}"), "").await;
        assert_eq!(st, StatusCode::OK);
        assert_eq!(info["state"], "dead");
        assert_eq!(info["death"], "killed");
        let (st, err) = call(&app, "DELETE", &format!("/sandboxes/{id}"), "").await;
        assert_eq!(st, StatusCode::CONFLICT, "{err}");
    }

    #[tokio::test]
    async fn unknown_sandbox_is_404_with_json_error() {
        let app = app(None);
        for uri in ["/sandboxes/sb-0000000000000000", "/sandboxes/nonsense"] {
            let (st, err) = call(&app, "GET", uri, "").await;
            assert_eq!(st, StatusCode::NOT_FOUND);
            assert_eq!(err["error"]["kind"], "not_found");
            assert_eq!(err["error"]["infrastructure"], false);
        }
        let (st, _) = call(
            &app,
            "POST",
            "/sandboxes/sb-0000000000000000/commands",
            r#"{"cmd":"true"}"#,
        )
        .await;
        assert_eq!(st, StatusCode::NOT_FOUND);
    }

    #[tokio::test]
    async fn malformed_requests_are_400_with_a_message() {
        let app = app(None);
        for (method, uri, body) in [
            ("POST", "/sandboxes", "{not json"),
            ("POST", "/sandboxes", r#"{"template":"minimal","bogus":1}"#),
            (
                "POST",
                "/sandboxes",
                r#"{"template":"minimal","timeout_secs":-1}"#,
            ),
            ("GET", "/sandboxes?label=novalue", ""),
            ("GET", "/sandboxes?what=1", ""),
        ] {
            let (st, err) = call(&app, method, uri, body).await;
            assert_eq!(st, StatusCode::BAD_REQUEST, "{method} {uri} {body}: {err}");
            assert_eq!(err["error"]["kind"], "invalid_request");
            assert!(err["error"]["message"]
                .as_str()
                .is_some_and(|m| !m.is_empty()));
        }
        let (_, info) = call(&app, "POST", "/sandboxes", r#"{"template":"minimal"}"#).await;
        let id = info["id"].as_str().expect("id").to_owned();
        let (st, err) = call(
            &app,
            "POST",
            &format!("/sandboxes/{id}/commands"),
            r#"{"cmd":"a","argv":["b"]}"#,
        )
        .await;
        assert_eq!(st, StatusCode::BAD_REQUEST, "{err}");
        let (st, _) = call(
            &app,
            "GET",
            &format!("/sandboxes/{id}/files?path=relative"),
            "",
        )
        .await;
        assert_eq!(st, StatusCode::BAD_REQUEST);
    }

    #[tokio::test]
    async fn unknown_template_is_404_and_fork_answers_per_child() {
        let app = app(None);
        let (st, _) = call(&app, "POST", "/sandboxes", r#"{"template":"nope"}"#).await;
        assert_eq!(st, StatusCode::NOT_FOUND);
        let (_, info) = call(&app, "POST", "/sandboxes", r#"{"template":"minimal"}"#).await;
        let id = info["id"].as_str().expect("id").to_owned();
        let (st, err) = call(
            &app,
            "POST",
            &format!("/sandboxes/{id}/fork"),
            r#"{"count":2}"#,
        )
        .await;
        assert_eq!(st, StatusCode::OK, "{err}");
        let kids = err.as_array().expect("array");
        assert_eq!(kids.len(), 2);
        assert_eq!(kids[1]["sandbox"]["parent"], id.as_str());
        assert_eq!(kids[1]["sandbox"]["started_by"], "fork");
        // Past the cap of 4: two fit, the third says why on its own.
        let (st, body) = call(
            &app,
            "POST",
            &format!("/sandboxes/{id}/fork"),
            r#"{"count":3}"#,
        )
        .await;
        assert_eq!(st, StatusCode::OK, "{body}");
        assert_eq!(body[2]["error"]["kind"], "capacity", "{body}");
        assert_eq!(body[2]["error"]["infrastructure"], false);
    }

    #[tokio::test]
    async fn create_with_a_bad_rule_is_400_and_creates_nothing() {
        let app = app(None);
        let (st, err) = call(
            &app,
            "POST",
            "/sandboxes",
            r#"{"template":"minimal","network":{"allow_out":["pypi.org","x:99999"]}}"#,
        )
        .await;
        assert_eq!(st, StatusCode::BAD_REQUEST, "{err}");
        assert_eq!(err["error"]["kind"], "invalid_request");
        let msg = err["error"]["message"].as_str().unwrap_or_default();
        assert!(
            msg.starts_with(r#"allow_out[1] "x:99999" is not a valid rule"#),
            "{msg}"
        );
        let (_, list) = call(&app, "GET", "/sandboxes?all=true", "").await;
        assert_eq!(list.as_array().map(Vec::len), Some(0));
        let (_, t) = call(&app, "GET", "/templates/minimal", "").await;
        assert_eq!(t["state"], "not_baked", "not even a bake");
    }

    #[tokio::test]
    async fn network_is_set_read_and_inherited_over_http() {
        let app = app(None);
        let (st, info) = call(
            &app,
            "POST",
            "/sandboxes",
            r#"{"template":"minimal","network":{"allow_out":["PyPI.org:443"]}}"#,
        )
        .await;
        assert_eq!(st, StatusCode::CREATED, "{info}");
        let id = info["id"].as_str().expect("id").to_owned();
        let uri = format!("/sandboxes/{id}/network");
        let (st, n) = call(&app, "GET", &uri, "").await;
        assert_eq!(st, StatusCode::OK, "{n}");
        assert_eq!(
            n,
            serde_json::json!({"allow_out": ["pypi.org:443"], "deny_out": [], "active": true})
        );
        let (st, err) = call(&app, "POST", &uri, r#"{"deny_out":["10.0.0.0/33"]}"#).await;
        assert_eq!(st, StatusCode::BAD_REQUEST, "{err}");
        assert!(err["error"]["message"]
            .as_str()
            .is_some_and(|m| m.starts_with("deny_out[0]")));
        let (st, n) = call(
            &app,
            "POST",
            &uri,
            r#"{"allow_out":["*.Debian.org"],"deny_out":["security.debian.org"]}"#,
        )
        .await;
        assert_eq!(st, StatusCode::OK, "{n}");
        assert_eq!(n["allow_out"], serde_json::json!(["*.debian.org"]));
        assert_eq!(n["deny_out"], serde_json::json!(["security.debian.org"]));
        let (_, kids) = call(
            &app,
            "POST",
            &format!("/sandboxes/{id}/fork"),
            r#"{"count":1}"#,
        )
        .await;
        let kid = kids[0]["sandbox"]["id"].as_str().expect("child").to_owned();
        let (_, kn) = call(&app, "GET", &format!("/sandboxes/{kid}/network"), "").await;
        assert_eq!(kn, n, "the child inherits the parent's current policy");
        call(&app, "DELETE", &format!("/sandboxes/{id}"), "").await;
        let (st, err) = call(&app, "GET", &uri, "").await;
        assert_eq!(st, StatusCode::CONFLICT, "{err}");
    }

    #[tokio::test]
    async fn egress_answers_records_for_known_sandboxes_only() {
        let app = app(None);
        let (_, info) = call(&app, "POST", "/sandboxes", r#"{"template":"minimal"}"#).await;
        let id = info["id"].as_str().expect("id").to_owned();
        call(&app, "DELETE", &format!("/sandboxes/{id}"), "").await;
        let (st, body) = call(&app, "GET", &format!("/sandboxes/{id}/egress?limit=5"), "").await;
        assert_eq!(st, StatusCode::OK, "{body}");
        assert_eq!(body, serde_json::json!({"records": []}));
        let (st, _) = call(&app, "GET", &format!("/sandboxes/{id}/egress?limit=x"), "").await;
        assert_eq!(st, StatusCode::BAD_REQUEST);
        let (st, err) = call(&app, "GET", "/sandboxes/sb-0000000000000000/egress", "").await;
        assert_eq!(st, StatusCode::NOT_FOUND, "{err}");
    }

    #[tokio::test]
    async fn logs_are_the_console_tail_as_text() {
        let app = app(None);
        let (_, info) = call(&app, "POST", "/sandboxes", r#"{"template":"minimal"}"#).await;
        let id = info["id"].as_str().expect("id").to_owned();
        let req = Request::builder()
            .uri(format!("/sandboxes/{id}/logs?lines=3"))
            .body(Body::empty())
            .expect("request");
        let resp = app.clone().oneshot(req).await.expect("response");
        assert_eq!(resp.status(), StatusCode::OK);
        let body = resp.into_body().collect().await.expect("body").to_bytes();
        assert_eq!(&body[..], b"line 0\nline 1\nline 2\n");
        let (st, _) = call(&app, "GET", &format!("/sandboxes/{id}/logs?lines=x"), "").await;
        assert_eq!(st, StatusCode::BAD_REQUEST);
    }

    #[tokio::test]
    async fn exec_with_dead_agent_is_502_infrastructure() {
        let app = app(None);
        let (_, info) = call(&app, "POST", "/sandboxes", r#"{"template":"minimal"}"#).await;
        let id = info["id"].as_str().expect("id").to_owned();
        let (st, err) = call(
            &app,
            "POST",
            &format!("/sandboxes/{id}/commands"),
            r#"{"cmd":"true"}"#,
        )
        .await;
        assert_eq!(st, StatusCode::BAD_GATEWAY, "{err}");
        assert_eq!(err["error"]["infrastructure"], true);
    }

    #[tokio::test]
    async fn token_is_required_except_for_health() {
        let app = app(Some("s3cret"));
        let (st, _) = call(&app, "GET", "/health", "").await;
        assert_eq!(st, StatusCode::OK);
        let (st, err) = call(&app, "GET", "/sandboxes", "").await;
        assert_eq!(st, StatusCode::UNAUTHORIZED);
        assert_eq!(err["error"]["kind"], "unauthorized");
        let req = axum::http::Request::builder()
            .uri("/sandboxes")
            .header(header::AUTHORIZATION, "Bearer s3cret")
            .body(Body::empty())
            .expect("request");
        let resp = app.clone().oneshot(req).await.expect("infallible");
        assert_eq!(resp.status(), StatusCode::OK);
    }

    #[tokio::test]
    async fn metrics_count_creations_and_errors() {
        let app = app(None);
        call(&app, "POST", "/sandboxes", r#"{"template":"minimal"}"#).await;
        call(&app, "DELETE", "/sandboxes/sb-0000000000000000", "").await;
        let req = axum::http::Request::builder()
            .uri("/metrics")
            .body(Body::empty())
            .expect("req");
        let resp = app.clone().oneshot(req).await.expect("infallible");
        let text = resp.into_body().collect().await.expect("body").to_bytes();
        let text = String::from_utf8_lossy(&text);
        assert!(text.contains("forkbox_sandboxes_live 1"), "{text}");
        assert!(
            text.contains("forkbox_sandbox_creations_total{outcome=\"ok\"} 1"),
            "{text}"
        );
        assert!(
            text.contains("forkbox_errors_total{kind=\"not_found\"} 1"),
            "{text}"
        );
    }

    /// A stand-in guest agent on a unix socket that only relays
    /// `ConnectPort` to this host's 127.0.0.1 (as the real one does in
    /// its guest).
    fn fake_port_agent(dir: &std::path::Path) -> std::path::PathBuf {
        use forkbox_proto::frame::{read_frame, write_frame};
        use forkbox_proto::{encode_control, FrameKind, Hello, Request as AgentRequest};
        let sock = dir.join("agent.sock");
        let listener = std::os::unix::net::UnixListener::bind(&sock).expect("bind agent");
        std::thread::spawn(move || {
            for conn in listener.incoming() {
                let Ok(mut conn) = conn else { return };
                std::thread::spawn(move || {
                    let hello = Hello {
                        protocol_version: forkbox_proto::PROTOCOL_VERSION,
                        agent_version: "fake".into(),
                        boot: Default::default(),
                    };
                    write_frame(&mut conn, FrameKind::Control, &encode_control(&hello))
                        .expect("hello");
                    let Ok(Some(f)) = read_frame(&mut conn, forkbox_proto::MAX_FRAME_LEN) else {
                        return;
                    };
                    let Ok(AgentRequest::ConnectPort { port }) =
                        forkbox_proto::decode_control(&f.body)
                    else {
                        return;
                    };
                    let reply = match std::net::TcpStream::connect(("127.0.0.1", port)) {
                        Ok(tcp) => {
                            let r = forkbox_proto::Response::Ready;
                            write_frame(&mut conn, FrameKind::Control, &encode_control(&r))
                                .expect("ready");
                            let (mut c2, mut t2) = (
                                conn.try_clone().expect("clone"),
                                tcp.try_clone().expect("clone"),
                            );
                            std::thread::spawn(move || {
                                let _ = std::io::copy(&mut c2, &mut t2);
                                let _ = t2.shutdown(std::net::Shutdown::Write);
                            });
                            let mut tcp = tcp;
                            let _ = std::io::copy(&mut tcp, &mut conn);
                            let _ = conn.shutdown(std::net::Shutdown::Write);
                            return;
                        }
                        Err(e) => forkbox_proto::Response::Error {
                            error: AgentError::new(
                                GuestKind::ConnectionRefused,
                                format!("guest port {port} refused the connection: {e}"),
                            ),
                        },
                    };
                    let _ = write_frame(&mut conn, FrameKind::Control, &encode_control(&reply));
                });
            }
        });
        sock
    }

    fn app_with_agent(sock: std::path::PathBuf) -> Router {
        let fake = Fake::default();
        *fake.world.agent_sock.lock().expect("agent_sock") = Some(sock);
        let d = Daemon::new(Arc::new(fake), Config::default()).expect("daemon");
        router(d, None)
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn port_forward_relays_to_the_guest_port_and_closes_with_the_sandbox() {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let dir = tempfile::tempdir().expect("tempdir");
        let app = app_with_agent(fake_port_agent(dir.path()));
        // The "guest" server: echoes one line per connection.
        let server = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let port = server.local_addr().expect("addr").port();
        tokio::spawn(async move {
            loop {
                let Ok((mut s, _)) = server.accept().await else {
                    return;
                };
                tokio::spawn(async move {
                    let mut buf = [0u8; 64];
                    let n = s.read(&mut buf).await.unwrap_or(0);
                    let _ = s.write_all(&buf[..n]).await;
                });
            }
        });
        let (_, info) = call(&app, "POST", "/sandboxes", r#"{"template":"minimal"}"#).await;
        let id = info["id"].as_str().expect("id").to_owned();
        let body = format!(r#"{{"port":{port}}}"#);
        let (st, fwd) = call(&app, "POST", &format!("/sandboxes/{id}/ports"), &body).await;
        assert_eq!(st, StatusCode::OK, "{fwd}");
        assert_eq!(fwd["port"], port);
        let host = fwd["host"].as_str().expect("host").to_owned();
        assert!(host.starts_with("127.0.0.1:"), "{host}");
        let mut c = tokio::net::TcpStream::connect(&host)
            .await
            .expect("connect");
        c.write_all(b"ping").await.expect("write");
        let mut got = Vec::new();
        c.read_to_end(&mut got).await.expect("read");
        assert_eq!(got, b"ping");
        // Opening it again answers the same forward; it is listed.
        let (_, again) = call(&app, "POST", &format!("/sandboxes/{id}/ports"), &body).await;
        assert_eq!(again["host"], host.as_str());
        let (_, list) = call(&app, "GET", &format!("/sandboxes/{id}/ports"), "").await;
        assert_eq!(list.as_array().map(Vec::len), Some(1));
        // Killing the sandbox closes the listener.
        call(&app, "DELETE", &format!("/sandboxes/{id}"), "").await;
        let mut closed = false;
        for _ in 0..200 {
            if tokio::net::TcpStream::connect(&host).await.is_err() {
                closed = true;
                break;
            }
            tokio::task::yield_now().await;
        }
        assert!(closed, "the forward outlived its sandbox");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn port_forward_to_a_refusing_port_is_409_and_close_is_404_after() {
        let dir = tempfile::tempdir().expect("tempdir");
        let app = app_with_agent(fake_port_agent(dir.path()));
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .expect("free port")
            .port();
        let (_, info) = call(&app, "POST", "/sandboxes", r#"{"template":"minimal"}"#).await;
        let id = info["id"].as_str().expect("id").to_owned();
        let (st, err) = call(
            &app,
            "POST",
            &format!("/sandboxes/{id}/ports"),
            &format!(r#"{{"port":{port}}}"#),
        )
        .await;
        assert_eq!(st, StatusCode::CONFLICT, "{err}");
        assert_eq!(err["error"]["guest_kind"], "connection_refused");
        assert_eq!(err["error"]["infrastructure"], false);
        let msg = err["error"]["message"].as_str().unwrap_or_default();
        assert!(msg.contains(&format!("guest port {port} refused")), "{msg}");
        // Without the check the forward opens; closing it twice is a 404.
        let (st, _) = call(
            &app,
            "POST",
            &format!("/sandboxes/{id}/ports"),
            &format!(r#"{{"port":{port},"check":false}}"#),
        )
        .await;
        assert_eq!(st, StatusCode::OK);
        let uri = format!("/sandboxes/{id}/ports/{port}");
        assert_eq!(
            call(&app, "DELETE", &uri, "").await.0,
            StatusCode::NO_CONTENT
        );
        assert_eq!(
            call(&app, "DELETE", &uri, "").await.0,
            StatusCode::NOT_FOUND
        );
    }

    #[tokio::test]
    async fn process_routes_check_the_sandbox_and_the_pid() {
        let app = app(None);
        let (st, _) = call(&app, "GET", "/sandboxes/sb-0000000000000000/processes", "").await;
        assert_eq!(st, StatusCode::NOT_FOUND);
        let (_, info) = call(&app, "POST", "/sandboxes", r#"{"template":"minimal"}"#).await;
        let id = info["id"].as_str().expect("id").to_owned();
        let (st, err) = call(
            &app,
            "POST",
            &format!("/sandboxes/{id}/processes/abc/wait"),
            "",
        )
        .await;
        assert_eq!(st, StatusCode::BAD_REQUEST, "{err}");
        let (st, err) = call(
            &app,
            "POST",
            &format!("/sandboxes/{id}/processes/12/kill"),
            r#"{"sig":9}"#,
        )
        .await;
        assert_eq!(st, StatusCode::BAD_REQUEST, "{err}");
        // The fake has no agent: a well-formed call is an infrastructure error.
        let (st, err) = call(
            &app,
            "POST",
            &format!("/sandboxes/{id}/commands"),
            r#"{"cmd":"sleep 1","background":true}"#,
        )
        .await;
        assert_eq!(st, StatusCode::BAD_GATEWAY, "{err}");
        assert_eq!(err["error"]["infrastructure"], true);
    }

    #[test]
    fn utf8_chunk_keeps_split_characters_whole() {
        let mut carry = Vec::new();
        let e = "é".as_bytes();
        assert_eq!(utf8_chunk(&mut carry, vec![b'a', e[0]]), "a");
        assert_eq!(utf8_chunk(&mut carry, vec![e[1], b'b']), "éb");
        assert_eq!(utf8_chunk(&mut carry, vec![0xff, b'c']), "\u{fffd}c");
    }

    #[test]
    fn constant_time_eq_compares_whole_tokens() {
        assert!(constant_time_eq(b"abc", b"abc"));
        assert!(!constant_time_eq(b"abc", b"abd"));
        assert!(!constant_time_eq(b"abc", b"ab"));
    }
}
