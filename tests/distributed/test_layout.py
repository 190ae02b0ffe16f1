"""The repository's shape. Over every Python file (pipesgd/, pipesgd_lab/, tests/, examples/): no
import cycle (TYPE_CHECKING and function-level imports included), no file over the size cap, and no
import from the library into the lab; inside the library, no import of a higher floor (FLOORS). Over the library: every mode complete (its builder returns an Engine implementing the whole
contract), every staleness rule's config at its constructor's defaults, and timeless comments (no
tracker references). tests/distributed/test_plugins.py proves every plugin of every kind complete."""

from __future__ import annotations

import ast
import inspect
import re
import sys
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

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "pipesgd"
LAB = ROOT / "pipesgd_lab"
MAX_LINES = 600  # a module of the library or the lab
MAX_TEST_LINES = 900  # a test file: many small cases of one subject read better together than split
SKIP_DIRS = {"__pycache__", "build", "dist", "outputs", "multirun"}


def _module_name(path: Path) -> str:
    """The name a file is imported by: dotted from the root for pipesgd/ and pipesgd_lab/; the bare
    file name elsewhere (tests/ is on sys.path (conftest.py), each test folder is put there by
    pytest, and an example is run as a script, its folder on the path)."""
    parts = path.relative_to(ROOT).with_suffix("").parts
    if parts[0] not in ("pipesgd", "pipesgd_lab") and (parts[-1] != "conftest" or len(parts) == 2):
        return parts[-1]  # a tier's own conftest.py is pytest's to load, by its path
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _python_files(root: Path) -> list[Path]:
    """Every Python file under ``root``, but not in hidden folders (.venv, .git) or run outputs."""
    return sorted(p for p in root.rglob("*.py")
                  if not any(part.startswith(".") or part in SKIP_DIRS or part.endswith(".egg-info")
                             for part in p.relative_to(root).parts[:-1]))


FILES = _python_files(ROOT)
MODULES = {_module_name(p): p for p in FILES}


def _is_library(name: str) -> bool:
    return name == "pipesgd" or name.startswith("pipesgd.")


def _is_lab(name: str) -> bool:
    return name == "pipesgd_lab" or name.startswith("pipesgd_lab.")


LIBRARY = {n: p for n, p in MODULES.items() if _is_library(n)}
PACKAGES = {n: p for n, p in MODULES.items() if _is_library(n) or _is_lab(n)}


def test_every_python_file_is_seen_once():
    """Two files imported by one name would hide each other from the checks below."""
    assert len(MODULES) == len(FILES), sorted(n for n in MODULES if sum(_module_name(p) == n for p in FILES) > 1)
    seen = {p.relative_to(ROOT).parts[0] for p in FILES}
    assert {"pipesgd", "pipesgd_lab", "tests", "examples"} <= seen, seen


def _import_sites(name: str, path: Path, modules: dict[str, Path] = MODULES) -> list[tuple[int, str]]:
    """``(line, module)`` for each of the repository's modules ``name`` imports anywhere in its
    source (a ``from X import y`` names module ``X.y`` when that is a module, else ``X``), a
    literal given to ``import_module`` (``importlib.import_module("pipesgd.live.engine")``) included."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{anchor}.{base}" if base else anchor
            found += [(node.lineno, f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base) for a in node.names]
        elif isinstance(node, ast.Call) and _called(node.func) == "import_module":
            found += [(node.lineno, c.value) for arg in node.args for c in ast.walk(arg)
                      if isinstance(c, ast.Constant) and isinstance(c.value, str)]
    # ``from tests.lab.test_x import y``: the test module ``test_x`` (the repository root is on the path too)
    found = [(line, m.rpartition(".")[2] if m.startswith("tests.") else m) for line, m in found]
    return sorted({(line, m) for line, m in found if m in modules and m != name})


def _called(func: ast.expr) -> str | None:
    """The name a call is made by: ``f`` of ``f(...)`` and of ``x.f(...)``."""
    return func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else None


def _imports(name: str, path: Path, modules: dict[str, Path] = MODULES) -> set[str]:
    """The repository's modules ``name`` imports (:func:`_import_sites`)."""
    return {m for _, m in _import_sites(name, path, modules)}


def _graph(modules: dict[str, Path] = MODULES) -> dict[str, set[str]]:
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def _first_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1 = on the current path, 2 = done

    def visit(name: str, path: list[str]) -> list[str] | None:
        state[name] = 1
        for dep in sorted(graph[name]):
            if state.get(dep) == 1:
                return path[path.index(dep):] + [dep]
            if dep not in state and (cycle := visit(dep, path + [dep])):
                return cycle
        state[name] = 2
        return None

    for name in sorted(graph):
        if name not in state and (cycle := visit(name, [name])):
            return cycle
    return None


