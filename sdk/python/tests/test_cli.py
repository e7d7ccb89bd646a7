"""End to end: the `forkbox` CLI (target/release/forkbox) against a real
forkboxd booting real microVMs. The `daemon_url` fixture sets FORKBOX_URL,
which the CLI reads."""

from __future__ import annotations

import json
import os
import stat
import subprocess
from pathlib import Path
from typing import Iterator, List

import pytest

REPO = Path(__file__).resolve().parents[3]
FORKBOX = os.environ.get("FORKBOX_CLI") or str(REPO / "target" / "release" / "forkbox")


def forkbox(*args: str, check: bool = True, env: dict | None = None,
            timeout: float = 300) -> subprocess.CompletedProcess:
    p = subprocess.run([FORKBOX, *args], capture_output=True, text=True, timeout=timeout,
                       env=env, stdin=subprocess.DEVNULL)
    if check and p.returncode != 0:
        pytest.fail(f"forkbox {' '.join(args)} exited {p.returncode}:\n"
                    f"stdout: {p.stdout}\nstderr: {p.stderr}")
    return p


def ids(listing: List[dict]) -> List[str]:
    return [s["id"] for s in listing]


@pytest.fixture(scope="module")
def sb(daemon_url: str) -> Iterator[str]:
    info = json.loads(forkbox("sandbox", "create", "minimal", "--timeout", "600",
                              "--label", "suite=cli", "--env", "CLI_VAR=from-create",
                              "--json").stdout)
    assert info["state"] == "running"
    assert info["metadata"] == {"suite": "cli"}
    yield info["id"]
    forkbox("sandbox", "kill", info["id"], check=False)


def test_cli_sandbox_ls_json_and_table_show_it(sb: str) -> None:
    listing = json.loads(forkbox("sandbox", "ls", "--json").stdout)
    assert sb in ids(listing)
    assert json.loads(forkbox("sandbox", "ls", "--label", "suite=cli", "--json").stdout)[0]["id"] == sb
    assert json.loads(forkbox("sandbox", "ls", "--label", "suite=none", "--json").stdout) == []
    table = forkbox("sandbox", "ls").stdout.splitlines()
    assert table[0].split()[:3] == ["ID", "TEMPLATE", "STATE"]
    assert any(line.startswith(sb) and "running" in line and "suite=cli" in line for line in table)
    info = forkbox("sandbox", "info", sb).stdout
    assert "state:" in info and "running" in info
    assert json.loads(forkbox("sandbox", "info", sb, "--json").stdout)["id"] == sb


def test_cli_exec_streams_output_and_passes_the_exit_code(sb: str) -> None:
    p = forkbox("exec", sb, "--", "sh", "-c", "echo out; echo err >&2; exit 3", check=False)
    assert (p.returncode, p.stdout, p.stderr) == (3, "out\n", "err\n")
    p = forkbox("exec", sb, "--cwd", "/tmp", "--env", "A=b c", "--", "sh", "-c",
                'echo "$A"; echo "$CLI_VAR"; pwd')
    assert p.stdout.splitlines() == ["b c", "from-create", "/tmp"]


def test_cli_exec_signal_timeout_and_missing_command(sb: str) -> None:
    assert forkbox("exec", sb, "--", "sh", "-c", "kill -9 $$", check=False).returncode == 137
    assert forkbox("exec", sb, "--timeout", "1", "--", "sleep", "30",
                   check=False).returncode == 124
    assert forkbox("exec", sb, "--", "/no/such/cmd", check=False).returncode == 127


def test_cli_exec_json_is_one_result(sb: str) -> None:
    p = forkbox("exec", sb, "--json", "--", "sh", "-c", "echo hi; exit 2", check=False)
    assert p.returncode == 2
    out = json.loads(p.stdout)
    assert (out["stdout"], out["exit_code"], out["timed_out"]) == ("hi\n", 2, False)


def test_cli_exec_failure_of_forkbox_itself_is_125(daemon_url: str) -> None:
    p = forkbox("exec", "sb-0000000000000000", "--", "true", check=False)
    assert p.returncode == 125
    assert "sb-0000000000000000" in p.stderr


def test_cli_cp_file_both_ways(sb: str, tmp_path: Path) -> None:
    src = tmp_path / "f.sh"
    src.write_bytes(b"#!/bin/sh\necho copied\n\x00\xff")
    src.chmod(0o750)
    forkbox("cp", str(src), f"{sb}:/tmp/cli/f.sh")
    assert forkbox("exec", sb, "--", "stat", "-c", "%a %s", "/tmp/cli/f.sh").stdout.split() == [
        "750", str(len(src.read_bytes()))]
    # Onto an existing guest directory: the file goes inside it.
    forkbox("cp", str(src), f"{sb}:/tmp/cli")
    back = tmp_path / "back.sh"
    forkbox("cp", f"{sb}:/tmp/cli/f.sh", str(back))
    assert back.read_bytes() == src.read_bytes()
    assert stat.S_IMODE(back.stat().st_mode) == 0o750
    into = tmp_path / "into"
    into.mkdir()
    forkbox("cp", f"{sb}:/tmp/cli/f.sh", str(into))
    assert (into / "f.sh").read_bytes() == src.read_bytes()


