"""The only module that creates or destroys process groups.

Workers always come up through the torchrun environment contract (RANK, WORLD_SIZE, LOCAL_RANK,
MASTER_ADDR, MASTER_PORT), whether torchrun, the local launcher or the emulated cluster started
them. Two groups exist: the default group for the training loop's own collectives (evaluation
counts, final checks) and a second one, ``comm_group``, that the engine's background thread owns,
so the two threads never interleave messages on one group. ``comm=hierarchical`` adds its node
groups and leaders' group through :func:`node_groups`, ``dist.ranks_per_replica`` > 1 its replicas'
groups and the rank peers' through :func:`replica_groups`, each called once per run by every rank.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

log = logging.getLogger(__name__)

BACKENDS = ("auto", "gloo", "nccl")
# The engine's deadline for a reduction, as a share of the process groups' timeout (docs/gpu.md).
ENGINE_TIMEOUT_SHARE = 0.8


class RendezvousError(RuntimeError):
    """This process could not host or reach the job's store at MASTER_ADDR:MASTER_PORT."""


@dataclass(frozen=True)
class DistContext:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    backend: str
    device: torch.device
    comm_group: object | None = None
    timeout_s: float = 300.0  # the process groups' timeout

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def engine_timeout_s(self) -> float:
        """The engine's deadline for a reduction: shorter than the groups' timeout, so its
        :class:`~pipesgd.engine.base.ReductionError` (naming the step) is what a hang raises. NCCL's
        watchdog counts a collective's time from its enqueue and ends the process when the groups'
        timeout runs out; the engine counts from when a step starts waiting, K-1 steps after that
        enqueue. The rest of the timeout (60 s of the default 300) covers those steps."""
        return ENGINE_TIMEOUT_SHARE * self.timeout_s


def resolve_backend(backend: str) -> str:
    if backend not in BACKENDS:
        raise ValueError(f"dist.backend={backend!r} is not known; allowed: {', '.join(BACKENDS)}")
    if backend == "auto":
        return "nccl" if torch.cuda.is_available() else "gloo"
    return backend


def env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    return default if value is None else int(value)


def init(backend: str = "auto", timeout_s: float = 300.0) -> DistContext:
    """Join the job described by the environment; a lone process (no WORLD_SIZE) gets no group."""
    backend = resolve_backend(backend)
    rank, world = env_int("RANK", 0), env_int("WORLD_SIZE", 1)
    local_rank, local_world = env_int("LOCAL_RANK", 0), env_int("LOCAL_WORLD_SIZE", world)
    if backend == "nccl":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if "WORLD_SIZE" not in os.environ:
        return DistContext(0, 1, 0, 1, backend, device, timeout_s=timeout_s)
    timeout = timedelta(seconds=timeout_s)  # both groups: a silent peer fails any wait within it
    try:
        store = _job_store(rank, world, timeout)
    except dist.DistNetworkError as e:
        raise _rendezvous_error(rank, e) from None
    # device_id binds NCCL's communicators to this rank's GPU and creates them now (comm_group is
    # split from the default group's), not lazily at the first collective mid-run.
    dist.init_process_group(backend, store=store, timeout=timeout, rank=rank, world_size=world,
                            device_id=device if backend == "nccl" else None)
    comm_group = dist.new_group(backend=backend, timeout=timeout)
    log.debug("rank %d/%d joined (%s)", rank, world, backend)
    return DistContext(rank, world, local_rank, local_world, backend, device, comm_group, timeout_s)


def _job_store(rank: int, world: int, timeout: timedelta) -> dist.Store:
    """The job's TCP store at MASTER_ADDR:MASTER_PORT (what ``env://`` would connect to), with
    every key under a per-attempt prefix.

    Under torchrun / elastic the agent hosts the store and keeps it across restarts, and torch
    does not namespace the process groups' keys by attempt: a restarted job's ``new_group`` can
    read the dead attempt's Gloo addresses and fail with "connectFullMesh ... Connection
    refused" (seen with torch 2.13). Without an agent store, rank 0 hosts a fresh store each
    attempt, as ``env://`` does, and the prefix is constant: agents that joined in different rounds
    (an elastic scale-up) count their restarts differently, so the count could not be shared.
    """
    host, port = os.environ.get("MASTER_ADDR", "127.0.0.1"), int(os.environ.get("MASTER_PORT", "29500"))
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == str(True)
    store = dist.TCPStore(host, port, world, is_master=rank == 0 and not agent, timeout=timeout,
                          multi_tenant=True)
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") if agent else "0"
    return dist.PrefixStore(f"pipesgd/attempt_{attempt}/", store)


def _rendezvous_error(rank: int, e: Exception) -> RendezvousError:
    addr, port = os.environ.get("MASTER_ADDR", "?"), os.environ.get("MASTER_PORT", "?")
    if "EADDRINUSE" in str(e) or "address already in use" in str(e).lower():
        return RendezvousError(
            f"rank {rank} cannot host the job's store on MASTER_ADDR:MASTER_PORT={addr}:{port}: the port is already "
            f"in use (another job or a leftover process); pick a free one (torchrun --master-port=N, or "
            f"torchrun --standalone / the local launcher, which choose one) or free it (ss -ltnp | grep :{port})")
    detail = " ".join(str(e).split())[:300]
    return RendezvousError(f"rank {rank} could not join the job's store at {addr}:{port}: {detail}; check "
                           "MASTER_ADDR / MASTER_PORT and that rank 0 is running")


