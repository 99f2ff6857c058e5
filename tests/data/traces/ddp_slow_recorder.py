"""2-rank gloo DDP: rank 1 sleeps `slow_s` before each step from step 6 on (like a `slow` fault),
or computes slower (extra matmuls) with MODE=compute. Records step_s two ways + compute/wait
split."""

import json
import os
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
mode = os.environ.get("MODE", "sleep")
slow_s = float(os.environ.get("SLOW_S", "0.3"))
model = DDP(
    torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 256))
)
opt = torch.optim.SGD(model.parameters(), lr=1e-3)
x = torch.randn(64, 256)
out = []
last_end = time.monotonic()
for step in range(1, 21):
    slow = rank == 1 and step >= 6
    if slow and mode == "sleep":
        time.sleep(slow_s)  # before the step, like probe.before_step
    t0 = time.monotonic()
    loss = model(x).pow(2).mean()
    if slow and mode == "compute":
        y = torch.randn(800, 800)
        for _ in range(6):
            y = y @ y / 800  # rank-local extra compute inside the step
    t_fwd = time.monotonic()
    loss.backward()  # allreduce inside: waits for the slow rank
    opt.step()
    opt.zero_grad()
    t1 = time.monotonic()
    out.append(
        {
            "step": step,
            "rank": rank,
            "attempt": 1,
            "loss": float(loss),
            "step_s": t1 - t0,
            "step_s_end_to_end": t1 - last_end,
            "fwd_s": t_fwd - t0,
        }
    )
    last_end = t1
with open(os.environ["OUT"] + f".rank{rank}", "w") as f:
    for r in out:
        f.write(json.dumps(r) + "\n")
dist.destroy_process_group()
