"""Every plugin kind has one shape: a module that registers itself with the facts others read.
A mode registered from outside pipesgd (here, this test module) is usable as ``trainer.mode``
without editing modes.py; an allreduce that declares ``picks`` is bound like ``comm=auto`` with no
special case; DDP carries what declares a DDP hook; a compressor is checked once, against the mode
and the allreduce it rides, before any worker starts."""

from __future__ import annotations

import math
from collections.abc import Iterator

import pytest
import torch
from fake_dist import FakeDist
from torch import nn

from pipesgd.comm import bind, get_allreduce, native_allreduce, register as register_allreduce, ring_allreduce
from pipesgd.comm import tree_allreduce
from pipesgd.comm.ring import ring_phases
from pipesgd.compress import Compressor, get_compressor
from pipesgd.compress import register as register_compressor
from pipesgd.config import ConfigError, validate
from pipesgd.engine import DirectEngine, ModeArgs, PipeSGD
from pipesgd.engine.build import build
from pipesgd.modes import check_compressor, ddp_carried, get_mode, modes, register
from pipesgd.registry import registry
from pipesgd.timing import Link, step_time
from runs import ROOT


def composed(*overrides: str):
    from hydra import compose, initialize_config_dir

    import pipesgd.schema  # noqa: F401  (registers the structured config)

    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        return compose("config", overrides=["+experiment=mnist_mlp", *overrides])


def _solo_launcher(fn, args, nproc, max_restarts=0):  # a mode's own way of starting workers
    fn(*args)


@pytest.fixture
def solo() -> Iterator[str]:
    """``trainer.mode=solo``, registered here the way an engine module registers its builder."""

    @register("solo", compressors=("none",), overlap="none", replicas_agree=False, launcher=_solo_launcher)
    def build_solo(a: ModeArgs) -> tuple[nn.Module, DirectEngine]:
        return a.model, DirectEngine(a.optimizer, 0, 4, 1, a.nonfinite)

    try:
        yield "solo"
    finally:
        registry("mode").unregister("solo")


def test_a_mode_registered_outside_modes_py_is_a_trainer_mode(solo):
    from pipesgd import launch

    assert solo in modes() and get_mode(solo).overlap == "none"
    validate(composed(f"trainer.mode={solo}"), ["trainer.mode"])  # config reads its facts
    with pytest.raises(ConfigError, match=f"compressor=int8 is not available with trainer.mode={solo}; allowed: none"):
        validate(composed(f"trainer.mode={solo}", "compressor=int8"), ["trainer.mode", "compressor"])
    with pytest.raises(ConfigError, match=f"trainer.width=3 is not used by trainer.mode={solo}"):
        validate(composed(f"trainer.mode={solo}", "trainer.width=3"), ["trainer.mode", "trainer.width"])
    assert launch.for_mode(solo) is _solo_launcher and launch.for_mode("pipe") is launch.run
    model = nn.Linear(3, 2)
    args = ModeArgs(model, torch.optim.SGD(model.parameters(), lr=0.1), 2, get_compressor("none"), ring_allreduce,
                    None, 1, 0, torch.device("cpu"))
    _, engine = build(solo, args)
    assert type(engine) is DirectEngine and engine.width == 1
    t = step_time(solo, 1000, 0.1, Link.parse("1gbit", "10us"), 4)  # priced from what it declared
    assert 0.1 <= t < math.inf


def test_a_mode_with_a_fact_it_cannot_have_does_not_register():
    with pytest.raises(TypeError, match="mode 'odd' declares overlaps, which are not facts of a mode"):
        register("odd", overlaps="pipeline")
    with pytest.raises(ValueError, match="mode 'odd': overlap='sideways' is not known; allowed: pipeline"):
        register("odd", overlap="sideways")
    with pytest.raises(ValueError, match="mode 'odd': check_on_reductions=True needs replicas_agree=True"):
        register("odd", replicas_agree=False, check_on_reductions=True)
    assert "odd" not in modes()


def test_the_allreduces_a_mode_lists_are_registered_and_the_rest_refused():
    listing = [name for name in modes() if get_mode(name).comms is not None]
    assert "live" in listing
    for name in listing:
        mode = get_mode(name)
        assert mode.allreduce, f"trainer.mode={name} lists comms but does not reduce over the configured one"
        assert set(mode.comms) <= set(registry("allreduce")), f"trainer.mode={name} lists an unknown allreduce"
        refused = [a for a in registry("allreduce") if a not in mode.comms]
        for comm in refused:
            with pytest.raises(ConfigError, match=f"comm={comm} is not available with trainer.mode={name}"):
                validate(composed(f"trainer.mode={name}", f"comm={comm}"), ["trainer.mode", "comm"])


