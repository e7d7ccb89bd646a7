//! `/sandboxes/{id}/processes`: background processes: list, wait for
//! one, signal it, write its stdin, read (or follow) its output.

use axum::extract::RawQuery;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use forkbox_proto::OutputStream;
use serde::{Deserialize, Serialize};
use utoipa::{IntoParams, ToSchema};

use super::commands::{exit_output, ExecOutput};
use super::error::{report, ApiError, ApiErrorBody, ApiResult};
use super::extract::{optional_json, query, secs, OnProcess, OnSandbox, RawBody, UploadBody};
use super::stream::{output_event, relay, streamed, unexpected_end, Framing, StreamEvent};
use crate::service::{AttachEvent, ProcessEnded};

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

pub(super) fn process_json(p: forkbox_proto::ProcessInfo) -> ProcessJson {
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
pub(super) async fn process_list(
    OnSandbox { daemon, id }: OnSandbox,
) -> ApiResult<Json<Vec<ProcessJson>>> {
    let list = daemon.processes(&id).await?;
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
pub(super) async fn process_wait(
    OnProcess { daemon, id, pid }: OnProcess,
    RawBody(body): RawBody,
) -> ApiResult<Json<ExecOutput>> {
    let b: WaitBody = optional_json(&body)?;
    let timeout = secs(b.timeout_secs, "timeout_secs")?;
    let ended = daemon.wait_process(&id, pid, timeout).await?;
    match ended {
        None => Err(ApiError::Timeout(format!(
            "process {pid} still runs after {:.3} s",
            timeout.unwrap_or_default().as_secs_f64()
        ))),
        Some(ProcessEnded {
            result,
            stdout,
            stderr,
            dropped,
        }) => {
            let mut o = exit_output(
                &result,
                Some(String::from_utf8_lossy(&stdout).into_owned()),
                Some(String::from_utf8_lossy(&stderr).into_owned()),
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
pub(super) async fn process_kill(
    OnProcess { daemon, id, pid }: OnProcess,
    RawBody(body): RawBody,
) -> ApiResult<StatusCode> {
    let b: KillBody = optional_json(&body)?;
    let signal = b.signal.unwrap_or(libc::SIGKILL);
    daemon.kill_process(&id, pid, signal).await?;
    Ok(StatusCode::NO_CONTENT)
}

#[derive(Debug, Deserialize, IntoParams)]
#[serde(deny_unknown_fields)]
pub(super) struct StdinQuery {
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
pub(super) async fn process_stdin(
    OnProcess { daemon, id, pid }: OnProcess,
    RawQuery(raw): RawQuery,
    UploadBody(body): UploadBody,
) -> ApiResult<Json<StdinWritten>> {
    let q: StdinQuery = query(raw)?;
    let close = q.close.unwrap_or(false);
    let bytes = daemon.write_stdin(&id, pid, close, body).await?;
    Ok(Json(StdinWritten { bytes }))
}

#[derive(Debug, Deserialize, IntoParams)]
#[serde(deny_unknown_fields)]
pub(super) struct OutputQuery {
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
pub(super) async fn process_output(
    OnProcess { daemon, id, pid }: OnProcess,
    RawQuery(raw): RawQuery,
    headers: HeaderMap,
) -> ApiResult<Response> {
    let q: OutputQuery = query(raw)?;
    let framing = Framing::accepted(&headers, &[Framing::Ndjson]);
    let mut rx = daemon.attach(&id, pid, q.follow.unwrap_or(false))?;
    let Some(framing) = framing else {
        let (mut out, mut err) = (Vec::new(), Vec::new());
        while let Some(ev) = rx.recv().await {
            match ev {
                AttachEvent::Output(OutputStream::Stdout, b) => out.extend(b),
                AttachEvent::Output(OutputStream::Stderr, b) => err.extend(b),
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
    };
    let mut carry = [Vec::new(), Vec::new()];
    let events = relay(rx, move |ev| match ev {
        AttachEvent::Output(s, bytes) => Some(output_event(&mut carry, s, bytes)),
        AttachEvent::End {
            result: Some(r), ..
        } => Some(StreamEvent::Exit(exit_output(&r, None, None))),
        AttachEvent::End { result: None, .. } => None,
        AttachEvent::Failed(e) => Some(StreamEvent::Error {
            error: report(&daemon, &e.into()),
        }),
    });
    Ok(streamed(events, framing))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::testing::*;

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
}
