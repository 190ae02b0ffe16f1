"""Reliability end to end (docs/reliability.md): a worker SIGKILLed midway under the local launcher
and under torchrun finishes bit-identical to an uninterrupted run; a corrupt newest checkpoint
falls back to the previous one; a SIGSTOPped peer fails the job within dist.timeout_s naming it,
with no process left; a NaN on one rank is skipped by all; a perturbed replica is named; a taken
MASTER_PORT is explained; bad config is rejected by the schema with Hydra's message.

Faults are injected with PIPESGD_FAULT (pipesgd/reliability/faults.py) at a chosen step, never by timing.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from conftest import SHARED_DATA
from runs import CACHE, ROOT, needs_mnist, run, summary, tagged_processes

# 30 steps per epoch (60000 / 2 ranks / 1000), so 40 steps cross an epoch boundary (eval + an
# epoch-end checkpoint at 30); checkpoints at 8, 16, 24, 30, 32, 40 (the newest 2 kept); evaluations
# at 12, 24, 30 (epoch end), 36 and 40 (the end).
MNIST = ["+experiment=mnist_mlp", "trainer.max_steps=40", "data.batch_size=1000", "optimizer.lr=0.05",
         "trainer.lr_reference_batch=null", "trainer.checkpoint_every=8", "trainer.check_every=4",
         "trainer.log_every=10", "dist.threads_per_worker=1", "trainer.eval_every_steps=12"]
EVAL_STEPS = [12, 24, 30, 36, 40]


def curve(s: dict) -> list[tuple]:
    """The accuracy curve of a run: what must not depend on an interruption."""
    return [(e["step"], e["epoch"], e["test_accuracy"], e["test_loss"]) for e in s["evals"]]
KILL_STEP, RESUME_STEP = 35, 32


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> tuple[Path, dict]:
    """The uninterrupted run: its run dir and summary."""
    if not (SHARED_DATA / "mnist").is_dir():
        pytest.skip(f"offline datasets not found at {SHARED_DATA}")
    tmp = tmp_path_factory.mktemp("reference")
    r = run(*MNIST, f"hydra.run.dir={tmp / 'run'}", tmp=tmp)
    assert r.returncode == 0, r.stderr[-3000:]
    s = summary(tmp / "run")
    assert s["steps"] == 40 and s["resumed_from_step"] is None and re.fullmatch(r"[0-9a-f]{64}", s["param_checksum"])
    assert s["test_accuracy"] > 0.5, "the run must really train, or equality proves little"
    assert [e["step"] for e in s["evals"]] == EVAL_STEPS, "in-epoch evaluations every 12 steps, plus epoch ends"
    assert s["evals"][0]["epoch"] == pytest.approx(12 / 30) and all(e["eval_s"] > 0 for e in s["evals"])
    return tmp / "run", s


@needs_mnist
@pytest.mark.timeout(600)
@pytest.mark.parametrize("launcher", ["local", "torchrun"])
def test_killed_worker_restarts_and_finishes_bit_identical(launcher, reference, tmp_path):
    run_dir = tmp_path / "run"
    if launcher == "local":
        r = run(*MNIST, "dist.max_restarts=2", f"hydra.run.dir={run_dir}", tmp=tmp_path,
                fault=f"kill:1:{KILL_STEP}")
    else:
        r = run(*MNIST, f"hydra.run.dir={run_dir}", tmp=tmp_path, fault=f"kill:1:{KILL_STEP}",
                prefix=("-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "--max-restarts=2",
                        "-m", "pipesgd.train"))
    assert r.returncode == 0, r.stderr[-4000:]
    assert f"does 'kill' at step {KILL_STEP}" in r.stderr, "the fault must have fired"
    assert f"resuming from {run_dir / 'checkpoints' / f'step-{RESUME_STEP:08d}.pt'}" in r.stderr
    s = summary(run_dir)
    assert s["resumed_from_step"] == RESUME_STEP and s["steps"] == 40
    assert s["param_checksum"] == reference[1]["param_checksum"], "final weights must be bit-identical"
    assert s["test_accuracy"] == reference[1]["test_accuracy"]
    assert curve(s) == curve(reference[1]), "the evaluations before the checkpoint come back with it"
    assert not tagged_processes(r.tag)


@needs_mnist
@pytest.mark.timeout(400)
def test_corrupt_newest_checkpoint_is_reported_and_the_previous_used(reference, tmp_path):
    run_dir = tmp_path / "run"
    shutil.copytree(reference[0], run_dir)
    newest = run_dir / "checkpoints" / "step-00000040.pt"
    data = bytearray(newest.read_bytes())
    data[len(data) // 2] ^= 0xFF
    newest.write_bytes(bytes(data))
    r = run(*MNIST, f"hydra.run.dir={run_dir}", tmp=tmp_path)  # trainer.resume=auto is the default
    assert r.returncode == 0, r.stderr[-3000:]
    assert re.search(r"checkpoint .*step-00000040\.pt is corrupt: sha256 [0-9a-f]+ does not match", r.stderr)
    assert f"resuming from {run_dir / 'checkpoints' / 'step-00000032.pt'}" in r.stderr
    s = summary(run_dir)
    assert s["resumed_from_step"] == 32 and s["param_checksum"] == reference[1]["param_checksum"]


@needs_mnist
@pytest.mark.timeout(500)
def test_a_format_1_checkpoint_is_refused_naming_the_command_and_once_converted_resumes_bit_identical(
        reference, tmp_path):
    """A checkpoint written while ``trainer.staleness`` was an alias (its config digest over that form,
    tests/old_checkpoints.py): resume stops naming the command; converted in place, it resumes as
    the removed shim resumed it, to the uninterrupted run's weights."""
    from old_checkpoints import as_format_1
    from pipesgd.reliability.checkpoint import CheckpointDir

    run_dir = tmp_path / "run"
    shutil.copytree(reference[0], run_dir)
    ckpts = CheckpointDir(run_dir / "checkpoints")
    for p in (ckpts.path(40), ckpts.path(40).with_name("step-00000040.pt.sha256")):
        p.unlink()
    ckpts.save(as_format_1(CheckpointDir.load(ckpts.path(32))), 32)
    r = run(*MNIST, f"hydra.run.dir={run_dir}", tmp=tmp_path)
    assert r.returncode != 0 and f"convert it with: python -m pipesgd.reliability.checkpoint convert {ckpts.path(32)}" in r.stderr, \
        r.stderr[-3000:]
    c = subprocess.run([sys.executable, "-m", "pipesgd.reliability.checkpoint", "convert", str(ckpts.path(32))], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert c.returncode == 0, c.stderr
    r = run(*MNIST, f"hydra.run.dir={run_dir}", tmp=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"resuming from {ckpts.path(32)}" in r.stderr
    s = summary(run_dir)
    assert s["resumed_from_step"] == 32 and s["param_checksum"] == reference[1]["param_checksum"]
    assert curve(s) == curve(reference[1])


@needs_mnist
@pytest.mark.timeout(300)
def test_stopped_peer_fails_the_job_naming_it_and_leaves_no_process(tmp_path):
    """Rank 1 SIGSTOPs itself in step 5; rank 0 gives up after dist.timeout_s and names it."""
    r = run(*MNIST, "dist.timeout_s=10", f"hydra.run.dir={tmp_path / 'run'}", tmp=tmp_path, fault="stop:1:5")
    assert r.returncode == 1, r.stderr[-3000:]
    errors = [line for line in r.stderr.splitlines() if "[ERROR]" in line]
    # the worker logs its own error before its teardown (on NCCL a graceful one can hang), then the launcher names it
    assert any("rank 0 failed: HangError: rank 0 failed at step 6" in line for line in errors), errors
    error = next(line for line in errors if "worker rank 0 failed" in line)
    assert "worker rank 0 failed (exit code 1): HangError: rank 0 failed at step 6 during engine step" in error
    # the engine's deadline (80 % of dist.timeout_s) fires before Gloo's timeout and says whom
    assert "receiving from rank 1" in error
    assert "did not finish within 8 s" in error, error
    stopped = int(re.search(r"rank 1 \(pid (\d+)\) does 'stop' at step 5", r.stderr).group(1))
    assert re.search(rf"silent: rank 1 \(pid {stopped} on [^;]+; last heartbeat [\d.]+ s ago", error), error
    assert "Traceback" not in error
    assert not tagged_processes(r.tag), "no worker (in particular the stopped one) may outlive the launcher"


@needs_mnist
@pytest.mark.timeout(300)
def test_sigterm_to_the_launcher_says_what_happened_and_exits_143(tmp_path):
    """What scancel or a time limit does to a sweep job (the local launcher inside it), mid-run:
    rank 1 hangs after step 35, rank 0 blocks in the next reduction, the launcher gets SIGTERM."""
    run_dir = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(GLOO_SOCKET_IFNAME="lo", PIPESGD_TEST_TAG=uuid.uuid4().hex, PIPESGD_FAULT="hang:1:35")
    proc = subprocess.Popen([sys.executable, "-m", "pipesgd.train", *MNIST, f"hydra.run.dir={run_dir}",
                             f"data.root={SHARED_DATA}", f"data.cache_dir={CACHE}"],
                            cwd=ROOT, env=env, stderr=subprocess.PIPE, text=True)
    lines = []
    for line in proc.stderr:  # the fault's own log line is the point the run stands at
        lines.append(line)
        if "does 'hang' at step 35" in line:
            break
    proc.send_signal(signal.SIGTERM)
    lines += proc.stderr.readlines()
    err = "".join(lines)
    assert proc.wait(timeout=60) == 143, err[-3000:]
    newest = run_dir / "checkpoints" / "step-00000032.pt"
    assert re.search(r"\[ERROR\] - SIGTERM received: the job was stopped from outside .*Run the job again with the "
                     rf"same run directory .*: {re.escape(str(run_dir))}$", err, re.MULTILINE), err[-3000:]
    # Both ranks say it, the one blocked in a collective as well as the one in the hang.
    for rank in (0, 1):
        assert re.search(rf"rank {rank}: SIGTERM at step \d+ .* The newest checkpoint is {re.escape(str(newest))}",
                         err), err[-3000:]
    assert "Traceback" not in err
    assert not tagged_processes(env["PIPESGD_TEST_TAG"])


@needs_mnist
@pytest.mark.timeout(300)
def test_nan_on_one_rank_is_skipped_by_every_rank(tmp_path):
    run_dir = tmp_path / "run"
    r = run(*MNIST, "trainer.max_steps=12", "trainer.nonfinite=skip", "trainer.check_every=1",
            f"hydra.run.dir={run_dir}", tmp=tmp_path, fault="nan:1:7")
    assert r.returncode == 0, r.stderr[-3000:]
    skips = [line for line in r.stderr.splitlines()
             if "non-finite gradient at step 7 (NaN/inf on rank(s) 1): update skipped on every rank" in line]
    assert len(skips) == 2 and any("[rank 1]" in line for line in skips), "both ranks decide, the same step"
    s = summary(run_dir)
    assert s["nonfinite_skipped_steps"] == [7] and s["steps"] == 12  # check_every=1 passed at every step


@needs_mnist
@pytest.mark.timeout(300)
def test_perturbed_replica_is_named(tmp_path):
    """Two ranks have no majority: both digests are named (the 3-rank wording is unit-tested)."""
    r = run(*MNIST, "trainer.max_steps=12", f"hydra.run.dir={tmp_path / 'run'}", tmp=tmp_path, fault="perturb:1:5")
    assert r.returncode == 1, r.stderr[-3000:]
    assert re.search(r"ReplicaMismatch: replicas diverged at step 8: rank 0: sha256 [0-9a-f]{12}; rank 1: sha256 "
                     r"[0-9a-f]{12} \(trainer.check_every found it", r.stderr), r.stderr[-3000:]
    assert not tagged_processes(r.tag)


@pytest.mark.timeout(120)
def test_taken_master_port_is_explained(tmp_path):
    """Under a torchrun environment rank 0 hosts the store on MASTER_PORT; if that port is taken
    the run stops with a message saying so (the local launcher always picks a free port)."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        r = run("+experiment=mnist_mlp", f"hydra.run.dir={tmp_path / 'run'}", tmp=tmp_path, extra_env={
            "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    assert r.returncode == 1, r.stderr[-3000:]
    assert (f"rank 0 cannot host the job's store on MASTER_ADDR:MASTER_PORT=127.0.0.1:{port}: the port is already "
            "in use") in r.stderr
    assert "torchrun --master-port" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.timeout(120)
@pytest.mark.parametrize("override,message", [
    ("trainer.widht=3", "Could not override 'trainer.widht'"),
    ("data.batch_size=40000", "data.batch_size=40000 is larger than the 30000 training samples each of the 2 ranks"),
    ("trainer.mode=ddp trainer.width=4", "trainer.width=4 is not used by trainer.mode=ddp"),
    ("trainer.mode=ps_async staleness=dc", "staleness=dc is not used by trainer.mode=ps_async"),
    ("trainer.staleness=dc trainer.dc_lambda=0.1", "trainer.staleness=dc is no longer a setting: the staleness rule "
                                                   "is its config group; use staleness=dc (docs/convergence.md)"),
])
def test_bad_config_on_the_command_line_fails_before_workers_start(override, message, tmp_path):
    r = run("+experiment=mnist_mlp", *override.split(), f"hydra.run.dir={tmp_path / 'run'}", tmp=tmp_path)
    assert r.returncode != 0 and message in r.stderr, r.stderr[-2000:]
    assert "Traceback" not in r.stderr and "] - training " not in r.stderr, "no worker may have started"
