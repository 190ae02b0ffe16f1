"""Checkpoint files: atomic, checksummed, safe to load, the newest k kept.

``<run dir>/checkpoints/step-00000032.pt`` plus its ``.sha256`` (``sha256sum -c`` format), written
to a temporary file, fsynced and renamed, loaded with ``torch.load(weights_only=True)`` after the
checksum is verified (docs/reliability.md). What goes inside is :mod:`pipesgd.reliability.hooks`'s.
A checkpoint of an older layout is refused; ``python -m pipesgd.reliability.checkpoint convert OLD [NEW]``
rewrites it in this one (:func:`upgrade`).
"""

from __future__ import annotations

import argparse
import hashlib
import inspect
import json
import logging
import os
import random
import re
import sys
from pathlib import Path

import numpy as np
import torch
from torch import nn

from ..models import unwrap
from ..modes import get_mode, modes
from ..observability.runinfo import file_digest, write_atomic
from ..staleness import rule_class

log = logging.getLogger(__name__)

FORMAT = 2
"""2: the config carries the ``staleness`` group, not ``trainer.staleness`` / ``trainer.dc_*``; the
data position is ``consumed`` samples; ``evals`` is always there; a rank's CUDA RNG is its own GPU's.
Format 1 had each of those in its older form (:func:`upgrade` says which)."""
CONVERT = "python -m pipesgd.reliability.checkpoint convert"
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
              "dist.max_restarts", "dist.threads_per_worker", "dist.cpu_affinity", "data.root", "data.cache_dir",
              "data.download", "data.url", "timing")


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


def mode_sections(keep=()) -> list[str]:
    """The sections of mode-owned settings (``trainer.<mode>``, e.g. ``trainer.live``) of every
    registered mode but those in ``keep``."""
    return [f"trainer.{m}" for m in modes() if get_mode(m).settings is not None and m not in keep]


def drop_unset(node):
    """``node`` without the dict entries whose value is None, and without the dicts that leaves
    empty (recursively; returned). A setting at None is no setting: a key added with None as its
    default (the off switch, e.g. ``trainer.max_grad_norm``) is then no difference from a config
    written before the key existed, where the run behaved as the None does."""
    if not isinstance(node, dict):
        return node
    out = {}
    for key, value in node.items():
        value = drop_unset(value)
        if value is not None and value != {}:
            out[key] = value
    return out


def hashed_config(config: dict) -> dict:
    """``config`` (resolved, plain containers) without the :data:`NOT_HASHED` keys, without the
    settings of the modes it does not run (:func:`mode_sections`), and without settings at None
    (:func:`drop_unset`): those never reach the run, and a config from before such a section or key
    existed has none, so adding a mode or an option that is off by default changes no digest."""
    plain = json.loads(json.dumps(config, default=str))
    mode = (plain.get("trainer") or {}).get("mode")
    # an exchange every step has no outer step: its settings are no setting (configs before them had none)
    per_step = (plain.get("trainer") or {}).get("sync_every", 1) == 1
    unused = ["trainer.sync_every", "trainer.fragments", "outer_optimizer"] if per_step else []
    if (plain.get("dist") or {}).get("ranks_per_replica", 1) in (None, 1):  # every rank its own replica, as before the key
        unused.append("dist.ranks_per_replica")
    return drop_unset(drop_keys(plain, [*NOT_HASHED, *mode_sections(keep={mode}), *unused]))


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
    GPU saved it: an elastic resume hands a new rank its donor's state)."""
    torch.set_rng_state(state["torch"])
    cuda = state.get("cuda")
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


def _write(state: dict, final: Path) -> None:
    """``state`` to ``final`` and its sha256 to ``final.sha256``, each through a temporary file,
    fsync and rename, then the directory fsynced."""
    box: list[_HashingWriter] = []

    def write_state(f) -> None:
        box.append(_HashingWriter(f))
        torch.save(state, box[0])

    write_atomic(final, write_state)
    digest = box[0].sha.hexdigest()
    write_atomic(final.with_name(final.name + ".sha256"), lambda f: f.write(f"{digest}  {final.name}\n".encode()))
    _fsync_dir(final.parent)


def _read(path: Path, require_checksum: bool) -> dict:
    """The checksum-verified dict in checkpoint ``path``, whatever its format."""
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
    if not isinstance(state, dict):
        raise CheckpointError(f"checkpoint {path} is not a pipesgd checkpoint of format {FORMAT} "
                              f"(got {type(state).__name__!r})")
    return state


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
        _write(state, final)
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
        """The verified contents of checkpoint ``path``; CheckpointError saying what is wrong (for
        an older format: the command that converts it)."""
        state = _read(Path(path), require_checksum)
        if state.get("format") == 1:
            raise CheckpointError(f"checkpoint {path} has format 1, from before the staleness config group "
                                  f"(docs/reliability.md#old-checkpoints); convert it with: {CONVERT} {path}")
        if state.get("format") != FORMAT:
            raise CheckpointError(f"checkpoint {path} is not a pipesgd checkpoint of format {FORMAT} "
                                  f"(got {state.get('format')!r})")
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


