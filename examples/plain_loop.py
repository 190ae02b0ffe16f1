"""A plain PyTorch training loop with PipeSGD: no Hydra, no pipesgd trainer, just the engine.

    torchrun --standalone --nproc-per-node 2 examples/plain_loop.py --data-root ../shared/data
    torchrun --nnodes 2 --node-rank R --master-addr HOST --master-port 29500 \\
        --nproc-per-node 1 examples/plain_loop.py ...            # two hosts, see docs/multi-node.md
    python examples/plain_loop.py --steps 50                      # one process, no torchrun

An MLP on MNIST through pipesgd.data when --data-root holds the four MNIST files (nothing is
downloaded), otherwise on a synthetic 10-class problem of the same shape. What to copy into your
own loop is marked "PipeSGD:" below; everything else is ordinary PyTorch.
"""

from __future__ import annotations

import argparse
import logging
import os
from collections.abc import Iterator

import torch
import torch.distributed as dist
import torch.nn.functional as F

from pipesgd import PipeSGD
from pipesgd.data import MNIST, DatasetError
from pipesgd.models import MLP

log = logging.getLogger("plain_loop")
Batch = tuple[torch.Tensor, torch.Tensor]


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--width", type=int, default=2, help="pipeline width K (1 = synchronous SGD)")
    p.add_argument("--compressor", default="none", help="none | fp16 | bf16 | int8")
    p.add_argument("--batch-size", type=int, default=64, help="per worker")
    p.add_argument("--lr", type=float, default=0.02)
    p.add_argument("--data-root", default=os.environ.get("PIPESGD_DATA", "data"))
    p.add_argument("--log-every", type=int, default=50)
    return p.parse_args()


def mnist(root: str, batch_size: int, rank: int, world: int) -> tuple[Iterator[Batch], list[Batch]] | None:
    """Endless per-rank MNIST batches and this rank's shard of the test set, or None if absent."""
    data = MNIST(root, download=False, batch_size=batch_size)
    try:
        data.prepare()  # finds and verifies the files; a Hydra run does this once in the launcher
    except DatasetError as e:
        log.warning("%s; training on synthetic data instead", e)
        return None
    train, test = data.load()
    loader = data.train_loader(train, rank, world, seed=0)

    def forever() -> Iterator[Batch]:
        epoch = 0
        while True:
            loader.set_epoch(epoch)
            yield from loader
            epoch += 1

    return forever(), list(data.eval_loader(test, rank, world))


def synthetic(batch_size: int, rank: int) -> tuple[Iterator[Batch], list[Batch]]:
    """Labels from a fixed random linear teacher on 28x28 noise; each rank draws its own samples."""
    teacher = torch.randn(28 * 28, 10, generator=torch.Generator().manual_seed(0))

    def batch(g: torch.Generator, n: int) -> Batch:
        x = torch.randn(n, 1, 28, 28, generator=g)
        return x, (x.flatten(1) @ teacher).argmax(1)

    g = torch.Generator().manual_seed(1 + rank)
    test = torch.Generator().manual_seed(10_000 + rank)
    return (batch(g, batch_size) for _ in iter(int, 1)), [batch(test, 500) for _ in range(2)]


@torch.no_grad()
def accuracy(model: torch.nn.Module, batches: list[Batch], device: torch.device) -> float:
    counts = torch.zeros(2, device=device)  # NCCL reduces device tensors only
    for x, y in batches:
        counts[0] += (model(x.to(device)).argmax(1) == y.to(device)).sum()
        counts[1] += y.numel()
    if dist.is_initialized():
        dist.all_reduce(counts)  # default group: the engine has its own (see below)
    return (counts[0] / counts[1]).item()


def main() -> None:
    args = parse()
    # One GPU per process (torchrun's LOCAL_RANK) with NCCL when there are GPUs, else the CPU with Gloo.
    device = torch.device("cpu")
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    if "WORLD_SIZE" in os.environ:  # started by torchrun: RANK, WORLD_SIZE, MASTER_ADDR/PORT are set
        if device.type == "cuda":
            dist.init_process_group("nccl", device_id=device)
        else:
            dist.init_process_group("gloo")
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format=f"[rank {rank}] %(message)s")
    train, test = mnist(args.data_root, args.batch_size, rank, world) or synthetic(args.batch_size, rank)

    torch.manual_seed(0)  # reproducible initial weights (rank 0's are broadcast below)
    model = MLP().to(device)
    if dist.is_initialized():
        for t in model.state_dict().values():
            dist.broadcast(t, src=0)  # every replica starts from rank 0's weights
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    # PipeSGD: the engine replaces optimizer.step(). It communicates on a background thread, so
    # it gets its own process group; the loop's own collectives (accuracy) run after flush(). While
    # updates are in flight they would go through engine.collective(fn) (NCCL: one thread only).
    group = dist.new_group() if dist.is_initialized() else None
    engine = PipeSGD(optimizer, model.parameters(), width=args.width, compressor=args.compressor, group=group)

    for step in range(1, args.steps + 1):
        x, y = (t.to(device) for t in next(train))
        optimizer.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        stats = engine.step()  # PipeSGD: launch this step's allreduce, apply the one from K-1 steps ago
        if step % args.log_every == 0 or step == args.steps:
            log.info("step %d/%d loss %.4f (waited %.1f ms for communication, %d B on the wire)",
                     step, args.steps, loss.item(), 1e3 * stats.wait_s, stats.comm.wire_bytes)
    engine.flush()  # PipeSGD: apply what is still in flight before evaluating or saving
    engine.close()
    log.info("test accuracy %.2f%% after %d steps on %d worker(s), width %d, compressor %s",
             100 * accuracy(model, test, device), args.steps, world, engine.width, args.compressor)
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
