"""Cross-field checks on the composed config, run in the launching process before any worker
starts. Each failure is one line that names the key, the bad value and what is allowed."""

from __future__ import annotations

from omegaconf import DictConfig

from .modes import MODES
from .staleness import available as stalenesses


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


def validate(cfg: DictConfig) -> None:
    mode = cfg.trainer.mode
    if mode not in MODES:
        raise ConfigError(f"trainer.mode={mode!r} is not known; allowed: {', '.join(MODES)}")
    _int_at_least(cfg, "trainer.width", 1, "pipeline width; 1 = synchronous SGD, 2 = Pipe-SGD")
    if cfg.trainer.staleness not in stalenesses():
        raise ConfigError(f"trainer.staleness={cfg.trainer.staleness!r} is not known; "
                          f"allowed: {', '.join(stalenesses())} (docs/convergence.md)")
    _int_at_least(cfg, "dist.nproc", 1, "number of local worker processes")
    _int_at_least(cfg, "dist.max_restarts", 0)
    _int_at_least(cfg, "trainer.warmup_sync_steps", 0, "synchronous steps before the pipeline starts")
    _int_at_least(cfg, "trainer.epochs", 1)
    _int_at_least(cfg, "trainer.max_steps", 1, "or null for whole epochs", optional=True)
    _int_at_least(cfg, "trainer.log_every", 1)
    _int_at_least(cfg, "seed", 0)
    _int_at_least(cfg, "dist.threads_per_worker", 1, "or null for cores / local workers", optional=True)
    if cfg.dist.timeout_s is None or cfg.dist.timeout_s <= 0:
        raise ConfigError(f"dist.timeout_s={cfg.dist.timeout_s!r} is invalid: must be > 0 seconds")
    ref = cfg.trainer.lr_reference_batch
    if ref is not None and (isinstance(ref, bool) or not isinstance(ref, int) or ref < 1):
        raise ConfigError(f"trainer.lr_reference_batch={ref!r} is invalid: must be an integer >= 1 or null")
