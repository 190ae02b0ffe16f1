"""pipesgd_lab.bench.live_drill's arithmetic on logs written by hand: the survivors' stall, the
returning group's time to train again and its split at the imports, for a killed group (a new
process) and a stopped one (the same process, continued); and its refusals."""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

import pytest

from pipesgd_lab.bench import live_drill

T0 = datetime(2026, 11, 27, 12, 0, 0).timestamp()


def _line(t: float, text: str) -> str:
    stamp = datetime.fromtimestamp(T0 + t)
    return f"[{stamp:%Y-%m-%d %H:%M:%S},{stamp.microsecond // 1000:03d}][x][INFO] - {text}"


def _step(t: float, step: int) -> str:
    return _line(t, f"epoch 1 step {step}/30 loss 2.0 iter 20.0 ms (compute 10.0, exposed comm 0.0) ETA 0m01s")


def _write(run_dir: Path, replica: int, lines: list[str], **summary) -> None:
    d = run_dir / f"replica_{replica}"
    d.mkdir(parents=True)
    (d / "train.log").write_text("\n".join(lines) + "\n")
    (d / "summary.json").write_text(json.dumps({"param_checksum": "abc", "test_accuracy": 0.9, "steps": 30,
                                                "live_skipped_commits": 1, "live_healed": 0, **summary}))


def test_a_killed_group_its_survivors_stall_and_its_time_to_train_again(tmp_path):
    # the survivor steps every 0.1 s, stalls from step 5 (t=0.5) to step 6 (t=3.5), then goes on
    survivor = [_step(0.1 * s, s) for s in range(1, 6)] + [_step(3.5 + 0.1 * (s - 6), s) for s in range(6, 31)]
    survivor.insert(5, _line(3.45, "weights sha256 5eed after the update of step 5, the first since this replica "
                                   "served a healing peer"))
    faulted = [_step(0.1 * s, s) for s in range(1, 6)] + [
        _line(0.52, "fault injection (PIPESGD_FAULT): replica group 1 (pid 41) does 'kill' at step 5"),
        _line(2.0, f"replica group 1 restart 1 pid 42: process started at {T0 + 0.6:.3f}, imports done at "
                   f"{T0 + 1.6:.3f} (unix s)"),
        _line(3.4, "healed from a peer at its step 5 (manager step 5)"),
        _line(3.45, "weights sha256 5eed after the update of step 5, the first since this replica healed"),
        _step(3.5, 6)] + [_step(3.5 + 0.1 * (s - 6), s) for s in range(7, 31)]
    _write(tmp_path, 0, survivor)
    _write(tmp_path, 1, faulted, live_healed=1)
    d = live_drill.analyse(tmp_path, 2, None)
    assert (d["fault"], d["faulted_group"], d["fault_step"], d["updates_lost"]) == ("kill", 1, 5, 1)
    s = d["survivors"][0]
    assert s["normal_step_s"] == pytest.approx(0.1, abs=2e-3) and s["longest_gap_ends_at_step"] == 6
    assert s["longest_gap_s"] == pytest.approx(3.0, abs=2e-3)
    assert d["survivors_stall_s"] == pytest.approx(2.9, abs=4e-3)
    back = d["returning"]
    assert (back["restart"], back["pid"], back["healed"], back["first_step"]) == (1, 42, True, 6)
    assert back["import_s"] == pytest.approx(1.0, abs=2e-3)
    assert back["after_imports_s"] == pytest.approx(1.9, abs=2e-3)
    assert back["to_train_s"] == pytest.approx(2.9, abs=2e-3)
    assert back["setup_s"] == pytest.approx(0.4, abs=2e-3) and back["join_s"] == pytest.approx(1.5, abs=2e-3)
    assert d["weights_agree"] and d["healed"] == {0: 0, 1: 1}
    assert d["first_joint_step"] == {"step": 5, "healer": "5eed", "donors": {0: "5eed"}, "identical": True}
    assert "| 0 | kill at 5 of group 1 | 2.90 (3.00) | 1 | 1.00 + 0.40 + 1.50 = 2.90 | yes | yes / yes | 90.00 |" in \
        live_drill.table({"runs": [{"seed": 0, "drill": d}]})


def test_a_stopped_group_returns_in_its_own_process_at_the_signal(tmp_path):
    survivor = [_step(0.1 * s, s) for s in range(1, 31)]
    faulted = [_step(0.1 * s, s) for s in range(1, 6)] + [
        _line(0.52, "fault injection (PIPESGD_FAULT): replica group 1 (pid 41) does 'stop' at step 5"),
        _line(1.8, "healed from a peer at its step 17 (manager step 17)"), _step(1.9, 18)]
    _write(tmp_path, 0, survivor, live_skipped_commits=0)
    _write(tmp_path, 1, faulted, param_checksum="def")
    d = live_drill.analyse(tmp_path, 2, T0 + 1.5)
    back = d["returning"]
    assert (back["restart"], back["pid"], back["import_s"], back["first_step"]) == (0, None, None, 18)
    assert back["to_train_s"] == pytest.approx(0.4, abs=2e-3) == back["after_imports_s"] == back["join_s"]
    assert back["setup_s"] is None
    assert d["updates_lost"] == 0 and not d["weights_agree"] and d["first_joint_step"] is None


def test_weights_that_differ_at_the_first_joint_step_are_reported():
    logs = {0: [_line(1.0, "weights sha256 aaaa after the update of step 7, the first since this replica served a "
                           "healing peer")],
            1: [_line(1.0, "weights sha256 bbbb after the update of step 7, the first since this replica healed")]}
    assert live_drill.first_joint_step(logs, 1, T0)["identical"] is False
    assert live_drill.first_joint_step(logs, 1, T0 + 2) is None  # a heal before the group's return is not its


