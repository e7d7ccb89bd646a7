//! `/sandboxes`: creating, listing, reading and killing sandboxes, their
//! time-to-live, pause and resume, forks, templates made from a sandbox,
//! and console logs.

use std::collections::BTreeMap;

use axum::extract::{RawQuery, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::{Deserialize, Serialize};
use utoipa::{IntoParams, ToSchema};

use super::error::{one, report, unexpected, ApiError, ApiErrorBody, ApiResult, ErrorDetail};
use super::extract::{policy, query, secs, JsonBody, OnSandbox};
use super::stream::{streamed, Event, Framing};
use super::AppState;
use crate::core::{ExpiryAction, Labels, SandboxId};
use crate::network::NetworkPolicy;
use crate::service::{
    CreateSandbox, Daemon, DaemonError, IntegrityReport, Lifecycle, Reply, SandboxInfo,
};
use crate::template::{SandboxLimits, TemplateInfo};
use tokio::sync::mpsc;

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
    /// As a fork's `seed`, for the one sandbox (child 0 of the template's
    /// zygote).
    #[serde(default)]
    pub seed: Option<u64>,
    /// What the sandbox may reach; absent: nothing (egress denied). Never
    /// the template's bake policy.
    #[serde(default)]
    pub network: Option<NetworkPolicy>,
    /// The host resources it may take, over its template's (each at most
    /// what its shape gets); a value out of range is a 400.
    #[serde(default)]
    pub limits: Option<SandboxLimits>,
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
pub(super) async fn sandbox_create(
    State(st): State<AppState>,
    JsonBody(b): JsonBody<CreateBody>,
) -> ApiResult<(StatusCode, Json<SandboxInfo>)> {
    let network = b.network.map(policy).transpose()?;
    let cmd = Lifecycle::Create(CreateSandbox {
        template: b.template,
        ttl: secs(b.timeout_secs, "timeout_secs")?,
        on_expiry: b.on_timeout,
        labels: b.metadata,
        envs: b.envs,
        wait: secs(b.wait_secs, "wait_secs")?,
        network,
        seed: b.seed,
        limits: b.limits,
    });
    let info = one(st.daemon.execute(cmd).await?)?;
    Ok((StatusCode::CREATED, info))
}

/// Query of `GET /sandboxes`.
#[derive(Debug, Deserialize, IntoParams)]
#[allow(dead_code)] // documents the query; parsed by hand (repeated keys)
pub(super) struct ListQuery {
    /// `key=value`; repeat to require several labels.
    label: Option<Vec<String>>,
    /// Include dead sandboxes still remembered.
    all: Option<bool>,
}

pub(super) fn labels_of(pairs: &[(String, String)]) -> ApiResult<Labels> {
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
pub(super) async fn sandbox_list(
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
        .execute(Lifecycle::List {
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
pub(super) async fn sandbox_kill_by_label(
    State(st): State<AppState>,
    JsonBody(b): JsonBody<KillByLabelBody>,
) -> ApiResult<Json<Killed>> {
    let labels = b.metadata;
    match st.daemon.execute(Lifecycle::KillByLabel { labels }).await? {
        Reply::Killed(killed) => Ok(Json(Killed { killed })),
        other => Err(unexpected(other)),
    }
}

/// State, metadata, TTL, lineage and VMM metrics of one sandbox (dead ones
/// too, while remembered).
#[utoipa::path(get, path = "/sandboxes/{id}", params(("id" = String, Path)),
    responses((status = 200, body = SandboxInfo), (status = 404, body = ApiErrorBody)))]
pub(super) async fn sandbox_get(
    OnSandbox { daemon, id }: OnSandbox,
) -> ApiResult<Json<SandboxInfo>> {
    one(daemon.execute(Lifecycle::Info { id }).await?)
}

/// Kills a sandbox. Its VM is stopped off the request path.
#[utoipa::path(delete, path = "/sandboxes/{id}", params(("id" = String, Path)),
    responses((status = 204), (status = 404, body = ApiErrorBody), (status = 409, body = ApiErrorBody)))]
pub(super) async fn sandbox_kill(OnSandbox { daemon, id }: OnSandbox) -> ApiResult<StatusCode> {
    daemon.execute(Lifecycle::Kill { id }).await?;
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
pub(super) async fn sandbox_timeout(
    OnSandbox { daemon, id }: OnSandbox,
    JsonBody(b): JsonBody<TimeoutBody>,
) -> ApiResult<Json<SandboxInfo>> {
    let cmd = Lifecycle::SetTimeout {
        id,
        ttl: secs(b.timeout_secs, "timeout_secs")?,
        on_expiry: b.on_timeout,
    };
    one(daemon.execute(cmd).await?)
}

/// Pauses a running sandbox: its vCPUs stop, its memory stays; commands
/// and file calls are refused until it resumes.
#[utoipa::path(post, path = "/sandboxes/{id}/pause", params(("id" = String, Path)),
    responses((status = 200, body = SandboxInfo), (status = 404, body = ApiErrorBody), (status = 409, body = ApiErrorBody), (status = 502, body = ApiErrorBody)))]
