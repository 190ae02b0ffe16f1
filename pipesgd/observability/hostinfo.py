"""Which kind of host a number was produced on: the facts that decide a floating-point result on CPU.

A curve's evaluations rerun to the digit on the same kind of host and not on another CPU model:
the result follows the CPU and the math library's kernels (MKL / oneDNN dispatch, ATen's CPU
capability), not the load. Every record (curve, timing row, bench cell, crossover cell) and every
run's summary.json stores :func:`fingerprint`; :func:`host_kind` is the part two records must share
to be compared digit for digit. The core count is recorded but is not part of the kind: the
recipes pin one torch thread per worker (``dist.threads_per_worker``), so the same CPU with more
cores runs the same kernels.

:func:`fingerprint` imports torch when called (never at import); the rest is plain data.
"""

from __future__ import annotations

import os
import platform
import re
from collections.abc import Mapping

KIND_FIELDS = ("cpu_model", "cpu_capability", "torch", "blas", "mkl", "onednn")
"""The fingerprint's fields that make a host kind (:func:`host_kind`)."""
UNKNOWN = "unknown"
"""The host kind of a record that does not say where it ran."""


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo (``platform.processor()`` where there is none)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.partition(":")[2].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or UNKNOWN


def parse_build(show: str) -> dict[str, str | None]:
    """BLAS, MKL and oneDNN versions from ``torch.__config__.show()``'s text (None: not built in)."""
    def find(pattern: str) -> str | None:
        m = re.search(pattern, show)
        return m.group(1).strip() if m else None

    return {"blas": find(r"BLAS_INFO=([^,\s]+)"),
            "mkl": find(r"Math Kernel Library Version ([^\n]+?)(?: for |\n|$)"),
            "onednn": find(r"(?:MKL-DNN|oneDNN) (v[0-9][^\s(]*)")}


def fingerprint() -> dict:
    """This host: CPU model, logical core count, torch version, ATen CPU capability, BLAS / MKL /
    oneDNN versions (from ``torch.__config__.show()``), and the machine architecture."""
    import torch

    return {"cpu_model": cpu_model(), "cores": os.cpu_count(), "machine": platform.machine(),
            "torch": torch.__version__, "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            **parse_build(torch.__config__.show())}


def host_kind(host: Mapping | None) -> str:
    """A short, stable name of the host kind: the :data:`KIND_FIELDS` joined; :data:`UNKNOWN` for a
    record without a fingerprint."""
    if not host:
        return UNKNOWN
    return " | ".join(f"{host.get(k) or '-'}" for k in KIND_FIELDS)


def kind_differences(recorded: Mapping | None, here: Mapping) -> list[str]:
    """``field: recorded -> here`` for each :data:`KIND_FIELDS` entry that differs (empty: same kind;
    a record without a fingerprint differs in nothing it can name, so it is empty too)."""
    if not recorded:
        return []
    return [f"{k}: {recorded.get(k)} -> {here.get(k)}" for k in KIND_FIELDS if recorded.get(k) != here.get(k)]
