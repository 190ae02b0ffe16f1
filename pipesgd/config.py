"""Cross-field checks on the composed config, run in the launching process before any worker
starts. Each failure is one line that names the key, the bad value and what is allowed."""

from __future__ import annotations

import copy
import dataclasses
import difflib
import inspect
import sys
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from hydra.errors import InstantiationException
from hydra.experimental.callback import Callback
from hydra.utils import get_object, instantiate
from omegaconf import DictConfig, OmegaConf, open_dict

from .dist import BACKENDS, env_int, ranks_per_replica
from .launch import under_torchrun
from . import period
from .modes import check_comm, check_compressor, get_mode, modes, modes_with, replica_problems
from .placement import check_rule as _check_placement
from .registry import registry
from .schema import Config, DistConfig, LiveConfig, TrainerConfig
from .staleness import available as stalenesses
from .staleness import rule_class, rules_besides


class ConfigError(ValueError):
    pass


def _int_at_least(cfg: DictConfig, key: str, low: int, hint: str = "", optional: bool = False) -> None:
    node, *path = key.split(".")
    value = cfg.get(node)
    for part in path:
        value = None if value is None else value.get(part)
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        extra = f" ({hint})" if hint else ""
        raise ConfigError(f"{key}={value!r} is invalid: must be an integer >= {low}{extra}")


REMOVED = {"trainer.staleness": "staleness={value}",
           "trainer.dc_lambda": "staleness=dc staleness.dc_lambda={value}",
           "trainer.dc_adaptive": "staleness=dc staleness.dc_adaptive={value}"}
"""Keys that were aliases of a config group -> their spelling now (docs/convergence.md)."""


def check_removed(overrides: Iterable[str]) -> None:
    """A :data:`REMOVED` key among Hydra overrides (``trainer.staleness=dc``, ``+trainer.dc_lambda=1``)
    is a :class:`ConfigError` giving the spelling that replaced it. The entry point runs this on the
    command line before Hydra composes, whose own message would suggest ``+`` instead."""
    for override in overrides:
        key, _, value = override.partition("=")
        new = REMOVED.get(key.lstrip("+~"))
        if new is not None:
            raise ConfigError(f"{override} is no longer a setting: the staleness rule is its config group; "
                              f"use {new.format(value=value or 'VALUE')} (docs/convergence.md)")


def _known_keys(cfg: DictConfig) -> None:
    """Keys a ``+key=value`` override force-added past the schema (Hydra lets ``+`` append)."""
    for prefix, node, schema in (("", cfg, Config), ("trainer.", cfg.trainer, TrainerConfig),
                                 ("dist.", cfg.dist, DistConfig), ("trainer.live.", cfg.trainer.live, LiveConfig)):
        allowed = [f.name for f in dataclasses.fields(schema)]
        for key in node:
            if key not in allowed:
                check_removed([f"{prefix}{key}={node[key]}"])
                close = difflib.get_close_matches(str(key), allowed, n=1)
                hint = f"did you mean {prefix}{close[0]}? " if close else ""
                raise ConfigError(f"{prefix}{key} is not a setting; {hint}allowed: {', '.join(allowed)}")


def command_line_keys(overrides: Iterable[str]) -> frozenset[str]:
    """The keys a list of Hydra overrides sets (``trainer.width=4``, ``+x=1``, ``compressor=int8``)."""
    return frozenset(o.split("=", 1)[0].lstrip("+~") for o in overrides)


