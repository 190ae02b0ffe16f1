"""What a GPU check ran on, and where the clone it runs from is: read by the runner (results.json,
gpu-check.log) and by the step-times check (step_times.json), which the runner starts as a module
of its own, so both import this module rather than each other."""

from __future__ import annotations

import datetime
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
"""The clone's root: the lab runs from a clone (the checks import tests/'s references and run
tests/gpu), never from an installed wheel."""


def environment() -> dict:
    """GPU model, driver, torch, CUDA, NCCL, host and date: what the results were measured on."""
    import platform

    info = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "host": platform.node(), "python": platform.python_version()}
    try:
        import torch
    except ImportError as e:
        return {**info, "torch": f"not importable: {e}"}
    info.update(torch=torch.__version__, cuda=torch.version.cuda, gpus=torch.cuda.device_count()
                if torch.cuda.is_available() else 0)
    if torch.cuda.is_available():
        nccl = torch.cuda.nccl.version() if torch.distributed.is_nccl_available() else None
        info.update(gpu=torch.cuda.get_device_name(0),
                    nccl=".".join(map(str, nccl)) if isinstance(nccl, tuple) else nccl)  # an int before torch 1.10
        try:
            info["driver"] = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                            capture_output=True, text=True, timeout=20).stdout.strip().splitlines()[0]
        except (OSError, IndexError, subprocess.SubprocessError):
            info["driver"] = None
    try:
        info["commit"] = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                                        timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        info["commit"] = None
    return info
