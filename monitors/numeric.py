"""Numeric anomalies: NaN/Inf, loss spikes, grad-norm explosions.

All three follow each rank's series and report a step once across ranks
(``loss`` and ``grad_norm`` are global values in both adapters: TRL logs the
rank-averaged loss and the clipped-before norm of the whole model, TorchTitan
the global loss and norm); all three keep one state for the ranks whose values
agree (``SharedRankedMonitor``).
"""

from __future__ import annotations

import math
from typing import Any, Mapping

from .base import (
    _MISSING,
    Finding,
    SortedSeries,
    finite_of,
    median,
    median_sorted,
    number,
    quantile_sorted,
    spelled,
)
from .config import GradExplosionConfig, LossSpikeConfig, NanConfig
from .shared import SharedRankedMonitor


def _fmt(x: float | None) -> str:
    if x is None:
        return "None"
    if not math.isfinite(x):
        return str(x)
    return f"{x:.4g}"


class _NaNState:
    __slots__ = ("numeric", "bad")

    def __init__(self) -> None:
        self.numeric: set[str] = set()
        self.bad: set[str] = set()


class NaNMonitor(SharedRankedMonitor):
    """NaN / Inf in the loss or the grad norm (``monitor="nan"``, severity critical).

    Reads ``cfg.keys`` (default ``loss``, ``grad_norm``). A value is bad when it
    is a float NaN/Inf or the strings ``"nan"``, ``"inf"``, ``"-inf"``; with
    ``none_after_numeric`` also ``None`` for a key that held a number earlier on
    that rank (TRL logs None when every value it averaged was NaN; the probe
    fills None for keys an engine never reports, which is why None alone is not
    enough). Fires on the first bad step of a key and again only after the key
    was finite in between.

    Known false positives: an engine that legitimately logs None for a key on
    some steps (e.g. grad_norm only on logging steps) after numbers on others:
    set ``none_after_numeric = false`` or drop the key. Known misses: a NaN that
    an engine filters out of its averages (TRL's ``logging_nan_inf_filter``,
    which the ptops adapter turns off).
    """

    name = "nan"

    def __init__(self, cfg: NanConfig | None = None) -> None:
        self.cfg = cfg or NanConfig()
        self._keys = tuple((k, spelled(k)) for k in self.cfg.keys)
        self._nkeys = len(set(self.cfg.keys))
        self._all_finite = (True,) * len(self._keys)
        self._noop = (_MISSING,) * len(self._keys)  # no key present: nothing read, nothing changed
        super().__init__()

    def _new_state(self) -> _NaNState:
        return _NaNState()

    def _rewind(self, state: _NaNState, step: int) -> None:
        state.bad.clear()

    def _inputs(self, record: Mapping[str, Any]) -> tuple:
        """Per key what ``_apply`` reads: True (a finite number), None (a None), the text of a
        non-finite value ("nan", "inf", "-inf"), or ``_MISSING`` (absent, or no number: skipped
        alike). A text, not the float, so that a NaN equals a NaN: ranks that log the same bad value
        keep sharing one state."""
        out = []
        for _, sp in self._keys:
            raw = record.get(sp[0], _MISSING)
            if raw is _MISSING and sp[1] is not None:
                raw = record.get(sp[1], _MISSING)
            if raw is None or raw is _MISSING:
                out.append(raw)
                continue
            v = raw if type(raw) is float else number(raw)
            out.append(_MISSING if v is None else True if v - v == 0.0 else repr(v))
        return tuple(out)

    def _apply(
        self, st: _NaNState, inputs: tuple, record: Mapping[str, Any], step: int, rank: int
    ) -> list[Finding]:
        if inputs == self._all_finite and not st.bad and len(st.numeric) == self._nkeys:
            # the common case: every key seen numeric, none bad, all finite now (nothing changes)
            return []
        out: list[Finding] = []
        for (key, _), x in zip(self._keys, inputs):
            if x is True:  # finite
                if key not in st.numeric:
                    st.numeric.add(key)
                if st.bad:
                    st.bad.discard(key)
                continue
            if x is _MISSING:
                continue
            if x is None:
                if not (self.cfg.none_after_numeric and key in st.numeric):
                    continue
                v = None
                detail = f"{key} is None after numeric values (all values NaN at this step)"
            else:
                v = float(x)
                detail = f"{key} is {v} at step {step}"
            if key in st.bad:
                continue
            st.bad.add(key)
            self._emit(out, record, step, rank, key, v, detail, "critical")
        return out


_NO_VALUE = (None,)  # inputs of a record the monitor does not judge


