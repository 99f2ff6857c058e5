"""Loss plateau: the loss stopped improving (``monitor="loss_plateau"``, warning).

The worked example of docs/development.md ("Writing a monitor"): ``feed`` and ``reset``, a config
(``config.py``), a row in ``registry.py`` and ``runbooks/LossPlateau.md``.

Smoothed by an EMA, not a window: three numbers of state, and one lucky low step cannot set a best
that the curve never reaches again (a window's minimum can). A plateau: the EMA has not gone below
its best by more than ``min_delta`` x |best| for ``patience`` steps; reported once, and again only
after an improvement. Known false positives: a run that converges by design (a fine-tune past its
best, a long constant-LR phase); RL losses are no descent objective (leave it off there).
"""

from __future__ import annotations

import math
from typing import Any, Mapping

from .base import Finding, Monitor
from .config import LossPlateauConfig


class LossPlateauMonitor(Monitor):
    name = "loss_plateau"

    def __init__(self, cfg: LossPlateauConfig | None = None) -> None:
        self.cfg = cfg or LossPlateauConfig()
        self.reads = (self.cfg.key,)  # opt-in: feed depends on the loss alone (ranks share)
        self.reset(0)

    def reset(self, step: int) -> None:
        self.ema: float | None = None  # the smoothed loss
        self.best = math.inf  # the EMA at the last improvement
        self.since = 0  # the step of the last improvement
        self.told = False  # this plateau was reported

    def feed(self, record: Mapping[str, Any]) -> list[Finding]:
        x, step = record.get(self.cfg.key), record["step"]
        if type(x) not in (int, float) or not math.isfinite(x):
            return []  # None, "nan", NaN: not a loss to smooth (the nan monitor's business)
        cfg = self.cfg
        a = 2.0 / (cfg.ema_span + 1)
        self.ema = ema = x if self.ema is None else self.ema + a * (x - self.ema)
        if self.best == math.inf or ema < self.best - cfg.min_delta * abs(self.best):
            self.best, self.since, self.told = ema, step, False
            return []
        if step - self.since < cfg.patience or self.told:
            return []
        self.told = True
        detail = (
            f"{cfg.key} (EMA {ema:.4g}) not below its best {self.best:.4g} by more than "
            f"{cfg.min_delta:g} x |best| for {step - self.since} steps"
        )
        return [Finding(self.name, step, ema, detail, "warning")]