def _cap(path: Path) -> int:
    return MAX_TEST_LINES if path.relative_to(ROOT).parts[0] == "tests" else MAX_LINES


def _too_long(path: Path) -> str | None:
    lines = path.read_text().count("\n")
    return f"{path.relative_to(ROOT)} has {lines} lines (cap {_cap(path)}); split it by concern" \
        if lines > _cap(path) else None


def _library_into_lab(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    return sorted((n, d) for n, deps in graph.items() if _is_library(n) for d in deps if _is_lab(d))


def test_no_import_cycles_anywhere_in_the_repository():
    """The library, the lab, the tests and their helpers, the examples: TYPE_CHECKING and
    function-level imports included."""
    cycle = _first_cycle(_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_cycle_check_sees_type_checking_imports(tmp_path):
    src = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .modes import Mode\n"
    (tmp_path / "x.py").write_text(src)
    assert _imports("pipesgd.engine.x", tmp_path / "x.py") == set()  # .modes under engine/ does not exist
    assert "pipesgd.modes" in _imports("pipesgd.x", tmp_path / "x.py")


def test_the_cycle_check_finds_a_cycle(tmp_path):
    (tmp_path / "a.py").write_text("import b\n")
    (tmp_path / "b.py").write_text("def f():\n    from a import g\n")
    (tmp_path / "c.py").write_text("import a\n")
    modules = {p.stem: p for p in tmp_path.glob("*.py")}
    assert _first_cycle(_graph(modules)) == ["a", "b", "a"]
    (tmp_path / "b.py").write_text("import c\n")
    assert _first_cycle(_graph(modules)) == ["a", "b", "c", "a"]
    (tmp_path / "c.py").write_text("x = 1\n")
    assert _first_cycle(_graph(modules)) is None


@pytest.mark.parametrize("path", FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_file_is_over_the_size_cap(path):
    problem = _too_long(path)
    assert problem is None, problem


def test_the_size_check_sees_a_long_file(tmp_path, monkeypatch):
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    (tmp_path / "pipesgd").mkdir()
    (tmp_path / "tests").mkdir()
    for folder, cap in (("pipesgd", MAX_LINES), ("tests", MAX_TEST_LINES)):
        (tmp_path / folder / "long.py").write_text("x = 1\n" * (cap + 1))
        assert "split it" in (_too_long(tmp_path / folder / "long.py") or "")
        (tmp_path / folder / "long.py").write_text("x = 1\n" * cap)
        assert _too_long(tmp_path / folder / "long.py") is None


def test_the_library_never_imports_the_lab():
    """The training library stands without the lab (bench, emulate, report, study, the GPU check):
    the lab wraps the library, never the other way, and the wheel ships the library alone."""
    upward = _library_into_lab(_graph())
    assert not upward, f"library modules import the lab: {upward}"
    assert LIBRARY and any(_is_lab(n) for n in MODULES)


# The library's floors, bottom first: a folder of pipesgd/ (or a module beside them) imports only
# the folders of its own floor and the floors below, TYPE_CHECKING, function-level and
# ``import_module("...")`` imports included. docs/architecture.md ("What may import what") draws
# them. The registry is the one way up: ``registry(kind)`` imports a kind's packages by name
# (pipesgd/registry.py's KINDS, the torchft wing's modes among them), as plugin discovery does.
FLOORS = (
    ("flat", "inflight", "outer", "period", "registry", "dist", "teardown", "peers", "placement", "schedule", "objective", "schema",
     "models", "optim"),                      # leaves: they import no other part of the library
    ("modes", "compress", "staleness"),       # the plugin declarations the rest reads
    ("launch", "timing"),                     # how workers come to exist; the cost model on the declared facts
    ("observability",),                       # spans, metrics, progress, the run's facts and summary
    ("comm", "data", "hooks"),                # HOW bytes move; the data; DDP comm hooks
    ("reduction",),                           # WHAT is sent beyond a per-chunk compressor (top-k, PowerSGD)
    ("engine",),                              # WHEN: the engines behind one contract
    ("trainer", "config"),                    # the loop; the config checks
    ("reliability",),                         # the trainer's hooks: checkpoints, replica checks, faults
    ("live",),                                # the torchft wing: its engines and launcher on the core
    ("train", "pipesgd"),                     # the composition root; the package's lazy names
)


def _unit(name: str) -> str:
    """The folder of pipesgd/ a library module is in, or the module beside them it is."""
    return name.split(".")[1] if "." in name else name


def _floor(name: str) -> int:
    """The floor of a library module's folder; one above the top for a folder without one (which
    test_every_library_folder_has_a_floor names), so nothing it imports counts against it."""
    return next((i for i, floor in enumerate(FLOORS) if _unit(name) in floor), len(FLOORS))


def _against_the_floors(name: str, path: Path, modules: dict[str, Path] = MODULES) -> list[str]:
    """Each import of library module ``name`` from a folder on a higher floor, as ``file:line imports module``."""
    return [f"{path.relative_to(ROOT)}:{line} imports {dep} ({_unit(dep)} stands above {_unit(name)})"
            for line, dep in _import_sites(name, path, modules) if _is_library(dep) and _floor(dep) > _floor(name)]


def test_every_library_folder_has_a_floor():
    units = {_unit(n) for n in LIBRARY}
    placed = [u for floor in FLOORS for u in floor]
    assert len(placed) == len(set(placed)), f"a folder on two floors: {placed}"
    assert units <= set(placed), f"give {sorted(units - set(placed))} a floor in FLOORS (and docs/architecture.md)"
    assert set(placed) <= units, f"FLOORS names what the library no longer has: {sorted(set(placed) - units)}"


def test_no_library_folder_imports_a_higher_floor():
    upward = [v for name, path in sorted(LIBRARY.items()) for v in _against_the_floors(name, path)]
    assert not upward, f"{len(upward)} imports against the floors:\n" + "\n".join(upward)


def test_the_floor_check_sees_every_kind_of_upward_import(tmp_path, monkeypatch):
    """A TYPE_CHECKING import, a function-level one and an ``import_module`` string each count; an
    import of a lower floor or the folder's own does not."""
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    (tmp_path / "pipesgd" / "comm").mkdir(parents=True)
    src = ("import importlib\nfrom typing import TYPE_CHECKING\n\nfrom ..flat import views\n"
           "if TYPE_CHECKING:\n    from ..trainer import Trainer\n\n\ndef f():\n    from ..engine import pipe\n"
           "    return importlib.import_module('pipesgd.live.engine')\n")
    (tmp_path / "pipesgd" / "comm" / "x.py").write_text(src)
    found = _against_the_floors("pipesgd.comm.x", tmp_path / "pipesgd" / "comm" / "x.py")
    assert found == ["pipesgd/comm/x.py:6 imports pipesgd.trainer (trainer stands above comm)",
                     "pipesgd/comm/x.py:10 imports pipesgd.engine.pipe (engine stands above comm)",
                     "pipesgd/comm/x.py:11 imports pipesgd.live.engine (live stands above comm)"], found
    (tmp_path / "pipesgd" / "comm" / "x.py").write_text("from ..flat import views\nfrom . import ring\n")
    assert _against_the_floors("pipesgd.comm.x", tmp_path / "pipesgd" / "comm" / "x.py") == []
    (tmp_path / "pipesgd" / "x.py").write_text("def f():\n    from .comm import ring\n")  # from the bottom floor
    assert _against_the_floors("pipesgd.flat", tmp_path / "pipesgd" / "x.py") == \
        ["pipesgd/x.py:2 imports pipesgd.comm.ring (comm stands above flat)"]


# The tests/ folders that use the lab: its own tier, and SLURM on the lab's emulated hosts. `make
# test-lib` runs every other one, so none of those may import the lab or start one of its modules.
LAB_TIERS = ("lab", "slurm")
USES_ALLOWED = {
    "test_layout": "names the lab only to look for it",
    "conftest": "the netns and slurm fixtures import the lab inside, when a lab or SLURM test asks for them",
}
STARTS_A_LAB_MODULE = re.compile(r"""["']-m["'],\s*["']pipesgd_lab|python -m pipesgd_lab|examples/sweep\.sh""")


def _uses_the_lab(name: str, path: Path, graph: dict[str, set[str]]) -> list[str]:
    found = sorted(d for d in graph[name] if _is_lab(d))
    return found + STARTS_A_LAB_MODULE.findall(path.read_text())


def test_the_librarys_tests_never_use_the_lab():
    graph = _graph()
    for name, path in MODULES.items():
        parts = path.relative_to(ROOT).parts
        if parts[0] == "tests" and not (len(parts) > 2 and parts[1] in LAB_TIERS) and name not in USES_ALLOWED:
            assert not _uses_the_lab(name, path, graph), \
                f"{path.relative_to(ROOT)} uses the lab ({_uses_the_lab(name, path, graph)}): it belongs in tests/lab/"


def test_the_lab_use_check_sees_an_import_and_a_started_module(tmp_path):
    (tmp_path / "t.py").write_text("import subprocess, sys\nsubprocess.run([sys.executable, '-m', 'pipesgd_lab.report'])\n")
    assert _uses_the_lab("t", tmp_path / "t.py", {"t": set()})
    (tmp_path / "u.py").write_text("def f():\n    from pipesgd_lab.emulate import Cluster\n")
    assert _uses_the_lab("u", tmp_path / "u.py", {"u": _imports("u", tmp_path / "u.py")})


def test_the_direction_check_sees_an_upward_import(tmp_path):
    (tmp_path / "x.py").write_text("def f():\n    from pipesgd_lab.bench import runner\n")
    graph = {**_graph(), "pipesgd.x": _imports("pipesgd.x", tmp_path / "x.py")}
    assert _library_into_lab(graph) == [("pipesgd.x", "pipesgd_lab.bench.runner")]


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
    if engine.loads_before_first_step:  # a resume's engine: a fresh one takes the state
        engine.close()
        _, engine = build(mode, args)
    engine.load_state_dict(state)
    assert engine.steps == 1 and isinstance(engine.summary(), dict)
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
    """A tracker number means nothing to a reader without the tracker: the library, the lab, the
    tests (their docstrings say what a case guards), the examples, README.md and docs/*.md say what
    and why instead. results/ is exempt: its files are records of runs, kept as they were written."""
    import re

    texts = {name: path for name, path in MODULES.items() if path.relative_to(ROOT).parts[0] != "results"}
    docs = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    texts |= {str(path.relative_to(ROOT)): path for path in docs}
    assert "README.md" in texts and "docs/gpu.md" in texts and "test_layout" in texts, sorted(texts)
    number = re.compile(r"\b[Ii]ssue #?\d+")  # a number after the word, "#" or not; not a count ("issues 2 messages")
    for name, path in texts.items():
        hits = number.findall(path.read_text())
        assert not hits, f"{name} refers to {hits}: say what the code or the text is about instead"


# Where looking an object over by name or type is allowed, and why. Plugins are never looked over
# outside the registry: code reads the facts they declare (pipesgd.registry) instead.
PROBES_ALLOWED = {
    "pipesgd.registry": "the registry itself: reads what a plugin declares",
    "pipesgd.engine.build": "type-checks what a mode's builder built",
    "pipesgd.compress.base": "resolves a compressor spec (a name or an instance)",
    "pipesgd.reduction": "resolves a compressor/reduction spec (a name or an instance)",
    "pipesgd.staleness.base": "resolves a staleness spec (a name or an instance)",
    "pipesgd.models": "unwrap: the one place that looks inside a DDP wrapper",
    "pipesgd.observability.progress": "a logging handler's stream",
    "pipesgd.timing.model": "Link's own fields, validated by name",
    "pipesgd.data.download": "an URLError's reason",
    "pipesgd_lab.emulate.relay": "os.setns exists from Python 3.12",
    "pipesgd_lab.bench.calibrate": "its own dataclass fields, validated by name",
    "pipesgd_lab.bench.tta": "argparse values, validated by name",
    "pipesgd_lab.bench.__main__": "argparse values, validated by name",
    "pipesgd_lab.gpu_check.checks": "a CUDA device property that not every torch build has",
    "pipesgd_lab.gpu_check.models": "a CIFAR ResNet builder by its name",
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
    for name, path in sorted(PACKAGES.items()):
        if name not in PROBES_ALLOWED:
            assert not _probes(path), f"{name} probes objects: {_probes(path)}; read a declared fact instead"
    assert _probes(PACKAGE / "registry.py"), "the check sees the registry's own probes"
    for name in PROBES_ALLOWED:
        assert name in MODULES and _probes(MODULES[name]), f"{name} no longer probes: drop it from PROBES_ALLOWED"


def test_timing_and_bench_do_not_import_each_other():
    """bench/ measures and reads the model; the model never reaches into the benchmark suite."""
    graph = _graph()
    into_bench = [(n, d) for n, deps in graph.items() if n.startswith("pipesgd.timing") for d in deps
                  if d.startswith("pipesgd_lab.bench")]
    assert not into_bench, f"timing/ imports bench/: {into_bench}"


def test_no_library_module_finds_the_repository_by_its_own_path():
    """An installed copy has no clone around it: files come from arguments, the current directory
    or the package's own data (``importlib.resources``), never from ``Path(__file__).parents[...]``.
    (The lab runs from a clone: the GPU check finds it, pipesgd_lab/gpu_check/environment.py.)"""
    import re

    for name, path in LIBRARY.items():
        hits = re.findall(r"__file__\)?(?:\.resolve\(\))?\.(?:parents\[|parent\.parent)", path.read_text())
        assert not hits, f"{name} climbs out of the package from its own path: {hits}"
