"""A Hugging Face Accelerate loop as its docs write one (no ptops in it): `accelerator.prepare`,
`accelerator.backward`, `accelerator.save_state` every --save-every steps into its own step folders,
and a restart that finds the newest one `load_state`s it and skips the batches already seen.
`torchrun --nproc-per-node 2 accelerate_loop.py` runs it on CPU."""

import argparse
from pathlib import Path

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from accelerate.utils import set_seed
from torch.utils.data import DataLoader, TensorDataset


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--save-every", type=int, default=4)
    p.add_argument("--out", default="accel-out")
    args = p.parse_args()

    accelerator = Accelerator(cpu=True)
    set_seed(0)
    x = torch.randn(args.steps * 8 * accelerator.num_processes, 16)
    data = DataLoader(TensorDataset(x, x.sum(dim=1, keepdim=True)), batch_size=8)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer, data = accelerator.prepare(model, optimizer, data)

    start = 0
    saved = sorted(Path(args.out).glob("step-*"), key=lambda d: int(d.name.split("-")[1]))
    if saved:
        accelerator.load_state(str(saved[-1]))
        start = int(saved[-1].name.split("-")[1])
        accelerator.print(f"resumed from {saved[-1]}")
    batches = accelerator.skip_first_batches(data, start) if start else data
    model.train()
    for step, (inputs, targets) in enumerate(batches, start=start + 1):
        loss = F.mse_loss(model(inputs), targets)
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        if step % args.save_every == 0:
            accelerator.save_state(f"{args.out}/step-{step}")
    # no accelerator.end_training(): with torch 2.13 and gloo, destroying the process group while
    # the DDP reducer lives deadlocks or crashes now and then (also under plain torchrun); ptops
    # finds such a rank by its finishing budget (600 s) and restarts it, a test must not wait that


if __name__ == "__main__":
    main()
