"""A recording fake of ``torch.distributed`` for single-process tests of what pipesgd hands to the
backend (tests/unit/test_device.py, test_streams.py): ``FakeDist(world, rank, backend).install(monkeypatch)``
replaces the calls pipesgd makes; each returns at once. Receives into real (non-meta) tensors get
zeros and an all_gather copies this rank's tensor everywhere, so CPU runs stay finite. With
``sums=True`` an all_reduce sums as if every rank had sent this rank's values, in the tensor's own
dtype (NCCL's arithmetic for a 16-bit payload: it overflows where NCCL's would).

In NCCL mode (``backend="nccl"``, or the tensors a ``"cpu:gloo,cuda:nccl"`` backend would route to
NCCL) every tensor handed to the backend must have a dtype NCCL has: a fake that took any dtype
let a bf16 payload cross the wire as int16, which NCCL rejects at the first hop."""

from __future__ import annotations

import torch
import torch.distributed as dist

META = torch.device("meta")

# torch's own NCCL type table (ncclDataType in torch/csrc/distributed/c10d/NCCLUtils.hpp; older
# releases keep it in ProcessGroupNCCL.cpp): the dtypes ProcessGroupNCCL maps to an ncclDataType_t.
# Anything else raises "Input tensor data type is not supported for NCCL process group" (TypeError).
NCCL_DTYPES = frozenset({
    torch.int8, torch.uint8, torch.float32, torch.float64, torch.int32, torch.int64, torch.float16,
    torch.bool, torch.float8_e5m2, torch.float8_e4m3fn, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz,
    torch.bfloat16,
})


class FakeGroup:
    def __init__(self, size: int, rank: int):
        self.size, self.rank = size, rank


class Work:
    def wait(self, timeout=None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


class P2POp:
    def __init__(self, op, tensor, peer=None, group=None, tag=0, group_peer=None):
        self.op, self.tensor, self.group, self.group_peer = op, tensor, group, group_peer


class FakeDist:
    """What pipesgd hands to ``torch.distributed``, recorded as ``(call, tensors)``; every call
    returns at once (nothing is transferred: meta tensors have no data)."""

    def __init__(self, world: int, rank: int, backend: str, sums: bool = False):
        self.world, self.rank, self.backend = world, rank, backend
        self.sums = sums
        self.calls: list[tuple[str, list]] = []

    @staticmethod
    def _arrive(tensor) -> None:
        """A receive into a real (CPU) tensor gets zeros, so CPU runs stay finite."""
        if tensor.device != META:
            tensor.zero_()

    def install(self, monkeypatch) -> FakeDist:
        for name in ("isend", "irecv", "send", "recv", "all_reduce", "broadcast", "all_gather",
                     "batch_isend_irecv", "gather_object", "get_world_size", "get_rank", "get_backend",
                     "get_global_rank", "get_group_rank", "is_initialized", "is_available", "barrier"):
            monkeypatch.setattr(dist, name, getattr(self, name))
        monkeypatch.setattr(dist, "P2POp", P2POp)
        return self

    def _record(self, call: str, tensors) -> Work:
        tensors = list(tensors)
        for t in tensors:
            if self._on_nccl(t) and t.dtype not in NCCL_DTYPES:
                raise TypeError(f"{call}: Input tensor data type is not supported for NCCL process group: {t.dtype}")
        self.calls.append((call, tensors))
        return Work()

    def _on_nccl(self, t) -> bool:
        return isinstance(t, torch.Tensor) and (
            self.backend == "nccl" or ("cuda:nccl" in self.backend and t.device.type != "cpu"))

    def tensors(self) -> list[torch.Tensor]:
        return [t for _, ts in self.calls for t in ts if isinstance(t, torch.Tensor)]

    def names(self) -> list[str]:
        return [c for c, _ in self.calls]

    # --- the calls pipesgd makes ---
    def isend(self, tensor, dst=None, group=None, tag=0, group_dst=None):
        return self._record("isend", [tensor])

    def irecv(self, tensor, src=None, group=None, tag=0, group_src=None):
        self._arrive(tensor)
        return self._record("irecv", [tensor])

    def send(self, tensor, dst=None, group=None, tag=0, group_dst=None):
        self._record("send", [tensor])

    def recv(self, tensor, src=None, group=None, tag=0, group_src=None):
        self._record("recv", [tensor])
        return 1

    def all_reduce(self, tensor, op=None, group=None, async_op=False):
        if self.sums and tensor.device != META:
            # every rank sent this rank's values; summed in the tensor's own dtype, one rounded add
            # per rank, as NCCL sums a 16-bit payload (an fp16 sum past 65504 is inf everywhere)
            total = tensor.clone()
            for _ in range(self.get_world_size(group) - 1):
                total += tensor
            tensor.copy_(total)
        return self._record("all_reduce", [tensor])

    def broadcast(self, tensor, src=None, group=None, async_op=False, group_src=None):
        return self._record("broadcast", [tensor])

    def all_gather(self, tensor_list, tensor, group=None, async_op=False):
        for t in tensor_list:  # every rank sent what this one did
            if t.device != META:
                t.copy_(tensor)
        return self._record("all_gather", [*tensor_list, tensor])

    def batch_isend_irecv(self, ops):
        assert ops, "an empty batch"
        for op in ops:
            if op.op == self.irecv:
                self._arrive(op.tensor)
        self._record("batch_isend_irecv", [op.tensor for op in ops])
        return [Work()]  # NCCL coalesces a batch into one handle

    def gather_object(self, obj, object_gather_list=None, dst=0, group=None):
        self.calls.append(("gather_object", [obj]))

    def barrier(self, group=None, async_op=False, device_ids=None):
        return self._record("barrier", [])

    def get_world_size(self, group=None):
        return self.world if group is None else group.size

    def get_rank(self, group=None):
        return self.rank if group is None else group.rank

    def get_backend(self, group=None):
        return self.backend

    def get_global_rank(self, group, group_rank):
        return group_rank

    def get_group_rank(self, group, global_rank):
        return global_rank

    def is_initialized(self):
        return True

    def is_available(self):
        return True
