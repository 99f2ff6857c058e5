"""Prometheus exporter fed from the run directory's records.

The supervisor owns one :class:`PrometheusExporter` per run and calls
``observe_event(event)`` for every ``events.jsonl`` record and
``observe_metric(record)`` for every ``metrics.jsonl`` record it writes or
receives; ``serve(port)`` exposes ``/metrics`` on 127.0.0.1. An offline
``ptops export RUN_DIR --port P`` does the same with :func:`follow`, which tails
the run directory's files (``ptops.ops.runrecord.follow``).

What the events say is the run record's one reducer (``events.Reducer``, kept open:
each event costs O(1)); what the step records say is this module's ``_Records``.
Everything is built at scrape time from the table :data:`FAMILIES` (name, type,
help, label, source) under a lock, so values computed "now" (checkpoint age,
goodput) are exact at scrape, series appear only once they have a value (no fake
zeros for a loss nobody reported), and the exporter has its own
``CollectorRegistry`` (never the process-global one).

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
    EXPORTED_STATES,
    TERMINAL_STATES,
    EventKind,
    Reducer,
    RunState,
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
    # the vLLM engine seam (recipes/trl/engine.py): the rollouts' policy lag, the engine's model
    # version, the train/inference gap on the probe sequence, the weight sync's time
    "staleness": "ptops_rl_staleness",
    "engine/version": "ptops_rl_engine_version",
    "engine/lp_gap": "ptops_rl_engine_lp_gap",
    "engine/sync_s": "ptops_rl_engine_sync_seconds",
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


class _Records:
    """What the step records say (rank 0's scalars, every rank's throughput and step time): the
    exporter's own, as events are the reducer's (``ops/runrecord/events.py``)."""

    def __init__(self) -> None:
        self.attempt = 0  # the highest attempt a record came from
        self.running_after = -1  # ``RunView.state_events`` when a record last said "running"
        self.step: int | None = None
        self.scalars: dict[str, float] = {}  # ptops_loss, ptops_grad_norm, ..., ptops_rl_*
        self.tps: dict[int, tuple[int, float]] = {}  # rank -> (attempt, tokens/s)
        self.rank_step_s: dict[str, float] = {}
        self.hist = [0] * (len(STEP_BUCKETS) + 1)
        self.hist_sum = 0.0
        self.hist_count = 0
        self.nonfinite: dict[str, int] = {"loss": 0, "grad_norm": 0}
        self.nonfinite_seen: set[tuple] = set()
        self.last_nonfinite_ts: float | None = None
        self.first_ts: float | None = None
        self.last_ts: float | None = None
        self.evals: dict[str, float] = {}  # [eval] eval/<name> -> latest held-out score (rank 0)


class _Scrape:
    """One consistent snapshot for :data:`FAMILIES` (taken under the exporter's lock)."""

    def __init__(self, x: "PrometheusExporter", now: float) -> None:
        v, r = x._reducer.view, x._r
        self.v, self.r, self.now, self.ttl = v, r, now, x.straggler_ttl_s
        self.good = x._good.summary(now)
        self.attempt = max(v.attempt, v.restart_attempt, r.attempt)
        if r.running_after == v.state_events and v.event_state not in TERMINAL_STATES:
            self.state = RunState.RUNNING  # a step record came after the last event with a state
        else:
            self.state = v.event_state or x._state_note
        self.kinds = _capped_sum(v.counts, x._kind_label)
        self.kind_ts = _capped_max(v.kind_ts, x._kind_label)
        self.reasons = _capped_sum(v.restart_reasons, x._reason_label)
        self.anomalies = {m: 0 for m in KNOWN_MONITORS if m != "straggler"}
        self.anomalies.update(_capped_sum(v.monitor_findings, x._monitor_label))
        self.anomaly_ts = _capped_max(v.monitor_finding_ts, x._monitor_label)
        self.episodes = _capped_max(v.episode_open(), x._monitor_label)
        self.stragglers = {x._rank_label(str(k)): n for k, n in v.stragglers.items()}
        self.straggler_ratio = {
            x._rank_label(str(k)): ratio
            for k, (ratio, ts) in v.straggler_ratio.items()
            if now - ts <= x.straggler_ttl_s
        }
        ck = v.last_checkpoint or {}
        self.ckpt = {k: _finite(ck.get(k)) for k in ("blocking_s", "total_s")}
        self.ckpt["step"] = _int(ck.get("step"))
        self.first_launch_ts = v.first_launch_ts if v.first_launch_ts is not None else r.first_ts
        self.ckpt_ts = _finite(ck.get("ts"))
        marks = [t for t in (v.last_launch_ts, r.last_ts) if t is not None]
        self.last_progress_ts = max(marks) if marks else None
        self.tps = [tps for (att, tps) in r.tps.values() if att >= self.attempt]

    def histogram(self) -> tuple[list[tuple[str, int]], float]:
        cum, buckets = 0, []
        for le, n in zip((*(repr(b) for b in STEP_BUCKETS), "+Inf"), self.r.hist):
            cum += n
            buckets.append((le, cum))
        return buckets, self.r.hist_sum

    def checkpoint_age(self) -> float | None:
        since = self.ckpt_ts if self.ckpt_ts is not None else self.first_launch_ts
        return None if since is None else max(0.0, self.now - since)


def _finite(value: Any) -> float | None:
    v = number(value)
    return v if v is not None and math.isfinite(v) else None


def _capped_sum(values: Mapping[str, int], cap: "_Capped") -> dict[str, int]:
    out: dict[str, int] = {}
    for k, n in values.items():
        label = cap(_slug(k))
        out[label] = out.get(label, 0) + n
    return out


def _capped_max(values: Mapping[str, float], cap: "_Capped") -> dict[str, float]:
    out: dict[str, float] = {}
    for k, t in values.items():
        label = cap(_slug(k))
        out[label] = max(t, out.get(label, t))
    return out


def _goodput_lost(x: _Scrape) -> dict[str, float]:
    return x.good["lost_s"] if x.good["ratio"] is not None else {}


def _supervisor_lag(x: _Scrape) -> float | None:
    if not x.v.launches:
        return None
    return _finite(x.v.behind.get("lag_s")) if x.v.behind is not None else 0.0


G, C, H = "gauge", "counter", "histogram"
# One table: name, type, help, extra label, and where the value comes from: a number (None: no
# sample), a {label value: number} dict (or ordered pairs) for the family's one extra label, or for
# the histogram its (cumulative buckets, sum). A family with no sample is left out of the scrape.
FAMILIES: tuple[tuple[str, str, str, str | None, Callable[[_Scrape], Any]], ...] = (
    ("ptops_up", G, "1 while this exporter serves the run.", None, lambda x: 1),
    ("ptops_attempt", G, "Current attempt number (1 = first launch; absent before it).", None,
     lambda x: x.attempt or None),
    ("ptops_step", G, "Latest optimizer step reported by rank 0.", None, lambda x: x.r.step),
    ("ptops_loss", G, "Training loss at the latest step (rank 0).", None,
     lambda x: x.r.scalars.get("ptops_loss")),
    ("ptops_grad_norm", G, "Gradient norm at the latest step (rank 0).", None,
     lambda x: x.r.scalars.get("ptops_grad_norm")),
    ("ptops_learning_rate", G, "Learning rate at the latest step (rank 0).", None,
     lambda x: x.r.scalars.get("ptops_learning_rate")),
    ("ptops_tokens_per_second", G, "Training throughput: latest tokens/s summed over the ranks of "
     "the current attempt.", None, lambda x: sum(x.tps) if x.tps else None),
    ("ptops_step_duration_seconds", H, "Optimizer step wall time (rank 0).", None,
     lambda x: x.histogram()),
    ("ptops_rank_step_duration_seconds", G, "Latest step wall time per rank (capped ranks).",
     "rank", lambda x: x.r.rank_step_s),
    *(
        (name, G, f"RL: latest {key} (rank 0).", None,
         lambda x, name=name: x.r.scalars.get(name))
        for key, name in RL_KEYS.items()
    ),
    ("ptops_eval_score", G, "Latest held-out eval score eval/<name> (rank 0; recipes with [eval]).",
     "name", lambda x: x.r.evals),
    ("ptops_restarts", C, "Restarts by the supervisor, by reason.", "reason", lambda x: x.reasons),
    ("ptops_crashes", C, "Rank crashes seen.", None, lambda x: x.v.counts.get("crash", 0)),
    ("ptops_hangs", C, "Hangs detected.", None, lambda x: x.v.counts.get("hang", 0)),
    ("ptops_rollbacks", C, "Rollbacks to an earlier checkpoint.", None,
     lambda x: x.v.counts.get("rollback", 0)),
    ("ptops_faults_injected", C, "Faults injected on purpose (chaos).", None,
     lambda x: x.v.counts.get("fault_injected", 0)),
    ("ptops_stragglers", C, "Straggler findings by rank.", "rank", lambda x: x.stragglers),
    ("ptops_straggler_ratio", G, "Latest straggler ratio (rank step time / median) for ranks "
     "reported as stragglers in the last {ttl:g} s.", "rank", lambda x: x.straggler_ratio),
    ("ptops_anomalies", C, "Monitor findings by monitor.", "monitor", lambda x: x.anomalies),
    ("ptops_anomaly_last_timestamp_seconds", G, "Unix time of the latest finding per monitor.",
     "monitor", lambda x: x.anomaly_ts),
    ("ptops_finding_episode_open", G, "1 while a monitor's finding episode is open (reported, no "
     "all-clear yet).", "monitor", lambda x: x.episodes),
    ("ptops_nonfinite", C, "Steps whose metric was NaN/Inf.", "metric", lambda x: x.r.nonfinite),
    ("ptops_last_nonfinite_timestamp_seconds", G, "Unix time of the latest NaN/Inf loss or grad "
     "norm.", None, lambda x: x.r.last_nonfinite_ts),
    ("ptops_events", C, "events.jsonl records by kind.", "kind", lambda x: x.kinds),
    ("ptops_last_event_timestamp_seconds", G, "Unix time of the latest event per kind.", "kind",
     lambda x: x.kind_ts),
    ("ptops_checkpoint_blocking_seconds", G, "Training time blocked by the latest checkpoint.",
     None, lambda x: x.ckpt["blocking_s"]),
    ("ptops_checkpoint_total_seconds", G, "Total time of the latest checkpoint save.", None,
     lambda x: x.ckpt["total_s"]),
    ("ptops_checkpoint_age_seconds", G, "Seconds since the latest good checkpoint (since the first "
     "launch while there is none).", None, lambda x: x.checkpoint_age()),
    ("ptops_checkpoint_last_good_step", G, "Step of the latest good checkpoint.", None,
     lambda x: x.ckpt["step"]),
    ("ptops_checkpoints", C, "Good checkpoints written.", None,
     lambda x: x.v.counts.get("checkpoint", 0)),
    ("ptops_checkpoint_save_failures", C, "Checkpoint saves that failed.", None,
     lambda x: x.v.counts.get("checkpoint_failed", 0)),
    ("ptops_checkpoint_invalid", C, "Checkpoints found invalid (corrupt/incomplete).", None,
     lambda x: x.v.counts.get("checkpoint_invalid", 0)),
    ("ptops_goodput_ratio", G, "Productive step time (each step's final execution) / wall time "
     "since the first launch.", None, lambda x: x.good["ratio"]),
    ("ptops_productive_seconds", G, "Sum of the durations of each step's final execution.", None,
     lambda x: x.good["productive_s"] if x.r.hist_count else None),
    ("ptops_goodput_lost_seconds", G, "Wall time not spent in productive steps, by cause "
     "(startup, detection, restart, recomputed, checkpoint_blocking, shutdown, other).", "cause",
     _goodput_lost),
    ("ptops_start_timestamp_seconds", G, "Unix time of the first launch.", None,
     lambda x: x.first_launch_ts),
    ("ptops_last_progress_timestamp_seconds", G, "Unix time of the latest step record or launch.",
     None, lambda x: x.last_progress_ts),
    ("ptops_supervisor_behind", G, "1 while the supervisor is behind its ranks' messages (an "
     "inbox_behind episode: hang checks judge at what it has read, so detection is late by the "
     "lag), 0 otherwise.", None, lambda x: int(x.v.behind is not None) if x.v.launches else None),
    ("ptops_supervisor_lag_seconds", G, "How far behind the supervisor was when its open "
     "inbox_behind episode began; 0 while it keeps up.", None, _supervisor_lag),
    ("ptops_run_state", G, "1 for the run's current state, 0 for the others.", "state",
     lambda x: [(str(name), 1.0 if x.state == name else 0.0) for name in EXPORTED_STATES]),
)  # fmt: skip


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
        self._reducer = Reducer()  # what the events say: the one reducer (ops/runrecord/events.py)
        self._r = _Records()  # what the step records say
        self._good = Goodput()  # productive time and where the rest went (ops/runrecord/goodput.py)
        self._state_note = RunState.STARTING  # the state before any event says one
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
        ts = number(event.get("ts"))
        ts = self.clock() if ts is None or not math.isfinite(ts) else ts
        event = {**event, "ts": ts}
        with self._lock:
            self._reducer.add(event)
            self._good.event(event)

    def observe_metric(self, record: Mapping[str, Any]) -> None:
        """One ``metrics.jsonl`` record (one step of one rank)."""
        step = _int(record.get("step"))
        if step is None or step < 0:
            return
        rank = _int(record.get("rank"), 0) or 0
        ts = number(record.get("ts"))
        ts = self.clock() if ts is None or not math.isfinite(ts) else ts
        with self._lock:
            s, v = self._r, self._reducer.view
            current = max(v.attempt, v.restart_attempt, s.attempt)
            attempt = _int(record.get("attempt"), current) or 0
            s.attempt = max(s.attempt, attempt)
            if attempt >= current and v.event_state not in TERMINAL_STATES:
                s.running_after = v.state_events
            s.last_ts = max(ts, s.last_ts or ts)
            if s.first_ts is None:
                s.first_ts = ts
            for key in ("loss", "grad_norm"):
                val = number(record.get(key))
                if val is not None and not math.isfinite(val):
                    mark = (key, attempt, step)
                    if mark not in s.nonfinite_seen:
                        s.nonfinite_seen.add(mark)
                        if len(s.nonfinite_seen) > 10000:
                            s.nonfinite_seen.clear()
                        s.nonfinite[key] += 1
                        s.last_nonfinite_ts = max(ts, s.last_nonfinite_ts or ts)
            tps = _finite(record.get("tokens_per_s"))
            if tps is not None and (rank in s.tps or len(s.tps) < 4096):
                s.tps[rank] = (attempt, tps)
            step_s = _finite(record.get("step_s"))
            if step_s is not None and step_s >= 0:
                r = self._rank_label(str(rank))
                if r != "other":
                    s.rank_step_s[r] = step_s
            if rank == 0:
                self._rank0(s, record, step, step_s, ts)

    def _rank0(self, s: _Records, record: Mapping[str, Any], step: int, step_s, ts) -> None:
        s.step = step
        for key, name in (
            ("loss", "ptops_loss"),
            ("grad_norm", "ptops_grad_norm"),
            ("lr", "ptops_learning_rate"),
            *RL_KEYS.items(),
        ):
            val = number(record.get(key))
            if val is not None:
                s.scalars[name] = val
        for key, value in record.items():  # held-out evals ([eval]): eval/<name>, when one ran
            if key[:5] == "eval/":
                val = _finite(value)
                if val is not None and (key[5:] in s.evals or len(s.evals) < MAX_LABEL_VALUES):
                    s.evals[key[5:]] = val
        if step_s is not None and step_s >= 0:
            i = 0
            while i < len(STEP_BUCKETS) and step_s > STEP_BUCKETS[i]:
                i += 1
            s.hist[i] += 1
            s.hist_sum += step_s
            s.hist_count += 1
            self._good.record({**record, "ts": ts, "rank": 0, "step": step})

    # ------------------------------------------------------------------ computed values

    def goodput(self, now: float | None = None) -> float | None:
        """Productive training time / wall time since the first launch
        (``ops/runrecord/goodput.py``): a step redone after a restart or rollback counts once; wall
        time ends at the run's end event."""
        with self._lock:
            return self._good.summary(self.clock() if now is None else now)["ratio"]

    # ------------------------------------------------------------------ exposition

    def collect(self):
        started = time.monotonic()
        base_names, base = ["run", "recipe"], [self.run, self.recipe]
        kinds = {G: GaugeMetricFamily, C: CounterMetricFamily, H: HistogramMetricFamily}
        out = []
        with self._lock:  # one consistent scrape
            x = _Scrape(self, self.clock())
            for name, kind, doc, label, source in FAMILIES:
                doc = doc.format(ttl=self.straggler_ttl_s) if "{ttl" in doc else doc
                unit = "seconds" if kind == H else ""
                family = kinds[kind](name, doc, labels=[*base_names, *([label] if label else [])],
                                     unit=unit)  # fmt: skip
                value = source(x)
                if kind == H:
                    family.add_metric(base, *value)
                elif label:  # a dict in label order, or pairs in their own order
                    pairs = sorted(value.items()) if isinstance(value, Mapping) else value
                    for k, v in pairs:
                        family.add_metric([*base, k], v)
                elif value is not None:
                    family.add_metric(base, value)
                out.append(family)
        for family in out:
            if family.samples or family.type == H:
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
