"""The monitor contract (issue 50 point 3): a monitor is ``feed`` and ``reset``; what the feed layer
does for scale (a copy per rank, shared copies, node batches and summaries) is its own business and
cannot be broken by reading a record the ordinary way.

What ``record.items()`` did before: a ``SharedRankedMonitor`` whose ``_inputs`` called it made
``keys_any_record_reads`` return None, so ``MonitorFeed.read_keys()`` was None, the supervisor sent
``{"read": null}`` and every node agent summed nothing up (``summary_settings`` -> ``(1, None)``),
for every monitor, with nothing said. ``dict(record)`` (and ``{**record}``, ``copy()``,
``json.dumps``) was worse: ``keys_read`` saw no key read at all, so a certified repeat followed its
leader though the value the monitor read differed (a missed finding). Now: the first leaves that
one monitor out of the summing-up (``read_every``), its summed-up ranks counted in ``unmoved``; the
second is noted as a read of every value. A :class:`Monitor` is never watched at all."""

from __future__ import annotations

import json
import math
import random

import pytest
from test_monitors_replay import _through_batches, _through_summaries

from ptops.monitors import build_monitors, replay
from ptops.monitors.base import Finding, Monitor
from ptops.monitors.config import LossPlateauConfig, MonitorsSection
from ptops.monitors.plateau import LossPlateauMonitor
from ptops.monitors.registry import MONITORS
from ptops.monitors.shared import SharedRankedMonitor, keys_read
from ptops.ops.rank.channel import summary_settings
from ptops.ops.supervisor.monitorfeed import MonitorFeed

CFG = LossPlateauConfig(enabled=True, patience=100)


def _stream(ranks: int, flat_at: int | None = 300, steps: int = 700, seed: int = 0) -> list[dict]:
    """A falling loss (1 % noise, every rank the same: a global value) that flattens at
    ``flat_at``; per-rank step times and grad norms that differ, as in a real run."""
    rng = random.Random(seed)
    out = []
    for s in range(1, steps + 1):
        level = 2.0 + 8.0 * math.exp(-(s if flat_at is None else min(s, flat_at)) / 60)
        loss = level * (1 + rng.gauss(0, 0.01))
        for r in range(ranks):
            step_s = 0.4 + rng.random() * 0.01
            out.append(
                {"step": s, "rank": r, "attempt": 0, "ts": 1e3 + s + r / 100, "loss": loss,
                 "grad_norm": 1.0 + r / 10, "step_s": step_s}
            )  # fmt: skip
    return out


def _dicts(found: list[Finding]) -> list[dict]:
    return json.loads(json.dumps([f.to_dict() for f in found]))


# ------------------------------------------------------------------------ the plateau monitor


def test_plateau_found_within_patience_of_the_loss_flattening():
    found = replay(_stream(4), [LossPlateauMonitor(CFG)])
    assert [(f.monitor, f.severity, f.family) for f in found] == [
        ("loss_plateau", "warning", "numeric")
    ]
    # flat from step 300: the EMA (span 20) stops improving by 1 % a few steps later
    assert 300 + CFG.patience <= found[0].step <= 300 + CFG.patience + CFG.ema_span
    assert found[0].rank == 0 and found[0].ts == 1e3 + found[0].step  # stamped from its record


@pytest.mark.parametrize("seed", range(5))
def test_no_plateau_on_a_falling_noisy_loss(seed):
    rng = random.Random(seed)
    recs = [
        {"step": s, "rank": 0, "loss": 10 * math.exp(-s / 1500) * (1 + rng.gauss(0, 0.03))}
        for s in range(1, 3000)
    ]
    assert replay(recs, [LossPlateauMonitor(CFG)]) == []
    assert replay(_stream(2, flat_at=None, steps=400), [LossPlateauMonitor(CFG)]) == []


