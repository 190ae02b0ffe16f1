"""The package's shape: no import cycles (TYPE_CHECKING and function-level imports included), no
module over 600 lines, every mode complete (its builder returns an Engine implementing the whole
contract), every staleness rule's config at its constructor's defaults, and timeless comments (no
tracker references). tests/distributed/test_plugins.py proves every plugin of every kind complete."""

from __future__ import annotations

import ast
import inspect
import typing
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from distributed_utils import run_workers
from pipesgd.comm import ring_allreduce
from pipesgd.compress import get_compressor
from pipesgd.engine import Engine, ModeArgs
from pipesgd.engine.build import build
from pipesgd.modes import builder, get_mode, modes

PACKAGE = Path(__file__).resolve().parents[2] / "pipesgd"
MAX_LINES = 600


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in PACKAGE.rglob("*.py")}


def _imports(name: str, path: Path) -> set[str]:
    """The pipesgd modules ``name`` imports anywhere in its source (a ``from X import y`` names
    module ``X.y`` when that is a module, else ``X``)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{anchor}.{base}" if base else anchor
            found |= {f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names}
    return {m for m in found if m in MODULES and m != name}


def test_no_import_cycles():
    graph = {name: _imports(name, path) for name, path in MODULES.items()}
    state: dict[str, int] = {}  # 1 = on the current path, 2 = done

    def visit(name: str, path: list[str]) -> None:
        state[name] = 1
        for dep in sorted(graph[name]):
            if state.get(dep) == 1:
                cycle = path[path.index(dep):] + [dep]
                pytest.fail("import cycle: " + " -> ".join(cycle))
            if dep not in state:
                visit(dep, path + [dep])
        state[name] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])


def test_the_cycle_check_sees_type_checking_imports(tmp_path):
    src = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .modes import Mode\n"
    (tmp_path / "x.py").write_text(src)
    assert _imports("pipesgd.engine.x", tmp_path / "x.py") == set()  # .modes under engine/ does not exist
    assert "pipesgd.modes" in _imports("pipesgd.x", tmp_path / "x.py")


@pytest.mark.parametrize("name", sorted(MODULES))
def test_no_module_is_longer_than_600_lines(name):
    lines = MODULES[name].read_text().count("\n")
    assert lines <= MAX_LINES, f"{MODULES[name]} has {lines} lines; split it by concern"


@pytest.mark.parametrize("mode", modes())
def test_every_mode_builds_a_complete_engine(mode):
    build_engine = builder(mode)
    assert callable(build_engine), f"trainer.mode={mode} registered {build_engine!r}, not a builder"
    if get_mode(mode).min_world > 1:  # needs a process group: check the class it declares it builds
        engine_class = typing.get_type_hints(build_engine)["return"].__args__[1]
        assert issubclass(engine_class, Engine) and not inspect.isabstract(engine_class)
        return
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    args = ModeArgs(model, opt, 2, get_compressor("none"), ring_allreduce, None, 1, 0, torch.device("cpu"))
    _, engine = build(mode, args)
    assert isinstance(engine, Engine) and not inspect.isabstract(type(engine))
    assert engine.width == (2 if 2 in get_mode(mode).widths else get_mode(mode).width or 2)  # ddp: the pipelined hook
    model(torch.ones(4, 3)).sum().backward()
    with engine.forward_context(), engine.consistent_weights():
        engine.step()
    engine.flush()
    state = engine.state_dict()
    assert {"width", "steps", "pending"} <= state.keys() and state["steps"] == 1
    engine.load_state_dict(state)
    assert isinstance(engine.summary(), dict)
    engine.close()


def test_every_engine_class_implements_the_contract():
    import pipesgd.engine as engines

    classes = [c for c in vars(engines).values() if inspect.isclass(c) and issubclass(c, Engine) and c is not Engine]
    assert {c.__name__ for c in classes} >= {"PipeSGD", "DirectEngine", "ParameterServerEngine"}
    for c in classes:
        assert not inspect.isabstract(c), f"{c.__name__} leaves {sorted(c.__abstractmethods__)} unimplemented"


def test_every_staleness_rule_has_a_config_naming_it():
    from omegaconf import OmegaConf

    from pipesgd.staleness import available, rule_class

    for name in available():
        path = PACKAGE.parent / "conf" / "staleness" / f"{name}.yaml"
        assert path.exists(), f"staleness rule {name!r} has no conf/staleness/{name}.yaml"
        cfg = OmegaConf.load(path)
        cls = rule_class(name)
        assert cfg._target_ == f"{cls.__module__}.{cls.__qualname__}", f"{path} builds another class"
        defaults = {k: p.default for k, p in inspect.signature(cls).parameters.items()}
        assert {k: v for k, v in cfg.items() if k != "_target_"} == {k: defaults[k] for k in cls.options}, \
            f"{path}: every option of {name!r}, at the constructor's default (the library's make_staleness(name) uses those)"


def test_the_timing_model_does_not_import_hydra():
    """timing/ is arithmetic and its CLI: composing configs belongs to the entry points and bench/."""
    for name, path in MODULES.items():
        if name.startswith("pipesgd.timing"):
            roots = set()
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Import):
                    roots |= {a.name.split(".")[0] for a in node.names}
                elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
                    roots.add(node.module.split(".")[0])
            assert not roots & {"hydra", "omegaconf"}, f"{name} imports {sorted(roots & {'hydra', 'omegaconf'})}"


def test_comments_describe_the_code_not_the_tracker():
    import re

    for name, path in MODULES.items():
        hits = re.findall(r"[Ii]ssue #\d+", path.read_text())
        assert not hits, f"{name} refers to {hits}: say what the code does instead"


# Where looking an object over by name or type is allowed, and why. Plugins are never looked over
# outside the registry: code reads the facts they declare (pipesgd.registry) instead.
PROBES_ALLOWED = {
    "pipesgd.registry": "the registry itself: reads what a plugin declares",
    "pipesgd.engine.build": "type-checks what a mode's builder built",
    "pipesgd.compress.base": "resolves a compressor spec (a name or an instance)",
    "pipesgd.reduction": "resolves a compressor/reduction spec (a name or an instance)",
    "pipesgd.staleness.base": "resolves a staleness spec (a name or an instance)",
    "pipesgd.models": "unwrap: the one place that looks inside a DDP wrapper",
    "pipesgd.progress": "a logging handler's stream",
    "pipesgd.timing.model": "Link's own fields, validated by name",
    "pipesgd.data.download": "an URLError's reason",
    "pipesgd.tools.emulate.relay": "os.setns exists from Python 3.12",
    "pipesgd.tools.bench.calibrate": "its own dataclass fields, validated by name",
    "pipesgd.tools.bench.tta": "argparse values, validated by name",
    "pipesgd.tools.bench.__main__": "argparse values, validated by name",
}
PLUGIN_TYPES = {"Compressor", "NoCompression", "Reduction", "InRing", "TopK", "PowerSGD", "Staleness", "Engine",
                "PipeSGD", "DirectEngine", "ParameterServerEngine", "HierarchicalAllreduce", "Mode", "partial",
                "OrderedHandle", "CompletedHandle", "FutureHandle", "Handle"}


def _probes(path: Path) -> list[str]:
    """``getattr``/``hasattr`` calls, and ``isinstance`` against a plugin type, in ``path``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)):
            continue
        if node.func.id in ("getattr", "hasattr"):
            found.append(f"{node.func.id} at line {node.lineno}")
        elif node.func.id == "isinstance" and len(node.args) == 2:
            names = {n.id if isinstance(n, ast.Name) else n.attr for n in ast.walk(node.args[1])
                     if isinstance(n, (ast.Name, ast.Attribute))}
            if names & PLUGIN_TYPES:
                found.append(f"isinstance(..., {', '.join(sorted(names & PLUGIN_TYPES))}) at line {node.lineno}")
    return found


