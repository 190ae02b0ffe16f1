"""The one-command GPU check (`python -m pipesgd_lab.gpu_check`, `make gpu-check`) on the CPU: its dry run
lists every check within the 8-minute budget, its result parsing turns whatever a check left
behind into one outcome, and a check that overruns its budget is killed with its workers."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pipesgd.launch import has_exited, process_state

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def gpu_check():
    from pipesgd_lab.gpu_check import runner

    return runner


@pytest.mark.timeout(120)
def test_the_dry_run_lists_every_check_and_its_budget_within_eight_minutes(gpu_check):
    r = subprocess.run([sys.executable, "-m", "pipesgd_lab.gpu_check", "--dry-run"], cwd=ROOT, capture_output=True, text=True,
                       timeout=100)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.strip().splitlines()
    names = [c.name for c in gpu_check.CHECKS]
    assert [ln.split()[0] for ln in lines[:-1]] == names
    assert names[0] == "cuda-semantics", "the most decisive check runs first"
    one_gpu = sum(c.budget_s for c in gpu_check.CHECKS if c.gpus == 1)
    assert lines[-1].split()[:2] == ["total", f"{one_gpu:.0f}"] and one_gpu <= gpu_check.TOTAL_BUDGET_S
    assert all(c.budget_s > 0 for c in gpu_check.CHECKS)


def test_an_unknown_check_is_named_with_the_known_ones(gpu_check):
    with pytest.raises(SystemExit, match="--only nope: no such check; the checks are cuda-semantics"):
        gpu_check.selected(["nope"])


@pytest.mark.parametrize("written, returncode, status, summary", [
    ({"status": "pass", "summary": "all good\nsecond line", "details": {"x": 1}}, 0, "pass", "all good"),
    ({"status": "fail", "summary": "failed: stream order"}, 0, "fail", "failed: stream order"),
    ({"status": "skip", "summary": "1 GPU"}, 0, "skip", "1 GPU"),
    ({"status": "pass", "summary": "ok"}, 1, "error", "exit code 1 after reporting pass: Traceback line"),
    ({"status": "green"}, 0, "error", "result has status 'green'"),
    (None, 1, "error", "exit code 1, no result: Traceback line"),
    ("{not json", 0, "error", "malformed result file"),
])
def test_a_checks_result_is_parsed_into_one_outcome(gpu_check, tmp_path, written, returncode, status, summary):
    result = tmp_path / "r.json"
    if written is not None:
        result.write_text(written if isinstance(written, str) else json.dumps(written))
    outcome = gpu_check.parse_result("c", 60, 1.5, returncode, result, "output\nTraceback line\n\n")
    assert outcome.status == status and outcome.summary.startswith(summary), outcome
    assert outcome.line().startswith(f"{status.upper():7s} c ")
    if status == "pass":
        assert outcome.details == {"x": 1}


def test_a_check_killed_at_its_budget_is_a_timeout(gpu_check, tmp_path):
    outcome = gpu_check.parse_result("c", 60, 60.2, None, tmp_path / "none.json", "")
    assert (outcome.status, outcome.summary) == ("timeout", "killed after its budget of 60 s")


@pytest.mark.timeout(60)
def test_a_check_that_overruns_its_budget_is_killed_with_its_workers(gpu_check, tmp_path):
    """The stand-in starts a worker and hangs; both are in the check's process group, so both go."""
    pid_file = tmp_path / "worker.pid"
    hang = ("import subprocess, sys, time; w = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)']); "
            f"open({str(pid_file)!r}, 'w').write(str(w.pid)); print('started', flush=True); time.sleep(600)")
    check = gpu_check.Check("hangs", 3, "a stand-in", lambda out: None)
    log = io.StringIO()
    outcome = gpu_check.run_check(check, tmp_path, log, argv=[sys.executable, "-c", hang])
    assert outcome.status == "timeout" and "budget of 3 s" in outcome.summary
    assert "started" in log.getvalue()
    worker = int(pid_file.read_text())
    # killed by the group's SIGKILL: gone, or a zombie until init reaps it. SIGKILL is delivered at
    # once but a process under load takes a moment to exit: poll, bounded
    deadline = time.monotonic() + 10
    while not has_exited(worker) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert has_exited(worker), f"worker {worker} is in state {process_state(worker)}"