@dataclass(frozen=True)
class NodeGroups:
    """This rank's node group and the group of node leaders (hierarchical reduction).

    Ranks are split into consecutive blocks of ``group_size`` (node n = ranks n·g .. n·g+g-1, as
    torchrun numbers them); group rank 0 of each block is its leader. ``leaders`` is None on
    ranks that are not leaders; both are None in a lone process.
    """

    intra: object | None
    leaders: object | None
    group_size: int
    nodes: int


def node_groups(group_size: int | None, timeout_s: float = 300.0) -> NodeGroups:
    """Create the node groups and the leaders' group. COLLECTIVE: every rank calls it once, at the
    same point relative to other group creations. ``group_size=None`` takes LOCAL_WORLD_SIZE (the
    ranks torchrun started on this machine). Raises ValueError naming ``comm.group_size`` when it
    does not divide the world size."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    size = env_int("LOCAL_WORLD_SIZE", world) if group_size is None else group_size
    if isinstance(size, bool) or not isinstance(size, int) or size < 1 or world % size:
        raise ValueError(f"comm.group_size={size!r} is invalid for world size {world}: it must be an "
                         "integer >= 1 that divides the world size (null = LOCAL_WORLD_SIZE)")
    if not dist.is_initialized():
        return NodeGroups(None, None, 1, 1)
    rank, timeout = dist.get_rank(), timedelta(seconds=timeout_s)
    intra = None
    for node in range(world // size):  # every rank creates every group, in the same order
        g = dist.new_group(list(range(node * size, (node + 1) * size)), timeout=timeout)
        if rank // size == node:
            intra = g
    leaders = dist.new_group(list(range(0, world, size)), timeout=timeout)
    log.debug("rank %d: node %d of %d, %d ranks per node", rank, rank // size, world // size, size)
    return NodeGroups(intra, leaders if rank % size == 0 else None, size, world // size)


@dataclass(frozen=True)
class ReplicaGroups:
    """The groups of a world split into replicas of ``k`` consecutive ranks (replica i = global ranks
    i·k .. i·k+k-1, as torchrun numbers nodes: one node of ``--nproc-per-node k`` is one replica).

    ``inner``: this rank's replica, over which every inner step's gradient is averaged; ``gather``:
    the same ranks again, for gathering the outer exchange's shards (a group per thread: the inner
    steps' thread and the outer exchange's each own one, so neither waits behind the other's
    collectives and both keep one order on every rank); ``peers``: rank ``member`` of every replica,
    over which shard ``member`` of a round's pseudo-gradient is exchanged (the slow link).
    All three are None in a lone process."""

    inner: object | None
    gather: object | None
    peers: object | None
    k: int
    replicas: int
    index: int  # this rank's replica
    member: int  # this rank's place in its replica: the shard it carries between replicas


def ranks_per_replica(setting: int | None, rounds: bool) -> int:
    """``dist.ranks_per_replica`` as the run uses it: the setting where given; null: under torchrun
    across several nodes (LOCAL_WORLD_SIZE < WORLD_SIZE, dividing it) a node is a replica when the
    run has replicas to form (``rounds``: a mode with rounds at ``trainer.sync_every`` > 1), else 1
    (every rank a replica, and one host's ranks are never split that way)."""
    if setting is not None:
        return setting
    local, world = env_int("LOCAL_WORLD_SIZE", 0), env_int("WORLD_SIZE", 1)
    return local if rounds and 1 < local < world and world % local == 0 else 1


def replica_groups(k: int, timeout_s: float = 300.0) -> ReplicaGroups:
    """Create the replica groups of ``k`` ranks each (:class:`ReplicaGroups`). COLLECTIVE: every
    rank calls it once, at the same point relative to other group creations. ValueError naming
    ``dist.ranks_per_replica`` when ``k`` does not divide the world size."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    if isinstance(k, bool) or not isinstance(k, int) or k < 1 or world % k:
        raise ValueError(f"dist.ranks_per_replica={k!r} is invalid for world size {world}: it must be an "
                         "integer >= 1 that divides the world size")
    if not dist.is_initialized():
        return ReplicaGroups(None, None, None, k, world // k, 0, 0)
    rank, timeout = dist.get_rank(), timedelta(seconds=timeout_s)
    mine: dict[str, object] = {}
    for kind in ("inner", "gather"):  # every rank creates every group, in the same order
        for i in range(world // k):
            g = dist.new_group(list(range(i * k, (i + 1) * k)), timeout=timeout)
            if rank // k == i:
                mine[kind] = g
    for j in range(k):
        g = dist.new_group(list(range(j, world, k)), timeout=timeout)
        if rank % k == j:
            mine["peers"] = g
    log.debug("rank %d: replica %d of %d, member %d of %d", rank, rank // k, world // k, rank % k, k)
    return ReplicaGroups(mine["inner"], mine["gather"], mine["peers"], k, world // k, rank // k, rank % k)


def broadcast_object(obj, ctx: DistContext):
    """Rank 0's ``obj`` on every rank (identity in a lone process)."""
    if not dist.is_initialized():
        return obj
    box = [obj if ctx.is_main else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def destroy(abort: bool = False) -> None:
    """Tear down every process group. ``abort`` (after an error): without waiting for collectives
    still in flight. A graceful destroy on recent torch waits for a hung NCCL collective until
    NCCL's watchdog aborts the process (SIGABRT), so the error that ended the run never reaches
    the log or the launcher; abort returns at once on NCCL and Gloo."""
    if not dist.is_initialized():
        return
    if not abort:
        dist.destroy_process_group()
        return
    try:
        c10d._abort_process_group()
    except (RuntimeError, ValueError) as e:  # the process is on its way out with its error anyway
        log.warning("aborting the process groups failed (%s); leaving them to the process's exit", e)
