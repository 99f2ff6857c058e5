"""One rank of
``tests/install/test_recipes_clean_cache.py::test_asset_built_under_a_process_group_is_complete``:
2 ranks in a real gloo group build the tiny TRL model asset in one empty ``PTOPS_CACHE``.

- ``alone``: rank 1 builds while rank 0 waits at a barrier (the GKD teacher's case: a non-main rank,
  process group up, is the builder), then rank 0 takes it from the cache;
- ``both``: both ranks ask for another model at the same moment (one builds, the other waits).

Each rank writes OUT/rankR.json: the folders it got and a digest of the weights it loaded from them.

    python tests/assets_worker.py RANK OUT
"""

from __future__ import annotations

import hashlib
import json
import sys

import torch.distributed as dist


def _loaded_digest(path) -> str:
    from ptops.recipes.trl.model import load_model

    h = hashlib.sha256()
    for name, t in sorted(load_model(path).state_dict().items()):
        h.update(name.encode() + t.detach().contiguous().numpy().tobytes())
    return h.hexdigest()


def main() -> None:
    rank, out = int(sys.argv[1]), sys.argv[2]
    dist.init_process_group("gloo", init_method=f"file://{out}/store", rank=rank, world_size=2)
    from ptops.recipes.trl.config import TrlModel
    from ptops.recipes.trl.model import model_dir

    dims = TrlModel(hidden_size=32, num_layers=1, num_heads=2)
    report: dict = {}
    if rank == 1:
        report["alone"] = str(model_dir(dims, seed=101))
    dist.barrier()
    if rank == 0:
        report["alone"] = str(model_dir(dims, seed=101))
    dist.barrier()
    report["both"] = str(model_dir(dims, seed=102))  # both ranks at once
    report["digests"] = {k: _loaded_digest(report[k]) for k in ("alone", "both")}
    with open(f"{out}/rank{rank}.json", "w") as f:
        json.dump(report, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
