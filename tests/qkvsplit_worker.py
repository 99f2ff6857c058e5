"""One rank of
``tests/ckpt/test_staging.py::test_qkv_split_after_staging_writes_what_the_hook_writes`` (2 ranks,
gloo, FSDP2 on a tiny torchtitan llama3 with fused QKV): the state dict staged with the split done
after the copy (``QkvSplit``) against torchtitan's own hook
(``ModelWrapper.state_dict``), tensor by tensor, then both saved with DCP into OUT/new and OUT/old
for the test to compare file by file.

    python tests/qkvsplit_worker.py RANK OUT
"""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist


def main() -> None:
    rank, out = int(sys.argv[1]), sys.argv[2]
    dist.init_process_group("gloo", init_method=f"file://{out}/store", rank=rank, world_size=2)
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    from ptops.recipes.titan.qkvsplit import QkvSplit
    from ptops.recipes.titan.registry import tiny_llama3
    from ptops.recipes.titan.staging import FlatStager

    # isort: split
    from torchtitan.components.checkpointer.base import ModelWrapper

    torch.manual_seed(0)
    model = tiny_llama3(64, 2, 4, 128, 32).model.build()  # n_kv = n_heads: wq, wk, wv all 64 rows
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p))
    mesh = init_device_mesh("cpu", (2,))
    for layer in model.layers.values():
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    wrapper = ModelWrapper(model)
    pg = dist.new_group(backend="gloo")
    with (
        torch.no_grad()
    ):  # training moved on: the hook outputs in ModelWrapper's cache are stale now
        for p in model.parameters():
            p.mul_(1.5).add_(0.25)

    report: dict = {}
    plan, why = QkvSplit.build(wrapper, pg)
    report["plan"], report["why"] = plan is not None, why
    st = FlatStager()
    try:
        extra = {"step": torch.tensor(3), "meta": {"lr": 0.1}}
        states = plan.states({"model": wrapper, "train_state": extra}, "model")
        report["unsplit_keys"] = sorted(k for k in states if "qkv" in k or ".wq." in k)
        copied, done = st.stage_then(states, plan.finish)
        copied.result()
        new = done.result()
        old = {"train_state": extra}
        old.update(wrapper.state_dict())  # torchtitan's hook: gather + split on the training group
        report["same_order"] = list(new) == list(old)
        bad = []
        for k, v in old.items():
            n = new[k]
            if isinstance(v, DTensor):
                if (
                    type(n) is not DTensor
                    or n._spec != v._spec
                    or not torch.equal(n._local_tensor, v._local_tensor)
                ):
                    bad.append(k)
        report["mismatched"] = bad
        report["checked"] = sum(isinstance(v, DTensor) for v in old.values())
        dcp.save(new, checkpoint_id=f"{out}/new", process_group=pg)
        dcp.save(old, checkpoint_id=f"{out}/old", process_group=pg)

        lin = torch.nn.Linear(4, 4)
        fully_shard(lin, mesh=mesh)
        report["plain_model"] = list(QkvSplit.build(ModelWrapper(lin), pg))[1]
    finally:
        st.close()
        dist.destroy_process_group()
    with open(f"{out}/rank{rank}.json", "w") as f:
        json.dump(report, f)


if __name__ == "__main__":
    main()
