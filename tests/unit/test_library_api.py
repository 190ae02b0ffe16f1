"""The library entry (``from pipesgd import PipeSGD``) refuses what would go silently wrong in a
ported DDP script."""

import gc
import os
import subprocess
import sys
import warnings

import pytest
import torch
from torch import nn

from pipesgd import NonFiniteGradient, PipeSGD


def _engine():
    model = nn.Linear(4, 2)
    return PipeSGD(torch.optim.SGD(model.parameters(), lr=0.1), model.parameters(), width=2)


def test_world_size_without_a_process_group_is_an_error(monkeypatch):
    """torchrun sets WORLD_SIZE; forgetting init_process_group must not train p lone replicas."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(RuntimeError, match=r"WORLD_SIZE=2 in the environment .* no torch.distributed process "
                                           r"group: call torch.distributed.init_process_group"):
        _engine()


@pytest.mark.parametrize("world", [None, "1"])
def test_a_lone_process_needs_no_process_group(monkeypatch, world):
    if world is None:
        monkeypatch.delenv("WORLD_SIZE", raising=False)
    else:
        monkeypatch.setenv("WORLD_SIZE", world)
    engine = _engine()
    assert engine.in_flight == 0
    engine.close()


def _lone(staleness="none"):
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    engine = PipeSGD(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), model.parameters(), width=2,
                     staleness=staleness)
    return model, engine


def _backward(model):
    model.zero_grad()
    model(torch.ones(3, 4)).sum().backward()


@pytest.mark.parametrize("rule", ["lookahead", "predict"])
def test_a_rule_that_needs_forward_context_warns_once_without_it(monkeypatch, rule):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    model, engine = _lone(rule)
    with pytest.warns(RuntimeWarning, match=rf"staleness='{rule}' acts only inside `with engine.forward_context\(\):`"):
        for _ in range(3):
            _backward(model)
            engine.step()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _backward(model)
        engine.step()  # once is enough
        engine.flush()
    engine.close()


def test_forward_context_used_as_documented_gives_no_warning(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    model, engine = _lone("lookahead")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(3):
            with engine.forward_context():
                _backward(model)
            engine.step()
        engine.flush()
        engine.close()
        del engine
        gc.collect()


SCRIPT = """
import torch
from torch import nn
from pipesgd import NonFiniteGradient, PipeSGD
model = nn.Linear(4, 2)
engine = PipeSGD(torch.optim.SGD(model.parameters(), lr=0.1), model.parameters(), width=3)
for _ in range(4):
    model.zero_grad(); model(torch.ones(3, 4)).sum().backward(); engine.step()
{end}
"""


@pytest.mark.timeout(60)
@pytest.mark.parametrize("end,warned", [("", True), ("engine.flush()", False), ("engine.state_dict()", True),
                                       ("engine.state_dict(); engine.flush()", False)])
def test_exiting_with_updates_in_flight_warns(end, warned):
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK")}
    r = subprocess.run([sys.executable, "-c", SCRIPT.format(end=end)], capture_output=True, text=True, env=env,
                       timeout=50)
    assert r.returncode == 0, r.stderr[-2000:]
    message = "a PipeSGD engine ended with 2 update(s) in flight that were never applied: call engine.flush()"
    assert (message in r.stderr) == warned, r.stderr[-2000:]


def test_calling_the_owned_optimizers_step_directly_raises(monkeypatch):
    """GradScaler.step(optimizer) and a leftover optimizer.step() would bypass the average."""
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    model, engine = _lone()
    _backward(model)
    with pytest.raises(RuntimeError, match=r"optimizer.step\(\) was called directly on an optimizer a PipeSGD engine "
                                           r"owns.*call engine.step\(\) instead"):
        engine.optimizer.step()
    scaler = torch.amp.GradScaler("cpu")
    model.zero_grad()
    scaler.scale(model(torch.ones(3, 4)).sum()).backward()
    with pytest.raises(RuntimeError, match="called directly"):
        scaler.step(engine.optimizer)
    engine.step()
    engine.flush()
    engine.close()
    engine.optimizer.step()  # released by close()


def _train(scaled: bool) -> torch.Tensor:
    model, engine = _lone("lookahead")
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
    for t in range(6):
        with engine.forward_context():
            model.zero_grad()
            loss = model(torch.full((3, 4), 0.1 * t)).square().mean()
            (scaler.scale(loss) if scaled else loss).backward()
        if scaled:
            scaler.unscale_(engine.optimizer)
        engine.step()
        if scaled:
            scaler.update()
    engine.flush()
    engine.close()
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def test_the_documented_grad_scaler_recipe_trains_as_without_it(monkeypatch):
    """scale -> backward -> unscale_ -> engine.step() -> update: a power-of-two scale is exact."""
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    plain = _train(scaled=False)
    assert torch.equal(_train(scaled=True), plain)
    assert not torch.equal(plain, _train_untrained()), "training must move the weights"


def _train_untrained() -> torch.Tensor:
    torch.manual_seed(0)
    return torch.cat([p.detach().reshape(-1) for p in nn.Linear(4, 2).parameters()])


@pytest.mark.parametrize("nonfinite", ["skip", "abort"])
def test_grad_scaler_overflows_are_skipped_steps_with_nonfinite_skip(monkeypatch, nonfinite):
    """GradScaler's first steps overflow by design (it searches for the scale from above); with
    nonfinite="skip" every rank drops those steps alike and training goes on, with "abort" the
    engine stops at the first one, as documented."""
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    start = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    engine = PipeSGD(torch.optim.SGD(model.parameters(), lr=0.1), model.parameters(), width=2, nonfinite=nonfinite)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 127)  # overflows for the first steps
    skipped = 0
    try:
        for t in range(12):
            model.zero_grad()
            scaler.scale(model(torch.full((3, 4), 1.0 + t)).square().mean()).backward()
            scaler.unscale_(engine.optimizer)
            skipped += engine.step().skipped
            scaler.update()
        engine.flush()
    except NonFiniteGradient:
        assert nonfinite == "abort"
        return
    finally:
        engine.close()
    assert nonfinite == "skip" and skipped >= 1 and scaler.get_scale() < 2.0 ** 127
    final = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    assert torch.isfinite(final).all() and not torch.equal(final, start)


def test_a_scheduler_stepped_on_applied_updates_gives_each_update_its_own_rate(monkeypatch):
    """``if engine.step().applied: scheduler.step()``: the k-th update applied runs at the k-th rate,
    the pipeline's fill steps included, and torch's "scheduler before optimizer" warning never fires."""
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    model, engine = _lone()
    scheduler = torch.optim.lr_scheduler.LambdaLR(engine.optimizer, lambda k: 1.0 / (1 + k))
    used = []
    engine.optimizer.register_step_pre_hook(lambda opt, args, kwargs: used.append(opt.param_groups[0]["lr"]))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(6):
            _backward(model)
            if engine.step().applied:
                scheduler.step()
        engine.flush()
    engine.close()
    assert used == pytest.approx([0.1 / (1 + k) for k in range(6)])


@pytest.mark.timeout(60)
def test_the_mode_declarations_import_without_torch():
    """pipesgd.modes is the registry and its fact type, with no torch at import (its facts are
    registered by the engine modules, which need torch, like every other kind's)."""
    import subprocess
    import sys

    code = ("import sys\n"
            "class Block:\n"
            "    def find_spec(self, name, path=None, target=None):\n"
            "        if name == 'torch' or name.startswith('torch.'):\n"
            "            raise ImportError('torch is blocked')\n"
            "sys.meta_path.insert(0, Block())\n"
            "import pipesgd.modes\n"
            "pipesgd.modes.register('solo', width=None, server=True)(print)\n"
            "print(pipesgd.modes.REGISTRY.facts('solo')['server'], pipesgd.modes.Mode(width=None).runs_at(4))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=50)
    assert out.returncode == 0 and out.stdout.strip() == "True 4", out.stderr


def test_work_left_in_flight_is_quiesced_after_the_warning_and_a_failing_quiesce_is_silent():
    """An owner collected with work in flight warns, then lets each entry's work finish
    (``quiesce``), so that no backend thread still runs its callbacks when the interpreter
    finalizes (the abort at exit after a hook's last step); a quiesce that raises says nothing more."""
    import gc
    import warnings

    from pipesgd.inflight import InFlight

    seen = []

    def quiesce(work):
        seen.append(work)
        if work == "b":
            raise RuntimeError("gone")

    schedule = InFlight(3, owner="an owner", remedy="flush it", quiesce=quiesce)
    schedule.launch("a", at=1)
    schedule.launch("b", at=2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        del schedule
        gc.collect()
    assert seen == ["a", "b"]
    mine = [str(w.message) for w in caught if str(w.message).startswith("an owner")]  # not an earlier test's engine
    assert mine == ["an owner ended with 2 update(s) in flight that were never applied: flush it"]


def test_a_hooks_unapplied_round_is_given_a_bounded_time_to_complete():
    """The pipelined hook's rounds are polled, not waited for: a reduction that never completes
    (a peer gone) holds the exit no longer than the bound."""
    import time

    from pipesgd.hooks.pipelined import _Round

    done, never = torch.futures.Future(), torch.futures.Future()
    done.set_result(torch.zeros(4))
    round_ = _Round()
    round_.where = {1: (done, 0, 2), 2: (done, 2, 2), 3: (never, 0, 4)}
    start = time.monotonic()
    round_.quiesce(within_s=0.2)
    assert 0.2 <= time.monotonic() - start < 5
    assert not never.done()
