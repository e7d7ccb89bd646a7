"""`download_dir`'s unpacking of a guest's tar, against hand-built hostile
archives. Needs no daemon and no VM: run it alone with
`python3 -m pytest sdk/python/tests/test_tar_unpack.py`."""

from __future__ import annotations

import io
import os
import stat
import tarfile
from pathlib import Path
from typing import Tuple

import pytest

from forkbox import UnsafeArchiveError
from forkbox._tar import unpack_to


def _member(name: str, kind: bytes = tarfile.REGTYPE, data: bytes = b"",
            mode: int = 0o644, link: str = "") -> Tuple[tarfile.TarInfo, bytes]:
    """A member as a hostile guest would write it: tarfile writes names
    and link targets as given."""
    m = tarfile.TarInfo(name)
    m.type, m.mode, m.linkname, m.size = kind, mode, link, len(data)
    return m, data


def _archive(*members: Tuple[tarfile.TarInfo, bytes]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.GNU_FORMAT) as tar:
        for m, data in members:
            tar.addfile(m, io.BytesIO(data) if data else None)
    return buf.getvalue()


@pytest.fixture()
def out(tmp_path: Path) -> Path:
    return tmp_path / "out"


def test_plain_tree_with_inside_links_unpacks(out: Path) -> None:
    unpack_to(_archive(
        _member("d", tarfile.DIRTYPE, mode=0o755),
        _member("d/a.txt", data=b"hello"),
        _member("d/sub", tarfile.DIRTYPE, mode=0o750),
        _member("d/sub/up", tarfile.SYMTYPE, link="../a.txt"),
        _member("d/hard", tarfile.LNKTYPE, link="d/a.txt"),
    ), str(out))
    assert (out / "d/sub/up").read_bytes() == b"hello"
    assert (out / "d/hard").stat().st_ino == (out / "d/a.txt").stat().st_ino
    assert stat.S_IMODE((out / "d/sub").stat().st_mode) == 0o750


def test_absolute_member_is_refused_by_name(out: Path) -> None:
    with pytest.raises(UnsafeArchiveError, match="absolute") as e:
        unpack_to(_archive(_member("/tmp/forkbox-sdk-evil", data=b"x")), str(out))
    assert e.value.member == "/tmp/forkbox-sdk-evil"
    assert list(out.iterdir()) == []
    assert not Path("/tmp/forkbox-sdk-evil").exists()


def test_dotdot_member_is_refused_and_nothing_lands_outside(out: Path) -> None:
    with pytest.raises(UnsafeArchiveError, match="`..`") as e:
        unpack_to(_archive(_member("a/../../escaped", data=b"x")), str(out))
    assert e.value.member == "a/../../escaped"
    assert not (out.parent / "escaped").exists()


@pytest.mark.parametrize("target", ["..", "../x", "a/../../x", "sub/..", "/etc"])
def test_symlink_leading_out_is_refused(out: Path, target: str) -> None:
    with pytest.raises(UnsafeArchiveError, match="leads out") as e:
        unpack_to(_archive(_member("esc", tarfile.SYMTYPE, link=target)), str(out))
    assert e.value.member == "esc"
    assert not os.path.lexists(out / "esc")


def test_symlink_then_file_through_it_is_refused(out: Path) -> None:
    with pytest.raises(UnsafeArchiveError, match="through .* a symbolic link") as e:
        unpack_to(_archive(
            _member("real", tarfile.DIRTYPE, mode=0o755),
            _member("in", tarfile.SYMTYPE, link="real"),
            _member("in/f", data=b"x"),
        ), str(out))
    assert e.value.member == "in/f"
    assert not (out / "real/f").exists()


def test_file_over_a_link_replaces_the_link_not_its_target(tmp_path: Path, out: Path) -> None:
    victim = tmp_path / "victim"
    victim.write_bytes(b"keep")
    out.mkdir()
    (out / "f").symlink_to(victim)
    unpack_to(_archive(_member("f", data=b"new")), str(out))
    assert victim.read_bytes() == b"keep"
    assert not (out / "f").is_symlink() and (out / "f").read_bytes() == b"new"


@pytest.mark.parametrize("target,why", [
    ("/etc/passwd", "not a path inside"),
    ("../../etc/passwd", "not a path inside"),
    ("missing", "not unpacked before"),
])
def test_hard_link_out_is_refused(out: Path, target: str, why: str) -> None:
    with pytest.raises(UnsafeArchiveError, match=why) as e:
        unpack_to(_archive(_member("h", tarfile.LNKTYPE, link=target)), str(out))
    assert e.value.member == "h"
    assert not os.path.lexists(out / "h")


def test_hard_link_behind_a_link_is_refused(out: Path) -> None:
    with pytest.raises(UnsafeArchiveError, match="behind a symbolic link"):
        unpack_to(_archive(
            _member("d", tarfile.DIRTYPE, mode=0o755),
            _member("d/f", data=b"x"),
            _member("l", tarfile.SYMTYPE, link="d"),
            _member("h", tarfile.LNKTYPE, link="l/f"),
        ), str(out))


def test_setuid_setgid_sticky_bits_are_stripped(out: Path) -> None:
    unpack_to(_archive(
        _member("suid", data=b"#!/bin/sh\n", mode=0o4755),
        _member("sgid", data=b"", mode=0o2755),
        _member("sticky", tarfile.DIRTYPE, mode=0o3777),
    ), str(out))
    assert stat.S_IMODE((out / "suid").stat().st_mode) == 0o755
    assert stat.S_IMODE((out / "sgid").stat().st_mode) == 0o755
    assert stat.S_IMODE((out / "sticky").stat().st_mode) == 0o777


@pytest.mark.parametrize("kind,what", [
    (tarfile.CHRTYPE, "character device"),
    (tarfile.BLKTYPE, "block device"),
    (tarfile.FIFOTYPE, "FIFO"),
])
def test_device_nodes_and_fifos_are_refused_by_name(out: Path, kind: bytes, what: str) -> None:
    with pytest.raises(UnsafeArchiveError, match=what) as e:
        unpack_to(_archive(_member("dev/node", kind, mode=0o666)), str(out))
    assert e.value.member == "dev/node"
    assert not os.path.lexists(out / "dev/node")


def test_file_cannot_replace_a_directory(out: Path) -> None:
    with pytest.raises(UnsafeArchiveError, match="a directory"):
        unpack_to(_archive(
            _member("d", tarfile.DIRTYPE, mode=0o755),
            _member("d/x", data=b"1"),
            _member("d", data=b"2"),
        ), str(out))
    assert (out / "d/x").read_bytes() == b"1"
