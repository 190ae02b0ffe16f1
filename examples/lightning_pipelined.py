"""Pipe-SGD inside PyTorch Lightning's DDP: the pipelined comm hook through ``DDPStrategy``.

    python examples/lightning_pipelined.py            # two CPU processes (Lightning launches the second)

Each rank fits its own batches; DDP hands the optimizer the average of the previous step's
gradients (``pipesgd.hooks.pipelined`` around torch's ``fp16_compress_hook``, handed to
``DDPStrategy(ddp_comm_state=..., ddp_comm_hook=...)``, which registers it on CUDA devices; on the
CPU, where Lightning skips it, ``on_fit_start`` registers it on the DDP model). At the end rank 0
replays the same steps in one process (the width-2 rule: average of both ranks' gradients, with
the hook's fp16 rounding, applied one step late) and prints how far Lightning's weights are from it.
"""

from __future__ import annotations

import argparse

import torch
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import fp16_compress_hook
from torch.utils.data import DataLoader, TensorDataset

try:
    import lightning.pytorch as pl
    from lightning.pytorch.strategies import DDPStrategy
except ImportError:  # the standalone package
    import pytorch_lightning as pl
    from pytorch_lightning.strategies import DDPStrategy

from pipesgd.hooks import PipelinedState, pipelined

STEPS, BATCH, LR = 8, 16, 0.1


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(10, 32), nn.Tanh(), nn.Linear(32, 3))


def rank_data(rank: int) -> TensorDataset:
    g = torch.Generator().manual_seed(1000 + rank)
    return TensorDataset(torch.randn(STEPS * BATCH, 10, generator=g), torch.randint(0, 3, (STEPS * BATCH,), generator=g))


class Pipelined(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = make_model()
        # --- the hook ---
        self.hook_state = PipelinedState(self)  # its process groups are made at the first step

    def on_fit_start(self):
        if self.device.type == "cpu":  # DDPStrategy registers ddp_comm_hook on CUDA devices only
            self.trainer.strategy.model.register_comm_hook(self.hook_state, pipelined(fp16_compress_hook))

    def optimizer_step(self, epoch, batch_idx, optimizer, optimizer_closure):
        optimizer_closure()                    # forward and backward: DDP hands over the previous step's average
        if self.hook_state.ready():            # nothing at the first step
            optimizer.step()

    def on_train_end(self):
        self.hook_state.flush(self.trainer.optimizers[0])  # the step still in flight
        # --- end hook ---

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=LR, momentum=0.9)

    def train_dataloader(self):
        return DataLoader(rank_data(self.global_rank), batch_size=BATCH)


def replay() -> torch.Tensor:
    """The width-2 rule in one process: both ranks' gradients at the same weights, each cast to
    fp16 and halved, summed in fp16 (torch's fp16 hook), applied one step later."""
    net = make_model()
    opt = torch.optim.SGD(net.parameters(), lr=LR, momentum=0.9)
    data = [rank_data(r).tensors for r in range(2)]
    pending = None
    for t in range(STEPS + 1):
        avg = None
        if t < STEPS:
            grads = []
            for x, y in data:
                net.zero_grad()
                nn.functional.cross_entropy(net(x[t * BATCH:(t + 1) * BATCH]), y[t * BATCH:(t + 1) * BATCH]).backward()
                grads.append([p.grad.to(torch.float16).div_(2) for p in net.parameters()])
            avg = [(a + b).float() for a, b in zip(*grads)]
        if pending is not None:
            for p, g in zip(net.parameters(), pending):
                p.grad = g
            opt.step()
        pending = avg
    return torch.cat([p.detach().reshape(-1) for p in net.parameters()])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", default="lightning_logs", help="Lightning's default_root_dir")
    args = parser.parse_args()
    module = Pipelined()
    trainer = pl.Trainer(accelerator="cpu", devices=2, max_steps=STEPS, default_root_dir=args.root, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         use_distributed_sampler=False,
                         strategy=DDPStrategy(ddp_comm_state=module.hook_state,
                                              ddp_comm_hook=pipelined(fp16_compress_hook)))
    trainer.fit(module)
    if trainer.global_rank == 0:
        mine = torch.cat([p.detach().reshape(-1) for p in module.net.parameters()])
        moved = (mine - torch.cat([p.detach().reshape(-1) for p in make_model().parameters()])).abs().max()
        print(f"steps {module.hook_state.steps}; weights moved {moved.item():.3g}; "
              f"max |Lightning - width-2 replay| = {(mine - replay()).abs().max().item():.3g}")


if __name__ == "__main__":
    main()
