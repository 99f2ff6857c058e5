"""The monitor in docs/development.md ("Writing a monitor") is the real one: its code block is
``monitors/plateau.py`` as written, and that monitor, fed a real-looking run (every rank, flattening
loss), gives the same findings through replay and through the live feed with node-batch
certificates. Its own behaviour is tested in test_monitor_contract.py."""

from __future__ import annotations

import json
import random
import re

import synth  # tests/data/traces (pytest's pythonpath)
from conftest import REPO
from test_monitors_replay import _through_batches

from ptops.monitors import replay
from ptops.monitors.config import LossPlateauConfig
from ptops.monitors.plateau import LossPlateauMonitor
from ptops.ops.supervisor.monitorfeed import MonitorFeed


def _guide_code() -> str:
    doc = (REPO / "docs" / "development.md").read_text()
    section = doc.split("## Writing a monitor", 1)[1].split("\n## ", 1)[0]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_the_guides_code_is_the_real_monitor():
    code = _guide_code()
    assert "class LossPlateauMonitor(Monitor):" in code
    assert code in (REPO / "monitors" / "plateau.py").read_text()


def test_the_guides_monitor_finds_a_plateau_alike_offline_and_live():
    recs = [
        dict(r, loss=2.29) if r["step"] > 100 else r  # the loss flat from step 100, every rank
        for r in synth.pretrain(260, 3, ranks=4, with_busy=True)
    ]
    cfg = LossPlateauConfig(enabled=True, patience=50)
    found = replay(recs, [LossPlateauMonitor(cfg)])
    assert [(f.monitor, f.severity) for f in found] == [("loss_plateau", "warning")]
    assert 150 <= found[0].step <= 150 + 2 * cfg.ema_span  # patience + the EMA's lag
    live = MonitorFeed([LossPlateauMonitor(cfg)])
    handled = _through_batches(recs, random.Random(1), 4)  # the live path from node agents
    got = [f.to_dict() for r, like in handled for f in live.feed(r, like)[0]]
    want = replay([r for r, _ in handled], [LossPlateauMonitor(cfg)])  # (that order: that rank)
    assert json.loads(json.dumps(got)) == json.loads(json.dumps([f.to_dict() for f in want]))
    assert not live.errors