def test_no_probing_of_plugins_outside_the_registry():
    """No getattr/hasattr, and no isinstance against a plugin type, except where PROBES_ALLOWED says
    why; plugins declare facts instead (docs/adding-a-plugin.md)."""
    for name, path in sorted(MODULES.items()):
        if name not in PROBES_ALLOWED:
            assert not _probes(path), f"{name} probes objects: {_probes(path)}; read a declared fact instead"
    assert _probes(PACKAGE / "registry.py"), "the check sees the registry's own probes"
    for name in PROBES_ALLOWED:
        assert name in MODULES and _probes(MODULES[name]), f"{name} no longer probes: drop it from PROBES_ALLOWED"


def test_timing_and_bench_do_not_import_each_other():
    """bench/ measures and reads the model; the model never reaches into the benchmark suite."""
    graph = {name: _imports(name, path) for name, path in MODULES.items()}
    into_bench = [(n, d) for n, deps in graph.items() if n.startswith("pipesgd.timing") for d in deps
                  if d.startswith("pipesgd.tools.bench")]
    assert not into_bench, f"timing/ imports bench/: {into_bench}"


# The study and emulation tools; everything else in the package is the training library.
TOOLS = ("pipesgd.tools.bench", "pipesgd.tools.emulate", "pipesgd.tools.report", "pipesgd.tools.study")


def _is_tool(name: str) -> bool:
    return any(name == t or name.startswith(f"{t}.") for t in TOOLS)


def test_the_library_imports_no_tool():
    """The training library (engine, comm, reduction, compress, staleness, timing, trainer, data,
    models, checkpoint, reliability, ...) stands without the tools; the tools use the library."""
    graph = {name: _imports(name, path) for name, path in MODULES.items()}
    upward = sorted((n, d) for n, deps in graph.items() if not _is_tool(n) for d in deps if _is_tool(d))
    assert not upward, f"library modules import tools: {upward}"
    assert any(_is_tool(n) for n in MODULES) and any(not _is_tool(n) for n in MODULES)


def test_the_direction_check_sees_an_upward_import(tmp_path):
    (tmp_path / "x.py").write_text("from .tools.bench import runner\n")
    assert any(_is_tool(d) for d in _imports("pipesgd.x", tmp_path / "x.py"))


def test_no_module_finds_the_repository_by_its_own_path():
    """An installed copy has no clone around it: files come from arguments, the current directory
    or the package's own data (``importlib.resources``), never from ``Path(__file__).parents[...]``."""
    import re

    for name, path in MODULES.items():
        hits = re.findall(r"__file__\)?(?:\.resolve\(\))?\.(?:parents\[|parent\.parent)", path.read_text())
        assert not hits, f"{name} climbs out of the package from its own path: {hits}"
