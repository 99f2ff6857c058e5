"""Observability against a REAL supervised run: real TorchTitan (titan-tiny, 2 CPU ranks, gloo)
under ``ptops launch --supervise --metrics-port P --mlflow-uri sqlite:///...``, scraped by a real
Prometheus (the shipped rules) that alerts through a real Alertmanager to a local webhook.

One run, shared by every test here (~2 min on 2 cores):

- attempt 1: rank 1 is slowed by 0.4 s before steps 2-9 (``slow`` fault) -> the straggler monitor
  names it; the grad-explosion monitor runs with a low absolute cap (0.3, below every grad norm of
  this model) so a real monitor finding reaches the "Monitor findings" panel; rank 1 hangs before
  step 10 (``hang`` fault) -> the supervisor detects it (5 s floor), writes ``hang``, restarts;
- attempt 2 resumes from the step-8 checkpoint and is *held* before step 10 (``hold`` fault: every
  rank waits outside any collective, pinging; a declared pause, no hang) until the fixture has
  observed TrainingHang at the webhook, the straggler and monitor findings scraped and every
  dashboard query answered; then ``ptops inject RUN_DIR release`` lets it complete.

Nothing here races the run's length: the run lives until what the tests wait for was observed
(a 16-step run is over in seconds, before ``for: 10s`` + scrape + group_wait could fire). The
exporter waits for one scrape after the run's last record before it closes, so Prometheus' last
values are the run's final ones. Afterwards: they agree with the run directory, and the MLflow
store holds one run with the loss of every step.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
from conftest import PTOPS, REPO
from promstack import PromStack, wait_for

from ptops.ops.obs import dashboard

STEPS = 16
INTERVAL = 4
HANG_STEP = 10
FAULTS = [
    f"hang:rank=1,step={HANG_STEP}",
    f"slow:rank=1,step=2,seconds=0.4,steps={HANG_STEP - 2}",
    f"hold:step={HANG_STEP},attempt=2",
]
HANG_FLOOR_S = 5
SETTINGS = {
    "train.steps": STEPS,
    "checkpoint.interval": INTERVAL,
    "supervisor.hang.floor_s": HANG_FLOOR_S,
    "supervisor.hang.ping_stale_s": 4,
    "supervisor.restart.backoff_s": 0.5,
    # a real finding on the real grad-norm stream (norms are ~0.37-0.6)
    "monitors.grad_explosion.abs_max": 0.3,
}
RESTART_FROM = (HANG_STEP - 1) // INTERVAL * INTERVAL  # the last checkpoint before the hang


def _events(run: Path, kind: str | None = None) -> list[dict]:
    out = [json.loads(x) for x in (run / "events.jsonl").read_text().splitlines() if x.strip()]
    return [e for e in out if kind is None or e["kind"] == kind]


def _holds(run: Path) -> list[dict]:
    return (
        [e for e in _events(run, "fault_injected") if e["fault"].startswith("hold:")]
        if run.joinpath("events.jsonl").exists()
        else []
    )


def _metrics(run: Path) -> list[dict]:
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()]


def _value(result: list[dict], **labels) -> float:
    """The one sample of an instant vector whose labels include ``labels``."""
    hits = [r for r in result if all(r["metric"].get(k) == v for k, v in labels.items())]
    assert len(hits) == 1, (labels, result)
    return float(hits[0]["value"][1])


@pytest.fixture(scope="module")
def live(tmp_path_factory, have):
    from promstack import free_port

    tmp = tmp_path_factory.mktemp("obs-live")
    run = tmp / "runs" / "titan-live"
    mlflow_uri = f"sqlite:///{tmp / 'mlflow.db'}"
    port = free_port()
    servers = PromStack(tmp, [f"127.0.0.1:{port}"], have)
    obs: dict = {"run": run, "mlflow_uri": mlflow_uri, "prom": servers, "port": port}
    args = [
        "launch",
        "titan-tiny",
        "--supervise",
        "--run-dir",
        str(run),
        "--metrics-port",
        str(port),
        "--mlflow",
        "--mlflow-uri",
        mlflow_uri,
        "--json",
    ]
    for f in FAULTS:
        args += ["--fault", f]
    for k, v in SETTINGS.items():
        args += ["--set", f"{k}={v}"]
    stderr = open(tmp / "launch.stderr", "w+")
    t_start = time.time()
    proc = subprocess.Popen(
        [*PTOPS, *args],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=stderr,
        text=True,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
    )

    def alive_or_fail(what: str):
        def check(pred):
            def inner():
                if proc.poll() is not None:
                    stderr.seek(0)
                    raise AssertionError(
                        f"ptops launch exited {proc.returncode} while waiting for {what}:\n"
                        f"{stderr.read()[-4000:]}"
                    )
                return pred()

            return inner

        return check

    try:
        # 1. the supervisor detects the hang and writes it
        hang = wait_for(
            alive_or_fail("the hang event")(
                lambda: (run / "events.jsonl").exists() and _events(run, "hang")
            ),
            240,
            "the hang event",
            step=0.2,
        )[0]
        obs["hang_event"] = hang
        # 2. attempt 2 is held before step HANG_STEP: every rank announced its hold
        obs["held"] = wait_for(
            alive_or_fail("both ranks held in attempt 2")(
                lambda: len(_holds(run)) == 2 and _holds(run)
            ),
            300,
            "both ranks held in attempt 2",
            step=0.2,
        )
        # 3. TrainingHang at the webhook (Prometheus rule -> Alertmanager -> receiver)
        hook = servers.hook
        ts, alert = wait_for(
            alive_or_fail("TrainingHang at the webhook")(
                lambda: next(iter(hook.alerts("TrainingHang")), None)
            ),
            300,
            "TrainingHang at the webhook",
            step=0.2,
        )
        obs["alert"], obs["alert_ts"], obs["alive_at_alert"] = alert, ts, proc.poll() is None
        # 4. while the run is held: the incidents are scraped, then every dashboard query as Grafana
        #    sends it
        query = servers.query
        wait_for(
            alive_or_fail("straggler and monitor findings scraped")(
                lambda: query("ptops_stragglers_total > 0") and query("ptops_anomalies_total > 0")
            ),
            300,
            "straggler and monitor findings scraped",
            step=0.5,
        )
        obs["up_before"] = query(f'ptops_up{{run="{run.name}"}}')

        def panels():
            t_q = time.time()
            return [
                (panel, expr, servers.query_range(expr, t_start - 5, t_q, 1.0))
                for panel, expr in dashboard.panel_exprs(substitute=True)
            ]

        def answered(
            got,
        ):  # every panel that can have data has some (the test names the ones without)
            return all(result for panel, _, result in got if panel.needs not in ("gpu", "rl"))

        obs["panels"] = panels()
        deadline = (
            time.monotonic() + 60
        )  # held: waiting costs nothing, e.g. for a rate()'s second sample
        while not answered(obs["panels"]) and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(1)
            obs["panels"] = panels()
        obs["gpu_any"] = query('{__name__=~"ptops_gpu_.*"}')
        obs["alive_after_panels"] = proc.poll() is None
        obs["up_after"] = query(f'ptops_up{{run="{run.name}"}}')
        # held past three hang budgets (5 s floor) at least: the supervisor must call it a pause,
        # not a hang
        held_since = min(e["ts"] for e in obs["held"])
        while time.time() < held_since + 3 * HANG_FLOOR_S and proc.poll() is None:
            time.sleep(0.5)
        obs["hang_events_while_held"] = len(_events(run, "hang"))
        # 5. release the hold; the run completes
        rel = subprocess.run(
            [*PTOPS, "inject", str(run), "release"],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=60,
        )
        obs["release"] = (rel.returncode, rel.stdout + rel.stderr)
        out, _ = proc.communicate(timeout=240)
        obs["rc"], obs["stdout"] = proc.returncode, out
        stderr.seek(0)
        obs["stderr"] = stderr.read()
        obs["t_end"] = time.time()
        obs["wall_s"] = obs["t_end"] - t_start
        # 6. the exporter's last scraped values (its series went stale when the launch exited)
        last = {}
        for name in (
            "ptops_step",
            "ptops_attempt",
            "ptops_hangs_total",
            "ptops_crashes_total",
            "ptops_step_duration_seconds_count",
            "ptops_productive_seconds",
            "ptops_start_timestamp_seconds",
            "ptops_checkpoint_last_good_step",
            "ptops_checkpoints_total",
        ):
            last[name] = query(f'last_over_time({name}{{run="{run.name}"}}[10m])')
        for name in (
            "ptops_restarts_total",
            "ptops_stragglers_total",
            "ptops_anomalies_total",
            "ptops_straggler_ratio",
        ):
            last[name] = query(f'last_over_time({name}{{run="{run.name}"}}[10m])')
        last["attempt_changes"] = query(f'changes(ptops_attempt{{run="{run.name}"}}[10m])')
        # raw samples, stamped with their scrape's start (a range query's grid would be up to one
        # scrape interval off), and each scrape's duration: the exporter read its clock in between
        last["goodput_raw"] = query(f'ptops_goodput_ratio{{run="{run.name}"}}[30m]')
        last["productive_raw"] = query(f'ptops_productive_seconds{{run="{run.name}"}}[30m]')
        last["scrape_s_raw"] = query(f'scrape_duration_seconds{{instance="127.0.0.1:{port}"}}[30m]')
        obs["last"] = last
        obs["up_end"] = query(f'ptops_up{{run="{run.name}"}}')
        print(
            f"\nlive observability run: {obs['wall_s']:.1f} s; hang event -> webhook "
            f"{obs['alert_ts'] - hang['ts']:.1f} s; fault -> webhook "
            f"{obs['alert_ts'] - _events(run, 'fault_injected')[0]['ts']:.1f} s; held "
            f"{max(e['held_s'] for e in _events(run, 'hold_released')):.1f} s"
        )
        yield obs
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)  # the supervisor stops its ranks and exits 130
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
        stderr.close()
        servers.close()


@pytest.mark.slow
def test_hang_alert_reaches_the_receiver_while_the_run_lives(live):
    alert, hang = live["alert"], live["hang_event"]
    assert live["alive_at_alert"], "the alert arrived only after the run had ended"
    assert hang["attempt"] == 1 and hang["ranks"] == [1]
    assert alert["labels"]["run"] == live["run"].name
    assert alert["labels"]["recipe"] == "titan-tiny"
    assert alert["labels"]["severity"] == "critical"
    assert alert["annotations"]["runbook_url"].endswith("/TrainingHang.md")
    latency = live["alert_ts"] - hang["ts"]
    # for: 10s + scrape 1s + evaluation 1s + resend 1s + group_wait 1s, with slack for 2 busy cores
    assert 10 <= latency < 30, latency


@pytest.mark.slow
def test_every_dashboard_query_has_data_while_the_run_lives(live):
    assert live["alive_after_panels"], "the run ended before the dashboard queries were done"
    assert [r["value"][1] for r in live["up_before"]] == ["1"] and [
        r["value"][1] for r in live["up_after"]
    ] == ["1"]
    empty, unexpected = [], []
    for panel, expr, result in live["panels"]:
        points = [
            v for series in result for _, v in series["values"] if v not in ("NaN", "+Inf", "-Inf")
        ]
        if panel.needs in ("gpu", "rl"):
            # no NVML here; a TorchTitan run logs no entropy/KL/reward: no series at all, never fake
            # zeros
            if result:
                unexpected.append(f"{panel.row} / {panel.title}: {expr} -> {result[:2]}")
            continue
        if not points:
            empty.append(f"{panel.row} / {panel.title}: {expr}")
    assert not empty, "dashboard queries without data from the live run:\n" + "\n".join(empty)
    assert not unexpected, "series that should not exist:\n" + "\n".join(unexpected)
    assert not live["gpu_any"], "ptops_gpu_* series without NVML"


@pytest.mark.slow
def test_the_hold_is_a_declared_pause_released_on_request(live):
    run = live["run"]
    assert live["release"][0] == 0 and "injected release" in live["release"][1], live["release"]
    held = live["held"]
    assert sorted(e["rank"] for e in held) == [0, 1] and {
        (e["attempt"], e["step"]) for e in held
    } == {(2, HANG_STEP)}
    assert live["hang_events_while_held"] == 1, "the hold was taken for a hang"
    released = _events(run, "hold_released")
    assert sorted(e["rank"] for e in released) == [0, 1]
    assert min(e["held_s"] for e in released) > 2 * HANG_FLOOR_S
    assert {(e["attempt"], e["step"], e["by"]) for e in released} == {(2, HANG_STEP, "release")}
    inject = _events(run, "inject")
    assert [(e["fault"], e["attempt"], sorted(e["ranks"])) for e in inject] == [
        ("release:attempt=2", 2, [0, 1])
    ]
    # every rank was held until the fixture had seen the alert, and did the held step after the
    # release
    assert min(e["ts"] for e in released) > live["alert_ts"]
    steps_after = [m for m in _metrics(run) if m["attempt"] == 2 and m["step"] == HANG_STEP]
    assert len(steps_after) == 2 and min(m["ts"] for m in steps_after) > inject[0]["ts"]


@pytest.mark.slow
def test_run_completes_after_one_restart(live):
    assert live["rc"] == 0, live["stderr"][-4000:]
    summary = json.loads(live["stdout"])
    assert summary["state"] == "completed" and summary["step"] == STEPS
    assert (
        summary["attempts"] == 2
        and summary["restarts"] == 1
        and summary["hangs"] == 1
        and summary["crashes"] == 0
    )
    run = live["run"]
    restart = _events(run, "restart")
    assert (
        len(restart) == 1
        and restart[0]["from_step"] == RESTART_FROM
        and restart[0]["reason"].startswith("hang")
    )
    assert any(e["rank"] == 1 for e in _events(run, "straggler"))
    assert {e["monitor"] for e in _events(run, "anomaly")} == {"grad_explosion"}
    assert _events(run, "completed")[0]["step"] == STEPS
    from ptops.ops.supervisor.procs import run_processes

    assert run_processes(run) == []
    assert not live["up_end"], "the exporter still serves after the launch exited"


@pytest.mark.slow
def test_exporter_values_match_the_run_directory(live):
    run, last = live["run"], live["last"]
    rank0 = [m for m in _metrics(run) if m["rank"] == 0]
    final: dict[int, dict] = {}
    for m in rank0:  # the final execution of each step (a redone step replaces the earlier one)
        final[m["step"]] = m
    assert sorted(final) == list(range(1, STEPS + 1))
    assert _value(last["ptops_step"]) == STEPS
    assert _value(last["ptops_attempt"]) == 2
    assert _value(last["attempt_changes"]) == 1, (
        "one restart is one change of ptops_attempt (TrainingCrashLoop)"
    )
    assert _value(last["ptops_hangs_total"]) == 1 and _value(last["ptops_crashes_total"]) == 0
    assert _value(last["ptops_restarts_total"], reason="hang") == 1
    assert _value(last["ptops_stragglers_total"], rank="1") >= 1
    assert _value(last["ptops_straggler_ratio"], rank="1") > 1.2
    assert _value(last["ptops_anomalies_total"], monitor="grad_explosion") >= 1
    # the follower missed no record: every rank-0 step record, redone ones included, is in the
    # histogram
    assert _value(last["ptops_step_duration_seconds_count"]) == len(rank0)
    productive = sum(m["step_s"] for m in final.values())
    assert _value(last["ptops_productive_seconds"]) == pytest.approx(productive, rel=1e-9)
    ckpts = _events(run, "checkpoint")
    assert _value(last["ptops_checkpoint_last_good_step"]) == ckpts[-1]["step"] == STEPS
    assert _value(last["ptops_checkpoints_total"]) == len(ckpts)
    start = _value(last["ptops_start_timestamp_seconds"])
    assert start == pytest.approx(_events(run, "launch")[0]["ts"], abs=1e-3)
    # goodput at every scrape = productive time so far / wall time since the first launch, "now"
    # being the exporter's clock during the scrape: between the scrape's start (ts, ms) and its end
    prod = {ts: float(v) for ts, v in last["productive_raw"][0]["values"]}
    took = {ts: float(v) for ts, v in last["scrape_s_raw"][0]["values"]}
    end = _events(run, "completed")[0]["ts"]
    checked = 0
    for ts, v in last["goodput_raw"][0]["values"]:
        if ts not in prod:
            continue  # before the first step record: no productive time yet
        # wall time stops at completed, once the exporter has read it: a scrape in the few ms
        # between the event's stamp and the follower reading it still counts to its own clock
        lo_now, hi_now = min(ts - 0.001, end), ts + took[ts] + 0.001
        assert (
            prod[ts] / (hi_now - start) - 1e-9 <= float(v) <= prod[ts] / (lo_now - start) + 1e-9
        ), (ts, v, took[ts])
        checked += 1
    assert checked >= 10
    assert 0 < float(last["goodput_raw"][0]["values"][-1][1]) < 1


@pytest.mark.slow
def test_mlflow_holds_one_run_with_every_step(live):
    from mlflow.tracking import MlflowClient

    run = live["run"]
    client = MlflowClient(tracking_uri=live["mlflow_uri"])
    exp = client.get_experiment_by_name("titan-tiny")
    assert exp is not None
    found = client.search_runs([e.experiment_id for e in client.search_experiments()])
    assert len(found) == 1, [(r.info.run_name, r.info.run_id) for r in found]
    r = found[0]
    assert r.info.run_id == json.loads((run / "mlflow.json").read_text())["run_id"]
    assert r.info.status == "FINISHED" and r.info.run_name == run.name
    # loss of every step 1..N; a redone step appears once per execution, the last value is the final
    # one
    rank0 = [m for m in _metrics(run) if m["rank"] == 0]
    history = client.get_metric_history(r.info.run_id, "loss")
    assert sorted({h.step for h in history}) == list(range(1, STEPS + 1))
    assert len(history) == len(rank0)
    final = {m["step"]: m["loss"] for m in rank0}
    for step, loss in final.items():
        assert loss in {h.value for h in history if h.step == step}
    assert {h.step for h in client.get_metric_history(r.info.run_id, "grad_norm")} == set(final)
    # params: the recipe, including the overrides
    p = r.data.params
    assert p["name"] == "titan-tiny" and p["engine"] == "titan"
    assert p["train.steps"] == str(STEPS) and p["checkpoint.interval"] == str(INTERVAL)
    assert p["supervisor.hang.floor_s"] in ("5", "5.0")
    # tags: the events of both attempts
    t = r.data.tags
    assert t["ptops.state"] == "completed" and t["ptops.attempt"] == "2"
    assert t["ptops.events.launch.count"] == "2" and t["ptops.events.restart.count"] == "1"
    assert t["ptops.events.hang.count"] == "1"
    assert json.loads(t["ptops.events.hang.last"])["ranks"] == [1]
    assert int(t["ptops.events.straggler.count"]) >= 1
    # artifacts: the incident summary (with the hang and the restart) and the checkpoint manifests
    arts = {a.path for a in client.list_artifacts(r.info.run_id, "ptops")}
    assert {"ptops/incident_summary.json", "ptops/incident_summary.md"} <= arts
    local = client.download_artifacts(
        r.info.run_id, "ptops/incident_summary.json", str(live["run"].parent)
    )
    summary = json.loads(Path(local).read_text())
    assert summary["state"] == "completed" and summary["attempts"] == 2
    kinds = [e["kind"] for e in summary["incidents"]]
    assert "hang" in kinds and "restart" in kinds and "fault_injected" in kinds
    assert summary["last_good_checkpoint"]["step"] == STEPS


def test_attempt_is_absent_before_the_first_launch(tmp_path):
    """No ``ptops_attempt 0`` sample before the launch event: Prometheus would count 0 -> 1 as a
    change and TrainingCrashLoop (``changes(ptops_attempt[30m]) >= 3``) would page after two
    restarts instead of three."""
    from ptops.ops.obs import PrometheusExporter

    ex = PrometheusExporter("r", "t", nvml=False)
    assert "ptops_attempt{" not in ex.text()
    ex.observe_event({"ts": time.time(), "kind": "launch", "attempt": 1})
    assert 'ptops_attempt{recipe="t",run="r"} 1.0' in ex.text()