def _target_of(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def staleness_rule(cfg: DictConfig) -> str:
    """The registered name of the rule the ``staleness`` group builds (``staleness=dc``: ``"dc"``)."""
    target = cfg.staleness.get("_target_") if isinstance(cfg.staleness, DictConfig) else None
    for name in stalenesses():
        if target == _target_of(rule_class(name)):
            return name
    raise ConfigError(f"staleness._target_={target!r} is not a registered staleness rule; "
                      f"choose one with staleness=NAME, NAME in {', '.join(stalenesses())}")


@dataclass(frozen=True)
class Settled:
    """What a run runs that the composed config does not say alone, decided once in the launching
    process (:func:`settle`) and handed to the workers beside the config, which stays as composed.
    ``width``: the width the mode runs at (:meth:`pipesgd.modes.Mode.runs_at`); ``staleness``: the
    registered name of the rule it applies; ``from_group``: the ``staleness`` group builds it (False:
    a config file's rule for pipe, in a mode that applies none and was not asked for one on the
    command line, set aside for ``none`` at its defaults)."""

    width: int
    staleness: str
    from_group: bool = True

    def record(self, container: dict) -> dict:
        """``container`` (the composed config, plain) as checkpoints and summary.json record the
        run: what a run recorded before the config stopped being rewritten on its way down, so its
        checkpoints still resume (a fixed-width mode's width where the command line may choose
        another, ddp's; the staleness group as the rule that runs)."""
        out = copy.deepcopy(container)
        if get_mode(out["trainer"]["mode"]).widths:
            out["trainer"]["width"] = self.width
        if not self.from_group:
            out["staleness"] = {"_target_": _target_of(rule_class(self.staleness))}
        return out


def settle(cfg: DictConfig, explicit: Collection[str] = (), rule: str | None = None) -> Settled:
    """The run's :class:`Settled` facts: ``trainer.width`` where the mode takes it (one it names in
    ``widths`` only from the command line, ``explicit``), and the staleness rule (``rule``, the
    configured one, read here when None) unless the mode applies none and a config file chose it."""
    mode = get_mode(cfg.trainer.mode)
    asked = "trainer.width" in explicit
    rule = staleness_rule(cfg) if rule is None else rule
    applies = mode.staleness or (asked and cfg.trainer.width in mode.widths)
    # an experiment file's rule for pipe (resnet_cifar: lookahead), like its width: not this mode's
    aside = not applies and rule != "none" and bool(explicit) and "staleness" not in explicit
    return Settled(mode.runs_at(cfg.trainer.width, asked), "none" if aside else rule, not aside)


def validate(cfg: DictConfig, explicit: Collection[str] = (),
             origin: KeyOrigin | None = None) -> Settled:
    """Raise :class:`ConfigError` naming every bad key found (one problem: its message; several: a
    numbered list of them), else return what the run runs (:func:`settle`); ``cfg`` is left as
    composed. ``explicit``: the keys set on the command line (:func:`command_line_keys`), where a
    setting the mode does not use is a conflict rather than a config file's default for another
    mode. ``origin``: where a key was set (:class:`KeyOrigin`), for :func:`check_targets`' message.
    Checks that read what an earlier one refused (an unknown mode, target or rule) do not run."""
    found: list[str] = []

    def judge(check: Callable[..., object], *args, **kwargs) -> object:
        try:
            return check(*args, **kwargs)
        except ValueError as e:  # ConfigError, and a plugin's own argument check
            found.append(str(e))
        except Exception:
            if not found:
                raise  # nothing refused yet: the check's own error is the refusal, as it always was
            # else a check reading a value already refused says nothing more than its refusal
        return None

    judge(_known_keys, cfg)
    judge(check_targets, cfg, origin)
    rule = judge(staleness_rule, cfg)
    judge(_known_mode, cfg.trainer.mode)
    if found:
        raise _refusal(found)
    settled = settle(cfg, explicit, rule)
    for key, low, hint, optional in (
            ("trainer.width", 1, "pipeline width; 1 = synchronous SGD, 2 = Pipe-SGD", False),
            ("dist.nproc", 1, "number of local worker processes", False),
            ("dist.ranks_per_replica", 1, "ranks per DiLoCo replica; 1 = every rank a replica, null = a "
             "torchrun node across nodes", True),
            ("dist.max_restarts", 0, "", False),
            ("trainer.warmup_sync_steps", 0, "synchronous steps before the pipeline starts", False),
            ("trainer.epochs", 1, "", False),
            ("trainer.max_steps", 1, "or null for whole epochs", True),
            ("trainer.stop_after_step", 1, "or null to run to the end", True),
            ("trainer.log_every", 1, "", False),
            ("trainer.trace_steps", 1, "steps recorded when trainer.trace=true, or null for all", True),
            ("trainer.eval_max_batches", 1, "or null for the whole test set", True),
            ("trainer.eval_every_steps", 1, "steps between evaluations, or null for epoch ends only", True),
            ("seed", 0, "", False),
            ("dist.threads_per_worker", 1, "or null for cores / local workers", True),
            ("trainer.checkpoint_every", 1, "steps between checkpoints, or null for none", True),
            ("trainer.keep_checkpoints", 1, "2 or more survives a corrupt newest checkpoint", False),
            ("trainer.check_every", 1, "steps between replica checks, or null for none", True)):
        judge(_int_at_least, cfg, key, low, hint, optional)
    if not isinstance(cfg.trainer.trace, bool):
        found.append(f"trainer.trace={cfg.trainer.trace!r} is invalid: must be true or false")
    judge(_check_resume, str(cfg.trainer.resume))
    judge(_check_placement, cfg.dist.cpu_affinity)
    if cfg.dist.timeout_s is None or cfg.dist.timeout_s <= 0:
        found.append(f"dist.timeout_s={cfg.dist.timeout_s!r} is invalid: must be > 0 seconds")
    if cfg.dist.backend not in BACKENDS:
        found.append(f"dist.backend={cfg.dist.backend!r} is not known; allowed: {', '.join(BACKENDS)}")
    judge(_check_lr, cfg.optimizer.get("lr"))
    ref = cfg.trainer.lr_reference_batch
    if ref is not None and (isinstance(ref, bool) or not isinstance(ref, int) or ref < 1):
        found.append(f"trainer.lr_reference_batch={ref!r} is invalid: must be an integer >= 1 or null")
    judge(_check_comm, cfg)
    found += judge(_mode_problems, cfg, explicit, settled, rule) or []
    judge(_check_mode_settings, cfg, explicit)
    judge(_check_scheme_options, cfg)
    judge(_check_staleness_optimizer, cfg, settled)
    found += judge(_sync_every_problems, cfg, explicit, settled) or []
    found += judge(_replica_problems, cfg) or []
    if found:
        raise _refusal(found)
    return settled


def _refusal(found: list[str]) -> ConfigError:
    """One ConfigError for every problem: the message itself when there is one, else a numbered list."""
    if len(found) == 1:
        return ConfigError(found[0])
    return ConfigError(f"{len(found)} problems in this config:\n" +
                       "\n".join(f"  {i}. {message}" for i, message in enumerate(found, 1)))


def _known_mode(name: str) -> None:
    get_mode(name)


_RESERVED = frozenset({"_target_", "_partial_", "_recursive_", "_convert_", "_args_"})
CONF = Path(__file__).resolve().parent / "conf"


def check_targets(cfg: DictConfig, origin: KeyOrigin | None = None) -> None:
    """Every option of an instantiated group (optimizer, scheduler, model, data, compressor,
    staleness, comm, timing, and any ``_target_`` inside them) is a parameter its ``_target_``
    takes: an experiment's ``optimizer.momentum`` outlives ``optimizer=adamw`` otherwise, and the
    workers die on the TypeError. A target that takes ``**kwargs`` accepts anything."""
    for group in cfg:
        node = cfg._get_node(group)
        if isinstance(node, DictConfig) and "_target_" in node:
            _check_target(str(group), node, origin or KeyOrigin({}))


def _check_target(path: str, node: DictConfig, origin: KeyOrigin) -> None:
    target = str(node._target_)
    try:
        params = inspect.signature(get_object(target)).parameters.values()
    except (ImportError, AttributeError, ValueError) as e:
        raise ConfigError(f"{path}._target_={target!r} cannot be found: {e}") from None
    except TypeError:
        return  # no signature to read (a builtin): its own call checks
    takes = sorted(p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY))
    open_ended = any(p.kind is p.VAR_KEYWORD for p in params)
    for key in node:
        key = str(key)
        if key in _RESERVED:
            continue
        child = node._get_node(key)
        if isinstance(child, DictConfig) and "_target_" in child:
            _check_target(f"{path}.{key}", child, origin)
        if open_ended or key in takes:
            continue
        where = origin(f"{path}.{key}")
        came = f"; it was set by {where}" if where else ""
        group = path.split(".", 1)[0]
        choice = origin.choices.get(group)
        chosen = f"{group}={choice} ({target})" if choice and path == group else target
        value = OmegaConf.to_container(node, resolve=False).get(key)
        if where and where.startswith("the command line"):
            out = f"drop {key} from the command line"
        else:
            out = (f"drop it with ~{path}.{key} on the command line, or let the experiment choose {group} options of "
                   f"its own (a conf/{group}/NAME.yaml holding them, in its defaults), so that swapping the {group} "
                   "replaces them too")
        raise ConfigError(
            f"{path}.{key}={value!r} is not an option of {chosen}, which takes {', '.join(takes) or 'no options'}"
            f"{came}. An option written for another {group} outlives a swap to this one: {out}")


