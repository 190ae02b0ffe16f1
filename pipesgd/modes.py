"""Every ``trainer.mode``, declared once: the engine that builds it and the settings it honours.

Pure data (no torch at import): the config checks, the worker's composition root, the timing model
and the tests read this table; a setting a mode does not use is rejected, never ignored. Building a
mode's engine is :func:`pipesgd.engine.build.build`'s, so reading the table imports no engine.
"""

from __future__ import annotations

from dataclasses import dataclass

from .registry import Registry, registry


@dataclass(frozen=True)
class Mode:
    """``engine``: ``"module:function"``, a builder taking :class:`~pipesgd.engine.base.ModeArgs`
    and returning ``(model, Engine)``, imported when the mode is built.
    ``width``: the engine's fixed width, or None when it runs at ``trainer.width`` (pipelined).
    ``staleness``: applies ``trainer.staleness`` (other modes take only ``none``).
    ``compressors``: the compressor names it carries, or None for every per-chunk compressor.
    ``ddp_hooks``: it carries exactly the compressors and reductions that declare a DDP comm hook
    (their ``ddp_hook()``), error feedback their hook's own.
    ``widths``: other widths a mode of fixed width runs at when ``trainer.width`` names one on the
    command line (ddp: 2, through the pipelined hook); there it applies ``stalenesses``.
    ``stalenesses``: the staleness rules it applies (None: every registered rule).
    ``reductions``: also carries top-k / PowerSGD and error feedback (state kept across steps).
    ``allreduce``: reduces over the configured ``comm``; otherwise ``comm`` is not used.
    Its timing shape, what :mod:`pipesgd.timing` prices: ``overlap``, what a reduction runs
    beside: ``"pipeline"`` (the next steps' forward and backward, at width >= 2; nothing at width
    1), ``"backward"`` (DDP's buckets, under this step's backward), ``"async"`` (ps_async: the
    server serves the others while a worker computes) or ``"none"`` (no reduction at all);
    ``server``: gradients go through a parameter server on rank 0 (the model's ``"ps"``
    exchange) instead of an allreduce; ``fixed_comm``: the registered allreduce it always runs when
    it neither uses the configured ``comm`` nor has a server (ddp: the backend's). ``nonfinite_skip``: the ranks can drop a non-finite step
    together (``trainer.nonfinite=skip``). ``min_world``: fewest processes it runs with.
    ``replicas_agree``: identical weights after every step (replica checks apply).
    ``elastic``: a checkpoint resumes on another world size (pipesgd.elastic's rules cover its
    state; a parameter server's master copy on one rank is not covered).
    ``nccl``: runs on the NCCL backend (ps_async's server receives from whichever worker pushes
    first, a receive from any source, which NCCL does not support). ``launcher``: ``"module:function"``
    that starts the workers in place of :func:`pipesgd.launch.run` (live: one process per replica
    group behind a lighthouse), or None."""

    engine: str
    width: int | None = 1
    staleness: bool = False
    compressors: tuple[str, ...] | None = None
    ddp_hooks: bool = False
    widths: tuple[int, ...] = ()
    stalenesses: tuple[str, ...] | None = None
    reductions: bool = False
    allreduce: bool = False
    overlap: str = "pipeline"
    server: bool = False
    fixed_comm: str | None = None
    nonfinite_skip: bool = True
    min_world: int = 1
    replicas_agree: bool = True
    elastic: bool = True
    nccl: bool = True
    launcher: str | None = None

    def runs_at(self, width: int) -> int:
        """The width this mode runs at when ``trainer.width`` is ``width``: its own fixed width,
        unless ``width`` is one of its ``widths``; ``width`` itself for a pipelined mode."""
        return width if width in self.widths else self.width or width


