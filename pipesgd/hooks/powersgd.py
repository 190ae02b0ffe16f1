"""torch's ``PowerSGDState`` kept per parameter: re-laid out when DDP re-buckets, checkpointed as
plain tensors. Used by ``trainer.mode=ddp compressor=powersgd`` and by each in-flight slot of the
pipelined hook (:mod:`pipesgd.hooks.pipelined`)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from ..flat import state_to_device


class HookState(ABC):
    """A DDP comm hook's state that a checkpoint carries: ``run(hook, bucket)`` calls ``hook`` with
    the state torch's hook expects; ``state_dict`` / ``load_state_dict`` hold plain tensors and
    Python values (loadable with ``weights_only=True``)."""

    @abstractmethod
    def run(self, hook: Callable, bucket) -> torch.futures.Future:
        ...

    @abstractmethod
    def state_dict(self) -> dict[str, Any]:
        ...

    @abstractmethod
    def load_state_dict(self, state: dict[str, Any]) -> None:
        ...


def powersgd_state(process_group=None, *, rank: int = 1, error_feedback: bool = True, seed: int = 0,
                   start_iter: int = 1000, like=None):
    """A ``PowerSGDState`` over ``process_group``: with ``like`` (another PowerSGDState) its
    settings and its generator's state, else from the keywords (torch's defaults for the rest:
    warm start on, ``min_compression_rate=2``)."""
    from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState

    if like is None:
        return PowerSGDState(process_group=process_group, matrix_approximation_rank=rank,
                             use_error_feedback=error_feedback, random_seed=seed, start_powerSGD_iter=start_iter)
    state = PowerSGDState(
        process_group=process_group, matrix_approximation_rank=like.matrix_approximation_rank,
        start_powerSGD_iter=like.start_powerSGD_iter, min_compression_rate=like.min_compression_rate,
        use_error_feedback=like.use_error_feedback, warm_start=like.warm_start,
        orthogonalization_epsilon=like.orthogonalization_epsilon,
        batch_tensors_with_same_shape=like.batch_tensors_with_same_shape)
    state.rng.set_state(like.rng.get_state())
    state.iter = like.iter
    return state


class PowerSGDHookState(HookState):
    """torch's ``PowerSGDState`` (``state``) for DDP's ``powerSGD_hook``, re-laid out per parameter.

    The hook keeps its state per DDP bucket, laid out in the bucket's parameter order, and a fresh
    DDP's first iteration buckets the parameters in model order before it re-buckets them in the
    order backward makes them ready. So :meth:`run` lays the state out for the bucket first: when a
    bucket arrives in another layout than its state was built in, the state is split per parameter
    and re-assembled in the new layout (error feedback: the parameter's slice; warm-started P/Q: its
    factors), and torch's hook then sees exactly what an uninterrupted run's would. ``state_dict``
    holds plain tensors and Python values (the NumPy generator's state too).

    torch's ``batched_powerSGD_hook`` keeps one matrix per bucket, not per parameter, so it cannot be
    re-laid out: :meth:`run` refuses it."""

    def __init__(self, state, parameters: Sequence[nn.Parameter]):
        self.state = state
        self._index = {id(p): i for i, p in enumerate(parameters)}
        self._shapes = [p.shape for p in parameters]
        self._device = parameters[0].device if parameters else torch.device("cpu")
        self._layout: dict[int, list[int]] = {}  # bucket index -> the parameters its state is laid out for
        self._parked: dict[int, dict[str, Tensor]] = {}  # parameter -> its state, between two layouts

    def run(self, hook: Callable, bucket) -> torch.futures.Future:
        """``hook(self.state, bucket)`` after laying the state out for this bucket."""
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook

        if hook is powerSGD_hook.batched_powerSGD_hook:
            raise ValueError("batched_powerSGD_hook keeps one matrix per DDP bucket, which cannot follow a parameter "
                             "across DDP's bucket rebuild or a resume; use powerSGD_hook")
        idx, order = bucket.index(), [self._index[id(p)] for p in bucket.parameters()]
        if self._layout.get(idx, order) != order:
            self._park()
        if self._parked and all(i in self._parked for i in order):
            self._unpark(idx, order)
        self._layout[idx] = order
        return hook(self.state, bucket)

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
        """Restores onto the parameters' device: a checkpoint gathered on the CPU resumes on a GPU
        (torch's hook adds the residual to the bucket in place, which fails across devices)."""
        s = self.state
        s.iter = int(state["iter"])
        # the tensors only: the generator's state stays a CPU tensor NumPy reads
        moved = state_to_device({k: state[k] for k in ("error_dict", "p_memory_dict", "q_memory_dict", "parked")},
                                self._device)
        for mine, key in ((s.error_dict, "error_dict"), (s.p_memory_dict, "p_memory_dict"),
                          (s.q_memory_dict, "q_memory_dict")):
            mine.clear()
            mine.update(moved[key])
        self._layout = {int(k): list(v) for k, v in state["layout"].items()}
        self._parked = moved["parked"]
        r = state["rng"]
        s.rng.set_state((r["name"], r["keys"].numpy().astype("uint32"), r["pos"], r["has_gauss"], r["gauss"]))


def one_bucket_on_gloo(model: nn.Module) -> dict[str, float]:
    """DDP's ``bucket_cap_mb`` for torch's PowerSGD hook on Gloo: every parameter in one bucket.

    The hook waits for its P all-reduce inside a future's callback, and on Gloo callbacks run on the
    process group's worker threads (two by default): with two buckets in flight both workers block
    in those waits and nothing is left to run the all-reduces they wait for, so the run hangs at the
    first compressed step (reproduced with torch 2.13 and a model just over DDP's 1 MiB first
    bucket; ResNet-20 is one). An explicit cap also lifts that first-bucket limit. NCCL completes
    its work on its own streams and keeps DDP's default buckets."""
    import torch.distributed as dist

    if dist.get_backend() != "gloo":
        return {}
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    return {"bucket_cap_mb": nbytes / 2**20 + 1}