class KeyOrigin:
    """Where a key of the composed config was set, as far as the files can say: the command line
    (``overrides``), else the last config file among Hydra's group ``choices`` (the defaults
    list's order: an experiment after the groups it overrides) that sets it."""

    def __init__(self, choices: Mapping[str, str | None], overrides: Iterable[str] = ()):
        self.choices, self.overrides = dict(choices), list(overrides)

    def __call__(self, key: str) -> str | None:
        choices, overrides = self.choices, self.overrides
        for o in overrides:
            if o.split("=", 1)[0].lstrip("+~") == key:
                return f"the command line ({o})"
        found = None
        for group, option in choices.items():
            path = CONF / group / f"{option}.yaml"
            if option is None or group.startswith("hydra") or not path.is_file():
                continue
            text = path.read_text()
            globally = any(line.strip() == "# @package _global_" for line in text.splitlines()[:3])
            sub = key if globally else key[len(group) + 1:] if key.startswith(f"{group.replace('/', '.')}.") else None
            if sub and _sets(OmegaConf.create(text), sub):
                found = f"conf/{group}/{option}.yaml"
        return found


def _sets(node: object, dotted: str) -> bool:
    for part in dotted.split("."):
        if not isinstance(node, DictConfig) or part not in node:
            return False
        node = node._get_node(part)
    return True


