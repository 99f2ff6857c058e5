"""The Prometheus exporter, fed from a recorded run directory (real titan-tiny metrics; see
tests/data/README-obs.md), its follow/replay helpers, and the NVML collector."""

from __future__ import annotations

import json
import math
import shutil
import time
import types
import urllib.request
from pathlib import Path

import pytest
from conftest import TESTS
from prometheus_client import REGISTRY
from prometheus_client.parser import text_string_to_metric_families

from ptops.ops.obs import PrometheusExporter, follow, replay
from ptops.ops.obs.nvml import NvmlCollector

DATA = TESTS / "data"


def samples(exporter: PrometheusExporter) -> dict[tuple, float]:
    out = {}
    for fam in text_string_to_metric_families(exporter.text()):
        for s in fam.samples:
            out[
                (
                    s.name,
                    tuple(
                        sorted((k, v) for k, v in s.labels.items() if k not in ("run", "recipe"))
                    ),
                )
            ] = s.value
    return out


def read(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture
def titan():
    events = read(DATA / "obs-titan" / "events.jsonl")
    metrics = read(DATA / "obs-titan" / "metrics.jsonl")
    end = events[-1]["ts"]
    e = PrometheusExporter.for_run_dir(DATA / "obs-titan", clock=lambda: end + 10.0)
    assert replay(DATA / "obs-titan", e) == len(events) + len(metrics)
    return e, events, metrics


def test_replay_of_a_restarted_run(titan):
    e, events, metrics = titan
    s = samples(e)
    assert s[("ptops_up", ())] == 1
    assert s[("ptops_attempt", ())] == 2
    assert s[("ptops_step", ())] == 8
    last0 = [m for m in metrics if m["rank"] == 0][-1]
    assert s[("ptops_loss", ())] == pytest.approx(last0["loss"])
    assert s[("ptops_grad_norm", ())] == pytest.approx(last0["grad_norm"])
    # tokens/s: the latest value of each rank of the current attempt, summed
    want_tps = sum([m for m in metrics if m["rank"] == r][-1]["tokens_per_s"] for r in (0, 1))
    assert s[("ptops_tokens_per_second", ())] == pytest.approx(want_tps)
    assert s[("ptops_restarts_total", (("reason", "crash"),))] == 1
    assert s[("ptops_crashes_total", ())] == 1
    assert s[("ptops_hangs_total", ())] == 0
    assert s[("ptops_stragglers_total", (("rank", "1"),))] == 1
    assert s[("ptops_anomalies_total", (("monitor", "loss_spike"),))] == 1
    assert s[("ptops_anomalies_total", (("monitor", "nan"),))] == 0  # pre-initialised
    assert s[("ptops_checkpoint_last_good_step", ())] == 8
    assert s[("ptops_checkpoint_blocking_seconds", ())] == pytest.approx(0.19)
    assert s[("ptops_checkpoint_total_seconds", ())] == pytest.approx(0.88)
    ck_ts = [ev for ev in events if ev["kind"] == "checkpoint"][-1]["ts"]
    assert s[("ptops_checkpoint_age_seconds", ())] == pytest.approx(events[-1]["ts"] + 10.0 - ck_ts)
    assert s[("ptops_run_state", (("state", "completed"),))] == 1
    assert s[("ptops_run_state", (("state", "running"),))] == 0
    assert (
        s[("ptops_step_duration_seconds_count", ())] == 9
    )  # rank 0: steps 1-6 of attempt 1, 6-8 redone in attempt 2
    assert s[("ptops_last_event_timestamp_seconds", (("kind", "restart"),))] == pytest.approx(
        [ev for ev in events if ev["kind"] == "restart"][0]["ts"]
    )
    # the straggler finding is within the 300 s TTL at this clock (10 s after the end): still listed
    assert s[("ptops_straggler_ratio", (("rank", "1"),))] == pytest.approx(1.8)


def test_goodput_counts_each_step_once(titan):
    e, events, metrics = titan
    final = {}
    for m in metrics:
        if m["rank"] == 0:
            final[m["step"]] = m["step_s"]  # a redone step replaces the first execution
    wall = events[-1]["ts"] - events[0]["ts"]  # completed: wall time stops at the end
    assert e.goodput() == pytest.approx(sum(final.values()) / wall)
    assert samples(e)[("ptops_goodput_ratio", ())] == pytest.approx(sum(final.values()) / wall)
    assert samples(e)[("ptops_productive_seconds", ())] == pytest.approx(sum(final.values()))
    lost = {
        labels[0][1]: v
        for (name, labels), v in samples(e).items()
        if name == "ptops_goodput_lost_seconds"
    }
    assert set(lost) == {
        "startup",
        "detection",
        "restart",
        "recomputed",
        "checkpoint_blocking",
        "shutdown",
        "other",
    }
    assert lost["recomputed"] > 0 and lost["restart"] > 0  # this trace has a crash and redone steps
    assert sum(final.values()) + sum(lost.values()) == pytest.approx(wall)


def test_straggler_ratio_expires():
    now = [1000.0]
    e = PrometheusExporter("r", "t", clock=lambda: now[0], straggler_ttl_s=60, nvml=False)
    e.observe_event({"ts": 1000.0, "kind": "straggler", "rank": 3, "ratio": 2.0})
    assert samples(e)[("ptops_straggler_ratio", (("rank", "3"),))] == 2.0
    now[0] = 1100.0
    assert ("ptops_straggler_ratio", (("rank", "3"),)) not in samples(e)
    assert samples(e)[("ptops_stragglers_total", (("rank", "3"),))] == 1


def test_nonfinite_hang_and_states():
    e = PrometheusExporter("r", "t", nvml=False)
    s = samples(e)
    assert s[("ptops_run_state", (("state", "starting"),))] == 1
    assert ("ptops_loss", ()) not in s  # no fake zero before the first step
    e.observe_event({"ts": 10.0, "kind": "launch", "attempt": 1})
    e.observe_metric(
        {
            "step": 1,
            "rank": 0,
            "attempt": 1,
            "loss": "nan",
            "grad_norm": "inf",
            "step_s": 0.1,
            "ts": 11.0,
        }
    )
    e.observe_metric(
        {
            "step": 1,
            "rank": 1,
            "attempt": 1,
            "loss": "nan",
            "grad_norm": 1.0,
            "step_s": 0.1,
            "ts": 11.0,
        }
    )
    s = samples(e)
    assert math.isnan(s[("ptops_loss", ())])
    assert s[("ptops_grad_norm", ())] == math.inf
    assert (
        s[("ptops_nonfinite_total", (("metric", "loss"),))] == 1
    )  # two ranks, one step: counted once
    assert s[("ptops_nonfinite_total", (("metric", "grad_norm"),))] == 1
    assert s[("ptops_last_nonfinite_timestamp_seconds", ())] == 11.0
    e.observe_event(
        {"ts": 20.0, "kind": "hang", "attempt": 1, "ranks": [1], "step": 2, "silent_s": 9.0}
    )
    s = samples(e)
    assert s[("ptops_run_state", (("state", "hung"),))] == 1 and s[("ptops_hangs_total", ())] == 1
    e.observe_event({"ts": 21.0, "kind": "restart", "attempt": 2, "from_step": 0, "reason": "hang"})
    assert samples(e)[("ptops_run_state", (("state", "restarting"),))] == 1
    e.observe_event({"ts": 22.0, "kind": "launch", "attempt": 2})
    e.observe_event({"ts": 23.0, "kind": "checkpoint_invalid", "path": "x", "reason": "truncated"})
    e.observe_event({"ts": 24.0, "kind": "checkpoint_failed", "step": 5, "reason": "ENOSPC"})
    e.observe_event({"ts": 25.0, "kind": "failed", "reason": "gave up"})
    s = samples(e)
    assert s[("ptops_run_state", (("state", "failed"),))] == 1
    assert s[("ptops_attempt", ())] == 2
    assert s[("ptops_checkpoint_invalid_total", ())] == 1
    assert s[("ptops_checkpoint_save_failures_total", ())] == 1


def test_label_cardinality_is_bounded():
    e = PrometheusExporter("r", "t", max_ranks=4, nvml=False)
    for rank in range(100):
        e.observe_metric({"step": 1, "rank": rank, "step_s": 0.1, "tokens_per_s": 1.0})
        e.observe_event({"kind": "straggler", "rank": rank, "ratio": 1.5})
    assert (
        samples(e)[("ptops_tokens_per_second", ())] == 100.0
    )  # every rank counts, even past the label cap
    for i in range(200):
        e.observe_event({"kind": "restart", "attempt": 2, "reason": f"reason{i} with details {i}"})
        e.observe_event({"kind": "anomaly", "monitor": f"m{i}"})
        e.observe_event({"kind": f"kind{i}"})
    s = samples(e)
    ranks = {dict(k[1]).get("rank") for k in s if k[0] == "ptops_rank_step_duration_seconds"}
    assert ranks == {"0", "1", "2", "3"}
    assert {dict(k[1])["rank"] for k in s if k[0] == "ptops_stragglers_total"} == {
        "0",
        "1",
        "2",
        "3",
        "other",
    }
    assert len([k for k in s if k[0] == "ptops_restarts_total"]) <= 33
    assert len([k for k in s if k[0] == "ptops_anomalies_total"]) <= 33
    assert len([k for k in s if k[0] == "ptops_events_total"]) <= 33


def test_own_registry_and_loopback_server():
    e = PrometheusExporter("r", "t", nvml=False)
    assert e.registry is not REGISTRY
    assert not any(n.startswith("ptops_") for n in REGISTRY._names_to_collectors)
    port = e.serve(0)
    try:
        assert e._server.server_address[0] == "127.0.0.1"
        body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
        assert 'ptops_up{recipe="t",run="r"} 1.0' in body
    finally:
        e.close()


def test_follow_tails_and_waits_for_torn_lines(tmp_path):
    run = tmp_path / "demo-run"
    run.mkdir()
    shutil.copy(DATA / "obs-titan" / "recipe.json", run / "recipe.json")
    e = PrometheusExporter.for_run_dir(run, nvml=False)
    assert e.recipe == "titan-tiny" and e.run == "demo-run"
    f = follow(run, e, poll_s=0.05)
    try:
        with open(run / "events.jsonl", "a") as fh:
            fh.write(json.dumps({"ts": time.time(), "kind": "launch", "attempt": 1}) + "\n")
        with open(run / "metrics.jsonl", "a") as fh:
            fh.write(
                json.dumps({"step": 1, "rank": 0, "attempt": 1, "loss": 5.0, "ts": time.time()})
                + "\n"
            )
            fh.write('{"step": 2, "rank": 0, "loss": 4.')  # a writer mid-line
            fh.flush()
            deadline = time.time() + 5
            while samples(e).get(("ptops_step", ())) != 1 and time.time() < deadline:
                time.sleep(0.05)
            assert samples(e)[("ptops_step", ())] == 1
            time.sleep(0.2)
            assert samples(e)[("ptops_step", ())] == 1  # the torn line is not read yet
            fh.write('0, "attempt": 1}\n')
        deadline = time.time() + 5
        while samples(e).get(("ptops_step", ())) != 2 and time.time() < deadline:
            time.sleep(0.05)
        assert samples(e)[("ptops_loss", ())] == 4.0
    finally:
        f.stop()


def test_broken_sink_does_not_stop_the_others(tmp_path):
    class Broken:
        def observe_event(self, ev):
            raise RuntimeError("boom")

        def observe_metric(self, rec):
            raise RuntimeError("boom")

    e = PrometheusExporter("r", "t", nvml=False)
    assert replay(DATA / "obs-titan", Broken(), e) > 0
    assert samples(e)[("ptops_step", ())] == 8


# ---------------------------------------------------------------------- NVML


def test_nvml_absent_means_no_gpu_series_and_no_error(caplog):
    import pynvml

    try:
        pynvml.nvmlInit()
        pynvml.nvmlShutdown()
        pytest.skip("this machine has NVML (a GPU driver): the absent case cannot be shown here")
    except pynvml.NVMLError:
        pass
    caplog.set_level("DEBUG", logger="ptops.exporters.nvml")
    e = PrometheusExporter("r", "t")  # nvml=True by default
    replay(DATA / "obs-titan", e)
    text = e.text()
    assert "ptops_gpu_" not in text and "ptops_step" in text
    assert e.nvml is not None and not e.nvml.available
    msgs = [r for r in caplog.records if r.name == "ptops.exporters.nvml"]
    assert len(msgs) == 1 and msgs[0].levelname == "DEBUG"
    e.close()


class FakeNvml(types.SimpleNamespace):
    """Just enough of pynvml for the collector (the real one needs a GPU driver)."""

    class NVMLError(Exception):
        pass

    NVML_TEMPERATURE_GPU = 0
    NVML_CLOCK_SM = 1
    NVML_MEMORY_ERROR_TYPE_CORRECTED = 0
    NVML_MEMORY_ERROR_TYPE_UNCORRECTED = 1
    NVML_VOLATILE_ECC = 0
    nvmlEventTypeXidCriticalError = 8

    def __init__(self):
        super().__init__()
        self.events = [types.SimpleNamespace(device="h1", eventData=79)]

    def nvmlInit(self):
        pass

    def nvmlShutdown(self):
        pass

    def nvmlDeviceGetCount(self):
        return 2

    def nvmlDeviceGetHandleByIndex(self, i):
        return f"h{i}"

    def nvmlEventSetCreate(self):
        return "es"

    def nvmlEventSetFree(self, es):
        pass

    def nvmlDeviceRegisterEvents(self, h, t, es):
        pass

    def nvmlEventSetWait_v2(self, es, timeout):
        if self.events:
            return self.events.pop()
        raise self.NVMLError("timeout")

    def nvmlDeviceGetUtilizationRates(self, h):
        return types.SimpleNamespace(gpu=87, memory=40)

    def nvmlDeviceGetMemoryInfo(self, h):
        return types.SimpleNamespace(used=40 * 2**30, total=141 * 2**30)

    def nvmlDeviceGetTemperature(self, h, s):
        return 71

    def nvmlDeviceGetPowerUsage(self, h):
        return 650000

    def nvmlDeviceGetClockInfo(self, h, c):
        raise self.NVMLError("not supported")  # a field the GPU lacks is skipped

    def nvmlDeviceGetCurrentClocksEventReasons(self, h):
        return 0x8 if h == "h1" else 0x1

    def nvmlDeviceGetTotalEccErrors(self, h, t, c):
        return 3 if (h == "h1" and t == 1) else 0


def test_nvml_present_path_with_a_fake_library():
    c = NvmlCollector({"run": "r", "recipe": "t", "host": "n1"}, pynvml_module=FakeNvml())
    assert c.available
    fams = {f.name: f for f in c.collect()}
    util = {s.labels["gpu"]: s.value for s in fams["ptops_gpu_utilization_ratio"].samples}
    assert util == {"0": 0.87, "1": 0.87}
    assert "ptops_gpu_sm_clock_hertz" not in fams
    assert {s.labels["gpu"]: s.value for s in fams["ptops_gpu_power_watts"].samples}["0"] == 650.0
    ecc = {
        (s.labels["gpu"], s.labels["type"]): s.value for s in fams["ptops_gpu_ecc_errors"].samples
    }
    assert ecc[("1", "uncorrected")] == 3 and ecc[("0", "uncorrected")] == 0
    xid = {s.labels["gpu"]: s.value for s in fams["ptops_gpu_xid_errors"].samples}
    assert xid == {"0": 0, "1": 1}
    assert [s.value for s in fams["ptops_gpu_last_xid"].samples] == [79]
    thr = {
        (s.labels["gpu"], s.labels["reason"]): s.value for s in fams["ptops_gpu_throttle"].samples
    }
    assert thr[("1", "hw_slowdown")] == 1 and thr[("0", "hw_slowdown")] == 0
    c.close()


def test_finding_episodes_open_and_close_and_the_all_clear_is_no_finding():
    e = PrometheusExporter("r", "t", clock=lambda: 100.0, nvml=False)
    e.observe_event({"ts": 1, "kind": "launch", "attempt": 1})
    e.observe_event(
        {
            "ts": 10,
            "kind": "anomaly",
            "monitor": "entropy_collapse",
            "step": 5,
            "value": 30,
            "detail": "w",
            "severity": "warning",
            "episode": 1,
            "phase": "open",
        }
    )
    s = samples(e)
    key = ("ptops_finding_episode_open", (("monitor", "entropy_collapse"),))
    assert s[key] == 1 and s[("ptops_anomalies_total", (("monitor", "entropy_collapse"),))] == 1
    e.observe_event(
        {
            "ts": 50,
            "kind": "anomaly",
            "monitor": "entropy_collapse",
            "step": 40,
            "value": 0.9,
            "detail": "all clear",
            "severity": "info",
            "episode": 1,
            "phase": "resolved",
        }
    )
    s = samples(e)
    assert s[key] == 0
    assert (
        s[("ptops_anomalies_total", (("monitor", "entropy_collapse"),))] == 1
    )  # the all-clear is not a finding
    assert (
        s[("ptops_anomaly_last_timestamp_seconds", (("monitor", "entropy_collapse"),))] == 10
    )  # nor re-fires alerts
    e.observe_event(
        {
            "ts": 60,
            "kind": "anomaly",
            "monitor": "entropy_collapse",
            "step": 50,
            "value": 30,
            "detail": "w",
            "severity": "warning",
            "episode": 2,
            "phase": "open",
        }
    )
    assert samples(e)[key] == 1
    e.observe_event(
        {"ts": 70, "kind": "launch", "attempt": 2}
    )  # the monitors start the attempt with no episode open
    assert samples(e)[key] == 0


def _anomaly(ts: float, episode: int, phase: str, rank: int) -> dict:
    return {
        "ts": ts, "kind": "anomaly", "monitor": "loss_spike", "step": int(ts), "value": 1.0,
        "detail": "d", "severity": "info" if phase == "resolved" else "warning",
        "episode": episode, "phase": phase, "rank": rank,
    }  # fmt: skip


def test_an_all_clear_closes_its_own_episode_not_the_monitors_other_one():
    """Episodes are the reducer's (keyed by monitor and episode, as ``ptops status`` sees them): a
    monitor with two open episodes stays open until both are all-clear."""
    e = PrometheusExporter("r", "t", clock=lambda: 100.0, nvml=False)
    key = ("ptops_finding_episode_open", (("monitor", "loss_spike"),))
    e.observe_event({"ts": 1, "kind": "launch", "attempt": 1})
    e.observe_event(_anomaly(10, 1, "open", 0))
    e.observe_event(_anomaly(11, 2, "open", 1))
    e.observe_event(_anomaly(20, 1, "resolved", 0))
    assert samples(e)[key] == 1
    e.observe_event(_anomaly(21, 2, "resolved", 1))
    assert samples(e)[key] == 0
    e.observe_event(_anomaly(30, 3, "open", 0))
    e.observe_event({"ts": 40, "kind": "completed", "attempt": 1, "step": 30})
    assert samples(e)[key] == 0  # an ended run has no open episode


def test_the_exporter_says_what_the_reducer_says():
    """One reducer (``ops/runrecord/events.py``): the exporter's event counts, restarts and state
    are its view of the same events."""
    from ptops.ops.runrecord.events import reduce

    events = [
        {"ts": 1, "kind": "launch", "attempt": 1},
        {"ts": 2, "kind": "fault_injected", "fault": "crash:rank=1,step=3", "rank": 1, "step": 3},
        {"ts": 3, "kind": "crash", "attempt": 1, "rank": 1, "exit_code": -9},
        {"ts": 4, "kind": "restart", "attempt": 2, "reason": "crash: rank 1", "from_step": 0},
        {"ts": 5, "kind": "launch", "attempt": 2},
        {"ts": 6, "kind": "checkpoint", "step": 5, "path": "p", "blocking_s": 0.1, "total_s": 1},
        {"ts": 7, "kind": "completed", "attempt": 2, "step": 5},
    ]
    e = PrometheusExporter("r", "t", clock=lambda: 100.0, nvml=False)
    for ev in events:
        e.observe_event(ev)
    s, v = samples(e), reduce(events)
    for kind, n in v.counts.items():
        assert s[("ptops_events_total", (("kind", kind),))] == n
    assert s[("ptops_restarts_total", (("reason", "crash"),))] == v.restarts == 1
    assert s[("ptops_run_state", (("state", v.event_state),))] == 1 and v.event_state == "completed"
    assert s[("ptops_checkpoint_last_good_step", ())] == v.last_checkpoint["step"] == 5
    assert s[("ptops_attempt", ())] == v.attempt == 2
    assert s[("ptops_crashes_total", ())] == 1 and s[("ptops_faults_injected_total", ())] == 1


def test_every_metric_family_is_declared_once_with_help():
    from ptops.ops.obs.prometheus import FAMILIES

    names = [f[0] for f in FAMILIES]
    assert len(names) == len(set(names)), names
    assert all(f[1] in ("gauge", "counter", "histogram") and f[2].strip() for f in FAMILIES)


def test_supervisor_behind_opens_and_closes_with_its_episode():
    """``ptops_supervisor_behind`` (the SupervisorBehind alert's input) is 1 from an
    ``inbox_behind`` event until its ``inbox_caught_up``, a new launch or the run's end; the lag
    is the episode's when it began, 0 otherwise; nothing before a launch."""
    e = PrometheusExporter("r", "t", registry=None, nvml=False, clock=lambda: 100.0)
    behind, lag = ("ptops_supervisor_behind", ()), ("ptops_supervisor_lag_seconds", ())
    assert behind not in samples(e)
    e.observe_event({"ts": 1.0, "kind": "launch", "attempt": 1})
    assert samples(e)[behind] == 0 and samples(e)[lag] == 0
    e.observe_event({"ts": 2.0, "kind": "inbox_behind", "attempt": 1, "lag_s": 1.7, "queued": 9})
    s = samples(e)
    assert s[behind] == 1 and s[lag] == 1.7
    e.observe_event(
        {"ts": 9.0, "kind": "inbox_caught_up", "attempt": 1, "behind_s": 7.0, "max_lag_s": 3.1,
         "max_queued": 40, "why": "drained"}
    )  # fmt: skip
    s = samples(e)
    assert s[behind] == 0 and s[lag] == 0
    e.observe_event({"ts": 10.0, "kind": "inbox_behind", "attempt": 1, "lag_s": "x", "queued": 1})
    s = samples(e)
    assert s[behind] == 1 and lag not in s  # a copied run directory: a lag that is no number
    e.observe_event({"ts": 11.0, "kind": "launch", "attempt": 2})  # a restart while behind
    assert samples(e)[behind] == 0 and samples(e)[lag] == 0
    e.observe_event({"ts": 12.0, "kind": "inbox_behind", "attempt": 2, "lag_s": 2.0, "queued": 1})
    e.observe_event({"ts": 13.0, "kind": "completed", "step": 8, "attempt": 2})
    assert samples(e)[behind] == 0