def test_plateau_resets_on_rewind():
    """A rollback to step 380 (before patience ran out at ~413): the monitor starts over, and
    the redone steps find the plateau only ``patience`` steps after the rewind."""
    recs = _stream(2, steps=380)
    rewound = [dict(r, attempt=1) for r in _stream(2, steps=700) if r["step"] >= 370]
    found = replay(recs + rewound, [LossPlateauMonitor(CFG)])
    assert [f.step for f in found] == [370 + CFG.patience]
    assert found[0].attempt == 1
    # reset(step) on the monitor itself: everything forgotten
    m = LossPlateauMonitor(CFG)
    for r in _stream(1, steps=200):
        m.feed(r)
    m.reset(150)
    assert m.ema is None and m.best == math.inf


def test_plateau_replay_equals_the_live_feed_with_batches_and_summaries():
    """Offline (``replay``: a copy per rank) and live (``MonitorFeed``: one shared copy, node
    batches' certified repeats, node summaries) give the same findings, and replaying twice gives
    the same findings."""
    recs = _stream(8, steps=500)
    want = _dicts(replay(recs, [LossPlateauMonitor(CFG)]))
    assert want and want == _dicts(replay(recs, [LossPlateauMonitor(CFG)]))
    live = MonitorFeed([LossPlateauMonitor(CFG)])
    handled = _through_batches(recs, random.Random(1), 4)
    assert _dicts([f for r, like in handled for f in live.feed(r, like)[0]]) == want
    assert not live.errors
    feed = MonitorFeed([LossPlateauMonitor(CFG)])
    read = feed.read_keys()
    assert read == {"loss"} and feed.read_every == []
    whole, items = _through_summaries(recs, random.Random(2), 4, 4, read)
    found: list = []
    for item in items:
        if item[0] == "rec":
            found.extend(feed.feed(item[1], item[2])[0])
        else:
            found.extend(feed.repeat_summary(item[1], item[2], item[3])[0])
    assert any(item[0] == "sum" for item in items)  # ranks were summed up
    assert _dicts(found) == want and not feed.unmoved and not feed.errors


def test_the_plateau_monitor_is_registered_configured_and_short():
    from conftest import REPO

    assert MONITORS["loss_plateau"].monitor is LossPlateauMonitor
    assert MONITORS["loss_plateau"].runbook == "LossPlateau"
    assert not MonitorsSection().loss_plateau.enabled  # off by default: the default set unchanged
    assert "loss_plateau" not in {m.name for m in build_monitors()}
    section = MonitorsSection.model_validate({"loss_plateau": {"enabled": True, "patience": 50}})
    (m,) = [m for m in build_monitors(section) if m.name == "loss_plateau"]
    assert m.cfg.patience == 50
    assert len((REPO / "monitors" / "plateau.py").read_text().splitlines()) < 80


# ------------------------------------------------------------- the contract: feed and reset only


class _Counting(Monitor):
    """A monitor that reads the record every ordinary way and counts per rank: what a newcomer
    might write. Its findings depend on values that differ by rank (grad_norm)."""

    name = "counting"

    def __init__(self) -> None:
        self.reset(0)

    def reset(self, step: int) -> None:
        self.n = 0

    def feed(self, record):
        values = dict(record.items())  # the ordinary ways, all of them
        assert dict(record) == values and list(record) == list(values)
        self.n += 1
        g = values.get("grad_norm")
        if self.n % 50 == 0 and isinstance(g, float):
            return [Finding(self.name, values["step"], g, f"grad_norm {g:.3g} at {self.n}")]
        return []


