"""TorchTitan's fake-backend dry run of a recipe for a declared world, in one CPU process.

``python -m ptops.recipes.titan.dryrun RECIPE_JSON WORLD`` builds the recipe's real TorchTitan
trainer (``registry.trainer_config``) with ``comm.mode=fake_backend`` and ``NGPU=WORLD``: the device
mesh of every parallel dimension, the model (rank 0's shard, left on the meta device unless
``PTOPS_DRYRUN_MATERIALIZE=1`` materialises it on CPU), the float8 module swap (emulated: no SM89
here), activation checkpointing and compile wrappers, the parallelisation (FSDP2 / TP / PP / CP /
EP) and the optimizer. It runs no step. It prints one JSON line: what was checked, what was not, and
rank 0's measured parameter bytes (the planner's memory estimate is compared with them).

Run as a subprocess by ``ptops launch --dry-run`` (bounded time; torch stays out of the CLI).
"""

from __future__ import annotations

import json
import os
import resource
import sys
import tempfile
import time
import traceback
from pathlib import Path

from ptops import envnames

NOT_CHECKED = [
    "weights stay on the meta device unless PTOPS_DRYRUN_MATERIALIZE=1 (shapes and sharding are "
    "real; values are not)",
    "no forward/backward step runs: activation memory, CP attention numerics and fp8 kernels are "
    "not exercised",
    "float8 is built in emulation (CPU has no SM89): the same Float8Linear modules and sharding, "
    "not the kernels",
    "torch.compile wrappers are applied but nothing is compiled (compilation happens at the "
    "first step)",
    "only rank 0 of the simulated world is built (other pipeline stages and expert shards are not)",
    "collectives go to a fake process group: NCCL, bandwidth and timeouts are not exercised",
]


def run(recipe_json: str, world: int) -> dict:
    from ptops.recipes.schema import from_json

    recipe = from_json(recipe_json)
    os.environ["NGPU"] = str(world)
    os.environ["RANK"] = "0"
    os.environ["LOCAL_RANK"] = "0"
    os.environ["WORLD_SIZE"] = str(world)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    t0 = time.monotonic()
    from ptops.recipes.titan import registry  # applies the CPU compatibility layer first
    # isort: split

    import torch
    from torch.distributed.tensor import DTensor

    tmp = Path(tempfile.mkdtemp(prefix="ptops-dryrun-"))
    cfg = registry.trainer_config(recipe, tmp, dry_run=True)
    cfg.comm.mode = "fake_backend"
    cfg.checkpoint.enable = False  # nothing to save or load
    cfg.checkpoint.initial_load_path = None
    cfg.metrics.enable_tensorboard = False if hasattr(cfg.metrics, "enable_tensorboard") else None
    materialize = os.environ.get(envnames.DRYRUN_MATERIALIZE) == "1"
    if not materialize:
        # TorchTitan moves the sharded model to ``utils.device_type`` and initialises it there; on
        # meta the same sharding, shapes and optimizer are built without allocating or filling
        # rank 0's shard (CPU-side DTensor init of a 70B shard takes many minutes)
        from torchtitan.tools import utils as tt_utils

        saved, tt_utils.device_type = tt_utils.device_type, "meta"
    try:
        trainer = cfg.build()
    finally:
        if not materialize:
            tt_utils.device_type = saved
    pd = trainer.parallel_dims
    local = 0
    total = 0
    for part in trainer.model_parts:
        for p in part.parameters():
            t = p.to_local() if isinstance(p, DTensor) else p
            local += t.numel() * t.element_size()
            total += p.numel()
    n_opt = sum(len(o.param_groups) for o in trainer.optimizers.optimizers)
    f8 = sum(
        1
        for part in trainer.model_parts
        for m in part.modules()
        if type(m).__name__ == "Float8Linear"
    )
    if recipe.titan.float8.enabled and f8 == 0:
        raise ValueError(
            "titan.float8.enabled but TorchTitan swapped no Linear to Float8Linear (check "
            "filter_fqns)"
        )
    from torch.distributed.tensor.experimental._context_parallel._attention import _cp_options

    rotate = str(
        getattr(_cp_options.rotate_method, "name", _cp_options.rotate_method)
    ).lower()  # all_gather
    mem = trainer.metrics_processor.device_memory_monitor.get_peak_stats()
    out = {
        "ok": True,
        "world": world,
        "mesh": {
            "dp_replicate": pd.dp_replicate,
            "dp_shard": pd.dp_shard,
            "tp": pd.tp,
            "pp": pd.pp,
            "cp": pd.cp,
            "ep": pd.ep,
        },
        "model": f"{cfg.model_spec.name} {cfg.model_spec.flavor}",
        "model_parts": len(trainer.model_parts),
        "rank0_params": total,
        "rank0_param_bytes": local,
        "float8_modules": f8,
        "cp_rotate_method": rotate,
        "optimizer_param_groups": n_opt,
        # CPU: the process's peak RSS (compat.CpuDeviceModule)
        "titan_peak_memory_gib": mem.max_reserved_gib,
        "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024**2,
        "seconds": round(time.monotonic() - t0, 1),
        "materialized": materialize,
        "checked": [
            "device mesh for the declared world",
            "model build",
            "float8 swap (emulated)",
            "activation checkpointing",
            "compile wrapping",
            "parallelize (FSDP2/TP/PP/CP/EP)",
            "optimizer",
            "LR scheduler",
            "dataloader",
        ],
        "not_checked": NOT_CHECKED,
    }
    torch.distributed.destroy_process_group()
    return out


def main() -> None:
    recipe_json = Path(sys.argv[1]).read_text()
    world = int(sys.argv[2])
    try:
        out = run(recipe_json, world)
    except Exception as e:  # reported as one line by the CLI
        tb = traceback.format_exc().strip().splitlines()
        out = {
            "ok": False,
            "error": f"{type(e).__name__}: "
            f"{str(e).strip().splitlines()[0] if str(e).strip() else ''}",
            "where": tb[-3:] if len(tb) > 3 else tb,
        }
    sys.stdout.flush()
    print(envnames.DRYRUN_LINE + " " + json.dumps(out), flush=True)
    os._exit(0)  # no teardown of half-built trainers or fake process groups


if __name__ == "__main__":
    main()
