"""The fast entry (``feed_at``: the record parsed once for all monitors, what ``replay`` and the
supervisor's ``MonitorFeed`` call) gives the same findings as ``feed(record)`` per monitor, on every
recorded trace and on the replay corpus (rewound, garbled, late and diverging streams)."""

from __future__ import annotations

from replay_corpus import corpus

from ptops.monitors import StragglerMonitor, build_monitors, fast_entries, replay
from ptops.ops.supervisor.monitorfeed import MonitorFeed


def _plain(recs: list[dict]) -> list[dict]:
    mons = build_monitors()
    out = [f for r in recs for m in mons for f in m.feed(r)]
    for m in mons:
        if hasattr(m, "flush"):
            out += m.flush()
    return [f.to_dict() for f in out]


def _live(recs: list[dict]) -> list[dict]:
    mons = build_monitors()
    feed = MonitorFeed(mons)
    out = []
    for r in recs:
        found, errors = feed.feed(r)
        assert errors == []
        out += found
    for m in mons:
        if hasattr(m, "flush"):
            out += m.flush()
    return [f.to_dict() for f in out]


def test_fast_entry_gives_the_findings_of_plain_feed():
    total = 0
    streams = corpus()
    assert sum(n.endswith(".jsonl") for n in streams) >= 25  # every recorded trace is in it
    for name, recs in streams.items():
        want = _plain(recs)
        assert [f.to_dict() for f in replay(recs, build_monitors())] == want, name
        assert _live(recs) == want, name
        total += len(want)
    assert total > 300  # the corpus does find things: equality is not vacuous


class _Counting(StragglerMonitor):
    """A monitor that redefines ``feed``: the fast path must call it, not the inherited
    ``feed_at``."""

    def __init__(self) -> None:
        super().__init__()
        self.fed = 0

    def feed(self, record):
        self.fed += 1
        return super().feed(record)


def test_a_redefined_feed_and_a_record_without_step_go_to_feed():
    m = _Counting()
    [entry] = fast_entries([m])
    entry({"step": 1, "rank": 0, "step_s": 1.0}, {}.keys(), 1, 0)
    assert m.fed == 1
    feed = MonitorFeed([m])
    feed.feed({"step": 2, "rank": 0, "step_s": 1.0})
    feed.feed({"rank": 0, "step_s": 1.0})  # no step: plain feed, which ignores it
    assert m.fed == 3 and feed.errors == {}
    plain = StragglerMonitor()
    assert (
        fast_entries([plain])[0] == plain.feed_at
    )  # the fast entry itself when feed is not redefined