class Precheck(Callback):
    """Hydra callback (conf/config.yaml ``hydra.callbacks``): :func:`validate` before Hydra makes a
    run directory, for every job of a sweep before the first one runs. A bad config exits with
    status 2 and its one-paragraph message on stderr, and leaves nothing on disk."""

    def on_run_start(self, config: DictConfig, **kwargs) -> None:
        _precheck([config])

    def on_multirun_start(self, config: DictConfig, **kwargs) -> None:
        _precheck(_sweep_jobs(config))


def _sweep_jobs(config: DictConfig) -> Iterable[DictConfig]:
    """Each job's config, composed as Hydra's basic sweeper will (another sweeper: the primary's)."""
    if not str(config.hydra.sweeper.get("_target_", "")).endswith("BasicSweeper"):
        return [config]
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parsed = OverridesParser.create().parse_overrides(list(config.hydra.overrides.task))
    loader = GlobalHydra.instance().config_loader()
    return (loader.load_sweep_config(config, list(job)) for batch in BasicSweeper.split_arguments(parsed, None)
            for job in batch)


def _precheck(configs: Iterable[DictConfig]) -> None:
    for config in configs:
        overrides = list(config.hydra.overrides.task)
        origin = KeyOrigin(config.hydra.runtime.choices, overrides)
        cfg = copy.deepcopy(config)  # the job config keeps its hydra node
        with open_dict(cfg):
            cfg.pop("hydra")
        try:
            validate(cfg, command_line_keys(overrides), origin)
        except (ConfigError, ValueError) as e:
            sys.stderr.write(f"{e}\n")
            sys.exit(2)
        except InstantiationException as e:
            sys.stderr.write(f"{e.__cause__ if e.__cause__ is not None else str(e).strip().splitlines()[0]}\n")
            sys.exit(2)


