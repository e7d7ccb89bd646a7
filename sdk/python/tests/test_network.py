"""End to end: sandbox networks (egress policy, egress log) against a real
forkboxd booting real microVMs.

Every connection a guest makes goes to a server this test starts on the
host's 127.0.0.1, which guests reach as `host.forkbox.internal`
(10.0.2.2); no other destination is ever allowed. Every guest is
10.0.2.15, its gateway and DNS server 10.0.2.2."""

from __future__ import annotations

import asyncio
import json
import secrets
import socket
import threading
import time
import uuid
from typing import Any, Callable, Dict, Iterator, List, Optional

import pytest

from conftest import _forkboxd
from forkbox import (AsyncSandbox, ForkboxError, InvalidRequestError, Sandbox, Template)
from test_cli import forkbox

HOST = "host.forkbox.internal"
GATEWAY = "10.0.2.2"
GUEST = "10.0.2.15"

Record = Dict[str, Any]


class LineEcho:
    """A TCP server on 127.0.0.1: each connection's first line is echoed
    back, then the connection closes. Counts what it accepted."""

    def __init__(self) -> None:
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.bind(("127.0.0.1", 0))
        self._sock.listen(16)
        self.port: int = self._sock.getsockname()[1]
        self.lines: List[str] = []
        self.accepted = 0
        self._lock = threading.Lock()
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            with self._lock:
                self.accepted += 1
            with conn:
                conn.settimeout(30)
                data = b""
                try:
                    while not data.endswith(b"\n"):
                        chunk = conn.recv(4096)
                        if not chunk:
                            break
                        data += chunk
                    conn.sendall(data)
                except OSError:
                    pass
            with self._lock:
                self.lines.append(data.decode(errors="replace"))

    def close(self) -> None:
        self._sock.close()


@pytest.fixture(scope="module")
def echo() -> Iterator[LineEcho]:
    server = LineEcho()
    yield server
    server.close()


@pytest.fixture(scope="module")
def sb(daemon_url: str, echo: LineEcho) -> Iterator[Sandbox]:
    """A sandbox allowed to reach the echo server, and nothing else."""
    with Sandbox.create("minimal", timeout=900, metadata={"suite": "network"},
                        network={"allow_out": [f"{HOST}:{echo.port}"]}) as s:
        yield s


def logged_all(sb: Sandbox, what: str, pred: Callable[[List[Record]], bool],
               within: float = 30.0) -> List[Record]:
    """`sb`'s egress log once `pred` holds for it, waiting up to `within`
    seconds for the records to be written (a connection's when it
    closes)."""
    deadline = time.monotonic() + within
    while True:
        records = sb.network.egress_log()
        if pred(records):
            return records
        if time.monotonic() > deadline:
            pytest.fail(f"no {what} in the egress log of {sb.sandbox_id}: {records}")
        time.sleep(0.2)


def logged(sb: Sandbox, what: str, pred: Callable[[Record], bool]) -> Record:
    """The first record of `sb`'s egress log that `pred` picks (waiting
    for it as `logged_all`)."""
    records = logged_all(sb, what, lambda rs: any(pred(r) for r in rs))
    return next(r for r in records if pred(r))


def tcp_to(port: int) -> Callable[[Record], bool]:
    return lambda r: r.get("protocol") == "tcp" and r.get("port") == port


def send_line(sb: Sandbox, host: str, port: int, line: str) -> Any:
    """`echo LINE | nc HOST PORT` in the guest (busybox nc; `timeout` so a
    connection that hangs fails the test instead of stalling it)."""
    return sb.commands.run(f"echo {line} | timeout 30 nc {host} {port}", timeout=60)


def assert_refused(r: Any) -> None:
    """The connect failed at once with a reset: `Connection refused`,
    not a time-out (exit 124) or a name that did not resolve."""
    assert r.exit_code not in (0, 124), r
    assert "refused" in r.stderr.lower(), r


