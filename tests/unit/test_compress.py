"""Compressors: round-trip error within the bound each one documents, exact wire bytes,
shape and dtype restored, empty tensors."""

import math

import pytest
import torch

from pipesgd.compress import Ctx, available, get_compressor

SHAPES = [(0,), (1,), (7, 3), (4097,), (2, 3, 5, 7)]


def sample(shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g) * torch.logspace(-3, 2, steps=max(1, math.prod(shape)))[: math.prod(shape)].reshape(shape)


def bound(name: str, x: torch.Tensor, comp) -> torch.Tensor:
    """Per-value error bound, from each encoder's definition."""
    a = x.abs()
    if name == "none":
        return torch.zeros_like(a)
    if name == "fp16":   # round to nearest: half an ulp = 2**-11 relative, 2**-25 absolute near 0
        return a * 2.0 ** -11 + 2.0 ** -25
    if name == "bf16":   # truncation of 16 mantissa bits: < 1 ulp of an 8-bit significand
        return a * 2.0 ** -7
    if name == "int8":   # |x - q*s| <= s/2 with s = max|block| / 127
        flat = a.reshape(-1)
        bs = comp.block_size or flat.numel()
        out = torch.empty_like(flat)
        for i in range(0, flat.numel(), bs):
            out[i:i + bs] = flat[i:i + bs].max() / 254 * (1 + 1e-6)
        return out.reshape(x.shape)
    raise AssertionError(name)


@pytest.mark.parametrize("name", ["none", "fp16", "bf16", "int8"])
@pytest.mark.parametrize("shape", SHAPES)
def test_round_trip_within_bound(name, shape):
    comp = get_compressor(name)
    x = sample(shape)
    before = x.clone()
    payload, ctx = comp.compress(x)
    y = comp.decompress(payload, ctx)
    assert torch.equal(x, before), "compress must not modify its input"
    assert y.shape == x.shape and y.dtype == x.dtype
    assert torch.all((y - x).abs() <= bound(name, x, comp))
    assert payload.nbytes == comp.wire_bytes(ctx) == comp.payload_like(ctx).nbytes
    assert payload.dim() == 1


def test_wire_bytes_are_the_documented_sizes():
    n = 10_000
    ctx = Ctx((n,), torch.float32, torch.device("cpu"))
    assert get_compressor("none").wire_bytes(ctx) == 4 * n
    assert get_compressor("fp16").wire_bytes(ctx) == 2 * n
    assert get_compressor("bf16").wire_bytes(ctx) == 2 * n
    assert get_compressor("int8").wire_bytes(ctx) == n + 4 * math.ceil(n / 2048)
    assert get_compressor("int8", block_size=0).wire_bytes(ctx) == n + 4


def test_bf16_is_truncation_not_rounding():
    x = torch.tensor([1.0 + 2.0 ** -7 + 2.0 ** -8, -(1.0 + 2.0 ** -7 + 2.0 ** -8), 3.0e38, -0.0])
    comp = get_compressor("bf16")
    y = comp.decompress(*comp.compress(x))
    assert y.tolist()[:2] == [1.0 + 2.0 ** -7, -(1.0 + 2.0 ** -7)]  # round-to-nearest would go up
    assert math.isfinite(y[2].item()) and y[2] <= x[2]                 # no overflow
    assert torch.all(y.abs() <= x.abs())


def test_int8_zero_block_and_extremes():
    comp = get_compressor("int8", block_size=4)
    x = torch.tensor([0.0, 0.0, 0.0, 0.0, 1.0, -1.0, 0.5, 127.0])
    y = comp.decompress(*comp.compress(x))
    assert torch.equal(y[:4], torch.zeros(4))
    assert y[7] == 127.0 and y[4] == 1.0 and y[5] == -1.0


@pytest.mark.parametrize("dtype", [torch.float64, torch.float16, torch.bfloat16])
def test_dtype_restored(dtype):
    for name in available():
        comp = get_compressor(name)
        x = torch.randn(100).to(dtype)
        assert comp.decompress(*comp.compress(x)).dtype == dtype


def test_unknown_and_bad_arguments_name_the_value():
    with pytest.raises(ValueError, match=r"compressor='nope' is not known; allowed: bf16, fp16, int8, none"):
        get_compressor("nope")
    with pytest.raises(ValueError, match=r"block_size must be an integer >= 0, got -1"):
        get_compressor("int8", block_size=-1)
