"""``trainer.mode=ddp``: PyTorch DistributedDataParallel as the reference, with the DDP comm hook the
compressor declares (``ddp_hook()``: torch's ``fp16_compress_hook``, ``bf16_compress_hook``,
``powerSGD_hook``, never pipesgd's own implementations), so the baseline is the one DDP users run.
At ``trainer.width=2`` the same hook runs inside :func:`pipesgd.hooks.pipelined`: DDP becomes
Pipe-SGD of width 2 (docs/ddp-hook.md)."""

from __future__ import annotations

from contextlib import AbstractContextManager

from torch import nn

from ..hooks import HookState, PipelinedState, pipelined
from ..modes import register
from .base import ModeArgs, StepStats
from .direct import DirectEngine


class DDPEngine(DirectEngine):
    """DirectEngine plus the comm hook's own state (PowerSGD's), saved and restored with it."""

    def __init__(self, *args, hook_state: HookState | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.hook_state = hook_state

    def state_dict(self) -> dict:
        state = super().state_dict()
        if self.hook_state is not None:
            state["hook"] = self.hook_state.state_dict()
        return state

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        if self.hook_state is not None:
            if "hook" not in state:
                raise ValueError("this checkpoint has no state of the DDP comm hook (it was saved by a run with "
                                 "another compressor or trainer.width); resume it with the settings it was "
                                 "trained with")
            self.hook_state.load_state_dict(state["hook"])


class PipelinedDDPEngine(DDPEngine):
    """DDP with the pipelined hook (width 2): ``step()`` runs ``optimizer.step()`` when the hook
    handed DDP an earlier step's average (not at the first step), ``flush()`` applies the step in
    flight, ``forward_context()`` is the hook's (lookahead). The hook's state (in-flight averages by
    parameter name, the inner hook's per-slot states) is checkpointed under ``hook``."""

    width = 2

    def __init__(self, *args, hook_state: PipelinedState, **kwargs):
        super().__init__(*args, hook_state=hook_state, **kwargs)

    def step(self) -> StepStats:
        if not self.hook_state.ready():
            self.steps += 1
            self.last = StepStats(comm=self.last.comm)
            return self.last
        stats = super().step()
        stats.staleness = 1
        return stats

    def flush(self) -> StepStats:
        return StepStats(applied=self.hook_state.flush(self.optimizer), staleness=0)

    def forward_context(self) -> AbstractContextManager:
        return self.hook_state.forward_context()


@register("ddp", ddp_hooks=True, widths=(2,), stalenesses=("none", "lookahead"), overlap="backward",
          fixed_comm="native")
def build(a: ModeArgs) -> tuple[nn.Module, DirectEngine]:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    numel = sum(p.numel() for p in a.model.parameters() if p.requires_grad)
    if a.world_size == 1:
        if a.width == 2:  # one process: the update rule without DDP (nothing to reduce)
            from .pipe import PipeSGD

            return a.model, PipeSGD(a.optimizer, a.model.parameters(), width=2, staleness=a.staleness,
                                    nonfinite=a.nonfinite, timeout_s=a.timeout_s)
        return a.model, DirectEngine(a.optimizer, numel, 4, 1, a.nonfinite)
    ids = [a.device.index] if a.device.type == "cuda" else None
    comp = a.compressor
    hook = comp.ddp_hook()  # the launcher's modes.check_compressor refused a compressor that declares none
    model = DDP(a.model, device_ids=ids, **comp.ddp_options(a.model))
    params = [p for p in a.model.parameters() if p.requires_grad]
    engine_args = (a.optimizer, numel, comp.ddp_wire_bytes(), a.world_size, a.nonfinite)
    if a.width == 2:
        state = PipelinedState(model, lambda group: comp.ddp_state(params, group), optimizer=a.optimizer,
                               staleness=a.staleness)
        model.register_comm_hook(state, pipelined(hook))
        return model, PipelinedDDPEngine(*engine_args, hook_state=state)
    state = comp.ddp_state(params, None)
    if isinstance(state, HookState):
        model.register_comm_hook(state, lambda s, bucket: s.run(hook, bucket))
        return model, DDPEngine(*engine_args, hook_state=state)
    if hook is not _allreduce_hook():  # DDP's built-in allreduce is what allreduce_hook computes, in C++
        model.register_comm_hook(dist.group.WORLD, hook)
    return model, DDPEngine(*engine_args)


def _allreduce_hook():
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    return allreduce_hook

