//! `/sandboxes/{id}/files`: guest files: read, write, remove, list,
//! stat, mkdir, and directories as tar archives.

use axum::body::Bytes;
use axum::extract::RawQuery;
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::{Deserialize, Serialize};
use utoipa::{IntoParams, ToSchema};

use super::error::{ApiError, ApiErrorBody, ApiResult};
use super::extract::{query, OnSandbox};

#[derive(Debug, Deserialize, IntoParams)]
#[serde(deny_unknown_fields)]
pub(super) struct PathQuery {
    /// An absolute guest path.
    path: String,
}

#[derive(Debug, Deserialize, IntoParams)]
#[serde(deny_unknown_fields)]
pub(super) struct WriteQuery {
    path: String,
    /// Permission bits in octal (default 644).
    mode: Option<String>,
}

#[derive(Debug, Deserialize, IntoParams)]
#[serde(deny_unknown_fields)]
pub(super) struct RemoveQuery {
    path: String,
    /// Remove a whole tree.
    recursive: Option<bool>,
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

/// Reads a guest file (raw bytes).
#[utoipa::path(get, path = "/sandboxes/{id}/files", params(("id" = String, Path), PathQuery),
    responses((status = 200, content_type = "application/octet-stream", description = "the file's bytes"),
              (status = 404, body = ApiErrorBody)))]
pub(super) async fn file_read(
    OnSandbox { daemon, id }: OnSandbox,
    RawQuery(raw): RawQuery,
) -> ApiResult<Response> {
    let q: PathQuery = query(raw)?;
    let path = guest_path(q.path)?;
    let data = daemon.read_file(&id, path).await?;
    Ok(([(header::CONTENT_TYPE, "application/octet-stream")], data).into_response())
}

/// Writes a guest file from the raw request body, creating parent
/// directories.
#[utoipa::path(put, path = "/sandboxes/{id}/files", params(("id" = String, Path), WriteQuery),
    request_body(content = Vec<u8>, content_type = "application/octet-stream"),
    responses((status = 200, body = Written), (status = 400, body = ApiErrorBody)))]
pub(super) async fn file_write(
    OnSandbox { daemon, id }: OnSandbox,
    RawQuery(raw): RawQuery,
    body: Bytes,
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
    let bytes = daemon.write_file(&id, path.clone(), mode, body).await?;
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
    daemon.remove_path(&id, path, recursive).await?;
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
    let entries = daemon.list_dir(&id, path.clone()).await?;
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
    Ok(Json(stat_json(&daemon.stat(&id, path).await?)))
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
    daemon.mkdir(&id, path).await?;
    Ok(StatusCode::NO_CONTENT)
}

/// Downloads a guest directory as a tar archive.
#[utoipa::path(get, path = "/sandboxes/{id}/files/tar", params(("id" = String, Path), PathQuery),
    responses((status = 200, content_type = "application/x-tar", description = "the archive"), (status = 404, body = ApiErrorBody)))]
pub(super) async fn tar_download(
    OnSandbox { daemon, id }: OnSandbox,
    RawQuery(raw): RawQuery,
) -> ApiResult<Response> {
    let q: PathQuery = query(raw)?;
    let path = guest_path(q.path)?;
    let data = daemon.download_tar(&id, path).await?;
    Ok(([(header::CONTENT_TYPE, "application/x-tar")], data).into_response())
}

/// Unpacks a tar archive (the request body) into a guest directory.
#[utoipa::path(put, path = "/sandboxes/{id}/files/tar", params(("id" = String, Path), PathQuery),
    request_body(content = Vec<u8>, content_type = "application/x-tar"),
    responses((status = 200, body = Written), (status = 400, body = ApiErrorBody)))]
pub(super) async fn tar_upload(
    OnSandbox { daemon, id }: OnSandbox,
    RawQuery(raw): RawQuery,
    body: Bytes,
) -> ApiResult<Json<Written>> {
    let q: PathQuery = query(raw)?;
    let path = guest_path(q.path)?;
    let bytes = daemon.upload_tar(&id, path.clone(), body).await?;
    Ok(Json(Written { path, bytes }))
}
