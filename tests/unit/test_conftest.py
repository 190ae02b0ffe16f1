"""The test suite's own scheduling rule (tests/conftest.py): under pytest-xdist, every test that
builds network namespaces or counts them runs in the one unit of work of NAMESPACE_MODULES."""

import ast
from pathlib import Path

from conftest import NAMESPACE_MODULES, namespace_scope

TESTS = Path(__file__).resolve().parents[1]
NAMESPACE_FIXTURES = {"netns", "slurm"}
NAMESPACE_CALLS = {"Cluster", "SlurmCluster", "list_namespaces"}  # building a cluster, counting namespaces


def _uses_namespaces(tree: ast.Module) -> bool:
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef) and node.name.startswith("test_"):
            if NAMESPACE_FIXTURES & {a.arg for a in node.args.args}:
                return True
        if isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", None)) in NAMESPACE_CALLS:
            return True
    return False


def test_every_module_that_builds_or_counts_namespaces_is_scheduled_with_the_others():
    users = {p.name for p in TESTS.rglob("test_*.py") if _uses_namespaces(ast.parse(p.read_text()))}
    # tests/lab/test_emulate_options.py constructs Cluster only with arguments it refuses (no namespace is made)
    assert users - {"test_emulate_options.py"} <= NAMESPACE_MODULES, users - NAMESPACE_MODULES
    assert NAMESPACE_MODULES <= users, "a module listed that no longer builds namespaces"


def test_the_scope_is_by_module():
    assert namespace_scope("tests/slurm/test_sweep.py::test_sweep_runs_as_slurm_jobs_and_reports") == "namespaces"
    assert namespace_scope("tests/lab/test_elastic.py::test_x[4-60]") == "namespaces"
    assert namespace_scope("tests/e2e/test_train.py::test_experiment_runs_two_steps[mnist_mlp]") is None
