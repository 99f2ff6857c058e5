"""``ptops.rank``: the small public API of your own training script under ptops.

A script needs none of it to be supervised (``ptops launch --supervise -- python train.py``: crash
and hang detection with stacks, restarts, goodput, diagnose). With it, the script also gets step
records (monitors, numeric rollback), checkpoints ptops verifies and resumes from exactly, and a
save when the run is preempted or stopped::

    import ptops.rank as pr

    start = pr.resume(model, optimizer)         # last saved step (0: fresh); model, optimizer, RNG
    for step in range(start + 1, steps + 1):
        pr.start_step(step)                     # faults, liveness, a rollback's skipped batches
        x, y = batch(pr.batch_index(step))      # the data position: step-based, rollbacks counted
        loss = pr.loss(loss_fn(model(x), y))    # (chaos: a `nan` fault poisons it here)
        ...backward, optimizer.step()...
        pr.end_step(step, loss=loss, grad_norm=gn)  # the step's record (any scalar metrics)
        pr.checkpoint(step, model, optimizer, last=step == steps)  # when due: interval, last, stop
        if pr.should_stop():                           # preemption / Ctrl-C: saved above, leave now
            break

Without ptops (plain ``python`` or ``torchrun``) every call still works: records are dropped,
checkpoints go to ``ckpt_dir`` (default ``./checkpoints``) with the same layout and manifest, and
:func:`resume` resumes from them. Checkpoints are ``step-N/`` folders of torch DCP files (model,
optimizer, per-rank RNG, ptops' data position and your ``extra``) committed by
:class:`ptops.ckpt.SaveTransaction`: ``ptops ckpt verify`` and ``ptops ckpt digest`` read them.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from ptops.ckpt import SaveTransaction, resume_point
from ptops.recipes.rollback import RollbackInfo

__all__ = [
    "supervised",
    "resume",
    "start_step",
    "batch_index",
    "loss",
    "end_step",
    "checkpoint",
    "should_stop",
    "rollback",
    "lr_factor",
    "rank",
    "world_size",
]

_probe: Any = None  # the rank's probe (bound by the script engine, ptops.recipes.script.run)
_recipe: Any = None
_state: dict[str, Any] = {
    "api": False,
    "first_step": None,
    "skipped": 0,
    "step": 0,
    "stop": False,
    "rollback": None,
}


def _bind(probe: Any, recipe: Any) -> None:
    global _probe, _recipe
    _probe, _recipe = probe, recipe
    _state["rollback"] = RollbackInfo.from_env()


def _unbind() -> None:
    global _probe, _recipe
    _probe = _recipe = None


def _reports_steps() -> bool:
    """The script reports its own steps (the engine's optimizer-step beats stand aside)."""
    return _state["api"]


def supervised() -> bool:
    """Launched by ``ptops launch`` (records and checkpoints go to its run directory)."""
    return _probe is not None


def _dist() -> Any:
    try:
        import torch.distributed as dist
    except ImportError:
        return None
    return dist if dist.is_available() and dist.is_initialized() else None


def rank() -> int:
    d = _dist()
    return d.get_rank() if d else int(os.environ.get("RANK", "0"))


def world_size() -> int:
    d = _dist()
    return d.get_world_size() if d else int(os.environ.get("WORLD_SIZE", "1"))


def _device() -> Any:
    import torch

    d = _dist()
    if d is not None and d.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _any_rank(flag: bool) -> bool:
    """True on every rank when it is True on some rank (one all-reduce; alone: the flag)."""
    d = _dist()
    if d is None:
        return flag
    import torch

    t = torch.tensor([1 if flag else 0], device=_device())
    d.all_reduce(t, op=d.ReduceOp.MAX)
    return bool(t.item())


def _ckpt_root(ckpt_dir: str | os.PathLike | None) -> Path:
    if _probe is not None:
        return (
            _probe.run.checkpoints
        )  # the run directory's: the supervisor verifies and resumes from it
    return Path(ckpt_dir or "checkpoints")


def _event(kind: str, **fields: Any) -> None:
    if _probe is not None and rank() == 0:
        _probe.event(kind, **fields)


def _log(msg: str) -> None:
    import logging

    # ptops.ops.runrecord.ranklog's one format ("[ptops.rank rank R] ..."), set up by the probe
    logging.getLogger("ptops.rank.rank").info("%s", msg)


# ---------------------------------------------------------------- state


def _state_dict(model: Any, optimizer: Any, extra: dict | None) -> dict[str, Any]:
    """model, optimizer (torch's distributed state-dict helpers: FSDP2, DDP, plain modules alike),
    and ``train_state`` (per-rank RNG, data position, ``extra``; not part of the digest)."""
    import torch
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, optimizer)
    r = rank()
    return {
        "model": msd,
        "optimizer": osd,
        "train_state": {
            "skipped": torch.tensor(_state["skipped"]),
            f"rng_{r}": torch.get_rng_state(),
            f"extra_{r}": dict(extra or {}),
        },
    }


