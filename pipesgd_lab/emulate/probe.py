"""Link probe: a stand-in rank that checks an emulated cluster and measures it through Gloo.

    python -m pipesgd_lab.emulate --workers 2 --rate 100mbit --module pipesgd_lab.emulate.probe -- \\
        bytes=20000000 repeats=5

Arguments are `key=value`, like Hydra overrides: bytes (per transfer), repeats (timed transfers
per direction, after one warm-up), pings (small-message round trips), gapped (transfers of
gap_bytes, default ResNet-20's 1,078,888-byte gradient, each after gap_ms of idle link, default 50:
what a tbf bucket lets through above the rate shows here, as the ring's hops see it),
peer (the rank rank 0 measures against, default 1: with `--ranks-per-replica 2` rank 1 shares rank
0's host and its loopback, rank 2 is across the shaped link), hydra.run.dir (where to write).
Other keys are ignored. Needs the torchrun environment (RANK, WORLD_SIZE, MASTER_ADDR, ...).

Every rank all-reduces (rank + 1) and writes `<run dir>/probe_rank<r>.json`. Ranks 0 and `peer` also
time `bytes` going 0 -> peer and peer -> 0 with send/recv, and rank 0 times `pings` 1-float round trips: the sender's clock runs from the send until
a 1-element acknowledgement comes back, so one small-message round trip (~0.1 ms unshaped) is
included in each sample. Goodput, not wire rate: TCP/IP/Ethernet headers take ~4.4 % of each
1514-byte frame (0.7 % of a 9014-byte jumbo frame), so a perfect 100mbit link gives ~95.6 Mbit/s
here (~99.3 with `--mtu 9000`).

Rank 0 also reads the machine's /proc/stat around its timed sends and reports the CPU they cost
per megabyte by kind (softirq is the kernel's packet path: TCP, veth, bridge, tbf). It is the whole
machine's, so it means something only when nothing else runs.
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

log = logging.getLogger("pipesgd_lab.emulate.probe")


_CPU_FIELDS = ("user", "nice", "system", "idle", "iowait", "irq", "softirq")


def _cpu_ticks() -> list[int]:
    with open("/proc/stat") as f:
        return [int(v) for v in f.readline().split()[1:len(_CPU_FIELDS) + 1]]


def _cpu_ms_per_mb(before: list[int], after: list[int], nbytes: float) -> dict[str, float]:
    """Busy CPU (ms) per MB moved, by /proc/stat field, and their sum."""
    tick_ms = 1000 / os.sysconf("SC_CLK_TCK")
    out = {k: (b - a) * tick_ms / (nbytes / 1e6) for k, a, b in zip(_CPU_FIELDS, before, after, strict=True)
           if k not in ("idle", "iowait")}
    return out | {"busy": sum(out.values())}


def _timed_transfers(peer: int, sender: bool, nbytes: int, repeats: int, gap_s: float = 0.0) -> list[float]:
    buf = torch.zeros(nbytes, dtype=torch.uint8)
    ack = torch.zeros(1)
    seconds = []
    for i in range(repeats + 1):  # the first transfer warms up connections and buffers
        if sender:
            time.sleep(gap_s)  # idle link: the shaper's bucket refills
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


def _mtu(ifname: str | None) -> int | None:
    """This rank's interface MTU as the kernel has it (None outside an emulated host)."""
    try:
        with open(f"/sys/class/net/{ifname}/mtu") as f:
            return int(f.read())
    except (OSError, TypeError, ValueError):
        return None


def _summary(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def main(argv: list[str]) -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    opts = dict(a.lstrip("+").split("=", 1) for a in argv if "=" in a)
    nbytes = int(float(opts.get("bytes", 4e6)))
    repeats = int(opts.get("repeats", 5))
    pings = int(opts.get("pings", 20))
    gapped = int(opts.get("gapped", 0))
    gap_bytes = int(float(opts.get("gap_bytes", 1_078_888)))
    gap_s = float(opts.get("gap_ms", 50)) / 1000
    run_dir = opts.get("hydra.run.dir", ".")
    pair = int(opts.get("peer", 1))

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
        "mtu": _mtu(os.environ.get("GLOO_SOCKET_IFNAME")),
        "bytes": nbytes,
        "repeats": repeats,
        "peer": pair,
    }
    if not 0 < pair < world and world >= 2:
        raise SystemExit(f"peer={pair} must be a rank in 1..{world - 1}")
    if world >= 2 and rank in (0, pair):
        peer = pair if rank == 0 else 0
        rtt = _round_trips(peer, rank == 0, pings)  # only rank 0's clock sees a round trip
        if rank == 0:
            result["rtt_ms"] = {k: v * 1e3 for k, v in _summary(rtt).items()} | {"n": len(rtt)}
        for src in (0, pair):
            before = _cpu_ticks()
            seconds = _timed_transfers(peer, rank == src, nbytes, repeats)
            if rank == src:
                mbit = [nbytes * 8 / s / 1e6 for s in seconds]
                result["send_mbit_s"] = _summary(mbit) | {"n": len(mbit), "samples": mbit}
                if rank == 0:
                    result["cpu_ms_per_mb"] = _cpu_ms_per_mb(before, _cpu_ticks(), nbytes * (repeats + 1))
                log.info(
                    "rank %d -> %d: median %.1f Mbit/s (min %.1f, max %.1f, n=%d, %.1f MB each)",
                    src, peer, statistics.median(mbit), min(mbit), max(mbit), len(mbit),
                    nbytes / 1e6,
                )  # fmt: skip
        if gapped:
            seconds = _timed_transfers(peer, rank == 0, gap_bytes, gapped, gap_s)
            if rank == 0:
                ms = [s * 1e3 for s in seconds]
                result["gapped_ms"] = _summary(ms) | {"n": len(ms), "bytes": gap_bytes, "gap_ms": gap_s * 1e3}
                log.info("%d B after %.0f ms idle: median %.1f ms (min %.1f, max %.1f)", gap_bytes, gap_s * 1e3,
                         statistics.median(ms), min(ms), max(ms))
        if rank == 0:
            log.info("CPU per MB sent 0 -> %d (whole machine): %s", pair,
                     ", ".join(f"{k} {v:.2f} ms" for k, v in result["cpu_ms_per_mb"].items() if v))
            log.info("round trip 0 -> %d -> 0 (1 float): median %.3f ms, min %.3f, n=%d", pair,
                     statistics.median(rtt) * 1e3, min(rtt) * 1e3, len(rtt))
    dist.barrier()
    dist.destroy_process_group()
    os.makedirs(run_dir, exist_ok=True)
    with open(os.path.join(run_dir, f"probe_rank{rank}.json"), "w") as f:
        json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
