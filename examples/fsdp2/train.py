"""A plain PyTorch FSDP2 training script (``fully_shard``), ready for ``ptops launch``.

Runs as is with ``torchrun --nproc-per-node 2 examples/fsdp2/train.py`` (gloo on CPU, NCCL on GPUs)
and under ``ptops launch --supervise -- python examples/fsdp2/train.py``. The ``pr.*`` lines are the
whole ptops API (``ptops.rank``): drop them and ptops still restarts the script on a crash or hang;
keep them and a restart resumes exactly where the last checkpoint left off (model, optimizer, RNG,
data position), NaNs roll back, and a preemption saves first.
"""

import argparse

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import fully_shard

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
    args = p.parse_args()

    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", rank % torch.cuda.device_count()) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)

    torch.manual_seed(args.seed)  # the same initial weights on every rank
    model = nn.Sequential(
        nn.Linear(args.dim, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 1)
    )
    model.to(device)
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    if not cuda:  # gloo has no PREMUL_SUM: reduce gradients with SUM and divide locally
        for m in model.modules():
            if hasattr(m, "set_force_sum_reduction_for_comms"):
                m.set_force_sum_reduction_for_comms(True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)

    start = pr.resume(
        model, optimizer
    )  # 0 on a fresh start; else the step of the checkpoint loaded
    for group in optimizer.param_groups:
        group["lr"] = args.lr * pr.lr_factor()  # smaller after a numeric rollback
    for step in range(start + 1, args.steps + 1):
        pr.start_step(step)
        x, y = batch(pr.batch_index(step), args.seed, rank, dim=args.dim)
        loss = pr.loss(nn.functional.mse_loss(model(x.to(device)), y.to(device)))
        optimizer.zero_grad()
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        grad_norm = grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm
        optimizer.step()
        mean_loss = loss.detach().clone()
        dist.all_reduce(mean_loss)
        pr.end_step(
            step, loss=mean_loss / world, grad_norm=grad_norm, lr=optimizer.param_groups[0]["lr"]
        )
        pr.checkpoint(step, model, optimizer, last=step == args.steps)
        if pr.should_stop():  # the supervisor asked for a save and a stop (preemption, Ctrl-C)
            break
        if rank == 0:
            print(f"step {step} loss {float(mean_loss) / world:.5f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
