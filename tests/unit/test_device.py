"""The NCCL path's placement, proven without a GPU (docs/gpu.md).

Every compressor, reduction, allreduce and engine path runs on ``meta`` tensors against a
recording fake of ``torch.distributed``: every tensor handed to the backend must be on the input's
device (NCCL rejects host tensors), and nothing may read a value on the host (``meta`` raises on
``.item()``, ``.tolist()``, ``.cpu()`` and ``bool()``). On NCCL each hop is one
``batch_isend_irecv``; on Gloo the direct ``irecv``/``isend`` stay. An AST check keeps tensor
factories on the hot path explicit about their device.
"""

from __future__ import annotations

import ast
import inspect
import traceback
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from fake_dist import META, NCCL_DTYPES, FakeDist, FakeGroup
from torch import nn

from pipesgd.comm import native_allreduce, ring_allreduce, tree_allreduce
from pipesgd.comm.hierarchical import HierarchicalAllreduce
from pipesgd.compress import available, get_compressor
from pipesgd.compress.base import REGISTRY as COMPRESSORS
from pipesgd.engine.exchange import GradientExchange
from pipesgd.engine.pipe import PipeSGD
from pipesgd.engine.ps import ParameterServerEngine
from pipesgd.reduction import InRing, PowerSGD, TopK

ROOT = Path(__file__).resolve().parents[2]
SHAPES = [torch.Size([6, 5]), torch.Size([6]), torch.Size([3, 2, 2, 2]), torch.Size([3])]
NUMEL = sum(s.numel() for s in SHAPES)


def on_meta(*shape, dtype=torch.float32) -> torch.Tensor:
    return torch.empty(*shape, dtype=dtype, device=META)


def assert_all_on_meta(fake: FakeDist) -> None:
    tensors = fake.tensors()
    assert tensors, "nothing reached the backend"
    wrong = sorted({str(t.device) for t in tensors if t.device != META})
    assert not wrong, f"tensors handed to the backend on {wrong}, not on the input's device"


def assert_hops(fake: FakeDist, backend: str) -> None:
    """On NCCL no message is posted outside a batch; on Gloo no batch is used."""
    names = set(fake.names())
    if "nccl" in backend:
        assert not names & {"isend", "irecv", "send", "recv"}, names
    else:
        assert "batch_isend_irecv" not in names, names


BACKENDS = ["nccl", "gloo"]


@pytest.mark.parametrize("name", available())
@pytest.mark.parametrize("shape", [(0,), (1,), (7, 3), (4097,)])
def test_compressors_stay_on_the_input_device(name, shape):
    comp = get_compressor(name)
    x = on_meta(*shape)
    payload, ctx = comp.compress(x)
    assert payload.device == META and ctx.device == META
    assert comp.payload_like(ctx).device == META
    assert comp.decompress(payload, ctx).device == META
    assert comp.wire_bytes(ctx) == payload.nbytes


@pytest.mark.parametrize("name", available())
def test_every_payload_has_a_dtype_nccl_has(name):
    """NCCL has no 16-bit integer type (torch's table, tests/fake_dist.py): a bf16 payload that
    crossed as int16 failed the first hop of every compressor=bf16 run on a GPU."""
    comp = get_compressor(name)
    payload, ctx = comp.compress(on_meta(33))
    assert payload.dtype in NCCL_DTYPES and comp.payload_like(ctx).dtype in NCCL_DTYPES


def test_the_nccl_fake_rejects_a_dtype_nccl_has_not(monkeypatch):
    fake = FakeDist(2, 0, "nccl").install(monkeypatch)
    with pytest.raises(TypeError, match="not supported for NCCL process group: torch.int16"):
        dist.isend(on_meta(4, dtype=torch.int16), 1)
    with pytest.raises(TypeError, match="torch.uint16"):
        dist.all_reduce(on_meta(4, dtype=torch.uint16))
    dist.all_reduce(on_meta(4, dtype=torch.bfloat16))
    assert fake.names() == ["all_reduce"]
    FakeDist(2, 0, "cpu:gloo,cuda:nccl").install(monkeypatch).isend(torch.zeros(2, dtype=torch.int16), 1)