class LossSpikeMonitor(SharedRankedMonitor):
    """Loss spike: robust z-score against a trailing window (``monitor="loss_spike"``).

    Reads ``cfg.key`` (``loss``). Per rank, over the last ``window`` finite
    values: the level is the median of the last ``level_window`` values, the
    noise is the median absolute step-to-step change / sqrt(2) (a MAD estimate
    that a falling loss curve does not inflate, unlike the MAD around a window
    median), floored at 1e-3 x |level|; ``z = (x - level) / (1.4826 * noise)``.
    A spike needs ``z >= z_threshold`` *and* ``x >= level + min_rel_jump *
    |level|``, one-sided (a loss that drops is not an incident). Steps
    ``<= warmup_steps`` and the first ``min_history`` values are never judged.
    Fires once per run of consecutive spiking steps. Spikes enter the reference,
    so a lasting level shift becomes the new normal after ~window/2 steps.

    Known false positives: the loss of a new data-mixture phase or a curriculum
    step (a real, intended level shift); very small batches (noisy loss; raise
    ``z_threshold``); RL policy losses (GRPO/PPO), which are not descent
    objectives - the monitor stands down on records with a ``reward`` key
    (``skip_rl``). Known misses: slow divergence (a drift, not a spike) and
    spikes during warm-up.
    """

    name = "loss_spike"

    def __init__(self, cfg: LossSpikeConfig | None = None) -> None:
        self.cfg = cfg or LossSpikeConfig()
        self._key = spelled(self.cfg.key)
        super().__init__()

    def _new_state(self) -> list[Any]:
        return [SortedSeries(self.cfg.window), False]  # series, in-spike latch

    def _rewind(self, st: list[Any], step: int) -> None:
        st[0].rewind(step)
        st[1] = False

    def _inputs(self, record: Mapping[str, Any]) -> tuple:
        if self.cfg.skip_rl and "reward" in record:
            return _NO_VALUE
        return (finite_of(record, self._key),)

    def _apply(
        self, st: list[Any], inputs: tuple, record: Mapping[str, Any], step: int, rank: int
    ) -> list[Finding]:
        x = inputs[0]
        if x is None:
            return []
        cfg = self.cfg
        series: SortedSeries = st[0]
        out: list[Finding] = []
        if step > cfg.warmup_steps and len(series) >= cfg.min_history:
            ref = series.values
            level = median(ref[-cfg.level_window :])
            noise = median_sorted(series.diffs) / math.sqrt(
                2
            )  # MAD-like noise of one value; blind to slow trends
            scale = 1.4826 * max(noise, 1e-3 * abs(level), 1e-12)
            z = (x - level) / scale
            spike = z >= cfg.z_threshold and (x - level) >= cfg.min_rel_jump * abs(level)
            if spike and not st[1]:
                self._emit(
                    out,
                    record,
                    step,
                    rank,
                    "spike",
                    z,
                    f"{cfg.key} {_fmt(x)} vs recent level {_fmt(level)} (robust z {z:.1f} >= "
                    f"{cfg.z_threshold:g}, "
                    f"noise from the last {len(ref)} steps)",
                    "warning",
                )
            st[1] = spike
        series.append(step, x)
        return out


class GradExplosionMonitor(SharedRankedMonitor):
    """Grad-norm explosion (``monitor="grad_explosion"``).

    Reads ``cfg.key`` (``grad_norm``; the adapters log the norm before clipping).
    Two rules: ``x >= ratio x reference`` where the reference is the
    ``reference_quantile`` (0.75) of the last ``window`` finite values on that
    rank (after ``warmup_steps`` and ``min_history``), and ``x >= abs_max`` at
    any step. Fires once per run of consecutive exploding steps; exploding values
    enter the reference.

    Known false positives: the first steps after a learning-rate warm-up ends or
    after a resume with a fresh optimizer state (grad norms jump legitimately);
    loss-scale changes in fp16 runs (norms reported before unscaling). Known
    misses: a slow climb (no single step crosses ``ratio``); an explosion that
    clipping hides because the engine logs the norm after clipping.
    """

    name = "grad_explosion"

    def __init__(self, cfg: GradExplosionConfig | None = None) -> None:
        self.cfg = cfg or GradExplosionConfig()
        self._key = spelled(self.cfg.key)
        super().__init__()

    def _new_state(self) -> list[Any]:
        return [SortedSeries(self.cfg.window), False]

    def _rewind(self, st: list[Any], step: int) -> None:
        st[0].rewind(step)
        st[1] = False

    def _inputs(self, record: Mapping[str, Any]) -> tuple:
        return (finite_of(record, self._key),)

    def _apply(
        self, st: list[Any], inputs: tuple, record: Mapping[str, Any], step: int, rank: int
    ) -> list[Finding]:
        x = inputs[0]
        if x is None:
            return []
        cfg = self.cfg
        series: SortedSeries = st[0]
        out: list[Finding] = []
        detail = None
        value = None
        if cfg.abs_max and x >= cfg.abs_max:
            detail = f"{cfg.key} {_fmt(x)} >= absolute cap {cfg.abs_max:g}"
            value = x
        elif step > cfg.warmup_steps and len(series) >= cfg.min_history:
            ref = quantile_sorted(series.sorted, cfg.reference_quantile)
            if ref > 0 and x >= cfg.ratio * ref:
                value = x / ref
                detail = (
                    f"{cfg.key} {_fmt(x)} is {value:.1f}x the trailing "
                    f"p{round(cfg.reference_quantile * 100)} "
                    f"{_fmt(ref)} (>= {cfg.ratio:g}x, last {len(series)} steps)"
                )
        exploding = detail is not None
        if exploding and not st[1]:
            self._emit(out, record, step, rank, "explosion", value, detail or "", "critical")
        st[1] = exploding
        series.append(step, x)
        return out
