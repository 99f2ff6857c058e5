"""TRL / transformers side of a rollback (``PTOPS_ROLLBACK``, contract in
:mod:`ptops.recipes.rollback`).

- ``lr_factor``: :func:`callbacks` returns a ``TrainerCallback`` whose
  ``on_train_begin`` (after transformers loaded the optimizer and scheduler from
  the checkpoint) sets the scheduler's base learning rates to
  ``args.learning_rate x lr_factor`` and the optimizer's current lr to match
  (absolute: transformers saves ``base_lrs`` in ``scheduler.pt``, so a later
  resume never compounds the factor).
- ``skip_batches``: :func:`skip` runs at the top of the trainer's
  ``get_batch_samples`` and drops ``skip_batches x num_batches`` batches from
  the epoch iterator before step ``skip_at_step``. transformers recovers the
  data position on resume by *counting* steps (``skip_first_batches``), so an
  attempt that resumes after the skip window re-applies the skip on its first
  step (``position_in_checkpoint=False``).

Not covered: several rollbacks that each skipped data (only the latest
rollback is known to the ranks; earlier skips are lost on a resume that
recounts from a checkpoint before them), a skip that crosses an epoch
boundary (the epoch iterator ends early: fewer batches are dropped), and
GRPO's generation buffer when ``steps_per_generation > gradient_accumulation_steps``
(the skip then drops prompt batches, not whole generation rounds).
"""

from __future__ import annotations

from typing import Any

from ptops.recipes.rollback import RollbackInfo

_STATE: dict[str, Any] = {}


def info() -> RollbackInfo | None:
    if "info" not in _STATE:
        _STATE["info"] = RollbackInfo.from_env()
    return _STATE["info"]


def _is_rank0(state: Any) -> bool:
    return bool(getattr(state, "is_world_process_zero", True))


def callbacks(probe: Any) -> list:
    """Extra trainer callbacks for this attempt (empty without a rollback)."""
    rb = info()
    if rb is None or abs(rb.lr_factor - 1.0) <= 1e-12:
        return []
    from transformers import TrainerCallback

    class RollbackLR(TrainerCallback):
        def on_train_begin(self, args, state, control, optimizer=None, lr_scheduler=None, **kwargs):
            base = float(args.learning_rate) * rb.lr_factor
            lrs: list[float] = []
            sch = lr_scheduler
            if sch is not None and hasattr(sch, "base_lrs"):
                sch.base_lrs = [base for _ in sch.base_lrs]
                lams = getattr(sch, "lr_lambdas", None)
                if lams:
                    lrs = [b * lam(sch.last_epoch) for b, lam in zip(sch.base_lrs, lams)]
                    sch._last_lr = list(lrs)
            opt = optimizer if optimizer is not None else getattr(sch, "optimizer", None)
            if opt is not None:
                for i, group in enumerate(opt.param_groups):
                    group["lr"] = lrs[i] if i < len(lrs) else base
                    if "initial_lr" in group:
                        group["initial_lr"] = base
            if _is_rank0(state):
                step = int(state.global_step) + 1
                lr = lrs[0] if lrs else base
                probe.event(
                    "rollback_applied", **rb.applied("lr", step, lr_factor=rb.lr_factor, lr=lr)
                )

    return [RollbackLR()]


def skip(trainer: Any, epoch_iterator: Any, num_batches: int, probe: Any) -> int:
    """Drop the batches a rollback asks to skip before this step; returns how many were dropped."""
    rb = info()
    if rb is None:
        return 0
    step = int(trainer.state.global_step) + 1
    first = _STATE.setdefault("first_step", step)
    n = rb.batches_to_skip(step, first, position_in_checkpoint=False)
    if not n:
        return 0
    dropped = 0
    for _ in range(n * max(1, int(num_batches))):
        try:
            next(epoch_iterator)
        except StopIteration:
            break
        dropped += 1
    if trainer.state.is_world_process_zero:
        probe.event(
            "rollback_applied",
            **rb.applied("skip", step, skip_batches=n, batches_dropped=dropped),
        )
    return dropped