def test_a_plain_monitor_sees_one_rank_in_step_order_and_reading_is_free():
    recs = _stream(4, steps=200)
    found = replay(recs, [_Counting()])
    # a copy per rank: each rank's 50th record, one finding each (their grad norms differ)
    assert sorted((f.step, f.rank) for f in found) == [(s, r) for s in (50, 100, 150, 200)
                                                        for r in range(4)]  # fmt: skip
    # rewinds reset each rank's copy
    again = replay(recs + [dict(r, attempt=1) for r in recs if r["step"] > 180], [_Counting()])
    assert sorted(f.step for f in again) == sorted(f.step for f in found)
    live = MonitorFeed(build_monitors() + [_Counting()])
    handled = _through_batches(recs, random.Random(3), 4)
    got = [f for r, like in handled for f in live.feed(r, like)[0] if f.monitor == "counting"]
    assert _dicts(got) == _dicts(found) and not live.errors
    # and it changes nothing of what node agents may sum up
    assert live.read_keys() == MonitorFeed(build_monitors()).read_keys() and not live.read_every


# ------------------------------------------- the legacy SharedRankedMonitor: ordinary reads safe


class _ReadsAll(SharedRankedMonitor):
    """A shared monitor whose inputs read the record whole (``how``): a finding when its loss is
    above 5, which only rank 1 has at step 3."""

    name = "reads_all"

    def __init__(self, how) -> None:
        self.how = how
        super().__init__()

    def _new_state(self) -> list:
        return []

    def _inputs(self, record) -> tuple:
        return (self.how(record).get("loss"),)

    def _apply(self, state, inputs, record, step, rank) -> list:
        out: list = []
        if isinstance(inputs[0], float) and inputs[0] > 5:
            self._emit(out, record, step, rank, "high", inputs[0], "loss high", "warning")
        return out


HOW = {
    "items": lambda r: dict(r.items()),
    "values": lambda r: dict(zip(r.keys(), r.values())),
    "dict": dict,
    "unpack": lambda r: {**r},
    "copy": lambda r: r.copy(),
    "json": lambda r: json.loads(json.dumps(r)),
    "or": lambda r: r | {},
}


@pytest.mark.parametrize("how", sorted(HOW))
def test_reading_a_record_whole_is_noted_and_never_follows_a_leader_wrongly(how):
    inputs = _ReadsAll(HOW[how])._inputs
    assert "loss" in keys_read(inputs, {"step": 1, "rank": 0, "loss": 1.0, "x": 2})
    # the live path: rank 1's record certified equal to rank 0's but for its loss (a like)
    recs = [{"step": s, "rank": r, "loss": 9.0 if (s, r) == (3, 1) else 1.0} for s in (1, 2, 3)
            for r in (0, 1)]  # fmt: skip
    feed = MonitorFeed([_ReadsAll(HOW[how])])
    got = []
    for rec in recs:
        like = (0, frozenset({"rank", "loss"})) if rec["rank"] == 1 else None
        got.extend(feed.feed(rec, like)[0])
    assert [(f.step, f.rank) for f in got] == [(3, 1)]


def test_items_in_a_shared_monitor_no_longer_turns_node_summaries_off():
    plain = MonitorFeed(build_monitors()).read_keys()
    feed = MonitorFeed(build_monitors() + [_ReadsAll(HOW["items"])])
    read = feed.read_keys()
    assert read is not None and read == plain and feed.read_every == ["reads_all"]
    every, keys = summary_settings(json.dumps({"every": 4, "read": sorted(read)}))
    assert keys == read  # node agents still sum up (before: (1, None), nothing summed up)
    # its summed-up ranks that differ in a key it reads: counted, not moved on silently
    lead = {"step": 1, "rank": 0, "loss": 1.0, "step_s": 0.4}
    feed.feed(lead)
    feed.repeat_summary(lead, [1, 2, 3], frozenset({"step_s"}))
    assert feed.unmoved == {"reads_all": 3}


def test_every_registered_monitor_keeps_node_summaries_on():
    """A registered shared monitor whose inputs read a record whole fails here, loudly."""
    on = MonitorsSection.model_validate({n: {"enabled": True} for n in MONITORS})
    feed = MonitorFeed(build_monitors(on))
    assert feed.read_keys() and feed.read_every == []
