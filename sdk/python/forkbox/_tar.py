"""Directories as one tar stream, for `files.upload_dir`/`download_dir`.

An archive from a guest is hostile: `unpack_to` checks every member
before making anything for it and stops at the first one it cannot
unpack safely, raising `UnsafeArchiveError` naming it (nothing is skipped
silently; members before it stay unpacked). The rules are those of
`forkbox cp` (crates/forkbox/src/cli/unpack.rs): nothing is written
outside the target (no absolute names, no `..`, never through a symbolic
link, whether the archive made it or it was there); a symbolic link is
made only if it stays inside (relative, its `..` only leading and no more
of them than its depth), a hard link only to a regular file already
inside; only files, directories and such links are made (no devices,
FIFOs or sparse files); modes keep their permission bits only (no setuid,
setgid or sticky bit); owners are never changed.
"""

from __future__ import annotations

import io
import os
import shutil
import stat
import tarfile
from typing import List, Tuple

from .exceptions import UnsafeArchiveError


def pack_dir(local_dir: str) -> bytes:
    """The contents of `local_dir` (not the directory itself) as a tar."""
    if not os.path.isdir(local_dir):
        raise NotADirectoryError(local_dir)
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name in sorted(os.listdir(local_dir)):
            tar.add(os.path.join(local_dir, name), arcname=name)
    return buf.getvalue()


def _inside(member: str, name: str) -> List[str]:
    """`name` as path parts inside the target ([] for the target itself);
    absolute names and `..` are refused."""
    if name.startswith("/"):
        raise UnsafeArchiveError(
            member, "has an absolute path: members must name paths inside the target")
    parts = []
    for p in name.split("/"):
        if p in ("", "."):
            continue
        if p == "..":
            raise UnsafeArchiveError(member, "names `..`: it would leave the target directory")
        parts.append(p)
    return parts


def _symlink_stays_inside(parts: List[str], target: str) -> bool:
    """Whether a link at `parts` to `target` resolves inside the target
    whatever the other links there are: relative, its `..` all first and
    no more of them than the link's depth."""
    if target.startswith("/"):
        return False
    ups, descended = 0, False
    for p in target.split("/"):
        if p in ("", "."):
            continue
        if p == "..":
            if descended:
                return False
            ups += 1
        else:
            descended = True
    return ups <= len(parts) - 1


def _lstat(path: str):
    try:
        return os.lstat(path)
    except FileNotFoundError:
        return None


def _make_parents(root: str, parts: List[str], member: str) -> None:
    """Each directory above `parts` a real directory: made if missing."""
    d = root
    for p in parts[:-1]:
        d = os.path.join(d, p)
        st = _lstat(d)
        if st is None:
            os.mkdir(d, 0o755)
        elif stat.S_ISLNK(st.st_mode):
            raise UnsafeArchiveError(member, f"would be written through {d}, a symbolic link")
        elif not stat.S_ISDIR(st.st_mode):
            raise UnsafeArchiveError(member, f"would replace {d}, a file, with a directory")


def _clear(dest: str, member: str) -> None:
    """Removes what is at `dest` (never following a link); a directory is
    not replaced."""
    st = _lstat(dest)
    if st is None:
        return
    if stat.S_ISDIR(st.st_mode):
        raise UnsafeArchiveError(member, f"would replace {dest}, a directory")
    os.unlink(dest)


def _kind(m: tarfile.TarInfo) -> str:
    if m.ischr():
        return "a character device"
    if m.isblk():
        return "a block device"
    if m.isfifo():
        return "a FIFO"
    if m.issparse():
        return "a sparse file"
    return f"a member of type {m.type!r}"


def unpack_to(tar_bytes: bytes, local_dir: str) -> None:
    """Extracts a tar from a guest into `local_dir` (created if missing),
    refusing with `UnsafeArchiveError` any member that is not safe (see
    the module's comment)."""
    os.makedirs(local_dir, exist_ok=True)
    root = os.path.realpath(local_dir)
    dir_modes: List[Tuple[str, int]] = []
    with tarfile.open(fileobj=io.BytesIO(tar_bytes), mode="r:") as tar:
        for m in tar:
            member = m.name
            parts = _inside(member, m.name)
            mode = m.mode & 0o777
            if not parts:
                if m.isdir():
                    continue  # the target itself (`./`): left as it is
                raise UnsafeArchiveError(member, "would replace the target directory")
            _make_parents(root, parts, member)
            dest = os.path.join(root, *parts)
            if m.isdir():
                st = _lstat(dest)
                if st is not None and not stat.S_ISDIR(st.st_mode):
                    os.unlink(dest)
                    st = None
                if st is None:
                    os.mkdir(dest, 0o700)
                dir_modes.append((dest, mode))
            elif m.type in (tarfile.REGTYPE, tarfile.AREGTYPE, tarfile.CONTTYPE):
                _clear(dest, member)
                # O_EXCL: never opens through a link.
                fd = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
                with os.fdopen(fd, "wb") as out:
                    src = tar.extractfile(m)
                    if src is not None:
                        shutil.copyfileobj(src, out)
                    os.fchmod(out.fileno(), mode)
            elif m.issym():
                if not m.linkname or not _symlink_stays_inside(parts, m.linkname):
                    raise UnsafeArchiveError(
                        member, f"is a symbolic link to {m.linkname!r}, "
                        "which leads out of the target directory")
                _clear(dest, member)
                os.symlink(m.linkname, dest)
            elif m.islnk():
                why = None
                try:
                    linked = _inside(member, m.linkname)
                except UnsafeArchiveError:
                    linked = []
                if not linked:
                    why = "is not a path inside the target"
                else:
                    d, behind = root, False
                    for p in linked[:-1]:
                        d = os.path.join(d, p)
                        st = _lstat(d)
                        behind = behind or st is None or not stat.S_ISDIR(st.st_mode)
                    st = _lstat(os.path.join(root, *linked))
                    if behind:
                        why = "lies behind a symbolic link"
                    elif st is None:
                        why = "was not unpacked before it"
                    elif not stat.S_ISREG(st.st_mode):
                        why = "is not a regular file"
                if why is not None:
                    raise UnsafeArchiveError(
                        member, f"is a hard link to {m.linkname!r}, which {why}")
                _clear(dest, member)
                os.link(os.path.join(root, *linked), dest, follow_symlinks=False)
            else:
                raise UnsafeArchiveError(
                    member, f"is {_kind(m)}: only files, directories and links "
                    "inside the target are unpacked")
    for d, mode in reversed(dir_modes):
        st = _lstat(d)
        if st is not None and stat.S_ISDIR(st.st_mode):
            os.chmod(d, mode)
