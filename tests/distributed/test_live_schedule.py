"""The live engine's reduction in flight, kept in the engines' one schedule (pipesgd.inflight): a
checkpoint keeps it without voting on it, a load drops the checkpoint's (its quorum no longer
exists), and an engine ended with one never voted in warns, as PipeSGD does. One replica group on
an in-process lighthouse. Skipped without torchft (pip install '.[live]'), except under CI=true."""

from __future__ import annotations

import gc

import pytest
import torch

from needs_torchft import require_torchft

require_torchft()

from pipesgd.engine.base import ModeArgs  # noqa: E402
from pipesgd.live.engine import build  # noqa: E402


def _engine():
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    _, engine = build(ModeArgs(model, optimizer, 2, None, None, None, 1, 0, torch.device("cpu")))

    def step():
        optimizer.zero_grad()
        model(torch.ones(4, 3)).sum().backward()
        return engine.step()

    return model, engine, step


@pytest.mark.timeout(60)
def test_a_checkpoint_keeps_the_reduction_in_flight_unapplied_and_a_load_drops_the_checkpoints():
    model, engine, step = _engine()
    try:
        step()
        before = model.weight.detach().clone()
        state = engine.state_dict()
        assert [len(state["pending"]), len(engine.schedule), state["width"]] == [1, 1, 2]
        assert torch.equal(model.weight.detach(), before), "a checkpoint waits for the reduction, never applies it"
        assert engine.flush().applied and not engine.schedule
        assert torch.allclose(model.weight.detach(), before - 0.1 * 4)  # the kept reduction, voted in by flush
        engine.load_state_dict(state)
        assert not engine.schedule and engine.steps == 1
        assert engine.flush().applied is False  # the checkpoint's reduction was dropped, not restored
    finally:
        engine.close()


@pytest.mark.timeout(60)
def test_an_engine_ended_with_a_reduction_never_voted_in_warns():
    _, engine, step = _engine()
    step()
    engine.close()
    with pytest.warns(RuntimeWarning, match=r"a LiveEngine ended with 1 update\(s\) in flight .*engine\.flush\(\)"):
        del engine, step
        gc.collect()
