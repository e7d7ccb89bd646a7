//! `/sandboxes/{id}/network` and `/sandboxes/{id}/egress`: a sandbox's
//! egress policy (read, replaced) and the last records of its egress log.

use axum::extract::RawQuery;
use axum::Json;
use serde::{Deserialize, Serialize};
use utoipa::{IntoParams, ToSchema};

use super::error::{unexpected, ApiErrorBody, ApiResult};
use super::extract::{policy, query, JsonBody, OnSandbox};
use crate::core::SandboxId;
use crate::network::NetworkPolicy;
use crate::service::{Lifecycle, NetworkInfo, Reply};

/// The egress policy of a running or paused sandbox. `active: false`: a
/// sandbox without a network broker (re-adopted from state an older
/// daemon wrote), which opens no new connection.
#[utoipa::path(get, path = "/sandboxes/{id}/network", params(("id" = String, Path)),
    responses((status = 200, body = NetworkInfo), (status = 404, body = ApiErrorBody),
              (status = 409, body = ApiErrorBody)))]
pub(super) async fn network_get(
    OnSandbox { daemon, id }: OnSandbox,
) -> ApiResult<Json<NetworkInfo>> {
    network_reply(daemon.execute(Lifecycle::Network { id }).await?)
}

/// Replaces a running or paused sandbox's egress policy: new connections
/// and DNS lookups follow it, open connections stay. Answers the policy
/// in force, rules in normal form. A bad rule is a 400 naming it.
#[utoipa::path(post, path = "/sandboxes/{id}/network", params(("id" = String, Path)), request_body = NetworkPolicy,
    responses((status = 200, body = NetworkInfo), (status = 400, body = ApiErrorBody),
              (status = 404, body = ApiErrorBody), (status = 409, body = ApiErrorBody),
              (status = 502, body = ApiErrorBody)))]
pub(super) async fn network_set(
    OnSandbox { daemon, id }: OnSandbox,
    JsonBody(b): JsonBody<NetworkPolicy>,
) -> ApiResult<Json<NetworkInfo>> {
    let policy = policy(b)?;
    network_reply(daemon.execute(Lifecycle::SetNetwork { id, policy }).await?)
}

pub(super) fn network_reply(r: Reply) -> ApiResult<Json<NetworkInfo>> {
    match r {
        Reply::Network(n) => Ok(Json(n)),
        other => Err(unexpected(other)),
    }
}

/// Query of `GET /sandboxes/{id}/egress`.
#[derive(Debug, Deserialize, IntoParams)]
#[serde(deny_unknown_fields)]
pub(super) struct EgressQuery {
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
    /// resolve), `internal_address` (a private, shared, unique-local,
    /// cloud-platform or host address matched only by a name rule, `*` or
    /// a wider CIDR: see `rule` and `error`), `single_label_name` (never
    /// resolved), `broker_denied` (the host side's decision: see `error`).
    reason: String,
    /// The rule that decided, in normal form (for `internal_address`, the
    /// allow rule that did not open the address).
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
pub(super) async fn egress_log(
    OnSandbox { daemon, id }: OnSandbox,
    RawQuery(raw): RawQuery,
) -> ApiResult<Json<EgressLog>> {
    let q: EgressQuery = query(raw)?;
    let limit = q.limit.unwrap_or(1000).clamp(1, 100_000);
    let records = daemon.egress(&id, limit).await?;
    Ok(Json(EgressLog { records }))
}

#[cfg(test)]
mod tests {
    use crate::api::testing::*;

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
}
