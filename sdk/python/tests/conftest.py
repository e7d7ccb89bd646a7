"""Starts a real forkboxd for the session (VMs need KVM: run the session
inside the emulated host where this machine lacks VMX/SVM, as
`make sdk-test` does)."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Iterator

import pytest

SDK = Path(__file__).resolve().parents[1]
REPO = SDK.parents[1]
sys.path.insert(0, str(SDK))

import httpx  # noqa: E402

MAX_LIVE = 2


@pytest.fixture(scope="session")
def daemon_url() -> Iterator[str]:
    # /tmp: the emulated host mounts everything else read-only.
    d = tempfile.mkdtemp(prefix="forkboxd-test-", dir="/tmp")
    sock = os.path.join(d, "forkbox.sock")
    exe = os.environ.get("FORKBOXD") or str(REPO / "target" / "release" / "forkboxd")
    log = open(os.path.join(d, "forkboxd.log"), "w+b")
    proc = subprocess.Popen(
        [exe, "--listen", f"unix://{sock}", "--max-live", str(MAX_LIVE), "--create-wait", "0"],
        stdout=log, stderr=subprocess.STDOUT)
    url = f"unix://{sock}"
    deadline = time.monotonic() + 120
    while True:
        if proc.poll() is not None:
            log.seek(0)
            pytest.fail(f"forkboxd exited with {proc.returncode}:\n{log.read().decode()}")
        if os.path.exists(sock):
            try:
                with httpx.Client(transport=httpx.HTTPTransport(uds=sock)) as c:
                    if c.get("http://forkboxd/health").status_code == 200:
                        break
            except httpx.TransportError:
                pass
        if time.monotonic() > deadline:
            proc.kill()
            pytest.fail("forkboxd did not come up within 120 s")
        time.sleep(0.05)
    os.environ["FORKBOX_URL"] = url
    yield url
    proc.terminate()
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()
    log.seek(0)
    sys.stderr.write("--- forkboxd log ---\n" + log.read().decode(errors="replace")[-4000:])
