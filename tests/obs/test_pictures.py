"""The pictures: one colour per policy from one palette, a README Gantt example that crosses regions with no
overlapping micro-batch labels, a cluster map with latencies and a legend, and a simulation report a person
would forward (human column names and settings, times in hours, no raw Python values)."""

from __future__ import annotations

import html
import json
import re
from pathlib import Path
from typing import Any

import pytest

from spiderflow.viz import palette

ROOT = Path(__file__).resolve().parents[2]


def test_every_builtin_policy_has_its_own_colour_in_the_shared_palette() -> None:
    from spiderflow.core.placement import REGISTRY, load_builtin_policies
    from spiderflow.viz import simplots as plots

    load_builtin_policies()
    builtin = {n for n, f in REGISTRY.items() if getattr(f, "__module__", "").startswith("spiderflow.core.placement")}
    names = builtin - {"bruteforce"}
    assert {"spinsearch", "genetic", "ilp", "firstfit", "bace"} <= names
    assert names <= set(palette.POLICY_COLORS), names - set(palette.POLICY_COLORS)
    colours = [palette.POLICY_COLORS[n] for n in names]
    assert len(set(colours)) == len(colours)
    assert plots.policy_color is palette.policy_color and plots.POLICY_COLORS is palette.POLICY_COLORS
    assert palette.policy_color("my-policy") == palette.policy_color("my-policy") in palette.EXTRA_COLORS
    # the dashboard draws measured and predicted in the palette's colours
    page = (ROOT / "spiderflow/dashboard/index.html").read_text()
    assert palette.MEASURED in page and palette.PREDICTED in page


def _readme_gantt_args() -> list[str]:
    from scripts.readme_images import GANTT

    readme = (ROOT / "README.md").read_text()
    assert "spiderflow " + " ".join(GANTT) + " --gantt plan.png" in readme
    return GANTT


def test_the_readme_gantt_example_crosses_regions_without_overlapping_labels(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from spiderflow.cli.main import main
    from spiderflow.core.tpa.timeline import simulate_plan
    from spiderflow.formats import load_topology
    from spiderflow.viz.gantt import _PLOT_PX, _fits_label

    args = _readme_gantt_args()
    out = tmp_path / "plan.png"
    assert main([*args, "--gantt", str(out), "--json"]) == 0
    doc: dict[str, Any] = json.loads(capsys.readouterr().out)
    plan_doc = doc.get("plan", doc)
    clusters = [s["cluster"] for s in plan_doc["stages"]]
    assert len(clusters) >= 2 and len(set(clusters)) >= 2, clusters  # a pipeline across regions
    assert out.stat().st_size > 10_000
    # Labels: a block gets its micro-batch number only when the number fits inside it.
    from spiderflow.core.catalog import model_preset
    from spiderflow.core.domain import GpuRange, JobSpec
    from spiderflow.formats import plan_from_dict

    topo = load_topology(ROOT / "examples/topology-3.yaml")
    plan = plan_from_dict(plan_doc, strict=False)
    job = JobSpec(id="g", model=model_preset("gpt3-13b"), global_batch=32, micro_batch=2, seq_len=2048,
                  gpus=GpuRange(min=24, max=40))
    tl = simulate_plan(plan, topo, job, record=True)
    span = tl.makespan_s
    for o in tl.ops:
        if _fits_label(o.end_s - o.start_s, span, o.micro_batch):
            assert (o.end_s - o.start_s) / span * _PLOT_PX >= 6.5 * (len(str(o.micro_batch)) + 1)
    assert not _fits_label(span / 300, span, 12)  # 300 blocks in a row: no numbers
    assert _fits_label(span / 8, span, 12)


def test_the_map_labels_latency_and_has_a_legend(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from matplotlib.axes import Axes

    from spiderflow.cli.commands.topology import draw_map
    from spiderflow.formats import load_topology

    texts: list[str] = []
    legends: list[list[str]] = []
    real_annotate, real_legend = Axes.annotate, Axes.legend

    def annotate(self: Axes, text: str, *a: Any, **k: Any) -> Any:
        texts.append(text)
        return real_annotate(self, text, *a, **k)

    def legend(self: Axes, *a: Any, **k: Any) -> Any:
        legends.append([h.get_label() for h in k.get("handles", [])])
        return real_legend(self, *a, **k)

    monkeypatch.setattr(Axes, "annotate", annotate)
    monkeypatch.setattr(Axes, "legend", legend)
    draw_map(load_topology(ROOT / "examples/topology-3.yaml"), tmp_path / "map.png")
    assert (tmp_path / "map.png").stat().st_size > 10_000
    assert "1.12 Gbit/s · 11 ms" in texts and "450 Mbit/s · 62 ms" in texts
    assert legends and any("latency in ms" in label for label in legends[0])


def test_the_report_reads_like_a_report(tmp_path: Path) -> None:
    from spiderflow.viz.simplots import write_plots

    pol = {name: {"jobs": 2, "completed": 2, "mean_jct_s": 12520.0, "p95_jct_s": 20000.0, "makespan_s": 30000.0,
                  "throughput_tokens_per_s": 1.5e5, "sched_overhead_s": 0.2, "decisions": 2,
                  "overhead_per_decision_mean_s": 0.1, "gpu_utilization": 0.5, "cost_usd": 3.0, "restarts": 0,
                  "records": [{"status": "completed", "jct_s": 12520.0}, {"status": "completed", "jct_s": 20000.0}]}
           for name in ("spinsearch", "firstfit")}
    doc = {"topology": "t.json", "clusters": 8, "pool_gpus": 64, "trace": "tr.json", "jobs": 2, "objective": "jct",
           "seed": 1, "time_limit_s": None, "overhead_mode": "measured", "events": 0, "releases": True,
           "budget": {"trials": 3, "population": 8}, "policies": pol}
    paths = write_plots(doc, tmp_path)
    page = (tmp_path / "report.html").read_text()
    text = html.unescape(re.sub(r"data:image/png;base64,[A-Za-z0-9+/=]+", "", page))
    assert "Mean JCT (h)" in text and "3.48" in text  # 12,520 s in hours, as the CLI shows it
    assert "1.252e+04" not in text and "12520" not in text
    for raw in ("{'", "None", "True", "pool_gpus", "time_limit_s", "mean_jct_s", "overhead_mode"):
        assert raw not in re.sub(r"<[^>]+>", " ", text), raw
    assert "GPUs in the pool" in text and "Waiting for released GPUs" in text and "trials: 3, population: 8" in text
    assert {p.name for p in paths} == {"jct_cdf.png", "throughput_cost.png", "overhead_vs_clusters.png",
                                       "report.html"}