@pytest.mark.parametrize("backend", [*BACKENDS, "cpu:gloo,cuda:nccl"])
@pytest.mark.parametrize("compressor", available())
@pytest.mark.parametrize("p", [2, 3, 4])
def test_ring_hands_only_device_tensors_to_the_backend_one_batch_per_hop(monkeypatch, backend, compressor, p):
    fake = FakeDist(p, 1, backend).install(monkeypatch)
    t = on_meta(1001)
    ring_allreduce(t, compressor)
    assert_all_on_meta(fake)
    assert_hops(fake, backend)
    if "nccl" in backend:
        assert fake.names().count("batch_isend_irecv") == 2 * (p - 1)  # one per hop
        assert all(len(ts) == 2 for _, ts in fake.calls)  # its receive and its send


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("compressor", available())
@pytest.mark.parametrize("p", [2, 3, 5])
def test_tree_hands_only_device_tensors_to_the_backend(monkeypatch, backend, compressor, p):
    for rank in range(p):  # the root, inner nodes and leaves take different paths
        fake = FakeDist(p, rank, backend).install(monkeypatch)
        tree_allreduce(on_meta(257), compressor)
        assert_all_on_meta(fake)
        assert_hops(fake, backend)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("compressor", available())
def test_hierarchical_hands_only_device_tensors_to_the_backend(monkeypatch, backend, compressor):
    fake = FakeDist(4, 0, backend).install(monkeypatch)
    HierarchicalAllreduce(intra=FakeGroup(2, 0), leaders=FakeGroup(2, 0))(on_meta(300), compressor)
    assert_all_on_meta(fake)
    assert_hops(fake, backend)


@pytest.mark.parametrize("compressor", ["none", "fp16", "bf16"])
def test_native_hands_only_device_tensors_to_the_backend(monkeypatch, compressor):
    fake = FakeDist(3, 0, "nccl").install(monkeypatch)
    native_allreduce(on_meta(300), compressor)
    assert_all_on_meta(fake)


def reductions() -> list:
    return [InRing(get_compressor("int8")), InRing(get_compressor("fp16", error_feedback=True)),
            TopK(ratio=0.1), TopK(ratio=0.1, error_feedback=False), PowerSGD(rank=2)]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("index", range(len(reductions())))
def test_reductions_keep_state_and_temporaries_on_the_device(monkeypatch, backend, index):
    fake = FakeDist(3, 2, backend).install(monkeypatch)
    red = reductions()[index]
    red.bind(SHAPES, ring_allreduce, META)
    for _ in range(2):  # the second step uses the residual and the warm start
        flat = on_meta(NUMEL)
        red.reduce(flat, None)
        assert flat.device == META
    assert_all_on_meta(fake)
    state = red.state_dict()
    assert all(t.device == META for t in _tensors(state)), state


def _tensors(obj) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in _tensors(v)]
    if isinstance(obj, (list, tuple)):
        return [t for v in obj for t in _tensors(v)]
    return []


def meta_model() -> nn.Module:
    with torch.device(META):
        return nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 3))


def give_grads(model: nn.Module) -> None:
    for p in model.parameters():
        p.grad = torch.empty_like(p)


@pytest.mark.parametrize("compressor", ["none", "int8", "topk", "powersgd"])
@pytest.mark.parametrize("allreduce", ["ring", "tree", "native"])
def test_the_comm_thread_runs_a_reduction_on_the_device_without_a_host_sync(monkeypatch, compressor, allreduce):
    """The whole job the engine submits (flatten, non-finite flag, reduction, average) on meta:
    a host read on the communication thread would raise there and fail the handle."""
    if allreduce == "native" and compressor == "int8":
        pytest.skip("int8 does not ride the backend's all_reduce")
    fake = FakeDist(2, 0, "nccl").install(monkeypatch)
    model = meta_model()
    give_grads(model)
    exchange = GradientExchange(model.parameters(), compressor, {"ring": ring_allreduce, "tree": tree_allreduce,
                                                                   "native": native_allreduce}[allreduce])
    try:
        reduced = exchange.launch().wait()
    finally:
        exchange.close()
    assert reduced.flat.device == META and reduced.flag.device == META
    assert_all_on_meta(fake)


