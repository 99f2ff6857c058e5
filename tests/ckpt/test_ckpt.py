"""Tests for ptops.ckpt on real checkpoints.

A session fixture writes, in two subprocesses running side by side:
* DCP: a TorchTitan-layout state (flat model keys, `optimizer.*` flattened FQN state,
  `lr_scheduler`, `train_state`, `dataloader`) saved with `torch.distributed.checkpoint`
  after steps 1, 2, 3 from one process, and the step-3 state re-saved from 2 gloo ranks
  with FSDP2 (`fully_shard`, DTensor shards) -> 2 `.distcp` files;
* TRL/HF: a real `transformers.Trainer` run (tiny Qwen2, 4 steps, save_steps=2).
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from conftest import REPO

from ptops.ckpt import (
    RESUME_ENV,
    ManifestError,
    SaveTransaction,
    checkpoint_path,
    commit,
    digest,
    is_writing,
    latest_good,
    list_checkpoints,
    prune,
    quarantine,
    read_latest,
    resume_point,
    shard_files,
    verify,
    write_manifest,
)

DCP_GEN = textwrap.dedent(
    """
    import os, sys, pickle, warnings
    warnings.simplefilter("ignore")
    import torch, torch.nn as nn
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    import torch.multiprocessing as mp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict, StateDictOptions
    OPTS = StateDictOptions(flatten_optimizer_state_dict=True)

    class M(nn.Module):
        def __init__(s):
            super().__init__(); s.a = nn.Linear(8, 16); s.b = nn.Linear(16, 4)
        def forward(s, x): return s.b(torch.relu(s.a(x)))

    def titan_sd(m, opt, step):
        msd, osd = get_state_dict(m, opt, options=OPTS)
        sd = dict(msd); sd["optimizer"] = osd
        sd["lr_scheduler"] = {"last_epoch": step}
        sd["train_state"] = {"step": step, "ntokens_seen": 16 * step}
        sd["dataloader"] = {"dp_rank_0": pickle.dumps({"pos": step}), "world_size": 1}
        return sd

    def worker(rank, ws, src, dst, port):
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=rank, world_size=ws)
        from torch.distributed.fsdp import fully_shard
        torch.manual_seed(0); m = M()
        fully_shard(m.a); fully_shard(m)
        opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
        m(torch.randn(2, 8)).sum().backward(); opt.step()   # materialise optimizer state
        sd = titan_sd(m, opt, 3)
        dcp.load(sd, checkpoint_id=src)                      # reshard the 1-rank state
        msd = {k: v for k, v in sd.items() if k not in ("optimizer", "lr_scheduler", "train_state", "dataloader")}
        set_state_dict(m, opt, model_state_dict=msd, optim_state_dict=sd["optimizer"], options=OPTS)
        sd = titan_sd(m, opt, 3)
        assert type(sd["a.weight"]).__name__ == "DTensor"
        dcp.save(sd, checkpoint_id=dst)
        # ptops' save transaction on 2 ranks: all-reduce agreement, rank 0 writes manifest + LATEST and
        # prunes (keep 1); at step 4 rank 1 fails after writing: nobody commits
        import json
        from ptops.ckpt import SaveTransaction
        pg = dist.new_group(backend="gloo")
        def agree(failed):
            t = torch.tensor([1 if failed else 0]); dist.all_reduce(t, op=dist.ReduceOp.MAX, group=pg)
            return bool(t.item())
        root = dst.replace("/two/", "/two-txn/").rsplit("/", 1)[0]
        seen = []
        for st in (2, 3, 4):
            txn = SaveTransaction(root, st, leader=rank == 0, agree=agree, world_size=ws, keep=1)
            began = txn.begin()
            err = None
            if began:
                dcp.save(sd, checkpoint_id=str(txn.path), process_group=pg)
                if st == 4 and rank == 1:
                    err = OSError(28, "No space left on device (test)")
                txn.commit(err)
            seen.append([st, began, txn.ok, txn.error])
        with open(f"{root}-rank{rank}.json", "w") as fh:
            json.dump(seen, fh)
        dist.barrier(); dist.destroy_process_group()

    if __name__ == "__main__":
        out = sys.argv[1]; port = int(sys.argv[2])
        torch.manual_seed(0)
        m = M(); opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
        for step in (1, 2, 3):
            m(torch.randn(2, 8)).sum().backward(); opt.step(); opt.zero_grad()
            dcp.save(titan_sd(m, opt, step), checkpoint_id=f"{out}/run/checkpoints/step-{step}")
        mp.spawn(worker, args=(2, f"{out}/run/checkpoints/step-3", f"{out}/two/step-3", port), nprocs=2)
    """  # noqa: E501
)

HF_GEN = textwrap.dedent(
    """
    import sys, warnings
    warnings.simplefilter("ignore")
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM, Trainer, TrainingArguments
    from transformers.utils import logging; logging.set_verbosity_error()
    cfg = Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64)
    torch.manual_seed(0)
    class DS(torch.utils.data.Dataset):
        def __len__(s): return 64
        def __getitem__(s, i):
            x = (torch.arange(16) + i) % 64; return {"input_ids": x, "labels": x}
    args = TrainingArguments(output_dir=sys.argv[1], max_steps=4, save_steps=2, per_device_train_batch_size=2,
                             use_cpu=True, report_to=[], logging_steps=1, disable_tqdm=True)
    Trainer(model=Qwen2ForCausalLM(cfg), args=args, train_dataset=DS()).train()
    """  # noqa: E501
)


@pytest.fixture(scope="session")
def made(tmp_path_factory):
    base = tmp_path_factory.mktemp("ckgen")
    (base / "dcp_gen.py").write_text(DCP_GEN)
    (base / "hf_gen.py").write_text(HF_GEN)
    env = dict(
        os.environ,
        OMP_NUM_THREADS="1",
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        TOKENIZERS_PARALLELISM="false",
    )
    import socket

    with socket.socket() as so:
        so.bind(("127.0.0.1", 0))
        port = so.getsockname()[1]
    p1 = subprocess.Popen(
        [sys.executable, str(base / "dcp_gen.py"), str(base), str(port)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    p2 = subprocess.Popen(
        [sys.executable, str(base / "hf_gen.py"), str(base / "hf" / "checkpoints")],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    out1, _ = p1.communicate(timeout=240)
    out2, _ = p2.communicate(timeout=240)
    assert p1.returncode == 0, out1[-3000:]
    assert p2.returncode == 0, out2[-3000:]
    return base


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _age(path: Path, seconds: float = 3600) -> None:
    """Make a folder and its files look old (retention skips fresh ones)."""
    t = time.time() - seconds
    for dp, _, fns in os.walk(path):
        for fn in fns:
            os.utime(os.path.join(dp, fn), (t, t))
        os.utime(dp, (t, t))


@pytest.fixture
def dcp_run(made, tmp_path):
    return _copy(made / "run", tmp_path / "run")


@pytest.fixture
def hf_run(made, tmp_path):
    return _copy(made / "hf", tmp_path / "hf")


def _flip_mid(f: Path, at: int | None = None) -> None:
    n = f.stat().st_size
    at = n // 2 if at is None else at
    with open(f, "r+b") as fh:
        fh.seek(at)
        b = fh.read(8)
        fh.seek(at)
        fh.write(bytes(x ^ 0xFF for x in b))
    assert f.stat().st_size == n


def _files(problems):
    return [p["file"] for p in problems]


# ------------------------------------------------------------------ DCP verify --


def test_dcp_real_checkpoints_verify(made):
    for p in [
        made / "run/checkpoints/step-1",
        made / "run/checkpoints/step-3",
        made / "two/step-3",
    ]:
        r = verify(p)
        assert r.ok, r.problems
        assert r.kind == "dcp" and r.step == int(p.name.split("-")[1])
        assert not r.has_manifest and "dcp-structure" in r.checks
    assert len(list((made / "two/step-3").glob("*.distcp"))) == 2


def test_manifest_and_commit(dcp_run):
    root = dcp_run / "checkpoints"
    ck = root / "step-3"
    m = write_manifest(ck, step=3, world_size=1, versions={"torch": "2.13.0"})
    man = json.loads(m.read_text())
    names = {f["path"] for f in man["files"]}
    assert names == {".metadata", "__0_0.distcp"}
    assert all(len(f["sha256"]) == 64 and f["size"] > 0 for f in man["files"])
    assert not list(ck.glob(".*tmp*"))
    res = commit(root, ck)
    assert res.ok and "manifest-hash" in res.checks
    assert read_latest(root) == ck
    assert (root / "LATEST").read_text().strip() == "step-3"


def test_write_manifest_refuses_partial_and_commit_needs_manifest(dcp_run):
    root = dcp_run / "checkpoints"
    (root / "step-2" / ".metadata").unlink()
    with pytest.raises(ManifestError) as ei:
        write_manifest(root / "step-2", 2, 1, {})
    assert ".metadata" in str(ei.value)
    with pytest.raises(ManifestError):
        commit(root, root / "step-3")  # no manifest yet
    assert read_latest(root) is None


def test_truncated_shard(dcp_run):
    ck = dcp_run / "checkpoints/step-3"
    shard = ck / "__0_0.distcp"
    with open(shard, "r+b") as fh:
        fh.truncate(shard.stat().st_size - 100)
    r = verify(ck)  # no manifest: .metadata offsets catch it
    assert not r.ok and "__0_0.distcp" in _files(r.problems)
    assert "truncated" in r.problems[0]["reason"]


def test_truncated_shard_with_manifest(dcp_run):
    ck = dcp_run / "checkpoints/step-3"
    write_manifest(ck, 3, 1, {})
    shard = ck / "__0_0.distcp"
    with open(shard, "r+b") as fh:
        fh.truncate(shard.stat().st_size - 100)
    r = verify(ck, deep=False)
    assert not r.ok and _files(r.problems)[0] == "__0_0.distcp"


def test_flipped_bytes_with_manifest(dcp_run, made):
    ck = dcp_run / "checkpoints/step-3"
    write_manifest(ck, 3, 1, {})
    _flip_mid(ck / "__0_0.distcp")
    r = verify(ck)
    assert not r.ok
    assert r.problems[0]["file"] == "__0_0.distcp" and "hash mismatch" in r.problems[0]["reason"]
    # sizes alone cannot see it (documented): the quick check passes
    assert verify(ck, deep=False).ok


def test_background_verifier_reports_good_and_damaged_commits(dcp_run):
    """What the saving rank runs after each commit: verdicts arrive from a background thread, a
    damaged checkpoint names its file, a pruned one is not reported, and close() lets the last one
    finish."""
    from ptops.ckpt import BackgroundVerifier

    root = dcp_run / "checkpoints"
    good, bad = root / "step-1", root / "step-3"
    write_manifest(good, 1, 1, {})
    write_manifest(bad, 3, 1, {})
    _flip_mid(bad / "__0_0.distcp")
    heard: list = []
    v = BackgroundVerifier(
        lambda step, path, ok, reason, s: heard.append((step, path.name, ok, reason))
    )
    v.submit(1, good)
    assert v.wait_idle(60)
    v.submit(3, bad)
    assert v.wait_idle(60)
    v.submit(7, root / "step-7")  # pruned before it was read
    v.close(60)
    assert [h[:3] for h in heard] == [(1, "step-1", True), (3, "step-3", False)], heard
    assert "__0_0.distcp" in heard[1][3] and "hash mismatch" in heard[1][3]
    v.submit(1, good)  # after close: ignored, no thread left behind
    assert len(heard) == 2 and not v._thread.is_alive()


def test_flipped_tensor_bytes_without_manifest_crc(dcp_run):
    """No manifest: the deep check recomputes the zip CRC32 of each DCP record."""
    from ptops.ckpt._dcpmeta import read_metadata

    ck = dcp_run / "checkpoints/step-3"
    md = read_metadata(ck)
    info = next(
        v for k, v in md.storage_data.items() if k.fqn == "optimizer.state.a.weight.exp_avg"
    )
    _flip_mid(ck / info.relative_path, info.offset + info.length // 2)
    r = verify(ck)
    assert (
        not r.ok
        and r.problems[0]["file"] == info.relative_path
        and "CRC" in r.problems[0]["reason"]
    )


def test_deleted_metadata_and_partial_save(dcp_run):
    root = dcp_run / "checkpoints"
    # a killed save: shards without .metadata, at a newer step
    partial = root / "step-4"
    shutil.copytree(root / "step-3", partial)
    (partial / ".metadata").unlink()
    r = verify(partial)
    assert (
        not r.ok
        and r.problems[0]["file"] == ".metadata"
        and "incomplete" in r.problems[0]["reason"]
    )
    # catalog falls back to the previous valid one
    ents = list_checkpoints(root)
    assert [e.step for e in ents] == [4, 3, 2, 1]
    assert not ents[0].ok and ents[0].reason.startswith(".metadata")
    assert latest_good(root).step == 3
    # and a run directory is accepted too
    assert latest_good(dcp_run).step == 3


def test_metadata_unsafe_pickle_refused(dcp_run, tmp_path):
    ck = dcp_run / "checkpoints/step-3"
    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    (ck / ".metadata").write_bytes(pickle.dumps(Evil()))
    r = verify(ck)
    assert (
        not r.ok and r.problems[0]["file"] == ".metadata" and "refusing" in r.problems[0]["reason"]
    )
    assert not marker.exists()


def test_metadata_with_enums_pickled_by_name_loads_and_getattr_stays_leashed(dcp_run):
    """Some Python releases (Debian 12's python3.11, 3.11.2; not 3.11.7) pickle an enum member as
    ``getattr(Enum, name)``: a checkpoint saved there must verify and load as one saved elsewhere
    (it was refused, so no save could commit), and ``getattr`` reaches only an allowed enum's
    member."""
    import enum
    import io

    from ptops.ckpt._dcpmeta import UnsafeMetadata, read_metadata, read_metadata_lite

    ck = dcp_run / "checkpoints/step-3"
    md = read_metadata(ck)
    named = []

    class ByName(pickle.Pickler):
        def reducer_override(self, obj):
            if isinstance(obj, enum.Enum):
                named.append(obj)
                return getattr, (type(obj), obj.name)
            return NotImplemented

    buf = io.BytesIO()
    ByName(buf, protocol=2).dump(md)
    assert named and b"getattr" in buf.getvalue()  # DCP's metadata holds enums: the case
    (ck / ".metadata").write_bytes(buf.getvalue())
    assert read_metadata(ck) == md
    assert read_metadata_lite(ck).state_dict_metadata.keys() == md.state_dict_metadata.keys()
    r = verify(ck, deep=True)
    assert r.ok, r.problems

    class Reach:
        def __init__(self, target, name):
            self.target, self.name = target, name

        def __reduce__(self):
            return getattr, (self.target, self.name)

    for target, name in ((dict, "fromkeys"), (Path, "write_text"), (named[0].__class__, "mro")):
        (ck / ".metadata").write_bytes(pickle.dumps(Reach(target, name), protocol=2))
        for read in (read_metadata, read_metadata_lite):
            with pytest.raises(UnsafeMetadata):
                read(ck)
        r = verify(ck)  # (lite: an allowed enum's non-member is an inert stub, still no Metadata)
        assert not r.ok and "does not load (UnsafeMetadata" in r.problems[0]["reason"], r.problems


def test_corrupt_newest_catalog_and_quarantine(dcp_run):
    root = dcp_run / "checkpoints"
    for s in (1, 2, 3):
        write_manifest(root / f"step-{s}", s, 1, {})
        commit(root, root / f"step-{s}")
    _flip_mid(root / "step-3" / "__0_0.distcp")
    assert [e.ok for e in list_checkpoints(root)] == [True, True, True]  # quick: sizes only
    assert [e.ok for e in list_checkpoints(root, deep=True)] == [False, True, True]
    good = latest_good(root)
    assert good.step == 2
    files_before = sorted(p.name for p in (root / "step-3").iterdir())
    new = quarantine(root / "step-3", "hash mismatch in __0_0.distcp")
    assert not (root / "step-3").exists()
    assert new.parent == root / "invalid" and new.name.startswith("step-3-")
    assert sorted(p.name for p in new.iterdir()) == sorted(files_before + ["ptops-quarantine.json"])
    assert json.loads((new / "ptops-quarantine.json").read_text())["reason"].startswith(
        "hash mismatch"
    )
    # LATEST named step-3: moved back to the newest good one
    assert read_latest(root) == root / "step-2"
    assert [e.step for e in list_checkpoints(root)] == [2, 1]


# ------------------------------------------------------------------ TRL verify --


def test_trl_real_checkpoints(hf_run):
    root = hf_run / "checkpoints"
    ents = list_checkpoints(root)
    assert [(e.step, e.kind, e.ok) for e in ents] == [(4, "trl", True), (2, "trl", True)]
    ck = root / "checkpoint-4"
    write_manifest(ck, 4, 1, {"trl": "1.16.0"})
    commit(root, ck)
    assert verify(ck).ok and read_latest(root) == ck


def test_trl_missing_optimizer(hf_run):
    ck = hf_run / "checkpoints/checkpoint-4"
    (ck / "optimizer.pt").unlink()
    r = verify(ck)
    assert not r.ok and _files(r.problems) == ["optimizer.pt"]
    assert latest_good(hf_run / "checkpoints").step == 2


def test_trl_other_breakages(hf_run):
    root = hf_run / "checkpoints"
    ck = root / "checkpoint-4"
    st = json.loads((ck / "trainer_state.json").read_text())
    st["global_step"] = 3
    (ck / "trainer_state.json").write_text(json.dumps(st))
    r = verify(ck)
    assert (
        _files(r.problems) == ["trainer_state.json"]
        and "global_step is 3" in r.problems[0]["reason"]
    )
    (ck / "trainer_state.json").unlink()
    assert "written last" in verify(ck).problems[0]["reason"]
    ck2 = root / "checkpoint-2"
    f = ck2 / "model.safetensors"
    with open(f, "r+b") as fh:
        fh.truncate(f.stat().st_size - 10)
    r = verify(ck2)
    assert _files(r.problems) == ["model.safetensors"] and "truncated" in r.problems[0]["reason"]
    assert latest_good(root) is None


def test_trl_flip_with_manifest(hf_run):
    ck = hf_run / "checkpoints/checkpoint-4"
    write_manifest(ck, 4, 1, {})
    _flip_mid(ck / "model.safetensors")
    r = verify(ck)
    assert not r.ok and r.problems[0]["file"] == "model.safetensors"


# ------------------------------------------------------------------- retention --


def test_retention(dcp_run):
    root = dcp_run / "checkpoints"
    for s in range(4, 9):
        shutil.copytree(root / "step-3", root / f"step-{s}")
    for s in range(1, 9):
        _age(root / f"step-{s}")
    (root / "LATEST").write_text("step-2\n")  # pointer at an old one: keep it
    (root / "step-5" / ".writing").write_text("x")  # a save in flight
    (root / "step-8" / ".metadata").unlink()  # newest is a killed save: invalid, kept
    _age(root / "step-8")
    shutil.copytree(root / "step-3", root / "step-9")  # fresh: may be being written right now
    os.utime(root / "step-9" / "__0_0.distcp")
    rep = prune(root, keep_last=2, keep_every=3)
    assert sorted(rep.deleted) == ["step-1", "step-4"], rep.kept
    assert set(rep.kept) == {"step-9", "step-8", "step-7", "step-6", "step-5", "step-3", "step-2"}
    assert "LATEST" in rep.kept["step-2"] and "modified" in rep.kept["step-9"]
    assert "invalid" in rep.kept["step-8"] and ".writing" in rep.kept["step-5"]
    assert rep.kept["step-3"].startswith("step is a multiple")
    assert not (root / "step-1").exists() and not (root / "step-4").exists()
    assert not [p for p in root.iterdir() if p.name.startswith(".deleting")]
    # dry run deletes nothing
    rep2 = prune(root, keep_last=1, keep_every=0, dry_run=True)
    assert rep2.deleted and all((root / n).exists() for n in rep2.deleted)


def test_retention_never_deletes_latest_good(dcp_run):
    root = dcp_run / "checkpoints"
    for s in (1, 2, 3):
        _age(root / f"step-{s}")
    (root / "step-3" / ".metadata").unlink()
    _age(root / "step-3")
    rep = prune(root, keep_last=1)
    assert rep.deleted == ["step-1"]
    assert "latest good" in rep.kept["step-2"]


def test_retention_keeps_the_target_of_an_sdc_rollback(dcp_run):
    """Saves every 5 steps, sdc checks every 10 (issue 26): a corruption found at the check of
    step 20 rolls back to the newest checkpoint strictly before step 10, the last step the
    replicas agreed on; keep_last=3 alone would have pruned step-5 at the save of step 20."""
    from ptops.ckpt.retention import sdc_rollback_steps

    root = dcp_run / "checkpoints"
    for s in (5, 10, 15, 20):
        shutil.copytree(root / "step-3", root / f"step-{s}")
        _age(root / f"step-{s}")
    for s in (1, 2, 3):
        shutil.rmtree(root / f"step-{s}")
    (root / "LATEST").write_text("step-20\n")
    assert sdc_rollback_steps(20, 10) == [20, 10] and sdc_rollback_steps(20, 0) == []
    assert sdc_rollback_steps(47, 10) == [40, 30, 20]
    dry = prune(root, keep_last=2, min_age_s=0, dry_run=True)
    assert dry.deleted == ["step-10", "step-5"]  # without the rule
    rep = prune(root, keep_last=2, keep_before=sdc_rollback_steps(20, 10), min_age_s=0)
    assert rep.deleted == ["step-10"] and "sdc rollback" in rep.kept["step-5"], rep.kept


# ---------------------------------------------------------------------- digest --


def test_digest_independent_of_sharding(made):
    d1 = digest(made / "run/checkpoints/step-3")
    d2 = digest(made / "two/step-3")  # FSDP2 on 2 gloo ranks, 2 .distcp files
    assert len(d1) == 64 and d1 == d2
    assert digest(made / "run/checkpoints/step-2") != d1
    # batching (many small dcp.load calls) does not change it
    from ptops.ckpt.digest import digest as dg

    assert dg(made / "two/step-3", batch_bytes=1) == d1
    # a run directory means its latest good checkpoint
    assert digest(made / "run") == d1


def test_digest_ignores_non_model_state(made, tmp_path):
    """train_state / lr_scheduler / dataloader are excluded: same tensors, same digest."""
    import torch.distributed.checkpoint as dcp

    from ptops.ckpt.digest import iter_dcp_tensors

    src = made / "run/checkpoints/step-3"
    sd = dict(iter_dcp_tensors(src))
    assert any(k.startswith("optimizer.state.") and k.endswith(".exp_avg") for k in sd)
    assert "a.weight" in sd and not any(k.startswith("train_state") for k in sd)
    sd["train_state"] = {"step": 99}
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(sd, checkpoint_id=str(tmp_path / "step-3"))
    assert digest(tmp_path / "step-3") == digest(src)


def test_digest_trl_layout_independent(hf_run):
    from safetensors.torch import load_file, save_file

    ck = hf_run / "checkpoints/checkpoint-4"
    d = digest(ck)
    assert digest(hf_run) == d and digest(hf_run / "checkpoints/checkpoint-2") != d
    # re-shard the model weights into 2 files + index: same digest
    sd = load_file(ck / "model.safetensors")
    keys = sorted(sd)
    half = len(keys) // 2
    parts = {
        "model-00001-of-00002.safetensors": keys[:half],
        "model-00002-of-00002.safetensors": keys[half:],
    }
    for fn, ks in parts.items():
        save_file({k: sd[k].contiguous() for k in ks}, ck / fn, metadata={"format": "pt"})
    (ck / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": {k: fn for fn, ks in parts.items() for k in ks}})
    )
    (ck / "model.safetensors").unlink()
    assert verify(ck).ok
    assert digest(ck) == d


# ------------------------------------------------------------- lifecycle API --


def _commit_all(root: Path, steps) -> None:
    for s in steps:
        write_manifest(root / f"step-{s}", s, 1, {})
        commit(root, root / f"step-{s}")


def test_resume_point_quarantines_newer_invalid_and_returns_newest_valid(dcp_run):
    root = dcp_run / "checkpoints"
    _commit_all(root, (1, 2, 3))
    _flip_mid(root / "step-3" / "__0_0.distcp")  # sizes unchanged: only the hashes see it
    shutil.copytree(root / "step-2", root / "step-4")
    (root / "step-4" / ".metadata").unlink()  # a killed save
    (root / "step-4" / "ptops-manifest.json").unlink()
    reported = []
    good = resume_point(dcp_run, on_invalid=lambda **kw: reported.append(kw))
    assert good is not None and good.step == 2 and good.path == str(root / "step-2") and good.ok
    assert [Path(r["path"]).name for r in reported] == ["step-4", "step-3"]
    assert [r["step"] for r in reported] == [4, 3]
    assert ".metadata" in reported[0]["reason"] and "__0_0.distcp" in reported[1]["reason"]
    for r in reported:  # moved, never deleted
        assert Path(r["moved_to"]).parent == root / "invalid" and Path(r["moved_to"]).is_dir()
    assert sorted(p.name for p in root.iterdir()) == ["LATEST", "invalid", "step-1", "step-2"]
    assert read_latest(root) == root / "step-2"
    # nothing good at all: None, everything quarantined and reported
    empty = dcp_run / "empty"
    shutil.copytree(root / "step-1", empty / "step-1")
    (empty / "step-1" / "__0_0.distcp").unlink()
    reported.clear()
    assert resume_point(empty, on_invalid=lambda **kw: reported.append(kw)) is None
    assert [Path(r["path"]).name for r in reported] == ["step-1"]
    assert resume_point(dcp_run / "nothing-here") is None


def test_resume_point_adopts_a_complete_save_killed_before_its_commit(dcp_run):
    root = dcp_run / "checkpoints"
    _commit_all(root, (1, 2))
    (root / "step-3" / ".writing").write_text(
        "123 0.0\n"
    )  # DCP finished (.metadata), commit never ran
    assert not verify(root / "step-3").ok
    assert resume_point(root, adopt=False).step == 3
    assert (
        read_latest(root) == root / "step-2"
        and not (root / "step-3" / "ptops-manifest.json").exists()
    )
    good = resume_point(root, world_size=1, versions={"torch": "x"})
    assert good.step == 3 and good.has_manifest and "adopted" in good.reason
    man = json.loads((root / "step-3" / "ptops-manifest.json").read_text())
    assert man["extra"] == {"adopted": True} and man["versions"] == {"torch": "x"}
    assert read_latest(root) == root / "step-3" and verify(root / "step-3").ok


def test_resume_point_trl_needs_every_ranks_rng_state_without_a_manifest(hf_run):
    root = hf_run / "checkpoints"
    # checkpoint-4 killed before rank 1 wrote its RNG state: used only when nothing else is good
    (root / "checkpoint-4" / "rng_state.pth").rename(root / "checkpoint-4" / "rng_state_0.pth")
    shutil.copy2(
        root / "checkpoint-4" / "rng_state_0.pth", root / "checkpoint-2" / "rng_state_0.pth"
    )
    shutil.copy2(
        root / "checkpoint-4" / "rng_state_0.pth", root / "checkpoint-2" / "rng_state_1.pth"
    )
    assert resume_point(root, world_size=2, adopt=False).step == 2
    shutil.rmtree(root / "checkpoint-2")
    fallback = resume_point(root, world_size=2, adopt=False)
    assert fallback.step == 4 and "rng_state_1.pth" in fallback.reason


def test_resume_point_from_the_supervisor_is_not_verified_again(dcp_run, monkeypatch):
    """A restart verifies once: the supervisor's choice (PTOPS_RESUME_FROM) is taken as is."""
    import ptops.ckpt.lifecycle as lc

    root = dcp_run / "checkpoints"
    calls = []
    real = lc.verify
    monkeypatch.setattr(lc, "verify", lambda *a, **kw: calls.append(a[0]) or real(*a, **kw))
    monkeypatch.delenv(RESUME_ENV, raising=False)
    chosen = resume_point(root, adopt=False)  # what the supervisor does
    assert chosen.step == 3 and len(calls) == 1
    monkeypatch.setenv(RESUME_ENV, chosen.path)  # what the ranks then see
    calls.clear()
    again = resume_point(root)
    assert again.step == 3 and again.path == chosen.path and calls == []
    assert "supervisor" in again.reason
    monkeypatch.setenv(RESUME_ENV, "")  # the supervisor found nothing good: a fresh start
    assert resume_point(root) is None and calls == []
    monkeypatch.setenv(RESUME_ENV, str(root / "step-9"))  # gone since: decide here
    assert resume_point(root, adopt=False).step == 3 and len(calls) == 1
    calls.clear()
    monkeypatch.setenv(RESUME_ENV, chosen.path)
    assert resume_point(root, trust_env=False, adopt=False).step == 3 and len(calls) == 1


def _engine_writes(src: Path, dst: Path) -> None:
    shutil.copytree(src, dst, dirs_exist_ok=True)


def test_save_transaction_commits_and_prunes(dcp_run):
    root = dcp_run / "checkpoints"
    for s in (1, 2, 3):
        _age(root / f"step-{s}")
    txn = SaveTransaction(root, 5, keep=2, world_size=1, versions={"torch": "x"})
    assert txn.begin() and txn.path == root / "step-5" and is_writing(txn.path)
    assert read_latest(root) is None
    _engine_writes(root / "step-3", txn.path)
    assert txn.commit() and txn.ok and txn.error is None
    assert read_latest(root) == root / "step-5" and not is_writing(txn.path)
    assert json.loads((txn.path / "ptops-manifest.json").read_text())["step"] == 5
    assert txn.pruned == ["step-2", "step-1"]  # keep 2: step-5 and step-3
    assert sorted(p.name for p in root.iterdir()) == ["LATEST", "step-3", "step-5"]
    # a leftover folder of the same step is moved aside, not written into
    (root / "step-6").mkdir()
    (root / "step-6" / "junk").write_text("x")
    txn = SaveTransaction(root, 6)
    assert txn.begin() and txn.moved_leftover.parent == root / "invalid"
    assert sorted(p.name for p in txn.path.iterdir()) == [".writing"]
    with pytest.raises(ValueError):
        SaveTransaction(root, 7, name="latest")


def test_save_transaction_failure_never_looks_saved(dcp_run):
    root = dcp_run / "checkpoints"
    _commit_all(root, (3,))
    # this rank wrote, another failed: nobody commits
    txn = SaveTransaction(root, 4, agree=lambda failed: True)
    assert not txn.begin() and txn.error == "failed on another rank before writing"
    txn = SaveTransaction(root, 5)
    assert txn.begin()
    _engine_writes(root / "step-3", txn.path)
    (txn.path / "ptops-manifest.json").unlink()
    assert not txn.commit(OSError(28, "No space left on device")) and "No space left" in txn.error
    # the shards are complete, yet: no manifest, aborted marker, LATEST unchanged, never adopted
    assert read_latest(root) == root / "step-3"
    assert not (txn.path / "ptops-manifest.json").exists()
    assert (txn.path / ".writing").read_text().startswith("aborted: OSError")
    assert not verify(txn.path).ok
    # the leader's own commit refused (the save is incomplete): reported, nothing committed
    txn6 = SaveTransaction(root, 6)
    assert txn6.begin()
    _engine_writes(root / "step-3", txn6.path)
    (txn6.path / ".metadata").unlink()
    assert not txn6.commit() and ".metadata" in txn6.error and read_latest(root) == root / "step-3"
    # retention never deletes a failed save (left for quarantine)
    rep = prune(root, keep_last=1, min_age_s=0)
    assert rep.deleted == ["step-2", "step-1"]
    assert (
        all(".writing" in rep.kept[f"step-{s}"] for s in (4, 5, 6))
        and "LATEST" in rep.kept["step-3"]
    )
    reported = []
    assert resume_point(root, on_invalid=lambda **kw: reported.append(kw)).step == 3
    assert [Path(r["path"]).name for r in reported] == ["step-6", "step-5", "step-4"]
    assert "not committed" in reported[1]["reason"] and "No space left" in reported[1]["reason"]


def test_save_transaction_on_two_ranks(made):
    root = made / "two-txn"
    seen = [json.loads((made / f"two-txn-rank{r}.json").read_text()) for r in (0, 1)]
    for r in (0, 1):
        assert [s[:3] for s in seen[r]] == [[2, True, True], [3, True, True], [4, True, False]]
    assert seen[1][2][3].startswith("OSError") and seen[0][2][3] == "save failed on another rank"
    assert sorted(p.name for p in root.iterdir()) == ["LATEST", "step-3", "step-4"]  # step-2 pruned
    assert read_latest(root) == root / "step-3"
    man = json.loads((root / "step-3" / "ptops-manifest.json").read_text())
    assert (
        man["world_size"] == 2
        and len([f for f in man["files"] if f["path"].endswith(".distcp")]) == 2
    )
    assert verify(root / "step-3").ok and not verify(root / "step-4").ok
    assert digest(root / "step-3") == digest(made / "run/checkpoints/step-3")


def test_layout_helpers(made, dcp_run):
    root = dcp_run / "checkpoints"
    assert checkpoint_path(dcp_run, 2) == root / "step-2" and checkpoint_path(root, 9) is None
    assert checkpoint_path(made / "hf", 4) == made / "hf/checkpoints/checkpoint-4"
    two = made / "two/step-3"
    assert [f.name for f in shard_files(two, 1)] == ["__1_0.distcp"]
    files = shard_files(two)
    assert {f.name for f in files} == {"__0_0.distcp", "__1_0.distcp", ".metadata"}
    sizes = [f.stat().st_size for f in files]
    assert sizes == sorted(sizes, reverse=True)  # largest first: what corrupt-ckpt damages
    assert shard_files(made / "hf/checkpoints/checkpoint-4", 0) == []
    assert not is_writing(two)


def test_ckpt_imports_nothing_of_ptops():
    """ckpt/ is a leaf: stdlib at import time, torch/numpy/safetensors only inside functions,
    never another ptops package (the supervisor, status and the adapters import it, not back)."""
    import ast

    pkg = REPO / "ckpt"
    allowed_lazy = {"torch", "numpy", "safetensors"}
    for f in sorted(pkg.glob("*.py")):
        tree = ast.parse(f.read_text())
        top = {id(n) for n in tree.body}
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.level:
                assert node.level == 1, f"{f.name}: relative import leaves ckpt/"
                continue
            if isinstance(node, ast.Import):
                mods = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                mods = [node.module or ""]
            else:
                continue
            for m in mods:
                root_mod = m.split(".")[0]
                assert root_mod != "ptops", f"{f.name}: imports {m}"
                if id(node) in top:
                    assert root_mod in sys.stdlib_module_names or root_mod == "__future__", (
                        f"{f.name}: {m} at import time"
                    )
                else:
                    assert root_mod in sys.stdlib_module_names or root_mod in allowed_lazy, (
                        f"{f.name}: imports {m}"
                    )


def test_nothing_outside_ckpt_imports_its_private_modules():
    import re

    bad = []
    for f in REPO.rglob("*.py"):
        rel = f.relative_to(REPO)
        # build/ and runs/ are ignored outputs (a wheel's copy of ckpt/ lives in build/lib)
        if rel.parts[0] in {"ckpt", "tests", "build", "runs"} or rel.parts[0].startswith("."):
            continue
        if re.search(r"ptops\.ckpt\._|ptops\.ckpt import _", f.read_text(errors="replace")):
            bad.append(str(rel))
    assert bad == []


# ------------------------------------------------------------------------- CLI --


def test_cli(made, dcp_run, tmp_path):
    from typer.testing import CliRunner

    from ptops.ops.cli.ckpt import app

    runner = CliRunner()
    root = dcp_run / "checkpoints"
    write_manifest(root / "step-3", 3, 1, {})
    commit(root, root / "step-3")
    r = runner.invoke(app, ["list", str(dcp_run)])
    assert r.exit_code == 0, r.output
    assert "step-3 (LATEST)" in r.output and "STEP" in r.output
    r = runner.invoke(app, ["list", str(dcp_run), "--json"])
    js = json.loads(r.output)
    assert js["latest"] == "step-3" and [c["step"] for c in js["checkpoints"]] == [3, 2, 1]
    assert runner.invoke(app, ["verify", str(root / "step-3")]).exit_code == 0
    _flip_mid(root / "step-3" / "__0_0.distcp")
    r = runner.invoke(app, ["verify", str(root / "step-3")])
    assert (
        r.exit_code == 1 and "__0_0.distcp" in r.output and len(r.output.strip().splitlines()) == 1
    )
    r = runner.invoke(app, ["verify", str(root / "step-3"), "--json"])
    assert r.exit_code == 1 and json.loads(r.output)["problems"][0]["file"] == "__0_0.distcp"
    r = runner.invoke(app, ["verify", str(tmp_path / "nope")])
    assert r.exit_code == 2 and "not found" in r.output
    r = runner.invoke(app, ["verify", str(dcp_run)])  # a run directory is not a checkpoint
    assert r.exit_code == 2 and "not a checkpoint" in r.output
    assert runner.invoke(app, ["list", str(tmp_path / "nope")]).exit_code == 2
    assert runner.invoke(app, ["digest", str(tmp_path / "nope")]).exit_code == 2
    r = runner.invoke(app, ["digest", str(made / "two/step-3")])
    assert r.exit_code == 0 and r.output.strip() == digest(made / "run/checkpoints/step-3")
    # a run directory: the latest good (step-3 is now corrupt -> step-2)
    r = runner.invoke(app, ["digest", str(dcp_run)])
    assert r.exit_code == 0 and r.output.strip() == digest(root / "step-2")
    empty = tmp_path / "empty"
    (empty / "checkpoints").mkdir(parents=True)
    r = runner.invoke(app, ["digest", str(empty)])
    assert r.exit_code == 1 and "no good checkpoint" in r.output


def test_import_list_verify_without_torch(made):
    """Listing and verifying (structure, manifest, CRC) never import torch."""
    code = (
        "import sys, ptops.ckpt as c, ptops.ops.cli.ckpt\n"
        f"es = c.list_checkpoints({str(made / 'run')!r})\n"
        f"assert [e.ok for e in es] == [True, True, True], es\n"
        f"assert c.verify({str(made / 'two/step-3')!r}).ok\n"
        f"assert c.verify({str(made / 'hf/checkpoints/checkpoint-4')!r}).ok\n"
        "print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "False"
