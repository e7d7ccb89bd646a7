"""Images you bring: an OCI layout built here, imported with `forkbox
image import`, booted as a template's image. Its configuration is
honoured (`User`, `WorkingDir`, `Env`, its `Cmd` run as a service), and an
image with no shell at all still runs an argv."""

from __future__ import annotations

import hashlib
import io
import json
import os
import subprocess
import tarfile
import tempfile
from pathlib import Path
from typing import Dict, List, Tuple

from conftest import REPO
from forkbox import Sandbox, Template

BUSYBOX = "/bin/busybox"  # busybox-static, which `make` installs


def _layer(entries: List[Tuple[str, str, int, int, bytes]]) -> bytes:
    """A tar of (kind, path, mode, uid, data-or-link-target) entries:
    kind `d` a directory, `f` a file, `l` a symbolic link."""
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        for kind, path, mode, uid, data in entries:
            info = tarfile.TarInfo(path)
            info.mode, info.uid, info.gid, info.mtime = mode, uid, uid, 1_700_000_000
            if kind == "d":
                info.type = tarfile.DIRTYPE
                tar.addfile(info)
            elif kind == "l":
                info.type, info.linkname = tarfile.SYMTYPE, data.decode()
                tar.addfile(info)
            else:
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    return out.getvalue()


def _import(name: str, layers: List[bytes], config: Dict[str, object]) -> None:
    """Writes an OCI layout of `layers` (bottom first) and imports it as
    `name`."""
    with tempfile.TemporaryDirectory(dir="/tmp") as d:
        blobs = Path(d, "blobs", "sha256")
        blobs.mkdir(parents=True)

        def put(data: bytes) -> Tuple[str, int]:
            digest = hashlib.sha256(data).hexdigest()
            (blobs / digest).write_bytes(data)
            return f"sha256:{digest}", len(data)

        put_layers = [put(layer) for layer in layers]
        cfg = json.dumps({"architecture": "amd64", "os": "linux", "config": config,
                          "rootfs": {"type": "layers",
                                     "diff_ids": [d for d, _ in put_layers]}}).encode()
        cfg_digest, cfg_size = put(cfg)
        manifest = json.dumps({
            "schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
            "config": {"mediaType": "application/vnd.oci.image.config.v1+json",
                       "digest": cfg_digest, "size": cfg_size},
            "layers": [{"mediaType": "application/vnd.oci.image.layer.v1.tar",
                        "digest": d, "size": n} for d, n in put_layers]}).encode()
        m_digest, m_size = put(manifest)
        Path(d, "index.json").write_text(json.dumps({"schemaVersion": 2, "manifests": [{
            "mediaType": "application/vnd.oci.image.manifest.v1+json",
            "digest": m_digest, "size": m_size}]}))
        Path(d, "oci-layout").write_text('{"imageLayoutVersion":"1.0.0"}')
        done = subprocess.run([_forkbox(), "image", "import", d, "--name", name],
                              capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr


def _forkbox() -> str:
    return os.environ.get("FORKBOX") or str(REPO / "target" / "release" / "forkbox")


def _busybox() -> bytes:
    return Path(BUSYBOX).read_bytes()


def _tar_of(root: str, paths: List[str]) -> bytes:
    """A layer of `paths` (relative) under `root`, owned by root."""
    def owned(info: tarfile.TarInfo) -> tarfile.TarInfo:
        info.uid = info.gid = 0
        info.uname = info.gname = "root"
        return info

    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=tarfile.GNU_FORMAT) as tar:
        for p in paths:
            tar.add(os.path.join(root, p), arcname=p, filter=owned)
    return out.getvalue()


def test_an_images_user_dir_env_and_service_are_honoured(daemon_url: str) -> None:
    applets = ["sh", "id", "pwd", "cat", "wget", "grep", "httpd", "sleep", "true"]
    layer = _layer(
        [("d", p, 0o755, 0, b"") for p in ["bin", "etc", "srv", "srv/www", "home", "root"]]
        + [("d", "home/app", 0o755, 1001, b""), ("d", "tmp", 0o1777, 0, b""),
           ("f", "bin/busybox", 0o755, 0, _busybox())]
        + [("l", f"bin/{a}", 0o777, 0, b"busybox") for a in applets]
        + [("f", "etc/passwd", 0o644, 0,
            b"root:x:0:0:root:/root:/bin/sh\napp:x:1001:1001:app:/home/app:/bin/sh\n"),
           ("f", "etc/group", 0o644, 0, b"root:x:0:\napp:x:1001:\n"),
           ("f", "srv/www/index.html", 0o644, 0, b"hello from the image\n")])
    _import("forkbox-test/app:1", [layer], {
        "User": "app", "WorkingDir": "/srv", "Env": ["PATH=/bin", "GREETING=hi"],
        "Cmd": ["/bin/httpd", "-f", "-p", "8080", "-h", "/srv/www"]})
    info = Template.build("image-app", image="forkbox-test/app:1", run_image_cmd=True,
                          ready={"http_url": "http://127.0.0.1:8080/"})
    assert info.image_id and info.image_id.startswith("sha256:"), info
    with Sandbox.create("image-app", timeout=600) as sb:
        got = sb.commands.run("id -un; pwd; echo $GREETING")
        assert got.stdout == "app\n/srv\nhi\n", got
        page = sb.commands.run("wget -qO- http://127.0.0.1:8080/")
        assert page.stdout == "hello from the image\n", page
        # The service runs as the image's user, started at the bake.
        owner = sb.commands.run(
            "for p in /proc/[0-9]*; do grep -qx httpd $p/comm 2>/dev/null && "
            "grep ^Uid: $p/status; done")
        assert owner.stdout.split()[1:2] == ["1001"], owner
        assert sb.commands.run("id -u", user="root").stdout == "0\n"
    Template.delete("image-app")


