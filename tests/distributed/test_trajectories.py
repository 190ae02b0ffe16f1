"""Nothing moves but the code: every engine's trajectory (PipeSGD at widths 1-3 under every per-step
rule, PipeDiLoCo's widths, rules, fragments and sync_delay, the pipelined DDP hook) has the
parameter checksums recorded before the in-flight schedule was shared (tests/trajectories.json,
main at ca9ff32), checkpoint round trip mid-flight included."""

import json

import pytest

from trajectories import RECORD, measure

pytestmark = pytest.mark.timeout(300)


def test_every_engines_trajectory_is_bit_identical_to_the_recorded_one():
    recorded = json.loads(RECORD.read_text())
    found = measure()
    assert set(found) == set(recorded), "the cells changed: re-record only with a change meant to move them"
    moved = {name: (recorded[name], found[name]) for name in recorded if recorded[name] != found[name]}
    assert not moved, f"{len(moved)} trajectories moved: {json.dumps(moved, indent=1)}"
