"""RL health for TRL GRPO / DPO style runs: one small monitor per failure mode, reported as
episodes.

The keys are TRL's (``entropy``, ``kl``, ``reward``, ``frac_reward_zero_std``,
``completions/mean_length``, ``clip_ratio/region_mean``); the ptops TRL adapter
writes them sanitised (``completions_mean_length``) and both spellings match.
TRL gathers these across ranks before logging, so every rank carries the same
value; each monitor follows each rank and reports a step once, the ranks whose
values agree sharing one state (``SharedRankedMonitor``; stale_rollout keeps one
per rank: its check costs less than following).
A monitor whose key never appears stays silent (SFT, pre-training).

Why episodes: a condition that holds for 200 steps is one problem, not 200 (or a
dozen re-fired) pages. Each monitor keeps one episode at a time: ``open`` (the
first finding, warning or critical), at most one ``escalate`` (warning ->
critical), and one ``resolved`` all-clear (severity ``info``) once nothing holds
for ``clear_steps`` steps; only then can a new episode open. A run that rewinds
(resume, rollback) starts its redone timeline with no episode open.

Why incremental: ``feed`` runs for every record of every rank, so trends come
from running sums over fixed windows (:class:`_Fit`, :class:`_Tri`), O(1) per
record, no per-record window copies.

One file a failure mode; ``common`` holds the episodes and the base class, ``trend`` the running
fits and the statistics they share.
"""

from .entropy import EntropyCollapseMonitor
from .kl import KLDriftMonitor
from .mismatch import TrainInferenceGapMonitor
from .mode_collapse import ModeCollapseMonitor
from .reward_hacking import RewardHackingMonitor
from .stale import StaleRolloutMonitor

__all__ = [
    "EntropyCollapseMonitor",
    "KLDriftMonitor",
    "ModeCollapseMonitor",
    "RewardHackingMonitor",
    "StaleRolloutMonitor",
    "TrainInferenceGapMonitor",
]
