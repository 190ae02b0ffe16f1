"""Link probe: a stand-in rank that checks an emulated cluster and measures it through Gloo.

    python -m pipesgd.emulate --workers 2 --rate 100mbit --module pipesgd.emulate.probe -- \\
        bytes=20000000 repeats=5

Arguments are `key=value`, like Hydra overrides: bytes (per transfer), repeats (timed transfers
per direction, after one warm-up), pings (small-message round trips), hydra.run.dir (where to
write). Other keys are ignored. Needs the torchrun environment (RANK, WORLD_SIZE, MASTER_ADDR, ...).

Every rank all-reduces (rank + 1) and writes `<run dir>/probe_rank<r>.json`. Ranks 0 and 1 also
time `bytes` going 0 -> 1 and 1 -> 0 with send/recv, and rank 0 times `pings` 1-float round trips: the sender's clock runs from the send until
a 1-element acknowledgement comes back, so one small-message round trip (~0.1 ms unshaped) is
included in each sample. Goodput, not wire rate: TCP/IP/Ethernet headers take ~4.4 % of each
1514-byte frame, so a perfect 100mbit link gives ~95.6 Mbit/s here.
"""

from __future__ import annotations

import json
import logging
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

from pipesgd.comm.pingpong import round_trip

log = logging.getLogger("pipesgd.emulate.probe")


def _timed_transfers(peer: int, sender: bool, nbytes: int, repeats: int) -> list[float]:
    buf = torch.zeros(nbytes, dtype=torch.uint8)
    ack = torch.zeros(1)
    seconds = []
    for i in range(repeats + 1):  # the first transfer warms up connections and buffers
        if sender:
            start = time.perf_counter()
            dist.send(buf, peer)
            dist.recv(ack, peer)
            if i:
                seconds.append(time.perf_counter() - start)
        else:
            dist.recv(buf, peer)
            dist.send(ack, peer)
    return seconds


def _round_trips(peer: int, first: bool, pings: int) -> list[float]:
    x = torch.zeros(1)
    seconds = []
    for i in range(pings + 3):
        elapsed = round_trip(x, peer, first)
        if i >= 3:
            seconds.append(elapsed)
    return seconds


def _summary(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def main(argv: list[str]) -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    opts = dict(a.lstrip("+").split("=", 1) for a in argv if "=" in a)
    nbytes = int(float(opts.get("bytes", 4e6)))
    repeats = int(opts.get("repeats", 5))
    pings = int(opts.get("pings", 20))
    run_dir = opts.get("hydra.run.dir", ".")

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    t = torch.full((1024,), float(rank + 1))
    dist.all_reduce(t)
    result: dict[str, object] = {
        "rank": rank,
        "world_size": world,
        "allreduce": t[0].item(),
        "allreduce_expected": world * (world + 1) / 2,
        "link": os.environ.get("PIPESGD_EMULATED_LINK"),
        "bytes": nbytes,
        "repeats": repeats,
    }
    if world >= 2 and rank < 2:
        peer = 1 - rank
        rtt = _round_trips(peer, rank == 0, pings)  # only rank 0's clock sees a round trip
        if rank == 0:
            result["rtt_ms"] = {k: v * 1e3 for k, v in _summary(rtt).items()} | {"n": len(rtt)}
        for src in (0, 1):
            seconds = _timed_transfers(peer, rank == src, nbytes, repeats)
            if rank == src:
                mbit = [nbytes * 8 / s / 1e6 for s in seconds]
                result["send_mbit_s"] = _summary(mbit) | {"n": len(mbit), "samples": mbit}
                log.info(
                    "rank %d -> %d: median %.1f Mbit/s (min %.1f, max %.1f, n=%d, %.1f MB each)",
                    src, peer, statistics.median(mbit), min(mbit), max(mbit), len(mbit),
                    nbytes / 1e6,
                )  # fmt: skip
        if rank == 0:
            log.info("round trip 0 -> 1 -> 0 (1 float): median %.3f ms, min %.3f, n=%d",
                     statistics.median(rtt) * 1e3, min(rtt) * 1e3, len(rtt))
    dist.barrier()
    dist.destroy_process_group()
    os.makedirs(run_dir, exist_ok=True)
    with open(os.path.join(run_dir, f"probe_rank{rank}.json"), "w") as f:
        json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