MODES: dict[str, Mode] = {
    "sync": Mode("pipesgd.engine.pipe:build", width=1, staleness=True, reductions=True, allreduce=True),
    "pipe": Mode("pipesgd.engine.pipe:build", width=None, staleness=True, reductions=True, allreduce=True),
    "ddp": Mode("pipesgd.engine.ddp:build", ddp_hooks=True, widths=(2,), stalenesses=("none", "lookahead"),
                overlap="backward", fixed_comm="native"),
    "ps_sync": Mode("pipesgd.engine.ps:build_sync", server=True, nonfinite_skip=False, min_world=2, elastic=False),
    "ps_async": Mode("pipesgd.engine.ps:build_async", overlap="async", server=True, nonfinite_skip=False,
                     min_world=2, replicas_agree=False, elastic=False, nccl=False),
    "local": Mode("pipesgd.engine.local:build", compressors=("none",), overlap="none", replicas_agree=False),
    # torchft's quorums (pipesgd[live]): replica groups without a shared process group, so no replica checks
    "live": Mode("pipesgd.engine.live:build", width=2, compressors=("none",), fixed_comm="native",
                 replicas_agree=False, elastic=False, nccl=False, launcher="pipesgd.live.launch:run"),
}

OVERLAPS = ("pipeline", "backward", "async", "none")
REGISTRY: Registry[Mode] = Registry("mode", facts=tuple(Mode.__dataclass_fields__))
for _name, _mode in MODES.items():
    if _mode.overlap not in OVERLAPS:
        raise ValueError(f"mode {_name!r}: overlap={_mode.overlap!r}; allowed: {', '.join(OVERLAPS)}")
    REGISTRY.add(_name, _mode)


def get_mode(name: str) -> Mode:
    if name not in MODES:
        raise ValueError(f"trainer.mode={name!r} is not known; allowed: {', '.join(MODES)}")
    return MODES[name]


def modes_with(setting: str) -> list[str]:
    """The modes whose ``setting`` flag is true, e.g. ``modes_with("staleness")``."""
    if setting not in Mode.__dataclass_fields__:
        raise ValueError(f"{setting!r} is not a field of Mode; fields: {', '.join(Mode.__dataclass_fields__)}")
    return [name for name in MODES if REGISTRY.facts(name)[setting]]


def carries(name: str, compressor: object) -> bool:
    """Whether ``trainer.mode=name`` has a row for ``compressor`` (an instance): one that declares a
    DDP hook where the row says ``ddp_hooks``, one its row names, else any (:func:`check_compressor`
    says what else a configuration must meet)."""
    mode = get_mode(name)
    if mode.ddp_hooks:
        return compressor.ddp_hook() is not None
    return mode.compressors is None or compressor.name in mode.compressors


def ddp_carried() -> list[str]:
    """The compressors and reductions that declare a DDP comm hook (at their defaults)."""
    return [n for kind in ("compressor", "reduction") for n in registry(kind) if registry(kind)[n]().ddp_hook()]


def check_compressor(name: str, compressor: object) -> None:
    """ValueError unless ``trainer.mode=name`` carries ``compressor`` (a per-chunk Compressor or a
    Reduction) as configured, error feedback included."""
    mode = get_mode(name)
    if mode.ddp_hooks and compressor.ddp_hook() is None:
        raise ValueError(f"compressor={compressor.name} is not available with trainer.mode={name}: it declares no "
                         f"DDP comm hook (ddp_hook()); allowed: {', '.join(ddp_carried())}")
    if mode.compressors is not None and compressor.name not in mode.compressors:
        raise ValueError(f"compressor={compressor.name} is not available with trainer.mode={name}; "
                         f"allowed: {', '.join(mode.compressors)}")
    if mode.reductions or (mode.compressors is not None or mode.ddp_hooks) and compressor.name in registry("reduction"):
        return  # a reduction the mode carries is its own (ddp: torch's PowerSGD hook, with its error feedback)
    where = f"trainer.mode={'|'.join(modes_with('reductions'))}"
    if compressor.name in registry("reduction"):
        raise ValueError(f"compressor={compressor.name} is not available with trainer.mode={name}, which carries "
                         f"per-chunk compressors only; {compressor.name} runs with {where}")
    if compressor.error_feedback:
        raise ValueError(f"compressor.error_feedback=true is not used by trainer.mode={name}; error feedback "
                         f"runs with {where} (set compressor.error_feedback=false)")

