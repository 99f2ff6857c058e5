"""Benchmark ptops.ckpt on one process: sync vs async DCP save (blocking time),
manifest hashing, verify (manifest hashes / CRC without manifest), digest; the
disk's sequential write bandwidth (dd conv=fdatasync) against the background
write throughput; optionally (--titan) the real TorchTitan adapter's blocking
time, async vs sync, on a debug-size llama3.

    .venv/bin/python bench/ckpt_async.py [--mb 64] [--dir /tmp/ptops-ckpt-bench] [--titan]
    # ~1 GB state
    .venv/bin/python bench/ckpt_async.py --mb 340 --titan --out bench/results/ckpt_async.json
    .venv/bin/python bench/ckpt_async.py --titan-only --titan-repeat 3 \\
        --out bench/results/ckpt_staging.json
    .venv/bin/python bench/ckpt_async.py --mb 340 --stager-only --saves 4 \\
        --out bench/results/ckpt_synthetic.json

`--mb` is the size of the model parameters; AdamW state triples the checkpoint.
Every synthetic run also measures the titan adapter's way of saving on the same state
(``persistent_stager``: one DefaultStager for all saves, against sync saves, a plain memcpy
and dd in the same run); ``--stager-only`` measures only that (and the old per-save stager
for comparison), skipping the manifest / verify / digest figures.
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
    ap.add_argument(
        "--titan", action="store_true", help="also measure the real titan adapter (2 launches)"
    )
    ap.add_argument("--titan-steps", type=int, default=12)
    ap.add_argument(
        "--titan-only",
        action="store_true",
        help="only the titan adapter (skip the synthetic state and dd)",
    )
    ap.add_argument(
        "--titan-repeat",
        type=int,
        default=1,
        help="async/sync launch pairs; the median ratio is reported",
    )
    ap.add_argument(
        "--saves",
        type=int,
        default=4,
        help="persistent-stager saves: the first (cold, allocating) is reported apart, the "
        "median of the rest",
    )
    ap.add_argument(
        "--stager-only",
        action="store_true",
        help="only the persistent stager vs sync / memcpy / dd (and the per-save stager), no "
        "manifest/verify/digest",
    )
    ap.add_argument(
        "--overlap-batch",
        type=int,
        default=16,
        help="batch of the forward/backward run while staging (the adapter's overlap); 0: no "
        "overlap figure",
    )
    ap.add_argument(
        "--writer-threads",
        type=int,
        default=0,
        help="also 2 steady saves with FileSystemWriter(thread_count=N) (the adapter uses 1); 0: "
        "not",
    )
    ap.add_argument(
        "--stager",
        choices=("flat", "default"),
        default="flat",
        help="the persistent stager measured: flat = the adapter's FlatStager "
        "(recipes/titan/staging.py, "
        "one batched copy into reused buffers), default = DCP's DefaultStager (the adapter's "
        "before)",
    )
    ap.add_argument(
        "--head-to-head",
        type=int,
        default=0,
        metavar="ROUNDS",
        help="only: FlatStager vs DefaultStager vs memcpy, interleaved ROUNDS times (staging "
        "alone, no write)",
    )
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
        # model and opt are deleted below (memory for the titan run) after the last call of state()
        msd, osd = get_state_dict(
            model,  # noqa: F821
            opt,  # noqa: F821
            options=StateDictOptions(flatten_optimizer_state_dict=True),
        )
        sd = dict(msd)
        sd["optimizer"] = osd
        sd["train_state"] = {"step": step}
        return sd

    out: dict = {"param_mb": round(layers * dim * dim * 4 / 2**20, 1)}
    if args.head_to_head:
        import datetime
        import os

        out["date_utc"] = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M")
        out["loadavg_start"] = [round(x, 2) for x in os.getloadavg()]
        out["head_to_head"] = head_to_head(state, args.head_to_head)
        out["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
        result = json.dumps(out, indent=1)
        print(result)
        if args.out:
            Path(args.out).write_text(result + "\n")
        return
    if args.stager_only:
        import datetime
        import os

        out["date_utc"] = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M")
        out["loadavg_start"] = [round(x, 2) for x in os.getloadavg()]
        out["disk_dd_mb_per_s_before"] = [dd_bandwidth(root, args.dd_mb) for _ in range(3)]
        out["raw_write_fsync_mb_per_s_before"] = raw_write(root, args.dd_mb)
        out["persistent_stager"] = persistent_stager(
            model,
            state,
            root,
            args.saves,
            args.overlap_batch,
            writer_threads=args.writer_threads,
            kind=args.stager,
        )
        out["staging_options"] = staging_options(state, reps=3)
        out["disk_dd_mb_per_s_after"] = [dd_bandwidth(root, args.dd_mb) for _ in range(3)]
        out["raw_write_fsync_mb_per_s_after"] = raw_write(root, args.dd_mb)
        out["per_save_stager"] = sync_vs_async(state, root, args.repeat)
        out["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
        out["summary"] = _summary(out)
        result = json.dumps(out, indent=1)
        print(result)
        if args.out:
            Path(args.out).write_text(result + "\n")
        shutil.rmtree(root, ignore_errors=True)
        return
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
    out["persistent_stager"] = persistent_stager(
        model, state, root, args.saves, args.overlap_batch, kind=args.stager
    )
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
    subprocess.run(
        ["dd", "if=/dev/zero", f"of={f}", "bs=8M", f"count={max(1, mb // 8)}", "conv=fdatasync"],
        check=True,
        capture_output=True,
    )
    dt = time.perf_counter() - t
    size = f.stat().st_size
    f.unlink()
    return round(size / 2**20 / dt, 1)


def raw_write(root: Path, mb: int) -> float:
    """Python writes of ``mb`` MiB of random bytes already in memory (8 MiB per write, as dd), then
    fsync: what the filesystem takes with no serialisation (MB/s)."""
    import os

    import torch

    mv = memoryview(torch.randn(mb << 18).numpy()).cast("B")
    f = root / "raw.bin"
    t = time.perf_counter()
    with open(f, "wb") as fh:
        for o in range(0, len(mv), 8 << 20):
            fh.write(mv[o : o + (8 << 20)])
        fh.flush()
        os.fsync(fh.fileno())
    dt = time.perf_counter() - t
    f.unlink()
    return round(mb / dt, 1)


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


def _med(xs: list) -> float:
    return sorted(xs)[len(xs) // 2] if xs else float("nan")


def make_memcpy(state) -> tuple:
    """The physical limit of staging: ``dst.copy_(src)`` of every tensor of the state (storages
    deduplicated, as the stager does) into buffers allocated and touched once. Returns
    (copy function returning its seconds, bytes)."""
    import torch

    srcs, seen = [], set()

    def walk(x) -> None:
        if isinstance(x, torch.Tensor):
            if x.untyped_storage().data_ptr() not in seen:
                seen.add(x.untyped_storage().data_ptr())
                srcs.append(x)
        elif isinstance(x, dict):
            for v in x.values():
                walk(v)
        elif isinstance(x, (list, tuple)):
            for v in x:
                walk(v)

    walk(state(0))
    dsts = [torch.empty_like(t) for t in srcs]
    for d, t in zip(dsts, srcs):
        d.copy_(t)  # fault the pages in once: the timed copies find them mapped

    @torch.no_grad()
    def memcpy() -> float:
        t0 = time.perf_counter()
        for d, t in zip(dsts, srcs):
            d.copy_(t)
        return time.perf_counter() - t0

    return memcpy, sum(t.untyped_storage().nbytes() for t in srcs)


def _stager(shared: bool = False, threaded: bool = True, kind: str = "default"):
    """``kind="flat"``: what the titan adapter builds on a CPU (``ProbeCheckpointManager._stager``):
    ``FlatStager``, one ``torch._foreach_copy_`` per save into persistent buffers. ``"default"``:
    DCP's DefaultStager as the adapter built it before (and still does with a GPU): pinned memory
    and non-blocking copies only with a GPU; no shared memory (one writer thread, no process)."""
    import torch

    if kind == "flat":
        from ptops.recipes.titan.staging import FlatStager

        return FlatStager(threaded=threaded)
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    gpu = torch.cuda.is_available()
    return DefaultStager(
        StagingOptions(
            use_pinned_memory=gpu,
            use_shared_memory=shared,
            use_async_staging=threaded,
            use_non_blocking_copy=gpu and threaded,
        )
    )


def _dir_mb(d: Path) -> float:
    return sum(f.stat().st_size for f in d.iterdir()) / 2**20


def serialize_only(state) -> float:
    """MB/s of torch.save (what DCP's writer runs per tensor: pickling, zip records, CRC32) of every
    tensor of the state into a sink that drops the bytes: the writer's CPU ceiling, no disk."""
    import io

    import torch

    class Sink(io.RawIOBase):
        def writable(self) -> bool:
            return True

        def write(self, b) -> int:
            return len(memoryview(b))

    ts = [t for t in state(0).values() if isinstance(t, torch.Tensor)]
    ts += [t for t in state(0)["optimizer"].values() if isinstance(t, torch.Tensor)]
    t0 = time.perf_counter()
    for t in ts:
        torch.save(t, Sink())
    return sum(t.nbytes for t in ts) / 2**20 / (time.perf_counter() - t0)


def persistent_stager(
    model,
    state,
    root: Path,
    saves: int,
    overlap_batch: int,
    memcpy=None,
    writer_threads: int = 0,
    kind: str = "flat",
) -> dict:
    """The titan adapter's async save on the synthetic state: ONE stager (``kind``, see ``_stager``)
    for every save (its CPU buffers are allocated and faulted in by the first save and reused
    after), passed to ``dcp.async_save(..., async_stager=...)``. Per save:

    - ``call_s``: time inside the async_save call (the stager copies in its own thread);
    - ``stage_s``: call start -> staging complete. A training loop must not modify the state (the
      optimizer step) before that, so with no overlap this is what it is blocked: the headline;
    - ``write_s``: staging complete -> upload complete (plan, serialise, write, fsync as DCP does),
      the caller idle meanwhile; MB/s, and its ratio to a ``dd`` of the same bytes in the same
      folder run next to it (before one save, after the next: the disk here is shared and its
      bandwidth bimodal, so a dd minutes away says little);
    - ``memcpy_s``: ``make_memcpy`` of the same bytes, just before the save;
    - ``sync_s``: ``dcp.save`` of the same state, just before.

    Save 1 is cold (the stager allocates); saves 2..N are steady state (median). With
    ``overlap_batch``, each steady save is followed by one more async save during which the
    caller runs one forward/backward of the model (no optimizer step) and only then waits for
    staging, as the adapter does: its blocking is call + the residual wait, and the
    forward/backward's slowdown against one run alone just before is the cost the overlap hides
    in compute (two cores shared by the copy, the writer and the model)."""
    import threading

    import torch
    import torch.distributed.checkpoint as dcp

    if memcpy is None:
        memcpy, nbytes = make_memcpy(state)
    else:
        memcpy, nbytes = memcpy
    stager = _stager(kind=kind)
    dim = model[0].in_features
    x = torch.randn(max(1, overlap_batch), dim)

    def fwd_bwd() -> float:
        t0 = time.perf_counter()
        model(x).sum().backward()
        return time.perf_counter() - t0

    def one(step: int, overlap: bool, threads: int = 1) -> dict:
        d = root / f"stager-{step}"
        writer = None if threads == 1 else dcp.FileSystemWriter(str(d), thread_count=threads)
        marks: dict = {}
        ev = {"staged": threading.Event(), "written": threading.Event()}

        def mark(name: str):  # runs in the stager / writer thread the moment its future completes
            return lambda f: (marks.setdefault(name, time.perf_counter()), ev[name].set())

        ts = time.perf_counter()
        sd = state(step)
        t0 = time.perf_counter()
        res = dcp.async_save(
            sd,
            checkpoint_id=None if writer else str(d),
            storage_writer=writer,
            no_dist=True,
            async_stager=stager,
        )
        call = time.perf_counter() - ts
        res.staging_completion.add_done_callback(mark("staged"))
        res.upload_completion.add_done_callback(mark("written"))
        r: dict = {"state_dict_s": t0 - ts, "call_s": call}
        if overlap:
            r["fwd_bwd_during_s"] = fwd_bwd()
            t1 = time.perf_counter()
            res.staging_completion.result()
            r["wait_after_fwd_bwd_s"] = time.perf_counter() - t1
            r["overlap_blocking_s"] = call + r["wait_after_fwd_bwd_s"]
        res.staging_completion.result()
        res.upload_completion.result()
        ev["staged"].wait()
        ev["written"].wait()
        r["stage_s"] = marks["staged"] - ts  # get_state_dict included, as in sync_s
        r["stager_copy_s"] = marks["staged"] - t0  # from the async_save call on
        r["write_s"] = marks["written"] - marks["staged"]
        r["mb"] = _dir_mb(d)
        r["write_mb_per_s"] = r["mb"] / r["write_s"]
        shutil.rmtree(d)
        return r

    def sync(step: int) -> float:
        d = root / f"sync-{step}"
        t0 = time.perf_counter()
        dcp.save(state(step), checkpoint_id=str(d), no_dist=True)
        dt = time.perf_counter() - t0
        shutil.rmtree(d)
        return dt

    rows, overlap_rows = [], []
    try:
        for i in range(saves):
            row = {"memcpy_s": memcpy(), "sync_s": sync(100 + i)}
            if (
                i % 2
            ):  # dd of the same bytes next to each save, before it or after it in turn: the disk is
                row["dd_mb_per_s"] = dd_bandwidth(
                    root, int(nbytes) >> 20
                )  # shared and bimodal here
            row.update(one(200 + i, overlap=False))
            if not i % 2:
                row["dd_mb_per_s"] = dd_bandwidth(root, int(nbytes) >> 20)
            row["write_over_dd"] = row["write_mb_per_s"] / row["dd_mb_per_s"]
            rows.append(row)
            if overlap_batch > 0 and i > 0:
                alone = fwd_bwd()
                o = one(300 + i, overlap=True)
                o["fwd_bwd_alone_s"] = alone
                o["fwd_bwd_slowdown_s"] = o["fwd_bwd_during_s"] - alone
                overlap_rows.append(o)
        threads_rows = [
            one(500 + i, overlap=False, threads=writer_threads)
            for i in range(2 if writer_threads else 0)
        ]
        ser = serialize_only(state)
    finally:
        stager.close()

    def r3(d: dict) -> dict:
        return {k: round(v, 4) if isinstance(v, float) else v for k, v in d.items()}

    steady = rows[1:] or rows
    med = {k: _med([r[k] for r in steady]) for k in rows[0]}
    out: dict = {
        "what": f"one {'FlatStager' if kind == 'flat' else 'DefaultStager'} for all saves; save "
        "1 cold, median of saves 2..N",
        "stager": kind,
        "stager_options": {
            "pinned": torch.cuda.is_available(),
            "shared_memory": False,
            "async_staging": True,
        },
        "state_bytes": nbytes,
        "ckpt_mb": round(rows[0]["mb"], 1),
        "saves": [r3(r) for r in rows],
        "first": r3(rows[0]),
        "steady_median": r3(med),
        "steady_ratio_stage_over_sync": round(med["stage_s"] / med["sync_s"], 4),
        "steady_ratio_call_over_sync": round(med["call_s"] / med["sync_s"], 4),
        "steady_stage_over_memcpy": round(_med([r["stage_s"] / r["memcpy_s"] for r in steady]), 3),
        "steady_stager_copy_over_memcpy": round(
            _med([r["stager_copy_s"] / r["memcpy_s"] for r in steady]), 3
        ),
        "first_stage_over_memcpy": round(rows[0]["stage_s"] / rows[0]["memcpy_s"], 3),
        "memcpy_gb_per_s": round(nbytes / 2**30 / med["memcpy_s"], 2),
        "stage_gb_per_s": round(nbytes / 2**30 / med["stage_s"], 2),
        "write_mb_per_s": round(med["write_mb_per_s"], 1),
        "steady_write_over_paired_dd": round(_med([r["write_over_dd"] for r in steady]), 3),
        "serialize_only_mb_per_s": round(ser, 1),
    }
    if threads_rows:
        out[f"writer_threads_{writer_threads}"] = {
            "saves": [r3(r) for r in threads_rows],
            "write_mb_per_s": round(_med([r["write_mb_per_s"] for r in threads_rows]), 1),
        }
    if overlap_rows:
        omed = {k: _med([o[k] for o in overlap_rows]) for k in overlap_rows[0]}
        out["overlap"] = {
            "what": f"one forward/backward (batch {overlap_batch}) between the save call and the "
            "wait for staging",
            "saves": [r3(o) for o in overlap_rows],
            "median": r3(omed),
            "ratio_blocking_over_sync": round(omed["overlap_blocking_s"] / med["sync_s"], 4),
            "ratio_blocking_plus_slowdown_over_sync": round(
                (omed["overlap_blocking_s"] + max(0.0, omed["fwd_bwd_slowdown_s"])) / med["sync_s"],
                4,
            ),
        }
    return out


def staging_options(state, reps: int = 3) -> dict:
    """Staging alone (no write) of the same state with each StagingOptions that can run on a CPU,
    a fresh stager each: cold (allocating) then ``reps`` reuses; a plain memcpy just before each."""
    import gc

    memcpy, nbytes = make_memcpy(state)
    out: dict = {}
    for name, kw in (
        ("FlatStager, thread (adapter)", {"kind": "flat"}),
        ("DefaultStager, thread, private memory (adapter before)", {}),
        ("FlatStager, thread (adapter), again", {"kind": "flat"}),
        ("DefaultStager, thread, shared memory", {"shared": True}),
        ("DefaultStager, caller's thread, private memory", {"threaded": False}),
    ):
        st = _stager(**kw)
        times, mc = [], []
        try:
            for i in range(1 + reps):
                mc.append(memcpy())
                sd = state(400 + i)
                t0 = time.perf_counter()
                staged = st.stage(sd)
                if hasattr(staged, "result"):
                    staged = staged.result()
                times.append(time.perf_counter() - t0)
                del staged
        finally:
            st.close()
            gc.collect()
        out[name] = {
            "cold_s": round(times[0], 4),
            "steady_s": [round(t, 4) for t in times[1:]],
            "memcpy_s": [round(t, 4) for t in mc],
            "steady_over_memcpy": round(_med([t / m for t, m in zip(times[1:], mc[1:])]), 3),
        }
    del memcpy
    gc.collect()
    return out


def head_to_head(state, rounds: int) -> dict:
    """Staging alone (no write), the adapter's FlatStager against DCP's DefaultStager (both
    persistent, threaded, private memory; warmed by one cold stage each) and a plain memcpy,
    interleaved round by round so that the shared machine's noise hits all three alike. Min and
    median of the rounds."""
    memcpy, nbytes = make_memcpy(state)
    st = {"flat": _stager(kind="flat"), "default": _stager()}
    times: dict = {"memcpy": [], "flat": [], "default": []}

    def stage(s) -> float:
        sd = state(600)
        t0 = time.perf_counter()
        r = s.stage(sd)
        r = r.result() if hasattr(r, "result") else r
        dt = time.perf_counter() - t0
        del r
        return dt

    try:
        for s in st.values():
            stage(s)  # cold: allocate and fault in
        for i in range(rounds):
            order = ["memcpy", "flat", "default"] if i % 2 == 0 else ["default", "flat", "memcpy"]
            for k in order:
                times[k].append(memcpy() if k == "memcpy" else stage(st[k]))
    finally:
        for s in st.values():
            s.close()
    out = {
        k: {
            "min_s": round(min(v), 4),
            "median_s": round(_med(v), 4),
            "all_s": [round(x, 4) for x in v],
        }
        for k, v in times.items()
    }
    out["bytes"] = nbytes
    for k in ("flat", "default"):
        out[f"{k}_over_memcpy_min"] = round(out[k]["min_s"] / out["memcpy"]["min_s"], 3)
        out[f"{k}_over_memcpy_median"] = round(out[k]["median_s"] / out["memcpy"]["median_s"], 3)
    return out


def _summary(out: dict) -> dict:
    """Issue 12's three checkpoint targets from one run."""
    ps = out["persistent_stager"]
    dds = out.get("disk_dd_mb_per_s_before", []) + out.get("disk_dd_mb_per_s_after", [])
    dd = max(dds) if dds else 0.0
    s = {
        "ckpt_mb": ps["ckpt_mb"],
        "sync_s": ps["steady_median"]["sync_s"],
        "async_call_s": ps["steady_median"]["call_s"],
        "async_stage_complete_s": ps["steady_median"]["stage_s"],
        "ratio_stage_complete_over_sync": ps["steady_ratio_stage_over_sync"],
        "target_blocking_le_0.10": ps["steady_ratio_stage_over_sync"] <= 0.10,
        "stage_over_memcpy": ps["steady_stage_over_memcpy"],
        "target_staging_le_2x_memcpy": ps["steady_stage_over_memcpy"] <= 2.0,
        "write_mb_per_s": ps["write_mb_per_s"],
        "dd_mb_per_s_max_of_6": dd,
        "dd_mb_per_s_median_of_6": _med(dds),
        "write_over_dd_max_of_6": round(ps["write_mb_per_s"] / dd, 3) if dd else None,
        "write_over_dd_median": round(ps["write_mb_per_s"] / _med(dds), 3) if dds else None,
        "steady_stager_copy_over_memcpy": ps["steady_stager_copy_over_memcpy"],
        "write_over_paired_dd": ps["steady_write_over_paired_dd"],
        "target_write_ge_0.70_dd": ps["steady_write_over_paired_dd"] >= 0.70,
        "first_save": {
            k: ps["first"][k] for k in ("call_s", "stage_s", "memcpy_s", "sync_s", "write_mb_per_s")
        },
        "per_save_stager_ratio": out.get("per_save_stager", {}).get(
            "blocking_ratio_async_over_sync"
        ),
    }
    if "overlap" in ps:
        s["overlap_ratio_blocking_over_sync"] = ps["overlap"]["ratio_blocking_over_sync"]
        s["overlap_ratio_blocking_plus_slowdown_over_sync"] = ps["overlap"][
            "ratio_blocking_plus_slowdown_over_sync"
        ]
    return s


def titan_engine(steps: int, repeat: int = 1) -> dict:
    """The real adapter (2 ranks, FSDP2, gloo) on a torchtitan debug-size llama3 (dim 256,
    6 layers, 16 heads; local 512-token vocabulary), checkpoint every 2 steps: blocking_s of
    the interval saves from the `checkpoint` events, async vs `titan.async_checkpoint=false`,
    ``repeat`` pairs launched back to back (the box is shared: each pair's ratio, and their
    median)."""
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
        sets = [
            f"train.steps={steps}",
            "checkpoint.interval=2",
            "checkpoint.keep=2",
            "titan.model.dim=256",
            "titan.model.n_layers=6",
            "titan.model.n_heads=16",
            f"titan.async_checkpoint={str(mode == 'async').lower()}",
        ]
        argv = [sys.executable, "-m", "ptops", "launch", "titan-tiny", "--run-dir", str(run / "r")]
        for s in sets:
            argv += ["--set", s]
        env = dict(os.environ, OMP_NUM_THREADS="1")
        subprocess.run(argv, cwd=repo, env=env, check=True, capture_output=True, timeout=900)
        evs = [
            json.loads(x)
            for x in (run / "r" / "events.jsonl").read_text().splitlines()
            if x.strip()
        ]
        ck = [
            e for e in evs if e["kind"] == "checkpoint" and e["step"] < steps
        ]  # interval saves only
        final = next(d for d in sorted((run / "r" / "checkpoints").glob("step-*")))
        mb = sum(f.stat().st_size for f in final.iterdir()) / 2**20
        bl = sorted(e["blocking_s"] for e in ck)
        tot = sorted(e["total_s"] for e in ck)
        out[mode] = {
            "saves": len(ck),
            "ckpt_mb": round(mb, 1),
            "blocking_s": [e["blocking_s"] for e in ck],
            "total_s": [e["total_s"] for e in ck],
            "median_blocking_s": bl[len(bl) // 2],
            "median_total_s": tot[len(tot) // 2],
            # where the blocking went (rank 0's checkpoint events): medians of each part
            "median_parts_s": {
                k: sorted(e[k] for e in ck)[len(ck) // 2]
                for k in ("prep_s", "state_dict_s", "call_s", "wait_s")
                if all(k in e for e in ck)
            },
            "qkv_split": sorted({e.get("qkv_split") or "-" for e in ck}),
            "skipped": [e["step"] for e in evs if e["kind"] == "checkpoint_skipped"],
            "verified": [e["step"] for e in evs if e["kind"] == "checkpoint_verified"],
        }
        shutil.rmtree(run, ignore_errors=True)
    out["blocking_ratio_async_over_sync"] = round(
        out["async"]["median_blocking_s"] / out["sync"]["median_blocking_s"], 4
    )
    return out


if __name__ == "__main__":
    main()
