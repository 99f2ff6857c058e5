"""TorchTitan side of a rollback (``PTOPS_ROLLBACK``, contract in :mod:`ptops.recipes.rollback`).

``on_step(trainer, data_iterator, step, probe)`` runs at the start of every
``ProbeTrainer.train_step``, after the checkpoint was loaded:

- first step of the attempt: the LR schedulers' base learning rates become the
  configured ones x ``lr_factor`` (the schedule's lambda is unchanged; torchtitan
  saves only ``last_epoch``, so the factor is re-applied on every attempt after a
  rollback, never compounded);
- at ``skip_at_step`` (when this attempt resumed before it): ``skip_batches``
  optimizer steps' worth of batches (x gradient accumulation x PP microbatches)
  are drawn from the data iterator and dropped. torchtitan checkpoints the
  dataloader's position, so checkpoints saved after the skip resume after it.

Rank 0 reports ``rollback_applied {what, step, ...}`` through the probe.
"""

from __future__ import annotations

from typing import Any

from ptops.ops.runrecord import ranklog
from ptops.recipes.rollback import RollbackInfo

_STATE: dict[str, Any] = {}


def _info() -> RollbackInfo | None:
    if "info" not in _STATE:
        _STATE["info"] = RollbackInfo.from_env()
    return _STATE["info"]


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _scale_lr(trainer: Any, factor: float) -> list[float]:
    lrs: list[float] = []
    for sch in trainer.lr_schedulers.schedulers:
        base = getattr(sch, "_ptops_base_lrs", None)
        if base is None:
            base = sch._ptops_base_lrs = list(sch.base_lrs)
        sch.base_lrs = [b * factor for b in base]
        new = [b * lam(sch.last_epoch) for b, lam in zip(sch.base_lrs, sch.lr_lambdas)]
        for group, lr in zip(sch.optimizer.param_groups, new):
            group["lr"] = lr
        sch._last_lr = new
        lrs.extend(new)
    return lrs


def _skip(trainer: Any, data_iterator: Any, n_steps: int) -> int:
    per_step = int(getattr(trainer, "gradient_accumulation_steps", 1) or 1) * int(
        getattr(trainer, "num_pipeline_parallel_microbatches", 1) or 1
    )
    mp = trainer.metrics_processor
    tokens, times = mp.ntokens_since_last_log, len(mp.data_loading_times)
    dropped = 0
    for _ in range(n_steps * per_step):
        next(data_iterator)
        dropped += 1
    # the dropped batches are not this step's throughput
    mp.ntokens_since_last_log = tokens
    del mp.data_loading_times[times:]
    return dropped


def on_step(trainer: Any, data_iterator: Any, step: int, probe: Any) -> None:
    info = _info()
    if info is None:
        return
    first = _STATE.setdefault("first_step", step)
    if step == first and abs(info.lr_factor - 1.0) > 1e-12:
        lrs = _scale_lr(trainer, info.lr_factor)
        if probe is not None and _rank() == 0:
            probe.event(
                "rollback_applied",
                **info.applied("lr", step, lr_factor=info.lr_factor, lr=lrs[0] if lrs else None),
            )
    n = info.batches_to_skip(step, first, position_in_checkpoint=True)
    if n:
        dropped = _skip(trainer, data_iterator, n)
        ranklog.get("titan").info("rollback: skipped %s batch(es) before step %s", dropped, step)
        if probe is not None and _rank() == 0:
            probe.event(
                "rollback_applied",
                **info.applied("skip", step, skip_batches=n, batches_dropped=dropped),
            )
