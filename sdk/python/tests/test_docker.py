"""Docker inside a sandbox, against a real forkboxd: the built-in `docker`
template's `dockerd` is warm in every sandbox, `docker-compose` brings up
two services that talk to each other, the sandbox's egress policy holds for
its containers, and a fork carries the running containers into both
children."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Iterator, List

import pytest

from forkbox import Sandbox
from test_network import LineEcho

HOST = "host.forkbox.internal"
GATEWAY = "10.0.2.2"

COMPOSE = """\
version: "2.4"
services:
  web:
    image: bb:1
    command: ["sh", "-c", "mkdir -p /www && echo hello from web > /www/index.html && httpd -f -p 8080 -h /www"]
  client:
    image: bb:1
    depends_on: [web]
    volumes: ["/tmp/out:/out"]
    command: ["sh", "-c", "until wget -q -O /out/got http://web:8080/; do sleep 1; done; sleep 100000"]
"""


def _busybox() -> bytes:
    """busybox-static from forkbox's cache (the `minimal` image's)."""
    cache = Path(os.environ.get("FORKBOX_CACHE") or Path.home() / ".cache" / "forkbox")
    return (cache / "debs" / "busybox-static" / "bin" / "busybox").read_bytes()


@pytest.fixture(scope="module")
def servers() -> Iterator[List[LineEcho]]:
    """Two line-echo servers on this host's loopback: the policy opens the
    first only."""
    both = [LineEcho(), LineEcho()]
    yield both
    for s in both:
        s.close()


def _wait(sb: Sandbox, cmd: str, within: float = 300) -> str:
    deadline = time.monotonic() + within
    while True:
        r = sb.commands.run(cmd, timeout=120)
        if r.exit_code == 0:
            return r.stdout
        if time.monotonic() > deadline:
            pytest.fail(f"`{cmd}` did not succeed within {within} s: {r.stdout} {r.stderr}")
        time.sleep(2)


def test_docker_template_composes_keeps_egress_policy_and_forks_with_containers(
        daemon_url: str, servers: List[LineEcho]) -> None:
    allowed, denied = servers
    with Sandbox.create("docker", timeout=1800,
                        network={"allow_out": [f"{HOST}:{allowed.port}"]}) as sb:
        # dockerd was started before the zygote was made: no wait here.
        info = sb.commands.run("docker info --format '{{.Driver}} {{.ServerVersion}}'")
        assert info.exit_code == 0, info.stderr
        assert info.stdout.startswith("overlay2 "), info.stdout
        sb.files.write("/tmp/bb/bin/busybox", _busybox(), mode=0o755)
        imported = sb.commands.run(
            "cd /tmp/bb && "
            "for a in sh echo cat httpd wget sleep mkdir nc; do ln -s busybox bin/$a; done && "
            "tar -C /tmp/bb -c . | docker import - bb:1", timeout=300)
        assert imported.exit_code == 0, imported.stderr
        # Two services by name on their own network.
        sb.files.write("/tmp/app/docker-compose.yml", COMPOSE)
        sb.commands.run("mkdir -p /tmp/out && chmod 777 /tmp/out")
        up = sb.commands.run("cd /tmp/app && docker-compose up -d", timeout=600)
        assert up.exit_code == 0, up.stderr
        assert _wait(sb, "cat /tmp/out/got") == "hello from web\n"
        # The sandbox's policy holds for its containers: allowed, denied.
        # By the gateway's address, which host.forkbox.internal names, with
        # nc (busybox-static's wget segfaulted on Docker's default bridge).
        ask = "docker run --rm bb:1 sh -c 'echo from-a-container | nc -w 20 {} {}'"
        ok = sb.commands.run(ask.format(GATEWAY, allowed.port), timeout=300)
        assert (ok.exit_code, ok.stdout) == (0, "from-a-container\n"), (ok.stdout, ok.stderr)
        no = sb.commands.run(ask.format(GATEWAY, denied.port), timeout=300)
        assert no.exit_code != 0 and not no.stdout, (no.stdout, no.stderr)
        assert denied.accepted == 0, "a container reached a port the policy does not open"
        assert allowed.accepted >= 1
        verdicts = {(r.get("port"), r.get("verdict")) for r in sb.network.egress_log()}
        assert (denied.port, "deny") in verdicts, verdicts
        # Forked with the services running: both children have them.
        children = sb.fork(2)
        try:
            for i, child in enumerate(children):
                ps = child.commands.run("docker ps --format '{{.Names}}' | sort")
                assert ps.stdout.split() == ["app_client_1", "app_web_1"], (i, ps.stdout)
                mine = child.commands.run(
                    f"docker exec app_web_1 sh -c 'echo child{i} > /www/index.html' && "
                    "docker exec app_client_1 wget -q -O - http://web:8080/", timeout=300)
                assert mine.stdout == f"child{i}\n", (i, mine.stdout, mine.stderr)
            parent = sb.commands.run("docker exec app_client_1 wget -q -O - http://web:8080/",
                                     timeout=300)
            assert parent.stdout == "hello from web\n", parent.stdout
        finally:
            for child in children:
                child.kill()