def test_network_allowed_host_port_reaches_loopback_server_and_is_logged(
        sb: Sandbox, echo: LineEcho) -> None:
    assert sb.network.get() == {"allow_out": [f"{HOST}:{echo.port}"], "deny_out": [],
                                "active": True}
    r = send_line(sb, HOST, echo.port, "hello-from-guest")
    assert (r.exit_code, r.stdout) == (0, "hello-from-guest\n"), r
    assert "hello-from-guest\n" in echo.lines
    conn = logged(sb, "allowed connection", tcp_to(echo.port))
    assert conn["verdict"] == "allow", conn
    assert conn["reason"] == "rule" and conn["rule"] == f"{HOST}:{echo.port}", conn
    assert conn["name"] == HOST and conn["address"] == GATEWAY, conn
    assert conn["sandbox"] == sb.sandbox_id
    # Written when the connection closed, with what it moved.
    assert (conn["bytes_out"], conn["bytes_in"]) == (17, 17), conn
    lookup = logged(sb, "lookup of host.forkbox.internal",
                    lambda r: r.get("protocol") == "dns" and r.get("name") == HOST)
    assert lookup["verdict"] == "allow", lookup


def test_network_loopback_port_off_the_allowlist_is_refused_and_logged(sb: Sandbox) -> None:
    other = LineEcho()
    try:
        r = send_line(sb, HOST, other.port, "should-not-arrive")
        assert_refused(r)
        rec = logged(sb, "denied connection", tcp_to(other.port))
        assert rec["verdict"] == "deny", rec
        assert rec["reason"] == "no_rule" and "rule" not in rec, rec
        assert rec["port"] == other.port
        assert other.accepted == 0, "the server off the allowlist was reached"
    finally:
        other.close()


def test_network_denied_name_gets_nxdomain_and_is_logged(sb: Sandbox) -> None:
    name = f"denied-{uuid.uuid4().hex[:8]}.forkbox.test"
    r = sb.commands.run(f"nslookup {name}", timeout=60)
    assert r.exit_code != 0, r
    assert "NXDOMAIN" in r.stdout + r.stderr, r
    # A connection by that name never gets an address to connect to.
    r = sb.commands.run(f"echo x | timeout 30 nc {name} 80", timeout=60)
    assert r.exit_code not in (0, 124), r
    rec = logged(sb, "denied DNS question",
                 lambda r: r.get("protocol") == "dns" and r.get("name") == name)
    assert rec["verdict"] == "deny" and rec["reason"] == "no_rule", rec
    assert not any(tcp_to(80)(r) for r in sb.network.egress_log())


def test_network_update_opens_then_closes_new_connections_log_outlives_kill(
        daemon_url: str, echo: LineEcho) -> None:
    s = Sandbox.create("minimal", timeout=900, metadata={"suite": "network-update"})
    try:
        assert s.network.get() == {"allow_out": [], "deny_out": [], "active": True}
        assert_refused(send_line(s, GATEWAY, echo.port, "before-update"))

        rule = f"{HOST}:{echo.port}"
        assert s.network.update(allow_out=[rule]) == {
            "allow_out": [rule], "deny_out": [], "active": True}
        r = send_line(s, GATEWAY, echo.port, "while-allowed")
        assert (r.exit_code, r.stdout) == (0, "while-allowed\n"), r

        # A dict (as `get` answers it) replaces the whole policy too: a
        # deny rule wins over the allow rule. Rules come back in normal
        # form (any port: no port).
        policy = s.network.get()
        policy["deny_out"] = [f"{HOST}:*"]
        assert s.network.update(policy)["deny_out"] == [HOST]
        assert_refused(send_line(s, GATEWAY, echo.port, "denied-by-rule"))
        rec = logged(s, "connection a deny rule refused",
                     lambda r: tcp_to(echo.port)(r) and r.get("rule") == HOST)
        assert rec["verdict"] == "deny" and rec["reason"] == "rule", rec

        # Nothing given: deny all again.
        assert s.network.update() == {"allow_out": [], "deny_out": [], "active": True}
        assert_refused(send_line(s, GATEWAY, echo.port, "after-update"))
        assert "while-allowed\n" in echo.lines
        assert not {"before-update\n", "denied-by-rule\n", "after-update\n"} & set(echo.lines)
        # One record per attempt (an allowed one when it closes).
        logged_all(s, "all four attempts", lambda rs: len(
            [r for r in rs if tcp_to(echo.port)(r)]) == 4)
    finally:
        assert s.kill()
    # The log of a dead sandbox stays readable.
    after = s.network.egress_log()
    mine = sorted(r["verdict"] for r in after if tcp_to(echo.port)(r))
    assert mine == ["allow", "deny", "deny", "deny"], after
    assert all(r["sandbox"] == s.sandbox_id for r in after)
    assert len(s.network.egress_log(limit=1)) == 1


