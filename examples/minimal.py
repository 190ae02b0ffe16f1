"""The library in ten lines (README quotes the block between the markers).

    python examples/minimal.py                                       # one process
    torchrun --standalone --nproc-per-node 2 examples/minimal.py     # two workers, Gloo

Each worker fits its own random batches of a fixed linear teacher; PipeSGD averages the gradients
across workers, one step late, while the next forward/backward runs.
"""

import os

import torch
import torch.distributed as dist
import torch.nn.functional as F

from pipesgd import PipeSGD

if "WORLD_SIZE" in os.environ:
    dist.init_process_group("gloo")
rank = dist.get_rank() if dist.is_initialized() else 0
teacher = torch.randn(32, 4, generator=torch.Generator().manual_seed(0))
data = torch.Generator().manual_seed(1 + rank)  # each worker its own samples
torch.manual_seed(0)  # every replica starts from the same weights

# --- README example ---
model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
engine = PipeSGD(optimizer, model.parameters(), width=2, compressor="int8")  # replaces optimizer.step()
for step in range(200):
    x = torch.randn(64, 32, generator=data)
    optimizer.zero_grad()
    loss = F.cross_entropy(model(x), (x @ teacher).argmax(1))
    loss.backward()
    engine.step()  # launch this step's allreduce, apply the previous step's
engine.flush()  # apply the reduction still in flight
# --- end README example ---

engine.close()
if rank == 0:
    print(f"final loss {loss.item():.3f} after {engine.steps} steps")
if dist.is_initialized():
    dist.destroy_process_group()
