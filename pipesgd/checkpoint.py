"""Checkpoint files: atomic, checksummed, safe to load, the newest k kept.

``<run dir>/checkpoints/step-00000032.pt`` plus its ``.sha256`` (``sha256sum -c`` format), written
to a temporary file, fsynced and renamed, loaded with ``torch.load(weights_only=True)`` after the
checksum is verified (docs/reliability.md). What goes inside is :mod:`pipesgd.reliability`'s.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import re
from pathlib import Path

import numpy as np
import torch
from torch import nn

from .models import unwrap
from .runinfo import file_digest, write_atomic

log = logging.getLogger(__name__)

FORMAT = 1
_NAME = re.compile(r"step-(\d+)\.pt")


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete, corrupt, unsafe, or does not fit this run."""


def param_checksum(model: nn.Module) -> str:
    """sha256 over the bytes of the parameters, in ``state_dict`` order (buffers excluded: BatchNorm
    statistics legitimately differ across ranks). Equal digests mean bit-identical weights.
    Cost: one pass over the weights (about 1 GB/s; plus a device-to-host copy on GPU)."""
    h = hashlib.sha256()
    for t in unwrap(model).state_dict(keep_vars=True).values():
        if isinstance(t, nn.Parameter):
            h.update(t.detach().reshape(-1).contiguous().view(torch.uint8).cpu().numpy())
    return h.hexdigest()


# Keys that do not change the trajectory: where files live, how often to save/check/log, how
# long to wait, how many processes the launcher spawns (the world size is checked separately).
NOT_HASHED = ("trainer.resume", "trainer.stop_after_step", "trainer.elastic", "trainer.checkpoint_every", "trainer.keep_checkpoints",
              "trainer.check_every", "trainer.log_every", "trainer.trace", "trainer.trace_steps",
              "trainer.eval_max_batches", "trainer.eval_every_steps", "dist.nproc", "dist.timeout_s",
              "dist.max_restarts", "dist.threads_per_worker", "data.root", "data.cache_dir",
              "data.download", "data.url", "timing")


def _legacy_staleness(out: dict) -> dict:
    """The ``staleness`` group written as the ``trainer.*`` keys it replaced, so a checkpoint written
    before the group existed still matches the run that resumes it."""
    group = out.pop("staleness", None)
    trainer = out.get("trainer")
    if isinstance(group, dict) and isinstance(trainer, dict):
        trainer["dc_lambda"] = group.get("dc_lambda", 0.04)
        trainer["dc_adaptive"] = group.get("dc_adaptive", False)
        if group.get("dc_momentum", 0.95) != 0.95:
            trainer["dc_momentum"] = group["dc_momentum"]
    return out


def drop_keys(config: dict, keys) -> dict:
    """``config`` with each dotted key of ``keys`` removed where present (in place; returned)."""
    for key in keys:
        *parents, last = key.split(".")
        node = config
        for p in parents:
            node = node.get(p, {}) if isinstance(node, dict) else {}
        if isinstance(node, dict):
            node.pop(last, None)
    return config


def hashed_config(config: dict) -> dict:
    """``config`` (resolved, plain containers) without the :data:`NOT_HASHED` keys."""
    return drop_keys(_legacy_staleness(json.loads(json.dumps(config, default=str))), NOT_HASHED)


def config_digest(config: dict) -> str:
    """sha256 of the canonical JSON of :func:`hashed_config`."""
    return hashlib.sha256(json.dumps(hashed_config(config), sort_keys=True).encode()).hexdigest()


def config_diff(old: dict, new: dict, prefix: str = "") -> list[str]:
    """``["optimizer.lr: 0.1 -> 0.2", ...]`` between two hashed configs."""
    out = []
    for key in sorted(set(old) | set(new), key=str):
        a, b = old.get(key, "<unset>"), new.get(key, "<unset>")
        if isinstance(a, dict) and isinstance(b, dict):
            out += config_diff(a, b, f"{prefix}{key}.")
        elif a != b:
            out.append(f"{prefix}{key}: {a!r} -> {b!r}")
    return out


def rng_state(device: torch.device | None = None) -> dict:
    """This process's torch (CPU, and ``device``'s CUDA generator when it is a GPU), numpy and
    Python RNG states, as tensors and primitives. Only the rank's own GPU: a rank draws on no
    other, and saving every visible GPU's state made a resume where fewer GPUs are visible fail."""
    name, keys, pos, has_gauss, cached = np.random.get_state()
    version, internal, gauss_next = random.getstate()
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state(device) if device is not None and device.type == "cuda" else None,
        "numpy": {"name": name, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                  "has_gauss": int(has_gauss), "cached_gaussian": float(cached)},
        "python": {"version": version, "state": torch.tensor(internal, dtype=torch.int64),
                   "gauss_next": gauss_next},
    }