def _listening(sb: Sandbox, port: int) -> None:
    """Waits until something in `sb` listens on TCP `port` (IPv4 or
    dual-stack IPv6, as busybox nc does)."""
    r = sb.commands.run(
        f"for i in $(seq 100); do grep -q ':{port:04X} 0*:0000 0A' /proc/net/tcp "
        "/proc/net/tcp6 && exit 0; sleep 0.1; done; cat /proc/net/tcp /proc/net/tcp6; exit 1",
        timeout=60)
    assert r.exit_code == 0, f"nothing listens on guest port {port}: {r}"


def test_network_sandboxes_cannot_reach_each_other(daemon_url: str) -> None:
    port = 7070
    with Sandbox.create("minimal", timeout=900, metadata={"suite": "network-a"}) as a, \
            Sandbox.create("minimal", timeout=900, metadata={"suite": "network-b"}) as b:
        for s in (a, b):
            r = s.commands.run("ip -4 addr show dev eth0")
            assert f"inet {GUEST}/24" in r.stdout, r
        server = a.commands.run(f"nc -l -p {port}", background=True)
        _listening(a, port)

        # B's 10.0.2.15 is B itself, where nothing listens: B's own
        # kernel refuses, and nothing leaves B.
        assert_refused(send_line(b, GUEST, port, "b-to-own-address"))
        # The host side of the gateway is the host's loopback, which B
        # may not reach: the gateway refuses, and logs it.
        assert_refused(send_line(b, GATEWAY, port, "b-to-gateway"))
        rec = logged(b, "B's attempt through the gateway", tcp_to(port))
        assert rec["verdict"] == "deny" and rec["name"] == HOST, rec
        assert not any(r.get("address") == GUEST for r in b.network.egress_log())

        # A's server saw nothing; it does work, from inside A.
        out = server.output()
        assert out.running and out.stdout == "", out
        r = send_line(a, "127.0.0.1", port, "a-to-itself")
        assert r.exit_code == 0, r
        assert server.wait(timeout=60).stdout == "a-to-itself\n"


