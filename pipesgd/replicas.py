"""Whether the replicas hold the same weights: what the trainer's ``trainer.check_every`` and a
library user's ``engine.check_replicas()`` compare (a sha256 per rank), and how a difference is
reported (the same message on every rank)."""

from __future__ import annotations

import hashlib

import torch
from torch import Tensor


def digest(t: Tensor) -> str:
    """sha256 of ``t``'s bytes (one device-to-host copy on GPU)."""
    return hashlib.sha256(t.detach().reshape(-1).contiguous().view(torch.uint8).cpu().numpy()).hexdigest()


class ReplicaMismatch(RuntimeError):
    """The replicas' parameters differ; raised on every rank with the same message."""


def describe_mismatch(digests: list[str], step: int) -> str | None:
    """None if every rank has the same digest, else one line naming which ranks differ."""
    groups: dict[str, list[int]] = {}
    for rank, d in enumerate(digests):
        groups.setdefault(d, []).append(rank)
    if len(groups) == 1:
        return None
    ordered = sorted(groups.items(), key=lambda kv: (-len(kv[1]), kv[1]))
    (top, majority), rest = ordered[0], ordered[1:]

    def ranks(rs: list[int]) -> str:
        return f"rank{'s' if len(rs) > 1 else ''} {', '.join(map(str, rs))}"

    if 2 * len(majority) > len(digests):
        odd = sorted(r for _, rs in rest for r in rs)
        verb = "differ" if len(odd) > 1 else "differs"
        return (f"replicas diverged at step {step}: {ranks(odd)} {verb} from the majority ({ranks(majority)}, "
                f"parameter sha256 {top[:12]}); " + "; ".join(f"{ranks(rs)}: {d[:12]}" for d, rs in rest))
    return f"replicas diverged at step {step}: " + "; ".join(f"{ranks(rs)}: sha256 {d[:12]}" for d, rs in ordered)
