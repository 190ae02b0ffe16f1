"""PowerSGD (Vogels, Karimireddy, Jaggi, NeurIPS 2019): rank-r gradient compression with error
feedback and a warm-started power iteration, reduced by two dense allreduces.

For each parameter viewed as a matrix M (n x m; a conv weight as out x in·kh·kw) with
M = gradient + residual:

    P = M Q            allreduce(P)     P^ = orthonormal basis of sum(P)  (QR)
    Q = M^T P^         allreduce(Q)     result = P^ sum(Q)^T  = sum over ranks of P^ P^^T M

Every rank gets the same P^ and sum(Q), so replicas stay identical. Q is kept for the next step
(the warm start: one power-iteration step per SGD step refines last step's subspace); it starts
as a seeded Gaussian, the same on every rank. Error feedback follows the paper's Algorithm 2 and
torch's PowerSGD hook: this rank's residual is M minus the decompressed *average*,
P^ (sum(Q)/p)^T, so input = decompressed + residual, and the residuals sum to p times the
projection error of the average gradient. p is the number of ranks whose share counts: the
group's size, or under ``trainer.mode=live`` the valid contributions (a healer's zeroed share,
M = 0, keeps its residual as it is and is not counted).

Vectors (biases, norm scales) and matrices too small to gain (r·(n+m) >= n·m) are sent dense,
appended to the P buffer, so a step is exactly two allreduces. Wire bytes per step are
2(p-1)/p · 4 · (sum r·(n+m) + dense values) with the ring. Costs: three matmuls and one QR per
matrix per step (:func:`step_flops`, the fact the timing model prices them by), on the
communication thread; memory: one residual, the Q factors.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from ..comm import CommStats, ring_bytes
from ..comm.base import timed
from ..comm.group import group_size
from ..flat import views
from .base import Reduction, register
from .memory import ErrorFeedback


@dataclass(frozen=True)
class _Block:
    start: int
    end: int
    rows: int = 0  # 0: sent dense
    cols: int = 0
    rank: int = 0


def step_flops(rows: float, cols: float, rank: float) -> float:
    """Floating-point operations of one step of PowerSGD's compute on one compressed ``rows`` x
    ``cols`` matrix at ``rank``: three products with an n x r or m x r factor (P = M Q,
    Q = M^T P^, and the decompression P^ Q^T), 2nmr each, and the orthogonalisation of P, a QR of
    an n x r matrix that also forms Q (about 4nr^2). The error feedback's additions (O(nm)) are left
    to the constant that prices these operations (``powersgd_s_per_flop``, measured by
    ``python -m pipesgd_lab.bench.calibrate_cli``). The same operations run in torch's PowerSGD hook."""
    return 6.0 * rows * cols * rank + 4.0 * rows * rank * rank


MIN_COMPRESSION_RATE = 2
"""torch's ``PowerSGDState(min_compression_rate=2)`` default: its hook compresses a tensor only when
(n + m)·r·2 < n·m; the rest travel uncompressed in the bucket's first allreduce."""


def ddp_traffic(shapes: Sequence[Sequence[int]] | None, bucket_bytes: Sequence[float],
                rank: int) -> list[tuple[float, float, float, float]]:
    """What torch's ``powerSGD_hook`` costs per DDP bucket: ``(uncompressed, P, Q, FLOPs)``, the fp32
    values of its three allreduces, one after another (the uncompressed tensors, then the P factors,
    then the Q factors), and the floating-point operations of its compute (:func:`step_flops`),
    the fact the timing model prices the hook by. A tensor viewed as n × (numel/n) with
    r = min(rank, n, m) is sent as P (n·r) and Q (m·r) when (n + m)·r·2 < n·m, else whole. DDP
    fills buckets in reverse parameter order; a tensor straddling a bucket boundary (buckets are
    cut by bytes) is shared in proportion. ``shapes=None``: each bucket is one square matrix."""
    out = [[0.0, 0.0, 0.0, 0.0] for _ in bucket_bytes]
    if shapes is None:
        for j, size in enumerate(bucket_bytes):
            side = math.sqrt(size / 4)  # fp32 values
            r = min(rank, side)
            out[j][1] = out[j][2] = side * r
            out[j][3] = step_flops(side, side, r)
        return [tuple(v) for v in out]
    edges = [0.0]
    for size in bucket_bytes:
        edges.append(edges[-1] + size)
    start, j = 0.0, 0
    for shape in reversed(shapes):
        numel = math.prod(shape)
        n = shape[0] if shape else 1
        m = numel // n if n else 0
        r = min(rank, n, m)
        parts = ((0.0, n * r, m * r, step_flops(n, m, r)) if (n + m) * r * MIN_COMPRESSION_RATE < n * m
                 else (numel, 0.0, 0.0, 0.0))
        end = start + 4 * numel
        while j < len(bucket_bytes) and edges[j + 1] <= start:
            j += 1
        k = j
        while k < len(bucket_bytes) and edges[k] < end:
            share = (min(end, edges[k + 1]) - max(start, edges[k])) / (end - start) if end > start else 1.0
            for i in range(4):
                out[k][i] += share * parts[i]
            k += 1
        start = end
    return [tuple(v) for v in out]


