"""Benchmark ptops.ckpt on one process: sync vs async DCP save (blocking time),
manifest hashing, verify (manifest hashes / CRC without manifest), digest.

    .venv/bin/python bench/ckpt_async.py [--mb 64] [--dir /tmp/ptops-ckpt-bench]

`--mb` is the size of the model parameters; AdamW state triples the checkpoint.
Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
import warnings
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mb", type=float, default=64.0)
    ap.add_argument("--dir", default="/tmp/ptops-ckpt-bench")
    args = ap.parse_args()
    warnings.simplefilter("ignore")
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    from ptops.ckpt import commit, digest, verify, write_manifest
    from ptops.ckpt.async_save import AsyncCheckpointer

    root = Path(args.dir)
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    n = int(args.mb * (1 << 20) / 4)
    dim = 1024
    layers = max(1, n // (dim * dim))
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(dim, dim, bias=False) for _ in range(layers)])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, dim)).sum().backward()
    opt.step()

    def state(step):
        msd, osd = get_state_dict(model, opt, options=StateDictOptions(flatten_optimizer_state_dict=True))
        sd = dict(msd)
        sd["optimizer"] = osd
        sd["train_state"] = {"step": step}
        return sd

    out: dict = {"param_mb": round(layers * dim * dim * 4 / 2**20, 1)}
    t = time.perf_counter()
    dcp.save(state(1), checkpoint_id=str(root / "step-1"), no_dist=True)
    out["sync_save_s"] = round(time.perf_counter() - t, 3)
    ck = root / "step-1"
    mb = sum(f.stat().st_size for f in ck.iterdir()) / 2**20
    out["ckpt_mb"] = round(mb, 1)
    t = time.perf_counter()
    write_manifest(ck, 1, 1, {"torch": torch.__version__})
    dt = time.perf_counter() - t
    out["write_manifest_s"] = round(dt, 3)
    out["manifest_mb_per_s"] = round(mb / dt)
    commit(root, ck, deep=False)
    t = time.perf_counter()
    assert verify(ck).ok
    dt = time.perf_counter() - t
    out["verify_manifest_s"], out["verify_manifest_mb_per_s"] = round(dt, 3), round(mb / dt)
    (ck / "ptops-manifest.json").unlink()
    t = time.perf_counter()
    assert verify(ck).ok
    dt = time.perf_counter() - t
    out["verify_crc_no_manifest_s"], out["verify_crc_mb_per_s"] = round(dt, 3), round(mb / dt)
    t = time.perf_counter()
    assert verify(ck, deep=False).ok
    out["verify_quick_s"] = round(time.perf_counter() - t, 4)
    t = time.perf_counter()
    d = digest(ck)
    dt = time.perf_counter() - t
    out["digest_s"], out["digest_mb_per_s"] = round(dt, 3), round(mb / dt)

    ac = AsyncCheckpointer(root, keep_last=2)
    blocking, total = [], []
    for step in (2, 3, 4):
        rec = ac.save(state(step), step)
        # "training" continues while the write runs
        for _ in range(3):
            model(torch.randn(2, dim)).sum()
        rec = ac.wait()
        blocking.append(rec.blocking_s)
        total.append(rec.total_s)
    out["async_blocking_s"] = [round(x, 3) for x in blocking]
    out["async_total_s_incl_manifest_commit_prune"] = [round(x, 3) for x in total]
    out["left_after_prune"] = sorted(p.name for p in root.iterdir())
    out["digest_matches_after_async"] = digest(root / "step-4") == d
    print(json.dumps(out, indent=1))
    shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
