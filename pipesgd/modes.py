"""Every ``trainer.mode``: an engine builder registered with the facts of its mode.

An engine module registers its builder like every plugin kind, ``@register("pipe", width=None,
...)`` (the facts are :class:`Mode`'s fields; unnamed ones keep their defaults), so adding a mode
is its engine module in ``pipesgd/engine/`` plus its row in docs/modes.md; nothing here names it.
This module is the registry and its readers, without torch at import: reading a mode's facts
imports ``pipesgd.engine`` (every engine module registers itself there), as reading any other
kind imports its package (:func:`pipesgd.registry.registry`). The config checks, the composition
root, reliability, the timing model and the tests read these facts; a setting a mode does not use
is rejected, never ignored. Building a mode is :func:`pipesgd.engine.build.build`'s.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields

from .registry import Registry, registry

OVERLAPS = ("pipeline", "backward", "async", "none")


@dataclass(frozen=True)
class Mode:
    """What one ``trainer.mode`` declares beside its builder (a function taking
    :class:`~pipesgd.engine.base.ModeArgs` and returning ``(model, Engine)``).
    ``width``: the engine's fixed width, or None when it runs at ``trainer.width`` (pipelined).
    ``staleness``: applies the ``staleness`` group's rule (other modes take only ``none``).
    ``compressors``: the compressor names it carries, or None for every per-chunk compressor.
    ``ddp_hooks``: it carries exactly the compressors and reductions that declare a DDP comm hook
    (their ``ddp_hook()``), error feedback their hook's own.
    ``widths``: other widths a mode of fixed width runs at when ``trainer.width`` names one on the
    command line (ddp: 2, through the pipelined hook); there it applies ``stalenesses``.
    ``stalenesses``: the staleness rules it applies (None: every registered rule).
    ``reductions``: also carries top-k / PowerSGD and error feedback (state kept across steps).
    ``allreduce``: reduces over the configured ``comm``; otherwise ``comm`` is not used.
    ``comms``: where it does, the registered allreduces it runs (None: every one; live: those
    that run over torchft's group). ``refused_comms``: ``(name, why)`` pairs, why it does not
    run one it leaves out of ``comms`` (the refusal says so).
    Its timing shape, what :mod:`pipesgd.timing` prices: ``overlap``, what a reduction runs
    beside: ``"pipeline"`` (the next steps' forward and backward, at width >= 2; nothing at width
    1), ``"backward"`` (DDP's buckets, under this step's backward), ``"async"`` (ps_async: the
    server serves the others while a worker computes) or ``"none"`` (no reduction at all);
    ``server``: gradients go through a parameter server on rank 0 (the model's ``"ps"``
    exchange) instead of an allreduce; ``fixed_comm``: the registered allreduce it always runs when
    it neither uses the configured ``comm`` nor has a server (ddp: the backend's).
    ``nonfinite_skip``: the ranks can drop a non-finite step together (``trainer.nonfinite=skip``).
    ``sync_every``: runs at ``trainer.sync_every`` > 1 (inner steps per round, the outer step
    carried by its schedule: :mod:`pipesgd.engine.diloco`); other modes refuse it.
    ``sync_delay``: runs at ``trainer.sync_delay`` > 0, inner steps between a round's launch and the
    step that waits for it (torchft_diloco: torchft's ``fragment_sync_delay``; pipe at width 2: the
    step its average lands); other modes refuse it.
    ``replicas``: at ``trainer.sync_every`` > 1 its replicas may be groups of ``dist.ranks_per_replica``
    ranks (data parallelism inside each, the rounds between them); other modes refuse k > 1.
    ``rounds_only``: runs only at ``trainer.sync_every`` > 1 and resumes only where a fragment has
    just synced (torchft_diloco: torchft keeps its place inside a period to itself).
    ``min_world``: fewest processes it runs with. ``reference``: the blocking baseline the timing
    model's table compares every row against (``speedup_vs_sync``; sync: its allreduce is the one
    that declares ``reference`` too, uncompressed).
    ``replicas_agree``: identical weights after every step (replica checks apply).
    ``check_on_reductions``: the replica check rides on the engine's own reductions:
    ``trainer.check_every`` reaches its builder (``ModeArgs.check_every``) and the reliability
    hooks gather no digests (live: its replica groups share no process group to gather on).
    ``elastic``: a checkpoint resumes on another world size (pipesgd.reliability.elastic's rules cover its
    state; a parameter server's master copy on one rank is not covered).
    ``nccl``: runs on the NCCL backend (ps_async's server receives from whichever worker pushes
    first, a receive from any source, which NCCL does not support). ``launcher``: the function
    that starts the workers in place of :func:`pipesgd.launch.run`, with its arguments (live: one
    process per replica group behind a lighthouse; it may return the path of the run's
    summary.json where that is not the run directory's), or None. ``settings``: the mode's own keys,
    ``trainer.<mode>.*`` (a dict), parsed into what its launcher takes, ValueError naming the key
    and the bad value (the config checks call it before any worker starts), or None: it has none.
    ``settings_key``: the ``trainer.<key>`` its settings read where that is another mode's (torchft_diloco
    runs behind the live launcher, so it reads ``trainer.live``); None: its own name."""

    width: int | None = 1
    staleness: bool = False
    compressors: tuple[str, ...] | None = None
    ddp_hooks: bool = False
    widths: tuple[int, ...] = ()
    stalenesses: tuple[str, ...] | None = None
    reductions: bool = False
    allreduce: bool = False
    comms: tuple[str, ...] | None = None
    refused_comms: tuple[tuple[str, str], ...] = ()
    overlap: str = "pipeline"
    server: bool = False
    fixed_comm: str | None = None
    nonfinite_skip: bool = True
    sync_every: bool = False
    sync_delay: bool = False
    replicas: bool = False
    rounds_only: bool = False
    min_world: int = 1
    reference: bool = False
    replicas_agree: bool = True
    check_on_reductions: bool = False
    elastic: bool = True
    nccl: bool = True
    launcher: Callable[..., object] | None = None
    settings: Callable[[dict], object] | None = None
    settings_key: str | None = None

    def __post_init__(self) -> None:
        if self.overlap not in OVERLAPS:
            raise ValueError(f"overlap={self.overlap!r} is not known; allowed: {', '.join(OVERLAPS)}")
        if self.check_on_reductions and not self.replicas_agree:
            raise ValueError("check_on_reductions=True needs replicas_agree=True: a check compares replicas "
                             "that agree")

    def runs_at(self, width: int, asked: bool = True) -> int:
        """The width this mode runs at when ``trainer.width`` is ``width``: its own fixed width,
        unless ``width`` is one of its ``widths`` and ``asked`` (set on the command line: a config
        file's width is pipe's default, which a mode of fixed width does not take); ``width``
        itself for a pipelined mode."""
        return width if asked and width in self.widths else self.width or width


FIELDS = tuple(f.name for f in fields(Mode))
REGISTRY: Registry[Callable] = Registry("mode", facts=FIELDS)
"""Engine builders by ``trainer.mode``; their facts are a :class:`Mode`'s fields."""


def register(name: str, **facts) -> Callable[[Callable], Callable]:
    """Decorator on an engine builder: ``trainer.mode=name`` builds with it. ``facts``: fields of
    :class:`Mode` (the rest keep their defaults). One builder may serve several modes (a decorator
    each: pipe.py's serves sync and pipe); the builder is not renamed."""
    unknown = sorted(set(facts) - set(FIELDS))
    if unknown:
        raise TypeError(f"mode {name!r} declares {', '.join(unknown)}, which are not facts of a mode; "
                        f"allowed: {', '.join(FIELDS)}")
    try:
        row = Mode(**facts)
    except ValueError as e:
        raise ValueError(f"mode {name!r}: {e}") from None

    def deco(builder: Callable) -> Callable:
        REGISTRY.add(name, builder, **vars(row))
        return builder

    return deco


LEAD = ("sync", "pipe")
"""The paper's modes, first in every listing of :func:`modes`."""


def modes() -> list[str]:
    """Every registered ``trainer.mode``: :data:`LEAD`, then the rest by family (the name up to its
    first underscore: ddp, live, local, ps_*, torchft_*), in registration order within one; so a
    mode's place does not hang on which package registered it (the torchft wing's come last)."""
    names = list(registry("mode"))
    rest = sorted((n for n in names if n not in LEAD), key=lambda n: n.split("_")[0])
    return [n for n in LEAD if n in names] + rest


def get_mode(name: str) -> Mode:
    """The facts ``trainer.mode=name`` declared; ValueError naming the known modes."""
    try:
        return Mode(**registry("mode").facts(name))
    except ValueError:
        raise ValueError(f"trainer.mode={name!r} is not known; allowed: {', '.join(modes())}") from None


def builder(name: str) -> Callable:
    """The engine builder registered as ``trainer.mode=name``."""
    get_mode(name)
    return registry("mode").get(name)


def modes_with(setting: str) -> list[str]:
    """The modes whose ``setting`` flag is true, e.g. ``modes_with("staleness")``."""
    if setting not in FIELDS:
        raise ValueError(f"{setting!r} is not a field of Mode; fields: {', '.join(FIELDS)}")
    return [name for name in modes() if registry("mode").facts(name)[setting]]


def carries(name: str, compressor: object) -> bool:
    """Whether ``trainer.mode=name`` carries ``compressor`` (an instance): one that declares a DDP
    hook where the mode declares ``ddp_hooks``, one its ``compressors`` name, else any
    (:func:`check_compressor` says what else a configuration must meet)."""
    mode = get_mode(name)
    if mode.ddp_hooks:
        return compressor.ddp_hook() is not None
    return mode.compressors is None or compressor.name in mode.compressors


def ddp_carried() -> list[str]:
    """The compressors and reductions that declare a DDP comm hook (at their defaults)."""
    return [n for kind in ("compressor", "reduction") for n in registry(kind) if registry(kind)[n]().ddp_hook()]


def check_comm(name: str, allreduce: str) -> None:
    """ValueError unless ``trainer.mode=name`` runs ``comm=allreduce`` (a registered name): every
    allreduce where the mode reduces over the configured one and lists none, only those it lists
    (its ``comms``), and any where it does not use ``comm`` at all."""
    mode = get_mode(name)
    if mode.allreduce and mode.comms is not None and allreduce not in mode.comms:
        why = dict(mode.refused_comms).get(allreduce)
        raise ValueError(f"comm={allreduce} is not available with trainer.mode={name}{f': {why}' if why else ''}; "
                         f"allowed: {', '.join(mode.comms)}")


def replica_problems(name: str, k: int, sync_every: int, compressor: str, allreduce: str | None) -> list[str]:
    """What ``dist.ranks_per_replica=k`` > 1 cannot run with, one message each: a mode or a
    ``trainer.sync_every`` without rounds (each rank is a replica there, or there are no replicas),
    a reduction that cannot run on a shard of the flat buffer (its declared ``shardable``), an
    allreduce built on node groups of the whole world (its declared ``node_groups``)."""
    if k == 1:
        return []
    out, key = [], f"dist.ranks_per_replica={k}"
    runs = "|".join(m for m in modes_with("replicas"))
    if not get_mode(name).replicas:
        out.append(f"{key} is not available with trainer.mode={name}: replicas of several ranks are the rounds' "
                   f"(trainer.mode={runs or 'none'} at trainer.sync_every > 1); use dist.ranks_per_replica=1")
    elif sync_every == 1:
        out.append(f"{key} makes replicas of several ranks that exchange rounds: at trainer.sync_every=1 every "
                   "step is averaged over every rank and there are no replicas; set trainer.sync_every=H > 1 "
                   "or dist.ranks_per_replica=1")
    if compressor in registry("reduction") and not registry("reduction").facts(compressor)["shardable"]:
        out.append(f"compressor={compressor} is not available with {key}: it reads each parameter's shape, which "
                   "the rank peers' shards of the flat buffer cut across")
    if allreduce in registry("allreduce") and registry("allreduce").facts(allreduce).get("node_groups"):
        out.append(f"comm={allreduce} is not available with {key}: it builds node groups of the whole world, and "
                   "with replicas of several ranks the replica is the node; use comm=ring|native|auto")
    return out


def check_compressor(name: str, compressor: object, allreduce: str | None = None) -> None:
    """The one check of a compressor on its way in (the launcher runs it before any worker
    starts): ValueError unless ``trainer.mode=name`` carries ``compressor`` (a resolved per-chunk
    Compressor or Reduction) as configured, error feedback included, and, where the mode reduces
    over the configured allreduce (``allreduce``, a registered name), that allreduce carries a
    per-chunk compressor (its declared ``carries``; reductions run collectives of their own)."""
    mode = get_mode(name)
    if mode.ddp_hooks and compressor.ddp_hook() is None:
        raise ValueError(f"compressor={compressor.name} is not available with trainer.mode={name}: it declares no "
                         f"DDP comm hook (ddp_hook()); allowed: {', '.join(ddp_carried())}")
    if mode.compressors is not None and compressor.name not in mode.compressors:
        raise ValueError(f"compressor={compressor.name} is not available with trainer.mode={name}; "
                         f"allowed: {', '.join(mode.compressors)}")
    reduction = compressor.name in registry("reduction")
    if mode.allreduce and allreduce is not None and not reduction:
        rule = registry("allreduce").facts(allreduce).get("carries")  # e.g. native: only a cast the backend sums
        if rule is not None:
            rule(compressor)
    if mode.reductions or (mode.compressors is not None or mode.ddp_hooks) and reduction:
        return  # a reduction the mode carries is its own (ddp: torch's PowerSGD hook, with its error feedback)
    where = f"trainer.mode={'|'.join(modes_with('reductions'))}"
    if reduction:
        raise ValueError(f"compressor={compressor.name} is not available with trainer.mode={name}, which carries "
                         f"per-chunk compressors only; {compressor.name} runs with {where}")
    if compressor.error_feedback:
        raise ValueError(f"compressor.error_feedback=true is not used by trainer.mode={name}; error feedback "
                         f"runs with {where} (set compressor.error_feedback=false)")
