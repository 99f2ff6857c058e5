"""``ProbeMetricsProcessor``: torchtitan's metric computation, kept, with its result captured on
every rank (torchtitan logs on rank 0 only), and ``_metric_name``: its names as ptops record keys.

Its own module: what torchtitan measures is apart from the train step that hands it to the probe
(``ProbeTrainer._step_record``). Import only after ``compat.apply()`` (``registry`` does that).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torchtitan.components.metrics import BaseLogger, MetricsProcessor


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


def _metric_name(key: str) -> str:
    """torchtitan names (``memory/max_reserved(GiB)``) -> flat snake names."""
    out = (
        key.replace("(%)", "_pct")
        .replace("(GiB)", "_gib")
        .replace("(s)", "_s")
        .replace("(tps)", "_tps")
    )
    for ch in "/()% ":
        out = out.replace(ch, "_")
    while "__" in out:
        out = out.replace("__", "_")
    return out.strip("_")
