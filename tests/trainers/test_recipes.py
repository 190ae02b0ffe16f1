"""docs/ddp-hook.md's Accelerate and Hugging Face Trainer recipes, each run as the doc's own code
block under ``torchrun --standalone`` on two CPU ranks (Gloo on loopback), with a tiny model built
here: the weights after the flush equal the same run without the pipelined hook (torch's
``fp16_compress_hook`` registered the plain way) with each update applied one step late, within
1e-6; they differ from that run applied at once; the replicas agree bit for bit; as many
optimizer updates as the plain run; the script, once it lets go of what it built and destroys the
group, has as many threads as before its first group (a group left running aborted the finished
process about one run in seven: docs/reliability.md, "Teardown"). No hub access: the models are
built in code, HF offline."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import uuid

import pytest
from needs_trainers import require_trainers
from runs import ROOT, tagged_processes

require_trainers()

TOLERANCE = 1e-6
STEPS = 6  # 96 samples, 8 per rank and step, 2 ranks

COMMON = """
import gc, hashlib, json, os
import torch
import torch.distributed as dist
import pipesgd.hooks  # before any group, as a script's imports come first (pipesgd/teardown.py)
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import fp16_compress_hook
from torch.optim.optimizer import register_optimizer_step_post_hook

torch.set_num_threads(1)
alone = len(os.listdir("/proc/self/task"))  # this process's threads before any group
updates = [0]
register_optimizer_step_post_hook(lambda *_: updates.__setitem__(0, updates[0] + 1))


def flat(module):
    return torch.cat([p.detach().reshape(-1) for p in module.parameters()]).clone()


def data(n=96):
    g = torch.Generator().manual_seed(1)
    return torch.randn(n, 8, generator=g), torch.randint(0, 3, (n,), generator=g)


def counted(run):
    updates[0] = 0
    weights = run()
    return weights, updates[0]


def report(pipelined, late, at_once):
    (mine, n), (ref, n_ref), (sync, _) = pipelined, late, at_once
    rank = dist.get_rank()
    # What the recipe left in globals holds DDP, DDP its group: let go of it (the trainers are cycles,
    # hence the collection) so that destroy_process_group() joins Gloo's workers while Python is whole.
    # A worker left running into interpreter exit aborts the finished process when it lets go of a
    # collective's tensors (SIGABRT, "terminate called without an active exception").
    for name in ("model", "optimizer", "loader", "accelerator", "state", "trainer", "args"):
        globals().pop(name, None)
    gc.collect()
    dist.destroy_process_group()
    with open(f"result-{rank}.json", "w") as f:  # in the working directory: the test's tmp_path
        json.dump({
            "rank": rank, "updates": n, "updates_plain": n_ref,
            "late": (mine - ref).abs().max().item(), "at_once": (mine - sync).abs().max().item(),
            "moved": (mine - initial).abs().max().item(),
            "digest": hashlib.sha1(mine.numpy().tobytes()).hexdigest(),
            "threads": [alone, len(os.listdir("/proc/self/task"))]}, f)
"""

ACCELERATE = COMMON + """
from accelerate import Accelerator
from accelerate.utils import DDPCommunicationHookType, DistributedDataParallelKwargs


def build():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 3))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-3)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(*data()), batch_size=8)
    return model, optimizer, loader


loss_fn = nn.functional.cross_entropy
initial = flat(build()[0])


def plain(late: bool):
    \"\"\"Accelerate with torch's fp16 hook registered by DDP's kwargs; ``late``: each update one step late.\"\"\"
    model, optimizer, loader = build()
    accelerator = Accelerator(kwargs_handlers=[DistributedDataParallelKwargs(comm_hook=DDPCommunicationHookType.FP16)])
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    kept = None
    for x, y in loader:
        optimizer.zero_grad()
        accelerator.backward(loss_fn(model(x), y))
        if not late:
            optimizer.step()
            continue
        now = [p.grad.clone() for p in model.parameters()]
        if kept is not None:
            for p, g in zip(model.parameters(), kept):
                p.grad = g
            optimizer.step()
        kept = now
    if late:
        for p, g in zip(model.parameters(), kept):
            p.grad = g
        optimizer.step()
    return flat(model.module)


def recipe():
    global model, optimizer, loader
    model, optimizer, loader = build()
    exec(RECIPE, globals())
    return flat(model.module)


report(counted(recipe), counted(lambda: plain(late=True)), counted(lambda: plain(late=False)))
"""

HF_TRAINER = COMMON + """
import transformers


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 3))

    def forward(self, x, labels):
        logits = self.net(x)
        return {"loss": nn.functional.cross_entropy(logits, labels), "logits": logits}


x, y = data()
train_dataset = [{"x": x[i], "labels": y[i]} for i in range(len(y))]
initial = flat(Tiny())
out = os.path.join(os.getcwd(), "trainer-output")  # the test's tmp_path


