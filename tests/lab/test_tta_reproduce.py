"""A curve record's first evaluation reruns to the bit on this host, the kind it was recorded on: a real
width-2 pipe run on MNIST, its record, and ``python -m pipesgd_lab.bench.tta_reproduce`` on it. The rerun
stops right after that evaluation (``trainer.stop_after_step``) with the whole run's schedule and a
reduction still in flight; a run that merely ends there (``trainer.max_steps``) flushes the pipeline
first and scores other weights. (That a one-bit difference reads "differs" is in
tests/lab/test_host_fingerprint.py.)"""

import json
import subprocess
import sys

import pytest

from pipesgd_lab.bench import tta_records, tta_reproduce
from pipesgd_lab.bench.runner import recorded
from pipesgd.observability.hostinfo import fingerprint, host_kind
from runs import CACHE, ROOT, fast, summary, train

ARM = ("trainer.mode=pipe", "trainer.width=2", "staleness=none")


def _args(tmp_path, data, run_dir, *extra):
    return ["+experiment=mnist_mlp", *ARM, "seed=5", *fast(tmp_path, data), "trainer.eval_every_steps=3",
            "trainer.eval_max_batches=2", *extra, f"hydra.run.dir={run_dir}"]


@pytest.mark.timeout(480)
def test_a_records_first_evaluation_reruns_to_the_bit_here(tmp_path, shared_data):
    run_dir = tmp_path / "run"
    args = _args(tmp_path, shared_data, run_dir, "trainer.max_steps=8", "dist.cpu_affinity=rank")
    r = train(*args)
    assert r.returncode == 0, r.stderr[-2000:]
    s = summary(run_dir)
    assert s["host"] == fingerprint(), "summary.json says which host the run ran on"
    allowed = s["placement"]["allowed"]  # and where its workers ran (a pinned run's record reruns the same)
    assert s["placement"] == {"rule": "rank", "allowed": allowed, "core": allowed[0]}
    record = tta_records.curve_record("pipe", 5, list(ARM), "mnist_mlp", s,
                                      [{"command": recorded([sys.executable, "-m", "pipesgd.train", *args])}])
    assert record["host_kind"] == host_kind(fingerprint()) and record["curve"][0][0] == 3
    path = tmp_path / "pipe-s5.json"
    path.write_text(json.dumps(record))

    def reproduce(p):
        return subprocess.run([sys.executable, "-m", "pipesgd_lab.bench.tta_reproduce", str(p), "--dir",
                               str(tmp_path / f"rerun-{p.stem}"), f"data.cache_dir={CACHE}"],
                              cwd=ROOT, capture_output=True, text=True, timeout=200)

    out = reproduce(path)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert out.stdout.strip().endswith(f"{path}: reproduced")
    rerun = summary(tmp_path / "rerun-pipe-s5" / "rerun")
    assert rerun["steps"] == 3 and rerun["evals"][0] == s["evals"][0] | {k: rerun["evals"][0][k]
                                                                         for k in ("elapsed_s", "eval_s")}

    # another CPU model: not comparable, and nothing runs (exit 2)
    elsewhere = tmp_path / "elsewhere.json"
    elsewhere.write_text(json.dumps(record | {"host": record["host"] | {"cpu_model": "another CPU"}}))
    out = reproduce(elsewhere)
    assert out.returncode == 2 and out.stdout.strip().endswith(tta_reproduce.OTHER_HOST), out.stdout[-2000:]
    assert not (tmp_path / "rerun-elsewhere").exists()

    # ending the run at the evaluation's step instead flushes the in-flight reduction first
    ended = tmp_path / "ended"
    r = train(*_args(tmp_path, shared_data, ended, "trainer.max_steps=3"))
    assert r.returncode == 0, r.stderr[-2000:]
    assert summary(ended)["evals"][-1]["test_loss"] != s["evals"][0]["test_loss"]
