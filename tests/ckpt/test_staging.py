"""``FlatStager`` (the titan adapter's CPU staging copy): the staged state is the source bit for
bit, save after save, while its buffers are reused; DTensors keep their spec; DCP writes what was
staged."""

from __future__ import annotations

import torch
from conftest import TESTS

from ptops.recipes.titan.staging import FlatStager


def _bits(t: torch.Tensor) -> bytes:
    return t.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes()


def _state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(64, 32, generator=g)
    nan = torch.randn(8, generator=g)
    nan[3] = float("nan")
    nan[5] = -0.0
    return {
        "model.w": torch.nn.Parameter(w, requires_grad=False),
        "model.wt": w.t(),  # a strided view of the same storage
        "model.b": torch.randn(5, generator=g).to(torch.bfloat16),
        "optimizer": {
            "state.exp_avg": nan,
            "state.step": torch.tensor(float(seed)),
            "param_groups": [{"lr": 1e-3 * seed, "betas": (0.9, 0.95)}],
        },
        "train_state": {"step": seed, "name": "x"},
        "ints": torch.arange(7, dtype=torch.int64) * seed,
    }


def _assert_equal(staged: dict, src: dict) -> None:
    assert staged.keys() == src.keys()
    for k, v in src.items():
        s = staged[k]
        if isinstance(v, torch.Tensor):
            assert type(s) is torch.Tensor and s.dtype == v.dtype and s.shape == v.shape
            assert _bits(s) == _bits(v), k
            assert s.untyped_storage().data_ptr() != v.untyped_storage().data_ptr(), (
                "a copy, not the source"
            )
        elif isinstance(v, dict):
            _assert_equal(s, v)
        else:
            assert s == v


def test_staged_copy_is_bit_exact_across_saves_with_buffers_reused():
    st = FlatStager()
    try:
        src = _state(1)
        first = st.stage(src).result()
        _assert_equal(first, src)
        ptrs = {k: v.data_ptr() for k, v in first.items() if isinstance(v, torch.Tensor)}
        keep = {k: _bits(v) for k, v in first.items() if isinstance(v, torch.Tensor)}

        # training changes the state in place between the saves (same shapes: the buffers are
        # reused)
        src2 = _state(2)
        with torch.no_grad():
            for k in ("model.w", "model.b", "ints"):
                src[k].copy_(src2[k])
            src["optimizer"]["state.exp_avg"].copy_(src2["optimizer"]["state.exp_avg"])
            src["optimizer"]["state.step"].copy_(src2["optimizer"]["state.step"])
        src["train_state"]["step"] = 2
        assert _bits(src["model.w"]) != keep["model.w"]

        second = st.stage(src).result()
        _assert_equal(second, src)
        assert {k: v.data_ptr() for k, v in second.items() if isinstance(v, torch.Tensor)} == ptrs
        assert (
            second["optimizer"]["param_groups"] is not src["optimizer"]["param_groups"]
        )  # deep-copied
        assert second["model.wt"].stride() == src["model.wt"].stride()

        # a tensor whose shape changed gets a new buffer, still exact
        src["ints"] = torch.arange(9, dtype=torch.int64)
        third = st.stage(src).result()
        _assert_equal(third, src)
    finally:
        st.close()


def test_dcp_async_save_writes_what_was_staged(tmp_path):
    import torch.distributed.checkpoint as dcp

    st = FlatStager()
    try:
        for step in (1, 2):  # the second save reuses the buffers
            src = {
                "w": torch.randn(128, 16),
                "opt": {"m": torch.randn(16)},
                "step": torch.tensor(step),
            }
            res = dcp.async_save(
                src, checkpoint_id=str(tmp_path / f"s{step}"), no_dist=True, async_stager=st
            )
            res.staging_completion.result()
            res.upload_completion.result()
            back = {
                "w": torch.zeros(128, 16),
                "opt": {"m": torch.zeros(16)},
                "step": torch.tensor(0),
            }
            dcp.load(back, checkpoint_id=str(tmp_path / f"s{step}"), no_dist=True)
            assert _bits(back["w"]) == _bits(src["w"]) and _bits(back["opt"]["m"]) == _bits(
                src["opt"]["m"]
            )
            assert int(back["step"]) == step
    finally:
        st.close()


