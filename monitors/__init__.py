"""Monitors: pure functions of the metric-record stream (no ptops imports, no torch, no I/O, no
clock).

    from ptops.monitors import MonitorsSection, build_monitors, replay
    findings = replay(records, build_monitors(MonitorsSection()))

The same objects run live in the supervisor and offline over a run's ``metrics.jsonl``
(``ptops diagnose``): ``m.feed(record)`` per record, or, where every monitor gets the record,
``feed_at(record, keys, step, rank)`` with the record parsed once for all (``fast_entries``).

What the folder holds: pure monitors (straggler, numeric, RL, hang, memory, silent data
corruption), their `[monitors]` config, the registry (`registry.py`: name, class, config,
runbook); the contract and helpers (`base.py`); one state for ranks that report the same values
(`shared.py`). May import (of ptops): nothing.
"""

from __future__ import annotations

from .base import Fed, Finding, Monitor, RankedMonitor, fast_entries, number, replay
from .config import (
    ACTIONS,
    EntropyCollapseConfig,
    GradExplosionConfig,
    KLDriftConfig,
    LossSpikeConfig,
    MemoryConfig,
    ModeCollapseConfig,
    MonitorsSection,
    NanConfig,
    RewardHackingConfig,
    RollbackPolicy,
    SdcConfig,
    StaleRolloutConfig,
    StragglerConfig,
    TrainInferenceGapConfig,
)
from .memory import MemoryMonitor
from .numeric import GradExplosionMonitor, LossSpikeMonitor, NaNMonitor
from .registry import (
    FAMILIES,
    MONITOR_CLASSES,
    MONITOR_NAMES,
    MONITORS,
    RUNBOOKS,
    MonitorInfo,
    monitors_for_runbook,
)
from .rl import (
    EntropyCollapseMonitor,
    KLDriftMonitor,
    ModeCollapseMonitor,
    RewardHackingMonitor,
    StaleRolloutMonitor,
    TrainInferenceGapMonitor,
)
from .sdc import SdcMonitor
from .shared import SharedRankedMonitor
from .straggler import StragglerMonitor


def build_monitors(section: MonitorsSection | None = None) -> list[Fed]:
    """Fresh monitor objects for every enabled monitor of a ``[monitors]`` section (defaults when
    None)."""
    section = section or MonitorsSection()
    if not section.enabled:
        return []
    out: list[Fed] = []
    for name, info in MONITORS.items():
        cfg = getattr(section, name)
        if cfg.enabled:
            try:
                out.append(info.monitor(cfg))
            except Exception as e:  # any constructor error is a bad config of that monitor
                raise MonitorConfigError(name, e) from e
    return out


class MonitorConfigError(ValueError):
    """A monitor that cannot be built from its ``[monitors.<name>]`` settings (callers name the
    file)."""

    def __init__(self, monitor: str, error: Exception):
        super().__init__(f"{type(error).__name__}: {error}")
        self.monitor = monitor


__all__ = [
    "ACTIONS",
    "FAMILIES",
    "MONITOR_CLASSES",
    "MONITOR_NAMES",
    "MONITORS",
    "RUNBOOKS",
    "MonitorInfo",
    "monitors_for_runbook",
    "Fed",
    "Finding",
    "Monitor",
    "MonitorConfigError",
    "RankedMonitor",
    "SharedRankedMonitor",
    "build_monitors",
    "fast_entries",
    "number",
    "replay",
    "MonitorsSection",
    "RollbackPolicy",
    "StragglerConfig",
    "NanConfig",
    "LossSpikeConfig",
    "GradExplosionConfig",
    "EntropyCollapseConfig",
    "KLDriftConfig",
    "RewardHackingConfig",
    "ModeCollapseConfig",
    "StaleRolloutConfig",
    "MemoryConfig",
    "StragglerMonitor",
    "NaNMonitor",
    "LossSpikeMonitor",
    "GradExplosionMonitor",
    "EntropyCollapseMonitor",
    "KLDriftMonitor",
    "RewardHackingMonitor",
    "ModeCollapseMonitor",
    "StaleRolloutMonitor",
    "TrainInferenceGapConfig",
    "TrainInferenceGapMonitor",
    "MemoryMonitor",
    "SdcConfig",
    "SdcMonitor",
]
