//! `POST /sandboxes/{id}/commands`: runs a command, its answer buffered,
//! streamed (NDJSON or SSE) or, in the background, its pid at once.

use std::collections::BTreeMap;

use axum::http::HeaderMap;
use axum::response::{IntoResponse, Response};
use axum::Json;
use forkbox_proto::{ExecRequest, ExecResult, ExitStatus, OutputStream, User};
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use super::error::{report, ApiError, ApiErrorBody, ApiResult};
use super::extract::{secs, JsonBody, OnSandbox};
use super::stream::{output_event, relay, streamed, unexpected_end, Framing, StreamEvent};
use crate::service::{Bounds, ExecEvent};

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
    /// A user name or a numeric uid; default the image's unprivileged user
    /// (`user` in the built-in images; a stored image's `User` unless
    /// root, else uid 1000; `root` must be asked for).
    #[serde(default)]
    pub user: Option<String>,
    /// Wall-clock limit in seconds; on expiry the process group is killed
    /// and `timed_out` is true. At most the daemon's `--max-exec-secs`
    /// (a day by default), which is also the timeout of a command given
    /// none (a background one gets none).
    #[serde(default)]
    pub timeout_secs: Option<f64>,
    /// Bytes given to the command's standard input (UTF-8 text).
    #[serde(default)]
    pub stdin: Option<String>,
    /// Per-stream output cap in bytes (buffered form default: 16 MiB, at
    /// most 256 MiB; the daemon holds the buffered answer).
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

const DEFAULT_BUFFERED_CAP: u64 = 16 << 20;
/// Largest `output_cap` of a buffered command (per stream).
const MAX_BUFFERED_CAP: u64 = 256 << 20;

/// The user a request's `user` field names (`None`: root, asked for as
/// `root` or `0`); absent: `default`, the sandbox's
/// (`Daemon::default_user`: its image's unprivileged user).
pub(super) fn acting_user(default: User, named: Option<String>) -> Option<User> {
    let Some(named) = named else {
        return Some(default);
    };
    match named.parse::<u32>() {
        Ok(0) => None,
        Ok(uid) => Some(User::Uid(uid)),
        Err(_) if named == "root" => None,
        Err(_) => Some(User::Name(named)),
    }
}

pub(super) fn exec_request(
    b: ExecBody,
    buffered: bool,
    bounds: &Bounds,
    default_user: User,
) -> ApiResult<(ExecRequest, Option<Vec<u8>>)> {
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
    req.user = acting_user(default_user, b.user);
    req.timeout = secs(b.timeout_secs, "timeout_secs")?;
    if let Some(t) = req.timeout.filter(|t| *t > bounds.max_exec) {
        return Err(ApiError::BadRequest(format!(
            "timeout_secs {}: over the daemon's limit of {} s (forkboxd --max-exec-secs)",
            t.as_secs_f64(),
            bounds.max_exec.as_secs()
        )));
    }
    if let Some(cap) = b.output_cap.filter(|c| buffered && *c > MAX_BUFFERED_CAP) {
        return Err(ApiError::BadRequest(format!(
            "output_cap {cap}: a buffered answer holds at most {MAX_BUFFERED_CAP} bytes per \
             stream; stream the output (Accept: application/x-ndjson) for more"
        )));
    }
    req.output_cap = b.output_cap.or(buffered.then_some(DEFAULT_BUFFERED_CAP));
    Ok((req, b.stdin.map(String::into_bytes)))
}

