"""Does a reduction in flight overlap the next step's compute? The check only a GPU can settle for
the NCCL path (docs/gpu.md); on the CPU with Gloo it measures the same thing.

    torchrun --standalone --nproc-per-node 2 -m pipesgd_lab.bench.overlap --out overlap.json

Per rank, ResNet-20 on random CIFAR-shaped batches, the engine's own reduction path
(:class:`~pipesgd.engine.exchange.GradientExchange` over the ring, on a process group of its own,
on its communication thread and, on CUDA, stream). Rounds of three measurements, interleaved so a
drift of the machine hits all three alike:

* ``compute``: forward and backward, nothing in flight;
* ``comm``: one reduction of the gradient, launched and waited for, no compute;
* ``both``: the reduction launched, then forward and backward, then waited for (width 2's step).

``overlap = (compute + comm - both) / min(compute, comm)``: 1 when the shorter one is hidden
entirely, 0 when they run one after the other. On CUDA every time is read from CUDA events on the
training stream after the round (one host sync per round, none inside it); on the CPU from
``perf_counter``. Rank 0 writes the medians of every rank, the spread and the config as JSON.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from pipesgd.comm import ring_allreduce
from pipesgd.engine.exchange import GradientExchange
from pipesgd.models.resnet_cifar import resnet20
from pipesgd.observability.runinfo import git_commit, write_json_atomic


class Clock:
    """Wall time of a region on the training stream: CUDA events on a GPU, perf_counter on the CPU."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def time(self, fn: Callable[[], None]) -> Callable[[], float]:
        """Run ``fn``; return a function giving its milliseconds (call it after the round)."""
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            return lambda: (end.synchronize(), start.elapsed_time(end))[1]
        t0 = time.perf_counter()
        fn()
        ms = (time.perf_counter() - t0) * 1e3
        return lambda: ms


def measure(device: torch.device, batch: int, rounds: int, warmup: int) -> dict[str, list[float]]:
    torch.manual_seed(0)
    model = resnet20().to(device)
    x = torch.randn(batch, 3, 32, 32, device=device)
    y = torch.randint(0, 10, (batch,), device=device)
    exchange = GradientExchange(list(model.parameters()), "none", ring_allreduce, dist.new_group())
    clock = Clock(device)

    def compute() -> None:
        model.zero_grad(set_to_none=True)
        F.cross_entropy(model(x), y).backward()

    def comm() -> None:
        exchange.launch().wait()

    def both() -> None:
        handle = exchange.launch()  # this step's gradient, as PipeSGD.step() launches it
        compute()
        handle.wait()

    compute()  # gradients exist before the first launch
    times: dict[str, list[float]] = {"compute": [], "comm": [], "both": []}
    try:
        for r in range(warmup + rounds):
            dist.barrier()  # every rank starts the round together (default group, nothing in flight)
            read = {name: clock.time(fn) for name, fn in (("compute", compute), ("comm", comm), ("both", both))}
            if r >= warmup:
                for name, ms in read.items():
                    times[name].append(ms())
    finally:
        exchange.close()
    return times


def summarize(per_rank: list[dict[str, list[float]]]) -> dict:
    """Medians per rank, and the overlap from the slowest rank's medians (a step ends for all when
    the slowest has its average)."""
    medians = [{k: statistics.median(v) for k, v in t.items()} for t in per_rank]
    slow = {k: max(m[k] for m in medians) for k in ("compute", "comm", "both")}
    hidden = slow["compute"] + slow["comm"] - slow["both"]
    return {"per_rank_median_ms": medians, "median_ms": slow,
            "spread_ms": {k: [min(min(t[k]) for t in per_rank), max(max(t[k]) for t in per_rank)]
                          for k in ("compute", "comm", "both")},
            "overlap": hidden / min(slow["compute"], slow["comm"])}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=32, help="per rank")
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--out", type=Path, default=None, help="JSON for rank 0 to write")
    args = p.parse_args(argv)
    if "RANK" not in os.environ:
        p.error("run it under torchrun with at least 2 processes, e.g. "
                "torchrun --standalone --nproc-per-node 2 -m pipesgd_lab.bench.overlap")
    local = int(os.environ.get("LOCAL_RANK", 0))
    if torch.cuda.is_available():
        device = torch.device("cuda", local)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        torch.set_num_threads(1)
        dist.init_process_group("gloo")
    try:
        times = measure(device, args.batch, args.rounds, args.warmup)
        gathered: list = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, times)
    finally:
        dist.destroy_process_group()
    if int(os.environ["RANK"]) == 0:
        result = {"config": {**vars(args), "out": str(args.out), "device": device.type, "world": len(gathered),
                             "model": "resnet20", "allreduce": "ring", "torch": torch.__version__},
                  "commit": git_commit(), **summarize(gathered)}
        m = result["median_ms"]
        print(f"compute {m['compute']:.1f} ms, comm {m['comm']:.1f} ms, both {m['both']:.1f} ms: "
              f"overlap {result['overlap']:.2f} ({device.type}, {len(gathered)} ranks)", flush=True)
        if args.out is not None:
            write_json_atomic(args.out, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
