"""End to end: port forwards (`get_host`) and background processes
(`commands.run(background=True)`, `CommandHandle`) against a real forkboxd
booting real microVMs. Only loopback addresses are used."""

from __future__ import annotations

import asyncio
import socket
from typing import List

import httpx
import pytest

from forkbox import (AsyncSandbox, CommandHandle, ConflictError, NotFoundError,
                     ProcessTimeoutError, Sandbox)


@pytest.fixture(scope="module")
def sb(daemon_url: str):
    with Sandbox.create("minimal", timeout=900, metadata={"suite": "ports"}) as s:
        yield s


def _get(url: str) -> httpx.Response:
    # No proxy from the environment: the forward is on this host's loopback.
    return httpx.get(url, trust_env=False, timeout=60)


def _serve_http(sb: Sandbox, port: int, body: str) -> CommandHandle:
    """A busybox httpd in the guest, in the background."""
    root = f"/tmp/www{port}"
    sb.files.write(f"{root}/index.html", body)
    return sb.commands.run(f"exec busybox httpd -f -p 127.0.0.1:{port} -h {root}",
                           background=True)


def test_get_host_reaches_a_guest_http_server(sb: Sandbox) -> None:
    server = _serve_http(sb, 8000, "hello from the guest\n")
    host = sb.get_host(8000, wait=30)
    assert host.startswith("127.0.0.2:")
    for _ in range(3):  # one connection each
        r = _get(f"http://{host}/index.html")
        assert r.status_code == 200
        assert r.text == "hello from the guest\n"
    # Opening it again answers the same forward; it is listed.
    assert sb.get_host(8000) == host
    assert sb.ports() == {8000: host}
    sb.close_port(8000)
    assert sb.ports() == {}
    with pytest.raises(httpx.TransportError):
        _get(f"http://{host}/index.html")
    assert server.kill()


def test_get_host_of_a_refusing_port_says_so(sb: Sandbox) -> None:
    with pytest.raises(ConflictError) as e:
        sb.get_host(8999)
    assert "guest port 8999 refused" in str(e.value)
    assert e.value.detail.get("guest_kind") == "connection_refused"
    assert not e.value.infrastructure


def test_forwards_close_when_the_sandbox_is_killed(daemon_url: str) -> None:
    with Sandbox.create("minimal", timeout=600, metadata={"suite": "ports-kill"}) as s:
        _serve_http(s, 8001, "bye\n")
        host = s.get_host(8001, wait=30)
        assert _get(f"http://{host}/index.html").text == "bye\n"
    hostname, port = host.rsplit(":", 1)
    with pytest.raises(OSError):
        socket.create_connection((hostname, int(port)), timeout=10).close()


def test_background_process_takes_stdin_and_waits(sb: Sandbox) -> None:
    h = sb.commands.run("read x; echo got:$x; echo err >&2; exit 3", background=True)
    assert h.pid > 1
    assert h.send_stdin("hi\n") == 3
    r = h.wait(timeout=60)
    assert (r.stdout, r.stderr, r.exit_code) == ("got:hi\n", "err\n", 3)
    listed = {p.pid: p for p in sb.commands.list()}
    info = listed[h.pid]
    assert info.background and not info.running
    assert info.result is not None and info.result.exit_code == 3


def test_background_wait_times_out_then_kill_ends_it(sb: Sandbox) -> None:
    h = sb.commands.run("sleep 300", background=True)
    with pytest.raises(ProcessTimeoutError):
        h.wait(timeout=0.5)
    assert any(p.pid == h.pid and p.running for p in sb.commands.list())
    assert h.kill()
    r = h.wait(timeout=60)
    assert r.exit_code is None and r.signal == 9
    assert h.kill() is False


def test_reattach_streams_output_so_far_then_as_it_comes(sb: Sandbox) -> None:
    h = sb.commands.run("echo early; read go; for i in 1 2; do echo line$i; sleep 0.2; done",
                        background=True)
    again = sb.commands.connect(h.pid)
    assert again.pid == h.pid
    out = again.output()
    assert out.running and out.result is None
    h.send_stdin("go\n", close=True)
    chunks: List[str] = []
    r = again.wait(on_stdout=chunks.append)
    assert "".join(chunks) == "early\nline1\nline2\n"
    assert r.exit_code == 0
    done = again.output()
    assert not done.running and done.stdout == "early\nline1\nline2\n"
    assert done.result is not None and done.result.exit_code == 0
    with pytest.raises(NotFoundError):
        sb.commands.connect(999999)


def test_async_background_process_and_get_host(daemon_url: str) -> None:
    async def main() -> None:
        async with await AsyncSandbox.create("minimal", timeout=600,
                                             metadata={"suite": "ports-async"}) as s:
            h = await s.commands.run("echo hi; sleep 0.2; echo bye", background=True)
            r = await h.wait(timeout=60)
            assert (r.stdout, r.exit_code) == ("hi\nbye\n", 0)
            with pytest.raises(ConflictError):
                await s.get_host(8998)
            assert await s.ports() == {}
    asyncio.run(main())
