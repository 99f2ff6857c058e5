"""ptops' torchtitan components, plugged in through torchtitan's own extension points.

- ``ProbeTrainer``: a ``Trainer`` subclass (own nested ``Config``) that calls the
  rank probe at the start and end of each optimizer step and arms the NaN
  fault hook.
- ``ProbeMetricsProcessor``: a ``MetricsProcessor`` subclass whose logger hands
  torchtitan's per-step metrics to the trainer (every rank, not just rank 0).
- ``ProbeCheckpointManager``: torchtitan's DCP ``CheckpointManager`` that tells
  the probe when a save starts and ends.
- ``PoisonableCrossEntropyLoss``: torchtitan's cross-entropy, multiplied by NaN
  when the probe asks for it (fault injection), before backward.
- ``register_local_text_dataset``: the ptops text corpus as an entry of
  torchtitan's ``DATASETS`` table (no hub download).

Import only after ``compat.apply()`` (``registry`` does that).
"""

from __future__ import annotations

import math
import random
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from torchtitan.components.checkpoint import CheckpointManager
from torchtitan.components.loss import CrossEntropyLoss
from torchtitan.components.metrics import BaseLogger, MetricsProcessor
from torchtitan.trainer import Trainer

DATASET_NAME = "ptops_text"

# The probe of this process; set by ``ptops.recipes.titan.run.main``. Without
# one (e.g. torchtitan's own CLI with --module ptops.recipes.titan.registry)
# the components behave like stock torchtitan.
_PROBE: Any = None
_POISON = False


def set_probe(probe: Any) -> None:
    global _PROBE
    _PROBE = probe


def get_probe() -> Any:
    return _PROBE


# --------------------------------------------------------------------------- #
def register_local_text_dataset(seed: int = 0) -> str:
    """Add ``ptops_text`` to torchtitan's dataset table; returns its name.

    The corpus comes from ``ptops.recipes.assets.text_corpus()`` (generated,
    deterministic); its order is shuffled with ``seed`` so that ``train.seed``
    also fixes the data order.
    """
    from datasets import Dataset

    from torchtitan.hf_datasets import DatasetConfig
    from torchtitan.hf_datasets.text_datasets import DATASETS

    from ptops.recipes.assets import text_corpus

    def loader(path: str) -> Dataset:
        rows = text_corpus()
        random.Random(seed).shuffle(rows)
        return Dataset.from_dict({"text": rows})

    DATASETS[DATASET_NAME] = DatasetConfig(
        path="ptops://text_corpus",
        loader=loader,
        sample_processor=lambda sample: sample["text"],
    )
    return DATASET_NAME


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
class _CaptureLogger(BaseLogger):
    def __init__(self) -> None:
        self.last: dict[str, Any] | None = None

    def log(self, metrics: dict[str, Any], step: int) -> None:
        self.last = dict(metrics, _step=step)


class ProbeMetricsProcessor(MetricsProcessor):
    """Keeps torchtitan's metric computation; captures the result on every rank.

    With pipeline parallelism only the last stage computes the loss; the loss
    is summed over the PP group (other stages contribute 0) so every rank
    records the real value.
    """

    @dataclass(kw_only=True, slots=True)
    class Config(MetricsProcessor.Config):
        pass

    pp_has_last_stage: bool = True

    def _build_metric_logger(self, **kwargs: Any) -> BaseLogger:
        self.capture = _CaptureLogger()
        return self.capture

    def log(self, step, global_avg_loss, global_max_loss, grad_norm, extra_metrics=None):
        if self.parallel_dims.pp_enabled:
            mine = 1.0 if self.pp_has_last_stage else 0.0
            t = torch.tensor([global_avg_loss * mine, global_max_loss * mine], dtype=torch.float64)
            dist.all_reduce(t, group=self.parallel_dims.get_mesh("pp").get_group())
            global_avg_loss, global_max_loss = float(t[0]), float(t[1])
        self.tokens_this_log = self.ntokens_since_last_log
        super().log(step, global_avg_loss, global_max_loss, grad_norm, extra_metrics)


# --------------------------------------------------------------------------- #
class ProbeCheckpointManager(CheckpointManager):
    """torchtitan's DCP checkpointing; the probe hears ``checkpoint`` before and ``step`` after.

    Also applies the retention policy after the final-step save (torchtitan
    itself purges only after interval saves).
    """

    @dataclass(kw_only=True, slots=True)
    class Config(CheckpointManager.Config):
        pass

    def save(self, curr_step: int, last_step: bool = False) -> bool:
        if not (self.enable and self._should_save(curr_step, last_step)):
            return super().save(curr_step, last_step)
        probe = get_probe()
        begin = time.monotonic()
        if probe is not None:
            probe.phase("checkpoint", curr_step)
        saved = super().save(curr_step, last_step)
        if last_step and saved:
            # torchtitan purges only after interval saves; keep ``keep`` at the end too
            self._purge_stale_checkpoints()
        self.last_save_s = time.monotonic() - begin
        if probe is not None:
            probe.phase("step", curr_step)
        return saved


# --------------------------------------------------------------------------- #
def _metric_name(key: str) -> str:
    """torchtitan names (``memory/max_reserved(GiB)``) -> flat snake names."""
    out = key.replace("(%)", "_pct").replace("(GiB)", "_gib").replace("(s)", "_s").replace("(tps)", "_tps")
    for ch in "/()% ":
        out = out.replace(ch, "_")
    while "__" in out:
        out = out.replace("__", "_")
    return out.strip("_")


class ProbeTrainer(Trainer):
    """torchtitan's Trainer with the ptops probe around every optimizer step."""

    @dataclass(kw_only=True, slots=True)
    class Config(Trainer.Config):
        pass

    def __init__(self, config: Config):
        super().__init__(config)
        if isinstance(self.metrics_processor, ProbeMetricsProcessor):
            self.metrics_processor.pp_has_last_stage = (
                self.pp_has_last_stage if self.parallel_dims.pp_enabled else True
            )

    def train_step(self, data_iterator):
        global _POISON
        probe = get_probe()
        step = self.step
        if probe is not None:
            probe.before_step(step)
            _POISON = bool(probe.should_poison(step))
        begin = time.perf_counter()
        try:
            super().train_step(data_iterator)
        except RuntimeError as e:
            if probe is not None and "not finite" in str(e):
                probe.step(step, {"loss": math.nan, "grad_norm": math.nan,
                                  "step_s": time.perf_counter() - begin, "error": "loss_not_finite"})
            raise
        finally:
            _POISON = False
        step_s = time.perf_counter() - begin
        if probe is not None:
            probe.step(step, self._step_record(step, step_s))

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