def test_cli_cp_directory_both_ways(sb: str, tmp_path: Path) -> None:
    src = tmp_path / "tree"
    (src / "sub" / "deeper").mkdir(parents=True)
    (src / "top.txt").write_text("top\n")
    (src / "sub" / "deeper" / "leaf.txt").write_text("leaf\n")
    (src / "sub" / "empty").mkdir()
    forkbox("cp", str(src), f"{sb}:/tmp/clitree")
    found = forkbox("exec", sb, "--", "sh", "-c",
                    "cd /tmp/clitree && find . | sort && cat sub/deeper/leaf.txt").stdout
    assert found.splitlines() == [".", "./sub", "./sub/deeper", "./sub/deeper/leaf.txt",
                                  "./sub/empty", "./top.txt", "leaf"]
    out = tmp_path / "out"
    forkbox("cp", f"{sb}:/tmp/clitree", str(out))
    assert (out / "top.txt").read_text() == "top\n"
    assert (out / "sub" / "deeper" / "leaf.txt").read_text() == "leaf\n"
    assert (out / "sub" / "empty").is_dir()
    # Into an existing local directory: the tree goes inside it.
    forkbox("cp", f"{sb}:/tmp/clitree", str(out))
    assert (out / "clitree" / "top.txt").read_text() == "top\n"


def test_cli_cp_missing_guest_path_fails_clearly(sb: str, tmp_path: Path) -> None:
    p = forkbox("cp", f"{sb}:/no/such/file", str(tmp_path / "x"), check=False)
    assert p.returncode != 0
    assert "/no/such/file" in p.stderr


def test_cli_template_list_and_logs(sb: str) -> None:
    names = [t["name"] for t in json.loads(forkbox("template", "list", "--json").stdout)]
    assert "minimal" in names
    assert forkbox("template", "list").stdout.splitlines()[0].startswith("NAME")
    forkbox("exec", sb, "--user", "root", "--", "sh", "-c", "echo cli-logs-marker > /dev/console")
    assert "cli-logs-marker" in forkbox("logs", sb).stdout
    logs = json.loads(forkbox("logs", sb, "--json").stdout)
    assert logs["sandbox"] == sb and "cli-logs-marker" in logs["lines"]


def test_cli_sandbox_kill_by_id_and_by_label(sb: str) -> None:
    other = json.loads(forkbox("sandbox", "create", "minimal", "--label", "suite=cli-kill",
                               "--json").stdout)["id"]
    p = forkbox("sandbox", "kill", "--label", "suite=cli-kill", "--json")
    assert json.loads(p.stdout) == {"killed": [other]}
    assert other not in ids(json.loads(forkbox("sandbox", "ls", "--json").stdout))
    dead = json.loads(forkbox("sandbox", "ls", "--all", "--json").stdout)
    assert any(s["id"] == other and s["state"] == "dead" for s in dead)
    p = forkbox("sandbox", "kill", other, check=False)
    assert p.returncode != 0 and "forkboxd" in p.stderr


def test_cli_sandbox_fork_pause_resume(sb: str) -> None:
    children = json.loads(forkbox("sandbox", "fork", sb, "--count", "1", "--json").stdout)
    assert len(children) == 1, children
    child = children[0]["sandbox"]
    assert child["parent"] == sb
    try:
        p = forkbox("exec", child["id"], "--", "sh", "-c", 'echo "$CLI_VAR"')
        assert p.stdout == "from-create\n"
    finally:
        forkbox("sandbox", "kill", child["id"])
    assert json.loads(forkbox("sandbox", "pause", sb, "--json").stdout)["state"] == "paused"
    assert forkbox("sandbox", "resume", sb).stdout.split() == [sb, "running"]
    assert forkbox("exec", sb, "--", "echo", "awake").stdout == "awake\n"


def test_cli_template_bake_file_then_create_and_rm(daemon_url: str, tmp_path: Path) -> None:
    f = tmp_path / "t.toml"
    f.write_text('image = "minimal"\n'
                 'setup = ["echo baking-step", "echo made > /tmp/baked"]\n'
                 'ready = { file = "/tmp/baked" }\n'
                 '[limits]\ncpus = 0.5\n'
                 '[envs]\nT_VAR = "from-template"\n')
    p = forkbox("template", "bake", "cli-t", "--file", str(f))
    assert "baking-step" in p.stderr
    assert "baked cli-t" in p.stdout
    assert "cli-t" in [t["name"] for t in json.loads(forkbox("template", "list", "--json").stdout)]
    made = json.loads(forkbox("sandbox", "create", "cli-t", "--memory-limit", "300",
                              "--json").stdout)
    new = made["id"]
    try:
        # The template's CPU limit, the creation's memory limit.
        assert made["metrics"]["limits"] == {"cpus": 0.5, "memory_mib": 300}, made
        p = forkbox("exec", new, "--", "sh", "-c", 'cat /tmp/baked; echo "$T_VAR"')
        assert p.stdout == "made\nfrom-template\n"
    finally:
        forkbox("sandbox", "kill", new)
    forkbox("template", "rm", "cli-t")
    assert "cli-t" not in [t["name"] for t in json.loads(forkbox("template", "list", "--json").stdout)]


def test_cli_template_bake_failure_shows_the_step_and_its_output(daemon_url: str,
                                                                  tmp_path: Path) -> None:
    f = tmp_path / "bad.toml"
    f.write_text('image = "minimal"\nsetup = ["true", "echo boom-output; exit 3"]\n')
    p = forkbox("template", "bake", "cli-bad", "--file", str(f), check=False)
    assert p.returncode == 1
    assert "setup[1]" in p.stderr
    assert "boom-output" in p.stderr


def test_cli_template_bake_builtin_by_name(daemon_url: str) -> None:
    p = forkbox("template", "bake", "minimal", "--json")
    events = [json.loads(line) for line in p.stdout.splitlines()]
    assert events[-1]["type"] == "done"
    assert events[-1]["template"]["name"] == "minimal"


def test_cli_unreachable_daemon_says_to_start_it(tmp_path: Path) -> None:
    env = dict(os.environ, FORKBOX_URL=f"unix://{tmp_path}/none.sock")
    p = forkbox("sandbox", "ls", env=env, check=False)
    assert p.returncode == 1
    assert "forkbox daemon" in p.stderr
