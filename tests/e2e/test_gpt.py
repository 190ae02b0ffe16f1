"""The GPT recipe (+experiment=gpt_shakespeare) end to end on a shrunken model: each kind of mode
runs it (synchronous, pipelined with a staleness rule and an in-ring compressor, DDP with a comm
hook), reports validation loss and bits per character at fixed steps, and records the split."""

import json
import math

import pytest

from runs import CACHE, train

TINY = ["model.n_layer=1", "model.n_embd=32", "model.n_head=2", "data.block_size=32", "data.batch_size=4",
        "data.eval_batch_size=16", "trainer.eval_max_batches=2", "trainer.max_steps=4",
        "trainer.eval_every_steps=2", "trainer.log_every=1", "trainer.check_every=2"]


@pytest.fixture
def shakespeare(shared_data):
    if not (shared_data / "shakespeare").is_dir():
        pytest.skip(f"offline Shakespeare copy not found in {shared_data}")
    return shared_data


@pytest.mark.timeout(300)
@pytest.mark.parametrize("arm", [
    ["trainer.mode=sync", "staleness=none"],
    # the recipe's 300 synchronous steps would cover the whole shrunken run: one, then the pipeline
    ["trainer.mode=pipe", "staleness=lookahead", "compressor=int8", "comm=ring", "trainer.warmup_sync_steps=1"],
    ["trainer.mode=ddp", "staleness=none", "compressor=fp16"],
], ids=["sync", "pipe-lookahead-int8", "ddp-fp16"])
def test_gpt_recipe_runs_in_each_kind_of_mode(arm, tmp_path, shakespeare):
    run_dir = tmp_path / "run"
    r = train("+experiment=gpt_shakespeare", f"data.root={shakespeare}", f"data.cache_dir={CACHE}",
              *TINY, *arm, f"hydra.run.dir={run_dir}")
    assert r.returncode == 0, r.stderr[-3000:]
    s = json.loads((run_dir / "summary.json").read_text())
    assert s["steps"] == 4 and s["world_size"] == 2
    assert [e["step"] for e in s["evals"]] == [2, 4], "validation at fixed steps, and at the end"
    assert 0 < s["test_loss"] < math.log(256) + 0.5 and s["test_bpc"] == pytest.approx(s["test_loss"] / math.log(2))
    assert s["data"]["valid_works"] == ["hamlet_gut", "macbeth_gut", "sonnets_gut", "tempest_gut"]
    assert s["config"]["optimizer"]["_target_"] == "pipesgd.optim.adamw"
    assert s["config"]["trainer"]["max_grad_norm"] == 1.0
    assert "validation works (471536 chars)" in r.stderr and "bpc" in r.stderr