def _check_comm(cfg: DictConfig) -> None:
    """``comm.name`` is a registered allreduce (and so declares its cost, which every run's
    timing prediction reads; ``auto`` picks one of them when it is bound, comm/auto.py)."""
    try:
        registry("allreduce").facts(str(cfg.comm.get("name")))
    except ValueError as e:
        raise ConfigError(f"comm.name: {e} (conf/comm/*.yaml name registered allreduces)") from None


def _mode_problems(cfg: DictConfig, explicit: Collection[str], settled: Settled, rule: str) -> list[str]:
    """What ``trainer.mode`` does not use is an error, not silently ignored (docs/modes.md). A width
    from a config file is pipe's default and a mode of fixed width runs at its own; set on the
    command line, it conflicts. ``rule``: the configured staleness rule; ``settled``: what runs.
    Every problem found, one message each."""
    name, out = cfg.trainer.mode, []
    mode = get_mode(name)
    pipelined = ", ".join(m for m in modes() if get_mode(m).width is None)
    other_width = "trainer.width" in explicit and cfg.trainer.width in mode.widths  # ddp: 2, the pipelined hook
    # a fixed-width mode that runs rounds (sync at sync_every > 1) reads the warm-up: its rounds start after it
    rounds_read_warmup = cfg.trainer.sync_every != 1 and mode.sync_every and not mode.rounds_only
    if mode.width is not None:
        for key, neutral in (("trainer.width", mode.width),
                             *(() if rounds_read_warmup else (("trainer.warmup_sync_steps", 0),))):
            value = OmegaConf.select(cfg, key)
            if key in explicit and value != neutral and not (key == "trainer.width" and other_width):
                also = f" or {', '.join(map(str, mode.widths))}" if mode.widths and key == "trainer.width" else ""
                out.append(f"{key}={value} is not used by trainer.mode={name}, which runs at width "
                           f"{mode.width}{also}; drop {key} or use trainer.mode={pipelined}")
    applies = mode.staleness or other_width
    if applies and mode.stalenesses is not None and rule not in mode.stalenesses:
        out.append(f"staleness={rule} is not available with trainer.mode={name}"
                   f"{f' trainer.width={settled.width}' if other_width else ''}; allowed: "
                   f"{', '.join(mode.stalenesses)}")
    if not applies and settled.staleness != "none":
        wider = "".join(f" (and {m} at trainer.width={w})" for m in modes() for w in get_mode(m).widths)
        out.append(f"staleness={rule} is not used by trainer.mode={name}; only "
                   f"{', '.join(modes_with('staleness'))} apply a staleness rule{wider} (use staleness=none)")
    clip = cfg.trainer.get("max_grad_norm")
    if clip is not None and (isinstance(clip, bool) or not isinstance(clip, (int, float)) or not clip > 0):
        out.append(f"trainer.max_grad_norm={clip!r} is invalid: must be a number > 0, or null for no clipping")
    if clip is not None and mode.server:
        out.append(f"trainer.max_grad_norm={clip} is not used by trainer.mode={name}: its server steps its "
                   "own copy of the optimizer; use trainer.max_grad_norm=null")
    if not mode.nonfinite_skip and cfg.trainer.nonfinite == "skip":
        out.append(f"trainer.nonfinite=skip is not available with trainer.mode={name}: its ranks do not "
                   "decide a non-finite gradient together; use trainer.nonfinite=abort")
    try:
        check_comm(name, str(cfg.comm.get("name")))
    except ValueError as e:
        out.append(str(e))
    try:
        # the launcher's one build (its own argument checks run) and the one check, against the mode and its allreduce
        allreduce = str(cfg.comm.get("name"))  # an unknown one is _check_comm's to name
        check_compressor(name, instantiate(cfg.compressor), allreduce if allreduce in registry("allreduce") else None)
    except ValueError as e:
        out.append(str(e))
    backend = cfg.dist.backend
    if not mode.nccl and (backend == "nccl" or backend == "auto" and _cuda_available()):
        out.append(f"trainer.mode={name} cannot run on NCCL (dist.backend={backend}"
                   f"{', which picks nccl on this CUDA machine' if backend == 'auto' else ''}): its server "
                   "receives from whichever worker pushes first, which NCCL does not support; set "
                   f"dist.backend=gloo, or use trainer.mode={'|'.join(modes_with('nccl'))}")
    nproc = None if under_torchrun() else cfg.dist.nproc  # under torchrun the engine checks the world
    if nproc is not None and nproc < mode.min_world:
        out.append(f"dist.nproc={nproc} is invalid for trainer.mode={name}: it needs >= {mode.min_world} "
                   "processes")
    return out


