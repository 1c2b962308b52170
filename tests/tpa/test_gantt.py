"""Gantt charts: every format is produced, self-contained, and names the stages' clusters."""

from __future__ import annotations

from pathlib import Path

import pytest

from spiderflow.core.domain import JobSpec, Topology
from spiderflow.core.errors import ValidationError
from spiderflow.core.tpa import plan_chain
from spiderflow.viz import render_gantt


@pytest.fixture
def planned(three_region_topo: Topology, job_6b7: JobSpec) -> tuple[Topology, JobSpec, object]:
    plan = plan_chain(three_region_topo, job_6b7, [("ohio", 16), ("tokyo", 8), ("paris", 8)])
    return three_region_topo, job_6b7, plan


def test_png_svg_and_html(planned: tuple, tmp_path: Path) -> None:  # type: ignore[type-arg]
    topo, job, plan = planned
    png = render_gantt(plan, topo, job, tmp_path / "g.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    svg = render_gantt(plan, topo, job, tmp_path / "sub" / "g.svg").read_text()
    assert "<svg" in svg and "ohio" in svg and "paris" in svg
    page = render_gantt(plan, topo, job, tmp_path / "g.html").read_text()
    assert page.startswith("<!DOCTYPE html>")
    assert "<svg" in page and "<?xml" not in page
    assert "http://" not in page.split("<svg", 1)[0] and "<script src" not in page  # self-contained
    for st in plan.stages:
        assert f"<td>{st.cluster}</td>" in page


def test_unknown_format_is_rejected(planned: tuple, tmp_path: Path) -> None:  # type: ignore[type-arg]
    topo, job, plan = planned
    with pytest.raises(ValidationError, match="path"):
        render_gantt(plan, topo, job, tmp_path / "g.pdf")