def arguments():
    # the Trainer's defaults but for the run's length and what would write or log: AdamW, clipping at
    # 1.0, DDP with find_unused_parameters=True; a constant rate so that the flushed update counts
    return transformers.TrainingArguments(output_dir=out, max_steps=6, per_device_train_batch_size=8,
                                          learning_rate=0.05, lr_scheduler_type="constant", report_to="none",
                                          save_strategy="no", logging_strategy="no", disable_tqdm=True, seed=0)


class Plain(transformers.Trainer):
    \"\"\"torch's fp16 hook on the Trainer's DDP; ``late``: each update one step late, the last one
    applied at the end unclipped, as the recipe's flush does.\"\"\"

    def __init__(self, *args, late, **kwargs):
        super().__init__(*args, **kwargs)
        self.late, self.kept, self.unclipped = late, None, None
        self.add_callback(PlainHook(self))

    def training_step(self, *args, **kwargs):
        loss = super().training_step(*args, **kwargs)
        self.unclipped = [p.grad.clone() for p in self.model.parameters()]
        return loss

    def create_optimizer(self, *args, **kwargs):
        optimizer = super().create_optimizer(*args, **kwargs)
        self.raw_step = step = optimizer.step

        def late_step(*a, **k):
            now = [p.grad.clone() for p in self.model.parameters()]
            kept, self.kept = self.kept, now
            if kept is not None:
                for p, g in zip(self.model.parameters(), kept):
                    p.grad = g
                step(*a, **k)

        if self.late:
            optimizer.step = late_step
        return optimizer


class PlainHook(transformers.TrainerCallback):
    def __init__(self, trainer):
        self.trainer = trainer

    def on_train_begin(self, args, state, control, **kwargs):
        self.trainer.model_wrapped.register_comm_hook(None, fp16_compress_hook)

    def on_train_end(self, args, state, control, **kwargs):
        if self.trainer.late:
            for p, g in zip(self.trainer.model.parameters(), self.trainer.unclipped):
                p.grad = g
            self.trainer.raw_step()


def plain(late: bool):
    trainer = Plain(model=Tiny(), args=arguments(), train_dataset=train_dataset, late=late)
    trainer.train()
    assert trainer.model_wrapped.find_unused_parameters, "the Trainer's default DDP"
    return flat(trainer.model)


def recipe():
    global model, args, trainer
    model, args = Tiny(), arguments()
    exec(RECIPE, globals())
    assert trainer.model_wrapped.find_unused_parameters, "the Trainer's default DDP"
    return flat(trainer.model)


report(counted(recipe), counted(lambda: plain(late=True)), counted(lambda: plain(late=False)))
"""


def recipe(name: str) -> str:
    """The python block after docs/ddp-hook.md's ``<!-- recipe: NAME ... -->`` marker."""
    text = (ROOT / "docs" / "ddp-hook.md").read_text()
    found = re.search(rf"<!-- recipe: {re.escape(name)}\b[^>]*-->\s*```python\n(.*?)```", text, re.S)
    assert found, f"docs/ddp-hook.md has no recipe block {name!r}"
    return found.group(1)


def torchrun(harness: str, block: str, tmp_path) -> list[dict]:
    """``harness`` (which runs ``RECIPE``, the doc's block) on two CPU ranks; each rank's result."""
    script = tmp_path / "recipe.py"
    script.write_text(f"RECIPE = {block!r}\n{harness}")
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env.update(GLOO_SOCKET_IFNAME="lo", PYTHONPATH=str(ROOT), PIPESGD_TEST_TAG=uuid.uuid4().hex, OMP_NUM_THREADS="1",
               ACCELERATE_USE_CPU="true",  # what `accelerate launch --cpu` sets
               HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_DATASETS_OFFLINE="1", HF_HUB_DISABLE_TELEMETRY="1",
               HF_HOME=str(tmp_path / "hf"))
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                        str(script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=150)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    assert not tagged_processes(env["PIPESGD_TEST_TAG"]), "no process left behind"
    return [json.loads((tmp_path / f"result-{rank}.json").read_text()) for rank in (0, 1)]


@pytest.mark.timeout(180)
@pytest.mark.parametrize("name,harness", [("accelerate", ACCELERATE), ("hf-trainer", HF_TRAINER)])
def test_the_documented_recipe_is_the_plain_run_one_step_late(name, harness, tmp_path):
    results = torchrun(harness, recipe(name), tmp_path)
    for res in results:
        assert res["late"] <= TOLERANCE, f"{name}: differs from the plain run one step late: {res}"
        assert res["at_once"] > 1e-4, f"{name}: the plain run applied at once differs: {res}"
        assert res["moved"] > 1e-3, f"{name}: the optimizer stepped: {res}"
        assert res["updates"] == res["updates_plain"] == STEPS, f"{name}: as many updates as the plain run: {res}"
    assert results[0]["digest"] == results[1]["digest"], f"{name}: the replicas differ"
    for res in results:
        alone, after = res["threads"]
        assert after == alone, f"{name}: {after} threads after destroy_process_group(), {alone} before any group: a group outlived it"
