"""Whether the replicas hold the same weights: what the trainer's ``trainer.check_every`` and a
library user's ``engine.check_replicas()`` compare (a sha256 per rank), and how a difference is
reported (the same message on every rank). A live run's groups compare sums of their digests'
bytes instead (:func:`moments`, :func:`describe_summed_mismatch`): the check rides on a reduction."""

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


MOMENTS = 64
"""Values a digest adds to a summed check (:func:`moments`): its 32 bytes, then their squares."""
EXACT_GROUPS = 2 ** 24 // 255 ** 2
"""258: the most contributions whose summed squares stay below 2**24, exact in float32."""


def moments(hexdigest: str) -> list[float]:
    """A sha256 (hex) as one group's share of a summed check: each of its 32 bytes d, then each d*d.
    Summed over the groups that take part, each adding c times these (c = 1; 0 for a group whose
    share is zeroed), N = sum c, S1 = sum c*d and S2 = sum c*d*d satisfy N*S2 == S1**2 for every
    byte exactly when every contributing digest is the same (Cauchy-Schwarz). Integers below 2**24
    for up to :data:`EXACT_GROUPS` groups: exact in float32 whatever the order of summation."""
    d = bytes.fromhex(hexdigest)
    return [float(x) for x in d] + [float(x * x) for x in d]


def describe_summed_mismatch(n: int, sums: list[float], mine: str | None, where: str) -> str | None:
    """None if the ``n`` digests summed into ``sums`` (the sum of :func:`moments` over them) are
    equal, else one line saying so and what this group can tell from the sums: ``mine``, its own
    digest if it was one of them. Sums say whether the digests differ, not which group is odd:
    with two groups neither can tell; with more, a group whose peers agree with each other is
    the odd one, and a group whose peers differ among themselves too cannot tell more."""
    s1, s2 = sums[:MOMENTS // 2], sums[MOMENTS // 2:]
    bad = sum(n * b != a * a for a, b in zip(s1, s2))
    if not bad:
        return None
    what = (f"replica groups diverged at {where}: the weights of the {n} groups that took part in the check differ "
            f"({bad} of the 32 bytes of their sha256 differ; the check sums the digests, so it tells that they "
            f"differ, not which group)")
    if mine is None:
        return what + "; this group took no part (it was healing)"
    own = moments(mine)
    rest = n - 1
    r1 = [a - d for a, d in zip(s1, own[:MOMENTS // 2])]
    r2 = [b - d for b, d in zip(s2, own[MOMENTS // 2:])]
    if rest == 1:
        return what + f"; with two groups the sums cannot tell which one is odd (this group's sha256 {mine[:12]})"
    if rest < 1:
        return what + f" (this group's sha256 {mine[:12]})"
    if all(rest * b == a * a for a, b in zip(r1, r2)):
        return what + f"; the other {rest} agree with each other, so this group (sha256 {mine[:12]}) is the odd one"
    return what + f"; the other {rest} differ among themselves too (this group's sha256 {mine[:12]})"