def resume(
    model: Any,
    optimizer: Any,
    *,
    extra: dict | None = None,
    ckpt_dir: str | os.PathLike | None = None,
) -> int:
    """Load the newest good checkpoint into ``model``, ``optimizer``, this rank's RNG and ``extra``
    (a dict updated in place); return its step (0 when there is none: a fresh start). Call it after
    the model, the optimizer and the process group exist, before the first step."""
    _state["api"] = True
    d = _dist()
    if _probe is not None:
        _probe.world(world_size(), rank())
        _probe.startup("load")
        _probe.faults.on_startup("load")
        _probe.stop.accept()  # save_if_due saves and the script returns when the supervisor asks
    root = _ckpt_root(ckpt_dir)
    found: list[Any] = [None]
    if rank() == 0:  # one rank decides (it may quarantine or adopt), every rank loads the same

        def invalid(**info: Any) -> None:
            _log(
                f"checkpoint {info['path']} is not good ({info['reason']}); moved to "
                f"{info['moved_to']}"
            )
            _event("checkpoint_invalid", **info)

        entry = resume_point(root, deep=True, on_invalid=invalid, world_size=world_size())
        found = [(entry.path, entry.step) if entry is not None else None]
    if d is not None:
        d.broadcast_object_list(found, src=0)
    if found[0] is None:
        return 0
    path, step = found[0]
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict

    sd = _state_dict(model, optimizer, extra)
    dcp.load(sd, checkpoint_id=str(path))
    set_state_dict(model, optimizer, model_state_dict=sd["model"], optim_state_dict=sd["optimizer"])
    ts = sd["train_state"]
    torch.set_rng_state(ts[f"rng_{rank()}"])
    _state["skipped"] = int(ts["skipped"])
    if extra is not None:
        extra.update(ts[f"extra_{rank()}"])
    _log(f"resumed from {path} (step {step})")
    return int(step)


# ---------------------------------------------------------------- steps


def rollback() -> RollbackInfo | None:
    """The rollback this attempt honours (``ptops.recipes.rollback``), or None."""
    return _state["rollback"] if _probe is not None else None


def lr_factor() -> float:
    """Multiply your learning rate by this (after :func:`resume`): 1.0, or less after a rollback."""
    info = rollback()
    return info.lr_factor if info is not None else 1.0


def start_step(step: int) -> None:
    """Step ``step`` begins: fault hooks, the step's begin beat, a rollback's batch skip."""
    _state["api"] = True
    step = int(step)
    if _state["first_step"] is None:
        _state["first_step"] = step
        info = rollback()
        if info is not None and abs(info.lr_factor - 1.0) > 1e-12:
            _event("rollback_applied", **info.applied("lr", step, lr_factor=info.lr_factor))
    info = rollback()
    n = info.batches_to_skip(step, _state["first_step"], position_in_checkpoint=True) if info else 0
    if n:
        _state["skipped"] += n
        _log(f"rollback: skipped {n} batch(es) before step {step}")
        _event("rollback_applied", **info.applied("skip", step, skip_batches=n, batches_dropped=n))
    _state["step"] = step
    _state["t0"] = time.monotonic()
    if _probe is not None:
        _probe.profile.at_step(step)  # a capture's boundary comes before the fault hooks
        _probe.faults.before_step(step)
        _probe.before_step(step)