@pytest.mark.parametrize("staleness", ["none", "dc", "lookahead", "predict", "dga"])
def test_launching_steps_never_reads_the_device_and_applying_reads_only_the_flag(monkeypatch, staleness):
    """Steps that only launch (width 3: the first two) run on meta to the end. The first host read
    of a step that applies is the documented one: the reduced non-finite flag."""
    fake = FakeDist(2, 0, "nccl").install(monkeypatch)
    model = meta_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    with PipeSGD(opt, model.parameters(), width=3, compressor="int8", staleness=staleness) as engine:
        for _ in range(2):
            give_grads(model)
            with engine.forward_context():
                pass
            engine.step()
        assert engine.in_flight == 2
        give_grads(model)
        with engine.forward_context():
            pass
        with pytest.raises(RuntimeError, match="meta") as info:
            engine.step()
        engine.schedule.clear()  # meta results cannot be applied; no exit warning
    package = str(Path(inspect.getfile(PipeSGD)).parents[1])  # the package's own frames, not a checkout named pipesgd
    frames = [f.name for f in traceback.extract_tb(info.tb) if f.filename.startswith(package)]
    assert frames[-1] == "nonfinite", frames
    assert_all_on_meta(fake)


@pytest.mark.parametrize("staleness", ["dc", "lookahead", "predict", "dga"])
@pytest.mark.parametrize("compressor", ["powersgd", "topk", "int8"])
def test_resume_puts_restored_state_on_the_parameters_device(monkeypatch, staleness, compressor):
    """A checkpoint is read to the CPU (map_location="cpu"); the engine's in-flight gradients and
    flags, staleness and reduction state come back on the parameters' device."""
    def engine_on(device):
        with torch.device(device):
            model = nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 3))
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        ef = {"compressor": get_compressor("int8", error_feedback=True)} if compressor == "int8" else {}
        return model, PipeSGD(opt, model.parameters(), width=2, compressor=ef.get("compressor", compressor),
                              staleness=staleness)

    FakeDist(2, 0, "gloo").install(monkeypatch)  # the saving run: CPU, real values
    model, cpu = engine_on("cpu")
    for _ in range(3):
        for p in model.parameters():
            p.grad = torch.randn_like(p)
        with cpu.forward_context():
            pass
        cpu.step()
    state = cpu.state_dict()
    cpu.flush()
    cpu.close()
    assert state["pending"] and state["reduction"] and state["staleness"]
    assert all(t.device.type == "cpu" for t in _tensors(state))

    FakeDist(2, 0, "nccl").install(monkeypatch)
    _, engine = engine_on(META)
    engine.load_state_dict(state)
    pending = [h.wait() for _, h in engine.schedule]
    assert all(r.flat.device == META and r.flag.device == META for r in pending)
    # (state_dict() would read the flags on the host, which meta cannot)
    restored = {"pending": [r.flat for r in pending], "staleness": engine.staleness.state_dict(),
                "reduction": engine._reducer.state_dict()}
    engine.schedule.clear()  # meta values cannot be applied
    engine.close()
    assert len(_tensors(restored)) == len(_tensors({k: state[k] for k in restored}))
    wrong = sorted({str(t.device) for t in _tensors(restored) if t.device != META})
    assert not wrong, f"restored state on {wrong}"