def _check_mode_settings(cfg: DictConfig, explicit: Collection[str]) -> None:
    """A mode's own keys, ``trainer.<mode>.*`` (trainer.live): checked by the ``settings`` its
    builder declares when the mode runs; set on the command line for another mode, an error."""
    for name in modes():
        parse = get_mode(name).settings
        if parse is None or get_mode(name).settings_key is not None:
            continue
        readers = [m for m in modes() if m == name or get_mode(m).settings_key == name]
        if cfg.trainer.mode in readers:
            try:
                parse(OmegaConf.to_container(cfg.trainer[name]))
            except ValueError as e:
                raise ConfigError(str(e)) from None
        given = sorted(k for k in explicit if k.startswith(f"trainer.{name}."))
        if given and cfg.trainer.mode not in readers:
            raise ConfigError(f"{given[0]} is not used by trainer.mode={cfg.trainer.mode}; only trainer.mode="
                              f"{'|'.join(readers)} read{'s' if len(readers) == 1 else ''} trainer.{name}.*")


def _sync_every_problems(cfg: DictConfig, explicit: Collection[str], settled: Settled) -> list[str]:
    """``trainer.sync_every``: 1 is an exchange every step (no outer step, ``outer_optimizer`` and
    the outer rules unused); H > 1 is the period-H engine (docs/period-h.md), refused with what it
    cannot run: modes without rounds, a schedule :func:`pipesgd.period.problems` refuses (per-step
    staleness rules, eager or a delay off width 2), a synchronous warm-up, replica checks asked of
    eager replicas (which differ by design). Every problem found, one message each."""
    t = cfg.trainer
    h, name, fragments, delay = t.sync_every, t.mode, t.fragments, t.sync_delay
    out = period.invalid(h, fragments, delay, prefix="trainer.")
    if out:
        return out
    mode, rule = get_mode(name), settled.staleness
    if delay and not mode.sync_delay:
        out.append(f"trainer.sync_delay={delay} is not used by trainer.mode={name}; only trainer.mode="
                   f"{'|'.join(modes_with('sync_delay'))} wait for a round's exchange steps after launching it")
    if mode.rounds_only and h == 1:
        out.append(f"trainer.mode={name} runs rounds of inner steps: set trainer.sync_every=H > 1 "
                   "(inner steps per round)")
    if delay and h == 1:
        out.append(f"trainer.sync_delay={delay} delays a round's exchange and is not used at "
                   "trainer.sync_every=1: set trainer.sync_every=H > 1 (inner steps per round), or drop it")
    every = t.checkpoint_every
    if mode.rounds_only and h % fragments == 0 and every and every % (h // fragments):
        out.append(f"trainer.checkpoint_every={every} is not a multiple of trainer.sync_every / "
                   f"trainer.fragments = {h // fragments}: trainer.mode={name} resumes only where a fragment "
                   "has just synced (torchft keeps its place inside a period to itself)")
    rule_period = registry("staleness").facts(rule)["sync_period"]
    outer = sorted(k for k in explicit if k == "outer_optimizer" or k.startswith("outer_optimizer."))
    if h == 1:
        if fragments != 1:
            out.append(f"trainer.fragments={fragments} is not used at trainer.sync_every=1: fragments stream "
                       "a round's exchange; set trainer.sync_every=H (a multiple of the fragments) or drop it")
        if outer:
            out.append(f"{outer[0]} is not used at trainer.sync_every=1, which exchanges gradients every "
                       "step and has no outer step; set trainer.sync_every to the inner steps per round "
                       "(H > 1) to run one, or drop it")
        if rule_period == "round":
            out.append(f"staleness={rule} is a rule for the outer step of trainer.sync_every > 1; set "
                       "trainer.sync_every=H (inner steps per round), or use a per-step rule: "
                       f"staleness={'|'.join(rules_besides('round'))}")
        return out
    if not mode.sync_every:
        out.append(f"trainer.sync_every={h} is not available with trainer.mode={name}; only trainer.mode="
                   f"{'|'.join(modes_with('sync_every'))} run rounds of inner steps (docs/period-h.md), or "
                   "set trainer.sync_every=1")
        return out
    # torchft's schedule (rounds_only) lands by its delay at width 1; a pipe's round needs width 2
    width = None if mode.rounds_only else settled.width
    agrees = registry("staleness").facts(rule)["agrees"]
    out += period.problems(h, fragments, delay, width=width, rule=rule, rule_period=rule_period,
                           rule_agrees=agrees, round_rules=rules_besides("step"), prefix="trainer.",
                           runs=f"trainer.mode={name} runs at width {width} (use trainer.mode=pipe trainer.width=2)")
    if t.warmup_sync_steps and mode.rounds_only and "trainer.warmup_sync_steps" not in explicit:  # else _check_mode's
        out.append(f"trainer.warmup_sync_steps={t.warmup_sync_steps} is not used by trainer.mode={name}: its rounds "
                   "have no synchronous warm-up; set trainer.warmup_sync_steps=0, or run the warm-up with "
                   f"trainer.mode={'|'.join(m for m in modes_with('sync_every') if not get_mode(m).rounds_only)}")
    layout, alpha = t.get("fragment_layout", "contiguous"), t.get("landing_alpha")
    # the values (period's one list; the warm-up's range is the schema's), then whether this mode reads them
    out += period.merge_problems(0, alpha, delay, layout, "trainer.")
    pipes = '|'.join(m for m in modes_with('sync_every') if not get_mode(m).rounds_only)
    if layout in period.LAYOUTS and layout != "contiguous" and (fragments == 1 or mode.rounds_only):
        out.append(f"trainer.fragment_layout={layout} deals a model's layers to trainer.fragments > 1 of "
                   f"trainer.mode={pipes}")
    if alpha is not None and mode.rounds_only and delay:
        out.append(f"trainer.landing_alpha={alpha} mixes the weights where a round lands trainer.sync_delay "
                   f"steps after its launch, which trainer.mode={name} does its own way; use trainer.mode={pipes}")
    if not agrees and "trainer.check_every" in explicit and t.check_every is not None:
        out.append(f"trainer.check_every={t.check_every} cannot check staleness={rule} replicas: each carries "
                   "its own fresh pseudo-gradient, so they differ by design; set trainer.check_every=null")
    lr = cfg.outer_optimizer.get("lr")  # null: follows H and M (pipesgd.outer), SGD's only
    if lr is None and cfg.outer_optimizer.get("_target_") != "torch.optim.SGD":
        out.append(f"outer_optimizer.lr=null follows H and M for torch.optim.SGD only; set a number > 0 for "
                   f"{cfg.outer_optimizer.get('_target_')}")
    elif lr is not None and (isinstance(lr, bool) or not isinstance(lr, (int, float)) or not lr > 0):
        out.append(f"outer_optimizer.lr={lr!r} is invalid: must be a number > 0, or null to follow H and M")
    return out


def replica_size(cfg: DictConfig) -> int:
    """The run's ranks per replica: ``dist.ranks_per_replica``, or where it is null a torchrun node
    when the mode forms replicas of rounds (:func:`pipesgd.dist.ranks_per_replica`)."""
    return ranks_per_replica(cfg.dist.get("ranks_per_replica"),
                             get_mode(cfg.trainer.mode).replicas and cfg.trainer.sync_every > 1)


def _replica_problems(cfg: DictConfig) -> list[str]:
    """``dist.ranks_per_replica=k``: a divisor of the world (``dist.nproc``, or torchrun's
    WORLD_SIZE), and what the mode and the plugins cannot run with replicas of k ranks."""
    k = replica_size(cfg)
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        return []  # refused as an integer >= 1 already
    world, what = (env_int("WORLD_SIZE", 1), "WORLD_SIZE") if under_torchrun() else (cfg.dist.nproc, "dist.nproc")
    out = [f"dist.ranks_per_replica={k} does not divide the world size ({what}={world}): replicas are k "
           "consecutive ranks each; use a divisor of it"] if world % k else []
    return out + replica_problems(cfg.trainer.mode, k, cfg.trainer.sync_every, instantiate(cfg.compressor).name,
                                  str(cfg.comm.get("name")))


def _cuda_available() -> bool:
    import torch  # what dist.backend=auto resolves with (pipesgd.dist.resolve_backend)

    return torch.cuda.is_available()


def _check_scheme_options(cfg: DictConfig) -> None:
    """Node groups (an allreduce that declares it needs them) and LARS. Under torchrun ``dist.nproc`` is ignored (the environment sets
    the world), so the world-size checks run in the workers instead."""
    nproc = None if under_torchrun() else cfg.dist.nproc
    size = cfg.comm.get("group_size")
    name = str(cfg.comm.get("name"))
    if registry("allreduce").facts(name).get("node_groups") and size is not None:
        _int_at_least(cfg, "comm.group_size", 1, "ranks per node group, or null for LOCAL_WORLD_SIZE")
        if nproc is not None and nproc % size:
            raise ConfigError(f"comm.group_size={size} is invalid with dist.nproc={nproc}: the node group "
                              "size must divide the number of workers")
    trust = cfg.optimizer.get("trust_coefficient")
    if "trust_coefficient" in cfg.optimizer and (isinstance(trust, bool) or not isinstance(trust, (int, float))
                                                 or not trust > 0):
        raise ConfigError(f"optimizer.trust_coefficient={trust!r} is invalid: must be a number > 0 (LARS η)")


def _check_staleness_optimizer(cfg: DictConfig, settled: Settled) -> None:
    """A staleness rule that assumes one optimizer's update (dga: SGD's) refuses any other, here
    before the workers start (the engine's bind checks the same). Builds the optimizer once over a
    one-value parameter: the same class the workers build."""
    rule = rule_class(settled.staleness)
    facts = registry("staleness").facts(rule.name)
    if not facts["optimizers"]:
        return
    import torch

    from .staleness.base import check_optimizer

    # a round rule steps the outer optimizer (at sync_every > 1); every other rule the optimizer
    group = cfg.outer_optimizer if facts["sync_period"] == "round" and cfg.trainer.sync_every > 1 else cfg.optimizer
    try:
        check_optimizer(rule, instantiate(group)([torch.nn.Parameter(torch.zeros(1))]))
    except ValueError as e:
        raise ConfigError(str(e)) from None


def _check_lr(lr: object) -> None:
    """The learning rate as given (``optimizer.lr``), before the linear scaling by the global batch."""
    if isinstance(lr, bool) or not isinstance(lr, (int, float)) or not lr > 0:
        raise ConfigError(f"optimizer.lr={lr!r} is invalid: must be a number > 0 (the rate for "
                          "trainer.lr_reference_batch samples, scaled linearly to the global batch)")


def _check_resume(resume: str) -> None:
    if resume in ("auto", "never"):
        return
    path = Path(resume).expanduser()
    if not path.is_file():
        raise ConfigError(f"trainer.resume={resume!r} is not a checkpoint file; allowed: auto (newest valid "
                          "checkpoint of the run dir), never, or the path of a step-N.pt file")


def check_batch(batch_size: int, train_size: int, world_size: int) -> None:
    """Every rank needs at least one whole batch per epoch (ranks drop their last partial batch)."""
    per_rank = train_size // world_size
    if batch_size > per_rank:
        raise ConfigError(f"data.batch_size={batch_size} is larger than the {per_rank} training samples each of "
                          f"the {world_size} ranks gets ({train_size} in all); lower data.batch_size to at most "
                          f"{per_rank} or use fewer ranks (dist.nproc)")
