"""Monitors: pure functions of the metric-record stream (no ptops imports, no torch, no I/O, no clock).

    from ptops.monitors import MonitorsSection, build_monitors, replay
    findings = replay(records, build_monitors(MonitorsSection()))

The same objects run live in the supervisor (``m.feed(record)`` per record) and
offline over a run's ``metrics.jsonl`` (``ptops diagnose``).
"""

from __future__ import annotations

from .base import FAMILIES, Finding, Monitor, RankedMonitor, number, replay
from .config import (
    ACTIONS,
    MONITOR_NAMES,
    EntropyCollapseConfig,
    GradExplosionConfig,
    KLDriftConfig,
    LossSpikeConfig,
    ModeCollapseConfig,
    MonitorsSection,
    NanConfig,
    RewardHackingConfig,
    RollbackPolicy,
    StaleRolloutConfig,
    StragglerConfig,
)
from .numeric import GradExplosionMonitor, LossSpikeMonitor, NaNMonitor
from .rl import (
    EntropyCollapseMonitor,
    KLDriftMonitor,
    ModeCollapseMonitor,
    RewardHackingMonitor,
    StaleRolloutMonitor,
)
from .straggler import StragglerMonitor

MONITOR_CLASSES = {
    "straggler": StragglerMonitor,
    "nan": NaNMonitor,
    "loss_spike": LossSpikeMonitor,
    "grad_explosion": GradExplosionMonitor,
    "entropy_collapse": EntropyCollapseMonitor,
    "kl_drift": KLDriftMonitor,
    "reward_hacking": RewardHackingMonitor,
    "mode_collapse": ModeCollapseMonitor,
    "stale_rollout": StaleRolloutMonitor,
}


def build_monitors(section: MonitorsSection | None = None) -> list[Monitor]:
    """Fresh monitor objects for every enabled monitor of a ``[monitors]`` section (defaults when None)."""
    section = section or MonitorsSection()
    if not section.enabled:
        return []
    out: list[Monitor] = []
    for name, cls in MONITOR_CLASSES.items():
        cfg = getattr(section, name)
        if cfg.enabled:
            out.append(cls(cfg))
    return out


__all__ = [
    "ACTIONS", "FAMILIES", "MONITOR_CLASSES", "MONITOR_NAMES",
    "Finding", "Monitor", "RankedMonitor", "build_monitors", "number", "replay",
    "MonitorsSection", "RollbackPolicy", "StragglerConfig", "NanConfig", "LossSpikeConfig",
    "GradExplosionConfig", "EntropyCollapseConfig", "KLDriftConfig", "RewardHackingConfig",
    "ModeCollapseConfig", "StaleRolloutConfig",
    "StragglerMonitor", "NaNMonitor", "LossSpikeMonitor", "GradExplosionMonitor",
    "EntropyCollapseMonitor", "KLDriftMonitor", "RewardHackingMonitor", "ModeCollapseMonitor",
    "StaleRolloutMonitor",
]
