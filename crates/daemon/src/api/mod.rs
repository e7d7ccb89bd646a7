//! The HTTP+JSON edge: parses requests into typed calls of [`Daemon`],
//! turns replies and errors into responses, and describes itself in an
//! OpenAPI document (`/openapi.json`). Handlers only translate: HTTP in,
//! a service call, HTTP out.
//!
//! Errors are JSON: `{"error": {"kind", "message", "infrastructure"}}`;
//! `infrastructure: true` means the sandbox machinery failed, not the
//! request or the user's command.
//!
//! This module owns the router, its bearer-token check and the OpenAPI
//! document; the handlers are grouped by resource:
//!
//! - `templates`: `/templates`: list, register and bake, save, push to
//!   and pull from a registry, delete.
//! - `sandboxes`: `/sandboxes`: create, list, kill, time-to-live, pause,
//!   fork, templates from a sandbox, console logs.
//! - `network`: a sandbox's egress policy and egress log.
//! - `commands`: running commands (buffered, streamed, background).
//! - `processes`: background processes: list, wait, kill, stdin, output.
//! - `ports`: port forwards.
//! - `files`: guest files and tar archives.
//!
//! and the parts they share: `extract` (what every handler parses
//! first), `error` (statuses, JSON errors, the one place they are
//! counted), `stream` (NDJSON and SSE framing).

mod commands;
mod error;
mod extract;
mod files;
mod network;
mod ports;
mod processes;
mod sandboxes;
mod stream;
mod templates;
#[cfg(test)]
mod testing;

use axum::extract::{DefaultBodyLimit, Request, State};
use axum::http::header;
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{delete, get, post};
use axum::{Json, Router};
use serde::Serialize;
use utoipa::OpenApi;

use crate::core::{DeathCause, ExpiryAction, SandboxId, SandboxState};
use crate::network::NetworkPolicy;
use crate::service::{
    BakeEvent, BakeFailure, Daemon, IntegrityReport, NetworkInfo, PortForwardInfo, RegistryEvent,
    RegistryRequest, SandboxInfo, SandboxMetrics,
};
use crate::template::{Readiness, SandboxLimits, TemplateInfo, TemplateSpec, TemplateState};

// The handlers and their OpenAPI paths (`__path_*`), by name: the
// document's operations carry no tag (`paths(module::handler)` would tag
// each with its module).
use commands::*;
use error::*;
use files::*;
use network::*;
use ports::*;
use processes::*;
use sandboxes::*;
use stream::StreamEvent;
use templates::*;

/// Largest JSON request body (1 MiB): every route but the uploads and
/// commands.
pub const MAX_JSON_BODY: usize = 1 << 20;
/// Largest body of `POST /sandboxes/{id}/commands` (16 MiB): its `stdin`
/// comes inline. File, tar and stdin uploads have the daemon's
/// `--max-upload-bytes` ([`Bounds::upload_max`](crate::service::Bounds)).
pub const MAX_COMMAND_BODY: usize = 16 << 20;

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
        template_save,
        template_push,
        template_pull,
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
        sandbox_integrity,
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
        SandboxLimits,
        TemplateInfo,
        TemplateState,
        Readiness,
        BakeEvent,
        BakeFailure,
        RegistryRequest,
        RegistryEvent,
        ForkChild,
        ForkEvent,
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
        EgressRecordDoc,
        IntegrityReport
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
    let upload = DefaultBodyLimit::max(daemon.bounds().upload_max);
    let state = AppState { daemon, token };
    let sandbox = Router::new()
        .route("/", get(sandbox_get).delete(sandbox_kill))
        .route("/timeout", post(sandbox_timeout))
        .route("/pause", post(sandbox_pause))
        .route("/resume", post(sandbox_resume))
        .route("/fork", post(sandbox_fork))
        .route("/snapshot", post(sandbox_snapshot))
        .route("/logs", get(sandbox_logs))
        .route("/integrity", get(sandbox_integrity))
        .route("/network", get(network_get).post(network_set))
        .route("/egress", get(egress_log))
        .route(
            "/commands",
            post(command_run).layer(DefaultBodyLimit::max(MAX_COMMAND_BODY)),
        )
        .route("/processes", get(process_list))
        .route("/processes/{pid}/wait", post(process_wait))
        .route("/processes/{pid}/kill", post(process_kill))
        .route("/processes/{pid}/stdin", post(process_stdin).layer(upload))
        .route("/processes/{pid}/output", get(process_output))
        .route("/ports", get(ports_list).post(port_open))
        .route("/ports/{port}", delete(port_close))
        .route(
            "/files",
            get(file_read)
                .put(file_write)
                .delete(file_remove)
                .layer(upload),
        )
        .route("/files/list", get(file_list))
        .route("/files/stat", get(file_stat))
        .route("/files/mkdir", post(file_mkdir))
        .route(
            "/files/tar",
            get(tar_download).put(tar_upload).layer(upload),
        );
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
        .route("/templates/{name}/save", post(template_save))
        .route("/templates/{name}/push", post(template_push))
        .route("/templates/{name}/pull", post(template_pull))
        .route("/sandboxes", get(sandbox_list).post(sandbox_create))
        .route("/sandboxes/kill", post(sandbox_kill_by_label))
        .nest("/sandboxes/{id}", sandbox)
        .fallback(|| async { ApiError::NotFound("no such route".into()) })
        .layer(DefaultBodyLimit::max(MAX_JSON_BODY))
        .layer(middleware::from_fn_with_state(state.clone(), authorize))
        .layer(middleware::from_fn_with_state(state.clone(), report_errors))
        .with_state(state)
}