def test_dtensor_local_shard_staged_with_the_same_spec():
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    own = not dist.is_initialized()
    if own:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    st = FlatStager()
    try:
        mesh = init_device_mesh("cpu", (1,))
        src = {"w": distribute_tensor(torch.randn(8, 4), mesh, [Shard(0)])}
        staged = st.stage(src).result()
        d = staged["w"]
        assert (
            type(d) is DTensor and d._spec == src["w"]._spec and d.placements == src["w"].placements
        )
        assert _bits(d._local_tensor) == _bits(src["w"]._local_tensor)
        with torch.no_grad():
            src["w"]._local_tensor.add_(1.0)
        again = st.stage(src).result()["w"]
        assert again._local_tensor.data_ptr() == d._local_tensor.data_ptr()
        assert _bits(again._local_tensor) == _bits(src["w"]._local_tensor)
    finally:
        st.close()
        if own:
            dist.destroy_process_group()


def test_qkv_split_after_staging_writes_what_the_hook_writes(tmp_path):
    """2 real gloo ranks, FSDP2, a tiny torchtitan llama3 with fused QKV (tests/qkvsplit_worker.py):
    the async path's split after the staging copy (``QkvSplit.finish``) gives torchtitan's hook's
    keys, order, DTensor specs and values (the hook's cached outputs being stale), and DCP writes
    the same files from both (the ``.metadata`` differs only in its save id and path). A model
    without fused QKV gets no plan."""
    import json
    import os
    import pickle
    import subprocess
    import sys

    worker = TESTS / "qkvsplit_worker.py"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    procs = [
        subprocess.Popen(
            [sys.executable, str(worker), str(r), str(tmp_path)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in (0, 1)
    ]
    outs = [p.communicate(timeout=600)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], "\n".join(o[-3000:] for o in outs)
    for r in (0, 1):
        rep = json.loads((tmp_path / f"rank{r}.json").read_text())
        assert rep["plan"], rep["why"]
        assert rep["unsplit_keys"] == [
            "layers.0.attention.qkv_linear.wqkv.weight",
            "layers.1.attention.qkv_linear.wqkv.weight",
        ], rep
        assert rep["same_order"] and rep["mismatched"] == [] and rep["checked"] > 6, rep
        assert rep["plain_model"] == "no fused qkv", rep
    new, old = tmp_path / "new", tmp_path / "old"
    names = sorted(p.name for p in new.iterdir())
    assert names == sorted(p.name for p in old.iterdir()) and "__0_0.distcp" in names
    for name in names:
        if name != ".metadata":
            assert (new / name).read_bytes() == (old / name).read_bytes(), name
    a, b = (pickle.loads((d / ".metadata").read_bytes()) for d in (new, old))
    assert list(a.state_dict_metadata.items()) == list(b.state_dict_metadata.items())
    assert a.storage_data == b.storage_data and a.planner_data == b.planner_data
    assert {
        "layers.0.attention.qkv_linear.wq.weight",
        "layers.1.attention.qkv_linear.wv.weight",
    } <= set(a.state_dict_metadata)


def test_a_fault_that_fires_in_a_save_keeps_that_save_from_being_skipped():
    """An interval save is skipped while the previous async save still writes, unless a pending
    fault needs it: committed (corrupt-ckpt, hold until committed) or begun (enospc,
    crash:phase=save). Otherwise, on a slow box, the fault would silently never fire (a chaos
    scenario or a test waiting for it would fail)."""
    from ptops.faultinject.inject import waits_for_save
    from ptops.faultinject.spec import Fault

    def waits(fault: Fault, step: int) -> bool:
        return waits_for_save([fault], step)

    assert waits(Fault("crash", 6, rank=1, params={"phase": "save"}), 6)
    assert waits(Fault("enospc", 8), 8)
    assert waits(Fault("corrupt-ckpt", 10), 4)
    assert waits(Fault("hold", 9, params={"until": "committed"}), 2)
    assert not waits(
        Fault("crash", 6, rank=1, params={"phase": "save"}), 4
    )  # not due yet: 4 may be skipped
    assert not waits(Fault("crash", 6, rank=1), 6)  # a crash before the step: not inside the save
    assert not waits(Fault("enospc", 8), 6)
    assert not waits_for_save([], 6)
