"""Writable disks against a real forkboxd: a template's disk is in every
sandbox, each sandbox's writes are its own, a fork mid-episode carries the
disk of its instant, a full disk is the guest's error, a full host disk
the host's, and a saved template keeps its disk across a daemon's restart."""

from __future__ import annotations

import os
import sys
import tempfile
import uuid
from pathlib import Path
from typing import Optional

import subprocess

import pytest

from forkbox import ForkboxError, GuestEndedError, InvalidRequestError, Sandbox, Template


def _name(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


# 1 MiB of random bytes written by the setup, its sum kept beside it.
SETUP = ["head -c 1048576 /dev/urandom > /data/setup && md5sum /data/setup > /data/sum",
         "chmod 1777 /data"]


def _ls(sb: Sandbox) -> str:
    return sb.commands.run("cd /data && ls | grep -v lost+found | tr '\\n' ' '").stdout


def test_a_templates_disk_is_every_sandboxs_and_a_forks_children_start_from_its_instant(
        daemon_url: str) -> None:
    name = _name("disk")
    info = Template.build(name, disks={"/data": 64}, setup=SETUP)
    assert info.disks == [{"path": "/data", "size_mib": 64}], info
    try:
        with Sandbox.create(name) as a, Sandbox.create(name) as b:
            for sb in (a, b):
                mounts = sb.commands.run("grep ' /data ' /proc/mounts").stdout
                assert "ext4 rw" in mounts, mounts
                assert sb.commands.run("md5sum -c /data/sum").exit_code == 0, "setup's bytes"
            a.commands.run("echo a > /data/a")
            assert _ls(a) == "a setup sum "
            assert _ls(b) == "setup sum ", "a's write is a's own"
            # A write still in the guest's page cache at the fork: each
            # child flushes it to its own disk and reads it back from there.
            a.commands.run("head -c 524288 /dev/urandom > /data/unsynced && "
                           "md5sum /data/unsynced > /data/unsynced.sum")
            children = a.fork(2)
            try:
                for i, child in enumerate(children):
                    got = child.commands.run(
                        "sync && echo 3 > /proc/sys/vm/drop_caches && md5sum -c /data/unsynced.sum",
                        user="root")
                    assert got.exit_code == 0, (i, got.stdout, got.stderr)
                    child.commands.run(f"echo {i} > /data/child{i}")
                a.commands.run("rm /data/a")
                assert _ls(a) == "setup sum unsynced unsynced.sum "
                for i, child in enumerate(children):
                    assert _ls(child) == f"a child{i} setup sum unsynced unsynced.sum ", i
            finally:
                for child in children:
                    child.kill()
            # A full disk is the guest's: its command fails, nothing else.
            full = b.commands.run("dd if=/dev/zero of=/data/fill bs=1M", timeout=600)
            assert full.exit_code != 0
            assert "No space left on device" in full.stderr, full.stderr
            b.commands.run("rm /data/fill && echo room > /data/after")
            assert b.files.read("/data/after") == "room\n"
    finally:
        Template.delete(name)


def test_a_template_with_disks_is_refused_by_push_saying_why(daemon_url: str) -> None:
    name = _name("nopush")
    Template.build(name, disks={"/data": 16})
    try:
        with pytest.raises(InvalidRequestError) as ei:
            Template.push(name, "127.0.0.1:1/forkbox/nopush:1", plain_http=True)
        assert "writable disks" in str(ei.value), ei.value
    finally:
        Template.delete(name)
    with pytest.raises(InvalidRequestError) as bad:
        Template.build(_name("baddisk"), disks={"/proc/x": 64})
    assert "disks" in str(bad.value)


def test_a_saved_template_keeps_its_disk_across_a_daemon_restart() -> None:
    from test_daemon_lifecycle import _start
    d = tempfile.mkdtemp(prefix="forkboxd-disk-", dir="/tmp")
    sock, state, log = f"{d}/forkbox.sock", f"{d}/state", f"{d}/forkboxd.log"
    url = f"unix://{sock}"
    first = _start(sock, state, log)
    second: Optional[subprocess.Popen] = None
    try:
        Template.build("disk-saved", disks={"/data": 64}, setup=SETUP, url=url)
        info = Template.save("disk-saved", url=url)
        assert Path(f"{state}/snapshots/disk-saved/disk-0").is_file()
        with Sandbox.create("disk-saved", timeout=600, url=url) as sb:
            mark = sb.files.read("/data/sum")
        first.terminate()
        first.wait(60)
        second = _start(sock, state, log)
        again = Template.get("disk-saved", url=url)
        assert (again.state, again.saved_bytes) == ("ready", info.saved_bytes), again
        with Sandbox.create("disk-saved", timeout=600, url=url) as sb:
            # From the disk, not the zygote's page cache.
            sb.commands.run("echo 3 > /proc/sys/vm/drop_caches", user="root")
            assert sb.files.read("/data/sum") == mark, "baked again, or the disk is lost"
            assert sb.commands.run("md5sum -c /data/sum").exit_code == 0
        Template.delete("disk-saved", url=url)
    finally:
        for proc in (first, second):
            if proc is not None and proc.poll() is None:
                proc.terminate()
                proc.wait(60)
        sys.stderr.write("--- disk test daemon log ---\n" + Path(log).read_text()[-3000:])


def _metric(url: str, name: str) -> float:
    """The value of `name` in the daemon's /metrics."""
    import httpx
    sock = url.removeprefix("unix://")
    with httpx.Client(transport=httpx.HTTPTransport(uds=sock)) as c:
        text = c.get("http://forkboxd/metrics").text
    values = [float(line.split()[-1]) for line in text.splitlines()
              if line.startswith(name + " ")]
    assert values, f"no {name} in /metrics"
    return values[0]


def test_a_full_host_disk_ends_the_sandbox_as_the_hosts_failure_and_loses_no_other_sandboxs_data(
        ) -> None:
    """The daemon's VMs live in a 48 MiB tmpfs: a guest that writes more
    than the host has loses a write to the host, and its VM ends at once as
    the host's failure (a guest file system that lost a write, its journal
    aborted, would otherwise throttle the writer forever); another
    sandbox's written data reads back whole, and it writes again in the
    space the ended sandbox gave back."""
    from test_daemon_lifecycle import _start
    d = tempfile.mkdtemp(prefix="forkboxd-hostfull-", dir="/tmp")
    small = f"{d}/small"
    os.makedirs(small)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=48m,mode=1777", "tmpfs", small],
                   check=True)
    sock, state, log = f"{d}/forkbox.sock", f"{d}/state", f"{d}/forkboxd.log"
    url = f"unix://{sock}"
    proc = _start(sock, state, log, env={**os.environ, "TMPDIR": small})
    try:
        Template.build("hostfull", disks={"/data": 256}, setup=["chmod 1777 /data"], url=url)
        with Sandbox.create("hostfull", timeout=600, url=url) as b, \
                Sandbox.create("hostfull", timeout=600, url=url) as a:
            kept = b.commands.run("head -c 4194304 /dev/urandom > /data/kept && sync && "
                                  "md5sum /data/kept > /data/kept.sum && sync")
            assert kept.exit_code == 0, kept.stderr
            assert _metric(url, "forkbox_vmm_disk_host_write_errors") == 0
            with pytest.raises(ForkboxError) as caught:
                a.commands.run("dd if=/dev/zero of=/data/flood bs=1M count=200 conv=fsync",
                               timeout=600)
            e = caught.value
            assert e.infrastructure and not isinstance(e, GuestEndedError), e
            assert "the host failed a write to the guest's writable disk" in str(e), e
            death = a.get_info().get("death")
            assert isinstance(death, dict) and "vm_lost" in death, death
            assert "No space left on device" in death["vm_lost"]["reason"], death
            check = b.commands.run("echo 3 > /proc/sys/vm/drop_caches && md5sum -c /data/kept.sum",
                                   user="root")
            assert check.exit_code == 0, (check.stdout, check.stderr)
            again = b.commands.run("head -c 4194304 /dev/urandom > /data/more && sync")
            assert again.exit_code == 0, again.stderr
    finally:
        proc.terminate()
        proc.wait(60)
        subprocess.run(["umount", small], check=False)
        sys.stderr.write("--- host-full test daemon log ---\n" + Path(log).read_text()[-3000:])


