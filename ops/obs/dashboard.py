"""Grafana: the ptops dashboard, Grafana-managed alert rules, file provisioning, and push.

Built with grafana-foundation-sdk (pin ``grafana-foundation-sdk==1769699379!11.6.0``,
the Grafana 11.6 flavour). The panels' PromQL lives in :data:`PANELS`, so tests
can check every query against promtool and a real Prometheus; the alert rules
mirror :mod:`ptops.ops.obs.alerts` one for one.

- :func:`dashboard_dict` / :func:`dashboard_json`: the dashboard model (``ptops dashboard``).
- :func:`alert_rule_group`: the Grafana-managed rule group (provisioning API shape).
- :func:`provisioning_files` / :func:`write_provisioning`: a folder Grafana loads
  with ``paths.provisioning`` (datasource, dashboard provider + dashboard, alert rules).
- :func:`push`: provision folder, dashboard and rule group through grafana-client.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DASHBOARD_UID = "ptops-training"
DASHBOARD_TITLE = "ptops: training runs"
FOLDER_UID = "ptops"
FOLDER_TITLE = "ptops"
DATASOURCE_UID = "ptops-prometheus"
RULE_GROUP = "ptops"
RULE_GROUP_INTERVAL_S = 30
SHIPPED_PROVISIONING = Path(__file__).with_name("grafana") / "provisioning"

SEL = 'run=~"$run"'


@dataclass(frozen=True)
class PanelSpec:
    row: str
    title: str
    targets: tuple[tuple[str, str], ...]  # (expr, legend)
    unit: str = "short"
    kind: str = "timeseries"  # or "stat"
    needs: str = ""  # "", "gpu" (no data without NVML), "rl" (RL recipes only)
    description: str = ""


def _p(row, title, targets, unit="short", kind="timeseries", needs="", description=""):
    return PanelSpec(row, title, tuple(targets), unit, kind, needs, description)


PANELS: tuple[PanelSpec, ...] = (
    # ---------------------------------------------------------------- run overview
    _p(
        "Run overview",
        "State",
        [(f"max by (run, state) (ptops_run_state{{{SEL}}}) == 1", "{{run}}: {{state}}")],
        kind="stat",
        description="Current supervisor state per run.",
    ),
    _p("Run overview", "Step", [(f"ptops_step{{{SEL}}}", "{{run}}")], kind="stat"),
    _p("Run overview", "Attempt", [(f"ptops_attempt{{{SEL}}}", "{{run}}")], kind="stat"),
    _p(
        "Run overview",
        "Goodput",
        [(f"ptops_goodput_ratio{{{SEL}}}", "{{run}}")],
        unit="percentunit",
        kind="stat",
        description="Productive step time / wall time since the first launch.",
    ),
    _p(
        "Run overview",
        "Where the wall time went",
        [(f"ptops_goodput_lost_seconds{{{SEL}}}", "{{run}}: {{cause}}")],
        unit="s",
        description="Wall time not spent in productive steps, by cause: startup, detection, "
        "restart, "
        "recomputed steps, checkpoint blocking, shutdown, other.",
    ),
    _p(
        "Run overview",
        "Since last progress",
        [(f"time() - ptops_last_progress_timestamp_seconds{{{SEL}}}", "{{run}}")],
        unit="s",
        kind="stat",
    ),
    _p("Run overview", "Exporter up", [(f"ptops_up{{{SEL}}}", "{{run}}")], kind="stat"),
    # ---------------------------------------------------------------- throughput
    _p(
        "Throughput",
        "Tokens per second",
        [(f"ptops_tokens_per_second{{{SEL}}}", "{{run}}")],
        unit="short",
    ),
    _p(
        "Throughput",
        "Step time (p50, p95)",
        [
            (
                "histogram_quantile(0.5, sum by (run, le) "
                f"(rate(ptops_step_duration_seconds_bucket{{{SEL}}}[$__rate_interval])))",
                "{{run}} p50",
            ),
            (
                "histogram_quantile(0.95, sum by (run, le) "
                f"(rate(ptops_step_duration_seconds_bucket{{{SEL}}}[$__rate_interval])))",
                "{{run}} p95",
            ),
        ],
        unit="s",
    ),
    _p(
        "Throughput",
        "Steps per second",
        [(f"rate(ptops_step_duration_seconds_count{{{SEL}}}[$__rate_interval])", "{{run}}")],
        unit="short",
    ),
    # ---------------------------------------------------------------- loss
    _p("Loss and grad norm", "Loss", [(f"ptops_loss{{{SEL}}}", "{{run}}")]),
    _p("Loss and grad norm", "Grad norm", [(f"ptops_grad_norm{{{SEL}}}", "{{run}}")]),
    _p("Loss and grad norm", "Learning rate", [(f"ptops_learning_rate{{{SEL}}}", "{{run}}")]),
    _p(
        "Loss and grad norm",
        "Non-finite steps",
        [(f"ptops_nonfinite_total{{{SEL}}}", "{{run}} {{metric}}")],
    ),
    # ---------------------------------------------------------------- checkpoints
    _p(
        "Checkpoints",
        "Checkpoint age",
        [(f"ptops_checkpoint_age_seconds{{{SEL}}}", "{{run}}")],
        unit="s",
    ),
    _p(
        "Checkpoints",
        "Last good checkpoint step",
        [(f"ptops_checkpoint_last_good_step{{{SEL}}}", "{{run}}")],
    ),
    _p(
        "Checkpoints",
        "Checkpoint time",
        [
            (f"ptops_checkpoint_blocking_seconds{{{SEL}}}", "{{run}} blocking"),
            (f"ptops_checkpoint_total_seconds{{{SEL}}}", "{{run}} total"),
        ],
        unit="s",
    ),
    _p(
        "Checkpoints",
        "Save failures and invalid checkpoints",
        [
            (f"ptops_checkpoint_save_failures_total{{{SEL}}}", "{{run}} save failures"),
            (f"ptops_checkpoint_invalid_total{{{SEL}}}", "{{run}} invalid"),
        ],
    ),
    # ---------------------------------------------------------------- incidents
    _p(
        "Restarts and incidents",
        "Restarts by reason",
        [(f"ptops_restarts_total{{{SEL}}}", "{{run}} {{reason}}")],
    ),
    _p(
        "Restarts and incidents",
        "Hangs and crashes",
        [
            (f"ptops_hangs_total{{{SEL}}}", "{{run}} hangs"),
            (f"ptops_crashes_total{{{SEL}}}", "{{run}} crashes"),
            (f"ptops_rollbacks_total{{{SEL}}}", "{{run}} rollbacks"),
        ],
    ),
    _p(
        "Restarts and incidents",
        "Monitor findings",
        [(f"sum by (run, monitor) (ptops_anomalies_total{{{SEL}}}) > 0", "{{run}} {{monitor}}")],
    ),
    _p(
        "Restarts and incidents",
        "Supervisor behind",
        [
            (f"ptops_supervisor_behind{{{SEL}}}", "{{run}} behind"),
            (f"ptops_supervisor_lag_seconds{{{SEL}}}", "{{run}} lag when it began (s)"),
        ],
        description="1 while the supervisor handles its ranks' messages late (an inbox_behind "
        "episode): hang detection is late by the lag meanwhile. Runbook SupervisorBehind.",
    ),
    _p(
        "Restarts and incidents",
        "Events",
        [(f"sum by (run, kind) (ptops_events_total{{{SEL}}})", "{{run}} {{kind}}")],
    ),
    # ---------------------------------------------------------------- stragglers
    _p(
        "Stragglers by rank",
        "Step time by rank",
        [(f"ptops_rank_step_duration_seconds{{{SEL}}}", "{{run}} rank {{rank}}")],
        unit="s",
    ),
    _p(
        "Stragglers by rank",
        "Straggler ratio",
        [(f"ptops_straggler_ratio{{{SEL}}}", "{{run}} rank {{rank}}")],
        description="Only ranks a straggler finding named in the last 5 minutes.",
    ),
    _p(
        "Stragglers by rank",
        "Straggler findings by rank",
        [(f"ptops_stragglers_total{{{SEL}}}", "{{run}} rank {{rank}}")],
    ),
    # ---------------------------------------------------------------- RL
    _p("RL health", "Entropy", [(f"ptops_rl_entropy{{{SEL}}}", "{{run}}")], needs="rl"),
    _p("RL health", "KL to reference", [(f"ptops_rl_kl{{{SEL}}}", "{{run}}")], needs="rl"),
    _p(
        "RL health",
        "Reward (mean, std)",
        [
            (f"ptops_rl_reward{{{SEL}}}", "{{run}} reward"),
            (f"ptops_rl_reward_std{{{SEL}}}", "{{run}} reward std"),
        ],
        needs="rl",
    ),
    # ---------------------------------------------------------------- GPU
    _p(
        "GPU",
        "GPU utilisation",
        [(f"ptops_gpu_utilization_ratio{{{SEL}}}", "{{host}} gpu {{gpu}}")],
        unit="percentunit",
        needs="gpu",
    ),
    _p(
        "GPU",
        "GPU memory",
        [
            (f"ptops_gpu_memory_used_bytes{{{SEL}}}", "{{host}} gpu {{gpu}} used"),
            (f"ptops_gpu_memory_total_bytes{{{SEL}}}", "{{host}} gpu {{gpu}} total"),
        ],
        unit="bytes",
        needs="gpu",
    ),
    _p(
        "GPU",
        "Temperature",
        [(f"ptops_gpu_temperature_celsius{{{SEL}}}", "{{host}} gpu {{gpu}}")],
        unit="celsius",
        needs="gpu",
    ),
    _p(
        "GPU",
        "Power",
        [(f"ptops_gpu_power_watts{{{SEL}}}", "{{host}} gpu {{gpu}}")],
        unit="watt",
        needs="gpu",
    ),
    _p(
        "GPU",
        "SM clock",
        [(f"ptops_gpu_sm_clock_hertz{{{SEL}}}", "{{host}} gpu {{gpu}}")],
        unit="hertz",
        needs="gpu",
    ),
    _p(
        "GPU",
        "Throttling",
        [(f"ptops_gpu_throttle{{{SEL}}} == 1", "{{host}} gpu {{gpu}} {{reason}}")],
        needs="gpu",
    ),
    _p(
        "GPU",
        "ECC and XID errors",
        [
            (f"ptops_gpu_ecc_errors_total{{{SEL}}}", "{{host}} gpu {{gpu}} ecc {{type}}"),
            (f"ptops_gpu_xid_errors_total{{{SEL}}}", "{{host}} gpu {{gpu}} xid"),
        ],
        needs="gpu",
    ),
)

ROWS = tuple(dict.fromkeys(p.row for p in PANELS))


def panel_exprs(substitute: bool = False) -> list[tuple[PanelSpec, str]]:
    """Every (panel, expr); ``substitute`` replaces Grafana variables for plain Prometheus."""
    out = []
    for p in PANELS:
        for expr, _ in p.targets:
            out.append((p, promql(expr) if substitute else expr))
    return out


def promql(expr: str, rate_interval: str = "1m") -> str:
    """A dashboard expr as plain PromQL (``$run`` -> any run, ``$__rate_interval`` ->
    ``rate_interval``)."""
    return expr.replace("$__rate_interval", rate_interval).replace('"$run"', '".*"')


# ---------------------------------------------------------------------- dashboard


def _encode(obj: Any) -> Any:
    from grafana_foundation_sdk.cog.encoder import JSONEncoder

    return json.loads(json.dumps(obj, cls=JSONEncoder))


def build_dashboard():
    from grafana_foundation_sdk.builders import dashboard as db
    from grafana_foundation_sdk.builders import prometheus, stat, timeseries
    from grafana_foundation_sdk.models.dashboard import DataSourceRef, VariableRefresh, VariableSort

    ds = DataSourceRef(type_val="prometheus", uid="${datasource}")
    d = (
        db.Dashboard(DASHBOARD_TITLE)
        .uid(DASHBOARD_UID)
        .description(
            "ptops: supervised TorchTitan/TRL runs: progress, throughput, loss, checkpoints, "
            "incidents, "
            "stragglers, RL health, GPUs. Fed by the ptops Prometheus exporter."
        )
        .tags(["ptops", "training"])
        .refresh("30s")
        .time("now-6h", "now")
        .timezone("browser")
        .with_variable(db.DatasourceVariable("datasource").label("Prometheus").type("prometheus"))
        .with_variable(
            db.QueryVariable("run")
            .label("Run")
            .datasource(ds)
            .query({"query": "label_values(ptops_up, run)", "refId": "ptops-run"})
            .refresh(VariableRefresh.ON_TIME_RANGE_CHANGED)
            .sort(VariableSort.ALPHABETICAL_ASC)
            .multi(True)
            .include_all(True)
            .all_value(".*")
        )
    )
    ids = iter(range(1, 1000))
    for row in ROWS:
        d = d.with_row(db.Row(row).id(next(ids)))
        for p in (p for p in PANELS if p.row == row):
            panel = (
                (stat.Panel() if p.kind == "stat" else timeseries.Panel())
                .id(next(ids))
                .title(p.title)
                .datasource(ds)
                .unit(p.unit)
                .height(4 if p.kind == "stat" else 8)
                .span(4 if p.kind == "stat" else 8)
            )
            if p.description:
                panel = panel.description(p.description)
            for i, (expr, legend) in enumerate(p.targets):
                panel = panel.with_target(
                    prometheus.Dataquery()
                    .expr(expr)
                    .legend_format(legend)
                    .ref_id(chr(ord("A") + i))
                    .datasource(ds)
                )
            d = d.with_panel(panel)
    return d.build()


def dashboard_dict() -> dict:
    return _encode(build_dashboard())


def dashboard_json(indent: int = 2) -> str:
    return json.dumps(dashboard_dict(), indent=indent, sort_keys=False) + "\n"


# ---------------------------------------------------------------------- Grafana-managed alert rules


def _grafana_rules(datasource_uid: str, folder_uid: str, runbook_base: str | None = None):
    from grafana_foundation_sdk.builders import alerting, expr, prometheus
    from grafana_foundation_sdk.models.alerting import RelativeTimeRange
    from grafana_foundation_sdk.models.dashboard import DataSourceRef

    from ptops.ops.obs.alerts import ALERTS, runbook_url

    expr_ds = DataSourceRef(type_val="__expr__", uid="__expr__")
    rules = []
    for a in ALERTS:
        # the Prometheus expr returns series only while the condition holds: `group without ()`
        # turns each into 1 (NaN-safe), B reduces to the last value, C fires on > 0; no data means
        # OK, as in Prometheus.
        rule = (
            alerting.Rule(a.name)
            .uid(f"ptops-{a.name}"[:40])
            .rule_group(RULE_GROUP)
            .folder_uid(folder_uid)
            .org_id(1)
            .condition("C")
            .for_val(a.for_)
            .no_data_state("OK")
            .exec_err_state("Error")
            .labels({"severity": a.severity, **a.labels})
            .annotations(
                {
                    "summary": _grafana_template(a.summary),
                    "description": _grafana_template(a.description),
                    "runbook_url": runbook_url(a.name, runbook_base),
                }
            )
            .with_query(
                alerting.Query("A")
                .datasource_uid(datasource_uid)
                .relative_time_range(RelativeTimeRange(from_val=600, to=0))
                .model(
                    prometheus.Dataquery()
                    .expr(f"group without () ({a.expr})")
                    .instant()
                    .ref_id("A")
                    .datasource(DataSourceRef(type_val="prometheus", uid=datasource_uid))
                )
            )
            .with_query(
                alerting.Query("B")
                .datasource_uid("__expr__")
                .relative_time_range(RelativeTimeRange(from_val=600, to=0))
                .model(
                    expr.TypeReduce()
                    .expression("A")
                    .reducer("last")
                    .ref_id("B")
                    .datasource(expr_ds)
                )
            )
            .with_query(
                alerting.Query("C")
                .datasource_uid("__expr__")
                .relative_time_range(RelativeTimeRange(from_val=600, to=0))
                .model(
                    expr.TypeThreshold()
                    .expression("B")
                    .ref_id("C")
                    .datasource(expr_ds)
                    .conditions(
                        [
                            expr.ExprTypeThresholdConditions().evaluator(
                                expr.ExprTypeThresholdConditionsEvaluator().type("gt").params([0])
                            )
                        ]
                    )
                )
            )
        )
        if (
            "$value" in a.summary + a.description
        ):  # R/V: the raw value for the annotations ($values.V.Value)
            rule = rule.with_query(
                alerting.Query("R")
                .datasource_uid(datasource_uid)
                .relative_time_range(RelativeTimeRange(from_val=600, to=0))
                .model(
                    prometheus.Dataquery()
                    .expr(a.expr)
                    .instant()
                    .ref_id("R")
                    .datasource(DataSourceRef(type_val="prometheus", uid=datasource_uid))
                )
            ).with_query(
                alerting.Query("V")
                .datasource_uid("__expr__")
                .relative_time_range(RelativeTimeRange(from_val=600, to=0))
                .model(
                    expr.TypeReduce()
                    .expression("R")
                    .reducer("last")
                    .ref_id("V")
                    .datasource(expr_ds)
                )
            )
        rules.append(rule)
    return rules


def _grafana_template(text: str) -> str:
    """Prometheus ``{{ $value }}`` -> Grafana ``{{ $values.V.Value }}`` (the V query holds the raw
    value)."""
    return text.replace("{{ $value }}", "{{ $values.V.Value }}").replace(
        "{{ $value |", "{{ $values.V.Value |"
    )


def alert_rule_group(
    datasource_uid: str = DATASOURCE_UID,
    folder_uid: str = FOLDER_UID,
    runbook_base: str | None = None,
) -> dict:
    """The rule group as the Grafana provisioning API takes it (PUT
    .../folder/{uid}/rule-groups/{group})."""
    from grafana_foundation_sdk.builders import alerting

    group = (
        alerting.RuleGroup(RULE_GROUP)
        .folder_uid(folder_uid)
        .interval(RULE_GROUP_INTERVAL_S)
        .rules(_grafana_rules(datasource_uid, folder_uid, runbook_base))
    )
    return _encode(group.build())


def _file_rule(rule: dict) -> dict:
    """API rule -> file-provisioning rule (``relativeTimeRange``/``model`` per query, no
    folder/group keys)."""
    out = {
        k: v
        for k, v in rule.items()
        if k not in ("folderUID", "ruleGroup", "orgID", "id", "provenance", "updated")
    }
    return out


def provisioning_files(
    prometheus_url: str = "http://127.0.0.1:9090", runbook_base: str | None = None
) -> dict[str, str]:
    """Relative path -> text of a Grafana provisioning folder (``paths.provisioning``)."""
    import yaml

    group = alert_rule_group(DATASOURCE_UID, FOLDER_UID, runbook_base)
    datasource = {
        "apiVersion": 1,
        "datasources": [
            {
                "name": "ptops Prometheus",
                "uid": DATASOURCE_UID,
                "type": "prometheus",
                "access": "proxy",
                "url": prometheus_url,
                "isDefault": False,
                "editable": True,
                "jsonData": {"timeInterval": "15s"},
            }
        ],
    }
    provider = {
        "apiVersion": 1,
        "providers": [
            {
                "name": "ptops",
                "orgId": 1,
                "folder": FOLDER_TITLE,
                "folderUid": FOLDER_UID,
                "type": "file",
                "disableDeletion": False,
                "allowUiUpdates": True,
                "updateIntervalSeconds": 60,
                "options": {
                    "path": "/etc/grafana/provisioning/dashboards/ptops",
                    "foldersFromFilesStructure": False,
                },
            }
        ],
    }
    rules = {
        "apiVersion": 1,
        "groups": [
            {
                "orgId": 1,
                "name": RULE_GROUP,
                "folder": FOLDER_TITLE,
                "interval": f"{RULE_GROUP_INTERVAL_S}s",
                "rules": [_file_rule(r) for r in group["rules"]],
            }
        ],
    }
    header = (
        "# generated by `ptops dashboard --provisioning DIR` (ptops.ops.obs.dashboard); do "
        "not edit by hand\n"
    )
    dump = lambda d: header + yaml.safe_dump(d, sort_keys=False, width=120)  # noqa: E731
    return {
        "datasources/ptops.yml": dump(datasource),
        "dashboards/ptops.yml": dump(provider),
        "dashboards/ptops/ptops-dashboard.json": dashboard_json(),
        "alerting/ptops-rules.yml": dump(rules),
    }


def write_provisioning(target: str | Path, **kwargs: Any) -> list[Path]:
    target = Path(target)
    written = []
    for rel, text in provisioning_files(**kwargs).items():
        p = target / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
        written.append(p)
    return written


# ---------------------------------------------------------------------- push


def push(
    url: str,
    token: str | None = None,
    *,
    datasource_uid: str = DATASOURCE_UID,
    folder_uid: str = FOLDER_UID,
    runbook_base: str | None = None,
    timeout: float = 10.0,
) -> dict:
    """Provision the folder, the dashboard and the alert rule group on a Grafana through
    grafana-client.

    ``datasource_uid`` names the Prometheus datasource the alert rules query (it must
    exist on that Grafana; the dashboard picks its datasource through a variable).
    Idempotent: an existing folder is reused, dashboard and rule group are overwritten.
    """
    from grafana_client import GrafanaApi
    from grafana_client.client import GrafanaClientError

    api = GrafanaApi.from_url(url, credential=token, timeout=timeout)
    try:
        folder = api.folder.get_folder(folder_uid)
    except GrafanaClientError as e:
        if getattr(e, "status_code", None) != 404:
            raise
        folder = api.folder.create_folder(FOLDER_TITLE, uid=folder_uid)
    dash = api.dashboard.update_dashboard(
        {
            "dashboard": dashboard_dict(),
            "folderUid": folder_uid,
            "overwrite": True,
            "message": "provisioned by ptops grafana push",
        }
    )
    group = alert_rule_group(datasource_uid, folder_uid, runbook_base)
    rules = api.alertingprovisioning.update_rule_group(
        folder_uid, RULE_GROUP, group, disable_provenance=True
    )
    return {
        "folder": folder.get("uid", folder_uid) if isinstance(folder, dict) else folder_uid,
        "dashboard": (dash or {}).get("uid", DASHBOARD_UID)
        if isinstance(dash, dict)
        else DASHBOARD_UID,
        "rules": len(group["rules"]),
        "rule_group_response": bool(rules is not None),
    }
