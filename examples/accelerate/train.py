"""A Hugging Face Accelerate training script, ready for ``ptops launch``.

Runs as is with ``torchrun --nproc-per-node 2 examples/accelerate/train.py``
(``Accelerator(cpu=True)`` trains as gloo DDP on CPU; drop ``--cpu`` on GPUs) and under ``ptops
launch --supervise -- python examples/accelerate/train.py --cpu``. The ``pr.*`` lines are the whole
ptops API (``ptops.rank``): without them ptops still restarts the script on a crash or hang; with
them a restart resumes exactly (model, optimizer, RNG, data position), NaNs roll back, and a
preemption saves first. ptops' checkpoints take the place of ``accelerator.save_state``.
"""

import argparse

import torch
import torch.nn as nn
from accelerate import Accelerator
from accelerate.utils import set_seed

import ptops.rank as pr


def batch(index: int, seed: int, rank: int, size: int = 16, dim: int = 32):
    """Deterministic synthetic data: the batch of one rank at one data position."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + index * 101 + rank)
    x = torch.randn(size, dim, generator=g)
    y = torch.sin(x[:, :1]) + 0.5 * x[:, 1:2]
    return x, y


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dim", type=int, default=32)
    p.add_argument("--cpu", action="store_true", help="train on CPU (gloo) even where a GPU is")
    args = p.parse_args()

    accelerator = Accelerator(cpu=args.cpu)
    set_seed(args.seed)  # the same initial weights on every rank
    net = nn.Sequential(
        nn.Linear(args.dim, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 1)
    )
    optim = torch.optim.AdamW(net.parameters(), lr=args.lr, weight_decay=0.01)
    model, optimizer = accelerator.prepare(net, optim)
    rank = accelerator.process_index

    start = pr.resume(model, optim)  # the wrapped model, the optimizer Accelerate wraps
    for group in optim.param_groups:
        group["lr"] = args.lr * pr.lr_factor()  # smaller after a numeric rollback
    for step in range(start + 1, args.steps + 1):
        pr.start_step(step)
        x, y = batch(pr.batch_index(step), args.seed, rank, dim=args.dim)
        loss = pr.loss(
            nn.functional.mse_loss(model(x.to(accelerator.device)), y.to(accelerator.device))
        )
        optimizer.zero_grad()
        accelerator.backward(loss)
        grad_norm = accelerator.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        mean_loss = accelerator.reduce(loss.detach(), reduction="mean")
        pr.end_step(step, loss=mean_loss, grad_norm=grad_norm, lr=optim.param_groups[0]["lr"])
        pr.checkpoint(step, model, optim, last=step == args.steps)
        if pr.should_stop():  # the supervisor asked for a save and a stop (preemption, Ctrl-C)
            break
        accelerator.print(f"step {step} loss {float(mean_loss):.5f}")
    # the DDP model goes before the process group: with torch 2.13 and gloo, a reducer that outlives
    # destroy_process_group can deadlock at exit (its last all-reduce freed under the GIL)
    del model, optimizer
    accelerator.free_memory()
    accelerator.end_training()


if __name__ == "__main__":
    main()
