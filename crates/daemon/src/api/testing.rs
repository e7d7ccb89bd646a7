//! What the API's tests share: a router on the fake backend and one
//! call through it.

pub(super) use axum::body::Body;
pub(super) use axum::http::{header, StatusCode};
pub(super) use axum::Router;
pub(super) use http_body_util::BodyExt;
pub(super) use std::sync::Arc;
pub(super) use tower::ServiceExt;

pub(super) use super::router;
pub(super) use crate::backend::fake::Fake;
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
