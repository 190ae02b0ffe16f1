"""A parameter list as one flat vector: copies out, in-place writes back, gradient views.

All functions walk ``params`` in order; ``flat`` is laid out as ``torch.cat`` of the flattened
parameters. Writes happen under ``torch.no_grad()`` (they are optimizer-like updates).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor


def flatten_grads(params: Sequence[Tensor], out: Tensor) -> None:
    """``params``' gradients, flat, in order, into ``out`` (their total numel values); a missing
    ``.grad`` counts as zeros."""
    torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in params], out=out)


def views(params: Sequence[Tensor], flat: Tensor) -> list[Tensor]:
    """The front of ``flat`` cut into views shaped like ``params`` (no copy)."""
    out, offset = [], 0
    for p in params:
        n = p.numel()
        out.append(flat[offset:offset + n].view_as(p))
        offset += n
    return out


def flat_params(params: Sequence[Tensor]) -> Tensor:
    """A fresh flat copy of the parameter values (one parameter-sized allocation)."""
    return torch.cat([p.detach().reshape(-1) for p in params])


@torch.no_grad()
def assign_params(params: Sequence[Tensor], flat: Tensor) -> None:
    """Copy ``flat`` into the parameters (exact: bit for bit)."""
    for p, v in zip(params, views(params, flat)):
        p.copy_(v)


@torch.no_grad()
def add_to_params(params: Sequence[Tensor], flat: Tensor, alpha: float = 1.0) -> None:
    for p, v in zip(params, views(params, flat)):
        p.add_(v, alpha=alpha)


def set_grads(params: Sequence[Tensor], flat: Tensor) -> None:
    """Point every ``p.grad`` at its slice of ``flat`` (views, no copy)."""
    for p, v in zip(params, views(params, flat)):
        p.grad = v


def has_nonfinite(t: Tensor) -> Tensor:
    """Whether ``t`` holds a NaN/inf, as a 0-d bool tensor (no device sync).

    The test is the sum: NaN and inf propagate through it (inf - inf is NaN), so a finite sum
    means every value is finite. A vectorised sum is ~50x cheaper than ``isfinite().all()`` on
    CPU (0.016 vs 0.7 ms for ResNet-20's gradient, measured). Half precision is summed in fp32;
    an fp32 sum overflows only past 3.4e38, which counts as non-finite too (no better an update)."""
    acc = torch.float32 if t.element_size() < 4 else t.dtype
    return torch.isfinite(t.sum(dtype=acc)).logical_not_()


def mark_nonfinite(buf: Tensor, at: int = -1) -> Tensor:
    """Set the flag slot ``buf[at]`` (default the last value) to +inf if any value before it is
    NaN/inf, else 0; return that test (:func:`~pipesgd.flat.has_nonfinite`; no device sync)."""
    bad = has_nonfinite(buf[:at])
    buf[at] = torch.where(bad, float("inf"), 0.0)
    return bad


def flag_overflow(buf: Tensor, at: int = -1) -> None:
    """After the sum: set the flag slot ``buf[at]`` to +inf where the values before it came out
    NaN/inf though no rank's own were (a 16-bit hop's sum overflowed), so every rank drops the
    step alike. One sum over those values."""
    buf[at] = torch.where(has_nonfinite(buf[:at]), float("inf"), buf[at])


def state_to_device(state, device: torch.device | str):
    """``state`` (tensors inside dicts, lists and tuples) with every tensor on ``device``; tensors
    already there are the same objects (no copy). Other values are returned as they are."""
    if isinstance(state, torch.Tensor):
        return state.to(device)
    if isinstance(state, dict):
        return {k: state_to_device(v, device) for k, v in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(state_to_device(v, device) for v in state)
    return state
