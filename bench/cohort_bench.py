"""What a relay-step costs the supervisor's per-rank parts, with and without cohorts (issue 24).

A relay's step: its leader's record whole, its other ranks summed up (one summary), every rank's
begin beat folded into one line. Three parts are timed here, on groups of ``--per`` ranks:

- the hang monitor: ``observe_ranks`` (a cohort moves as ONE state) against ``observe_steps`` of
  each rank (the path every group took before, and takes when its ranks' states differ), in the
  same run, and the ratio;
- the shared monitors: ``MonitorFeed.repeat_summary`` of the followers (a cohort moved on in O(1)
  by each ``SharedRankedMonitor``), steady steps only;
- the hang check's full walk at ``--groups`` x ``--per`` ranks (each state asked once).

    .venv/bin/python bench/cohort_bench.py [--groups 256 --per 512] [--json OUT]

Results: bench/README.md, "Cohorts".
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import scale_load  # the bench's own titan-like records

from ptops.monitors.hang import HangConfig, HangMonitor
from ptops.ops.supervisor.monitorfeed import MonitorFeed, build


def _warm(m: HangMonitor, world: int) -> float:
    """Every rank through its first step one by one (the slow path), as a run's start."""
    begin = {"kind": "beat", "phase": "step", "stage": "begin"}
    for r in range(world):
        m.observe({**begin, "rank": r, "step": 1, "ts": 1.0})
    for r in range(world):
        m.observe({"kind": "metrics", "rank": r, "step": 1, "step_s": 1.0, "ts": 2.0})
        m.observe({**begin, "rank": r, "step": 2, "ts": 2.0})
    return 2.0


def hang_step(groups: list, steps: int, cohorts: bool) -> float:
    """Seconds a relay-step (leader, summary, folded beats) in the hang monitor, steady steps."""
    world = sum(len(g) for g in groups)
    m = HangMonitor(world, 0.0, HangConfig(floor_s=10.0))
    ts = _warm(m, world)
    spent, n = 0.0, 0
    for step in range(2, 2 + steps):
        ts += 1.0
        t0 = time.perf_counter()
        for g in groups:
            lead, rest = g[0], g[1:]
            m.observe_steps("metrics", [(lead, step, 1.0)], ts)
            if cohorts:
                m.observe_ranks("metrics", rest, step, ts, (rest[3], 1.0))
                m.observe_ranks("begin", g, step + 1, ts)
            else:
                done = [(r, step, 1.0 if r == rest[3] else None) for r in rest]
                m.observe_steps("metrics", done, ts)
                m.observe_steps("begin", [(r, step + 1, None) for r in g], ts)
        if step > 3:  # (its first steps form the cohorts)
            spent += time.perf_counter() - t0
            n += len(groups)
    return spent / n


def hang_walk(groups: list) -> float:
    """Seconds of the hang check's full walk, every rank in its relay's cohort."""
    world = sum(len(g) for g in groups)
    m = HangMonitor(world, 0.0, HangConfig(floor_s=10.0))
    ts = _warm(m, world)
    for step in range(2, 8):
        ts += 1.0
        for g in groups:
            m.observe_steps("metrics", [(g[0], step, 1.0)], ts)
            m.observe_ranks("metrics", g[1:], step, ts, None)
            m.observe_ranks("begin", g, step + 1, ts)
    m.check(ts + 0.1)  # (the stale heap entries of the start popped)
    m._check_memo = {}
    t0 = time.perf_counter()
    m._check(ts + 0.1)
    return time.perf_counter() - t0


def shared_step(groups: list, steps: int) -> float:
    """Seconds a relay-step of ``MonitorFeed.repeat_summary`` (all shared monitors), steady."""
    feed = MonitorFeed(build(None, "cohort_bench"))
    names = frozenset(
        ["tokens_per_s"] + [k for k in scale_load._TITAN_KEYS if k not in scale_load._GLOBAL]
    )
    spent, n = 0.0, 0
    for step in range(1, 1 + steps):
        for g in groups:
            lead = scale_load._metrics_msg(g[0], 1, step, 1.0, 0.0, 0)["rec"]
            feed.feed(lead)
            t0 = time.perf_counter()
            _, errors = feed.repeat_summary(lead, g[1:], names)
            if step > 3:
                spent += time.perf_counter() - t0
                n += 1
            assert not errors, errors
    return spent / n


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--groups", type=int, default=256, help="relays (groups of ranks)")
    ap.add_argument("--per", type=int, default=512, help="ranks a relay")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()
    few = [list(range(g * args.per, (g + 1) * args.per)) for g in range(8)]
    every = [list(range(g * args.per, (g + 1) * args.per)) for g in range(args.groups)]
    out: dict = {"per": args.per}
    print(f"hang monitor, {len(few)} groups of {args.per}:", file=sys.stderr)
    before = hang_step(few, args.steps, cohorts=False)
    after = hang_step(few, args.steps, cohorts=True)
    out["hang_relay_step_us"] = {"per_rank": round(before * 1e6), "cohorts": round(after * 1e6)}
    out["hang_ratio"] = round(before / after, 1)
    print(f"  a relay-step {before * 1e6:.0f} us rank by rank, {after * 1e6:.0f} us as a cohort "
          f"({out['hang_ratio']}x)", file=sys.stderr)  # fmt: skip
    shared = shared_step(few, args.steps)
    out["shared_relay_step_us"] = round(shared * 1e6, 1)
    print(f"shared monitors: a relay-step {shared * 1e6:.1f} us", file=sys.stderr)
    walk = hang_walk(every)
    out["hang_walk_s"] = {"ranks": args.groups * args.per, "s": round(walk, 3)}
    print(f"hang check's walk, {args.groups * args.per} ranks: {walk:.3f} s", file=sys.stderr)
    print(json.dumps(out))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
