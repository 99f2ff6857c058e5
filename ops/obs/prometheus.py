"""Prometheus exporter fed from the run directory's records.

The supervisor owns one :class:`PrometheusExporter` per run and calls
``observe_event(event)`` for every ``events.jsonl`` record and
``observe_metric(record)`` for every ``metrics.jsonl`` record it writes or
receives; ``serve(port)`` exposes ``/metrics`` on 127.0.0.1. An offline
``ptops export RUN_DIR --port P`` does the same with :func:`follow`, which tails
the run directory's files (``ptops.ops.runrecord.follow``).

Everything is built at scrape time by one custom collector from a small state
object under a lock, so values computed "now" (checkpoint age, goodput) are
exact at scrape, series appear only once they have a value (no fake zeros for a
loss nobody reported), and the exporter has its own ``CollectorRegistry`` (never
the process-global one).

Labels: every series carries ``run`` and ``recipe``; per-rank series add
``rank`` (capped: ``max_ranks`` distinct ranks, the rest fold into
``rank="other"``); free-form label values (restart reasons, anomaly monitors,
event kinds) are normalised and capped too, so cardinality stays bounded.
"""

from __future__ import annotations

import json
import logging
import math
import re
import socket
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from ptops.monitors.base import number  # the probe's "nan"/"inf" encoding, decoded in one place
from ptops.monitors.registry import MONITORS
from ptops.ops.runrecord.events import (
    END_KINDS,
    EXPORTED_STATES,
    TERMINAL_STATES,
    EventKind,
    RunState,
    is_all_clear,
    next_state,
)
from ptops.ops.runrecord.goodput import Goodput

log = logging.getLogger("ptops.exporters.prometheus")

# The monitors' names: pre-initialised at 0 so rate()/increase() see the first finding.
KNOWN_MONITORS = tuple(MONITORS)
STEP_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
RL_KEYS = {
    "entropy": "ptops_rl_entropy",
    "kl": "ptops_rl_kl",
    "reward": "ptops_rl_reward",
    "reward_std": "ptops_rl_reward_std",
}
MAX_LABEL_VALUES = 32  # per free-form label (reason, monitor, kind)


def _int(value: Any, default: int | None = None) -> int | None:
    try:
        return int(value)
    except (TypeError, ValueError):
        return default


def _slug(value: Any, default: str = "unknown") -> str:
    """A bounded label value: the first word of a free-form string, lower case, <= 40 chars."""
    m = re.search(r"[A-Za-z][A-Za-z0-9_\-]*", str(value or ""))
    return m.group(0).lower().replace("-", "_")[:40] if m else default


class _Capped:
    """Label values for one label, at most ``cap`` distinct; later newcomers become ``other``."""

    def __init__(self, cap: int, preset: Iterable[str] = ()) -> None:
        self.cap = cap
        self.seen: set[str] = set(preset)

    def __call__(self, value: str) -> str:
        if value in self.seen:
            return value
        if len(self.seen) < self.cap:
            self.seen.add(value)
            return value
        return "other"


class _State:
    def __init__(self) -> None:
        self.attempt = 0
        self.state: str | None = "starting"
        self.step: int | None = None
        self.scalars: dict[
            str, float
        ] = {}  # ptops_loss, ptops_grad_norm, ptops_learning_rate, ptops_rl_*
        self.tps: dict[int, tuple[int, float]] = {}  # rank -> (attempt, tokens/s)
        self.rank_step_s: dict[str, float] = {}
        self.hist = [0] * (len(STEP_BUCKETS) + 1)
        self.hist_sum = 0.0
        self.hist_count = 0
        self.good = Goodput()  # productive time and where the rest went (ops/runrecord/goodput.py)
        self.restarts: dict[str, int] = {}
        self.counts: dict[str, int] = {
            "crashes": 0,
            "hangs": 0,
            "rollbacks": 0,
            "faults_injected": 0,
            "checkpoint_save_failures": 0,
            "checkpoint_invalid": 0,
            "checkpoints": 0,
        }
        self.stragglers: dict[str, int] = {}
        self.straggler_ratio: dict[str, tuple[float, float]] = {}  # rank -> (ratio, ts)
        self.anomalies: dict[str, int] = {m: 0 for m in KNOWN_MONITORS if m != "straggler"}
        self.anomaly_ts: dict[str, float] = {}
        self.episode_open: dict[
            str, int
        ] = {}  # monitor -> 1 while an episode is open (opened, not yet all-clear)
        self.nonfinite: dict[str, int] = {"loss": 0, "grad_norm": 0}
        self.nonfinite_seen: set[tuple] = set()
        self.last_nonfinite_ts: float | None = None
        self.events: dict[str, int] = {}
        self.event_ts: dict[str, float] = {}
        self.ckpt: dict[str, float] = {}  # blocking_s, total_s, step, ts
        self.first_launch_ts: float | None = None
        self.end_ts: float | None = None
        self.last_progress_ts: float | None = None
        self.evals: dict[str, float] = {}  # [eval] eval/<name> -> latest held-out score (rank 0)


