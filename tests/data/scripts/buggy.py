"""A plain DDP loop with a bug a restart cannot fix (no ptops in it).

--bug shape: every rank's forward fails before the first optimizer step (a shape mismatch).
--bug batch: rank 0 meets a bad batch at its third step, every time it gets there.
"""

import argparse
import os

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

p = argparse.ArgumentParser()
p.add_argument("--bug", choices=["shape", "batch"], required=True)
p.add_argument("--steps", type=int, default=6)
args = p.parse_args()

dist.init_process_group("gloo")
rank = int(os.environ["RANK"])
torch.manual_seed(0)
model = DDP(torch.nn.Linear(8, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(1, args.steps + 1):
    x = torch.randn(4, 16 if args.bug == "shape" else 8)
    if args.bug == "batch" and rank == 0 and step == 3:
        raise ValueError(f"batch {step} has no labels")
    loss = model(x).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
dist.destroy_process_group()