pub(super) fn exit_output(
    r: &ExecResult,
    stdout: Option<String>,
    stderr: Option<String>,
) -> ExecOutput {
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
pub(super) async fn command_run(
    OnSandbox { daemon, id }: OnSandbox,
    headers: HeaderMap,
    JsonBody(b): JsonBody<ExecBody>,
) -> ApiResult<Response> {
    let framing = Framing::accepted(&headers, &[Framing::Ndjson, Framing::Sse]);
    if b.background {
        let (req, stdin) = exec_request(b, false, daemon.bounds(), daemon.default_user(&id))?;
        let pid = daemon.spawn_process(&id, req, stdin).await?;
        return Ok(Json(ProcessStarted { pid }).into_response());
    }
    let default_user = daemon.default_user(&id);
    let (req, stdin) = exec_request(b, framing.is_none(), daemon.bounds(), default_user)?;
    let cap = req.output_cap.unwrap_or(DEFAULT_BUFFERED_CAP);
    let mut rx = daemon.exec(&id, req, stdin)?;
    let Some(framing) = framing else {
        // The agent caps the output; the daemon does not trust it to.
        let (mut out, mut err) = (Capped::new(cap), Capped::new(cap));
        while let Some(ev) = rx.recv().await {
            match ev {
                ExecEvent::Output(OutputStream::Stdout, b) => out.push(&b),
                ExecEvent::Output(OutputStream::Stderr, b) => err.push(&b),
                ExecEvent::Exit(r) => {
                    let mut o = exit_output(&r, Some(out.text()), Some(err.text()));
                    o.stdout_truncated |= out.cut;
                    o.stderr_truncated |= err.cut;
                    return Ok(Json(o).into_response());
                }
                ExecEvent::Failed(e) => return Err(e.into()),
            }
        }
        return Err(unexpected_end());
    };
    let mut carry = [Vec::new(), Vec::new()];
    let events = relay(rx, move |ev| {
        Some(match ev {
            ExecEvent::Output(s, bytes) => output_event(&mut carry, s, bytes),
            ExecEvent::Exit(r) => StreamEvent::Exit(exit_output(&r, None, None)),
            ExecEvent::Failed(e) => StreamEvent::Error {
                error: report(&daemon, &e.into()),
            },
        })
    });
    Ok(streamed(events, framing))
}

/// A buffered stream's output, at most `cap` bytes of it.
struct Capped {
    bytes: Vec<u8>,
    cap: usize,
    /// Bytes were dropped at the cap.
    cut: bool,
}

impl Capped {
    fn new(cap: u64) -> Self {
        Self {
            bytes: Vec::new(),
            cap: usize::try_from(cap).unwrap_or(usize::MAX),
            cut: false,
        }
    }

    fn push(&mut self, b: &[u8]) {
        let room = self.cap.saturating_sub(self.bytes.len());
        self.cut |= b.len() > room;
        self.bytes.extend_from_slice(&b[..b.len().min(room)]);
    }

    fn text(&self) -> String {
        String::from_utf8_lossy(&self.bytes).into_owned()
    }
}

#[cfg(test)]
mod tests {
    use crate::api::testing::*;

    /// A guest that takes the command and never answers: the call ends
    /// at the command's timeout plus the margin, as the guest's fault.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn exec_the_guest_never_answers_ends_at_its_deadline_as_504() {
        use std::io::Read;
        let dir = tempfile::tempdir().expect("tempdir");
        let sock = scripted_agent(dir.path(), |conn, req| {
            let forkbox_proto::Request::Exec { exec, .. } = req else {
                panic!("{req:?}")
            };
            assert_eq!(exec.timeout, Some(std::time::Duration::from_millis(100)));
            let _ = conn.read(&mut [0u8; 1]);
        });
        let bounds = crate::service::Bounds {
            exec_margin: std::time::Duration::from_millis(100),
            ..Default::default()
        };
        let app = app_with_agent_and(Some(sock), bounds);
        let id = sandbox(&app).await;
        let (st, err) = call(
            &app,
            "POST",
            &format!("/sandboxes/{id}/commands"),
            r#"{"cmd":"sleep 100","timeout_secs":0.1}"#,
        )
        .await;
        assert_eq!(st, StatusCode::GATEWAY_TIMEOUT, "{err}");
        assert_eq!(err["error"]["kind"], "guest_timeout");
        assert_eq!(err["error"]["infrastructure"], false);
    }

    /// A command without a timeout gets the daemon's longest.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn exec_without_a_timeout_gets_the_daemon_s_max_exec() {
        let dir = tempfile::tempdir().expect("tempdir");
        let sock = scripted_agent(dir.path(), |conn, req| {
            let forkbox_proto::Request::Exec { exec, .. } = req else {
                panic!("{req:?}")
            };
            let result = forkbox_proto::ExecResult {
                status: forkbox_proto::ExitStatus::Code(
                    exec.timeout.map_or(0, |t| t.as_secs() as i32),
                ),
                timed_out: false,
                duration: std::time::Duration::ZERO,
                stdout: Default::default(),
                stderr: Default::default(),
            };
            let r = forkbox_proto::Response::Exec { result };
            let _ = forkbox_proto::frame::write_frame(
                conn,
                forkbox_proto::FrameKind::Control,
                &forkbox_proto::encode_control(&r),
            );
        });
        let bounds = crate::service::Bounds {
            max_exec: std::time::Duration::from_secs(77),
            ..Default::default()
        };
        let app = app_with_agent_and(Some(sock), bounds);
        let id = sandbox(&app).await;
        let (st, out) = call(
            &app,
            "POST",
            &format!("/sandboxes/{id}/commands"),
            r#"{"cmd":"true"}"#,
        )
        .await;
        assert_eq!(st, StatusCode::OK, "{out}");
        assert_eq!(out["exit_code"], 77, "{out}");
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
    async fn exec_on_a_lost_vm_is_502_and_the_sandbox_is_dead_with_vm_lost() {
        let fake = Fake::default();
        let world = fake.world.clone();
        let d = Daemon::new(Arc::new(fake), Config::default()).expect("daemon");
        let app = router(d, None);
        let (_, info) = call(&app, "POST", "/sandboxes", r#"{"template":"minimal"}"#).await;
        let id = info["id"].as_str().expect("id").to_owned();
        world.lose_last("the VMM died (signal 9)");
        let (st, err) = call(
            &app,
            "POST",
            &format!("/sandboxes/{id}/commands"),
            r#"{"cmd":"true"}"#,
        )
        .await;
        assert_eq!(st, StatusCode::BAD_GATEWAY, "{err}");
        assert_eq!(err["error"]["kind"], "infrastructure");
        assert_eq!(err["error"]["infrastructure"], true);
        let msg = err["error"]["message"].as_str().unwrap_or_default();
        assert!(msg.contains(&format!("sandbox {id} died")), "{msg}");
        let (st, info) = call(&app, "GET", &format!("/sandboxes/{id}"), "").await;
        assert_eq!(st, StatusCode::OK);
        assert_eq!(info["state"], "dead");
        assert_eq!(
            info["death"],
            serde_json::json!({"vm_lost": {"reason": "the VMM died (signal 9)"}})
        );
        // Dead now: a second command is refused as the caller's mistake.
        let (st, err) = call(
            &app,
            "POST",
            &format!("/sandboxes/{id}/commands"),
            r#"{"cmd":"true"}"#,
        )
        .await;
        assert_eq!(st, StatusCode::CONFLICT, "{err}");
        assert_eq!(err["error"]["infrastructure"], false);
    }
}
