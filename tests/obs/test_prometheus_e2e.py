"""Real servers: Prometheus 2.42 scrapes exporters that follow run directories, every dashboard
query returns data from it, and a hang written to a run directory reaches a webhook through
Prometheus (the shipped rules) and Alertmanager 0.25.

The run directories are written live from the recorded runs in tests/data (real titan-tiny
and trl-grpo-tiny metrics; the titan run's incidents were added by hand, see
tests/data/README-obs.md), with timestamps moved to now. The hang is a `hang` event appended
to the run directory, as the supervisor writes it (not a real supervised hang: the supervisor
was not in the tree when this was written).
"""

from __future__ import annotations

import json
import shutil
import threading
import time
from pathlib import Path

import pytest
from conftest import TESTS
from promstack import PromStack, wait_for

from ptops.ops.obs import PrometheusExporter, dashboard, follow

DATA = TESTS / "data"


def write_live(src: Path, dst: Path, skip_kinds=("completed",), pace_s: float = 0.05) -> None:
    """Append a recorded run's records to dst in time order, with timestamps moved to now."""
    events = [json.loads(x) for x in (src / "events.jsonl").read_text().splitlines()]
    metrics = [json.loads(x) for x in (src / "metrics.jsonl").read_text().splitlines()]
    recs = sorted(
        [(e["ts"], 0, e) for e in events] + [(m["ts"], 1, m) for m in metrics],
        key=lambda t: (t[0], t[1]),
    )
    for _, is_metric, rec in recs:
        if not is_metric and rec["kind"] in skip_kinds:
            continue
        rec = dict(rec, ts=time.time())
        with open(dst / ("metrics.jsonl" if is_metric else "events.jsonl"), "a") as f:
            f.write(json.dumps(rec) + "\n")
        time.sleep(pace_s)


@pytest.fixture(scope="module")
def stack(tmp_path_factory, have):
    tmp = tmp_path_factory.mktemp("obs-e2e")
    closers = []
    servers = None
    try:
        # run directories followed by exporters (titan + grpo), served on loopback
        runs, exporters, ports = {}, {}, {}
        for name in ("obs-titan", "obs-grpo"):
            rd = tmp / "runs" / f"{name}-live"
            rd.mkdir(parents=True)
            shutil.copy(DATA / name / "recipe.json", rd / "recipe.json")
            runs[name] = rd
            exporters[name] = PrometheusExporter.for_run_dir(rd)
            ports[name] = exporters[name].serve(0)
            f = follow(rd, exporters[name], poll_s=0.1)
            closers.append(f.stop)
            closers.append(exporters[name].close)
        # prometheus (shipped rules) -> alertmanager -> webhook receiver
        servers = PromStack(tmp, [f"127.0.0.1:{p}" for p in ports.values()], have)
        query = servers.query
        # both exporters scraped once before the runs start writing: counters start at 0 in
        # Prometheus
        wait_for(
            lambda: len([r for r in query("ptops_up") if r["value"][1] == "1"]) == 2,
            30,
            "first scrapes",
        )
        t0 = time.monotonic()
        writers = [threading.Thread(target=write_live, args=(DATA / n, runs[n])) for n in runs]
        for w in writers:
            w.start()
        for w in writers:
            w.join()
        # everything written is in Prometheus: last titan step and the redo's rates
        wait_for(
            lambda: any(r["value"][1] == "8" for r in query('ptops_step{run="obs-titan-live"}')),
            30,
            "titan step 8 scraped",
        )
        wait_for(lambda: query('ptops_rl_entropy{run="obs-grpo-live"}'), 30, "grpo entropy scraped")
        # rate()-based panels need two scrapes of a series: the ~1.5 s of writing may hold one
        # scrape of it or several. Wait until every panel answers (the test below asserts it and
        # names the empty ones), rather than query at the first scrape that saw the last record.
        try:
            wait_for(
                lambda: (
                    not [
                        e
                        for p, e in dashboard.panel_exprs(substitute=True)
                        if p.needs != "gpu" and not query(e)
                    ]
                ),
                30,
                "every dashboard query answered",
                step=0.5,
            )
        except AssertionError:
            pass
        yield {
            "prom": servers.url,
            "query": query,
            "runs": runs,
            "tmp": tmp,
            "hook": servers.hook,
            "feed_s": time.monotonic() - t0,
        }
    finally:
        if servers is not None:
            servers.close()
        for c in closers:
            try:
                c()
            except Exception:
                pass


def test_every_dashboard_query_returns_data(stack):
    query = stack["query"]
    empty, gpu_series = [], []
    for panel, expr in dashboard.panel_exprs(substitute=True):
        result = query(expr)
        if panel.needs == "gpu":
            gpu_series += result  # no NVML on this machine: the GPU row must be empty, not an error
            continue
        if not result:
            empty.append(f"{panel.row} / {panel.title}: {expr}")
    assert not empty, "dashboard queries without data:\n" + "\n".join(empty)
    assert not gpu_series
    assert not query('{__name__=~"ptops_gpu_.*"}')
    # the numbers are the run's: attempt 2 after the restart, goodput in (0, 1]
    assert query('ptops_attempt{run="obs-titan-live"}')[0]["value"][1] == "2"
    goodput = float(query('ptops_goodput_ratio{run="obs-titan-live"}')[0]["value"][1])
    assert 0 < goodput <= 1


def test_hang_reaches_the_webhook_through_alertmanager(stack):
    rd = stack["runs"]["obs-titan"]
    t_hang = time.time()
    with open(rd / "events.jsonl", "a") as f:
        f.write(
            json.dumps(
                {
                    "ts": t_hang,
                    "kind": "hang",
                    "attempt": 2,
                    "ranks": [1],
                    "step": 9,
                    "silent_s": 30.0,
                }
            )
            + "\n"
        )

    hook = stack["hook"]

    def got_hang():
        return next(iter(hook.alerts("TrainingHang")), None)

    ts, alert = wait_for(got_hang, 60, "TrainingHang at the webhook", step=0.5)
    assert alert["labels"]["run"] == "obs-titan-live"
    assert alert["labels"]["recipe"] == "titan-tiny"
    assert alert["labels"]["severity"] == "critical"
    assert alert["annotations"]["runbook_url"].endswith("/TrainingHang.md")
    latency = ts - t_hang
    print(f"\nhang event -> webhook: {latency:.1f}s (rule for: 10s, scrape/eval 1s, group_wait 1s)")
    assert latency < 60
    # nothing from the grpo run (healthy) is paging as a hang
    assert not any(
        a["labels"].get("run") == "obs-grpo-live" and a["labels"]["alertname"] == "TrainingHang"
        for _, a in hook.alerts(status=None)
    )