@pytest.fixture
def tcp_daemon(monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """A second forkboxd listening on TCP 127.0.0.1 (which needs a
    token); its URL. FORKBOX_TOKEN is set meanwhile, so the SDK's client
    for it (made on first use) sends the token."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    token = secrets.token_hex(16)
    monkeypatch.setenv("FORKBOX_TOKEN", token)
    with _forkboxd(4, tcp_port=port, token=token) as url:
        yield url


def test_network_daemon_api_port_is_refused_unless_allowed(tcp_daemon: str) -> None:
    port = int(tcp_daemon.rsplit(":", 1)[1])
    with Sandbox.create("minimal", timeout=600, url=tcp_daemon) as s:
        health = f"timeout 30 wget -q -O - http://{HOST}:{port}/health"
        r = s.commands.run(f"timeout 30 wget -q -O - http://{GATEWAY}:{port}/health",
                           timeout=60)
        assert_refused(r)
        rec = logged(s, "refused connection to the daemon's port", tcp_to(port))
        assert rec["verdict"] == "deny", rec
        # Not even its name resolves while no rule names it.
        r = s.commands.run(health, timeout=60)
        assert r.exit_code != 0 and r.stdout == "", r

        s.network.update(allow_out=[f"{HOST}:{port}"])
        r = s.commands.run(health, timeout=60)
        assert r.exit_code == 0, r
        assert json.loads(r.stdout)["status"] == "ok"


def test_network_bad_rule_raises_invalid_request(sb: Sandbox, echo: LineEcho) -> None:
    with pytest.raises(InvalidRequestError) as e:
        Sandbox.create("minimal", timeout=60,
                       network={"allow_out": [f"{HOST}:{echo.port}", "x:99999"]})
    assert 'allow_out[1] "x:99999"' in str(e.value), e.value
    assert e.value.status == 400 and not e.value.infrastructure
    # host.forkbox.internal without a port would open the host's whole loopback.
    with pytest.raises(InvalidRequestError) as e:
        Sandbox.create("minimal", timeout=60, network={"allow_out": [HOST]})
    assert "exactly one port" in str(e.value), e.value
    before = sb.network.get()
    with pytest.raises(InvalidRequestError) as e:
        sb.network.update(allow_out=[f"{HOST}:{echo.port}"], deny_out=["10.1.2.3/16"])
    assert "deny_out[0]" in str(e.value), e.value
    with pytest.raises(InvalidRequestError):
        sb.network.update({"allow": [HOST]})
    with pytest.raises(TypeError):
        sb.network.update(allow_out=HOST)  # type: ignore[arg-type]
    assert sb.network.get() == before


def test_network_fork_inherits_the_policy_then_has_its_own(sb: Sandbox,
                                                           echo: LineEcho) -> None:
    kids = sb.fork(count=1)
    kid = kids[0]
    assert isinstance(kid, Sandbox), kid
    try:
        assert kid.network.get() == sb.network.get()
        r = send_line(kid, HOST, echo.port, "from-child")
        assert (r.exit_code, r.stdout) == (0, "from-child\n"), r
        rec = logged(kid, "the child's connection", tcp_to(echo.port))
        assert rec["verdict"] == "allow" and rec["sandbox"] == kid.sandbox_id, rec
        # Its policy is its own from then on.
        kid.network.update(deny_out=["*"])
        assert_refused(send_line(kid, GATEWAY, echo.port, "child-denied"))
        assert sb.network.get()["allow_out"] == [f"{HOST}:{echo.port}"]
    finally:
        kid.kill()


def test_network_rollout_group_and_gym_env_take_a_policy(daemon_url: str,
                                                         echo: LineEcho) -> None:
    from forkbox import rollouts
    from forkbox.gym import SandboxEnv
    policy = {"allow_out": [f"{HOST}:{echo.port}"]}

    def reach(child: Sandbox) -> Any:
        return send_line(child, HOST, echo.port, "from-group").stdout

    assert rollouts.group("minimal", 2, reach, network=policy) == ["from-group\n"] * 2
    env = SandboxEnv("minimal", network=policy)
    try:
        env.reset()
        assert env.sandbox is not None
        assert env.sandbox.network.get()["allow_out"] == policy["allow_out"]
        # The default stays nothing reachable.
        env.network = None
        env.reset()
        assert env.sandbox.network.get()["allow_out"] == []
    finally:
        env.close()


def test_network_template_policy_holds_only_while_it_bakes(daemon_url: str,
                                                           echo: LineEcho) -> None:
    name = f"net-{uuid.uuid4().hex[:8]}"
    rule = f"{HOST}:{echo.port}"
    try:
        Template.build(name, setup=[f"echo from-bake | timeout 30 nc {HOST} {echo.port}"],
                       network={"allow_out": [rule]})
        assert "from-bake\n" in echo.lines
        with Sandbox.create(name, timeout=600) as s:
            assert s.network.get()["allow_out"] == []
            assert_refused(send_line(s, GATEWAY, echo.port, "from-template-sandbox"))
    finally:
        try:
            Template.delete(name)
        except ForkboxError:
            pass


def test_async_network_create_update_and_log(daemon_url: str, echo: LineEcho) -> None:
    async def main() -> None:
        rule = f"{HOST}:{echo.port}"
        async with await AsyncSandbox.create("minimal", timeout=600,
                                             network={"allow_out": [rule]}) as s:
            assert (await s.network.get())["allow_out"] == [rule]
            r = await s.commands.run(f"echo async-line | timeout 30 nc {GATEWAY} {echo.port}")
            assert r.stdout == "async-line\n", r
            assert await s.network.update(deny_out=[rule]) == {
                "allow_out": [], "deny_out": [rule], "active": True}
            records: List[Record] = []
            for _ in range(150):
                records = await s.network.egress_log(limit=10)
                if any(tcp_to(echo.port)(x) for x in records):
                    break
                await asyncio.sleep(0.2)
            assert any(tcp_to(echo.port)(x) and x["verdict"] == "allow" for x in records)
    asyncio.run(main())


def _cli_egress(sid: str, *args: str) -> List[Record]:
    out = forkbox("sandbox", "egress", sid, "--json", *args).stdout
    return [json.loads(line) for line in out.splitlines()]


def test_cli_sandbox_network_and_egress(daemon_url: str, echo: LineEcho) -> None:
    rule = f"{HOST}:{echo.port}"
    other = LineEcho()
    sid = json.loads(forkbox("sandbox", "create", "minimal", "--timeout", "600",
                             "--allow-out", rule, "--json").stdout)["id"]
    try:
        policy = json.loads(forkbox("sandbox", "network", sid, "--json").stdout)
        assert policy == {"allow_out": [rule], "deny_out": [], "active": True}
        assert forkbox("sandbox", "network", sid).stdout.splitlines() == [f"allow  {rule}"]
        p = forkbox("exec", sid, "--", "sh", "-c",
                    f"echo cli-line | timeout 30 nc {GATEWAY} {echo.port}")
        assert p.stdout == "cli-line\n"
        p = forkbox("exec", sid, "--", "sh", "-c",
                    f"echo x | timeout 30 nc {GATEWAY} {other.port}", check=False)
        assert p.returncode not in (0, 124, 125) and "refused" in p.stderr.lower(), p

        deadline = time.monotonic() + 30
        while not any(tcp_to(echo.port)(r) for r in _cli_egress(sid)):
            assert time.monotonic() < deadline, _cli_egress(sid)
            time.sleep(0.2)
        got = _cli_egress(sid)
        assert any(tcp_to(echo.port)(r) and r["verdict"] == "allow" for r in got), got
        assert any(tcp_to(other.port)(r) and r["verdict"] == "deny" for r in got), got
        assert all(r["sandbox"] == sid for r in got), got
        assert len(_cli_egress(sid, "--limit", "1")) == 1
        table = forkbox("sandbox", "egress", sid).stdout.splitlines()
        assert table[0].split() == ["TIME(UTC)", "PROTO", "DESTINATION", "VERDICT", "REASON",
                                    "OUT/IN", "DURATION"]
        assert any(f"{HOST}:{other.port}" in line and " deny " in line and "no_rule" in line
                   for line in table), table
        assert any(f"{HOST}:{echo.port}" in line and f"rule {rule}" in line and "9/9" in line
                   for line in table), table

        denied = json.loads(forkbox("sandbox", "network", sid, "--deny-all", "--json").stdout)
        assert (denied["allow_out"], denied["deny_out"]) == ([], [])
        assert forkbox("sandbox", "network", sid).stdout.splitlines() == [
            "deny all (no allow rules)"]
        p = forkbox("sandbox", "network", sid, "--allow-out", "x:99999", check=False)
        assert p.returncode == 2 and "99999" in p.stderr, p
    finally:
        other.close()
        forkbox("sandbox", "kill", sid, check=False)
