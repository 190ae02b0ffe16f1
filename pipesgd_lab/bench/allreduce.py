"""Time one allreduce algorithm on an fp32 tensor of a fixed size: the bus-bandwidth cells.

    python -m pipesgd_lab.bench.allreduce algo=ring bytes=8000000 repeats=20 nproc=2 hydra.run.dir=DIR
    python -m pipesgd_lab.emulate --workers 2 --rate 100mbit --module pipesgd_lab.bench.allreduce -- \\
        algo=native bytes=8000000 repeats=20

Arguments are ``key=value`` (so it runs unchanged under pipesgd_lab.emulate, which appends
``hydra.run.dir=DIR``): algo (a registered pipesgd.comm allreduce), bytes, repeats, warmup, nproc (local
workers when not under torchrun/emulate), hydra.run.dir, and tensors (a model preset of
pipesgd.timing.presets, e.g. ``tensors=gpt-shakespeare``: instead of one buffer of ``bytes``, one
allreduce per parameter tensor of that model, in turn, as torchft's DiLoCo sends its pseudo-gradient). Each repetition starts after a barrier;
its time is the slowest rank's (the collective is done when the last rank has its sum). Rank 0
writes ``DIR/allreduce.json`` with every repetition's seconds.
"""

from __future__ import annotations

import logging
import math
import os
import sys
import time
from pathlib import Path

log = logging.getLogger("pipesgd_lab.bench.allreduce")
KEYS = ("algo", "bytes", "repeats", "warmup", "nproc", "tensors", "hydra.run.dir")


def parse(argv: list[str]) -> dict[str, str]:
    """``key=value`` arguments; raises ValueError naming an unknown key or a bare word."""
    opts = {}
    for arg in argv:
        key, sep, value = arg.lstrip("+").partition("=")
        if not sep or key not in KEYS:
            raise ValueError(f"unexpected argument {arg!r}: expected key=value with key in {list(KEYS)}")
        opts[key] = value
    return opts


def _buffers(nbytes: int, model: str | None) -> list:
    """One fp32 buffer of ``nbytes``, or one per parameter tensor of the preset ``model``."""
    import torch

    if model is None:
        return [torch.ones(max(nbytes // 4, 1))]
    from pipesgd.timing.presets import MODELS

    return [torch.ones(math.prod(shape)) for shape in MODELS[model].shapes]


def _worker(algo: str, nbytes: int, repeats: int, warmup: int, out: str, model: str | None = None) -> None:
    import torch
    import torch.distributed as dist

    from pipesgd import dist as pdist
    from pipesgd.comm import get_allreduce
    from pipesgd.observability.runinfo import write_json_atomic

    torch.set_num_threads(1)
    fn = get_allreduce(algo)
    ctx = pdist.init("gloo")
    try:
        tensors = _buffers(nbytes, model)
        for _ in range(warmup):
            for tensor in tensors:
                fn(tensor, None, ctx.comm_group)
        mine = []
        cpu0, wall0 = os.times(), time.perf_counter()
        for _ in range(repeats):
            dist.barrier()
            t0 = time.perf_counter()
            for tensor in tensors:
                fn(tensor, None, ctx.comm_group)
            mine.append(time.perf_counter() - t0)
        # This process's CPU (all its threads, Gloo's included; kernel work done in its context
        # counts as system time) per second of the timed loop: what a reduction takes from compute.
        cpu1, wall = os.times(), time.perf_counter() - wall0
        usage = {"user": (cpu1.user - cpu0.user) / wall, "system": (cpu1.system - cpu0.system) / wall}
        everyone: list[list[float]] = [[] for _ in range(ctx.world_size)]
        dist.all_gather_object(everyone, mine)
        cpu: list[dict] = [{} for _ in range(ctx.world_size)]
        dist.all_gather_object(cpu, usage)
        if ctx.is_main:
            Path(out).parent.mkdir(parents=True, exist_ok=True)
            write_json_atomic(out, {
                "algo": algo, "bytes": 4 * sum(t.numel() for t in tensors), "tensors": len(tensors), "model": model,
                "world_size": ctx.world_size,
                "link": os.environ.get("PIPESGD_EMULATED_LINK", "loopback"), "repeats": repeats,
                "warmup": warmup, "seconds": [max(rank[i] for rank in everyone) for i in range(repeats)],
                "seconds_per_rank": everyone, "cpu_cores_per_rank": cpu,
            })
    finally:
        pdist.destroy()


def main(argv: list[str]) -> int:
    from pipesgd import launch
    from pipesgd.comm import REGISTRY
    from pipesgd.timing.presets import MODELS

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        opts = parse(argv)
        algo = opts.get("algo", "ring")
        if algo not in REGISTRY:
            raise ValueError(f"algo={algo!r} is not known; allowed: {', '.join(sorted(REGISTRY))}")
        nbytes, repeats = int(float(opts.get("bytes", 4e6))), int(opts.get("repeats", 10))
        warmup, nproc = int(opts.get("warmup", 2)), int(opts.get("nproc", 2))
        if nbytes < 4 or repeats < 1 or warmup < 0 or nproc < 2:
            raise ValueError(f"need bytes >= 4, repeats >= 1, warmup >= 0, nproc >= 2; got {opts}")
        model = opts.get("tensors")
        if model is not None and model not in MODELS:
            raise ValueError(f"tensors={model!r} is not a model preset; allowed: {', '.join(sorted(MODELS))}")
    except ValueError as e:
        log.error("%s", e)
        return 2
    out = os.path.abspath(os.path.join(opts.get("hydra.run.dir", "."), "allreduce.json"))
    try:
        launch.run(_worker, (algo, nbytes, repeats, warmup, out, model), nproc=nproc)
    except launch.WorkerFailed as e:
        log.error("%s", e)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