_ALIASES = ("staleness", "dc_lambda", "dc_adaptive", "dc_momentum")


def _staleness_group(trainer: dict) -> dict:
    """The ``staleness`` group a format-1 config meant by ``trainer.staleness`` and
    ``trainer.dc_*``: the rule with its constructor's defaults (= conf/staleness/NAME.yaml,
    tests/distributed/test_layout.py), the ``dc_*`` values over them."""
    cls = rule_class(trainer.get("staleness") or "none")
    defaults = inspect.signature(cls).parameters
    node = {"_target_": f"{cls.__module__}.{cls.__qualname__}"} | {k: defaults[k].default for k in cls.options}
    for key in cls.options:
        if trainer.get(key) is not None:
            node[key] = trainer[key]
    return node


def upgrade_config(config: dict) -> dict:
    """A format-1 (hashed) config in format 2's form, in place; returned: the ``staleness`` group in
    place of ``trainer.staleness`` / ``trainer.dc_*``."""
    trainer = config.get("trainer", {})
    config["staleness"] = _staleness_group(trainer)
    for key in _ALIASES:
        trainer.pop(key, None)
    return config


def upgrade(state: dict) -> dict:
    """A format-1 checkpoint's ``state`` in format 2 (in place; returned): the ``staleness`` group
    from ``trainer.staleness`` / ``trainer.dc_*`` and the config digest recomputed; ``consumed``
    samples from ``batch`` (batches of ``data.batch_size`` per rank); ``evals`` added (none);
    a rank's list of every visible GPU's RNG state becomes the entry of GPU ``rank % len`` (the one
    each rank trains on when a node runs one rank per visible GPU). A format-2 state is returned as is."""
    if state.get("format") == FORMAT:
        return state
    if state.get("format") != 1:
        raise CheckpointError(f"cannot convert format {state.get('format')!r}: {CONVERT} reads format 1")
    try:
        config = upgrade_config(state["config"])
    except ValueError as e:  # a rule this pipesgd does not register
        raise CheckpointError(f"cannot convert its config.trainer.staleness: {e}") from None
    state["config_digest"] = config_digest(config)
    if "consumed" not in state:
        state["consumed"] = state.pop("batch") * config["data"]["batch_size"] * state["world_size"]
    state.setdefault("evals", [])
    for rank, mine in enumerate(state["ranks"]):
        cuda = mine["rng"].get("cuda")
        if isinstance(cuda, list):
            mine["rng"]["cuda"] = cuda[rank % len(cuda)] if cuda else None
    state["format"] = FORMAT
    return state


def convert(old: str | os.PathLike, new: str | os.PathLike | None = None) -> Path:
    """Verify checkpoint ``old``, :func:`upgrade` it and write it to ``new`` (default: over
    ``old``) with its ``.sha256``, each through a temporary file and a rename. Returns ``new``."""
    old = Path(old)
    new = old if new is None else Path(new)
    state = _read(old, require_checksum=False)
    before = state.get("format")
    upgrade(state)
    if before == FORMAT and new == old:
        log.info("checkpoint %s already has format %d", old, FORMAT)
        return new
    new.parent.mkdir(parents=True, exist_ok=True)
    _write(state, new)
    return new


def main(argv: list[str] | None = None) -> int:
    """``python -m pipesgd.reliability.checkpoint convert OLD [NEW]`` (docs/reliability.md#old-checkpoints)."""
    parser = argparse.ArgumentParser(prog="python -m pipesgd.reliability.checkpoint",
                                     description="Checkpoint files (docs/reliability.md).")
    sub = parser.add_subparsers(dest="command", required=True)
    conv = sub.add_parser("convert", help=f"rewrite a format-1 checkpoint in format {FORMAT}")
    conv.add_argument("old", help="the checkpoint (step-N.pt; its .sha256 is checked when present)")
    conv.add_argument("new", nargs="?", help="where to write it (default: over OLD); its .sha256 beside it")
    args = parser.parse_args(argv)
    try:
        path = convert(args.old, args.new)
    except CheckpointError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyError as e:
        print(f"error: checkpoint {args.old} lacks {e}, which a format-1 checkpoint has", file=sys.stderr)
        return 2
    print(f"{path}: format {FORMAT}; resume with trainer.resume={path}, or as step-N.pt in "
          "<run dir>/checkpoints with trainer.resume=auto")
    return 0


if __name__ == "__main__":
    sys.exit(main())