def test_a_run_whose_fault_never_fired_is_a_failed_cell(tmp_path):
    _write(tmp_path, 0, [_step(0.1, 1)])
    _write(tmp_path, 1, [_step(0.1, 1)])
    with pytest.raises(live_drill.CellFailed, match="group 1 logged no fault"):
        live_drill.analyse(tmp_path, 2, None)


@pytest.mark.parametrize("argv, message", [
    (["--replicas", "1"], "--replicas: 1 must be >= 2"),
    (["dist.nproc=3"], "the drill sets seed, trainer.mode, dist.nproc"),
    (["trainer.log_every=5"], "the drill sets"),
    (["--seeds", "a"], "--seeds: 'a' is not"),
    (["--rate", "1gbit"], "--rate: '1gbit' applies to --launcher torchrun only"),
    (["--launcher", "torchrun", "trainer.live.host=10.0.0.1"], "--launcher torchrun the drill sets trainer.live"),
    (["--launcher", "torchrun", "--rate", "1gbps"], "argument --rate: '1gbps'"),
])
def test_bad_arguments_are_refused_naming_them(argv, message, capsys):
    with pytest.raises(SystemExit):
        live_drill.parse(argv)
    assert message in capsys.readouterr().err


def test_the_torchrun_launcher_refuses_without_root(monkeypatch, capsys):
    monkeypatch.setattr(live_drill.live_drill_torchrun.os, "geteuid", lambda: 1000)
    with pytest.raises(SystemExit):
        live_drill.parse(["--launcher", "torchrun"])
    assert "argument --launcher: torchrun runs the groups on emulated nodes" in capsys.readouterr().err


def test_the_lighthouse_keys_go_to_the_lighthouse_under_torchrun():
    options, group = live_drill.live_drill_torchrun.split_overrides(
        ["trainer.live.min_replicas=2", "trainer.live.join_timeout_ms=500", "+trainer.live.quorum_tick_ms=10",
         "data.root=/d"])
    assert options == ["--min-replicas", "2", "--join-timeout-ms", "500", "--quorum-tick-ms", "10"]
    assert group == ["trainer.live.min_replicas=2", "data.root=/d"]  # a group refuses the lighthouse's own keys


def test_every_torchrun_group_waits_for_all_groups_before_its_first_step_unless_told_otherwise():
    command = live_drill.live_drill_torchrun.group_command
    plain = command(["data.root=/d"], "10.0.0.2", "http://10.0.0.1:29510", "drill-1", 1, 3)
    assert plain.count("trainer.live.start_replicas=3") == 1
    own = command(["data.root=/d", "trainer.live.start_replicas=2"], "10.0.0.2", "http://h:1", "drill-1", 1, 3)
    assert [t for t in own if "start_replicas" in t] == ["trainer.live.start_replicas=2"]
    forced = command(["+trainer.live.start_replicas=2"], "10.0.0.2", "http://h:1", "drill-1", 1, 3)
    assert [t for t in forced if "start_replicas" in t] == ["+trainer.live.start_replicas=2"]


def test_a_survivor_that_healed_from_a_peer_got_back_the_update_it_failed():
    # survivor 0 failed vote 9 that survivor 1 passed, then healed from it: the model lost one update
    assert live_drill.updates_lost({0: {"live_skipped_commits": 2, "live_healed": 1},
                                    1: {"live_skipped_commits": 1, "live_healed": 0}}) == 1
    assert live_drill.updates_lost({0: {"live_skipped_commits": 2, "live_healed": 1}}) == 2


@pytest.mark.timeout(60)
@pytest.mark.parametrize("after, status", [("SIGCONT", 0), ("SIGKILL", -9)])
def test_a_stopped_group_is_found_by_its_fault_line_and_signalled(tmp_path, after, status):
    """A process that logs the fault line the way pipesgd.reliability.faults does and stops itself: the drill
    finds its pid, sees it stopped, and sends the signal that ends the stop."""
    import signal
    import subprocess
    import sys

    train_log = tmp_path / "train.log"
    code = ("import os, signal, sys; "
            f"open(sys.argv[1], 'w').write({_line(0, 'fault injection (PIPESGD_FAULT): replica group 1 (pid ')!r} "
            f"+ str(os.getpid()) + {') does ' + repr('stop') + ' at step 5'!r} + '\\n'); "
            "os.kill(os.getpid(), signal.SIGSTOP)")
    proc = subprocess.Popen([sys.executable, "-c", code, str(train_log)])
    try:
        watch = live_drill._StopThenSignal(train_log, 0.1, getattr(signal, after), deadline_s=30)
        watch(proc)
        assert proc.wait(timeout=30) == status
        assert watch.pid == proc.pid and watch.resumed_at is not None
    finally:
        proc.kill()
        proc.wait()


def test_drills_with_other_overrides_never_share_a_run_directory(tmp_path):
    """A stop drill with trainer.live.timeout_s=2 once resumed the default stop drill's checkpoints
    (same directory name) and failed on the config digest: the overrides are in the name now."""
    base = ["--workload", "mnist", "--replicas", "2", "--fault", "stop", "--dir", str(tmp_path), "--json",
            str(tmp_path / "d.json")]
    plain = live_drill.parse([*base, "data.root=x"])
    shorter = live_drill.parse([*base, "data.root=x", "trainer.live.timeout_s=2"])
    assert live_drill.drill_dir(plain, 0) != live_drill.drill_dir(shorter, 0)
    assert live_drill.drill_dir(plain, 0) == live_drill.drill_dir(live_drill.parse([*base, "data.root=x"]), 0)
    assert live_drill.drill_dir(plain, 0) != live_drill.drill_dir(plain, 1)
