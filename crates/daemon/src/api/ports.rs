//! `/sandboxes/{id}/ports`: port forwards: open one (a host listener
//! relayed to a guest port), list them, close one.

use axum::extract::Path;
use axum::http::StatusCode;
use axum::Json;
use serde::Deserialize;
use utoipa::ToSchema;

use super::error::{ApiError, ApiErrorBody, ApiResult};
use super::extract::{secs, JsonBody, OnSandbox};
use crate::service::PortForwardInfo;

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
/// `127.0.0.2:NNNNN` of the host (never `127.0.0.1`, where sandboxes'
/// `host.forkbox.internal` rules go) and relays each connection to the guest
/// port through the guest agent (no guest network needed). Opening an
/// open port answers the same forward. A guest port that refuses: 409,
/// kind `guest`, `guest_kind` `connection_refused`; later connections it
/// refuses are reset. Every forward closes when the sandbox dies.
#[utoipa::path(post, path = "/sandboxes/{id}/ports", params(("id" = String, Path)), request_body = PortBody,
    responses((status = 200, body = PortForwardInfo), (status = 404, body = ApiErrorBody),
              (status = 409, body = ApiErrorBody), (status = 502, body = ApiErrorBody)))]
pub(super) async fn port_open(
    OnSandbox { daemon, id }: OnSandbox,
    JsonBody(b): JsonBody<PortBody>,
) -> ApiResult<Json<PortForwardInfo>> {
    let wait = secs(b.wait_secs, "wait_secs")?.unwrap_or_default();
    let check = b.check.unwrap_or(true);
    Ok(Json(daemon.open_port(&id, b.port, check, wait).await?))
}

/// The sandbox's open port forwards.
#[utoipa::path(get, path = "/sandboxes/{id}/ports", params(("id" = String, Path)),
    responses((status = 200, body = [PortForwardInfo]), (status = 404, body = ApiErrorBody)))]
pub(super) async fn ports_list(
    OnSandbox { daemon, id }: OnSandbox,
) -> ApiResult<Json<Vec<PortForwardInfo>>> {
    Ok(Json(daemon.ports(&id)?))
}

/// Closes a port forward and its connections.
#[utoipa::path(delete, path = "/sandboxes/{id}/ports/{port}",
    params(("id" = String, Path), ("port" = u16, Path)),
    responses((status = 204), (status = 404, body = ApiErrorBody)))]
pub(super) async fn port_close(
    OnSandbox { daemon, id }: OnSandbox,
    Path((_, port)): Path<(String, String)>,
) -> ApiResult<StatusCode> {
    let port: u16 = port
        .parse()
        .map_err(|_| ApiError::BadRequest(format!("port {port:?}: expected 1-65535")))?;
    if daemon.close_port(&id, port)? {
        Ok(StatusCode::NO_CONTENT)
    } else {
        Err(ApiError::NotFound(format!(
            "no forward of guest port {port}"
        )))
    }
}

#[cfg(test)]
mod tests {
    use crate::api::testing::*;
    use forkbox_proto::{AgentError, ErrorKind as GuestKind};

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
        assert!(host.starts_with("127.0.0.2:"), "{host}");
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
}
