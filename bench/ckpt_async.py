"""Benchmark ptops.ckpt on one process: sync vs async DCP save (blocking time),
manifest hashing, verify (manifest hashes / CRC without manifest), digest; the
disk's sequential write bandwidth (dd conv=fdatasync) against the background
write throughput; optionally (--titan) the real TorchTitan adapter's blocking
time, async vs sync, on a debug-size llama3.

    .venv/bin/python bench/ckpt_async.py [--mb 64] [--dir /tmp/ptops-ckpt-bench] [--titan]
    .venv/bin/python bench/ckpt_async.py --mb 340 --titan --out bench/results/ckpt_async.json  # ~1 GB state
    .venv/bin/python bench/ckpt_async.py --titan-only --titan-repeat 3 --out bench/results/ckpt_staging.json

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
    ap.add_argument("--repeat", type=int, default=3, help="sync/async pairs of the same state")
    ap.add_argument("--dd-mb", type=int, default=1024, help="size of the dd write (conv=fdatasync)")
    ap.add_argument("--titan", action="store_true", help="also measure the real titan adapter (2 launches)")
    ap.add_argument("--titan-steps", type=int, default=12)
    ap.add_argument("--titan-only", action="store_true", help="only the titan adapter (skip the synthetic state and dd)")
    ap.add_argument("--titan-repeat", type=int, default=1, help="async/sync launch pairs; the median ratio is reported")
    ap.add_argument("--out", help="also write the JSON here")
    args = ap.parse_args()
    warnings.simplefilter("ignore")
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    from ptops.ckpt import commit, digest, verify, write_manifest

    if args.titan_only:
        out = {"titan_engine": titan_engine(args.titan_steps, args.titan_repeat)}
        result = json.dumps(out, indent=1)
        print(result)
        if args.out:
            Path(args.out).write_text(result + "\n")
        return

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

    blocking, total = [], []
    for step in (2, 3, 4):
        save = async_save(state(step), root, step, keep=2)
        blocking.append(save["blocking_s"])
        # "training" continues while the write runs
        for _ in range(3):
            model(torch.randn(2, dim)).sum()
        save["wait"]()
        total.append(save["total_s"])
    out["async_blocking_s"] = [round(x, 3) for x in blocking]
    out["async_total_s_incl_manifest_commit_prune"] = [round(x, 3) for x in total]
    out["left_after_prune"] = sorted(p.name for p in root.iterdir())
    out["digest_matches_after_async"] = digest(root / "step-4") == d
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)

    # ---- sync vs async blocking of the same state, and write throughput vs the disk (dd)
    out["disk_dd_mb_per_s"] = dd_bandwidth(root, args.dd_mb)
    out["sync_vs_async"] = sync_vs_async(state, root, args.repeat)
    del model, opt
    if args.titan:
        out["titan_engine"] = titan_engine(args.titan_steps, args.titan_repeat)
    result = json.dumps(out, indent=1)
    print(result)
    if args.out:
        Path(args.out).write_text(result + "\n")
    shutil.rmtree(root, ignore_errors=True)


def dd_bandwidth(root: Path, mb: int) -> float:
    """Sequential write bandwidth of the checkpoint disk: dd with conv=fdatasync (MB/s)."""
    import subprocess

    f = root / "dd.bin"
    t = time.perf_counter()
    subprocess.run(["dd", "if=/dev/zero", f"of={f}", "bs=8M", f"count={max(1, mb // 8)}", "conv=fdatasync"],
                   check=True, capture_output=True)
    dt = time.perf_counter() - t
    size = f.stat().st_size
    f.unlink()
    return round(size / 2**20 / dt, 1)


def async_save(state_dict, root: Path, step: int, keep: int) -> dict:
    """One process: dcp.async_save, then (in the background, once written) ptops' save
    transaction commits it (manifest, LATEST, retention). ``wait()`` blocks until committed
    and fills ``total_s``; blocking_s is what training waits for."""
    import threading

    import torch.distributed.checkpoint as dcp

    from ptops.ckpt import SaveTransaction

    t0 = time.perf_counter()
    txn = SaveTransaction(root, step, keep=keep)
    assert txn.begin()
    fut = dcp.async_save(state_dict, checkpoint_id=str(txn.path), no_dist=True)
    if hasattr(fut, "upload_completion"):
        fut = fut.upload_completion
    out: dict = {"blocking_s": time.perf_counter() - t0}
    done = threading.Event()

    def finish(f) -> None:
        txn.commit(f.exception(), collective=False)
        out["total_s"] = time.perf_counter() - t0
        done.set()

    fut.add_done_callback(lambda f: threading.Thread(target=finish, args=(f,), daemon=True).start())

    def wait() -> None:
        done.wait()
        if not txn.ok:
            raise RuntimeError(f"checkpoint step {step} failed: {txn.error}")

    out["wait"] = wait
    return out


def sync_vs_async(state, root: Path, repeat: int) -> dict:
    """The same state saved with dcp.save and with dcp.async_save (what the titan adapter's
    async_mode="async" calls): time the caller is blocked, and the background write."""
    import torch.distributed.checkpoint as dcp

    from ptops.ckpt import commit, write_manifest

    res: dict = {"sync_s": [], "async_blocking_s": [], "async_write_s": [], "async_commit_s": []}
    mb = 0.0
    for i in range(repeat):
        d = root / f"step-{10 + i}"
        t = time.perf_counter()
        dcp.save(state(10 + i), checkpoint_id=str(d), no_dist=True)
        res["sync_s"].append(time.perf_counter() - t)
        mb = sum(f.stat().st_size for f in d.iterdir()) / 2**20
        shutil.rmtree(d)
        d = root / f"step-{20 + i}"
        t = time.perf_counter()
        fut = dcp.async_save(state(20 + i), checkpoint_id=str(d), no_dist=True)
        if hasattr(fut, "upload_completion"):
            fut = fut.upload_completion
        res["async_blocking_s"].append(time.perf_counter() - t)
        fut.result()
        res["async_write_s"].append(time.perf_counter() - t - res["async_blocking_s"][-1])
        t2 = time.perf_counter()
        write_manifest(d, 20 + i, 1)
        commit(root, d, deep=False)
        res["async_commit_s"].append(time.perf_counter() - t2)
        shutil.rmtree(d)
    med = {k: sorted(v)[len(v) // 2] for k, v in res.items()}
    gb = mb / 1024
    return {
        "ckpt_mb": round(mb, 1),
        **{k: [round(x, 3) for x in v] for k, v in res.items()},
        "median_sync_s": round(med["sync_s"], 3),
        "median_async_blocking_s": round(med["async_blocking_s"], 3),
        "blocking_ratio_async_over_sync": round(med["async_blocking_s"] / med["sync_s"], 3),
        "async_blocking_ms_per_gb": round(1000 * med["async_blocking_s"] / gb, 1),
        "sync_ms_per_gb": round(1000 * med["sync_s"] / gb, 1),
        "async_write_mb_per_s": round(mb / med["async_write_s"], 1),
        "sync_write_mb_per_s": round(mb / med["sync_s"], 1),
        "manifest_and_commit_mb_per_s": round(mb / med["async_commit_s"], 1),
    }


def titan_engine(steps: int, repeat: int = 1) -> dict:
    """The real adapter (2 ranks, FSDP2, gloo) on a torchtitan debug-size llama3 (dim 256,
    6 layers, 16 heads; local 512-token vocabulary), checkpoint every 2 steps: blocking_s of
    the interval saves from the `checkpoint` events, async vs `titan.async_checkpoint=false`,
    ``repeat`` pairs launched back to back (the box is shared: each pair's ratio, and their median)."""
    import statistics

    pairs = [_titan_pair(steps) for _ in range(repeat)]
    out: dict = {"pairs": pairs, "ratios": [p["blocking_ratio_async_over_sync"] for p in pairs]}
    out["median_blocking_ratio_async_over_sync"] = round(statistics.median(out["ratios"]), 4)
    if repeat == 1:
        out.update(pairs[0])
    return out


def _titan_pair(steps: int) -> dict:
    import os
    import subprocess
    import sys
    import tempfile

    repo = Path(__file__).resolve().parent.parent
    out: dict = {}
    for mode in ("async", "sync"):
        run = Path(tempfile.mkdtemp(prefix=f"ptops-bench-titan-{mode}-"))
        sets = [f"train.steps={steps}", "checkpoint.interval=2", "checkpoint.keep=2", "titan.model.dim=256",
                "titan.model.n_layers=6", "titan.model.n_heads=16", f"titan.async_checkpoint={str(mode == 'async').lower()}"]
        argv = [sys.executable, "-m", "ptops", "launch", "titan-tiny", "--run-dir", str(run / "r")]
        for s in sets:
            argv += ["--set", s]
        env = dict(os.environ, OMP_NUM_THREADS="1")
        subprocess.run(argv, cwd=repo, env=env, check=True, capture_output=True, timeout=900)
        evs = [json.loads(x) for x in (run / "r" / "events.jsonl").read_text().splitlines() if x.strip()]
        ck = [e for e in evs if e["kind"] == "checkpoint" and e["step"] < steps]  # interval saves only
        final = next(d for d in sorted((run / "r" / "checkpoints").glob("step-*")))
        mb = sum(f.stat().st_size for f in final.iterdir()) / 2**20
        bl = sorted(e["blocking_s"] for e in ck)
        tot = sorted(e["total_s"] for e in ck)
        out[mode] = {"saves": len(ck), "ckpt_mb": round(mb, 1), "blocking_s": [e["blocking_s"] for e in ck],
                     "total_s": [e["total_s"] for e in ck], "median_blocking_s": bl[len(bl) // 2],
                     "median_total_s": tot[len(tot) // 2],
                     "skipped": [e["step"] for e in evs if e["kind"] == "checkpoint_skipped"],
                     "verified": [e["step"] for e in evs if e["kind"] == "checkpoint_verified"]}
        shutil.rmtree(run, ignore_errors=True)
    out["blocking_ratio_async_over_sync"] = round(out["async"]["median_blocking_s"] / out["sync"]["median_blocking_s"], 4)
    return out


if __name__ == "__main__":
    main()