pub(super) async fn sandbox_pause(
    OnSandbox { daemon, id }: OnSandbox,
) -> ApiResult<Json<SandboxInfo>> {
    one(daemon.execute(Lifecycle::Pause { id }).await?)
}

/// Resumes a paused sandbox.
#[utoipa::path(post, path = "/sandboxes/{id}/resume", params(("id" = String, Path)),
    responses((status = 200, body = SandboxInfo), (status = 404, body = ApiErrorBody), (status = 409, body = ApiErrorBody), (status = 502, body = ApiErrorBody)))]
pub(super) async fn sandbox_resume(
    OnSandbox { daemon, id }: OnSandbox,
) -> ApiResult<Json<SandboxInfo>> {
    one(daemon.execute(Lifecycle::Resume { id }).await?)
}

#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ForkBody {
    /// 1-1024 children.
    pub count: u32,
    /// Child `i`'s guest randomness seed derives from (`seed`, `i`): the
    /// entropy forkbox gives its kernel RNG after the fork and its
    /// `FORKBOX_SEED` (also in `/run/forkbox/seed`). Absent: fresh host
    /// entropy and no `FORKBOX_SEED`.
    #[serde(default)]
    pub seed: Option<u64>,
}

/// One child of a fork: `sandbox`, or `error` when this child failed on
/// its own (past the live cap, or it did not come up).
#[derive(Debug, Serialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum ForkChild {
    Sandbox(Box<SandboxInfo>),
    Error(ErrorDetail),
}

/// One line of a streamed fork: child `index` of the request (0-based),
/// the sandbox or why it failed alone.
#[derive(Debug, Serialize, ToSchema)]
pub struct ForkEvent {
    pub index: u32,
    #[serde(flatten)]
    pub child: ForkChild,
}

impl Event for ForkEvent {
    fn name(&self) -> &'static str {
        match self.child {
            ForkChild::Sandbox(_) => "sandbox",
            ForkChild::Error(_) => "error",
        }
    }
}

fn fork_child(daemon: &Daemon, child: Result<SandboxInfo, DaemonError>) -> ForkChild {
    match child {
        Ok(info) => ForkChild::Sandbox(Box::new(info)),
        Err(e) => ForkChild::Error(report(daemon, &e.into())),
    }
}

/// Forks a running or paused sandbox into `count` copy-on-write children,
/// which inherit its labels, time-to-live, environment and current egress
/// policy (each logs its egress on its own) and run at once; the parent
/// keeps its state. One entry per child, in order: a child the caps do
/// not admit is its own entry's error (200 even when that is every child).
/// The request as a whole fails (an error status) when the parent is not
/// there or cannot fork (its VMM refused or is gone).
///
/// With `Accept: application/x-ndjson` the children stream instead, one
/// [`ForkEvent`] line each as soon as it is up (in the order they come
/// up, each with its `index`; the children the caps refused last): a
/// caller of a wide group starts on its first children before the last
/// exist. The request's own failure is still an error status.
#[utoipa::path(post, path = "/sandboxes/{id}/fork", params(("id" = String, Path)), request_body = ForkBody,
    responses((status = 200, body = [ForkChild]),
              (status = 200, description = "with Accept: application/x-ndjson, one line per child as it comes up", body = ForkEvent, content_type = "application/x-ndjson"),
              (status = 400, body = ApiErrorBody), (status = 404, body = ApiErrorBody),
              (status = 409, body = ApiErrorBody), (status = 502, body = ApiErrorBody)))]