/// Without a valid token (when one is set), every route but `/health`
/// answers 401.
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
        st.daemon.scrape().await,
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::testing::*;

    #[test]
    fn openapi_document_matches_docs_openapi_json() {
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../../docs/openapi.json");
        let committed = std::fs::read_to_string(path).unwrap_or_default();
        assert!(
            committed == openapi_json(),
            "docs/openapi.json is stale: regenerate it with `target/release/forkboxd openapi > docs/openapi.json`"
        );
    }

    /// The template limits the document shows are the VMM's own.
    #[test]
    fn openapi_template_limits_are_the_vmm_s() {
        use forkbox_vmm_api::shape::{MAX_MEMORY_MIB, MAX_VCPUS, MIN_MEMORY_MIB, MIN_VCPUS};
        let doc: serde_json::Value =
            serde_json::from_str(&openapi_json()).expect("the document is JSON");
        let props = &doc["components"]["schemas"]["TemplateSpec"]["properties"];
        assert_eq!(props["vcpus"]["minimum"], u64::from(MIN_VCPUS));
        assert_eq!(props["vcpus"]["maximum"], u64::from(MAX_VCPUS));
        assert_eq!(props["memory_mib"]["minimum"], MIN_MEMORY_MIB);
        assert_eq!(props["memory_mib"]["maximum"], MAX_MEMORY_MIB);
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

    #[test]
    fn constant_time_eq_compares_whole_tokens() {
        assert!(constant_time_eq(b"abc", b"abc"));
        assert!(!constant_time_eq(b"abc", b"abd"));
        assert!(!constant_time_eq(b"abc", b"ab"));
    }

    #[tokio::test]
    async fn errors_are_counted_once_whether_answered_streamed_or_per_fork_child() {
        let app = app(None);
        let (_, info) = call(&app, "POST", "/sandboxes", r#"{"template":"minimal"}"#).await;
        let id = info["id"].as_str().expect("id").to_owned();
        // The fake has no agent: a buffered command fails as an error
        // response, a streamed one in its last event.
        let uri = format!("/sandboxes/{id}/commands");
        assert_eq!(
            call(&app, "POST", &uri, r#"{"cmd":"true"}"#).await.0,
            StatusCode::BAD_GATEWAY
        );
        let (status, events) = call_ndjson(&app, &uri, r#"{"cmd":"true"}"#).await;
        assert_eq!(status, StatusCode::OK);
        let last = events.last().expect("an event");
        assert_eq!(last["type"], "error", "{last}");
        // Past the live cap of 4: the fourth child fails alone.
        let (_, kids) = call(
            &app,
            "POST",
            &format!("/sandboxes/{id}/fork"),
            r#"{"count":4}"#,
        )
        .await;
        assert_eq!(kids[3]["error"]["kind"], "capacity", "{kids}");
        let text = metrics_text(&app).await;
        assert!(
            text.contains("forkbox_errors_total{kind=\"infrastructure\"} 2"),
            "{text}"
        );
        assert!(
            text.contains("forkbox_errors_total{kind=\"capacity\"} 1"),
            "{text}"
        );
    }

    #[tokio::test]
    async fn a_streamed_fork_gives_each_child_once_with_its_place_and_its_own_failures() {
        let app = app(None);
        let (_, info) = call(&app, "POST", "/sandboxes", r#"{"template":"minimal"}"#).await;
        let id = info["id"].as_str().expect("id").to_owned();
        // The live cap is 4 and the parent is one: three children, then
        // two refusals, which come last.
        let (status, lines) =
            call_ndjson(&app, &format!("/sandboxes/{id}/fork"), r#"{"count":5}"#).await;
        assert_eq!(status, StatusCode::OK);
        let mut places: Vec<u64> = lines
            .iter()
            .map(|l| l["index"].as_u64().expect("index"))
            .collect();
        let sandboxes = lines
            .iter()
            .filter(|l| l["sandbox"]["id"].is_string())
            .count();
        assert_eq!(sandboxes, 3, "{lines:?}");
        assert!(
            lines[3..].iter().all(|l| l["error"]["kind"] == "capacity"),
            "{lines:?}"
        );
        places.sort_unstable();
        assert_eq!(places, [0, 1, 2, 3, 4]);
        // The children are live sandboxes, listed as any other.
        let child = lines[0]["sandbox"]["id"].as_str().expect("a child");
        let (status, _) = call(&app, "GET", &format!("/sandboxes/{child}"), "").await;
        assert_eq!(status, StatusCode::OK);
        // The request's own failures are still error statuses.
        let (status, body) =
            call_ndjson(&app, &format!("/sandboxes/{id}/fork"), r#"{"count":1025}"#).await;
        assert_eq!(status, StatusCode::BAD_REQUEST);
        assert!(
            body[0]["error"]["message"]
                .as_str()
                .expect("message")
                .contains("1-1024"),
            "{body:?}"
        );
        let (status, _) = call_ndjson(&app, "/sandboxes/sb-nothere/fork", r#"{"count":2}"#).await;
        assert_eq!(status, StatusCode::NOT_FOUND);
    }
}
