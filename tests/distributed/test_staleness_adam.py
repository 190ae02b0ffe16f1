"""Staleness rules under Adam: each either follows the optimizer's own update or refuses it.

lookahead takes ``optimizer.step()`` itself (test_staleness checks it bit for bit under Adam);
predict extrapolates the last update the optimizer actually applied, and dc corrects the gradient
by the weights' actual change, so both meet Adam's direction, not SGD's ``-lr·g``; dga's local
step is SGD's ``-lr·g`` and refuses any other optimizer, at config time and at bind. Checked on
the closed-form quadratic of test_staleness, one rank (the average is the local gradient).
"""

from collections import deque
from pathlib import Path

import pytest
import torch
from test_staleness import LAMBDA, Quadratic, grad

from pipesgd import PipeSGD
from pipesgd.optim import adamw
from pipesgd.staleness import make_staleness

ROOT = Path(__file__).resolve().parents[2]
ADAM_LR = 0.05


def _adam(params):
    return torch.optim.Adam(params, lr=ADAM_LR, betas=(0.9, 0.99))


def _run(staleness, steps=8, trace=None, **options):
    """Quadratic on rank 0's data through PipeSGD width 2 with Adam; ``trace`` gets (weights held,
    weights the forward saw) per step."""
    model = Quadratic()
    opt = _adam(model.parameters())
    rule = make_staleness(staleness, **options)
    with PipeSGD(opt, model.parameters(), width=2, staleness=rule) as engine:
        for t in range(steps):
            opt.zero_grad()
            held = model.w.detach().clone()
            with engine.forward_context():
                if trace is not None:
                    trace.append((held, model.w.detach().clone()))
                model.loss(0, t).backward()
            engine.step()
        engine.flush()
    return model.w.detach().clone()


def test_predict_extrapolates_adams_own_last_update():
    trace = []
    _run("predict", trace=trace)
    steps_taken = 0
    for (prev, _), (held, seen) in zip(trace, trace[1:]):
        update = held - prev  # what Adam applied between the two forwards (zero during the fill)
        if update.abs().max() == 0:
            assert torch.equal(seen, held)
            continue
        steps_taken += 1
        assert torch.allclose(seen - held, update, rtol=0, atol=1e-12), "w + D·(Adam's last step), D = 1"
        sgd_step = -ADAM_LR * grad(prev, 0, 0)
        assert not torch.allclose(update, sgd_step, atol=1e-3), "Adam's step is not SGD's"
    assert steps_taken >= 5


def test_dc_corrects_the_gradient_adam_then_applies():
    """The reference: Adam fed g + λ·g⊙g⊙(w_now - w_then), w_then the weights g was taken at."""
    w = Quadratic().w.detach().clone().requires_grad_()
    opt = _adam([w])
    pending: deque = deque()

    def apply() -> None:
        g, w_then = pending.popleft()
        w.grad = g + LAMBDA * g * g * (w.detach() - w_then)
        opt.step()

    for t in range(8):
        pending.append((grad(w.detach(), 0, t), w.detach().clone()))
        if len(pending) == 2:
            apply()
    while pending:
        apply()
    got = _run("dc", dc_lambda=LAMBDA)
    assert torch.allclose(got, w.detach(), rtol=0, atol=1e-12)
    assert (got - _run("none")).abs().max() > 1e-4, "the compensation must bite"


@pytest.mark.parametrize("optimizer", [adamw, _adam])
def test_dga_refuses_adam_naming_rule_and_optimizer(optimizer):
    model = Quadratic()
    with pytest.raises(ValueError, match=r"staleness=dga assumes the update of torch.optim.sgd.SGD and "
                                         r"cannot run with optimizer torch.optim.(adam|adamw).(Adam|AdamW);.*"
                                         r"staleness=none\|dc\|lookahead\|predict"):
        PipeSGD(optimizer(model.parameters()), model.parameters(), width=2, staleness="dga")


def test_dga_with_adamw_fails_before_any_worker_starts():
    from hydra import compose, initialize_config_dir

    from pipesgd.config import ConfigError, validate

    with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=["+experiment=gpt_shakespeare", "data.root=.", "staleness=dga"])
        ok = compose("config", overrides=["+experiment=gpt_shakespeare", "data.root=.", "staleness=dc"])
    with pytest.raises(ConfigError, match="staleness=dga .* optimizer torch.optim.adamw.AdamW"):
        validate(cfg)
    validate(ok)
