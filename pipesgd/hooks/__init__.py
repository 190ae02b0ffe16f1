"""DDP communication hooks: :func:`pipelined` turns any DDP hook into Pipe-SGD of width 2
(docs/ddp-hook.md); :class:`PowerSGDHookState` keeps torch's PowerSGD state per parameter."""

from .. import teardown  # noqa: F401  (before any process group: see there)
from .pipelined import PipelinedState, pipelined, register
from .powersgd import HookState, PowerSGDHookState, one_bucket_on_gloo, powersgd_state

__all__ = ["HookState", "PipelinedState", "PowerSGDHookState", "one_bucket_on_gloo", "pipelined", "powersgd_state",
           "register"]
