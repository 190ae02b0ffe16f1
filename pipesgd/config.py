"""Cross-field checks on the composed config, run in the launching process before any worker
starts. Each failure is one line that names the key, the bad value and what is allowed."""

from __future__ import annotations

import dataclasses
import difflib
from pathlib import Path

from omegaconf import DictConfig

from .modes import MODES
from .schema import Config, DistConfig, TrainerConfig


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


def _known_keys(cfg: DictConfig) -> None:
    """Keys a ``+key=value`` override force-added past the schema (Hydra lets ``+`` append)."""
    for prefix, node, schema in (("", cfg, Config), ("trainer.", cfg.trainer, TrainerConfig),
                                 ("dist.", cfg.dist, DistConfig)):
        allowed = [f.name for f in dataclasses.fields(schema)]
        for key in node:
            if key not in allowed:
                close = difflib.get_close_matches(str(key), allowed, n=1)
                hint = f"did you mean {prefix}{close[0]}? " if close else ""
                raise ConfigError(f"{prefix}{key} is not a setting; {hint}allowed: {', '.join(allowed)}")


def validate(cfg: DictConfig) -> None:
    _known_keys(cfg)
    mode = cfg.trainer.mode
    if mode not in MODES:
        raise ConfigError(f"trainer.mode={mode!r} is not known; allowed: {', '.join(MODES)}")
    _int_at_least(cfg, "trainer.width", 1, "pipeline width; 1 = synchronous SGD, 2 = Pipe-SGD")
    _int_at_least(cfg, "dist.nproc", 1, "number of local worker processes")
    _int_at_least(cfg, "dist.max_restarts", 0)
    _int_at_least(cfg, "trainer.warmup_sync_steps", 0, "synchronous steps before the pipeline starts")
    _int_at_least(cfg, "trainer.epochs", 1)
    _int_at_least(cfg, "trainer.max_steps", 1, "or null for whole epochs", optional=True)
    _int_at_least(cfg, "trainer.log_every", 1)
    _int_at_least(cfg, "seed", 0)
    _int_at_least(cfg, "dist.threads_per_worker", 1, "or null for cores / local workers", optional=True)
    _int_at_least(cfg, "trainer.checkpoint_every", 1, "steps between checkpoints, or null for none",
                  optional=True)
    _int_at_least(cfg, "trainer.keep_checkpoints", 1, "2 or more survives a corrupt newest checkpoint")
    _int_at_least(cfg, "trainer.check_every", 1, "steps between replica checks, or null for none",
                  optional=True)
    _check_resume(str(cfg.trainer.resume))
    if cfg.dist.timeout_s is None or cfg.dist.timeout_s <= 0:
        raise ConfigError(f"dist.timeout_s={cfg.dist.timeout_s!r} is invalid: must be > 0 seconds")
    ref = cfg.trainer.lr_reference_batch
    if ref is not None and (isinstance(ref, bool) or not isinstance(ref, int) or ref < 1):
        raise ConfigError(f"trainer.lr_reference_batch={ref!r} is invalid: must be an integer >= 1 or null")


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
