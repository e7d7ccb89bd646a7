//! `/templates`: the templates, registering and baking one (its bake
//! streamed as NDJSON), saving one to outlive the daemon, pushing one to a
//! registry and pulling one from it (streamed too), deleting one.

use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::Response;
use axum::Json;

use super::error::{ApiErrorBody, ApiResult};
use super::extract::JsonBody;
use super::stream::{streamed, Framing};
use super::AppState;
use crate::service::{BakeEvent, RegistryEvent, RegistryRequest};
use crate::template::{TemplateInfo, TemplateSpec};

/// Built-in, baked and snapshot templates, with their zygotes' state.
#[utoipa::path(get, path = "/templates", responses((status = 200, body = [TemplateInfo])))]
pub(super) async fn templates_list(State(st): State<AppState>) -> Json<Vec<TemplateInfo>> {
    Json(st.daemon.templates())
}

/// Registers and bakes a template: boot, setup commands, readiness check,
/// then the VM is paused as the template's zygote, which every sandbox
/// created from it forks. Streams NDJSON [`BakeEvent`]s; the last line is
/// `done` or `failed` (a failed template is unregistered again).
#[utoipa::path(post, path = "/templates", request_body = TemplateSpec,
    responses((status = 200, description = "NDJSON stream of bake events", body = BakeEvent, content_type = "application/x-ndjson"),
              (status = 400, body = ApiErrorBody), (status = 409, body = ApiErrorBody)))]
pub(super) async fn template_create(
    State(st): State<AppState>,
    JsonBody(spec): JsonBody<TemplateSpec>,
) -> ApiResult<Response> {
    let rx = st.daemon.bake(spec)?;
    Ok(streamed(rx, Framing::Ndjson))
}

#[utoipa::path(get, path = "/templates/{name}", params(("name" = String, Path)),
    responses((status = 200, body = TemplateInfo), (status = 404, body = ApiErrorBody)))]
pub(super) async fn template_get(
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
pub(super) async fn template_bake(
    State(st): State<AppState>,
    Path(name): Path<String>,
) -> ApiResult<Response> {
    let rx = st.daemon.bake_named(&name)?;
    Ok(streamed(rx, Framing::Ndjson))
}

/// Saves a baked template's zygote (its memory, sparse, and its state)
/// in the daemon's state directory: a restarted daemon, even after a
/// reboot, starts it from there instead of baking (`saved_bytes` in its
/// info). Saved again, the snapshot is replaced; deleting the template
/// removes it. Creations from the template wait while it is written.
#[utoipa::path(post, path = "/templates/{name}/save", params(("name" = String, Path)),
    responses((status = 200, body = TemplateInfo), (status = 400, body = ApiErrorBody),
              (status = 404, body = ApiErrorBody), (status = 409, body = ApiErrorBody)))]
pub(super) async fn template_save(
    State(st): State<AppState>,
    Path(name): Path<String>,
) -> ApiResult<Json<TemplateInfo>> {
    Ok(Json(st.daemon.save_template(&name).await?))
}

/// Pushes a baked template to a registry as one OCI artifact: its record,
/// its zygote's snapshot (the memory compressed with zstd) and, for a
/// stored image, the image whole (blobs the registry has are not sent).
/// A template not yet saved is saved first. Streams NDJSON
/// [`RegistryEvent`]s; the last line is `pushed` or `failed`.
#[utoipa::path(post, path = "/templates/{name}/push", params(("name" = String, Path)), request_body = RegistryRequest,
    responses((status = 200, description = "NDJSON stream of registry events", body = RegistryEvent, content_type = "application/x-ndjson"),
              (status = 400, body = ApiErrorBody), (status = 404, body = ApiErrorBody)))]
pub(super) async fn template_push(
    State(st): State<AppState>,
    Path(name): Path<String>,
    JsonBody(req): JsonBody<RegistryRequest>,
) -> ApiResult<Response> {
    let rx = st.daemon.push_template(&name, req)?;
    Ok(streamed(rx, Framing::Ndjson))
}

/// Pulls a template a daemon pushed, registers it as `name` and starts
/// its zygote from the snapshot, without baking: sandboxes fork from it
/// at once. Its image comes with it (layers the store has are not
/// downloaded); a template on a built-in image needs this host's disk of
/// that image to be the same bytes. Creations from `name` wait while it
/// is pulled. Streams NDJSON [`RegistryEvent`]s; the last line is
/// `pulled` or `failed`.
#[utoipa::path(post, path = "/templates/{name}/pull", params(("name" = String, Path)), request_body = RegistryRequest,
    responses((status = 200, description = "NDJSON stream of registry events", body = RegistryEvent, content_type = "application/x-ndjson"),
              (status = 400, body = ApiErrorBody), (status = 409, body = ApiErrorBody)))]
pub(super) async fn template_pull(
    State(st): State<AppState>,
    Path(name): Path<String>,
    JsonBody(req): JsonBody<RegistryRequest>,
) -> ApiResult<Response> {
    let rx = st.daemon.pull_template(&name, req)?;
    Ok(streamed(rx, Framing::Ndjson))
}

#[utoipa::path(delete, path = "/templates/{name}", params(("name" = String, Path)),
    responses((status = 204), (status = 400, body = ApiErrorBody), (status = 404, body = ApiErrorBody)))]
pub(super) async fn template_delete(
    State(st): State<AppState>,
    Path(name): Path<String>,
) -> ApiResult<StatusCode> {
    st.daemon.delete_template(&name)?;
    Ok(StatusCode::NO_CONTENT)
}