@register("powersgd", step_flops=step_flops, ddp_traffic=ddp_traffic)
class PowerSGD(Reduction):
    shardable = False  # each parameter's matrix: a shard of the flat buffer cuts across them

    def __init__(self, rank: int = 4, error_feedback: bool = True, seed: int = 0, ddp_start_iter: int = 1000):
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
            raise ValueError(f"compressor.rank={rank!r} is invalid: must be an integer >= 1")
        if isinstance(ddp_start_iter, bool) or not isinstance(ddp_start_iter, int) or ddp_start_iter < 2:
            raise ValueError(f"compressor.ddp_start_iter={ddp_start_iter!r} is invalid: must be an integer >= 2 "
                             "(torch's powerSGD_hook compresses from the third DDP step at the earliest)")
        self.rank = rank
        self.ddp_start_iter = ddp_start_iter  # trainer.mode=ddp only: torch's start_powerSGD_iter
        self.seed = seed
        self.memory = ErrorFeedback() if error_feedback else None
        self._blocks: list[_Block] = []
        self._numel = 0
        self._allreduce: Callable[..., CommStats] | None = None
        self.q: list[Tensor] = []
        self._device: torch.device | None = None

    def bind(self, shapes: Sequence[torch.Size], allreduce: Callable[..., CommStats], device: torch.device) -> None:
        self._allreduce = allreduce
        self._device = device
        self._blocks, offset = [], 0
        for shape in shapes:
            n = shape.numel()
            rows = shape[0] if len(shape) >= 2 else 0
            cols = n // rows if rows else 0
            r = min(self.rank, rows, cols)
            if rows and r * (rows + cols) < n:
                self._blocks.append(_Block(offset, offset + n, rows, cols, r))
            else:
                self._blocks.append(_Block(offset, offset + n))
            offset += n
        self._numel = offset
        self.q = []  # the warm start is drawn by the first reduce(), on the stream that reads it

    def _warm_start(self) -> list[Tensor]:
        """The initial Q factors, drawn on the CPU generator and moved: the same start on every rank
        and every device. Drawn where they are first needed, so on a GPU they are allocated on the
        communication stream that reads them (made on the training stream at bind, their memory
        could go to the next forward while the first reduction still reads it)."""
        gen = torch.Generator().manual_seed(self.seed)
        return [torch.randn(b.cols, b.rank, generator=gen, device="cpu").to(self._device) for b in self._matrices]

    def bound_flops(self) -> float:
        """:func:`step_flops` summed over the matrices :meth:`bind` chose to compress."""
        return sum(step_flops(b.rows, b.cols, b.rank) for b in self._matrices)

    @property
    def _matrices(self) -> list[_Block]:
        return [b for b in self._blocks if b.rows]

    def reduce(self, flat: Tensor, group, *, zeroed: bool = False, contributors: int | None = None) -> CommStats:
        return timed(lambda: self._reduce(flat, group, zeroed, contributors))

    def _reduce(self, flat: Tensor, group, zeroed: bool, contributors: int | None) -> CommStats:
        if self._allreduce is None:
            raise RuntimeError("PowerSGD.reduce before bind()")
        world = group_size(group)
        p = world if contributors is None else contributors  # what the caller averages by
        if not self.q:
            self.q = self._warm_start()
        keeps = self.memory is not None and not zeroed  # a zeroed share: M = 0, its residual untouched
        corrected = self.memory.add_to(flat) if keeps else flat
        mats = [corrected[b.start:b.end].view(b.rows, b.cols).float() for b in self._matrices]
        dense = [corrected[b.start:b.end] for b in self._blocks if not b.rows]

        # Round 1: P = M Q for every matrix, and the dense values, in one allreduce.
        ps = [m @ q for m, q in zip(mats, self.q)]
        p_buf = _cat([x.reshape(-1) for x in ps] + [d.float() for d in dense], flat.device)
        stats = self._allreduce(p_buf, None, group)
        p_hat = [torch.linalg.qr(x).Q for x in views(ps, p_buf)]

        # Round 2: Q = M^T P^, summed; sum(Q)/p is the next warm start.
        qs = [m.T @ ph for m, ph in zip(mats, p_hat)]
        q_buf = _cat([x.reshape(-1) for x in qs], flat.device)
        if qs:  # every parameter dense: one allreduce is all there is
            stats += self._allreduce(q_buf, None, group)
        q_sum = views(qs, q_buf)
        self.q = [q / p for q in q_sum]

        out = torch.empty_like(flat)
        for b, ph, q in zip(self._matrices, p_hat, q_sum):
            out[b.start:b.end] = (ph @ q.T).reshape(-1)
        dense_sum = p_buf[sum(x.numel() for x in ps):]
        offset = 0
        for b in self._blocks:
            if not b.rows:
                out[b.start:b.end] = dense_sum[offset:offset + b.end - b.start]
                offset += b.end - b.start
        if keeps:
            # Decompressed = the average approximation; dense blocks: this rank's own value (exact).
            decoded = out / p
            for b in self._blocks:
                if not b.rows:
                    decoded[b.start:b.end] = corrected[b.start:b.end]
            self.memory.update(corrected, decoded)
        flat.copy_(out)
        return CommStats(wire_bytes=stats.wire_bytes,
                         raw_bytes=ring_bytes(flat.numel(), world, flat.element_size()))

    def ddp_hook(self):
        """torch's ``powerSGD_hook`` (never this module's code: the DDP baseline is torch's)."""
        from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import powerSGD_hook

        return powerSGD_hook

    def ddp_state(self, parameters, group):
        """torch's ``PowerSGDState`` over ``group`` from this compressor's settings (``rank`` ->
        ``matrix_approximation_rank``, ``error_feedback`` -> ``use_error_feedback``, ``seed`` ->
        ``random_seed``, ``ddp_start_iter`` -> ``start_powerSGD_iter``), kept per parameter so it
        follows DDP's bucket rebuild and a resume (:class:`~pipesgd.hooks.PowerSGDHookState`)."""
        from ..hooks.powersgd import PowerSGDHookState, powersgd_state

        state = powersgd_state(group, rank=self.rank, error_feedback=self.memory is not None, seed=self.seed,
                               start_iter=self.ddp_start_iter)
        return PowerSGDHookState(state, parameters)

    def ddp_options(self, model):
        """One bucket on Gloo: torch's hook waits inside its callbacks (:func:`~pipesgd.hooks.one_bucket_on_gloo`)."""
        from ..hooks.powersgd import one_bucket_on_gloo

        return one_bucket_on_gloo(model)

    def state_dict(self) -> dict:
        return {**super().state_dict(), "q": [q.clone() for q in self.q] if self.q else self._warm_start()}

    def load_state_dict(self, state: dict) -> None:
        q = state.get("q", [])
        if [tuple(x.shape) for x in q] != [(b.cols, b.rank) for b in self._matrices]:
            raise ValueError("PowerSGD warm-start factors in the checkpoint do not match this model and rank")
        self.q = [x.clone() for x in q]
        super().load_state_dict(state)

    def __repr__(self) -> str:
        return f"PowerSGD(rank={self.rank}, error_feedback={self.memory is not None})"


def _cat(parts: list[Tensor], device: torch.device) -> Tensor:
    return torch.cat(parts) if parts else torch.empty(0, device=device)
