"""``ProbeTrainer``: torchtitan's ``Trainer`` (own nested ``Config``) with the rank probe around
each optimizer step: the fault hooks, the silent-data-corruption checks (``recipes/sdc.py``: at-rest
fingerprints, where the ``bitflip`` fault flips, and the gradient recheck in the optimizers' step
pre-hook), the stop agreement and the step record.

``PoisonableCrossEntropyLoss`` (torchtitan's cross-entropy times NaN while the probe's NaN fault is
armed, before backward) stays here: the train step sets ``_POISON`` and the loss reads it, one
module global with one owner (moved apart, the trainer would set a name the loss never reads).

The other components: ``checkpointing.py`` (saves, resume), ``metrics.py``, ``dataset.py``,
``context.py`` (the probe of this process). Import only after ``compat.apply()`` (``registry`` does
that).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any

from torchtitan.components.loss import CrossEntropyLoss
from torchtitan.trainer import Trainer

from ptops.recipes.titan.checkpointing import ProbeCheckpointManager
from ptops.recipes.titan.context import _log, _rank, _world, get_probe, get_recipe
from ptops.recipes.titan.metrics import ProbeMetricsProcessor, _metric_name

_POISON = False


# --------------------------------------------------------------------------- #
class PoisonableCrossEntropyLoss(CrossEntropyLoss):
    """Cross-entropy (sum / global tokens) that returns NaN while a poison is armed."""

    @dataclass(kw_only=True, slots=True)
    class Config(CrossEntropyLoss.Config):
        pass

    def __call__(self, pred, labels, global_valid_tokens=None, **kwargs):
        loss, metrics = super().__call__(pred, labels, global_valid_tokens, **kwargs)
        if _POISON:
            loss = loss * float("nan")
        return loss, metrics


# --------------------------------------------------------------------------- #
class _MarkedBatches:
    """The same batch iterator, each ``next`` inside ``probe.profile.mark("data")`` (nothing
    buffered: the batches and their order are the iterator's own)."""

    def __init__(self, it: Any, probe: Any):
        self.it, self.probe = it, probe

    def __iter__(self) -> "_MarkedBatches":
        return self

    def __next__(self) -> Any:
        with self.probe.profile.mark("data"):
            return next(self.it)


class ProbeTrainer(Trainer):
    """torchtitan's Trainer with the ptops probe around every optimizer step; under a
    supervisor, a stop request is agreed on at the end of a step, that step is
    checkpointed and the training loop ends normally (exit 0)."""

    @dataclass(kw_only=True, slots=True)
    class Config(Trainer.Config):
        pass

    def __init__(self, config: Config):
        self.ptops_stopped_at: int | None = None
        super().__init__(config)
        probe = get_probe()
        if probe is not None:
            probe.startup("load")  # train() loads the checkpoint first, then the first step begins
            probe.faults.on_startup("load")
        self.ptops_tap: Any = None  # recipes/titan/partner.py: what this rank hands the reduce
        self.ptops_sdc = self._state_checks(probe)
        self.ptops_fwd: list[tuple[tuple, dict]] = []  # this step's forward-backward calls
        if self.ptops_sdc is not None:
            self.optimizers.register_step_pre_hook(self._before_optimizer)
        if isinstance(self.metrics_processor, ProbeMetricsProcessor):
            self.metrics_processor.pp_has_last_stage = (
                self.pp_has_last_stage if self.parallel_dims.pp_enabled else True
            )

    def _state_checks(self, probe: Any) -> Any:
        """The silent-data-corruption checks of this rank (``recipes/sdc.py``): its own shards of
        the model and optimizer state, so never comparable across ranks (``replicated`` False)."""
        if probe is None:
            return None
        from ptops.recipes import sdc

        def params() -> sdc.Named:
            return [
                (f"{i}.{n}", sdc.local(p))
                for i, part in enumerate(self.model_parts)
                for n, p in part.named_parameters()
            ]

        def optims() -> sdc.Named:
            return sdc.optim_tensors(list(getattr(self.optimizers, "optimizers", [])))

        from ptops.recipes.titan import partner

        recipe = get_recipe()
        rechecks, pairs = sdc.recheck_of(recipe), sdc.partner_of(recipe)
        tap = partner.install(self.model_parts, probe, lambda: self.step)
        if tap is None or not partner.data_parallel_only(self.parallel_dims) or _world() < 2:
            pairs = 0  # no ring of batches: the partner run cannot say anything
        self.ptops_tap = tap
        return sdc.StateChecks(
            sdc.every_of(recipe), probe, params, optims,
            recheck_every=rechecks, partner_every=pairs, tap=tap,
        )  # fmt: skip

    def forward_backward_step(self, *args: Any, **kwargs: Any) -> Any:
        """torchtitan's, its inputs kept for the step's recheck (references: alive all step)."""
        self.ptops_fwd.append((args, kwargs))
        return super().forward_backward_step(*args, **kwargs)

    def ptops_forward_backward(self, *args: Any, **kwargs: Any) -> Any:
        """torchtitan's forward-backward, not kept (the recheck's and partner's runs)."""
        return super().forward_backward_step(*args, **kwargs)

    def _before_optimizer(self, *_hook: Any) -> None:
        """The optimizers' step pre-hook (after the backward and the clipping): gradient bit
        flips, then the recheck (``recipes/sdc.py``)."""
        from ptops.recipes import sdc
        from ptops.recipes.titan import partner

        ckpt = self.checkpointer
        agree = ckpt.agree_any if isinstance(ckpt, ProbeCheckpointManager) else bool
        tap, many = self.ptops_tap, _world() > 1
        pairs = tap is not None and self.ptops_sdc.partner_every > 0
        self.ptops_sdc.before_optimizer(
            self.step,
            lambda: sdc.grad_tensors(self.model_parts),
            self._recompute_grads,
            agree,
            exchange=partner.exchange_flags if tap is not None and many else None,
            partner=(lambda own: partner.partner_run(self, tap, own)) if pairs else None,
        )

    def _recompute_grads(self) -> None:
        """The step's gradients again, from the same batches and weights: torchtitan's
        train_step between its data fetch and its optimizer step (zero, forward-backward per
        accumulation group, clip), nothing logged."""
        import torch
        from torchtitan.distributed import utils as dist_utils

        self.optimizers.zero_grad(
            set_to_none=getattr(self.config.training, "disable_cuda_graphs", True)
        )
        with torch.enable_grad():
            for args, kwargs in self.ptops_fwd:
                self.ptops_forward_backward(*args, **kwargs)
        pd = self.parallel_dims
        dist_utils.clip_grad_norm_(
            [p for m in self.model_parts for p in m.parameters()],
            self.config.training.max_norm,
            foreach=True,
            pp_mesh=pd.get_optional_mesh("pp"),
            ep_enabled=pd.ep_enabled,
        )

    def init_distributed(self):
        """Start-up progress around the process group's init (the rendezvous), and what it
        formed."""
        probe = get_probe()
        if probe is not None:
            probe.startup("rendezvous")
            probe.faults.on_startup("rendezvous")
        dims = super().init_distributed()
        if probe is not None:
            probe.world(_world(), _rank())
            probe.startup("build")
            probe.faults.on_startup("build")
        return dims

    def train_step(self, data_iterator):
        global _POISON
        probe = get_probe()
        step = self.step
        self.ptops_fwd = []
        if probe is not None:
            probe.profile.at_step(step)  # a capture's boundary comes before the fault hooks
            probe.faults.before_step(step)
            probe.before_step(step)
            if self.ptops_sdc is not None:
                self.ptops_sdc.before_step(step)  # bitflip faults, then the at-rest check
            _POISON = bool(probe.faults.should_poison(step))
            if probe.profile.running:  # `ptops profile`: batches fetched inside a ptops/data range
                data_iterator = _MarkedBatches(data_iterator, probe)
        from ptops.recipes.titan import (
            rollback as _rollback,
        )  # PTOPS_ROLLBACK: lr factor, skipped batches

        _rollback.on_step(self, data_iterator, step, probe)
        begin = time.perf_counter()
        try:
            super().train_step(data_iterator)
        except RuntimeError as e:
            if probe is not None and "not finite" in str(e):
                probe.step(
                    step,
                    {
                        "loss": math.nan,
                        "grad_norm": math.nan,
                        "step_s": time.perf_counter() - begin,
                        "error": "loss_not_finite",
                    },
                )
            raise
        finally:
            _POISON = False
        step_s = time.perf_counter() - begin
        if probe is not None:
            record = self._step_record(step, step_s)
            if self.ptops_sdc is not None:
                record.update(self.ptops_sdc.after_step(step))  # fingerprint after the optimizer
            probe.step(step, record)
            self._agree_stop(probe, step)

    def _agree_stop(self, probe: Any, step: int) -> None:
        """Save-on-request: all ranks agree (all-reduce) at the end of a step, so they
        checkpoint the same step and leave the loop together (a lone stop would hang the rest)."""
        if not getattr(probe, "supervised", False) or step >= self.config.training.steps:
            return  # unsupervised: nobody can ask; the final step is saved anyway
        ckpt = self.checkpointer
        flag = probe.stop.requested
        agreed = ckpt.agree_any(flag) if isinstance(ckpt, ProbeCheckpointManager) else flag
        if agreed:
            self.ptops_stopped_at = step
            if isinstance(ckpt, ProbeCheckpointManager):
                ckpt.stop_step = step
            _log(f"stop requested: checkpointing step {step} and stopping")

    def should_continue_training(self) -> bool:
        return super().should_continue_training() and self.ptops_stopped_at is None

    def _step_record(self, step: int, step_s: float) -> dict[str, Any]:
        mp = self.metrics_processor
        raw = dict(getattr(getattr(mp, "capture", None), "last", None) or {})
        if raw.get("_step") != step:
            raw = {}
        lr = next((v for k, v in raw.items() if k.startswith("lr/")), None)
        if lr is None:
            lr = self.lr_schedulers.schedulers[0].get_last_lr()[0]
        tokens = getattr(mp, "tokens_this_log", 0) or 0
        record: dict[str, Any] = {
            "loss": raw.get("loss_metrics/global_avg_loss"),
            "grad_norm": raw.get("grad_norm"),
            "lr": lr,
            "step_s": step_s,
            "tokens_per_s": tokens / step_s if step_s > 0 else None,
        }
        skip = {"loss_metrics/global_avg_loss", "grad_norm", "_step"}
        for key, value in raw.items():
            if key in skip or key.startswith("lr/"):
                continue
            name = _metric_name(key)
            if name == "throughput_tps":
                name = "titan_tps"
            elif name == "loss_metrics_global_max_loss":
                name = "max_loss"
            elif name == "mfu_pct":
                name = "mfu"
            record[name] = value
        return record
