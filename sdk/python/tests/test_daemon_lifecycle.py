"""The daemon's own life: a restart re-adopts live sandboxes, a crash
with no restart leaves no VMM running past its grace; a client killed
mid-stream leaks nothing."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from pathlib import Path
from typing import Dict, List, Optional

import json

import httpx
import pytest

from conftest import REPO, SDK
from forkbox import ConflictError, Sandbox, Template


def _start(sock: str, state: str, log_path: str, *extra: str,
           env: Optional[Dict[str, str]] = None) -> subprocess.Popen:
    exe = os.environ.get("FORKBOXD") or str(REPO / "target" / "release" / "forkboxd")
    log = open(log_path, "ab")
    proc = subprocess.Popen([exe, "--listen", f"unix://{sock}", "--state-dir", state, *extra],
                            stdout=log, stderr=subprocess.STDOUT, env=env)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        assert proc.poll() is None, Path(log_path).read_text()
        try:
            with httpx.Client(transport=httpx.HTTPTransport(uds=sock)) as c:
                if c.get("http://forkboxd/health").status_code == 200:
                    return proc
        except httpx.TransportError:
            pass
        time.sleep(0.05)
    proc.kill()
    pytest.fail("forkboxd did not come up within 120 s")


def test_daemon_killed_and_restarted_re_adopts_its_sandboxes() -> None:
    d = tempfile.mkdtemp(prefix="forkboxd-restart-", dir="/tmp")
    sock, state, log = f"{d}/forkbox.sock", f"{d}/state", f"{d}/forkboxd.log"
    url = f"unix://{sock}"
    first = _start(sock, state, log)
    try:
        running = Sandbox.create("minimal", timeout=600, metadata={"t": "restart"}, url=url)
        running.files.write("/tmp/mark", "before the crash")
        paused = Sandbox.create("minimal", timeout=600, metadata={"t": "restart"}, url=url)
        paused.pause()
        # A crash: no shutdown, nothing stopped.
        first.send_signal(signal.SIGKILL)
        first.wait(30)
        second = _start(sock, state, log)
        try:
            again = Sandbox.connect(running.sandbox_id, url=url)
            assert again.get_info()["state"] == "running"
            assert again.files.read("/tmp/mark") == "before the crash"
            assert again.commands.run("echo alive").stdout == "alive\n"
            still = Sandbox.connect(paused.sandbox_id, url=url)
            assert still.get_info()["state"] == "paused"
            still.resume()
            assert still.commands.run("true").exit_code == 0
            # The re-adopted zygote serves new creations without a new bake.
            fresh = Sandbox.create("minimal", timeout=600, metadata={"t": "restart"}, url=url)
            assert fresh.commands.run("true").exit_code == 0
            killed = Sandbox.kill_by_metadata({"t": "restart"}, url=url)
            assert len(killed) == 3
        finally:
            second.terminate()
            second.wait(60)
        # A clean stop leaves no state behind.
        assert os.listdir(f"{state}/sandboxes") == []
        assert os.listdir(f"{state}/templates") == []
    finally:
        if first.poll() is None:
            first.kill()
        sys.stderr.write("--- restart test daemon log ---\n" + Path(log).read_text()[-3000:])


def test_saved_template_outlives_a_stopped_daemon_without_baking() -> None:
    """A baked and saved template survives a clean stop, which ends every
    VM as a reboot would: the next daemon starts its zygote from the
    snapshot in its state directory. What its setup wrote at random is
    still there: it was not baked again."""
    d = tempfile.mkdtemp(prefix="forkboxd-saved-", dir="/tmp")
    sock, state, log = f"{d}/forkbox.sock", f"{d}/state", f"{d}/forkboxd.log"
    url = f"unix://{sock}"
    first = _start(sock, state, log)
    second: Optional[subprocess.Popen] = None
    try:
        Template.build("saved-t", image="minimal",
                       setup=["od -An -tx1 -N16 /dev/urandom > /tmp/baked"], url=url)
        with Sandbox.create("saved-t", timeout=600, url=url) as sb:
            mark = sb.files.read("/tmp/baked")
        assert len(mark.split()) == 16, mark
        with pytest.raises(ConflictError):
            Template.save("debian", url=url)  # not baked
        info = Template.save("saved-t", url=url)
        assert info.saved_bytes and info.saved_bytes > 0, info
        assert Path(f"{state}/snapshots/saved-t/memory").is_file()
        recorded = _vmm_pids(state)
        first.terminate()
        first.wait(60)
        assert not any(_vmm_running(p) for p in recorded), "a clean stop ends every VM"
        assert os.listdir(f"{state}/templates") == ["saved-t.json"]
        second = _start(sock, state, log)
        again = Template.get("saved-t", url=url)
        assert (again.state, again.saved_bytes) == ("ready", info.saved_bytes), again
        assert "started again from its snapshot" in Path(log).read_text()
        with Sandbox.create("saved-t", timeout=600, url=url) as sb:
            assert sb.files.read("/tmp/baked") == mark, "baked again"
            assert sb.commands.run("echo alive").stdout == "alive\n"
        Template.delete("saved-t", url=url)
        assert not Path(f"{state}/snapshots/saved-t").exists()
    finally:
        for proc in (first, second):
            if proc is not None and proc.poll() is None:
                proc.terminate()
                proc.wait(60)
        sys.stderr.write("--- saved template test daemon log ---\n" + Path(log).read_text()[-3000:])


def _registry(root: str) -> "tuple[subprocess.Popen, str]":
    """Debian's `docker-registry` on a free loopback port, its storage
    under `root`."""
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        addr = f"127.0.0.1:{s.getsockname()[1]}"
    config = Path(root, "registry.yml")
    config.write_text(f"version: 0.1\nlog:\n  level: error\nstorage:\n  filesystem:\n"
                      f"    rootdirectory: {root}/data\nhttp:\n  addr: {addr}\n")
    proc = subprocess.Popen(["docker-registry", "serve", str(config)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while True:
        try:
            socket.create_connection(("127.0.0.1", int(addr.split(":")[1])), timeout=1).close()
            return proc, addr
        except OSError:
            assert proc.poll() is None and time.monotonic() < deadline, "no registry"
            time.sleep(0.1)


def test_a_pushed_template_is_pulled_by_another_daemon_and_forks_without_a_bake() -> None:
    """One daemon bakes a template and pushes it to a registry, then
    stops; another, with its own state directory, pulls it and forks from
    it: what the setup wrote at random is there, so it was not baked
    again. A second push sends only the record and the manifest."""
    d = tempfile.mkdtemp(prefix="forkboxd-push-", dir="/tmp")
    sock, log = f"{d}/forkbox.sock", f"{d}/forkboxd.log"
    url = f"unix://{sock}"
    registry, addr = _registry(d)
    daemon: Optional[subprocess.Popen] = _start(sock, f"{d}/here", log)
    try:
        Template.build("pushed-t", image="minimal",
                       setup=["od -An -tx1 -N16 /dev/urandom > /tmp/baked"], url=url)
        with Sandbox.create("pushed-t", timeout=600, url=url) as sb:
            mark = sb.files.read("/tmp/baked")
        events: List[dict] = []
        pushed = Template.push("pushed-t", f"{addr}/templates/pushed-t:v1", plain_http=True,
                               on_progress=events.append, url=url)
        assert pushed.present_bytes == 0 and pushed.sent_bytes > 0, pushed
        assert any(e.get("what") == "memory" for e in events), events
        again = Template.push("pushed-t", f"{addr}/templates/pushed-t:v2", plain_http=True,
                              url=url)
        assert again.digest == pushed.digest, (again, pushed)
        assert again.sent_bytes < 64 * 1024 <= again.present_bytes, again
        assert daemon is not None
        daemon.terminate()
        daemon.wait(60)
        daemon = _start(sock, f"{d}/there", log)
        info = Template.pull(f"{addr}/templates/pushed-t:v1", plain_http=True, url=url)
        assert (info.name, info.state) == ("pushed-t", "ready"), info
        assert info.saved_bytes, info
        with Sandbox.create("pushed-t", timeout=600, url=url) as sb:
            assert sb.files.read("/tmp/baked") == mark, "baked again"
            assert sb.commands.run("echo alive").stdout == "alive\n"
        with pytest.raises(ConflictError):
            Template.pull(f"{addr}/templates/pushed-t:v1", plain_http=True, url=url)
    finally:
        if daemon is not None and daemon.poll() is None:
            daemon.terminate()
            daemon.wait(60)
        registry.kill()
        registry.wait()
        sys.stderr.write("--- push/pull test daemon log ---\n" + Path(log).read_text()[-3000:])


def _vmm_pids(state: str) -> List[int]:
    """The VMM pids the daemon recorded for its sandboxes and zygotes."""
    pids: List[int] = []

    def walk(v: object) -> None:
        if isinstance(v, dict):
            if isinstance(v.get("pid"), int):
                pids.append(v["pid"])
            for x in v.values():
                walk(x)
        elif isinstance(v, list):
            for x in v:
                walk(x)

    for sub in ("sandboxes", "templates"):
        for f in Path(state, sub).glob("*.json"):
            walk(json.loads(f.read_text()))
    return pids


def _vmm_running(pid: int) -> bool:
    """Whether `pid` is a forkbox-vmm that has not exited (a zombie has)."""
    try:
        if not os.readlink(f"/proc/{pid}/exe").endswith("forkbox-vmm"):
            return False
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    return "State:\tZ" not in status


def test_daemon_killed_and_not_restarted_leaves_no_vmm_past_the_grace() -> None:
    d = tempfile.mkdtemp(prefix="forkboxd-orphan-", dir="/tmp")
    sock, state, log = f"{d}/forkbox.sock", f"{d}/state", f"{d}/forkboxd.log"
    url = f"unix://{sock}"
    grace = 5
    # The VMMs' own account of their owners, in the log shown on failure.
    daemon = _start(sock, state, log, "--orphan-grace-secs", str(grace),
                    env={**os.environ, "FORKBOX_LOG": "forkbox_vmm=info"})
    try:
        sb = Sandbox.create("minimal", timeout=600, url=url)
        assert sb.commands.run("true").exit_code == 0
        pids = _vmm_pids(state)
        # The sandbox, and the zygote of its template.
        assert len(pids) >= 2, pids
        assert all(_vmm_running(p) for p in pids), pids
        daemon.send_signal(signal.SIGKILL)
        daemon.wait(30)
        deadline = time.monotonic() + grace + 60
        while any(_vmm_running(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.2)
        left = [p for p in pids if _vmm_running(p)]
        assert not left, f"VMMs {left} outlived their daemon by {grace + 60} s"
    finally:
        if daemon.poll() is None:
            daemon.kill()
        sys.stderr.write("--- orphan test daemon log ---\n" + Path(log).read_text()[-3000:])


def _running_vmms() -> set:
    """Every forkbox-vmm process running on this host."""
    return {int(p) for p in os.listdir("/proc") if p.isdigit() and _vmm_running(int(p))}


def _wait_for_line(log_path: str, text: str, after: int, limit: float) -> None:
    """Waits until `text` appears in the log past byte `after`."""
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        with open(log_path, "rb") as f:
            f.seek(after)
            if text.encode() in f.read():
                return
        time.sleep(0.01)
    pytest.fail(f"{text!r} not in the daemon's log within {limit} s")


def test_daemon_killed_mid_fork_and_mid_command_harms_no_sandbox_and_leaks_no_vmm() -> None:
    d = tempfile.mkdtemp(prefix="forkboxd-midfork-", dir="/tmp")
    sock, state, log = f"{d}/forkbox.sock", f"{d}/state", f"{d}/forkboxd.log"
    url = f"unix://{sock}"
    # Room for the second daemon to start and re-adopt: on a loaded 2-core
    # machine that took 12 s once (2026-12-05), past a 5 s grace, and the
    # bystander had ended as an orphan.
    grace = 30
    # The VMMs log each fork child they make: the moment to kill the daemon.
    env = {**os.environ, "FORKBOX_LOG": "forkbox_vmm=info"}
    first = _start(sock, state, log, "--orphan-grace-secs", str(grace), env=env)
    second = None
    try:
        bystander = Sandbox.create("minimal", timeout=600, url=url)
        bystander.files.write("/tmp/mark", "untouched")
        parent = Sandbox.create("minimal", timeout=600, url=url)
        before = _running_vmms()
        errors: List[BaseException] = []

        def call(f) -> None:
            try:
                f()
            except BaseException as e:  # the daemon dies under it
                errors.append(e)

        command = threading.Thread(
            target=call, args=(lambda: parent.commands.run("sleep 30", timeout=120),))
        command.start()
        time.sleep(1)  # the command is running in the guest
        mark = os.path.getsize(log)
        fork = threading.Thread(target=call, args=(lambda: parent.fork(8),))
        fork.start()
        # Killed once the first child exists and before the request ends:
        # children forked, not yet answered or owned.
        _wait_for_line(log, "fork child", mark, 300)
        first.send_signal(signal.SIGKILL)
        first.wait(30)
        command.join(60)
        fork.join(60)
        assert len(errors) == 2, f"both calls should fail with their daemon: {errors}"

        second = _start(sock, state, log, "--orphan-grace-secs", str(grace), env=env)
        # The other sandbox and the forked one serve on, as they were.
        again = Sandbox.connect(bystander.sandbox_id, url=url)
        assert again.files.read("/tmp/mark") == "untouched"
        assert again.commands.run("echo alive").stdout == "alive\n"
        p = Sandbox.connect(parent.sandbox_id, url=url)
        assert p.commands.run("echo alive").stdout == "alive\n"
        # And forks again.
        children = p.fork(2)
        assert all(isinstance(c, Sandbox) for c in children), children
        assert all(c.commands.run("true").exit_code == 0 for c in children)
        for c in children:
            c.kill()
        # Every VMM that appeared since is one the new daemon owns, once the
        # orphans' grace has passed: no child of the interrupted fork stays.
        deadline = time.monotonic() + grace + 60
        while True:
            owned = set(_vmm_pids(state))
            leaked = _running_vmms() - before - owned
            if not leaked or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        assert not leaked, f"VMMs {sorted(leaked)} of the interrupted fork outlived it"
    finally:
        for proc in (first, second):
            if proc is not None and proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(60)
                except subprocess.TimeoutExpired:
                    proc.kill()
        sys.stderr.write("--- mid-fork test daemon log ---\n" + Path(log).read_text()[-4000:])


def _metric(url: str, name: str) -> float:
    sock = url[len("unix://"):]
    with httpx.Client(transport=httpx.HTTPTransport(uds=sock)) as c:
        for line in c.get("http://forkboxd/metrics").text.splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
    raise AssertionError(f"no metric {name}")


def test_client_killed_mid_stream_leaks_nothing(daemon_url: str) -> None:
    with Sandbox.create("minimal", timeout=600) as sb:
        live = _metric(daemon_url, "forkbox_sandboxes_live")
        client = textwrap.dedent(f"""
            import sys
            sys.path.insert(0, {str(SDK)!r})
            from forkbox import ConflictError, Sandbox
            sb = Sandbox.connect({sb.sandbox_id!r})
            sb.commands.run("i=0; while [ $i -lt 300 ]; do echo line $i; i=$((i+1)); sleep 0.1; done",
                            on_stdout=lambda s: print(s, end="", flush=True))
        """)
        proc = subprocess.Popen([sys.executable, "-c", client], stdout=subprocess.PIPE,
                                env={**os.environ, "FORKBOX_URL": daemon_url})
        assert proc.stdout is not None
        seen: List[bytes] = [proc.stdout.readline() for _ in range(3)]
        assert all(line.startswith(b"line ") for line in seen), seen
        proc.kill()
        proc.wait(30)
        # The daemon serves on, the sandbox is usable, and nothing was
        # created or lost by the client's death.
        assert sb.commands.run("echo still here").stdout == "still here\n"
        assert _metric(daemon_url, "forkbox_sandboxes_live") == live


def test_kill_ends_a_command_that_is_still_running(daemon_url: str) -> None:
    sb = Sandbox.create("minimal", timeout=600)
    outcome: List[BaseException] = []

    def run() -> None:
        try:
            sb.commands.run("sleep 600")
        except BaseException as e:  # noqa: BLE001 - what ended it is the point
            outcome.append(e)

    t = threading.Thread(target=run)
    t.start()
    time.sleep(2)
    sb.kill()
    t.join(60)
    assert not t.is_alive(), "the command outlived its sandbox"
    # The caller killed it: a conflict, not an infrastructure failure.
    assert len(outcome) == 1 and isinstance(outcome[0], ConflictError), outcome
