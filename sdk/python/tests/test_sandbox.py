"""End to end: the SDK against a real forkboxd booting real microVMs."""

from __future__ import annotations

import io
import tarfile
import time
from typing import List

import pytest

from forkbox import CapacityError, InvalidRequestError, NotFoundError, Sandbox
from forkbox._client import shared_client


@pytest.fixture(scope="module")
def sb(daemon_url: str):
    with Sandbox.create("minimal", timeout=600, metadata={"suite": "main"},
                        envs={"SANDBOX_VAR": "from-create"}) as s:
        yield s


def test_commands_run_returns_output_and_exit_code(sb: Sandbox) -> None:
    r = sb.commands.run("echo hello; echo oops >&2; exit 3")
    assert r.stdout == "hello\n"
    assert r.stderr == "oops\n"
    assert r.exit_code == 3
    assert not r.timed_out
    assert r.duration > 0


def test_commands_run_env_cwd_user_stdin(sb: Sandbox) -> None:
    r = sb.commands.run("echo $SANDBOX_VAR $CMD_VAR; pwd; id -u; cat", cwd="/tmp",
                        envs={"CMD_VAR": "from-run"}, user="user", stdin="piped")
    assert r.stdout.splitlines() == ["from-create from-run", "/tmp", "1000", "piped"]
    assert r.exit_code == 0


def test_commands_run_argv_form(sb: Sandbox) -> None:
    assert sb.commands.run(["echo", "a b"]).stdout == "a b\n"


def test_commands_run_timeout_kills(sb: Sandbox) -> None:
    r = sb.commands.run("sleep 30", timeout=1)
    assert r.timed_out
    assert r.exit_code is None


def test_commands_run_streams_to_callbacks(sb: Sandbox) -> None:
    out: List[str] = []
    err: List[str] = []
    r = sb.commands.run("for i in 1 2 3; do echo $i; sleep 0.1; done; echo e >&2",
                        on_stdout=out.append, on_stderr=err.append)
    assert "".join(out) == "1\n2\n3\n"
    assert "".join(err) == "e\n"
    assert r.stdout == "1\n2\n3\n"
    assert r.exit_code == 0


def test_files_write_read_list_exists_remove(sb: Sandbox) -> None:
    assert sb.files.write("/tmp/t/dir/hello.txt", "héllo") == len("héllo".encode())
    assert sb.files.read("/tmp/t/dir/hello.txt") == "héllo"
    assert sb.files.read("/tmp/t/dir/hello.txt", format="bytes") == "héllo".encode()
    names = [e.name for e in sb.files.list("/tmp/t/dir")]
    assert names == ["hello.txt"]
    assert sb.files.exists("/tmp/t/dir/hello.txt")
    sb.files.make_dir("/tmp/t/made/deep")
    assert sb.files.list("/tmp/t/made")[0].type == "dir"
    sb.files.remove("/tmp/t")
    assert not sb.files.exists("/tmp/t")
    with pytest.raises(NotFoundError):
        sb.files.read("/tmp/t/dir/hello.txt")


def test_files_tar_round_trip(sb: Sandbox) -> None:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tf:
        data = b"inside a tar\n"
        info = tarfile.TarInfo("sub/f.txt")
        info.size = len(data)
        tf.addfile(info, io.BytesIO(data))
    sb.files.upload_tar("/tmp/up", buf.getvalue())
    assert sb.files.read("/tmp/up/sub/f.txt") == "inside a tar\n"
    back = tarfile.open(fileobj=io.BytesIO(sb.files.download_tar("/tmp/up")))
    assert any(n.endswith("sub/f.txt") for n in back.getnames())


def test_connect_list_and_info(sb: Sandbox) -> None:
    again = Sandbox.connect(sb.sandbox_id)
    assert again.commands.run("echo same").stdout == "same\n"
    ids = [s.sandbox_id for s in Sandbox.list(metadata={"suite": "main"})]
    assert ids == [sb.sandbox_id]
    assert Sandbox.list(metadata={"suite": "nope"}) == []
    info = sb.get_info()
    assert info["state"] == "running"
    assert info["started_by"] == "fork", "created as a fork of the template's zygote"
    assert info["metrics"]["memory_rss_kib"] > 0
    assert info["parent"] is None


def test_unknown_sandbox_and_bad_requests(daemon_url: str) -> None:
    with pytest.raises(NotFoundError):
        Sandbox.connect("sb-0000000000000000")
    with pytest.raises(InvalidRequestError):
        shared_client().json("POST", "/sandboxes", json={"template": "minimal", "nope": 1})


def test_cap_ttl_kill_by_label_and_context_manager(small_daemon_url: str) -> None:
    url = small_daemon_url
    first = Sandbox.create("minimal", timeout=600, metadata={"suite": "first"}, url=url)
    # `first` is live and this daemon's cap is 2: one more fits, then no room.
    with pytest.raises(RuntimeError):
        with Sandbox.create("minimal", metadata={"suite": "second"}, url=url) as second:
            with pytest.raises(CapacityError):
                Sandbox.create("minimal", url=url)
            second.set_timeout(600)
            raise RuntimeError("the with block fails")
    assert not second.is_running(), "killed on exit even on error"
    # A fork past the cap: the daemon admits children one by one, so the
    # first takes the one free slot and the second alone is refused (the
    # request as a whole never is for capacity).
    children = first.fork(count=2)
    assert len(children) == 2, children
    child, refused = children
    assert isinstance(child, Sandbox), children
    assert isinstance(refused, CapacityError) and not refused.infrastructure, children
    assert child.get_info()["parent"] == first.sandbox_id
    child.kill()
    # Room again: a sandbox whose TTL runs out is killed by the daemon.
    short = Sandbox.create("minimal", timeout=None, metadata={"suite": "ttl"}, url=url)
    short.set_timeout(1)
    deadline = time.monotonic() + 30
    while short.is_running() and time.monotonic() < deadline:
        time.sleep(0.2)
    info = short.get_info()
    assert info["state"] == "dead"
    assert info["death"] == "expired"
    # Kill by label.
    third = Sandbox.create("minimal", metadata={"suite": "bylabel"}, url=url)
    assert Sandbox.kill_by_metadata({"suite": "bylabel"}, url=url) == [third.sandbox_id]
    assert not third.is_running()
    assert first.is_running()
    first.kill()
