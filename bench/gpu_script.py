"""The GPU check's own training script (driven by ``bench/gpu_check_script.py`` as
``ptops launch --supervise -- python bench/gpu_script.py ARGS``): a ~50M-parameter MLP on CUDA (CPU
and gloo with ``--cpu``) through the public ``ptops.rank`` API, one rank.

Saves are ``pr.checkpoint`` (synchronous DCP) or, with ``--async-ckpt``, the script's own async save
(``ptops.rank`` has none): DCP ``async_save`` staged by one persistent ``DefaultStager`` into pinned
host memory on CUDA, written on DCP's thread, committed by ``ptops.ckpt.SaveTransaction`` when
written, with the same state layout as ``pr.checkpoint`` so ``pr.resume`` reads it. Each save's
blocking time (what the training loop waited) goes to ``--timings`` as one JSON line.
``--oom-at-step S`` allocates at step S until CUDA runs out of memory, within a per-process cap so
the GPU stays usable (on CPU it raises the allocator's error text instead: the driver's path is the
same); with ``--oom-once FILE`` only the first attempt that reaches S does (the restart then
completes).
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn

import ptops.rank as pr
from ptops.ckpt import SaveTransaction


def batch(index: int, seed: int, size: int, dim: int, device: torch.device):
    """Deterministic synthetic data for a data position."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + index * 101)
    x = torch.randn(size, dim, generator=g)
    return x.to(device), torch.tanh(x).to(device)


def state(model: nn.Module, opt: torch.optim.Optimizer) -> dict:
    """The layout ``pr.checkpoint`` writes (model, optimizer, train_state), so ``pr.resume`` reads
    it."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, opt)
    return {
        "model": msd,
        "optimizer": osd,
        "train_state": {"skipped": torch.tensor(0), "rng_0": torch.get_rng_state(), "extra_0": {}},
    }


class AsyncSaver:
    """One save in flight at most: the next save first waits for the previous commit."""

    def __init__(self, root: Path, keep: int, pinned: bool):
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        self.root, self.keep = root, keep
        self.stager = DefaultStager(
            StagingOptions(
                use_pinned_memory=pinned,
                use_shared_memory=False,
                use_async_staging=False,
                use_non_blocking_copy=pinned,
            )
        )
        self.thread: threading.Thread | None = None
        self.errors: list[str] = []

    def wait(self) -> None:
        if self.thread is not None:
            self.thread.join()
            self.thread = None

    def save(self, step: int, model: nn.Module, opt: torch.optim.Optimizer) -> float:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

        t0 = time.monotonic()
        self.wait()
        txn = SaveTransaction(
            self.root, step, name=f"step-{step}", leader=True, world_size=1, keep=self.keep
        )
        if not txn.begin():
            self.errors.append(str(txn.error))
            return time.monotonic() - t0
        fut = dcp.async_save(
            state(model, opt),
            checkpoint_id=str(txn.path),
            async_stager=self.stager,
            async_checkpointer_type=AsyncCheckpointerType.THREAD,
        )
        fut = getattr(fut, "upload_completion", fut)
        blocking = time.monotonic() - t0

        def finish() -> None:
            err = None
            try:
                fut.result()
            except Exception as e:  # a failed write is a failed save, recorded
                err = e
            if not txn.commit(err, collective=False):
                self.errors.append(str(txn.error))

        self.thread = threading.Thread(target=finish, name="gpu-script-commit", daemon=True)
        self.thread.start()
        return blocking


def oom(device: torch.device) -> None:
    """Allocate 1 GiB blocks until the allocator refuses (a cap of what is in use + 4 GiB on
    CUDA)."""
    if device.type != "cuda":
        raise torch.OutOfMemoryError(
            "CUDA out of memory. Tried to allocate 1.00 GiB. (gpu_script --cpu: "
            "no GPU here, the allocator's text raised as is)"
        )
    total = torch.cuda.get_device_properties(device).total_memory
    cap = (torch.cuda.memory_reserved(device) + (4 << 30)) / total
    torch.cuda.set_per_process_memory_fraction(min(cap, 0.5), device)
    hold = []
    while True:
        hold.append(torch.empty(1 << 30, dtype=torch.uint8, device=device))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--dim", type=int, default=1280)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cpu", action="store_true", help="CPU and gloo (the driver's smoke test)")
    p.add_argument(
        "--async-ckpt", action="store_true", help="async DCP saves (pinned memory on CUDA)"
    )
    p.add_argument(
        "--ckpt-dir", default="", help="where async saves go (the run's checkpoints folder)"
    )
    p.add_argument("--keep", type=int, default=3)
    p.add_argument(
        "--interval", type=int, default=2, help="save every N steps (as checkpoint.interval)"
    )
    p.add_argument("--timings", default="", help="append one JSON line per save here")
    p.add_argument("--oom-at-step", type=int, default=0)
    p.add_argument(
        "--oom-once", default="", help="a marker file: only the first run to reach the step OOMs"
    )
    args = p.parse_args()

    cuda = torch.cuda.is_available() and not args.cpu
    dist.init_process_group(
        "cpu:gloo,cuda:nccl" if cuda else "gloo"
    )  # async DCP needs a CPU backend
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    torch.manual_seed(args.seed)
    d = args.dim

    def block() -> nn.Module:
        return nn.Sequential(nn.LayerNorm(d), nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    model = nn.Sequential(*[block() for _ in range(args.layers)]).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    params = sum(p.numel() for p in model.parameters())
    saver = AsyncSaver(Path(args.ckpt_dir), args.keep, pinned=cuda) if args.async_ckpt else None
    timings = Path(args.timings) if args.timings else None

    start = pr.resume(model, opt)
    print(
        f"gpu_script: {params / 1e6:.1f}M params on {device}, world {pr.world_size()}, from step "
        f"{start}",
        flush=True,
    )
    for step in range(start + 1, args.steps + 1):
        pr.start_step(step)
        if step == args.oom_at_step and not (args.oom_once and Path(args.oom_once).exists()):
            if args.oom_once:
                Path(args.oom_once).touch()
            oom(device)
        t0 = time.monotonic()
        x, y = batch(pr.batch_index(step), args.seed, args.batch, d, device)
        loss = pr.loss(nn.functional.mse_loss(model(x), y))
        opt.zero_grad()
        loss.backward()
        gn = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if cuda:
            torch.cuda.synchronize()
        rec = {"grad_norm": gn, "step_s": time.monotonic() - t0}
        if cuda:
            rec["memory_max_allocated_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
        pr.end_step(step, loss=loss.detach(), **rec)
        last = step == args.steps
        t0 = time.monotonic()
        if saver is not None and not last and step % args.interval == 0:
            blocking, mode = saver.save(step, model, opt), "async_pinned" if cuda else "async"
        else:
            if saver is not None and last:
                saver.wait()  # the last save is synchronous: the run ends on it
            saved = pr.checkpoint(step, model, opt, last=last, every=args.interval)
            blocking, mode = (time.monotonic() - t0, "sync") if saved else (None, None)
        if blocking is not None and timings is not None:
            with timings.open("a") as f:
                f.write(
                    json.dumps({"step": step, "mode": mode, "blocking_s": round(blocking, 5)})
                    + "\n"
                )
        if pr.should_stop():
            break
    if saver is not None:
        saver.wait()
        if saver.errors:
            raise RuntimeError(f"async saves failed: {saver.errors}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