def test_the_ddp_powersgd_state_resumes_on_the_parameters_device():
    """DDP's PowerSGD hook state (``trainer.mode=ddp compressor=powersgd``, and each slot of the
    pipelined hook) restored from a CPU checkpoint lands on the parameters' device: torch's hook adds
    the residual to the bucket in place, and a CPU residual failed the first step after a resume on
    a GPU (found by the GPU check, 2026-11-28)."""
    from pipesgd.hooks.powersgd import PowerSGDHookState, powersgd_state

    def params(device):
        return [nn.Parameter(torch.zeros(8, 4, device=device)), nn.Parameter(torch.zeros(3, device=device))]

    saved = PowerSGDHookState(powersgd_state(None, rank=2), params("cpu")).state_dict()
    saved |= {"error_dict": {0: torch.ones(35)}, "p_memory_dict": {0: torch.ones(16)},
              "q_memory_dict": {0: torch.ones(8)}, "layout": {0: [0, 1]}, "parked": {1: {"error": torch.ones(3)}}}
    state = PowerSGDHookState(powersgd_state(None, rank=2), params(META))
    state.load_state_dict(saved)
    s = state.state
    restored = [*s.error_dict.values(), *s.p_memory_dict.values(), *s.q_memory_dict.values(),
                *(t for piece in state._parked.values() for t in piece.values())]
    assert len(restored) == 4
    wrong = sorted({str(t.device) for t in restored if t.device != META})
    assert not wrong, f"restored state on {wrong}"


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("compressor", ["none", "int8", "bf16"])
def test_ps_sync_hands_only_device_tensors_to_the_backend(monkeypatch, backend, compressor):
    for rank in (0, 1):  # the server and a worker
        fake = FakeDist(3, rank, backend).install(monkeypatch)
        model = meta_model()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        engine = ParameterServerEngine(opt, get_compressor(compressor))
        give_grads(model)
        engine.step()
        assert_all_on_meta(fake)
        assert_hops(fake, backend)
        if backend == "nccl":  # worker: pull + push in one batch; server: receives, then replies
            assert fake.names().count("batch_isend_irecv") == (2 if rank == 0 else 1)


def test_ps_async_is_refused_on_nccl(monkeypatch):
    FakeDist(3, 0, "nccl").install(monkeypatch)
    model = meta_model()
    with pytest.raises(ValueError, match="ps_async cannot run on NCCL"):
        ParameterServerEngine(torch.optim.SGD(model.parameters(), lr=0.1), get_compressor("none"), asynchronous=True)


def test_ps_async_is_refused_on_nccl_before_any_worker_starts():
    from hydra import compose, initialize_config_dir

    from pipesgd.config import ConfigError, validate

    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base=None):
        cfg = compose("config", overrides=["trainer.mode=ps_async", "dist.backend=nccl", "dist.nproc=2"])
    with pytest.raises(ConfigError, match="trainer.mode=ps_async cannot run on NCCL.*dist.backend=gloo"):
        validate(cfg)


def test_checkpoint_gathers_every_ranks_state_on_the_cpu(monkeypatch, tmp_path):
    """Rank 0 unpickles what the others send: a CUDA tensor would land on its cuda:k."""
    from pipesgd.reliability.hooks import Reliability

    fake = FakeDist(2, 1, "nccl").install(monkeypatch)
    model = meta_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    # What a GPU engine's state_dict() holds (a meta engine cannot read its flags to produce one).
    engine = SimpleNamespace(shared_state=("pending", "pending_nonfinite"), state_dict=lambda: {
        "width": 2, "steps": 2, "pending": [on_meta(NUMEL)], "pending_nonfinite": [False],
        "staleness": {"w_then": [on_meta(NUMEL)]}, "reduction": {"residual": on_meta(NUMEL), "q": [on_meta(6, 2)]}})
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    hooks = Reliability(model=model, optimizer=opt, scheduler=scheduler, engine=engine,
                        rank=1, world_size=2, device=META, run_dir=tmp_path,
                        config={})
    monkeypatch.setattr("pipesgd.reliability.hooks.state_to_device", _to_cpu_as_if_copied)
    hooks.save(SimpleNamespace(step=2, last_losses=[1.0]), epoch=0, consumed=0)
    (sent,) = [objs[0] for call, objs in fake.calls if call == "gather_object"]
    assert _tensors(sent["engine"]), sent
    wrong = sorted({str(t.device) for t in _tensors(sent) if t.device.type != "cpu"})
    assert not wrong, f"gathered state holds tensors on {wrong}"


