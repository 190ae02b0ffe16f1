"""Persistent flat buffers (docs/gpu.md): the engine flattens each step's gradient into one of its
own buffers and reuses a buffer once its update is applied and no ``.grad`` points into it (or
launches it as it is when the gradients are that buffer), so a width-K pipeline cycles through K
buffers instead of allocating one per step, and the numbers are those of fresh buffers."""

from __future__ import annotations

import pytest
import torch
from fake_dist import FakeDist
from torch import nn

from pipesgd.engine.pipe import PipeSGD

STEPS = 12


def _run(monkeypatch, width: int, set_to_none: bool, reuse: bool, staleness: str = "none", world: int = 1):
    if world > 1:
        FakeDist(world, 0, "gloo").install(monkeypatch)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    seen = []
    with PipeSGD(opt, model.parameters(), width=width, staleness=staleness) as engine:
        exchange = engine._reducer
        if not reuse:  # the old behaviour: a fresh buffer every step
            monkeypatch.setattr(exchange, "release", lambda flat: None)
        flatten = exchange.flatten

        def recorded():
            buf = flatten()
            seen.append(buf.untyped_storage().data_ptr())
            return buf

        monkeypatch.setattr(exchange, "flatten", recorded)
        data = torch.Generator().manual_seed(1)
        for _ in range(STEPS):
            opt.zero_grad(set_to_none=set_to_none)
            with engine.forward_context():
                model(torch.randn(5, 4, generator=data)).square().sum().backward()
            engine.step()
        engine.flush()
    return [p.detach().clone() for p in model.parameters()], seen


@pytest.mark.parametrize("width", [1, 2, 3])
@pytest.mark.parametrize("set_to_none", [True, False])
@pytest.mark.parametrize("staleness", ["none", "lookahead", "dga"])
def test_a_pipeline_cycles_through_its_width_in_buffers_with_the_numbers_of_fresh_ones(
        monkeypatch, width, set_to_none, staleness):
    fresh, _ = _run(monkeypatch, width, set_to_none, reuse=False, staleness=staleness)
    reused, seen = _run(monkeypatch, width, set_to_none, reuse=True, staleness=staleness)
    for a, b in zip(fresh, reused):
        assert torch.equal(a, b)
    assert len(set(seen)) == width, seen


@pytest.mark.parametrize("width", [1, 2])
def test_gradients_zeroed_in_place_are_the_buffer_and_are_not_copied(monkeypatch, width):
    """zero_grad(set_to_none=False) leaves the gradients views of the last applied average;
    backward accumulates into them there and the step launches that buffer as it is."""
    cats = []
    cat = torch.cat

    def counted(tensors, *args, **kwargs):
        if "out" in kwargs:
            cats.append(len(tensors))
        return cat(tensors, *args, **kwargs)

    monkeypatch.setattr(torch, "cat", counted)
    _run(monkeypatch, width, set_to_none=False, reuse=True)
    assert len(cats) == width  # the steps before the first update was applied; none after
    cats.clear()
    _run(monkeypatch, width, set_to_none=True, reuse=True)
    assert len(cats) == STEPS  # fresh gradients are copied every step


def _one_update(between=lambda model: None, x: float = 1.0):
    """A width-1 engine after one applied update; ``between`` runs before the second backward.
    Returns (flattened second gradient, storage the gradients viewed after the update, model)."""
    model = nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with PipeSGD(opt, model.parameters(), width=1) as engine:
        model(torch.ones(1, 3)).sum().backward()
        engine.step()
        applied = model.weight.grad.untyped_storage().data_ptr()
        between(model)
        model(x * torch.ones(1, 3)).sum().backward()
        return engine._reducer.flatten(), applied, model


def test_without_zero_grad_the_gradients_accumulate_in_the_buffer_as_plain_torch():
    """Without zero_grad the gradients are views of the last applied average and backward
    accumulates into them: that buffer is launched as it is, holding what plain torch's .grad
    would (the applied gradient, all ones, plus the new one)."""
    buf, applied, _ = _one_update(x=2.0)
    assert buf.untyped_storage().data_ptr() == applied
    second = torch.cat([torch.full((2, 3), 2.0).reshape(-1), torch.ones(2)])
    torch.testing.assert_close(buf[:-1], torch.ones(8) + second, rtol=0, atol=0)
    assert buf[-1] == 0


def test_a_buffer_a_gradient_points_into_is_never_flattened_into():
    """Gradients that only partly view a released buffer (here a bias set to None by hand) are
    copied into another buffer: flattening into the one they view would read what it writes."""
    def drop_bias_grad(model):
        model.bias.grad = None

    buf, applied, model = _one_update(drop_bias_grad)
    assert buf.untyped_storage().data_ptr() != applied
    torch.testing.assert_close(buf[:-1], torch.cat([p.grad.reshape(-1) for p in model.parameters()]))


def test_two_ranks_reuse_buffers_through_the_communication_thread(monkeypatch):
    reused, seen = _run(monkeypatch, 2, True, reuse=True, world=2)
    assert len(set(seen)) == 2
    assert all(torch.isfinite(p).all() for p in reused)
