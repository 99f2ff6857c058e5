"""The monitor in docs/development.md ("Writing a monitor"), run as written: a newcomer's four
methods give the findings of one state per rank through replay and through the live feed with
node-batch certificates, and find what they should."""

from __future__ import annotations

import json
import random
import re

import synth  # tests/data/traces (pytest's pythonpath)
from conftest import REPO
from test_monitors_replay import _through_batches

from ptops.monitors import replay
from ptops.ops.supervisor.monitorfeed import MonitorFeed


def _guide_class():
    doc = (REPO / "docs" / "development.md").read_text()
    section = doc.split("## Writing a monitor", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    space: dict = {}
    exec(compile(code, "docs/development.md", "exec"), space)  # the repo's own doc
    return space["VanishingGradMonitor"]


def _stream(ranks: int) -> list[dict]:
    recs = []
    for r in synth.pretrain(200, 3, ranks=ranks, with_busy=True):
        if 120 <= r["step"] < 126:
            r = dict(r, grad_norm=1e-10)  # every rank: the global norm vanished
        recs.append(r)
    return recs


def test_the_guides_monitor_finds_what_it_should_and_shares_exactly():
    cls = _guide_class()
    recs = _stream(4)
    found = replay(recs, [cls()])
    assert [(f.monitor, f.step, f.severity) for f in found] == [("vanishing_grad", 122, "warning")]
    alone = cls()
    alone.share = False
    want = [f.to_dict() for f in replay(recs, [alone])]
    assert [f.to_dict() for f in found] == want
    handled = _through_batches(recs, random.Random(1), 4)  # the live path from node agents
    live = MonitorFeed([cls()])
    got = [f.to_dict() for r, like in handled for f in live.feed(r, like)[0]]
    alone = cls()
    alone.share = False
    assert json.loads(json.dumps(got)) == [
        f.to_dict() for f in replay([r for r, _ in handled], [alone])
    ]
    assert got and not live.errors