pub(super) async fn sandbox_fork(
    OnSandbox { daemon, id }: OnSandbox,
    headers: HeaderMap,
    JsonBody(b): JsonBody<ForkBody>,
) -> ApiResult<Response> {
    if Framing::accepted(&headers, &[Framing::Ndjson]).is_some() {
        let (first, mut rest) = daemon.fork_streamed(id, b.count, b.seed).await?;
        let (tx, rx) = mpsc::channel(64);
        tokio::spawn(async move {
            let mut next = Some(first);
            while let Some((index, child)) = next {
                let event = ForkEvent {
                    index: index as u32,
                    child: fork_child(&daemon, child),
                };
                if tx.send(event).await.is_err() {
                    // The client left; the children are recorded all
                    // the same (and reported as they come).
                    while let Some((_, child)) = rest.recv().await {
                        fork_child(&daemon, child);
                    }
                    return;
                }
                next = rest.recv().await;
            }
        });
        return Ok(streamed(rx, Framing::Ndjson));
    }
    match daemon
        .execute(Lifecycle::Fork {
            id,
            count: b.count,
            seed: b.seed,
        })
        .await?
    {
        Reply::Forked(children) => Ok(Json(
            children
                .into_iter()
                .map(|c| fork_child(&daemon, c))
                .collect::<Vec<_>>(),
        )
        .into_response()),
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
pub(super) async fn sandbox_snapshot(
    OnSandbox { daemon, id }: OnSandbox,
    JsonBody(b): JsonBody<SnapshotBody>,
) -> ApiResult<(StatusCode, Json<TemplateInfo>)> {
    let t = daemon.template_from_sandbox(&id, b.name).await?;
    Ok((StatusCode::CREATED, Json(t)))
}

/// Query of `GET /sandboxes/{id}/logs`.
#[derive(Debug, Deserialize, IntoParams)]
#[serde(deny_unknown_fields)]
pub(super) struct LogsQuery {
    /// How many of the last lines (default 200, at most 10000).
    lines: Option<usize>,
}

/// The sandbox's serial console, its last lines: kernel and agent
/// messages since it started (a fork child's since its fork). Commands'
/// output is not here; it goes to their callers.
#[utoipa::path(get, path = "/sandboxes/{id}/logs", params(("id" = String, Path), LogsQuery),
    responses((status = 200, description = "the console's last lines", content_type = "text/plain"),
              (status = 404, body = ApiErrorBody)))]
pub(super) async fn sandbox_logs(
    OnSandbox { daemon, id }: OnSandbox,
    RawQuery(raw): RawQuery,
) -> ApiResult<Response> {
    let q: LogsQuery = query(raw)?;
    let lines = q.lines.unwrap_or(200).clamp(1, 10_000);
    let text = daemon.console(&id, lines).await?;
    Ok(([(header::CONTENT_TYPE, "text/plain; charset=utf-8")], text).into_response())
}

/// Whether the sandbox's protected paths (its template's `protect`) still
/// hold what the template's bake recorded: which paths changed, were
/// added under a protected path, or are gone. Check before grading: a
/// rollout whose report is not `intact` tampered with what grades it.
#[utoipa::path(get, path = "/sandboxes/{id}/integrity", params(("id" = String, Path)),
    responses((status = 200, body = IntegrityReport), (status = 404, body = ApiErrorBody),
              (status = 409, body = ApiErrorBody), (status = 410, body = ApiErrorBody),
              (status = 502, body = ApiErrorBody)))]
