"""``trainer.mode=ddp``: PyTorch DistributedDataParallel as the reference, with DDP's own comm hooks
(the compressors ``pipesgd.modes`` lists for this mode): ``fp16``/``bf16`` route to torch's
``fp16_compress_hook``/``bf16_compress_hook``, ``powersgd`` to torch's ``powerSGD_hook`` with a
``PowerSGDState``, never to pipesgd's own implementations, so the baseline is the one DDP users run."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn

from ..reduction.powersgd import PowerSGD
from .base import ModeArgs
from .direct import DirectEngine


class PowerSGDHookState:
    """torch's ``PowerSGDState`` for ``compressor=powersgd`` under DDP, checkpointed with the engine.

    Settings: ``matrix_approximation_rank`` = ``compressor.rank``, ``use_error_feedback`` =
    ``compressor.error_feedback``, ``random_seed`` = ``compressor.seed``, ``start_powerSGD_iter`` =
    ``compressor.ddp_start_iter`` (default torch's 1000 plain allreduce steps first, which torch
    recommends to let the early, large gradients through uncompressed; a timing run of a few dozen
    steps sets it low, or it times plain DDP); everything else is torch's default (warm start on,
    ``min_compression_rate=2``).

    Resume: the hook keeps its state per DDP bucket, laid out in the bucket's parameter order, and a
    fresh DDP's first iteration buckets the parameters in model order before it re-buckets them in
    the order backward makes them ready. So :meth:`hook` wraps torch's hook: when a bucket arrives in
    another layout than its state was built in, the state is split per parameter and re-assembled in
    the new layout (error feedback: the parameter's slice; warm-started P/Q: its factors), and torch's
    hook then sees exactly what an uninterrupted run's would. ``state_dict`` holds plain tensors and
    Python values (the NumPy generator's state too), so a checkpoint loads with ``weights_only=True``."""

    def __init__(self, compressor: PowerSGD, parameters: Sequence[nn.Parameter]):
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook

        self._torch_hook = powerSGD_hook.powerSGD_hook
        self.state = powerSGD_hook.PowerSGDState(
            process_group=None, matrix_approximation_rank=compressor.rank,
            use_error_feedback=compressor.memory is not None, random_seed=compressor.seed,
            start_powerSGD_iter=compressor.ddp_start_iter)
        self._index = {id(p): i for i, p in enumerate(parameters)}
        self._shapes = [p.shape for p in parameters]
        self._layout: dict[int, list[int]] = {}  # bucket index -> the parameters its state is laid out for
        self._parked: dict[int, dict[str, Tensor]] = {}  # parameter -> its state, between two layouts

    def hook(self, state, bucket):  # no annotation: DDP rejects a string one (future annotations)
        """DDP's comm hook: torch's ``powerSGD_hook``, after laying the state out for this bucket."""
        idx, order = bucket.index(), [self._index[id(p)] for p in bucket.parameters()]
        if self._layout.get(idx, order) != order:
            self._park()
        if self._parked and all(i in self._parked for i in order):
            self._unpark(idx, order)
        self._layout[idx] = order
        return self._torch_hook(state, bucket)

    def _factors(self, i: int) -> tuple[int, int] | None:
        """(rows, cols) x rank of parameter ``i``'s P and Q if torch's hook compresses it, else None
        (the hook's own rule: a matrix ``shape[0]`` x rest, worth it above ``min_compression_rate``)."""
        n = self._shapes[i][0]
        m = self._shapes[i].numel() // n
        r = min(n, m, self.state.matrix_approximation_rank)
        return (n * r, m * r) if (n + m) * r * self.state.min_compression_rate < n * m else None

    def _park(self) -> None:
        """Split every bucket's state into per-parameter pieces (DDP is re-bucketing)."""
        s = self.state
        for idx, order in self._layout.items():
            if idx not in s.error_dict and idx not in s.q_memory_dict:
                continue
            error = s.error_dict.pop(idx, None)
            p_mem, q_mem = s.p_memory_dict.pop(idx, None), s.q_memory_dict.pop(idx, None)
            at = p_at = q_at = 0
            for i in order:
                piece = self._parked.setdefault(i, {})
                numel = self._shapes[i].numel()
                if error is not None:
                    piece["error"] = error[at:at + numel]
                at += numel
                factors = self._factors(i)
                if factors is not None and p_mem is not None:
                    piece["p"], piece["q"] = p_mem[p_at:p_at + factors[0]], q_mem[q_at:q_at + factors[1]]
                    p_at, q_at = p_at + factors[0], q_at + factors[1]
        self._layout.clear()

    def _unpark(self, idx: int, order: list[int]) -> None:
        s = self.state
        pieces = [self._parked.pop(i) for i in order]
        if all("error" in piece for piece in pieces):
            s.error_dict[idx] = torch.cat([piece["error"] for piece in pieces])
        compressed = [piece for i, piece in zip(order, pieces) if self._factors(i) is not None]
        if compressed and all("q" in piece for piece in compressed):
            s.p_memory_dict[idx] = torch.cat([piece["p"] for piece in compressed])
            s.q_memory_dict[idx] = torch.cat([piece["q"] for piece in compressed])

    def state_dict(self) -> dict[str, Any]:
        s = self.state
        name, keys, pos, has_gauss, gauss = s.rng.get_state()
        return {"iter": s.iter, "error_dict": dict(s.error_dict), "p_memory_dict": dict(s.p_memory_dict),
                "q_memory_dict": dict(s.q_memory_dict), "layout": dict(self._layout),
                "parked": dict(self._parked),
                "rng": {"name": name, "keys": torch.from_numpy(keys.astype("int64")), "pos": int(pos),
                        "has_gauss": int(has_gauss), "gauss": float(gauss)}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        s = self.state
        s.iter = int(state["iter"])
        for key in ("error_dict", "p_memory_dict", "q_memory_dict"):
            getattr(s, key).clear()
            getattr(s, key).update(state[key])
        self._layout = {int(k): list(v) for k, v in state["layout"].items()}
        self._parked = dict(state["parked"])
        r = state["rng"]
        s.rng.set_state((r["name"], r["keys"].numpy().astype("uint32"), r["pos"], r["has_gauss"], r["gauss"]))


def one_bucket_on_gloo(compressor: str, model: nn.Module) -> dict[str, float]:
    """DDP's ``bucket_cap_mb`` for torch's PowerSGD hook on Gloo: every parameter in one bucket.

    The hook waits for its P all-reduce inside a future's callback, and on Gloo callbacks run on the
    process group's worker threads (two by default): with two buckets in flight both workers block
    in those waits and nothing is left to run the all-reduces they wait for, so the run hangs at the
    first compressed step (reproduced here with torch 2.13 and a model just over DDP's 1 MiB first
    bucket; ResNet-20 is one). An explicit cap also lifts that first-bucket limit. NCCL completes
    its work on its own streams and keeps DDP's default buckets."""
    import torch.distributed as dist

    if compressor != "powersgd" or dist.get_backend() != "gloo":
        return {}
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    return {"bucket_cap_mb": nbytes / 2**20 + 1}


class DDPEngine(DirectEngine):
    """DirectEngine plus the comm hook's own state (PowerSGD's), saved and restored with it."""

    def __init__(self, *args, hook_state: PowerSGDHookState | None = None, **kwargs):
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
                raise ValueError("this checkpoint has no PowerSGD hook state (it was saved by a run without "
                                 "compressor=powersgd); resume it with the compressor it was trained with")
            self.hook_state.load_state_dict(state["hook"])


def build(a: ModeArgs) -> tuple[nn.Module, DirectEngine]:
    from torch.nn.parallel import DistributedDataParallel as DDP

    numel = sum(p.numel() for p in a.model.parameters() if p.requires_grad)
    if a.world_size == 1:
        return a.model, DirectEngine(a.optimizer, numel, 4, 1, a.nonfinite)
    ids = [a.device.index] if a.device.type == "cuda" else None
    name = a.compressor.name
    model = DDP(a.model, device_ids=ids, **one_bucket_on_gloo(name, a.model))
    hook_state, wire = None, 4
    if name == "powersgd":
        hook_state = PowerSGDHookState(a.compressor, [p for p in a.model.parameters() if p.requires_grad])
        model.register_comm_hook(hook_state.state, hook_state.hook)
    else:  # a compressor declares its hook (fp16 -> fp16_compress_hook, bf16 -> bf16_compress_hook, none: None)
        hook = a.compressor.ddp_hook()
        if hook is not None:
            model.register_comm_hook(None, hook)
        wire = a.compressor.payload_bytes(1)
    # Wire bytes: an ideal ring of the elements at the hook's width (PowerSGD's factors are fewer
    # bytes than this; DDP does not expose what it sent).
    return model, DDPEngine(a.optimizer, numel, wire, a.world_size, a.nonfinite, hook_state=hook_state)
