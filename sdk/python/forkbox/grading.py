"""Grading where the policy has no hand: in a fresh sandbox of the
pristine template, with only the rollout's declared outputs carried over.

    from forkbox.grading import grade_in_fresh_sandbox
    g = grade_in_fresh_sandbox(rollout, outputs=["/task/calc.py"],
                               command="python3 /task/grade.py")
    reward = g.result.exit_code == 0

Nothing else the policy changed reaches the grader: not its edits to the
tests or the grader, not an interpreter start-up hook it planted
(`sitecustomize.py`, `usercustomize.py`, a `.pth` file), not `PATH`, shell
rc files, `/tmp` or processes it left running. Each output is read from
the rollout with the policy's user's rights (`output_user`, default the
image's `user`), so an output that is a link to a file only root may read
(the expected answer, say) is refused, not followed; a directory output
may not hold links at all. What is carried over is written into the
grading sandbox as root, at the same path, in place of what the template
has there (a directory output replaces the template's directory whole).

Limits: the outputs themselves are the policy's, and the grader runs them
(an output module that patches the test framework on import is not
stopped here; run such graders so they do not import the policy's code
into their own process). The grading sandbox is a fork of the template's
zygote: it has the template's state, not the rollout's starting state if
the rollout was forked mid-episode from elsewhere (pass `template=` a
snapshot of that state, `sb.create_snapshot(...)`, to grade from it).
"""

from __future__ import annotations

import io
import stat
import tarfile
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Union

from .exceptions import ForkboxError, NotFoundError
from .models import CommandResult
from .sandbox import Sandbox


class OutputError(ForkboxError):
    """A declared output could not be carried over as the policy's user
    may see it: a link to somewhere that user may not read, a link inside
    a directory output, a device or FIFO. The policy's doing: score it as
    a failure (`infrastructure` is False). `path` names it."""

    def __init__(self, path: str, why: str) -> None:
        super().__init__(f"output {path}: {why}", kind="bad_output",
                         detail={"infrastructure": False, "path": path})
        self.path = path


@dataclass
class Graded:
    """What `grade_in_fresh_sandbox` did."""

    result: CommandResult
    """The grader command's result, in the fresh sandbox."""
    carried: Dict[str, int] = field(default_factory=dict)
    """Each output carried over and its size in bytes (a directory: its
    tar archive's)."""
    missing: List[str] = field(default_factory=list)
    """Declared outputs the rollout did not have (the grader sees them
    missing too)."""


def _carry_file(src: Sandbox, dst: Sandbox, path: str, user: Union[str, int]) -> int:
    st = src.files.stat(path, user=user)
    kind = st.get("kind")
    if kind == "symlink":
        # Read through the link as the policy's user: what that user may
        # read is carried as a plain file; anything else is refused.
        try:
            data = src.files.read(path, format="bytes", user=user)
        except ForkboxError as e:
            raise OutputError(path, f"a link the policy's user may not follow ({e})") from e
        mode = 0o644
    elif kind == "file":
        data = src.files.read(path, format="bytes", user=user)
        mode = int(st.get("mode", 0o644)) & 0o777
    else:
        raise OutputError(path, f"is a {kind}, not a file or directory")
    assert isinstance(data, bytes)
    dst.files.write(path, data, mode=mode, user="root")
    return len(data)


def _carry_dir(src: Sandbox, dst: Sandbox, path: str, user: Union[str, int]) -> int:
    archive = src.files.download_tar(path, user=user)
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        for m in tar.getmembers():
            if m.issym() or m.islnk():
                raise OutputError(f"{path}/{m.name}", "is a link; a directory output may "
                                  "hold only files and directories")
            if not (m.isfile() or m.isdir()):
                raise OutputError(f"{path}/{m.name}", "is not a file or directory")
            if m.mode & (stat.S_ISUID | stat.S_ISGID):
                raise OutputError(f"{path}/{m.name}", "is setuid or setgid")
    _remove(dst, path)
    dst.files.make_dir(path, user="root")
    dst.files.upload_tar(path, archive, user="root")
    return len(archive)


def _remove(sb: Sandbox, path: str) -> None:
    try:
        sb.files.remove(path, recursive=True, user="root")
    except NotFoundError:
        pass


def grade_in_fresh_sandbox(rollout: Sandbox, outputs: Sequence[str], command: str, *,
                           template: Optional[str] = None, user: Union[str, int] = "root",
                           output_user: Union[str, int] = "user", timeout: Optional[float] = 300,
                           cwd: Optional[str] = None, url: Optional[str] = None) -> Graded:
    """Creates a sandbox from `template` (default: the rollout's), carries
    each of `outputs` (absolute guest paths, files or directories) over
    from `rollout`, runs `command` there as `user` (default root) and
    kills it. Raises `OutputError` for an output that cannot be carried
    (see the module's doc); a missing output is listed in `missing`, not
    an error."""
    for p in outputs:
        if not p.startswith("/"):
            raise ValueError(f"output {p!r}: an absolute guest path")
    graded = Graded(result=CommandResult("", "", None, 0.0, False))
    with Sandbox.create(template or rollout.template, timeout=max(600.0, (timeout or 0) * 2),
                        url=url) as fresh:
        for path in outputs:
            try:
                st = rollout.files.stat(path, user=output_user)
            except NotFoundError:
                graded.missing.append(path)
                _remove(fresh, path)
                continue
            if st.get("kind") == "dir":
                graded.carried[path] = _carry_dir(rollout, fresh, path, output_user)
            else:
                graded.carried[path] = _carry_file(rollout, fresh, path, output_user)
        graded.result = fresh.commands.run(command, user=user, timeout=timeout, cwd=cwd)
    return graded
