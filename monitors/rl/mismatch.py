"""Rollouts sampled by an engine whose policy differs from the trainer's."""

from __future__ import annotations

from typing import Any, Mapping

from ..base import first_finite, spelled
from ..config import TrainInferenceGapConfig
from .common import _BoundRL, _spellings


class TrainInferenceGapMonitor(_BoundRL):
    """Train/inference mismatch (``monitor="train_inference_gap"``): the per-token log-probability
    gap between the engine that sampled the rollouts and the trainer, past a bound.

    Reads the first present of ``keys``: TRL's own measure on the step's rollouts
    (``sampling/sampling_logp_difference/mean``, logged with vLLM's importance-sampling
    correction), else ptops' probe gap after the step's weight sync (``engine/lp_gap``). Precision
    (a bf16 engine beside an fp32 trainer), kernels and stale weights all show here; above
    ``max_gap`` the importance-sampling ratios drift from 1 and the policy gradient is biased.
    Reported once per episode (warning); all-clear after ``clear_steps`` steps within the bound.

    Known false positives: a deliberately lower-precision engine (raise ``max_gap``). Known misses:
    runs without an engine (no key).
    """

    name = "train_inference_gap"

    def __init__(self, cfg: TrainInferenceGapConfig | None = None) -> None:
        self.cfg = cfg or TrainInferenceGapConfig()
        self._own = _spellings(*self.cfg.keys)
        self._keys = tuple(spelled(k) for k in self.cfg.keys)
        self._gate = self._rewind_keys = self._own
        self._noop = (None, None)
        super().__init__()

    def _inputs(self, record: Mapping[str, Any]) -> tuple:
        """(key, gap): the first of ``keys`` holding a finite number, or (None, None)."""
        return first_finite(record, self._keys)

    def _bound(self) -> float:
        return self.cfg.max_gap

    def _texts(self, key: str, gap: float) -> tuple[str, str]:
        return (
            f"{key} {gap:.3g} > {self.cfg.max_gap:g}: the engine samples from another policy "
            "than the trainer trains (precision, kernels or stale weights)",
            f"{key} {gap:.3g} within {self.cfg.max_gap:g} for {self.cfg.clear_steps} steps",
        )