def test_an_image_with_no_shell_runs_an_argv(daemon_url: str) -> None:
    """No /bin/sh at all: the bake's warm-up has nothing to warm and the
    zygote is made anyway; an argv runs, a shell string says what is
    missing."""
    layer = _layer([("d", "bin", 0o755, 0, b""), ("d", "tmp", 0o1777, 0, b""),
                    ("f", "bin/busybox", 0o755, 0, _busybox())])
    _import("forkbox-test/noshell:1", [layer], {"Env": ["PATH=/bin"]})
    Template.build("image-noshell", image="forkbox-test/noshell:1")
    with Sandbox.create("image-noshell", timeout=600) as sb:
        got = sb.commands.run(["/bin/busybox", "echo", "no shell here"])
        assert (got.exit_code, got.stdout) == (0, "no shell here\n"), got
        shell = sb.commands.run("echo hi")
        assert shell.exit_code == 127 and "not found" in shell.stderr, shell
    Template.delete("image-noshell")


CALC = """def add(a, b):
    return a + b
"""

TESTS = """import unittest

import calc


class TestCalc(unittest.TestCase):
    def test_adds(self):
        self.assertEqual(calc.add(2, 3), 5)

    def test_adds_negatives(self):
        self.assertEqual(calc.add(-2, -3), -5)


if __name__ == "__main__":
    unittest.main()
"""


def test_a_python_image_runs_a_test_suite(daemon_url: str) -> None:
    """A three-layer Python image: a busybox base, the shared libraries
    of the `debian` image, and its python3.11 with the standard library
    (taken out of the image's disk with `debugfs`). A project's test
    suite runs in a sandbox of it and passes; broken, it fails."""
    disk = subprocess.run([_forkbox(), "image", "build", "debian"], capture_output=True,
                          text=True, timeout=1800, check=True).stdout.strip()
    with tempfile.TemporaryDirectory(dir="/tmp") as root:
        for src in ["/usr/bin/python3.11", "/usr/lib/python3.11", "/usr/lib/x86_64-linux-gnu",
                    "/usr/lib64"]:
            into = root + os.path.dirname(src)
            os.makedirs(into, exist_ok=True)
            subprocess.run(["debugfs", "-R", f"rdump {src} {into}", disk], check=True,
                           capture_output=True, timeout=600)
        base = _layer(
            [("d", p, 0o755, 0, b"") for p in ["usr", "usr/bin", "etc", "home", "root", "work"]]
            + [("l", "bin", 0o777, 0, b"usr/bin"), ("l", "lib", 0o777, 0, b"usr/lib"),
               ("l", "lib64", 0o777, 0, b"usr/lib64"), ("d", "home/user", 0o755, 1000, b""),
               ("d", "tmp", 0o1777, 0, b""), ("f", "usr/bin/busybox", 0o755, 0, _busybox())]
            + [("l", f"usr/bin/{a}", 0o777, 0, b"busybox")
               for a in ["sh", "cat", "echo", "sed", "chown"]]
            + [("f", "etc/passwd", 0o644, 0,
                b"root:x:0:0:root:/root:/bin/sh\nuser:x:1000:1000:user:/home/user:/bin/sh\n"),
               ("f", "etc/group", 0o644, 0, b"root:x:0:\nuser:x:1000:\n")])
        libs = _tar_of(root, ["usr/lib/x86_64-linux-gnu", "usr/lib64"])
        python = _tar_of(root, ["usr/bin/python3.11", "usr/lib/python3.11"])
    _import("forkbox-test/python:1", [base, libs, python],
            {"Env": ["PATH=/usr/bin"], "WorkingDir": "/work", "User": "user"})
    Template.build("image-python", image="forkbox-test/python:1",
                   setup=["chown user /work"])
    with Sandbox.create("image-python", timeout=600) as sb:
        sb.files.write("/work/calc.py", CALC)
        sb.files.write("/work/test_calc.py", TESTS)
        passed = sb.commands.run(["python3.11", "-m", "unittest", "-v"], timeout=300)
        assert passed.exit_code == 0, passed
        assert "Ran 2 tests" in passed.stderr and "OK" in passed.stderr, passed
        sb.commands.run("sed -i 's/a + b/a - b/' /work/calc.py")
        failed = sb.commands.run(["python3.11", "-m", "unittest"], timeout=300)
        assert failed.exit_code == 1 and "FAILED (failures=2)" in failed.stderr, failed
    Template.delete("image-python")
