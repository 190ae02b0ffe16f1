"""What PipeSGD does as DDP does, beside its schedule: every rank starts from the first rank's
weights, takes its buffers every step (``broadcast_buffers``), clips the gradient the optimizer
applies, and names parameters in its errors as the module does."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from ..comm import Handle, note
from .exchange import GradientExchange


def broadcast_from_first_rank(tensors: list[Tensor], group) -> None:
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
        return
    src = 0 if group is None else dist.get_global_rank(group, 0)
    with torch.no_grad():
        for t in tensors:
            dist.broadcast(t.detach(), src=src, group=group)


def param_names(params: list[Tensor], module: torch.nn.Module | None) -> list[str]:
    """How errors name each parameter: its name in ``module``, else its index and shape."""
    names = {} if module is None else {id(p): n for n, p in module.named_parameters()}
    return [names.get(id(p), f"params[{i}] (shape {tuple(p.shape)})") for i, p in enumerate(params)]


def listed(names: list[str], indices: list[int], most: int = 5) -> str:
    shown = ", ".join(names[i] for i in indices[:most])
    more = f" and {len(indices) - most} more" if len(indices) > most else ""
    return f"parameter{'s' if len(indices) > 1 else ''} {shown}{more}"


class BufferBroadcast:
    """DDP's ``broadcast_buffers``: every rank takes the first rank's buffers (BatchNorm statistics)
    once per step, one broadcast per dtype, queued on the engine's communication thread and group
    like every other collective of the engine (two threads driving two communicators, in an order
    that can differ per rank, is a deadlock NCCL documents). DDP broadcasts before each forward;
    doing it in ``step()`` gives the next forward the same buffers and lets a joined rank take part
    (it knows a step happened only once that step's control round is done). It is queued after the
    step's control round and before its reduction, and waited for before ``step()`` returns: that
    waits for the reductions queued before it (the previous step's), not for this step's."""

    def __init__(self, module: torch.nn.Module, exchange: GradientExchange):
        self.module, self.exchange = module, exchange
        self.active = bool(list(module.buffers())) and exchange.world_size > 1
        group = exchange.group
        self.src = 0 if group is None or not self.active else dist.get_global_rank(group, 0)

    def start(self) -> Handle[list[Tensor]] | None:
        """Queue the broadcast of the first rank's buffers, as they are now."""
        if not self.active:
            return None
        with torch.no_grad():
            flats = [torch.cat([b.reshape(-1) for b in buffers]) for buffers in self._by_dtype()]
        group = self.exchange.group

        def job() -> list[Tensor]:
            note("broadcast of the module's buffers (broadcast_buffers)")
            for flat in flats:
                dist.broadcast(flat, src=self.src, group=group)
            return flats

        return self.exchange.ordered(job, *flats)

    def land(self, flats: list[Tensor]) -> None:
        """Copy the broadcast values into this rank's buffers (the first rank's are the values)."""
        if dist.get_rank() == self.src:
            return
        with torch.no_grad():
            for buffers, flat in zip(self._by_dtype(), flats):
                for b, v in zip(buffers, flat.split([b.numel() for b in buffers])):
                    b.copy_(v.view_as(b))

    def _by_dtype(self) -> list[list[Tensor]]:
        """The module's buffers, one list per dtype (one broadcast each), in a fixed order."""
        by_dtype: dict[torch.dtype, list[Tensor]] = {}
        for b in self.module.buffers():
            by_dtype.setdefault(b.dtype, []).append(b)
        return list(by_dtype.values())


def clip_applied_gradient(optimizer: torch.optim.Optimizer, max_norm: float,
                          params: list[Tensor] | None = None) -> torch.utils.hooks.RemovableHandle:
    """Clip the total 2-norm of ``params``' gradients (default: every parameter of ``optimizer``) to
    ``max_norm`` just before each ``optimizer.step()``: the gradient the optimizer applies, whatever
    engine handed it over (PipeSGD: the average; DDP: averaged in backward). Returns the hook's handle."""
    clipped = params if params is not None else [p for g in optimizer.param_groups for p in g["params"]]

    def clip(optimizer, args, kwargs) -> None:
        torch.nn.utils.clip_grad_norm_(clipped, max_norm)

    return optimizer.register_step_pre_hook(clip)