@pytest.mark.timeout(60)
def test_a_check_that_crashes_is_an_error_with_its_last_line(gpu_check, tmp_path):
    check = gpu_check.Check("crashes", 30, "a stand-in", lambda out: None)
    outcome = gpu_check.run_check(check, tmp_path, io.StringIO(),
                                  argv=[sys.executable, "-c", "raise RuntimeError('CUDA error: no kernel image')"])
    assert outcome.status == "error" and "RuntimeError: CUDA error: no kernel image" in outcome.summary


def test_the_step_time_models_have_the_scale_map_presets_parameter_counts(gpu_check):
    """What step-times measures is the preset the map prices: the same parameter count (built on
    the meta device: no memory, no time)."""
    import torch

    from pipesgd_lab.gpu_check.models import PRESETS
    from pipesgd.timing.presets import MODELS

    timed = {preset for *_, preset in PRESETS.values() if preset}
    assert timed == set(MODELS), "every scale-map preset is timed"
    for name, (build, *_, preset) in PRESETS.items():
        if preset:
            with torch.device("meta"):
                model = build()
            assert sum(p.numel() for p in model.parameters()) == MODELS[preset].params, name


def test_every_pipesgd_name_the_checks_import_exists():
    """The checks import inside their functions (no CUDA at import); a rename in the library would
    show only on the GPU, minutes into a lent machine (it did once: ``to_device``). Resolve every
    ``from pipesgd... import name`` and every patched ``module.attribute`` here instead."""
    import ast
    import importlib

    trees = [ast.parse(p.read_text()) for p in (ROOT / "pipesgd_lab" / "gpu_check").glob("*.py")]
    nodes = [node for tree in trees for node in ast.walk(tree)]
    missing, modules = [], {}
    for node in nodes:
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("pipesgd"):
            module = importlib.import_module(node.module)
            missing += [f"{node.module}.{a.name}" for a in node.names if not hasattr(module, a.name)
                        and importlib.util.find_spec(f"{node.module}.{a.name}") is None]
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("pipesgd") and a.asname:
                    modules[a.asname] = importlib.import_module(a.name)
    for node in nodes:  # the old code patched in: exchange.GradientExchange._let_go, pipe.set_grads
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                and node.value.id in modules and not hasattr(modules[node.value.id], node.attr)):
            missing.append(f"{node.value.id}.{node.attr}")
    assert not missing, f"pipesgd_lab/gpu_check/ uses names the library no longer has: {missing}"


@pytest.mark.timeout(120)
def test_the_period_h_check_passes_on_the_cpu(tmp_path):
    """The check's own code, kept working without a GPU (PIPESGD_GPU_CHECK_ON_CPU=1: its numbers
    then prove nothing about CUDA, only that the check compares what it says)."""
    # in a process of its own: the workers' start method may reuse a server process started before
    # this test, whose environment would not have the variable
    code = ("import json, sys; from pathlib import Path; from pipesgd_lab.gpu_check.period_h import period_h_cuda; "
            "print(json.dumps(period_h_cuda(Path(sys.argv[1]))))")
    r = subprocess.run([sys.executable, "-c", code, str(tmp_path)], cwd=ROOT, capture_output=True, text=True,
                       timeout=100, env={**os.environ, "PIPESGD_GPU_CHECK_ON_CPU": "1"})
    assert r.returncode == 0, r.stderr[-3000:]
    status, summary, details = json.loads(r.stdout.strip().splitlines()[-1])
    assert status == "pass", summary
    assert details["eager_rank0_vs_reference_max_abs"] <= 1e-6
