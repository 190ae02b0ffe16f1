"""Hydra entry and composition root: logging -> dist -> instantiate -> fit -> teardown.

``python -m pipesgd.train +experiment=resnet_cifar`` resolves the config ONCE in the launching
process, validates it and prepares the data there (bad input fails before any worker starts),
then starts ``dist.nproc`` workers that share the launcher's run directory. Under torchrun (or
``pipesgd_lab.emulate``) every process is a worker and rank 0's run directory is the run directory.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import hydra
import torch
from hydra.core.hydra_config import HydraConfig
from hydra.errors import InstantiationException
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from . import dist as pdist
from . import launch, outer, schema  # noqa: F401  (schema: registers the structured config with Hydra)
from .observability import trace
from .comm import bind, get_allreduce
from .config import (ConfigError, KeyOrigin, Settled, check_batch, check_removed, command_line_keys, replica_size,
                     settle, validate)
from .data import DatasetError
from .engine import Engine, ModeArgs
from .engine.parity import clip_applied_gradient
from .reliability.faults import Faults
from .observability.hostinfo import fingerprint
from .launch import replica_shard
from .observability.metrics import make_writer
from .engine.build import build
from .modes import get_mode
from .objective import Objective
from .staleness import make_staleness
from .placement import pin
from .reliability.hooks import Reliability
from .observability.runinfo import commit_fields, git_commit, write_json_atomic
from .observability.summary import Prediction, summary
from .timing import algorithm_for
from .trainer import Trainer, median
from .reliability.watchdog import Watchdog

log = logging.getLogger("pipesgd.train")


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def main(cfg: DictConfig) -> float | None:
    run_dir = Path(HydraConfig.get().runtime.output_dir)
    try:
        hydra_cfg = HydraConfig.get()
        explicit = command_line_keys(hydra_cfg.overrides.task)
        # the second time: conf/config.yaml's Precheck callback ran it before Hydra made the run dir
        settled = validate(cfg, explicit, KeyOrigin(hydra_cfg.runtime.choices, hydra_cfg.overrides.task))
        _check_buildable(cfg)
        if not launch.under_torchrun() or pdist.env_int("LOCAL_RANK", 0) == 0:
            instantiate(cfg.data).prepare()
    except (ConfigError, DatasetError, ValueError) as e:
        log.error("%s", e)
        sys.exit(2)
    except InstantiationException as e:
        log.error("%s", e.__cause__ if e.__cause__ is not None else str(e).strip().splitlines()[0])
        sys.exit(2)

    container = OmegaConf.to_container(cfg, resolve=True, enum_to_str=True)
    # The worker by its module's name: spawned workers import it by that name, and where main()
    # itself arrives pickled (submitit runs a sweep's jobs on SLURM so) __main__ is not this module.
    from pipesgd.train import worker as importable_worker

    # a mode may start its workers its own way (live: one process per replica group, restarted alone)
    start = launch.for_mode(cfg.trainer.mode)
    try:
        # a launcher may say where the summary is (live under torchrun: this replica group's)
        summary_path = Path(start(importable_worker, (container, str(run_dir), settled), nproc=cfg.dist.nproc,
                                  max_restarts=cfg.dist.max_restarts) or run_dir / "summary.json")
    except (launch.WorkerFailed, pdist.RendezvousError) as e:
        log.error("%s (run dir %s)", e, run_dir)
        sys.exit(1)
    except launch.Terminated as e:
        log.error("%s. Run the job again with the same run directory to resume from its newest checkpoint "
                  "(trainer.resume=auto): %s", e, run_dir)
        sys.exit(e.status)
    if launch.under_torchrun() and pdist.env_int("RANK", 0) != 0:
        return None
    done = json.loads(summary_path.read_text())
    log.info("done: test accuracy %.2f%%, median iteration %.1f ms, %s",
             100 * done["test_accuracy"], done["median_iter_ms"], summary_path)
    return done["test_accuracy"]


def _check_buildable(cfg: DictConfig) -> None:
    """Instantiate the cheap objects once so their own argument checks run before workers start
    (the compressor was built and checked against the mode and the allreduce by ``validate``)."""
    instantiate(cfg.comm)
    instantiate(cfg.staleness)
    data = instantiate(cfg.data)
    world = pdist.env_int("WORLD_SIZE", 1) if launch.under_torchrun() else cfg.dist.nproc
    check_batch(data.batch_size, data.train_size, world)


@dataclass
class _Run:
    """What a worker builds before training: the parts the trainer and the summary read."""

    loaders: tuple
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: object
    compressor: object
    engine: Engine
    lr: float
    global_batch: int
    comm: str
    allreduce: str
    objective: Objective
    data: dict


def worker(container: dict, run_dir: str, settled: Settled | None = None) -> None:
    """One rank of the job: everything from process group to summary.json, torn down in one place.
    ``settled``: what the launching process decided the config runs (:func:`pipesgd.config.settle`);
    None: the container's width and rule as they are."""
    cfg = OmegaConf.create(container)
    _setup_logging(pdist.env_int("RANK", 0), run_dir)
    placement = pin(cfg.dist.get("cpu_affinity"), pdist.env_int("RANK", 0), pdist.env_int("LOCAL_RANK", 0))
    threads = _threads(cfg)
    ctx = pdist.init(cfg.dist.backend, cfg.dist.timeout_s)
    started_on = git_commit() if ctx.is_main else None  # the code this run imports, not the checkout at its end
    run = writer = None
    failed = False
    try:
        tracer = trace.Tracer(ctx.rank, cfg.trainer.trace_steps) if cfg.trainer.trace else trace.NULL_TRACER
        trace.install(tracer)
        run_dir = pdist.broadcast_object(run_dir, ctx)
        torch.manual_seed(cfg.seed)
        settled = settled or settle(cfg, ("trainer.width", "staleness"))
        run = _build(cfg, ctx, settled)
        writer = make_writer(run_dir, ctx.is_main)
        log.info("mode=%s width=%d staleness=%s compressor=%s allreduce=%s world=%d global batch %d lr %.4g "
                 "threads/worker %d", cfg.trainer.mode, run.engine.width, settled.staleness, run.compressor.name,
                 run.allreduce, ctx.world_size, run.global_batch, run.lr, threads)
        k = replica_size(cfg)
        if k > 1:
            log.info("replicas: %d of %d ranks each (dist.ranks_per_replica): inner steps averaged inside a replica, "
                     "rounds exchanged between replicas in %d shards", ctx.world_size // k, k, k)
        if placement["core"] is not None:
            log.info("workers pinned by dist.cpu_affinity=%s: this rank on core %d of %s", placement["rule"],
                     placement["core"], placement["allowed"])
        predict = _prediction(cfg, run, ctx.world_size)
        record = settled.record(container)  # the config as this run runs it, as checkpoints compare it
        reliability = _reliability(cfg, ctx, run, run_dir, record, settled.staleness)
        trainer = Trainer(run.model, run.engine, run.optimizer, run.scheduler, *run.loaders, writer,
                          epochs=cfg.trainer.epochs, max_steps=cfg.trainer.max_steps,
                          stop_after_step=cfg.trainer.stop_after_step,
                          log_every=cfg.trainer.log_every, device=ctx.device, is_main=ctx.is_main,
                          predict=lambda h: predict(h)[0], eval_max_batches=cfg.trainer.eval_max_batches,
                          eval_every_steps=cfg.trainer.eval_every_steps, hooks=reliability,
                          objective=run.objective)
        _share_position(run.engine, run.scheduler, trainer)
        _warn_if_never_pipelined(cfg, run.engine.width, trainer.total_steps, ctx.is_main)
        with reliability.guard():
            result = trainer.fit()
        if tracer.enabled:
            trace.save(tracer, run_dir, {"mode": cfg.trainer.mode, "width": run.engine.width,
                                         "warmup_sync_steps": cfg.trainer.warmup_sync_steps,
                                         "compressor": run.compressor.name, "allreduce": run.allreduce})
        if ctx.is_main:
            _write_results(cfg, ctx, run, trainer, result, predict(trainer.history), reliability, writer,
                           Path(run_dir), record, threads, placement, settled.staleness, started_on)
    except BaseException as e:
        failed = True
        if isinstance(e, Exception):  # logged before the teardown, which a hung collective could end
            log.error("rank %d failed: %s: %s", ctx.rank, type(e).__name__, e)
        raise
    finally:
        trace.install(trace.NULL_TRACER)
        if writer is not None:
            writer.close()
        if run is not None:
            run.engine.close()
        pdist.destroy(abort=failed)  # after an error a collective may hang: never wait for it


def _warn_if_never_pipelined(cfg: DictConfig, width: int, total_steps: int, is_main: bool) -> None:
    """A shortened run of a recipe with a synchronous warm-up (gpt_shakespeare: 300 steps) that the
    warm-up covers is synchronous throughout: said, not silent."""
    warmup = cfg.trainer.warmup_sync_steps
    if is_main and width > 1 and get_mode(cfg.trainer.mode).width is None and warmup >= total_steps:
        log.warning("trainer.warmup_sync_steps=%d covers all %d steps of this run: it trains synchronously "
                    "throughout and never pipelines; set trainer.warmup_sync_steps below %d to run the pipeline",
                    warmup, total_steps, total_steps)


def _share_position(engine: Engine, scheduler, trainer: Trainer) -> None:
    """What a replica healing from this one takes beside the engine's state (trainer.mode=live):
    the schedule's position and the loop's step count, which also moves the healer's data to the
    position of that step in its own shard (:meth:`Trainer.seek`), and the evaluations so far, in
    place of the healer's own (of weights it no longer holds), so its summary.json has the run's
    whole curve, as a checkpoint resume's has."""
    engine.register_state("scheduler", scheduler.state_dict, scheduler.load_state_dict)
    engine.register_state("trainer_step", lambda: trainer.step, trainer.seek)
    engine.register_state("evals", lambda: trainer.history.evals,
                          lambda evals: setattr(trainer.history, "evals", list(evals)))


def _threads(cfg: DictConfig) -> int:
    """torch threads per worker: the config's, else OMP_NUM_THREADS, else the cores shared by the
    node's workers; set for this process."""
    threads = cfg.dist.threads_per_worker or pdist.env_int("OMP_NUM_THREADS", 0) or max(
        1, (os.cpu_count() or 1) // pdist.env_int("LOCAL_WORLD_SIZE", 1))
    torch.set_num_threads(threads)
    return threads


def _build(cfg: DictConfig, ctx: pdist.DistContext, settled: Settled) -> _Run:
    """Data, model (rank 0's weights everywhere), optimizer at the linearly scaled lr, the mode's
    engine and the schedule over the run's steps."""
    dataset = instantiate(cfg.data)
    train_split, test_split = dataset.load()
    # a live run's replica groups are lone processes; each reads its group's share of the data
    shard, shards = replica_shard() or (ctx.rank, ctx.world_size)
    k = replica_size(cfg)  # replicas of k ranks: the data by replica, then rank inside it
    train_loader = dataset.train_loader(train_split, shard, shards, cfg.seed, ranks_per_replica=k)
    eval_loader = dataset.eval_loader(test_split, ctx.rank, ctx.world_size)
    model = instantiate(cfg.model, **dataset.model_inputs).to(ctx.device)
    _broadcast_parameters(model)
    global_batch = train_loader.batch_size * shards
    ref = cfg.trainer.lr_reference_batch
    lr = cfg.optimizer.lr * (global_batch / ref if ref else 1.0)
    optimizer = instantiate(cfg.optimizer)(model.parameters(), lr=lr)
    compressor = instantiate(cfg.compressor)
    mode = get_mode(cfg.trainer.mode)
    # the allreduce that runs (comm=auto picks one for this backend and compressor, docs/gpu.md);
    # the config and the run's digest keep the configured name
    comm = bind(get_allreduce(cfg.comm.name), compressor, ctx.backend).name
    model, engine = build(cfg.trainer.mode, ModeArgs(
        model=model, optimizer=optimizer, width=settled.width, compressor=compressor,
        allreduce=_build_allreduce(cfg, comm) if mode.allreduce else None, group=ctx.comm_group,
        world_size=ctx.world_size, warmup_sync_steps=cfg.trainer.warmup_sync_steps, device=ctx.device,
        staleness=instantiate(cfg.staleness) if settled.from_group else make_staleness(settled.staleness),
        nonfinite=cfg.trainer.nonfinite, timeout_s=ctx.engine_timeout_s,
        check_every=cfg.trainer.check_every if mode.check_on_reductions else None,
        sync_every=cfg.trainer.sync_every, fragments=cfg.trainer.fragments, sync_delay=cfg.trainer.sync_delay,
        landing_alpha=cfg.trainer.get("landing_alpha"), fragment_layout=cfg.trainer.get("fragment_layout", "contiguous"),
        outer_optimizer=_outer_optimizer(cfg, ctx.world_size // k) if cfg.trainer.sync_every > 1 else None,
        replicas=pdist.replica_groups(k, cfg.dist.timeout_s) if k > 1 else None))
    if cfg.trainer.max_grad_norm is not None:
        clip_applied_gradient(optimizer, cfg.trainer.max_grad_norm)
    steps_per_epoch = len(train_loader)
    total = cfg.trainer.epochs * steps_per_epoch
    total = min(total, cfg.trainer.max_steps) if cfg.trainer.max_steps else total
    scheduler = instantiate(cfg.scheduler)(optimizer, total_steps=total, steps_per_epoch=steps_per_epoch)
    return _Run((train_loader, eval_loader), model, optimizer, scheduler, compressor, engine, lr, global_batch,
                comm, algorithm_for(cfg.trainer.mode, comm), dataset.objective, dataset.report())


def _reliability(cfg: DictConfig, ctx: pdist.DistContext, run: _Run, run_dir: str, container: dict,
                 rule: str) -> Reliability:
    """The trainer's hooks: checkpoints and resume, replica checks, faults, the hang watchdog."""
    t, mode, k = cfg.trainer, get_mode(cfg.trainer.mode), replica_size(cfg)
    agree = mode.replicas_agree and run.engine.replicas_agree
    if not run.engine.replicas_agree and t.check_every is not None and ctx.is_main:
        log.info("trainer.check_every=%d checks nothing here: this run's replicas differ by design (%s)",
                 t.check_every, rule)
    return Reliability(
        model=run.model, optimizer=run.optimizer, scheduler=run.scheduler, engine=run.engine, rank=ctx.rank, world_size=ctx.world_size, device=ctx.device, run_dir=run_dir,
        config=container, checkpoint_every=t.checkpoint_every, keep=t.keep_checkpoints, resume=t.resume,
        # replicas of several ranks: the ranks of each are checked to agree whatever the rule
        check_every=t.check_every if (agree or k > 1) and not mode.check_on_reductions else None,
        replicas_agree=agree, ranks_per_replica=k,
        faults=Faults.from_env(ctx.rank), watchdog=Watchdog.from_env(ctx.rank, ctx.world_size, cfg.dist.timeout_s),
        elastic=t.elastic, mode=t.mode)


def _write_results(cfg: DictConfig, ctx: pdist.DistContext, run: _Run, trainer: Trainer, result: dict,
                   predicted: tuple, reliability: Reliability, writer, run_dir: Path, container: dict,
                   threads: int, placement: dict, rule: str, started_on: str) -> None:
    """Rank 0: TensorBoard's HParams row, summary.json and history.json. ``started_on``: the commit
    read when the run started; summary.json names it (and the one at the end only if it moved)."""
    h = trainer.history
    commits = commit_fields(started_on, git_commit())
    if "git_commit_at_end" in commits:
        log.warning("the checkout moved while this run ran (started on %s, now %s): summary.json names the "
                    "commit it started on and adds git_commit_at_end", started_on, commits["git_commit_at_end"])
    name = run.compressor.name
    writer.hparams(_hparams(cfg, run, ctx.world_size), {
        "hparams/test_accuracy": result["test_accuracy"], "hparams/test_loss": result["test_loss"],
        "hparams/iter_ms": median(h.iter_ms), "hparams/predicted_iter_ms": predicted[0],
        "hparams/wall_seconds": result["wall_seconds"]}, trainer.step)
    write_json_atomic(run_dir / "summary.json", summary(
        h, result, predicted, mode=cfg.trainer.mode, width=run.engine.width, staleness=rule,
        compressor=name, allreduce=run.allreduce, world_size=ctx.world_size, backend=ctx.backend,
        replicas=ctx.world_size // replica_size(cfg), ranks_per_replica=replica_size(cfg),
        steps=trainer.step, total_steps=trainer.total_steps, global_batch=run.global_batch, lr=run.lr, threads_per_worker=threads,
        placement=placement,
        **commits, host=fingerprint(), config=container, data=run.data, **reliability.summary(), **run.engine.summary()))
    # Per-step timings for benchmarks that skip warm-up steps (pipesgd_lab.bench).
    write_json_atomic(run_dir / "history.json", {k: v for k, v in vars(h).items() if k != "evals"})


def _build_allreduce(cfg: DictConfig, name: str):
    """The configured algorithm as ``name`` (the one ``comm=auto`` bound), given the means to create
    node groups (collectively, once per run) in case it declares it needs them."""
    return instantiate(cfg.comm, name=name,
                       node_groups=functools.partial(pdist.node_groups, timeout_s=cfg.dist.timeout_s))


def _outer_optimizer(cfg: DictConfig, replicas: int):
    """The outer step of ``trainer.sync_every > 1``: the ``outer_optimizer`` group's, with any null
    among SGD's lr, momentum and nesterov following H and the ``replicas`` M (pipesgd.outer)."""
    given = OmegaConf.to_container(cfg.outer_optimizer, resolve=True)
    if given.get("_target_") == "torch.optim.SGD":
        given = outer.fill(given, cfg.trainer.sync_every, replicas)
        log.info("outer step: SGD lr %g momentum %g%s (H=%d, M=%d)", given["lr"], given["momentum"],
                 " Nesterov" if given["nesterov"] else "", cfg.trainer.sync_every, replicas)
    return instantiate(given)


def _hparams(cfg: DictConfig, run: _Run, world_size: int) -> dict:
    """What a sweep varies, flat, for TensorBoard's HParams tab."""
    return {"mode": cfg.trainer.mode, "width": run.engine.width, "sync_every": cfg.trainer.sync_every,
            "compressor": run.compressor.name, "comm": run.comm,
            "world_size": world_size, "model": cfg.model._target_.rsplit(".", 1)[-1],
            "data": cfg.data._target_.rsplit(".", 1)[-1], "global_batch": run.global_batch,
            "lr": float(cfg.optimizer.lr), "warmup_sync_steps": cfg.trainer.warmup_sync_steps,
            "seed": cfg.seed}


def _prediction(cfg: DictConfig, run: _Run, world_size: int) -> Prediction:
    """The timing model's prediction for this run: what carries the mode's gradients, priced as the
    plugins declare (pipesgd.engine.ps puts the server on rank 0, a worker too)."""
    options = {"server_on_worker": get_mode(cfg.trainer.mode).server,
               "per_node": cfg.comm.get("group_size") or pdist.env_int("LOCAL_WORLD_SIZE", world_size),
               "buffers": any(True for _ in run.model.buffers())}
    if cfg.trainer.sync_every > 1:
        options |= {"sync_every": cfg.trainer.sync_every, "fragments": cfg.trainer.fragments,
                    "sync_delay": cfg.trainer.sync_delay, "ranks_per_replica": replica_size(cfg)}
    trainable = [p for p in run.model.parameters() if p.requires_grad]
    return Prediction(instantiate(cfg.timing), cfg.trainer.mode, run.allreduce, run.engine.width,
                      sum(p.numel() * p.element_size() for p in trainable), sum(p.numel() for p in trainable),
                      run.loaders[0].batch_size, world_size, run.compressor.name, options)


def _broadcast_parameters(model: torch.nn.Module) -> None:
    """Start every replica from rank 0's weights, whatever each rank's RNG did."""
    import torch.distributed as dist

    if dist.is_initialized():
        for t in list(model.parameters()) + list(model.buffers()):
            dist.broadcast(t.data, src=0)


def _setup_logging(rank: int, run_dir: str) -> None:
    root = logging.getLogger()
    if rank != 0:
        root.setLevel(logging.WARNING)
        if not root.handlers:
            h = logging.StreamHandler()
            h.setFormatter(logging.Formatter(f"[%(asctime)s][rank {rank}][%(levelname)s] - %(message)s"))
            root.addHandler(h)
        return
    root.setLevel(logging.INFO)
    if not root.handlers:
        fmt = logging.Formatter("[%(asctime)s][%(name)s][%(levelname)s] - %(message)s")
        for h in (logging.StreamHandler(), logging.FileHandler(Path(run_dir) / "train.log")):
            h.setFormatter(fmt)
            root.addHandler(h)


def cli() -> None:
    """``python -m pipesgd.train``: under torchrun, ranks other than 0 must not create run
    directories of their own (each would resolve ``${now:}`` separately); rank 0's is shared. A
    removed key on the command line is refused here, with its new spelling, before Hydra parses it."""
    try:
        check_removed(sys.argv[1:])
    except ConfigError as e:
        sys.stderr.write(f"{e}\n")
        sys.exit(2)
    if launch.under_torchrun() and os.environ.get("RANK") != "0":
        sys.argv += ["hydra.output_subdir=null", "hydra.run.dir=.", "hydra/job_logging=none",
                     "hydra/hydra_logging=none"]
    main()


if __name__ == "__main__":
    cli()
