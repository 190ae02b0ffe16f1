"""Every registered plugin of every kind is complete: its config, the facts its kind declares, a
timing prediction read from those facts, a checkpoint round trip, and (compressors, allreduces) the
sum dist.all_reduce computes on 2 Gloo ranks. A plugin that lacks any of these fails here, not in
a user's run (docs/adding-a-plugin.md)."""

from __future__ import annotations

import copy
import inspect
import math
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from omegaconf import OmegaConf

from distributed_utils import run_workers
from pipesgd.registry import KINDS, registry
from pipesgd.timing import Link, TimingModel, comm_time, step_time
from pipesgd.timing.cost import Phase

ROOT = Path(__file__).resolve().parents[2]
LINK = Link.parse("100mbit", "50us")
PARAMS = 269_722
PLUGINS = [(kind, name) for kind in KINDS for name in registry(kind)]


def _yaml(kind: str, name: str):
    group = KINDS[kind][1]
    path = ROOT / "conf" / group / f"{name}.yaml"
    assert path.exists(), f"{kind} {name!r} has no conf/{group}/{name}.yaml"
    return OmegaConf.load(path)


def _target(cls) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def test_every_kind_has_plugins_and_facts():
    for kind in KINDS:
        assert len(registry(kind)) >= 1, kind
        assert registry(kind).required, f"{kind} declares no facts its plugins must state"


@pytest.mark.parametrize("kind, name", PLUGINS)
def test_every_plugin_has_its_config_and_facts(kind, name):
    reg = registry(kind)
    facts = reg.facts(name)
    assert set(reg.required) <= set(facts), f"{kind} {name!r} lacks {set(reg.required) - set(facts)}"
    plugin = reg.get(name)
    if kind == "mode":  # a mode is a row of pipesgd/modes.py; docs/modes.md's table says what it uses
        text = (ROOT / "docs" / "modes.md").read_text().split("## What each mode uses")[1].split("\n\n**")[0]
        rows = {m.strip() for line in text.splitlines() if line.startswith("| ") for m in line.split("|")[1].split(",")}
        assert name in rows, f"docs/modes.md's table 'What each mode uses' has no row for {name}"
        assert facts["overlap"] in ("pipeline", "backward", "async", "none") and isinstance(facts["server"], bool)
        return
    cfg = _yaml(kind, name)
    if kind == "allreduce":
        assert cfg.name == name, f"conf/comm/{name}.yaml names {cfg.name!r}"
    else:
        assert cfg._target_ == _target(plugin), f"conf/{KINDS[kind][1]}/{name}.yaml builds {cfg._target_}"
    if kind == "compressor":
        comp = plugin()
        assert isinstance(facts["identity"], bool)
        from pipesgd.compress import Ctx

        for numel in (0, 1, 7, 4097):
            ctx = Ctx((numel,), torch.float32, torch.device("meta"))
            assert comp.payload_bytes(numel, 4) == comp.payload_like(ctx).nbytes, (name, numel)
    if kind == "allreduce":
        assert facts["cost"](4e6, 1, 1.0, 1) == ()
        phases = facts["cost"](4e6, 4, 1.0, 2 if facts.get("node_groups") else 1)
        assert phases and all(isinstance(ph, Phase) and ph.steps > 0 for ph in phases)


@pytest.mark.parametrize("kind, name", PLUGINS)
def test_every_plugin_has_a_timing_prediction(kind, name):
    """Read from the declared facts alone: a new plugin without them has no prediction."""
    if kind == "compressor":
        t = step_time("sync", PARAMS, 0.1, LINK, 4, compressor=name)
        base = step_time("sync", PARAMS, 0.1, LINK, 4)
        assert 0.1 < t <= base if not registry(kind).facts(name)["identity"] else t == base
    elif kind == "allreduce":
        per_node = 2 if registry(kind).facts(name).get("node_groups") else 1
        assert 0 < comm_time(name, 4e6, 4, LINK, per_node=per_node) < math.inf
    elif kind == "mode":
        t = step_time(name, PARAMS, 0.1, LINK, 4)
        assert 0.1 <= t < math.inf
    else:  # reductions and staleness rules: a run's prediction uses the ratio it measured
        ms = TimingModel(LINK).iter_ms("pipe", "ring", 4 * PARAMS, 4, 0.1, ratio=4.0, compressor=name)
        assert 100 <= ms < math.inf


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))


def _engine(kind: str, name: str, model):
    from pipesgd import PipeSGD
    from pipesgd.compress import get_compressor
    from pipesgd.reduction import get_reduction

    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    options = {"compressor": get_compressor(name) if kind == "compressor" else
               get_reduction(name) if kind == "reduction" else "none",
               "staleness": name if kind == "staleness" else "none", "width": 2}
    if kind == "allreduce":
        options["allreduce"] = _allreduce(name)
    if kind == "staleness" and registry("staleness").facts(name)["sync_period"] == "round":
        from pipesgd.engine.diloco import PipeDiLoCo  # an outer-step rule: rounds of 2 inner steps

        return PipeDiLoCo(opt, model.parameters(), 2, **options)
    return PipeSGD(opt, model.parameters(), **options)


