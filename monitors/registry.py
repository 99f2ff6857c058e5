"""The monitor registry: every monitor's name, class, config class, family and runbook, declared
once.

``[monitors]`` (``config.MonitorsSection``), ``build_monitors``, the Prometheus
exporter's monitor labels, ``diagnose``'s runbook links and the alert rules' monitor
selectors all read this table. Adding a monitor: write the class (``base.Monitor``: ``feed``
and ``reset``; docs/development.md) and its config, add one line here and the config field in
``MonitorsSection`` (a test checks they agree), and a ``runbooks/<runbook>.md`` (a test checks
the file exists).
"""

from __future__ import annotations

from dataclasses import dataclass

from .config import (
    EntropyCollapseConfig,
    GradExplosionConfig,
    KLDriftConfig,
    LossPlateauConfig,
    LossSpikeConfig,
    MemoryConfig,
    ModeCollapseConfig,
    NanConfig,
    RewardHackingConfig,
    SdcConfig,
    StaleRolloutConfig,
    StragglerConfig,
    TrainInferenceGapConfig,
)
from .memory import MemoryMonitor
from .numeric import GradExplosionMonitor, LossSpikeMonitor, NaNMonitor
from .plateau import LossPlateauMonitor
from .rl import (
    EntropyCollapseMonitor,
    KLDriftMonitor,
    ModeCollapseMonitor,
    RewardHackingMonitor,
    StaleRolloutMonitor,
    TrainInferenceGapMonitor,
)
from .sdc import SdcMonitor
from .straggler import StragglerMonitor


@dataclass(frozen=True)
class MonitorInfo:
    name: str  # the ``[monitors]`` key, ``Finding.monitor`` and the ``monitor`` label
    monitor: type
    config: type
    family: str  # straggler | numeric | rl | memory | sdc
    runbook: str  # runbooks/<runbook>.md


def _info(monitor: type, config: type, family: str, runbook: str) -> MonitorInfo:
    return MonitorInfo(monitor.name, monitor, config, family, runbook)


# In the order they run (and are listed).
MONITORS: dict[str, MonitorInfo] = {
    m.name: m
    for m in (
        _info(StragglerMonitor, StragglerConfig, "straggler", "StragglerRank"),
        _info(NaNMonitor, NanConfig, "numeric", "TrainingNaN"),
        _info(LossSpikeMonitor, LossSpikeConfig, "numeric", "LossSpike"),
        _info(LossPlateauMonitor, LossPlateauConfig, "numeric", "LossPlateau"),
        _info(GradExplosionMonitor, GradExplosionConfig, "numeric", "LossSpike"),
        _info(EntropyCollapseMonitor, EntropyCollapseConfig, "rl", "EntropyCollapse"),
        _info(KLDriftMonitor, KLDriftConfig, "rl", "KLDrift"),
        _info(RewardHackingMonitor, RewardHackingConfig, "rl", "RewardHacking"),
        _info(ModeCollapseMonitor, ModeCollapseConfig, "rl", "EntropyCollapse"),
        _info(StaleRolloutMonitor, StaleRolloutConfig, "rl", "StaleRollouts"),
        _info(TrainInferenceGapMonitor, TrainInferenceGapConfig, "rl", "TrainInferenceMismatch"),
        _info(MemoryMonitor, MemoryConfig, "memory", "MemoryForecast"),
        _info(SdcMonitor, SdcConfig, "sdc", "SilentDataCorruption"),
    )
}

MONITOR_NAMES: tuple[str, ...] = tuple(MONITORS)
MONITOR_CLASSES: dict[str, type] = {n: m.monitor for n, m in MONITORS.items()}
FAMILIES: dict[str, str] = {n: m.family for n, m in MONITORS.items()}
RUNBOOKS: dict[str, str] = {n: m.runbook for n, m in MONITORS.items()}


def monitors_for_runbook(runbook: str) -> tuple[str, ...]:
    """The monitors whose findings the runbook (and its alert) covers, in registry order."""
    return tuple(n for n, m in MONITORS.items() if m.runbook == runbook)
