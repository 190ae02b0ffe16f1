"""Nothing moves but the code: every engine's trajectory (PipeSGD at widths 1-3 under every per-step
rule, PipeDiLoCo's widths, rules, fragments and sync_delay, the pipelined DDP hook) has the
parameter checksums recorded before the in-flight schedule was shared (tests/trajectories.json,
main at ca9ff32), checkpoint round trip mid-flight included."""

import json

import pytest

from trajectories import RECORD, cells, later_cells, measure

pytestmark = pytest.mark.timeout(300)


def test_every_engines_trajectory_is_bit_identical_to_the_recorded_one():
    recorded = json.loads(RECORD.read_text())
    found = measure([name for name, _ in cells()])
    assert set(found) == set(recorded), "the cells changed: re-record only with a change meant to move them"
    moved = {name: (recorded[name], found[name]) for name in recorded if recorded[name] != found[name]}
    assert not moved, f"{len(moved)} trajectories moved: {json.dumps(moved, indent=1)}"


def test_the_pipelined_ddp_hook_at_width_3_follows_pipesgd_at_width_3_bit_for_bit():
    """The hook took width K with the shared schedule: DDP hands each step the average of the step
    two back, as PipeSGD applies it (the weights at the mid-run checkpoint and after the flush)."""
    recorded = json.loads(RECORD.read_text())
    found = measure([name for name, _ in later_cells()])
    for rule in ("none", "lookahead"):
        for ranks in found[f"ddp/w3/{rule}"]:
            assert [ranks[0], ranks[-1]] == recorded[f"pipe/w3/{rule}"][0], rule