def test_unknown_modes_are_named_with_the_registered_ones():
    with pytest.raises(ValueError, match="trainer.mode='fast' is not known; allowed: sync, pipe, ddp"):
        get_mode("fast")


def test_an_allreduce_that_declares_picks_is_bound_to_its_pick(monkeypatch):
    """comm=auto has no special case: any allreduce that declares ``picks`` is bound the same way."""
    register_allreduce("to_tree", cost=ring_phases, picks=lambda compressor, backend: "tree")(
        lambda tensor, compressor=None, group=None: None)
    try:
        none = get_compressor("none")
        assert bind(get_allreduce("to_tree"), none, "gloo") is tree_allreduce
        assert bind(ring_allreduce, none, "nccl") is ring_allreduce
        FakeDist(2, 0, "gloo").install(monkeypatch)
        model = nn.Linear(4, 2)
        with PipeSGD(torch.optim.SGD(model.parameters(), lr=0.1), model.parameters(), width=1,
                     allreduce="to_tree") as engine:
            assert engine._reducer.allreduce is tree_allreduce
    finally:
        registry("allreduce").unregister("to_tree")


@pytest.mark.parametrize("backend, compressor, picked", [
    ("nccl", "none", native_allreduce), ("nccl", "fp16", native_allreduce), ("nccl", "bf16", native_allreduce),
    ("nccl", "int8", ring_allreduce), ("gloo", "fp16", ring_allreduce), ("cpu:gloo,cuda:nccl", "bf16", native_allreduce),
])
def test_auto_is_a_registered_allreduce_that_picks_when_bound(backend, compressor, picked):
    """docs/gpu.md's rule: NCCL's own all_reduce for none/fp16/bf16 on NCCL, the ring elsewhere."""
    assert "auto" in registry("allreduce") and registry("allreduce").facts("auto")["cost"] is ring_phases
    assert bind(get_allreduce("auto"), get_compressor(compressor), backend) is picked


def test_the_run_records_the_allreduce_auto_picked_and_the_digest_keeps_auto():
    """What train.py stores as the run's allreduce: the pick's registered name, not ``auto``."""
    cfg = composed()
    assert cfg.comm.name == "auto"
    assert bind(get_allreduce(cfg.comm.name), get_compressor("none"), "gloo").name == "ring"
    assert bind(get_allreduce(cfg.comm.name), get_compressor("fp16"), "nccl").name == "native"


@pytest.mark.parametrize("comm", ["auto", "native", "ring"])
@pytest.mark.parametrize("compressor", ["topk", "powersgd"])
def test_a_reduction_runs_over_any_allreduce(comm, compressor):
    """A reduction's collectives are its own (dense fp32 sums over the allreduce): what an
    allreduce carries is about per-chunk compressors. comm=native with topk raised AttributeError
    (TopK has no ``identity``) in the launcher instead of validating."""
    validate(composed(f"comm={comm}", f"compressor={compressor}"), ["comm", "compressor"])


def test_the_compressor_check_names_the_option_before_any_worker_starts():
    with pytest.raises(ConfigError, match="compressor='int8' cannot ride the backend's all_reduce"):
        validate(composed("comm=native", "compressor=int8"))
    validate(composed("comm=auto", "compressor=int8"))  # auto picks the ring for it
    with pytest.raises(ValueError, match="compressor=topk is not available with trainer.mode=local"):
        check_compressor("local", registry("reduction").get("topk")(), "auto")


def test_ddp_carries_every_compressor_that_declares_a_ddp_hook():
    """No list of DDP's compressors: a new one with a DDP comm hook is carried, one without is not."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    class Hooked(Compressor):
        identity = True

        def compress(self, t):
            return t, None

        def decompress(self, payload, ctx):
            return payload

        def payload_like(self, ctx):
            return torch.empty(ctx.shape)

        def payload_bytes(self, numel, elem_size=4):
            return numel * elem_size

        def ddp_hook(self):
            return allreduce_hook

    register_compressor("hooked")(Hooked)
    try:
        assert "hooked" in ddp_carried()
        # what engine/ddp.py reports on the wire, read from the declaration (a reduction: fp32)
        wires = {n: registry(k).get(n)().ddp_wire_bytes() for k in ("compressor", "reduction") for n in registry(k)
                 if n in ddp_carried()}
        assert wires == {"none": 4, "bf16": 2, "fp16": 2, "hooked": 4, "powersgd": 4}
        check_compressor("ddp", Hooked(), "auto")
        with pytest.raises(ValueError, match="compressor=int8 is not available with trainer.mode=ddp: it declares no "
                                             r"DDP comm hook \(ddp_hook\(\)\); allowed: none, bf16, fp16, hooked, powersgd"):
            check_compressor("ddp", get_compressor("int8"), "auto")
    finally:
        registry("compressor").unregister("hooked")
