"""What every GPU check shares: the clone on the path (pipesgd and tests/'s references), the device,
the :class:`Check` row and the verdict of named sub-checks."""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path


from .environment import ROOT

for path in (ROOT, ROOT / "tests"):  # pipesgd, the tests' references
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))


def _device():
    """GPU 0; ``PIPESGD_GPU_CHECK_ON_CPU=1`` runs the engine check's Python on the CPU instead (how
    the check itself is kept working without a GPU; its numbers then prove nothing about CUDA)."""
    import os

    import torch

    if os.environ.get("PIPESGD_GPU_CHECK_ON_CPU") == "1":
        return torch.device("cpu")
    torch.cuda.set_device(0)
    return torch.device("cuda", 0)


@dataclass(frozen=True)
class Check:
    name: str
    budget_s: float
    what: str
    run: Callable[[Path], tuple[str, str, dict]]
    gpus: int = 1  # the GPUs it needs; skipped (at no cost) with fewer


def _verdict(parts: dict[str, bool], details: dict, good: str) -> tuple[str, str, dict]:
    bad = [k for k, ok in parts.items() if not ok]
    return ("fail", "failed: " + ", ".join(bad), details) if bad else ("pass", good, details)
