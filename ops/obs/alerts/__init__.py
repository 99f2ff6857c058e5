"""ptops alert rules: one definition, rendered as a Prometheus rule file (and mirrored as
Grafana-managed rules by ``ptops.ops.obs.dashboard``).

The shipped ``ptops-rules.yml`` beside this file is ``render_rules()`` with the
default runbook base URL; ``tests/obs/test_alerts.py`` checks they agree, and
``ops/obs/alerts/tests/*.yml`` are ``promtool test rules`` unit tests for it.

Event-driven alerts (hang, corrupt checkpoint, NaN, monitor findings) compare
``time()`` with the exporter's ``*_timestamp_seconds`` gauges, which carry the
event's own time: they fire for a fixed window after the event whatever the
scrape timing, and survive an exporter restart. The RL monitors report episodes
(one finding when a problem opens, one when it escalates, an all-clear when it
ends), so their alerts also hold while ``ptops_finding_episode_open`` says an
episode is open, and the all-clear neither counts as a finding nor re-fires them.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from ptops import envnames
from ptops.monitors.registry import monitors_for_runbook
from ptops.ops.runrecord.events import EventKind

DEFAULT_RUNBOOK_BASE_URL = "https://github.com/your-org/ptops/blob/main/runbooks"
RULES_FILE = Path(__file__).with_name("ptops-rules.yml")
GROUP = "ptops"


@dataclass(frozen=True)
class Alert:
    name: str
    expr: str
    for_: str
    severity: str
    summary: str
    description: str
    labels: dict[str, str] = field(default_factory=dict)


def _monitors(runbook: str) -> str:
    """The ``monitor`` label matcher for the findings this alert (named like its runbook) covers."""
    names = monitors_for_runbook(runbook)
    return f'monitor="{names[0]}"' if len(names) == 1 else f'monitor=~"{"|".join(names)}"'


_ACTIVE = 'ptops_run_state{state=~"running|starting|restarting|rolling_back|hung|crashed"} == 1'

ALERTS: tuple[Alert, ...] = (
    Alert(
        "TrainingHang",
        'max by (run, recipe) (ptops_run_state{state="hung"}) == 1\n'
        "or\nmax by (run, recipe) (time() - "
        f'ptops_last_event_timestamp_seconds{{kind="{EventKind.HANG}"}}) < 900',
        "10s",
        "critical",
        "Run {{ $labels.run }} hung",
        "The supervisor detected a hang in run {{ $labels.run }} ({{ $labels.recipe }}): at "
        "least one rank stopped "
        "reporting steps. It restarts the job by itself when policy allows; if the run is still "
        "hung, act now.",
    ),
    Alert(
        "TrainingCrashLoop",
        "changes(ptops_attempt[30m]) >= 3\nor\nincrease(ptops_crashes_total[30m]) >= 3",
        "1m",
        "critical",
        "Run {{ $labels.run }} is crash-looping",
        "Run {{ $labels.run }} ({{ $labels.recipe }}) restarted or crashed 3 or more times in 30 "
        "minutes: "
        "restarts are not fixing the cause (bad node, bad checkpoint, bad data, OOM).",
    ),
    Alert(
        "TrainingStalled",
        "(time() - ptops_last_progress_timestamp_seconds) > 600\n"
        f"and on (run, recipe)\n({_ACTIVE})",
        "2m",
        "critical",
        "Run {{ $labels.run }} made no progress for 10 minutes",
        "Run {{ $labels.run }} ({{ $labels.recipe }}) is not finished but reported no step for "
        "{{ $value | humanizeDuration }}. The supervisor may be dead, or ranks are stuck before "
        "the first step.",
    ),
    Alert(
        "CheckpointStale",
        "ptops_checkpoint_age_seconds > 3600\nand on (run, "
        'recipe)\nptops_run_state{state="running"} == 1',
        "5m",
        "warning",
        "Run {{ $labels.run }} has no checkpoint for over an hour",
        "The latest good checkpoint of run {{ $labels.run }} is {{ $value | humanizeDuration }} "
        "old while the run "
        "is training: a crash now loses that much work.",
    ),
    Alert(
        "CheckpointSaveFailing",
        "max by (run, recipe) (time() - "
        f'ptops_last_event_timestamp_seconds{{kind="{EventKind.CHECKPOINT_FAILED}"}}) < 1800',
        "30s",
        "critical",
        "Checkpoint saves fail in run {{ $labels.run }}",
        "A checkpoint save failed in run {{ $labels.run }} ({{ $labels.recipe }}) in the last 30 "
        "minutes "
        "(disk full, permissions, storage down). The last good checkpoint is getting older.",
    ),
    Alert(
        "CheckpointCorrupt",
        "max by (run, recipe) (time() - "
        f'ptops_last_event_timestamp_seconds{{kind="{EventKind.CHECKPOINT_INVALID}"}}) < 3600',
        "10s",
        "critical",
        "Invalid checkpoint in run {{ $labels.run }}",
        "A checkpoint of run {{ $labels.run }} failed verification against its manifest "
        "(missing, truncated or "
        "altered shard). ptops falls back to the previous good checkpoint; find out why it broke.",
    ),
    Alert(
        "StragglerRank",
        "max by (run, recipe, rank) (ptops_straggler_ratio) > 1.2",
        "1m",
        "warning",
        "Rank {{ $labels.rank }} straggles in run {{ $labels.run }}",
        'Rank {{ $labels.rank }} of run {{ $labels.run }} is {{ $value | printf "%.2f" }}x '
        "slower than the median "
        "rank; every collective waits for it.",
    ),
    Alert(
        "TrainingNaN",
        "max by (run, recipe) (time() - ptops_last_nonfinite_timestamp_seconds) < 900\n"
        "or\nmax by (run, recipe) (time() - "
        f"ptops_anomaly_last_timestamp_seconds{{{_monitors('TrainingNaN')}}}) < 900",
        "10s",
        "critical",
        "NaN/Inf loss or gradient in run {{ $labels.run }}",
        "Run {{ $labels.run }} ({{ $labels.recipe }}) produced a non-finite loss or grad norm. "
        "Training past this "
        "point is wasted; ptops rolls back to the last good checkpoint when policy says so.",
    ),
    Alert(
        "LossSpike",
        "max by (run, recipe) (time() - "
        f"ptops_anomaly_last_timestamp_seconds{{{_monitors('LossSpike')}}}) < 900\n"
        "or\nptops_loss > on (run, recipe) (3 * (quantile_over_time(0.5, ptops_loss[30m]) > 0.1))",
        "30s",
        "warning",
        "Loss spike in run {{ $labels.run }}",
        "The loss (or grad norm) of run {{ $labels.run }} jumped far above its recent level.",
    ),
    Alert(
        "EntropyCollapse",
        "max by (run, recipe) (time() - "
        f"ptops_anomaly_last_timestamp_seconds{{{_monitors('EntropyCollapse')}}}) < 900\n"
        "or\nmax by (run, recipe) "
        f"(ptops_finding_episode_open{{{_monitors('EntropyCollapse')}}}) == 1\n"
        "or\nptops_rl_entropy < 0.1 * max_over_time(ptops_rl_entropy[1h])",
        "5m",
        "warning",
        "Policy entropy collapsed in run {{ $labels.run }}",
        "The policy of RL run {{ $labels.run }} became (nearly) deterministic: entropy fell "
        "below a tenth of its "
        "recent maximum, or the entropy/mode-collapse monitor fired. Exploration has stopped.",
    ),
    Alert(
        "KLDrift",
        "max by (run, recipe) (time() - "
        f"ptops_anomaly_last_timestamp_seconds{{{_monitors('KLDrift')}}}) < 900\n"
        f"or\nmax by (run, recipe) (ptops_finding_episode_open{{{_monitors('KLDrift')}}}) == 1\n"
        "or\nptops_rl_kl > 1",
        "5m",
        "warning",
        "KL to the reference drifts in run {{ $labels.run }}",
        "The KL divergence of RL run {{ $labels.run }} from its reference model is high or "
        "rising fast "
        "({{ $value }}): the policy is moving away from the reference faster than the KL penalty "
        "allows.",
    ),
    Alert(
        "RewardHacking",
        "max by (run, recipe) (time() - "
        f"ptops_anomaly_last_timestamp_seconds{{{_monitors('RewardHacking')}}}) < 1800\n"
        f"or\nmax by (run, recipe) (ptops_finding_episode_open{{{_monitors('RewardHacking')}}}) "
        "== 1\n"
        "or\n(deriv(ptops_rl_reward[15m]) > 0\n and on (run, recipe) deriv(ptops_rl_kl[15m]) > 0\n"
        " and on (run, recipe) ptops_rl_reward_std < 0.05)",
        "10m",
        "warning",
        "Possible reward hacking in run {{ $labels.run }}",
        "Reward of RL run {{ $labels.run }} rises while KL grows and the reward spread across "
        "completions collapses, "
        "or the reward-hacking monitor fired: the policy may be exploiting the reward function.",
    ),
    Alert(
        "SilentDataCorruption",
        "max by (run, recipe) (time() - "
        f"ptops_anomaly_last_timestamp_seconds{{{_monitors('SilentDataCorruption')}}}) < 3600",
        "10s",
        "critical",
        "Silent data corruption in run {{ $labels.run }}",
        "A rank of run {{ $labels.run }} ({{ $labels.recipe }}) had its parameters or optimizer "
        "state changed outside its optimizer (or its replicas disagree): a device is lying. "
        "ptops rolled back to a clean checkpoint; if the same rank is caught again, drain its "
        "node.",
    ),
    Alert(
        "GoodputLow",
        "ptops_goodput_ratio < 0.5\nand on (run, recipe) (time() - "
        "ptops_start_timestamp_seconds) > 3600\n"
        f"and on (run, recipe)\n({_ACTIVE})",
        "30m",
        "warning",
        "Goodput of run {{ $labels.run }} is below 50%",
        "Less than half of the wall time of run {{ $labels.run }} since its launch went into "
        "steps that count "
        "({{ $value | humanizePercentage }}): restarts, redone steps, startup and checkpoint "
        "stalls eat the rest.",
    ),
    Alert(
        "SupervisorBehind",
        f"ptops_supervisor_behind == 1\nand on (run, recipe)\n({_ACTIVE})",
        "2m",
        "warning",
        "The supervisor of run {{ $labels.run }} is behind its ranks' messages",
        "The supervisor of run {{ $labels.run }} ({{ $labels.recipe }}) has handled its ranks' "
        "messages late for 2 minutes or more (ptops_supervisor_lag_seconds: by how much when it "
        "began): hang detection is late by that lag (never false), and a backlog that keeps "
        "growing ends in an out-of-memory supervisor. The run outgrew one supervisor at this "
        "step rate, or the supervisor's host is starved of CPU.",
    ),
    Alert(
        "GPUErrors",
        'increase(ptops_gpu_ecc_errors_total{type="uncorrected"}[15m]) > 0\n'
        "or\nincrease(ptops_gpu_xid_errors_total[15m]) > 0\n"
        'or\nptops_gpu_throttle{reason=~"hw_slowdown|hw_thermal_slowdown|hw_power_brake_slowdown"} '
        "== 1",
        "1m",
        "critical",
        "GPU {{ $labels.gpu }} on {{ $labels.host }} reports hardware errors",
        "GPU {{ $labels.gpu }} on host {{ $labels.host }} (run {{ $labels.run }}) reports "
        "uncorrected ECC errors, "
        "critical XID events or hardware slowdown. Drain the node.",
    ),
)

ALERT_NAMES = tuple(a.name for a in ALERTS)


def runbook_base_url(base: str | None = None) -> str:
    return (base or os.environ.get(envnames.RUNBOOK_BASE_URL) or DEFAULT_RUNBOOK_BASE_URL).rstrip(
        "/"
    )


def runbook_url(name: str, base: str | None = None) -> str:
    return f"{runbook_base_url(base)}/{name}.md"


def rule_dicts(base: str | None = None) -> list[dict]:
    out = []
    for a in ALERTS:
        out.append(
            {
                "alert": a.name,
                "expr": a.expr,
                "for": a.for_,
                "labels": {"severity": a.severity, **a.labels},
                "annotations": {
                    "summary": a.summary,
                    "description": a.description,
                    "runbook_url": runbook_url(a.name, base),
                },
            }
        )
    return out


def _literal_yaml() -> type:
    import yaml

    class Dumper(yaml.SafeDumper):
        pass

    def str_rep(dumper, data):
        if "\n" in data:
            return dumper.represent_scalar("tag:yaml.org,2002:str", data, style="|")
        return dumper.represent_scalar("tag:yaml.org,2002:str", data)

    Dumper.add_representer(str, str_rep)
    return Dumper


def render_rules(base: str | None = None) -> str:
    """The Prometheus rule file (YAML text)."""
    import yaml

    doc = {"groups": [{"name": GROUP, "rules": rule_dicts(base)}]}
    header = (
        "# ptops alert rules for Prometheus (generated by `ptops alerts` from "
        "ops/obs/alerts/__init__.py, module ptops.ops.obs.alerts).\n"
        f"# runbook_url base: {runbook_base_url(base)} (set PTOPS_RUNBOOK_BASE_URL or "
        "--runbook-base-url).\n"
    )
    return header + yaml.dump(
        doc, Dumper=_literal_yaml(), sort_keys=False, width=120, allow_unicode=True
    )