def test_a_disk_starts_with_an_images_files_and_each_sandboxs_writes_are_its_own(
        daemon_url: str) -> None:
    """A disk made from a two-layer image holds its files as a guest sees
    the layers stacked (the upper one's file over the lower one's, owners
    and modes kept); every sandbox starts from them and writes on its own.
    Whiteouts and opaque directories are the image crate's test
    (`import_oci_layout_unpacks_layers_that_overlayfs_stacks_as_the_image`):
    an import in the emulated host cannot write them (docs/SPEC.md, known
    problems)."""
    from test_images import _import, _layer
    name = _name("diskimg")
    image = f"forkbox-test/{name}:1"
    base = _layer([("d", "repo", 0o755, 1000, b""),
                   ("f", "repo/README", 0o644, 1000, b"old\n"),
                   ("d", "repo/cache", 0o755, 0, b""),
                   ("f", "repo/cache/stale", 0o644, 0, b"stale\n")])
    top = _layer([("d", "repo", 0o755, 1000, b""),
                  ("f", "repo/README", 0o644, 1000, b"base\n"),
                  ("d", "repo/cache", 0o755, 0, b""),
                  ("f", "repo/cache/fresh", 0o644, 0, b"fresh\n"),
                  ("f", "repo/src.py", 0o600, 1000, b"print(1)\n")])
    _import(image, [base, top], {})
    with pytest.raises(InvalidRequestError) as e:
        Template.build(_name("nodiskimg"), disks={"/workspace": {"size_mib": 64,
                                                                 "image": "forkbox-test/none:1"}})
    assert "forkbox-test/none:1" in str(e.value), e.value
    info = Template.build(name, disks={"/workspace": {"size_mib": 64, "image": image}},
                          setup=["cat /workspace/repo/README"])
    assert info.disks[0]["image"] == image, info.disks
    assert info.disks[0]["image_id"].startswith("sha256:"), info.disks
    try:
        with Sandbox.create(name) as a, Sandbox.create(name) as b:
            seen = a.commands.run("cd /workspace/repo && find . | sort && "
                                  "stat -c '%n %u %a' README src.py cache/fresh", user="root")
            assert seen.stdout.split("\n") == [
                ".", "./README", "./cache", "./cache/fresh", "./cache/stale", "./src.py",
                "README 1000 644", "src.py 1000 600", "cache/fresh 0 644", ""], seen.stdout
            a.commands.run("echo mine > /workspace/repo/README", user="root")
            assert a.commands.run("cat /workspace/repo/README").stdout == "mine\n"
            assert b.commands.run("cat /workspace/repo/README").stdout == "base\n"
            assert b.commands.run("cat /workspace/repo/src.py", user="root").stdout == "print(1)\n"
    finally:
        Template.delete(name)
