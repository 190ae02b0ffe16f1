"""Interleaved A/B of backward-overlapped buckets: ResNet-20, CIFAR-shaped synthetic batch of 128 per
worker, 2 ranks, 1 thread each. Configurations rotate every round so load drift hits all of them.

Local:     PYTHONPATH=.:tools python -m bucket_ab [rounds] [steps]
Emulated:  PYTHONPATH=.:tools python -m pipesgd.emulate --workers 2 --rate 100mbit --module bucket_ab -- [rounds] [steps]
Prints (rank 0) per configuration: median iteration ms, median exposed wait ms, IQR, n.
"""

import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

CONFIGS = [(1, None), (1, 0.25), (2, None), (2, 0.25)]


def run(rounds: int, steps: int) -> None:
    from pipesgd import PipeSGD
    from pipesgd.models.resnet_cifar import resnet20

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    group = dist.new_group()
    torch.manual_seed(0)
    model = resnet20(num_classes=10)
    g = torch.Generator().manual_seed(rank)
    x, y = torch.randn(128, 3, 32, 32, generator=g), torch.randint(0, 10, (128,), generator=g)
    results = {c: {"iter": [], "wait": []} for c in CONFIGS}
    for r in range(rounds):
        order = CONFIGS[r % len(CONFIGS):] + CONFIGS[:r % len(CONFIGS)]
        for width, bucket in order:
            opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
            engine = PipeSGD(opt, model.parameters(), width=width, group=group, bucket_mb=bucket)
            for t in range(steps + 2):
                t0 = time.perf_counter()
                opt.zero_grad(set_to_none=True)
                F.cross_entropy(model(x), y).backward()
                stats = engine.step()
                dt = time.perf_counter() - t0
                if t >= 2:  # warm-up steps (and the pipeline fill) are not timed
                    results[(width, bucket)]["iter"].append(dt * 1e3)
                    results[(width, bucket)]["wait"].append(stats.wait_s * 1e3)
            engine.flush()
            engine.close()
            dist.barrier()
    if rank == 0:
        out = {}
        for (width, bucket), v in results.items():
            q = statistics.quantiles(v["iter"], n=4)
            out[f"width={width} bucket_mb={bucket}"] = {
                "iter_ms_median": round(statistics.median(v["iter"]), 1), "iter_ms_iqr": [round(q[0], 1), round(q[2], 1)],
                "wait_ms_median": round(statistics.median(v["wait"]), 1), "n": len(v["iter"])}
        print(json.dumps(out, indent=1), flush=True)
    dist.destroy_process_group()


def _local(rank: int, rounds: int, steps: int, port: int) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                      GLOO_SOCKET_IFNAME="lo")
    run(rounds, steps)


if __name__ == "__main__":
    nums = [int(a) for a in sys.argv[1:] if a.isdigit()]  # the emulator appends hydra.run.dir=...
    rounds, steps = (nums + [3, 8][len(nums):])[:2]
    if "RANK" in os.environ:
        run(rounds, steps)
    else:
        import socket

        import torch.multiprocessing as mp

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        mp.spawn(_local, args=(rounds, steps, port), nprocs=2)
