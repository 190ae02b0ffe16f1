"""examples/ddp_tutorial.py ported to pipesgd: the "after" of docs/porting-from-ddp.md. A diff of
the two files is the whole port.

    torchrun --standalone --nproc-per-node 2 examples/ddp_tutorial_pipesgd.py --data-root ../shared/data

MNIST comes from --data-root (nothing is downloaded; random images if it is absent). Rank 0 ends
with one line: the sha256 of the final parameters and the test accuracy.
"""

import argparse
import hashlib
import os

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed import destroy_process_group, init_process_group
from torch.optim.lr_scheduler import StepLR
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from pipesgd import PipeSGD
from pipesgd.data import MNIST, DatasetError


def ddp_setup() -> torch.device:
    """torchrun sets RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT."""
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
        init_process_group(backend="nccl", device_id=device)
        return device
    init_process_group(backend="gloo")
    return torch.device("cpu")


class Net(nn.Module):
    """The PyTorch MNIST example's convolutional network."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 32, 3, 1)
        self.conv2 = nn.Conv2d(32, 64, 3, 1)
        self.dropout1 = nn.Dropout(0.25)
        self.dropout2 = nn.Dropout(0.5)
        self.fc1 = nn.Linear(9216, 128)
        self.fc2 = nn.Linear(128, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.conv2(F.relu(self.conv1(x)))), 2)
        x = F.relu(self.fc1(torch.flatten(self.dropout1(x), 1)))
        return F.log_softmax(self.fc2(self.dropout2(x)), dim=1)


class Trainer:
    def __init__(self, model: nn.Module, train_data: DataLoader, optimizer: torch.optim.Optimizer,
                 scheduler: StepLR, device: torch.device, save_every: int, snapshot_path: str,
                 max_steps_per_epoch: int, seed: int, width: int, staleness: str):
        self.global_rank = int(os.environ["RANK"])
        self.device = device
        self.model = model.to(device)
        self.train_data = train_data
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.save_every = save_every
        self.snapshot_path = f"{snapshot_path}.rank{self.global_rank}"  # engine state may differ per rank
        self.max_steps_per_epoch = max_steps_per_epoch
        self.seed = seed
        self.epochs_run = 0
        self.engine = PipeSGD(optimizer, self.model.parameters(), width=width, module=self.model,
                              staleness=staleness)
        if os.path.exists(self.snapshot_path):
            self._load_snapshot(self.snapshot_path)

    def _load_snapshot(self, path: str) -> None:
        snapshot = torch.load(path, map_location=self.device)
        self.model.load_state_dict(snapshot["MODEL_STATE"])
        self.optimizer.load_state_dict(snapshot["OPTIMIZER_STATE"])
        self.scheduler.load_state_dict(snapshot["SCHEDULER_STATE"])
        self.engine.load_state_dict(snapshot["ENGINE_STATE"])
        self.epochs_run = snapshot["EPOCHS_RUN"]
        print(f"[rank {self.global_rank}] resuming from the snapshot at epoch {self.epochs_run}")

    def _run_batch(self, source: torch.Tensor, targets: torch.Tensor) -> None:
        self.optimizer.zero_grad()
        with self.engine.forward_context():  # the weights the staleness rule wants the gradient at
            output = self.model(source)
            loss = F.nll_loss(output, targets)
            loss.backward()
        self.engine.step()

    def _run_epoch(self, epoch: int) -> None:
        torch.manual_seed(self.seed + 1000 * epoch + self.global_rank)  # dropout: resumable per epoch
        self.train_data.sampler.set_epoch(epoch)
        for step, (source, targets) in enumerate(self.train_data):
            if step == self.max_steps_per_epoch:
                break
            self._run_batch(source.to(self.device), targets.to(self.device))

    def _save_snapshot(self, epoch: int) -> None:
        snapshot = {
            "MODEL_STATE": self.model.state_dict(),
            "OPTIMIZER_STATE": self.optimizer.state_dict(),
            "SCHEDULER_STATE": self.scheduler.state_dict(),
            "ENGINE_STATE": self.engine.state_dict(),  # the updates still in flight
            "EPOCHS_RUN": epoch + 1,
        }
        torch.save(snapshot, self.snapshot_path + ".tmp")
        os.replace(self.snapshot_path + ".tmp", self.snapshot_path)  # never half a snapshot
        print(f"[rank {self.global_rank}] epoch {epoch} done, snapshot saved at {self.snapshot_path}")

    def train(self, max_epochs: int) -> None:
        for epoch in range(self.epochs_run, max_epochs):
            self._run_epoch(epoch)
            self.scheduler.step()
            if (epoch + 1) % self.save_every == 0:
                self._save_snapshot(epoch)
        self.engine.flush()  # apply the updates still in flight
        self.engine.close()


def load_train_objs(data_root: str, test_samples: int) -> tuple[TensorDataset, TensorDataset, nn.Module,
                                                                 torch.optim.Optimizer]:
    try:
        data = MNIST(data_root, download=False)
        data.prepare()
        train, test = data.load()
        images = [(s.images.float() / 255 - 0.1307) / 0.3081 for s in (train, test)]
        train_set = TensorDataset(images[0], train.labels)
        test_set = TensorDataset(images[1][:test_samples], test.labels[:test_samples])
    except DatasetError as e:
        print(f"{e}; random images instead")
        g = torch.Generator().manual_seed(0)
        train_set = TensorDataset(torch.randn(2048, 1, 28, 28, generator=g), torch.randint(0, 10, (2048,), generator=g))
        test_set = TensorDataset(torch.randn(256, 1, 28, 28, generator=g), torch.randint(0, 10, (256,), generator=g))
    model = Net()
    optimizer = torch.optim.Adadelta(model.parameters(), lr=1.0)
    return train_set, test_set, model, optimizer


def prepare_dataloader(dataset: TensorDataset, batch_size: int) -> DataLoader:
    return DataLoader(dataset, batch_size=batch_size, pin_memory=torch.cuda.is_available(), shuffle=False,
                      sampler=DistributedSampler(dataset))


@torch.no_grad()
def evaluate(model: nn.Module, test_set: TensorDataset, device: torch.device) -> float:
    model.eval()
    correct = sum(int((model(x.to(device)).argmax(1) == y.to(device)).sum())
                  for x, y in DataLoader(test_set, batch_size=1000))
    return 100.0 * correct / len(test_set)


def checksum(model: nn.Module) -> str:
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().cpu().contiguous().view(torch.uint8).numpy())
    return h.hexdigest()


def main(args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    device = ddp_setup()
    torch.manual_seed(args.seed)  # the same initial weights on every rank
    train_set, test_set, model, optimizer = load_train_objs(args.data_root, args.test_samples)
    scheduler = StepLR(optimizer, step_size=1, gamma=0.7)
    train_data = prepare_dataloader(train_set, args.batch_size)
    trainer = Trainer(model, train_data, optimizer, scheduler, device, args.save_every, args.snapshot,
                      args.max_steps_per_epoch, args.seed, args.width, args.staleness)
    trainer.train(args.epochs)
    if trainer.global_rank == 0:
        net = trainer.model
        print(f"final params sha256 {checksum(net)} test accuracy {evaluate(net, test_set, device):.2f}%")
    destroy_process_group()


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--save-every", type=int, default=1, help="epochs between snapshots")
    p.add_argument("--batch-size", type=int, default=64, help="per worker")
    p.add_argument("--max-steps-per-epoch", type=int, default=-1, help="-1: the whole shard")
    p.add_argument("--snapshot", default="snapshot.pt")
    p.add_argument("--data-root", default=os.environ.get("PIPESGD_DATA", "data"))
    p.add_argument("--test-samples", type=int, default=10_000)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--width", type=int, default=2, help="pipeline width K (1 = synchronous, as DDP)")
    p.add_argument("--staleness", default="none", help="update rule, e.g. lookahead (docs/convergence.md)")
    return p.parse_args()


if __name__ == "__main__":
    main(parse())