class PrometheusExporter:
    """Run state as Prometheus metrics, fed record by record.

    Thread-safe: ``observe_*`` may be called from the supervisor loop while a
    scrape is running in the HTTP server's thread.
    """

    def __init__(
        self,
        run: str,
        recipe: str = "",
        *,
        registry: CollectorRegistry | None = None,
        max_ranks: int = 64,
        straggler_ttl_s: float = 300.0,
        nvml: bool = True,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.run = str(run)
        self.recipe = str(recipe or "")
        self.max_ranks = max_ranks
        self.straggler_ttl_s = straggler_ttl_s
        self.clock = clock
        self._lock = threading.Lock()
        self._s = _State()
        self._rank_label = _Capped(max_ranks)
        self._reason_label = _Capped(MAX_LABEL_VALUES)
        self._monitor_label = _Capped(MAX_LABEL_VALUES, (m for m in KNOWN_MONITORS))
        self._kind_label = _Capped(MAX_LABEL_VALUES, (str(k) for k in EventKind))
        self.registry = registry if registry is not None else CollectorRegistry()
        self.registry.register(self)
        self.nvml = None
        if nvml:
            from ptops.ops.obs.nvml import NvmlCollector

            self.nvml = NvmlCollector(
                {"run": self.run, "recipe": self.recipe, "host": socket.gethostname()}
            )
            self.registry.register(self.nvml)
        self._server = None
        self._thread = None
        self._scraped = threading.Condition()
        self._scrapes: list[float] = []  # monotonic start of the last two complete collections

    @classmethod
    def for_run_dir(cls, run_dir: str | Path, **kwargs: Any) -> "PrometheusExporter":
        """An exporter labelled after a run directory (run = its name, recipe = recipe.json's
        name)."""
        run_dir = Path(run_dir)
        return cls(run_dir.name, recipe_name(run_dir), **kwargs)

    # ------------------------------------------------------------------ feeding

    def observe_event(self, event: Mapping[str, Any]) -> None:
        """One ``events.jsonl`` record (``ts`` and ``kind`` always; the kind's fields)."""
        kind = str(event.get("kind") or "unknown")
        ts = number(event.get("ts"))
        ts = self.clock() if ts is None or not math.isfinite(ts) else ts
        with self._lock:
            s = self._s
            k = self._kind_label(_slug(kind))
            s.events[k] = s.events.get(k, 0) + 1
            s.event_ts[k] = max(ts, s.event_ts.get(k, ts))
            if kind in (EventKind.LAUNCH, *END_KINDS):
                # monitors forget open episodes when an attempt starts over; an ended run has none
                s.episode_open = dict.fromkeys(s.episode_open, 0)
            if kind == EventKind.LAUNCH:
                att = _int(event.get("attempt"), s.attempt + 1) or 0
                s.attempt = max(s.attempt, att)
                s.first_launch_ts = ts if s.first_launch_ts is None else min(s.first_launch_ts, ts)
                s.end_ts = None
                s.last_progress_ts = max(ts, s.last_progress_ts or ts)
            elif kind == EventKind.CHECKPOINT:
                s.counts["checkpoints"] += 1
                for key in ("blocking_s", "total_s"):
                    v = number(event.get(key))
                    if v is not None and math.isfinite(v):
                        s.ckpt[key] = v
                step = _int(event.get("step"))
                if step is not None:
                    s.ckpt["step"] = step
                s.ckpt["ts"] = max(ts, s.ckpt.get("ts", ts))
            elif kind == EventKind.CHECKPOINT_INVALID:
                s.counts["checkpoint_invalid"] += 1
            elif kind == EventKind.CHECKPOINT_FAILED:
                s.counts["checkpoint_save_failures"] += 1
            elif kind == EventKind.FAULT_INJECTED:
                s.counts["faults_injected"] += 1
            elif kind == EventKind.CRASH:
                s.counts["crashes"] += 1
            elif kind == EventKind.HANG:
                s.counts["hangs"] += 1
            elif kind == EventKind.STRAGGLER:
                rank = _int(event.get("rank"))
                if rank is not None:
                    r = self._rank_label(str(rank))
                    s.stragglers[r] = s.stragglers.get(r, 0) + 1
                    ratio = number(event.get("ratio"))
                    if ratio is not None and math.isfinite(ratio):
                        s.straggler_ratio[r] = (ratio, ts)
            elif kind == EventKind.ANOMALY:
                m = self._monitor_label(_slug(event.get("monitor")))
                phase = event.get("phase")
                if is_all_clear(event):
                    s.episode_open[m] = 0
                else:
                    s.anomalies[m] = s.anomalies.get(m, 0) + 1
                    s.anomaly_ts[m] = max(ts, s.anomaly_ts.get(m, ts))
                    if phase is not None:
                        s.episode_open[m] = 1
            elif kind == EventKind.RESTART:
                reason = self._reason_label(_slug(event.get("reason")))
                s.restarts[reason] = s.restarts.get(reason, 0) + 1
                att = _int(event.get("attempt"))
                if att is not None:
                    s.attempt = max(s.attempt, att)
            elif kind == EventKind.ROLLBACK:
                s.counts["rollbacks"] += 1
            elif kind in END_KINDS:
                s.end_ts = ts
            s.good.event({**event, "ts": ts})
            s.state = next_state(s.state, event)

    def observe_metric(self, record: Mapping[str, Any]) -> None:
        """One ``metrics.jsonl`` record (one step of one rank)."""
        step = _int(record.get("step"))
        if step is None or step < 0:
            return
        rank = _int(record.get("rank"), 0) or 0
        ts = number(record.get("ts"))
        ts = self.clock() if ts is None or not math.isfinite(ts) else ts
        with self._lock:
            s = self._s
            attempt = _int(record.get("attempt"), s.attempt) or 0
            if attempt > s.attempt:
                s.attempt = attempt
            if attempt >= s.attempt and s.state not in TERMINAL_STATES:
                s.state = RunState.RUNNING
            s.last_progress_ts = max(ts, s.last_progress_ts or ts)
            if s.first_launch_ts is None:
                s.first_launch_ts = ts
            for key in ("loss", "grad_norm"):
                v = number(record.get(key))
                if v is not None and not math.isfinite(v):
                    mark = (key, attempt, step)
                    if mark not in s.nonfinite_seen:
                        s.nonfinite_seen.add(mark)
                        if len(s.nonfinite_seen) > 10000:
                            s.nonfinite_seen.clear()
                        s.nonfinite[key] += 1
                        s.last_nonfinite_ts = max(ts, s.last_nonfinite_ts or ts)
            tps = number(record.get("tokens_per_s"))
            if tps is not None and math.isfinite(tps):
                if rank in s.tps or len(s.tps) < 4096:
                    s.tps[rank] = (attempt, tps)
            step_s = number(record.get("step_s"))
            if step_s is not None and math.isfinite(step_s) and step_s >= 0:
                r = self._rank_label(str(rank))
                if r != "other":
                    s.rank_step_s[r] = step_s
            if rank != 0:
                return
            s.step = step
            for key, name in (
                ("loss", "ptops_loss"),
                ("grad_norm", "ptops_grad_norm"),
                ("lr", "ptops_learning_rate"),
                *RL_KEYS.items(),
            ):
                v = number(record.get(key))
                if v is not None:
                    s.scalars[name] = v
            for (
                key,
                value,
            ) in record.items():  # held-out evals ([eval]): eval/<name>, on the steps that ran one
                if key[:5] == "eval/":
                    v = number(value)
                    if (
                        v is not None
                        and math.isfinite(v)
                        and (key[5:] in s.evals or len(s.evals) < MAX_LABEL_VALUES)
                    ):
                        s.evals[key[5:]] = v
            if step_s is not None and math.isfinite(step_s) and step_s >= 0:
                i = 0
                while i < len(STEP_BUCKETS) and step_s > STEP_BUCKETS[i]:
                    i += 1
                s.hist[i] += 1
                s.hist_sum += step_s
                s.hist_count += 1
                s.good.record({**record, "ts": ts, "rank": 0, "step": step})

    def set_state(self, state: str) -> None:
        """Let the supervisor say what it is doing when no event says it (e.g. ``starting``)."""
        with self._lock:
            self._s.state = state

    # ------------------------------------------------------------------ computed values

    def goodput(self, now: float | None = None) -> float | None:
        """Productive training time / wall time since the first launch
        (``ops/runrecord/goodput.py``): a step redone after a restart or rollback counts once; wall
        time ends at the run's end event."""
        with self._lock:
            return self._s.good.summary(self.clock() if now is None else now)["ratio"]

    # ------------------------------------------------------------------ exposition

    def collect(self):
        started = time.monotonic()
        now = self.clock()
        base_names = ["run", "recipe"]
        base = [self.run, self.recipe]
        with self._lock:
            s = self._s
            good = s.good.summary(
                now
            )  # under the same lock as the other values: one consistent scrape
            goodput = good["ratio"]

            def gauge(name: str, doc: str, value: float | None, unit: str = ""):
                g = GaugeMetricFamily(name, doc, labels=base_names, unit=unit)
                if value is not None:
                    g.add_metric(base, value)
                return g

            def counter(name: str, doc: str, value: float):
                c = CounterMetricFamily(name, doc, labels=base_names)
                c.add_metric(base, value)
                return c

            def labelled(cls, name: str, doc: str, label: str, values: Mapping[str, float]):
                m = cls(name, doc, labels=[*base_names, label])
                for k in sorted(values):
                    m.add_metric([*base, k], values[k])
                return m

            out = [
                gauge("ptops_up", "1 while this exporter serves the run.", 1),
                gauge(
                    "ptops_attempt",
                    "Current attempt number (1 = first launch; absent before it).",
                    s.attempt or None,
                ),
                gauge("ptops_step", "Latest optimizer step reported by rank 0.", s.step),
                gauge(
                    "ptops_loss",
                    "Training loss at the latest step (rank 0).",
                    s.scalars.get("ptops_loss"),
                ),
                gauge(
                    "ptops_grad_norm",
                    "Gradient norm at the latest step (rank 0).",
                    s.scalars.get("ptops_grad_norm"),
                ),
                gauge(
                    "ptops_learning_rate",
                    "Learning rate at the latest step (rank 0).",
                    s.scalars.get("ptops_learning_rate"),
                ),
            ]
            cur_tps = [v for (a, v) in s.tps.values() if a >= s.attempt]
            out.append(
                gauge(
                    "ptops_tokens_per_second",
                    "Training throughput: latest tokens/s summed over the ranks "
                    "of the current attempt.",
                    sum(cur_tps) if cur_tps else None,
                )
            )
            h = HistogramMetricFamily(
                "ptops_step_duration_seconds",
                "Optimizer step wall time (rank 0).",
                labels=base_names,
                unit="seconds",
            )
            cum, buckets = 0, []
            for le, n in zip((*(repr(b) for b in STEP_BUCKETS), "+Inf"), s.hist):
                cum += n
                buckets.append((le, cum))
            h.add_metric(base, buckets, s.hist_sum)
            out.append(h)
            out.append(
                labelled(
                    GaugeMetricFamily,
                    "ptops_rank_step_duration_seconds",
                    "Latest step wall time per rank (capped ranks).",
                    "rank",
                    s.rank_step_s,
                )
            )
            for key, name in RL_KEYS.items():
                out.append(gauge(name, f"RL: latest {key} (rank 0).", s.scalars.get(name)))
            out.append(
                labelled(
                    GaugeMetricFamily,
                    "ptops_eval_score",
                    "Latest held-out eval score eval/<name> (rank 0; recipes with [eval]).",
                    "name",
                    s.evals,
                )
            )

            restarts = CounterMetricFamily(
                "ptops_restarts",
                "Restarts by the supervisor, by reason.",
                labels=[*base_names, "reason"],
            )
            for reason in sorted(s.restarts):
                restarts.add_metric([*base, reason], s.restarts[reason])
            out.append(restarts)
            out.append(counter("ptops_crashes", "Rank crashes seen.", s.counts["crashes"]))
            out.append(counter("ptops_hangs", "Hangs detected.", s.counts["hangs"]))
            out.append(
                counter(
                    "ptops_rollbacks", "Rollbacks to an earlier checkpoint.", s.counts["rollbacks"]
                )
            )
            out.append(
                counter(
                    "ptops_faults_injected",
                    "Faults injected on purpose (chaos).",
                    s.counts["faults_injected"],
                )
            )
            out.append(
                labelled(
                    CounterMetricFamily,
                    "ptops_stragglers",
                    "Straggler findings by rank.",
                    "rank",
                    s.stragglers,
                )
            )
            live = {
                r: v for r, (v, t) in s.straggler_ratio.items() if now - t <= self.straggler_ttl_s
            }
            out.append(
                labelled(
                    GaugeMetricFamily,
                    "ptops_straggler_ratio",
                    "Latest straggler ratio (rank step time / median) for ranks reported as "
                    "stragglers "
                    f"in the last {self.straggler_ttl_s:g} s.",
                    "rank",
                    live,
                )
            )
            out.append(
                labelled(
                    CounterMetricFamily,
                    "ptops_anomalies",
                    "Monitor findings by monitor.",
                    "monitor",
                    s.anomalies,
                )
            )
            out.append(
                labelled(
                    GaugeMetricFamily,
                    "ptops_anomaly_last_timestamp_seconds",
                    "Unix time of the latest finding per monitor.",
                    "monitor",
                    s.anomaly_ts,
                )
            )
            out.append(
                labelled(
                    GaugeMetricFamily,
                    "ptops_finding_episode_open",
                    "1 while a monitor's finding episode is open (reported, no all-clear yet).",
                    "monitor",
                    s.episode_open,
                )
            )
            out.append(
                labelled(
                    CounterMetricFamily,
                    "ptops_nonfinite",
                    "Steps whose metric was NaN/Inf.",
                    "metric",
                    s.nonfinite,
                )
            )
            out.append(
                gauge(
                    "ptops_last_nonfinite_timestamp_seconds",
                    "Unix time of the latest NaN/Inf loss or grad norm.",
                    s.last_nonfinite_ts,
                )
            )
            out.append(
                labelled(
                    CounterMetricFamily,
                    "ptops_events",
                    "events.jsonl records by kind.",
                    "kind",
                    s.events,
                )
            )
            out.append(
                labelled(
                    GaugeMetricFamily,
                    "ptops_last_event_timestamp_seconds",
                    "Unix time of the latest event per kind.",
                    "kind",
                    s.event_ts,
                )
            )

            out.append(
                gauge(
                    "ptops_checkpoint_blocking_seconds",
                    "Training time blocked by the latest checkpoint.",
                    s.ckpt.get("blocking_s"),
                )
            )
            out.append(
                gauge(
                    "ptops_checkpoint_total_seconds",
                    "Total time of the latest checkpoint save.",
                    s.ckpt.get("total_s"),
                )
            )
            age_from = s.ckpt.get("ts", s.first_launch_ts)
            out.append(
                gauge(
                    "ptops_checkpoint_age_seconds",
                    "Seconds since the latest good checkpoint (since the "
                    "first launch while there is none).",
                    None if age_from is None else max(0.0, now - age_from),
                )
            )
            out.append(
                gauge(
                    "ptops_checkpoint_last_good_step",
                    "Step of the latest good checkpoint.",
                    s.ckpt.get("step"),
                )
            )
            out.append(
                counter("ptops_checkpoints", "Good checkpoints written.", s.counts["checkpoints"])
            )
            out.append(
                counter(
                    "ptops_checkpoint_save_failures",
                    "Checkpoint saves that failed.",
                    s.counts["checkpoint_save_failures"],
                )
            )
            out.append(
                counter(
                    "ptops_checkpoint_invalid",
                    "Checkpoints found invalid (corrupt/incomplete).",
                    s.counts["checkpoint_invalid"],
                )
            )

            out.append(
                gauge(
                    "ptops_goodput_ratio",
                    "Productive step time (each step's final execution) / wall time "
                    "since the first launch.",
                    goodput,
                )
            )
            out.append(
                gauge(
                    "ptops_productive_seconds",
                    "Sum of the durations of each step's final execution.",
                    good["productive_s"] if s.hist_count else None,
                )
            )
            out.append(
                labelled(
                    GaugeMetricFamily,
                    "ptops_goodput_lost_seconds",
                    "Wall time not spent in productive "
                    "steps, by cause (startup, detection, restart, recomputed, "
                    "checkpoint_blocking, "
                    "shutdown, other).",
                    "cause",
                    good["lost_s"] if good["ratio"] is not None else {},
                )
            )
            out.append(
                gauge(
                    "ptops_start_timestamp_seconds",
                    "Unix time of the first launch.",
                    s.first_launch_ts,
                )
            )
            out.append(
                gauge(
                    "ptops_last_progress_timestamp_seconds",
                    "Unix time of the latest step record or launch.",
                    s.last_progress_ts,
                )
            )
            st = GaugeMetricFamily(
                "ptops_run_state",
                "1 for the run's current state, 0 for the others.",
                labels=[*base_names, "state"],
            )
            for name in EXPORTED_STATES:
                st.add_metric([*base, str(name)], 1.0 if s.state == name else 0.0)
            out.append(st)
        for family in out:
            if family.samples or family.type in ("histogram",):
                yield family
        with self._scraped:
            self._scrapes = [*self._scrapes[-1:], started]
            self._scraped.notify_all()

    # ------------------------------------------------------------------ serving

    def text(self) -> str:
        return generate_latest(self.registry).decode()

    def serve(self, port: int = 0, addr: str = "127.0.0.1") -> int:
        """Serve ``/metrics`` on ``addr:port`` (0 = a free port) in a daemon thread; return the
        port."""
        from prometheus_client import start_http_server

        self._server, self._thread = start_http_server(port, addr=addr, registry=self.registry)
        return self._server.server_port

    @property
    def port(self) -> int | None:
        return self._server.server_port if self._server else None

    def last_scrape(self, cap_s: float = 30.0) -> bool:
        """Wait (at most two scrape intervals, ``cap_s`` at most) for one more scrape, so that the
        scraper sees what was fed last (the run's end) before the endpoint goes; returns at once
        when nothing scrapes (fewer than two collections seen: the registration's own)."""
        asked = time.monotonic()
        with self._scraped:
            if len(self._scrapes) < 2 or self._server is None:
                return False
            timeout = min(cap_s, 2 * (self._scrapes[-1] - self._scrapes[-2]) + 1.0)
            # a collection that began after everything was fed, not one that snapshotted before
            if not self._scraped.wait_for(lambda: self._scrapes[-1] > asked, timeout=timeout):
                return False
        time.sleep(0.2)  # the HTTP handler thread still writes the response out
        return True

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        if self.nvml is not None:
            self.nvml.close()


# ---------------------------------------------------------------------- run-directory feeding


def recipe_name(run_dir: str | Path) -> str:
    try:
        return str(json.loads((Path(run_dir) / "recipe.json").read_text()).get("name") or "")
    except (OSError, ValueError, AttributeError):
        return ""
