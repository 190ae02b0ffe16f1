"""The two 16-bit arithmetics a compressed average can take, on real
gradients (ResNet-20, one random CIFAR-shaped batch per rank), against the exact fp32 average:

* the ring (Gloo, and int8 everywhere): each reduce-scatter hop encodes its partial sum (fp16:
  round to nearest; bf16: truncation), the next rank decodes and adds its own values in fp32;
* NCCL's native path (comm=auto for fp16 / bf16 on NCCL): each rank's ``g / p`` is cast (round to
  nearest) and NCCL adds the 16-bit values, rounding after every add. On the CPU it runs as
  pipesgd's ``native_allreduce`` (division, cast, decode) over an all_reduce that adds the 16-bit
  payloads in rank order, rounding each add, as NCCL's ring does (its order may differ).

The stated tolerance, elementwise, from first-order rounding analysis: with A_i = mean_r |g_r,i|
and u the unit roundoff (fp16 2^-11, bf16 rounded 2^-8, bf16 truncated 2^-7), each path is
within 2p(u A_i + eta) of the exact average, eta = 2^-25 for fp16 (half its smallest subnormal),
0 for bf16 (fp32's exponent range); the two paths differ by at most the sum of their bounds.
Every convergence result in docs/ was taken on Gloo, so with the ring's numerics (docs/gpu.md)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from distributed_utils import run_workers
from pipesgd.comm import native_allreduce, ring_allreduce
from pipesgd.models.resnet_cifar import resnet20

P = 4
UNIT = {"fp16": (2.0 ** -11, 2.0 ** -11), "bf16": (2.0 ** -7, 2.0 ** -8)}  # (ring, native)
ETA = {"fp16": 2.0 ** -25, "bf16": 0.0}
DTYPE = ("fp16", "bf16")


def _gradient(rank: int) -> torch.Tensor:
    torch.manual_seed(0)
    model = resnet20()
    g = torch.Generator().manual_seed(100 + rank)
    x, y = torch.randn(8, 3, 32, 32, generator=g), torch.randint(0, 10, (8,), generator=g)
    F.cross_entropy(model(x), y).backward()
    return torch.cat([p.grad.reshape(-1) for p in model.parameters()])


def _nccl_sum(tensor: torch.Tensor, group=None, **kwargs) -> None:
    """NCCL's sum of a 16-bit payload, in place: the ranks' values added in rank order, each add
    rounded to the payload's dtype (torch's CPU 16-bit add computes wider and rounds, as NCCL's)."""
    everyone = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
    dist.all_gather(everyone, tensor, group=group)
    total = everyone[0].clone()
    for other in everyone[1:]:
        total += other
    tensor.copy_(total)


def _native(g: torch.Tensor, name: str, p: int, monkeypatch) -> torch.Tensor:
    """pipesgd's native path (its cast, division and decode) over NCCL's arithmetic."""
    out = g.clone()
    with monkeypatch.context() as m:
        m.setattr(dist, "all_reduce", _nccl_sum)
        native_allreduce(out, name)
    return out / p


def _worker(rank, p):
    g = _gradient(rank)
    exact = g.clone()
    dist.all_reduce(exact)
    exact /= p
    scale = g.abs()
    dist.all_reduce(scale)
    scale /= p
    out = {"exact": exact, "scale": scale}
    monkeypatch = pytest.MonkeyPatch()
    for name in DTYPE:
        ring = g.clone()
        ring_allreduce(ring, name)
        out[f"ring {name}"] = ring / p
        out[f"native {name}"] = _native(g, name, p, monkeypatch)
    return out


@pytest.mark.timeout(240)
def test_the_native_16_bit_arithmetic_stays_within_the_stated_bound_of_the_ring_and_the_exact_average():
    results = run_workers(_worker, P)
    r = results[0]
    exact, scale = r["exact"], r["scale"]
    assert scale.max() > 0
    for name in DTYPE:
        (u_ring, u_native), eta = UNIT[name], ETA[name]
        ring, native = r[f"ring {name}"], r[f"native {name}"]
        ring_bound = 2 * P * (u_ring * scale + eta)
        native_bound = 2 * P * (u_native * scale + eta)
        assert ((ring - exact).abs() <= ring_bound).all(), name
        assert ((native - exact).abs() <= native_bound).all(), name
        assert ((native - ring).abs() <= ring_bound + native_bound).all(), name
        # not vacuous: both paths do round, and differently
        assert not torch.equal(native, exact) and not torch.equal(native, ring), name
        for other in results[1:]:  # every rank holds the same average on either path
            assert torch.equal(other[f"ring {name}"], ring) and torch.equal(other[f"native {name}"], native)
