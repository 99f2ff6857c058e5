"""A plain DDP training script, written the way the PyTorch tutorials write one (no ptops in it).

Gradient accumulation over several micro-batches, a dataset read from slow storage (each sample
takes --io-latency seconds to read), an evaluation pass every --eval-every epochs, and its own
snapshot (model, optimizer, epoch) that rank 0 saves every --save-every epochs and every rank loads
back on a restart: `torchrun --nproc-per-node 2 ddp_accum.py` runs it as it is.
"""

import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


class RemoteDataset(Dataset):
    """Samples from a slow store: each read costs `latency` seconds."""

    def __init__(self, n, latency, seed):
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, 32, generator=g)
        self.y = (self.x[:, :4].sum(dim=1, keepdim=True) > 0).float()
        self.latency = latency

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        time.sleep(self.latency)
        return self.x[i], self.y[i]


class Trainer:
    def __init__(self, model, train_data, eval_data, optimizer, args):
        self.rank = int(os.environ["RANK"])
        self.model = model
        self.train_data = train_data
        self.eval_data = eval_data
        self.optimizer = optimizer
        self.args = args
        self.epochs_run = 0
        if os.path.exists(args.snapshot):
            self._load_snapshot(args.snapshot)
        self.model = DDP(self.model)

    def _load_snapshot(self, path):
        snapshot = torch.load(path, weights_only=True)
        self.model.load_state_dict(snapshot["MODEL_STATE"])
        self.optimizer.load_state_dict(snapshot["OPTIMIZER_STATE"])
        self.epochs_run = snapshot["EPOCHS_RUN"]
        print(f"[rank {self.rank}] resuming from snapshot at epoch {self.epochs_run}", flush=True)

    def _save_snapshot(self, epoch):
        snapshot = {
            "MODEL_STATE": self.model.module.state_dict(),
            "OPTIMIZER_STATE": self.optimizer.state_dict(),
            "EPOCHS_RUN": epoch + 1,
        }
        tmp = self.args.snapshot + ".tmp"
        torch.save(snapshot, tmp)
        os.replace(tmp, self.args.snapshot)
        print(f"epoch {epoch} | snapshot saved at {self.args.snapshot}", flush=True)

    def _run_epoch(self, epoch):
        self.train_data.sampler.set_epoch(epoch)
        self.model.train()
        self.optimizer.zero_grad()
        for i, (source, targets) in enumerate(self.train_data):
            if self.args.slow_first and epoch == self.epochs_run and i == 0:
                time.sleep(self.args.slow_first)  # a first step that builds caches, compiles...
            loss = F.binary_cross_entropy_with_logits(self.model(source), targets)
            (loss / self.args.accum).backward()
            if (i + 1) % self.args.accum == 0:
                self.optimizer.step()
                self.optimizer.zero_grad()
        print(f"[rank {self.rank}] epoch {epoch} | loss {loss.item():.4f}", flush=True)

    def _evaluate(self, epoch):
        self.model.eval()
        total = torch.zeros(2)
        with torch.no_grad():
            for source, targets in self.eval_data:
                pred = self.model(source) > 0
                total += torch.tensor([(pred == targets.bool()).sum().item(), len(targets)])
        dist.all_reduce(total)
        if self.rank == 0:
            print(f"epoch {epoch} | eval accuracy {total[0] / total[1]:.3f}", flush=True)

    def train(self):
        for epoch in range(self.epochs_run, self.args.epochs):
            self._run_epoch(epoch)
            if (epoch + 1) % self.args.eval_every == 0:
                self._evaluate(epoch)
            if (epoch + 1) % self.args.save_every == 0:
                if self.rank == 0:
                    self._save_snapshot(epoch)
                dist.barrier()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--batches", type=int, default=4, help="micro-batches per epoch and rank")
    p.add_argument("--accum", type=int, default=2, help="micro-batches per optimizer step")
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--io-latency", type=float, default=0.0)
    p.add_argument("--eval-every", type=int, default=2)
    p.add_argument("--eval-batches", type=int, default=2)
    p.add_argument("--save-every", type=int, default=1)
    p.add_argument("--snapshot", default="snapshot.pt")
    p.add_argument("--slow-first", type=float, default=0.0, help="extra seconds of the first step")
    args = p.parse_args()

    dist.init_process_group("gloo")
    torch.manual_seed(0)
    world = dist.get_world_size()
    n = args.batches * args.batch_size * world
    train_set = RemoteDataset(n, args.io_latency, seed=1)
    eval_set = RemoteDataset(args.eval_batches * args.batch_size * world, args.io_latency, seed=2)
    train_data = DataLoader(
        train_set, batch_size=args.batch_size, shuffle=False, sampler=DistributedSampler(train_set)
    )
    eval_data = DataLoader(
        eval_set, batch_size=args.batch_size, sampler=DistributedSampler(eval_set, shuffle=False)
    )
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    Trainer(model, train_data, eval_data, optimizer, args).train()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
