"""Nothing moves but the code: every engine's trajectory (PipeSGD at widths 1-3 under every per-step
rule, PipeDiLoCo's widths, rules, fragments and sync_delay, the pipelined DDP hook) has the
parameter checksums recorded before the in-flight schedule was shared (tests/trajectories.json,
main at ca9ff32), checkpoint round trip mid-flight included."""

import json

import pytest

from trajectories import RECORD, cells, later_cells, measure, resume_all

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


def test_checkpoints_written_before_the_shared_schedule_resume_bit_for_bit():
    """Each cell's mid-run state as the code before the shared schedule wrote it
    (tests/trajectories-ca9ff32.pt: PipeSGD without launch ticks, PipeDiLoCo without the warm-up's
    keys, the DDP hook's one step in flight as a dict) loads into today's engines, and the run
    resumed from it ends on the recorded weights."""
    recorded = json.loads(RECORD.read_text())
    resumed = resume_all(RECORD.with_name("trajectories-ca9ff32.pt"))
    assert set(resumed) == set(recorded)
    moved = {name: (recorded[name][0][-1], [r[-1] for r in resumed[name]]) for name in recorded
             if [r[-1] for r in resumed[name]] != [r[-1] for r in recorded[name]]}
    assert not moved, f"{len(moved)} resumed runs ended elsewhere: {json.dumps(moved, indent=1)}"
