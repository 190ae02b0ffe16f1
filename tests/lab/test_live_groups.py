"""pipesgd_lab.bench.live_groups, the period-H study's launcher of torchft's arms on emulated nodes:
the groups' torchrun jobs keep the mode they are given, and bad arguments stop it before any node."""

import pytest

from pipesgd_lab.bench import live_groups
from pipesgd_lab.bench.live_drill_torchrun import group_command


def test_a_group_keeps_the_mode_it_is_given_and_is_live_otherwise():
    torchft = group_command(["+experiment=mnist_mlp", "trainer.mode=torchft_diloco"], "10.0.0.1", "http://h:1",
                            "run", 1, 2)
    assert [t for t in torchft if t.startswith("trainer.mode=")] == ["trainer.mode=torchft_diloco"]
    assert "trainer.live.replica=1" in torchft and "trainer.live.start_replicas=2" in torchft
    live = group_command(["+experiment=mnist_mlp"], "10.0.0.1", "http://h:1", "run", 0, 2)
    assert [t for t in live if t.startswith("trainer.mode=")] == ["trainer.mode=live"]


@pytest.mark.parametrize("argv, message", [
    (["--workers", "2", "--rate", "1mbit", "--", "trainer.mode=torchft_diloco"], "hydra.run.dir=PATH"),
    (["--workers", "0", "--rate", "1mbit", "--", "hydra.run.dir=/tmp/x"], "--workers: must be an integer >= 1"),
    (["--workers", "2", "--rate", "fast", "--", "hydra.run.dir=/tmp/x"], "argument --rate: 'fast'"),
    (["--workers", "2", "--rate", "1mbit", "--", "trainer.live.replica=0", "hydra.run.dir=/tmp/x"],
     "sets trainer.live.lighthouse"),
])
def test_bad_arguments_stop_it_before_any_node_is_built(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        live_groups.main(argv)
    assert e.value.code == 2 and message in capsys.readouterr().err