def _to_cpu_as_if_copied(state, device):
    """``state_to_device`` for meta tensors, which cannot be copied out: an empty CPU tensor of the same
    shape stands for the copy, so the test sees where the gathered state lives."""
    from pipesgd.flat import state_to_device

    if isinstance(state, torch.Tensor) and state.device == META:
        return torch.empty(state.shape, dtype=state.dtype, device=device)
    if isinstance(state, torch.Tensor):
        return state_to_device(state, device)
    if isinstance(state, dict):
        return {k: _to_cpu_as_if_copied(v, device) for k, v in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(_to_cpu_as_if_copied(v, device) for v in state)
    return state


# --- tensor factories on the hot path say where they allocate -----------------------------------

FACTORIES = {"empty", "zeros", "ones", "full", "tensor", "arange", "randn", "rand", "randint", "linspace",
             "eye", "empty_strided", "as_tensor", "randperm"}
HOT_PATH = [p for d in ("comm", "compress", "reduction", "staleness") for p in sorted((ROOT / "pipesgd" / d).glob("*.py"))]
HOT_PATH += [ROOT / "pipesgd" / f for f in ("engine/exchange.py", "engine/pipe.py", "engine/ps.py", "flat.py", "trainer.py")]


def factory_calls_without_device(source: str) -> list[str]:
    """``torch.<factory>(...)`` calls in ``source`` that pass no ``device=`` (``*_like`` and
    ``t.new_*`` inherit the device and are not factories here)."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in FACTORIES
                and isinstance(node.func.value, ast.Name) and node.func.value.id == "torch"
                and not any(k.arg == "device" for k in node.keywords)):
            out.append(f"line {node.lineno}: torch.{node.func.attr}")
    return out


@pytest.mark.parametrize("path", HOT_PATH, ids=lambda p: str(p.relative_to(ROOT)))
def test_hot_path_tensor_factories_pass_a_device(path):
    missing = factory_calls_without_device(path.read_text())
    assert not missing, f"{path.relative_to(ROOT)}: {missing} allocate on the default device (the CPU)"


@pytest.mark.parametrize("name", available())
def test_every_registered_compressor_passes_a_device(name):
    source = inspect.getsource(inspect.getmodule(COMPRESSORS[name]))
    assert not factory_calls_without_device(source)


def test_the_factory_check_sees_a_missing_device():
    assert factory_calls_without_device("torch.empty(3, dtype=x)\ntorch.zeros(2, device=d)\nt.new_zeros(1)\n") \
        == ["line 1: torch.empty"]


@pytest.mark.parametrize("timeout_s", [300.0, 30.0])
def test_the_engines_deadline_fires_before_the_process_groups_timeout(monkeypatch, timeout_s):
    """NCCL's watchdog counts from a collective's enqueue and kills the process at the groups'
    timeout; the engine counts from when a step starts waiting (K-1 steps later). With the two equal,
    the engine's named ReductionError never appeared on NCCL: its deadline is a share of the groups'."""
    import inspect

    import pipesgd.dist as pdist
    import pipesgd.train as train

    groups = []
    monkeypatch.setattr(pdist, "_job_store", lambda rank, world, timeout: groups.append(("store", timeout)))
    monkeypatch.setattr(dist, "init_process_group", lambda *a, timeout, **k: groups.append(("default", timeout)))
    monkeypatch.setattr(dist, "new_group", lambda *a, timeout, **k: groups.append(("comm", timeout)))
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    ctx = pdist.init("gloo", timeout_s)
    assert [name for name, _ in groups] == ["store", "default", "comm"]
    for _, timeout in groups:
        assert ctx.engine_timeout_s <= 0.8 * timeout.total_seconds()
    assert ctx.engine_timeout_s == pytest.approx(0.8 * timeout_s)
    # the composition root gives the engine this deadline, not the groups' timeout
    assert "timeout_s=ctx.engine_timeout_s" in inspect.getsource(train._build)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("width", [1, 2, 3])
def test_a_hung_reduction_is_waited_for_k_minus_1_steps_after_its_enqueue(monkeypatch, width):
    """Why the engine's deadline is only a share of the groups' timeout (the test above): NCCL's
    watchdog counts a collective's time from its enqueue, the engine from when a step starts
    waiting for it, which is K-1 steps later. The hung reduction of step 3 is launched at step 3,
    the steps after it run without waiting for it, and the error comes at step 3 + K - 1, naming
    both; the steps between spend the groups' timeout beyond the engine's deadline."""
    import threading

    from pipesgd.comm import CommStats
    from pipesgd.engine.base import ReductionError

    FakeDist(2, 0, "gloo").install(monkeypatch)
    hung, launched = threading.Event(), []

    def allreduce(tensor, compressor=None, group=None):
        launched.append(len(launched) + 1)
        if len(launched) == 3:
            hung.wait(30)  # a peer that never answers (let go at the end of the test)
        return CommStats()

    model = nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    engine = PipeSGD(opt, model.parameters(), width=width, allreduce=allreduce, timeout_s=0.2)
    stepped = []
    try:
        with pytest.raises(ReductionError) as raised:
            for t in range(1, 10):
                model(torch.randn(2, 3)).sum().backward()
                engine.step()
                stepped.append(t)
    finally:
        hung.set()
        engine.close()
        engine.schedule.clear()  # abandoned with the failed run: no "never applied" warning
    assert stepped == list(range(1, 3 + width - 1)), "the steps after the enqueue do not wait for it"
    assert f"step 3's gradient (waited for at step {3 + width - 1}) did not finish within 0.2 s" in str(raised.value)


@pytest.mark.parametrize("backend", ["nccl", "gloo", "cpu:gloo,cuda:nccl"])
@pytest.mark.parametrize("compressor", ["none", "fp16", "bf16", "int8", "topk", "powersgd"])
def test_by_default_nccl_reduces_none_fp16_bf16_with_its_own_all_reduce(monkeypatch, backend, compressor):
    """On NCCL the ring is 2(p-1) launches with a decode and an add between hops, where NCCL's own
    all-reduce pipelines within hops over the topology: compressor none|fp16|bf16 take it by
    default (comm=auto), cast to the compressor's dtype; int8, top-k and PowerSGD keep the ring;
    on Gloo the ring stays the default."""
    from pipesgd.comm.auto import default_allreduce
    from pipesgd.reduction import resolve

    fake = FakeDist(2, 0, backend).install(monkeypatch)
    model = nn.Linear(64, 32)  # PowerSGD compresses it
    engine = PipeSGD(torch.optim.SGD(model.parameters(), lr=0.1), model.parameters(), width=1, compressor=compressor)
    fake.calls.clear()  # the construction's broadcast of rank 0's weights
    model(torch.randn(3, 64)).sum().backward()
    engine.step()
    engine.close()
    native = "nccl" in backend and compressor in ("none", "fp16", "bf16")
    assert default_allreduce(resolve(compressor), backend) == ("native" if native else "ring")
    names = set(fake.names())
    if native:
        assert names == {"all_reduce"}
        wire = {t.dtype for _, ts in fake.calls for t in ts if t.numel() > 1}
        assert wire == {{"none": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[compressor]}
    elif compressor in ("none", "fp16", "bf16", "int8"):  # the ring's hops
        assert names == ({"batch_isend_irecv"} if "nccl" in backend else {"isend", "irecv"}), names


def test_the_configs_default_comm_is_auto():
    from hydra import compose, initialize_config_dir

    import pipesgd.schema  # noqa: F401  (registers the structured config)

    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base=None):
        for overrides in ([], ["+experiment=mnist_mlp"], ["+experiment=resnet_cifar"]):
            assert compose("config", overrides=overrides).comm.name == "auto", overrides
