"""A live replica group run as its own torchrun job (docs/multi-node.md, "Live recovery under
torchrun"): what tells it its run (trainer.live.{lighthouse,run_id,replica,replicas} or the
environment), what is refused before it trains, and where it writes. The lighthouse command, run
for real. The whole thing on emulated nodes: tests/lab/test_live_torchrun.py."""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import signal
import subprocess
import sys
import time

import pytest
from omegaconf import OmegaConf

from listening import listening, on_every_interface
from pipesgd.config import ConfigError, command_line_keys, validate
from pipesgd.reliability.faults import Faults
from pipesgd.live import launch as live_launch
from pipesgd.live.options import (ENV_LIGHTHOUSE, ENV_REPLICA, ENV_REPLICAS, ENV_RESTART, ENV_RUN_ID, ENV_SPAWNED,
                                  options_from_env, replica_attempt, replica_shard)
from runs import ROOT
from test_config import composed

GROUP = ["trainer.mode=live", "trainer.live.lighthouse=http://10.1.2.3:29510", "trainer.live.run_id=exp7",
         "trainer.live.replica=1", "trainer.live.replicas=2", "trainer.live.host=10.1.2.4"]


@pytest.fixture
def torchrun(monkeypatch):
    """This process as a torchrun job's one worker, none of the live variables set; the whole
    environment restored after (``run_here`` sets the group's variables in this process, which
    monkeypatch would not undo, and a later test in the same worker would read them)."""
    saved = dict(os.environ)
    for key in ("PIPESGD_LIVE_HOST", "PIPESGD_LIVE_TIMEOUT_S", "PIPESGD_LIVE_QUORUM_TIMEOUT_S",
                "PIPESGD_LIVE_MIN_REPLICAS", "PIPESGD_LIVE_INIT_SYNC", "PIPESGD_LIVE_START_STORE", "RUST_LOG",
                "PIPESGD_LIVE_START_REPLICAS", "PIPESGD_LIVE_START_TIMEOUT_S",
                ENV_LIGHTHOUSE, ENV_RUN_ID, ENV_REPLICA, ENV_REPLICAS, ENV_RESTART, ENV_SPAWNED, "PIPESGD_FAULT"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    yield monkeypatch
    os.environ.clear()
    os.environ.update(saved)


def live_of(*overrides: str) -> dict:
    cfg = composed(*overrides)
    validate(cfg, command_line_keys(list(overrides)))
    return OmegaConf.to_container(cfg, resolve=True, enum_to_str=True)


def test_the_keys_make_this_process_the_replica_group_they_name(torchrun):
    container = live_of(*GROUP, "trainer.live.timeout_s=12", "trainer.live.min_replicas=2")
    torchrun.setenv("TORCHELASTIC_RESTART_COUNT", "1")  # torchrun restarted the worker once
    live = container["trainer"]["live"]
    env = live_launch.group_env(live, live_launch.settings(live)[1])
    for key, value in env.items():
        torchrun.setenv(key, value)
    options = options_from_env()
    assert (options.lighthouse, options.run_id, options.replica, options.host) == (
        "http://10.1.2.3:29510", "exp7", 1, "10.1.2.4")
    assert (options.timeout_s, options.min_replicas) == (12, 2)
    # its data shard follows the group, and torchrun's restart count is the group's: a fault for
    # group 1 fired in its first process, not in this one
    assert replica_shard() == (1, 2) and replica_attempt() == (1, 1)
    torchrun.setenv("PIPESGD_FAULT", "kill:1:3")
    assert Faults.from_env(0) is None  # nothing installed
    torchrun.setenv(ENV_RESTART, "0")  # what group_env gives the group's first process
    assert [f.rank for f in Faults.from_env(0).mine] == [1]


def test_a_start_barrier_reaches_the_group_and_its_limit_defaults_to_the_quorums(torchrun):
    live = live_of(*GROUP, "trainer.live.start_replicas=2", "trainer.live.quorum_timeout_s=90")["trainer"]["live"]
    for key, value in live_launch.group_env(live, live_launch.settings(live)[1]).items():
        torchrun.setenv(key, value)
    options = options_from_env()
    assert options.start_replicas == 2 and options.start_wait_s() == ("trainer.live.quorum_timeout_s", 90.0)
    live = live_of(*GROUP, "trainer.live.start_timeout_s=600")["trainer"]["live"]
    for key, value in live_launch.group_env(live, live_launch.settings(live)[1]).items():
        torchrun.setenv(key, value)
    torchrun.delenv("PIPESGD_LIVE_START_REPLICAS")
    options = options_from_env()
    assert options.start_replicas is None and options.start_wait_s() == ("trainer.live.start_timeout_s", 600.0)


def test_the_environment_may_say_it_instead(torchrun):
    for var, value in ((ENV_LIGHTHOUSE, "http://10.1.2.3:29510"), (ENV_RUN_ID, "exp7"), (ENV_REPLICA, "0"),
                       (ENV_REPLICAS, "3")):
        torchrun.setenv(var, value)
    container = live_of("trainer.mode=live", "trainer.live.host=10.1.2.5")
    live = container["trainer"]["live"]
    env = live_launch.group_env(live, live_launch.settings(live)[1])
    assert (env[ENV_REPLICA], env[ENV_REPLICAS], env[ENV_RESTART]) == ("0", "3", "0")


def test_a_group_of_several_ranks_is_torchfts_and_live_refuses_it_before_it_trains(torchrun, tmp_path):
    """torchft_diloco's replica group may be a torchrun job of k ranks (its launcher, run_groups); live's
    engine reduces over torchft's group alone, so its launcher refuses such a job before the worker runs.
    Each rank of a group reads its own k-th of the group's data share."""
    torchrun.setenv("WORLD_SIZE", "2")
    torchrun.setenv("RANK", "1")
    for mode, launcher in (("live", live_launch.run), ("torchft_diloco", live_launch.run_groups)):
        rounds = ("staleness=none", "compressor=none", "trainer.sync_every=4", "trainer.warmup_sync_steps=0",
                  "trainer.check_every=null") if mode == "torchft_diloco" else ()
        container = live_of(*GROUP[1:], f"trainer.mode={mode}", *rounds)
        ran = []
        if mode == "live":
            with pytest.raises(live_launch.WorkerFailed, match="this job has WORLD_SIZE=2"):
                launcher(lambda *a: ran.append(a), (container, str(tmp_path)), nproc=1)
            assert not ran
            continue
        launcher(lambda *a: ran.append(a), (container, str(tmp_path)), nproc=1)
        assert ran and ran[0][1] == str(tmp_path / "replica_1")
        # group 1 of 2, rank 1 of its 2: shard 3 of 4
        assert replica_shard() == (3, 4) and replica_attempt() == (1, 0)


@pytest.mark.parametrize("overrides,env,message", [
    (GROUP[:1], {}, "trainer.live.lighthouse, trainer.live.run_id, trainer.live.replica, trainer.live.replicas not "
                    "set (nor PIPESGD_LIVE_LIGHTHOUSE"),
    (GROUP[:4] + GROUP[5:], {}, "trainer.live.replicas not set (nor PIPESGD_LIVE_REPLICAS)"),
    (GROUP, {ENV_REPLICA: "0"}, "trainer.live.replica=1 and PIPESGD_LIVE_REPLICA='0' disagree"),
    (GROUP[:4] + GROUP[5:], {ENV_REPLICAS: "two"}, "trainer.live.replicas (or PIPESGD_LIVE_REPLICAS)='two' is "
                                                   "invalid: must be an integer"),
    ([*GROUP, "trainer.live.replica=2"], {}, "trainer.live.replica=2 is invalid with trainer.live.replicas=2: must "
                                             "be in 0..1"),
    ([*GROUP, "trainer.live.lighthouse=10.1.2.3:29510"], {}, "trainer.live.lighthouse='10.1.2.3:29510' is invalid: "
                                                             "must be http://host:port"),
    ([*GROUP, "trainer.live.run_id=a/b"], {}, "trainer.live.run_id='a/b' is invalid"),
    ([*GROUP, "trainer.live.heartbeat_timeout_ms=3000"], {}, "trainer.live.heartbeat_timeout_ms=3000 is the "
                                                             "lighthouse's, and under torchrun the lighthouse runs on "
                                                             "its own: pass --heartbeat-timeout-ms"),
    ([*GROUP, "trainer.live.lighthouse_port=29510"], {}, "pass --port to python -m pipesgd.live.lighthouse"),
    (GROUP[:-1], {}, "trainer.live.host=127.0.0.1 is loopback but the lighthouse is at http://10.1.2.3:29510"),
    ([*GROUP, "trainer.live.start_replicas=3"], {}, "trainer.live.start_replicas=3 is invalid with "
                                                    "trainer.live.replicas=2: a group cannot wait for more groups"),
    ([*GROUP, "trainer.live.start_replicas=0"], {}, "trainer.live.start_replicas=0 is invalid: must be an "
                                                    "integer >= 1"),
    ([*GROUP, "trainer.live.start_timeout_s=0"], {}, "trainer.live.start_timeout_s=0.0 is invalid: must be a number "
                                                     "of seconds > 0"),
])
def test_a_group_that_cannot_find_its_run_is_refused_before_it_trains(torchrun, overrides, env, message):
    for var, value in env.items():
        torchrun.setenv(var, value)
    with pytest.raises(ConfigError) as err:
        live_of(*overrides)
    assert message in str(err.value)


def test_a_process_knows_when_it_was_started_from_the_kernel():
    before = time.time()
    out = subprocess.run([sys.executable, "-c", "from pipesgd.live.launch import process_started; "
                          "print(process_started())"], cwd=ROOT, capture_output=True, text=True, timeout=60, check=True)
    after = time.time()
    started = float(out.stdout)
    assert before - 0.05 <= started <= after  # a clock tick's resolution, either side of the fork


def test_without_torchrun_the_launcher_numbers_the_groups_itself():
    with pytest.raises(ConfigError, match=r"trainer.live.lighthouse='http://10.1.2.3:29510' is for a replica group "
                                          r"started on its own \(torchrun\)"):
        live_of(*GROUP)
    with pytest.raises(ConfigError, match=r"trainer.live.start_replicas=2 is for replica groups started on their own "
                                          r"\(torchrun\); the live launcher starts every group and they wait"):
        live_of("trainer.mode=live", "trainer.live.start_replicas=2")
    live_of("trainer.mode=live")  # the defaults: fine


def test_a_group_runs_here_in_its_own_directory_with_its_own_log(torchrun, tmp_path):
    container = live_of(*GROUP[:3], "trainer.live.replica=0", "trainer.live.replicas=2", "trainer.live.host=10.1.2.4")
    hydra_log = logging.FileHandler(tmp_path / "train.log")  # as Hydra's, in the run directory
    root = logging.getLogger()
    root.addHandler(hydra_log)
    level = root.level
    root.setLevel(logging.INFO)  # as pipesgd.train's logging
    seen = {}

    def group(cont, run_dir):
        seen.update(run_dir=run_dir, replica=os.environ[ENV_REPLICA], run_id=os.environ[ENV_RUN_ID])
        logging.getLogger("pipesgd.test").warning("group 0 trains")
        live_launch.log_start(logging.getLogger("pipesgd.test"))
        (tmp_path / "replica_0" / "summary.json").write_text(json.dumps({"steps": 3}))

    try:
        summary = live_launch.run(group, (container, str(tmp_path)), nproc=4, max_restarts=3)
    finally:
        root.setLevel(level)
        root.removeHandler(hydra_log)
        hydra_log.close()
    assert seen == {"run_dir": str(tmp_path / "replica_0"), "replica": "0", "run_id": "exp7"}
    assert "group 0 trains" in (tmp_path / "replica_0" / "train.log").read_text()
    assert "group 0 trains" not in (tmp_path / "train.log").read_text()
    # torchrun passes no start time on: the worker's comes from the kernel, in the line the live drill reads
    started = live_launch.STARTED.search((tmp_path / "replica_0" / "train.log").read_text())
    assert started and (started[1], started[2], started[3]) == ("0", "0", str(os.getpid()))
    assert float(started[4]) < float(started[5]) <= time.time()
    assert summary == tmp_path / "replica_0" / "summary.json"
    assert json.loads((tmp_path / "summary.json").read_text()) == {"steps": 3}  # group 0's, as the launcher copies


@pytest.mark.skipif(importlib.util.find_spec("torchft") is None, reason="torchft is not installed")
@pytest.mark.timeout(120)
def test_the_lighthouse_command_listens_where_asked_and_stops_on_sigterm():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    p = subprocess.Popen([sys.executable, "-m", "pipesgd.live.lighthouse", "--host", "127.0.0.1", "--min-replicas",
                          "2"], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        address = p.stdout.readline().strip()
        assert address.startswith("http://127.0.0.1:"), p.stderr.read() if p.poll() is not None else address
        port = int(address.rsplit(":", 1)[1])
        sockets = listening(p.pid)
        assert {(str(a), q) for a, q, _ in sockets} >= {("127.0.0.1", port)}
        assert not on_every_interface(sockets)
        p.send_signal(signal.SIGTERM)
        assert p.wait(timeout=30) == 0
        assert f"lighthouse at {address} stopped" in p.stderr.read()
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()


@pytest.mark.parametrize("args,message", [(["--min-replicas", "0"], "argument --min-replicas: '0' is invalid"),
                                          (["--port", "70000"], "argument --port: '70000' is invalid"),
                                          (["--host", ""], "argument --host: '' would listen on every interface")])
def test_the_lighthouse_command_refuses_a_bad_option(args, message, capsys):
    from pipesgd.live.lighthouse import main

    with pytest.raises(SystemExit) as done:
        main(args)
    assert done.value.code == 2 and message in capsys.readouterr().err