def batch_index(step: int) -> int:
    """The data position of ``step`` (0-based): ``step - 1`` plus the batches rollbacks skipped.
    It is saved in every checkpoint, so a resumed run draws exactly the batches it would have."""
    return int(step) - 1 + int(_state["skipped"])


def loss(value: Any) -> Any:
    """Hand the step's loss through ptops (a ``nan`` fault multiplies it by NaN: chaos tests)."""
    if _probe is not None and _probe.faults.should_poison(_state["step"]):
        return value * float("nan")
    return value


def end_step(step: int, *, loss: Any = None, **metrics: Any) -> None:
    """Step ``step`` finished: its record (``loss``, ``grad_norm``, ``lr``, ``tokens_per_s`` and any
    scalar of yours) goes to the monitors; the numeric monitor's NaN finding rolls the run back."""
    _state["api"] = True
    if _probe is None:
        return
    rec: dict[str, Any] = {"loss": loss, **metrics}
    if "step_s" not in rec and "t0" in _state:
        rec["step_s"] = time.monotonic() - _state["t0"]
    _probe.step(
        int(step), {k: (float(v.item()) if hasattr(v, "item") else v) for k, v in rec.items()}
    )


def _interval() -> int:
    return int(_recipe.checkpoint.interval) if _recipe is not None else 0


def checkpoint(
    step: int,
    model: Any,
    optimizer: Any,
    *,
    last: bool = False,
    every: int = 10,
    extra: dict | None = None,
    ckpt_dir: str | os.PathLike | None = None,
) -> bool:
    """Save when due: every ``every`` steps (under ptops: the recipe's ``checkpoint.interval``), at
    the ``last`` step, or when the supervisor asks for a save before stopping (every rank agrees).
    Returns True when a checkpoint was committed. A failed save (disk full, ...) does not end
    training unless it was the last one."""
    step = int(step)
    interval = _interval() or int(every)
    stop = (
        _any_rank(bool(_probe is not None and _probe.stop.requested))
        if _probe is not None
        else False
    )
    _state["stop"] = stop
    if not (last or stop or (interval > 0 and step % interval == 0)):
        return False
    ok, error = save(step, model, optimizer, extra=extra, ckpt_dir=ckpt_dir)
    if not ok and (last or stop):
        raise RuntimeError(
            f"the {'last' if last else 'on-request'} checkpoint (step {step}) could not be "
            f"saved: {error}; the last good checkpoint is the newest one committed"
        )
    return ok


def should_stop() -> bool:
    """The supervisor asked the run to stop (Ctrl-C, SIGTERM, preemption): :func:`checkpoint` saved
    this step on every rank; leave the loop now."""
    return bool(_state["stop"])


def save(
    step: int,
    model: Any,
    optimizer: Any,
    *,
    extra: dict | None = None,
    ckpt_dir: str | os.PathLike | None = None,
) -> tuple[bool, str | None]:
    """One checkpoint of ``step`` now (all ranks call it): ``(committed, error)``."""
    import torch.distributed.checkpoint as dcp

    root = _ckpt_root(ckpt_dir)
    keep = int(_recipe.checkpoint.keep) if _recipe is not None else 3
    txn = SaveTransaction(
        root,
        step,
        name=f"step-{int(step)}",
        leader=rank() == 0,
        agree=_any_rank,
        world_size=world_size(),
        keep=keep,
    )
    t0 = time.monotonic()
    txn.run(
        lambda path: dcp.save(_state_dict(model, optimizer, extra), checkpoint_id=str(path)),
        probe=_probe,
    )
    total = round(time.monotonic() - t0, 4)
    if txn.ok:
        _event(
            "checkpoint",
            step=int(step),
            path=str(txn.path),
            blocking_s=total,
            total_s=total,
            mode="sync",
        )
    else:
        _log(f"step-{step}: checkpoint FAILED, not committed ({txn.error})")
        _event("checkpoint_failed", step=int(step), path=str(txn.path), error=txn.error)
    if _probe is not None:
        _probe.phase("step", step)
        _probe.faults.after_checkpoint(step)  # corrupt-ckpt fires once the save is committed
    return txn.ok, txn.error
