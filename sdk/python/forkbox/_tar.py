"""Directories as one tar stream, for `files.upload_dir`/`download_dir`."""

from __future__ import annotations

import io
import os
import tarfile


def pack_dir(local_dir: str) -> bytes:
    """The contents of `local_dir` (not the directory itself) as a tar."""
    if not os.path.isdir(local_dir):
        raise NotADirectoryError(local_dir)
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name in sorted(os.listdir(local_dir)):
            tar.add(os.path.join(local_dir, name), arcname=name)
    return buf.getvalue()


def unpack_to(tar_bytes: bytes, local_dir: str) -> None:
    """Extracts a tar into `local_dir` (created if missing). Entries that
    would land outside it, devices and links pointing out are refused."""
    os.makedirs(local_dir, exist_ok=True)
    with tarfile.open(fileobj=io.BytesIO(tar_bytes), mode="r") as tar:
        if hasattr(tarfile, "data_filter"):
            tar.extractall(local_dir, filter="data")
            return
        root = os.path.realpath(local_dir)
        for m in tar.getmembers():
            target = os.path.realpath(os.path.join(root, m.name))
            if not (target == root or target.startswith(root + os.sep)):
                raise ValueError(f"tar entry {m.name!r} would land outside {local_dir}")
            if m.isdev() or (m.issym() or m.islnk()) and os.path.isabs(m.linkname):
                raise ValueError(f"tar entry {m.name!r} is a device or an absolute link")
        tar.extractall(local_dir)
