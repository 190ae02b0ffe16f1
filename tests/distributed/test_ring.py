"""ring_allreduce against torch.distributed.all_reduce, on 2, 3 and 4 Gloo ranks.

Error bounds, per value, with S = sum over ranks of |x_r| and u the unit roundoff of the dtype:
- no compressor: both results are sums of p terms in some order, each within (p-1)*u*S of the
  exact sum, so they differ by at most 2(p-1)*u*S.
- with a compressor, a chunk is encoded p times (p-1 reduce-scatter hops + the owner's final
  encode), each time a partial sum of magnitude <= S: fp16 adds <= 2**-11 * S per encode,
  bf16 truncation < 2**-7 * S, int8 <= max(S)/254 (the block max is at most the global max);
  fp32 additions add (p-1)*2**-24*S. So |ring - exact| <= p * per_encode + (p-1)*2**-24*S.
"""

import pytest
import torch
import torch.distributed as dist

from distributed_utils import run_workers
from pipesgd.comm import native_allreduce, ring_allreduce

UNIT = {torch.float32: 2.0 ** -24, torch.float64: 2.0 ** -53, torch.float16: 2.0 ** -11, torch.bfloat16: 2.0 ** -8}
LENGTHS = [0, 1, 2, 3, 5, 1001, 40_000]


def data(rank, n, seed=0):
    return torch.randn(n, generator=torch.Generator().manual_seed(1000 * seed + 17 * rank + n))


def _ring_worker(rank, p):
    failures, sums = [], {}
    for n in LENGTHS:
        xs = [data(r, n) for r in range(p)]
        exact = torch.stack([x.double() for x in xs]).sum(0)
        S = torch.stack([x.double().abs() for x in xs]).sum(0)
        for dtype, u in UNIT.items():
            x = xs[rank].to(dtype)
            ref = x.clone()
            dist.all_reduce(ref)
            out = x.clone()
            stats = ring_allreduce(out)
            tol = 2 * (p - 1) * u * S + 1e-30
            exact_d = torch.stack([y.to(dtype).double() for y in xs]).sum(0)
            if out.dtype != dtype or out.shape != x.shape:
                failures.append(f"n={n} {dtype}: dtype/shape changed")
            if not torch.all((out.double() - ref.double()).abs() <= tol):
                failures.append(f"n={n} {dtype}: max diff {(out.double() - ref.double()).abs().max()}")
            if not torch.all((out.double() - exact_d).abs() <= (p - 1) * u * S + 1e-30):
                failures.append(f"n={n} {dtype}: off the exact sum")
        per_encode = {"fp16": 2.0 ** -11 * S, "bf16": 2.0 ** -7 * S, "int8": torch.full_like(S, S.max().item() / 254 if n else 0.0)}
        for name, enc in per_encode.items():
            out = xs[rank].clone()
            stats = ring_allreduce(out, name)
            err = (out.double() - exact).abs()
            tol = p * enc * (1 + 1e-3) + (p - 1) * 2.0 ** -24 * S + 1e-12
            if not torch.all(err <= tol):
                failures.append(f"n={n} {name}: error {err.max()} above bound")
            sums[(n, name)] = out
            if n >= 1000 and stats.wire_bytes >= stats.raw_bytes:
                failures.append(f"n={n} {name}: wire {stats.wire_bytes} >= raw {stats.raw_bytes}")
        # Bytes sent by this rank: p-1 chunks in each phase.
        out = xs[rank].clone()
        stats = ring_allreduce(out)
        sizes = [n // p + (1 if i < n % p else 0) for i in range(p)]
        expected = 4 * (sum(sizes[(rank - s) % p] for s in range(p - 1)) + sum(sizes[(rank + 1 - s) % p] for s in range(p - 1)))
        if stats.wire_bytes != expected or stats.raw_bytes != expected:
            failures.append(f"n={n}: sent {stats.wire_bytes} bytes, expected {expected}")
    # Non-contiguous input is reduced too.
    m = data(rank, 12).reshape(3, 4).t()
    ref = m.contiguous().clone()
    dist.all_reduce(ref)
    ring_allreduce(m)
    if not torch.allclose(m, ref, atol=1e-6):
        failures.append("non-contiguous tensor")
    # native path with summable casts
    for name in ["none", "fp16", "bf16"]:
        x = data(rank, 1001)
        ref = x.clone()
        dist.all_reduce(ref)
        native_allreduce(x, name)
        tol = {"none": 1e-5, "fp16": 2e-2, "bf16": 1e-1}[name]
        if not torch.allclose(x, ref, atol=tol):
            failures.append(f"native {name}: max diff {(x - ref).abs().max()}")
    return failures, sums


@pytest.mark.timeout(180)
@pytest.mark.parametrize("p", [2, 3, 4])
def test_ring_matches_all_reduce(p):
    results = run_workers(_ring_worker, p)
    for rank, (failures, _) in enumerate(results):
        assert not failures, f"rank {rank}: {failures}"
    # Compressed rings must leave every replica with bit-identical results.
    sums0 = results[0][1]
    for _, sums in results[1:]:
        for key, value in sums0.items():
            assert torch.equal(value, sums[key]), f"replicas differ for {key}"


def _native_rejects_int8(rank, p):
    try:
        native_allreduce(torch.ones(4), "int8")
    except ValueError as e:
        return str(e)
    return None


@pytest.mark.timeout(60)
def test_native_refuses_unsummable_compressor():
    msg = run_workers(_native_rejects_int8, 2)[0]
    assert msg is not None and "compressor='int8'" in msg and "comm=ring" in msg
