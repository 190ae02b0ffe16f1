"""Structured config: the types of the top level, ``trainer`` and ``dist``, registered with Hydra's
ConfigStore (``pipesgd_schema``, first in conf/config.yaml's defaults), so composition itself
rejects an unknown key or a wrongly typed value with Hydra's message. Ranges and cross-field rules
live in :mod:`pipesgd.config`; a new key in ``conf/trainer/*.yaml`` needs a field here too.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING

# OmegaConf reads these annotations at runtime: keep typing.Optional (not `X | None`) for
# compatibility with every omegaconf 2.3 release.


class NonFinite(str, Enum):
    """What the ranks do, together, when a step's gradient has a NaN or inf on any rank."""

    skip = "skip"    # drop that update on every rank (the schedule does not advance)
    abort = "abort"  # stop the run on every rank with an error naming the step and the ranks


@dataclass
class LiveConfig:
    """``trainer.live``: the lighthouse and the replica groups of ``trainer.mode=live``
    (pipesgd.live.launch.settings reads them; docs/reliability.md, "Live recovery")."""

    host: str = "127.0.0.1"
    lighthouse_port: int = 0
    min_replicas: int = 1
    heartbeat_timeout_ms: int = 1000
    join_timeout_ms: int = 1000
    quorum_tick_ms: int = 20
    timeout_s: float = 30.0
    quorum_timeout_s: float = 60.0
    init_sync: bool = False
    # a replica group started on its own (torchrun): where it finds its run (the local launcher sets them)
    lighthouse: Optional[str] = None
    run_id: Optional[str] = None
    replica: Optional[int] = None
    replicas: Optional[int] = None
    start_replicas: Optional[int] = None  # groups to wait for at start (torchrun); None: no wait
    start_timeout_s: Optional[float] = None  # the start barrier's limit; None: quorum_timeout_s


@dataclass
class TrainerConfig:
    mode: str = "pipe"
    width: int = 2
    warmup_sync_steps: int = 0
    sync_every: int = 1
    fragments: int = 1
    sync_delay: int = 0
    landing_alpha: Any = None  # a number in [0, 1], "auto" (follows the replicas) or None (period.merge_problems)
    fragment_layout: str = "contiguous"
    epochs: int = 1
    max_steps: Optional[int] = None
    stop_after_step: Optional[int] = None
    eval_max_batches: Optional[int] = None
    eval_every_steps: Optional[int] = None
    log_every: int = 50
    lr_reference_batch: Optional[int] = 256
    trace: bool = False
    trace_steps: Optional[int] = 200
    checkpoint_every: Optional[int] = 1000
    keep_checkpoints: int = 2
    resume: str = "auto"
    elastic: bool = False
    nonfinite: NonFinite = NonFinite.abort
    check_every: Optional[int] = 100
    max_grad_norm: Optional[float] = None
    live: LiveConfig = field(default_factory=LiveConfig)


@dataclass
class DistConfig:
    nproc: int = 2
    backend: str = "auto"
    timeout_s: float = 300.0
    max_restarts: int = 0
    threads_per_worker: Optional[int] = None
    cpu_affinity: Optional[str] = None
    ranks_per_replica: Optional[int] = None


@dataclass
class Config:
    seed: int = 0
    dist: DistConfig = field(default_factory=DistConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    model: Any = MISSING
    data: Any = MISSING
    compressor: Any = MISSING
    staleness: Any = MISSING
    comm: Any = MISSING
    optimizer: Any = MISSING
    outer_optimizer: Any = MISSING
    scheduler: Any = MISSING
    timing: Any = MISSING


def register() -> None:
    """Make ``pipesgd_schema`` available to Hydra's defaults list (idempotent)."""
    ConfigStore.instance().store(name="pipesgd_schema", node=Config)


register()
