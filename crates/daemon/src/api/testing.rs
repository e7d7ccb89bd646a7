//! What the API's tests share: a router on the fake backend and one
//! call through it, answered whole or streamed.

pub(super) use axum::body::Body;
pub(super) use axum::http::{header, StatusCode};
pub(super) use axum::Router;
pub(super) use http_body_util::BodyExt;
pub(super) use std::sync::Arc;
pub(super) use tower::ServiceExt;

pub(super) use super::router;
pub(super) use crate::backend::fake::{scripted_agent, Fake};
pub(super) use crate::service::{Config, Daemon};

pub(super) fn app(token: Option<&str>) -> Router {
    let mut config = Config::default();
    config.limits.max_live = 4;
    let d = Daemon::new(Arc::new(Fake::default()), config).expect("daemon");
    router(d, token.map(str::to_owned))
}

pub(super) async fn call(
    app: &Router,
    method: &str,
    uri: &str,
    body: &str,
) -> (StatusCode, serde_json::Value) {
    let (status, bytes) = send(app, method, uri, body, None).await;
    let json = serde_json::from_slice(&bytes).unwrap_or(serde_json::Value::Null);
    (status, json)
}

/// A POST asking for NDJSON: its status and its lines (an error status:
/// its one body).
pub(super) async fn call_ndjson(
    app: &Router,
    uri: &str,
    body: &str,
) -> (StatusCode, Vec<serde_json::Value>) {
    let (status, bytes) = send(app, "POST", uri, body, Some("application/x-ndjson")).await;
    if status != StatusCode::OK {
        let error = serde_json::from_slice(&bytes).expect("an error body");
        return (status, vec![error]);
    }
    let lines = bytes
        .split(|b| *b == b'\n')
        .filter(|l| !l.is_empty())
        .map(|l| serde_json::from_slice(l).expect("a JSON line"))
        .collect();
    (status, lines)
}

/// One JSON request through the router, `Accept: accept` if given; the
/// status and the whole body.
async fn send(
    app: &Router,
    method: &str,
    uri: &str,
    body: &str,
    accept: Option<&str>,
) -> (StatusCode, axum::body::Bytes) {
    let mut req = axum::http::Request::builder()
        .method(method)
        .uri(uri)
        .header(header::CONTENT_TYPE, "application/json");
    if let Some(accept) = accept {
        req = req.header(header::ACCEPT, accept);
    }
    let req = req.body(Body::from(body.to_owned())).expect("request");
    let resp = app.clone().oneshot(req).await.expect("infallible");
    let status = resp.status();
    let bytes = resp.into_body().collect().await.expect("body").to_bytes();
    (status, bytes)
}

/// A router on the fake backend whose VMs' agent listens on `sock`, with
/// the daemon's `bounds`.
pub(super) fn app_with_agent_and(
    sock: Option<std::path::PathBuf>,
    bounds: crate::service::Bounds,
) -> Router {
    let fake = Fake::default();
    *fake.world.agent_sock.lock().expect("agent_sock") = sock;
    let mut config = Config::default();
    config.limits.max_live = 4;
    config.bounds = bounds;
    let d = Daemon::new(Arc::new(fake), config).expect("daemon");
    router(d, None)
}

/// A created sandbox's id.
pub(super) async fn sandbox(app: &Router) -> String {
    let (st, info) = call(app, "POST", "/sandboxes", r#"{"template":"minimal"}"#).await;
    assert_eq!(st, StatusCode::CREATED, "{info}");
    info["id"].as_str().expect("id").to_owned()
}

/// The metrics text.
pub(super) async fn metrics_text(app: &Router) -> String {
    let req = axum::http::Request::builder()
        .uri("/metrics")
        .body(Body::empty())
        .expect("req");
    let resp = app.clone().oneshot(req).await.expect("infallible");
    let text = resp.into_body().collect().await.expect("body").to_bytes();
    String::from_utf8_lossy(&text).into_owned()
}