pub(super) async fn sandbox_integrity(
    OnSandbox { daemon, id }: OnSandbox,
) -> ApiResult<Json<IntegrityReport>> {
    Ok(Json(daemon.integrity(&id).await?))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::testing::*;

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
    async fn logs_are_the_console_tail_as_text() {
        let app = app(None);
        let (_, info) = call(&app, "POST", "/sandboxes", r#"{"template":"minimal"}"#).await;
        let id = info["id"].as_str().expect("id").to_owned();
        let req = axum::http::Request::builder()
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
}

#[cfg(test)]
mod bounds_tests {
    use crate::api::testing::*;

    /// A TTL of 1e19 s fits a `Duration` but not `Instant + it`: it used
    /// to panic in the registry with the creation counted, leaking a
    /// creation slot. Now it is a 400 that changes nothing.
    #[tokio::test]
    async fn create_with_an_overflowing_ttl_is_400_and_changes_no_counter() {
        let app = app(None);
        for body in [
            r#"{"template":"minimal","timeout_secs":1e19}"#,
            r#"{"template":"minimal","timeout_secs":-1}"#,
            r#"{"template":"minimal","timeout_secs":315360001}"#,
            r#"{"template":"minimal","wait_secs":1e300}"#,
        ] {
            let (st, err) = call(&app, "POST", "/sandboxes", body).await;
            assert_eq!(st, StatusCode::BAD_REQUEST, "{body}: {err}");
            assert_eq!(err["error"]["kind"], "invalid_request", "{err}");
        }
        let text = metrics_text(&app).await;
        for line in [
            "forkbox_sandboxes_live 0",
            "forkbox_sandboxes_creating 0",
            "forkbox_sandbox_creations_total{outcome=\"ok\"} 0",
            "forkbox_sandbox_creations_total{outcome=\"failed\"} 0",
        ] {
            assert!(text.lines().any(|l| l == line), "{line}: {text}");
        }
        assert!(!text.contains("forkbox_errors_total{"), "{text}");
        // Every slot is still there: the cap of 4 fills with 4.
        for _ in 0..4 {
            sandbox(&app).await;
        }
    }

    #[tokio::test]
    async fn set_timeout_overflowing_is_400_and_keeps_the_deadline() {
        let app = app(None);
        let id = sandbox(&app).await;
        let uri = format!("/sandboxes/{id}/timeout");
        let (st, err) = call(&app, "POST", &uri, r#"{"timeout_secs":1e19}"#).await;
        assert_eq!(st, StatusCode::BAD_REQUEST, "{err}");
        let (st, info) = call(&app, "GET", &format!("/sandboxes/{id}"), "").await;
        assert_eq!(st, StatusCode::OK);
        assert_eq!(info["state"], "running", "{info}");
        let (st, _) = call(&app, "POST", &uri, r#"{"timeout_secs":60}"#).await;
        assert_eq!(st, StatusCode::OK);
    }

    #[tokio::test]
    async fn overflowing_waits_and_command_timeouts_are_400() {
        let app = app(None);
        let id = sandbox(&app).await;
        for (uri, body) in [
            (
                format!("/sandboxes/{id}/commands"),
                r#"{"cmd":"true","timeout_secs":1e19}"#,
            ),
            (
                format!("/sandboxes/{id}/commands"),
                r#"{"cmd":"true","timeout_secs":86401}"#,
            ),
            (
                format!("/sandboxes/{id}/commands"),
                r#"{"cmd":"true","background":true,"timeout_secs":1e19}"#,
            ),
            (
                format!("/sandboxes/{id}/processes/7/wait"),
                r#"{"timeout_secs":1e19}"#,
            ),
            (
                format!("/sandboxes/{id}/ports"),
                r#"{"port":80,"wait_secs":1e19}"#,
            ),
            (
                format!("/sandboxes/{id}/ports"),
                r#"{"port":80,"wait_secs":301}"#,
            ),
        ] {
            let (st, err) = call(&app, "POST", &uri, body).await;
            assert_eq!(st, StatusCode::BAD_REQUEST, "{uri} {body}: {err}");
        }
        let text = metrics_text(&app).await;
        assert!(text.contains("forkbox_execs_total 0"), "{text}");
    }

    #[tokio::test]
    async fn a_json_body_over_1_mib_is_413_json() {
        let app = app(None);
        let big = format!(
            r#"{{"template":"minimal","labels":{{"x":"{}"}}}}"#,
            "a".repeat(2 << 20)
        );
        let (st, err) = call(&app, "POST", "/sandboxes", &big).await;
        assert_eq!(st, StatusCode::PAYLOAD_TOO_LARGE, "{err}");
        assert_eq!(err["error"]["kind"], "too_large");
        assert_eq!(err["error"]["infrastructure"], false);
    }
}