def _allreduce(name: str):
    reg = registry("allreduce")
    plugin = reg.get(name)
    if not reg.facts(name).get("node_groups"):
        return plugin
    from pipesgd.dist import node_groups

    groups = node_groups(1)
    return plugin(intra=groups.intra, leaders=groups.leaders)


def _steps(engine, model, rank: int, steps: range) -> None:
    for s in steps:
        x = torch.randn(8, 5, generator=torch.Generator().manual_seed(100 * s + rank))
        with engine.forward_context():
            model(x).square().mean().backward()
        engine.step()
        model.zero_grad()


def _round_trip_worker(rank, world):
    """Each plugin inside a width-2 engine: 3 steps, checkpoint, 3 more; against a second engine
    restored from the checkpoint that runs the same 3 steps. Identical weights, or the state lost
    something."""
    out = {}
    for kind in ("compressor", "reduction", "allreduce", "staleness"):
        for name in registry(kind):
            model = _model()
            with _engine(kind, name, model) as engine:
                _steps(engine, model, rank, range(3))
                state = copy.deepcopy((model.state_dict(), engine.optimizer.state_dict(), engine.state_dict()))
                _steps(engine, model, rank, range(3, 6))
                engine.flush()
                expected = [p.detach().clone() for p in model.parameters()]
            model2 = _model()
            with _engine(kind, name, model2) as engine2:
                model2.load_state_dict(state[0])
                engine2.optimizer.load_state_dict(state[1])
                engine2.load_state_dict(state[2])
                _steps(engine2, model2, rank, range(3, 6))
                engine2.flush()
            out[kind, name] = max((a - b).abs().max().item() for a, b in zip(expected, model2.parameters()))
    return out


def _reference_worker(rank, world):
    """Every compressor inside the ring and every allreduce uncompressed, against dist.all_reduce."""
    from pipesgd.comm import ring_allreduce

    out = {}
    for kind in ("compressor", "allreduce"):
        for name in registry(kind):
            x = torch.randn(1001, generator=torch.Generator().manual_seed(rank)) * (rank + 1)
            ref = x.clone()
            dist.all_reduce(ref)
            if kind == "compressor":
                stats = ring_allreduce(x, registry(kind).get(name)(), None)
            else:
                stats = _allreduce(name)(x, None, None)
            out[kind, name] = ((x - ref).abs().max().item() / ref.abs().max().item(), stats.wire_bytes,
                               stats.raw_bytes)
    return out


@pytest.mark.timeout(300)
def test_every_plugin_survives_a_checkpoint_round_trip():
    """Compressors, reductions, allreduces and staleness rules, each inside PipeSGD on 2 Gloo ranks
    (the modes' engines: tests/distributed/test_layout.py and tests/e2e/test_reliability.py)."""
    for rank, diffs in enumerate(run_workers(_round_trip_worker, 2, timeout=240)):
        assert {k for k, _ in diffs} == {"compressor", "reduction", "allreduce", "staleness"}
        for (kind, name), diff in diffs.items():
            assert diff == 0.0, f"rank {rank}: {kind} {name!r} resumes {diff} away from the uninterrupted run"


@pytest.mark.timeout(180)
def test_every_compressor_and_allreduce_sums_like_all_reduce():
    for rank, sums in enumerate(run_workers(_reference_worker, 2)):
        assert {n for k, n in sums if k == "compressor"} == set(registry("compressor"))
        for (kind, name), (rel, wire, raw) in sums.items():
            identity = kind == "allreduce" or registry("compressor").facts(name)["identity"]
            # lossy: a few encodes of at most 2^-7 (bf16) / 1/254 (int8) of the largest value
            assert rel < (1e-6 if identity else 2e-2), f"rank {rank}: {kind} {name!r} is {rel} off dist.all_reduce"
            assert raw > 0 and wire > 0, f"rank {rank}: {kind} {name!r} reports no bytes"


def test_a_plugin_without_its_facts_does_not_register():
    from pipesgd.comm import register as register_allreduce
    from pipesgd.compress import Compressor, register

    with pytest.raises(TypeError, match="compressor 'half_done' does not declare identity, payload_bytes"):
        @register("half_done")
        class HalfDone(Compressor):
            def compress(self, t): ...
            def decompress(self, payload, ctx): ...
            def payload_like(self, ctx): ...
    assert "half_done" not in registry("compressor")
    with pytest.raises(TypeError, match="allreduce 'costless' does not declare cost"):
        register_allreduce("costless")(lambda tensor, compressor=None, group=None: None)
    assert "costless" not in registry("allreduce")
    assert inspect.isclass(registry("compressor").get("none"))