def set_rng_state(state: dict, device: torch.device | None = None) -> None:
    """Restore :func:`rng_state`; its CUDA state goes to ``device`` (this rank's GPU, whichever
    GPU saved it: an elastic resume hands a new rank its donor's state). Checkpoints from before
    kept every visible GPU's state in a list: the entry at ``device``'s index, when there is one."""
    torch.set_rng_state(state["torch"])
    cuda = state.get("cuda")
    if isinstance(cuda, list):
        cuda = cuda[device.index] if device is not None and device.type == "cuda" and device.index < len(cuda) else None
    if cuda is not None and device is not None and device.type == "cuda":
        torch.cuda.set_rng_state(cuda, device)
    n = state["numpy"]
    np.random.set_state((n["name"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"],
                         n["cached_gaussian"]))
    p = state["python"]
    random.setstate((p["version"], tuple(int(v) for v in p["state"].tolist()), p["gauss_next"]))


def step_of(path: Path) -> int | None:
    m = _NAME.fullmatch(path.name)
    return int(m.group(1)) if m else None


class _HashingWriter:
    """A file wrapper that hashes what ``torch.save`` writes, so saving reads nothing back."""

    def __init__(self, f):
        self.f, self.sha = f, hashlib.sha256()

    def write(self, data) -> int:
        self.sha.update(data)
        return self.f.write(data)

    def flush(self) -> None:
        self.f.flush()


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class CheckpointDir:
    """The checkpoints of one run directory. Only rank 0 writes; ``keep`` newest are kept."""

    def __init__(self, directory: str | os.PathLike, keep: int = 2):
        if keep < 1:
            raise ValueError(f"keep must be >= 1, got {keep}")
        self.dir = Path(directory)
        self.keep = keep

    def path(self, step: int) -> Path:
        return self.dir / f"step-{step:08d}.pt"

    def save(self, state: dict, step: int) -> Path:
        """Write ``state`` as the checkpoint of ``step`` (atomically, with its sha256), then
        delete all but the ``keep`` newest. Returns the checkpoint's path."""
        self.dir.mkdir(parents=True, exist_ok=True)
        final = self.path(step)
        box: list[_HashingWriter] = []

        def write_state(f) -> None:
            box.append(_HashingWriter(f))
            torch.save(state, box[0])

        write_atomic(final, write_state)
        digest = box[0].sha.hexdigest()
        write_atomic(final.with_name(final.name + ".sha256"),
                            lambda f: f.write(f"{digest}  {final.name}\n".encode()))
        _fsync_dir(self.dir)
        self._prune()
        return final

    def _prune(self) -> None:
        for old in self.list()[self.keep:]:
            for p in (old, old.with_name(old.name + ".sha256")):
                p.unlink(missing_ok=True)

    def list(self) -> list[Path]:
        """Checkpoint files, newest (highest step) first."""
        if not self.dir.is_dir():
            return []
        found = [(s, p) for p in self.dir.iterdir() if (s := step_of(p)) is not None]
        return [p for _, p in sorted(found, reverse=True)]

    def remove_temporaries(self) -> None:
        """Delete temporaries a killed writer left behind (call when no writer can be running)."""
        if self.dir.is_dir():
            for p in self.dir.glob(".step-*.tmp"):
                p.unlink(missing_ok=True)

    @staticmethod
    def load(path: str | os.PathLike, require_checksum: bool = True) -> dict:
        """The verified contents of checkpoint ``path``; CheckpointError saying what is wrong."""
        path = Path(path)
        sidecar = path.with_name(path.name + ".sha256")
        if not path.is_file():
            raise CheckpointError(f"checkpoint {path} does not exist")
        if sidecar.is_file():
            expected = sidecar.read_text().split()[0] if sidecar.read_text().split() else ""
            actual = file_digest(path, "sha256")
            if actual != expected:
                raise CheckpointError(f"checkpoint {path} is corrupt: sha256 {actual} does not match "
                                      f"{expected or 'an empty checksum'} in {sidecar.name}")
        elif require_checksum:
            raise CheckpointError(f"checkpoint {path} is incomplete: its checksum file {sidecar.name} is "
                                  "missing (the writer stopped between the two renames)")
        else:
            log.warning("checkpoint %s has no checksum file %s; loading it unverified", path, sidecar.name)
        try:
            state = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as e:
            raise CheckpointError(f"refusing to load checkpoint {path}: {' '.join(str(e).split())[:300]} "
                                  "(checkpoints hold only tensors and plain containers, loaded with "
                                  "weights_only=True)") from e
        if not isinstance(state, dict) or state.get("format") != FORMAT:
            got = state.get("format") if isinstance(state, dict) else type(state).__name__
            raise CheckpointError(f"checkpoint {path} is not a pipesgd checkpoint of format {FORMAT} (got {got!r})")
        return state

    def newest_valid(self) -> tuple[Path, dict] | None:
        """The newest checkpoint that verifies and loads; each one skipped is reported. None if
        there are none; CheckpointError if there are some but none is valid."""
        problems = []
        for path in self.list():
            try:
                return path, self.load(path)
            except CheckpointError as e:
                log.warning("%s; trying the previous checkpoint", e)
                problems.append(str(e))
        if problems:
            raise CheckpointError(f"no valid checkpoint in {self.dir}: {' | '.join(problems)}; delete them or set "
                                  "trainer.resume=never to start over")
        return None
