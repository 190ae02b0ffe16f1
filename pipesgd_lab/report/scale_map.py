"""Heatmaps of the scale map (docs/scale-map.md): for one model and step time, the predicted speedup
of the best Pipe-SGD arm over the best DDP arm for every (inter-node link, p), each cell labelled
with the winning arm. ``python -m pipesgd_lab.report scale-map --out docs/img`` draws the documented set."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from pipesgd.timing.model import Link
from pipesgd.timing.presets import COMPUTE, INTER_NODE_LINKS, LINKS, MODELS, compute_preset
from pipesgd.timing.scale import speedup_grid
from .figure import new_figure

log = logging.getLogger(__name__)

WORKERS = tuple(2**k for k in range(1, 11))
"""p = 2 .. 1024."""


@dataclass(frozen=True)
class Panel:
    """One heatmap: a model preset at a step time, and what the caption says that time is."""

    model: str
    compute_ms: float
    compute_label: str
    file: str


def documented_panels() -> list[Panel]:
    """Every model at each of its published step times; a model with none (no cell is cited) at
    ResNet-50's A100 step, which is no measurement of it: only the gradient size changes."""
    panels = [Panel(c.model, c.step_ms, f"{c.gpu.upper()}, batch {c.batch}, {c.precision}: {c.step_ms:.1f} ms "
                    "(published)", f"scale-map-{c.model}-{c.gpu}.png") for c in COMPUTE]
    a100 = compute_preset("resnet50", "a100").step_ms
    panels += [Panel(m, a100, f"{a100:.1f} ms = ResNet-50's A100 step, an input (no published step time)",
                     f"scale-map-{m}.png") for m in MODELS
               if MODELS[m].panel and all(c.model != m for c in COMPUTE)]
    return panels


def render_panel(panel: Panel, out: Path) -> Path:
    """Draw one heatmap to ``out/panel.file``; returns the path."""
    from matplotlib.colors import TwoSlopeNorm

    model = MODELS[panel.model]
    links = [LINKS[name] for name in INTER_NODE_LINKS]
    grid = speedup_grid(model.params, panel.compute_ms / 1e3,
                        [Link.from_bandwidth(lk.bits_per_second, lk.latency_s) for lk in links], WORKERS,
                        shapes=model.shapes)
    values = [[cell["pipe_over_ddp"] for cell in row] for row in grid]
    flat = [v for row in values for v in row]
    fig = new_figure(11, 4.2)
    ax = fig.add_subplot()
    norm = TwoSlopeNorm(vcenter=1.0, vmin=min(0.5, min(flat)), vmax=max(2.0, max(flat)))
    image = ax.imshow(values, cmap="RdBu", norm=norm, aspect="auto", origin="lower")
    for i, row in enumerate(grid):
        for j, cell in enumerate(row):
            dark = abs(norm(cell["pipe_over_ddp"]) - 0.5) > 0.3
            ax.text(j, i, f"{cell['pipe_over_ddp']:.2f}\n{cell['winner']}", ha="center", va="center", fontsize=7,
                    color="white" if dark else "black")
    ax.set_xticks(range(len(WORKERS)), [str(p) for p in WORKERS])
    ax.set_yticks(range(len(links)), [f"{lk.bits_per_second / 1e9:g} Gbit/s" for lk in links])
    ax.set_xlabel("p (GPUs in data parallel), one NIC per GPU, α = 14 µs per ring step")
    ax.set_ylabel("inter-node link")
    ax.set_title(f"{model.name} ({model.params / 1e6:.1f} M params), compute {panel.compute_label}:\n"
                 "best Pipe-SGD arm over best DDP arm (cell: speedup, and the fastest arm overall)", fontsize=10)
    fig.colorbar(image, ax=ax, label="best pipe / best DDP speedup")
    out.mkdir(parents=True, exist_ok=True)
    path = out / panel.file
    fig.savefig(path)
    log.info("wrote %s", path)
    return path


def render_scale_maps(out: str | Path) -> list[Path]:
    """Every documented panel, drawn into ``out``."""
    return [render_panel(panel, Path(out)) for panel in documented_panels()]
