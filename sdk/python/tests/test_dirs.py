"""Directories both ways as one tar stream, sync and async."""

from __future__ import annotations

import asyncio
import io
import os
import tarfile
from pathlib import Path

import pytest

from forkbox import AsyncSandbox, Sandbox
from forkbox._tar import unpack_to


def _tree(root: Path) -> None:
    (root / "sub" / "deeper").mkdir(parents=True)
    (root / "a.txt").write_text("alpha")
    (root / "sub" / "b.bin").write_bytes(bytes(range(256)) * 64)
    (root / "sub" / "deeper" / "run.sh").write_text("#!/bin/sh\necho ran\n")
    os.chmod(root / "sub" / "deeper" / "run.sh", 0o755)


def _listing(root: Path) -> dict:
    return {str(p.relative_to(root)): (p.read_bytes(), p.stat().st_mode & 0o777)
            for p in sorted(root.rglob("*")) if p.is_file()}


def test_upload_dir_then_download_dir_round_trips(daemon_url: str, tmp_path: Path) -> None:
    src, back = tmp_path / "src", tmp_path / "back"
    src.mkdir()
    _tree(src)
    with Sandbox.create("minimal", timeout=300) as sb:
        assert sb.files.upload_dir(str(src), "/home/user/project") > 0
        assert sb.commands.run("/home/user/project/sub/deeper/run.sh").stdout == "ran\n"
        sb.files.download_dir("/home/user/project", str(back))
    assert _listing(back) == _listing(src)


def test_async_upload_dir_then_download_dir(daemon_url: str, tmp_path: Path) -> None:
    src, back = tmp_path / "src", tmp_path / "back"
    src.mkdir()
    _tree(src)

    async def go() -> None:
        async with await AsyncSandbox.create("minimal", timeout=300) as sb:
            await sb.files.upload_dir(str(src), "/home/user/p")
            await sb.files.download_dir("/home/user/p", str(back))

    asyncio.run(go())
    assert _listing(back) == _listing(src)


def test_unpack_refuses_entries_outside_the_target(tmp_path: Path) -> None:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        info = tarfile.TarInfo("../escaped")
        info.size = 1
        tar.addfile(info, io.BytesIO(b"x"))
    with pytest.raises(Exception):
        unpack_to(buf.getvalue(), str(tmp_path / "out"))
    assert not (tmp_path / "escaped").exists()
