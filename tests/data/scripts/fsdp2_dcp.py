"""FSDP2 with torch's Distributed Checkpoint, as the PyTorch DCP tutorial writes it (no ptops in
it): ``fully_shard`` each block, an ``AppState`` Stateful for ``dcp.save`` / ``dcp.load``, a
checkpoint folder every --save-every steps, and a restart resumes from the newest one.
`torchrun --nproc-per-node 2 fsdp2_dcp.py` runs it on CPU (gloo)."""

import argparse
import os
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.fsdp import fully_shard


class AppState(Stateful):
    def __init__(self, model, optimizer, step=0):
        self.model, self.optimizer, self.step = model, optimizer, step

    def state_dict(self):
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        return {"model": model_sd, "optim": optim_sd, "step": self.step}

    def load_state_dict(self, state_dict):
        set_state_dict(
            self.model,
            self.optimizer,
            model_state_dict=state_dict["model"],
            optim_state_dict=state_dict["optim"],
        )
        self.step = state_dict["step"]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--save-every", type=int, default=4)
    p.add_argument("--ckpt-dir", default="dcp-ckpt")
    args = p.parse_args()

    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(32, 32) for _ in range(3)])
    for block in model:
        fully_shard(block)
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    state = AppState(model, optimizer)
    saved = sorted(Path(args.ckpt_dir).glob("step-*"), key=lambda d: int(d.name.split("-")[1]))
    if saved:
        dcp.load({"app": state}, checkpoint_id=str(saved[-1]))
        print(f"resumed from {saved[-1]} (step {state.step})", flush=True)
    g = torch.Generator().manual_seed(int(os.environ["RANK"]))
    for step in range(state.step + 1, args.steps + 1):
        x = torch.randn(8, 32, generator=g)
        loss = model(x).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        state.step = step
        if step % args.save_every == 0:
            dcp.save({"app": state}, checkpoint_id=f"{args.ckpt_dir}/step-{step}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
