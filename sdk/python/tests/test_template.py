"""Template build, bake, list and delete against a real forkboxd."""

from __future__ import annotations

import gc
import uuid
from typing import Any, Dict, List

import pytest

from forkbox import ConflictError, NotFoundError, Sandbox, Template, TemplateError
from forkbox._client import shared_client


def _name(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


def _busy_connections() -> int:
    """Connections of the shared client that a response still holds."""
    pool = shared_client()._http._transport._pool  # type: ignore[attr-defined]
    return sum(1 for c in pool.connections if not (c.is_idle() or c.is_closed()))


def test_template_build_failing_setup_raises_with_step_and_output(daemon_url: str) -> None:
    events: List[Dict[str, Any]] = []
    name = _name("broken")
    # With the collector off, only the SDK itself can close the bake's
    # stream. One it left open was closed by the collector whenever it ran,
    # once while this thread held httpcore's pool lock: the next test then
    # waited for itself for ten minutes (encode/httpcore#990).
    gc.disable()
    try:
        with pytest.raises(TemplateError) as ei:
            Template.build(name, setup=["echo fine", "echo going wrong >&2; exit 7"],
                           on_progress=events.append)
        assert _busy_connections() == 0, "the failed bake's response is still open"
    finally:
        gc.enable()
    e = ei.value
    assert e.step == "setup[1]", e.detail
    assert "going wrong" in e.output
    assert not e.infrastructure
    assert events[-1]["type"] == "failed"
    assert any(ev["type"] == "step" and ev["step"] == "boot" for ev in events)
    assert any(ev["type"] == "output" and "fine" in ev.get("data", "") for ev in events)
    assert name not in [t.name for t in Template.list() if t.state == "ready"]
    try:
        Template.delete(name)
    except NotFoundError:
        pass


def test_template_build_then_create_list_bake_delete(daemon_url: str) -> None:
    events: List[Dict[str, Any]] = []
    name = _name("good")
    info = Template.build(name, setup=["mkdir -p /srv && echo baked > /srv/flag"],
                          ready={"file": "/srv/flag"}, ready_timeout=30,
                          envs={"TEMPLATE_VAR": "from-template"}, on_progress=events.append)
    try:
        assert info.name == name
        assert info.setup == ["mkdir -p /srv && echo baked > /srv/flag"]
        assert events[-1]["type"] == "done"
        listed = {t.name: t for t in Template.list()}
        assert listed[name].state == "ready"
        assert listed[name].from_sandbox is None
        assert listed[name].ready == {"file": "/srv/flag"}
        with pytest.raises(ConflictError):
            Template.build(name)
        # A ready template bakes to a single `done`.
        again: List[Dict[str, Any]] = []
        assert Template.bake(name, on_progress=again.append).name == name
        assert [ev["type"] for ev in again] == ["done"]
        with Sandbox.create(name, timeout=600) as sb:
            r = sb.commands.run("cat /srv/flag; echo $TEMPLATE_VAR")
            assert r.stdout == "baked\nfrom-template\n"
    finally:
        Template.delete(name)
    assert name not in [t.name for t in Template.list()]


def test_template_bake_builtin_ends_ready(daemon_url: str) -> None:
    events: List[Dict[str, Any]] = []
    info = Template.bake("minimal", on_progress=events.append)
    assert info.name == "minimal"
    assert events[-1]["type"] == "done"
    assert {t.name: t.state for t in Template.list()}["minimal"] == "ready"
