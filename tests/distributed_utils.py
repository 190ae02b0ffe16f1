"""Run a function on N Gloo ranks over loopback (or NCCL ranks, one GPU each) and collect what each returns.

The parent hosts the job's TCP store, as torchrun's agent (and so ``pipesgd.launch``) does: it
outlives every rank, so a rank that reads it after rank 0 has exited (the watchdog explaining a
hang) finds it there, as it would in a real job. No sleeps: ranks meet in the store rendezvous; the parent waits on the result queue with a
deadline and kills every child on timeout or failure, so a broken test never hangs the suite.
"""

from __future__ import annotations

import io
import os
import queue
import socket
import time
import traceback
from datetime import timedelta

import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(fn, rank, world_size, port, args, results, backend):
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))  # the torchrun env contract
    # No rank leaves init_process_group before every rank has finished Gloo's full-mesh connect.
    # Without it a rank whose fn does no collective (one that only checks an error) can return and
    # close its sockets while a slower peer is still handshaking, and that peer fails in
    # init_process_group with "Gloo connectFullMesh failed ... Connection closed by peer" (seen once
    # in CI on a loaded runner; the same race as pytorch/pytorch#53270).
    os.environ["TORCH_DIST_INIT_BARRIER"] = "1"
    try:
        device = None
        if backend == "nccl":
            device = torch.device("cuda", rank)
            torch.cuda.set_device(device)
        store = dist.TCPStore("127.0.0.1", port, world_size, is_master=False, timeout=timedelta(seconds=60))
        dist.init_process_group(
            backend, store=store, rank=rank, world_size=world_size, timeout=timedelta(seconds=60), device_id=device,
        )
        out = fn(rank, world_size, *args)
        # Serialise here: tensors sent through a queue are shared-memory handles that die with us.
        buf = io.BytesIO()
        torch.save(out, buf)
        results.put((rank, "ok", buf.getvalue()))
    except BaseException:
        results.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_workers(fn, world_size: int, *args, timeout: float = 120.0, expect: list[int] | None = None,
                backend: str = "gloo") -> list:
    """Return ``[fn(rank, world_size, *args) for each rank]``, computed in ``world_size`` processes.
    With ``expect``, wait only for those ranks' results (in that order) and kill the others.
    ``backend="nccl"``: rank r runs on ``cuda:r`` (tests/gpu)."""
    expect = list(range(world_size)) if expect is None else expect
    ctx = mp.get_context("forkserver")  # forked from a server that imported torch once: no 2-5 s import per rank
    ctx.set_forkserver_preload(["torch", "torch.distributed", "torch._dynamo"])
    results = ctx.Queue()
    import torch.distributed as dist

    host = dist.TCPStore("127.0.0.1", 0, world_size, is_master=True, wait_for_workers=False,
                         timeout=timedelta(seconds=60))
    port = host.port
    env_before = os.environ.get("GLOO_SOCKET_IFNAME")
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    procs = [ctx.Process(target=_entry, args=(fn, r, world_size, port, args, results, backend), daemon=True)
             for r in range(world_size)]
    try:
        for p in procs:
            p.start()
        out: dict[int, object] = {}
        deadline = time.monotonic() + timeout
        while not set(expect) <= out.keys():
            try:  # in short waits, so that a rank that died is named at once, with how it ended
                rank, status, value = results.get(timeout=min(1.0, max(0.0, deadline - time.monotonic())))
            except queue.Empty:
                dead = {r: procs[r].exitcode for r in expect if r not in out and procs[r].exitcode is not None}
                if dead:
                    try:  # a result put just before the exit may still be in the pipe
                        rank, status, value = results.get(timeout=5)
                    except queue.Empty:
                        raise RuntimeError(f"ranks {sorted(dead)} ended (exit codes {dead}) without a result") from None
                elif time.monotonic() >= deadline:
                    raise TimeoutError(f"ranks {sorted(set(expect) - set(out))} gave no result in {timeout}s") from None
                else:
                    continue
            if status == "error":
                raise RuntimeError(f"rank {rank} failed:\n{value}")
            import torch

            out[rank] = torch.load(io.BytesIO(value), weights_only=False)
        for r in expect:
            procs[r].join(timeout=30)
        return [out[r] for r in expect]
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
        del host  # the store goes after every rank
        if env_before is None:
            os.environ.pop("GLOO_SOCKET_IFNAME", None)
        else:
            os.environ["GLOO_SOCKET_IFNAME"] = env_before
