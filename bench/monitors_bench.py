"""Monitor cost, false-positive rate and detection delay.

    .venv/bin/python bench/monitors_bench.py [--seeds 20] [--ranks 8] [--steps 2000] [--reps 3] \\
        [--json]
    .venv/bin/python bench/monitors_bench.py --against f13977c   # cost now vs a git ref, same run
    # the same, the pre-2026-11-30 stream
    .venv/bin/python bench/monitors_bench.py --against f13977c --runs 4

1. cost: microseconds per record for each monitor alone and for the default
   set together, through the supervisor's live path (``MonitorFeed.feed``, error
   handling included; ``--against REF``: that ref's monitors through that ref's
   ``MonitorFeed``), feeding synthetic healthy records (pre-training and GRPO keys)
   of ``--ranks`` ranks for ``--steps`` steps (the supervisor pays this per
   record per rank); the ranks belong to one run (``--runs 1``: they report the
   same global loss, reward, ..., as a real run's ranks do) or to several;
2. false positives: findings on healthy traces - synthetic (``--seeds`` seeds
   x 3 kinds x 200 steps x 2 ranks) and the traces recorded from real tiny runs
   in tests/data/traces/ (``*-s<seed>.jsonl``);
3. detection delay: steps from a fault's first step to the first finding of the
   monitor that should catch it, over ``--seeds`` seeds per fault (synthetic,
   fault at step 100), plus the rate at which it is caught at all.

Pure Python, no torch; runs anywhere in a few seconds to a minute.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TRACES = REPO / "tests" / "data" / "traces"
sys.path.insert(0, str(TRACES))

import synth  # noqa: E402

from ptops.monitors import MONITOR_CLASSES, build_monitors, replay  # noqa: E402
from ptops.ops.supervisor.monitorfeed import MonitorFeed  # noqa: E402 - the live path, what the bench measures


def cost(
    ranks: int, steps: int, reps: int = 3, pkg=None, runs_in_stream: int = 1
) -> dict[str, float]:
    """Median over ``reps`` passes of each figure (the box is shared: one pass is noisy). ``pkg``:
    another copy of the monitors package to measure (``--against``), else ptops.monitors."""
    runs = [_cost_once(ranks, steps, pkg, runs_in_stream) for _ in range(reps)]
    return {k: statistics.median(r[k] for r in runs) for k in runs[0]}


def monitors_at(ref: str):
    """The monitors package as it was at git ``ref``, imported under another name (pure: no ptops
    imports)."""
    import importlib
    import subprocess
    import tempfile

    root = Path(tempfile.mkdtemp(prefix="ptops-monitors-"))
    dest = root / "monitors_at_ref"
    dest.mkdir()
    names = subprocess.run(
        ["git", "ls-tree", "--name-only", f"{ref}:monitors"],
        cwd=REPO,
        check=True,
        capture_output=True,
        text=True,
    ).stdout.split()
    for n in names:
        if n.endswith(".py"):
            text = subprocess.run(
                ["git", "show", f"{ref}:monitors/{n}"],
                cwd=REPO,
                check=True,
                capture_output=True,
                text=True,
            ).stdout
            (dest / n).write_text(text)
    sys.path.insert(0, str(root))
    return importlib.import_module("monitors_at_ref")


def live_feed_at(ref: str, pkg):
    """The supervisor's ``MonitorFeed`` class as it was at git ``ref``, fed ``pkg`` (that ref's
    monitors): the loop the supervisor ran then (its error handling; at f13977c one ``m.feed(rec)``
    per monitor)."""
    import subprocess
    import types

    text = subprocess.run(
        ["git", "show", f"{ref}:ops/supervisor/monitorfeed.py"],
        cwd=REPO,
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    mod = types.ModuleType(f"monitorfeed_at_{ref}")
    sys.modules[mod.__name__] = mod  # (dataclasses looks its module up)
    exec(
        compile(
            text.replace("ptops.monitors", pkg.__name__),
            f"{ref}:ops/supervisor/monitorfeed.py",
            "exec",
        ),
        mod.__dict__,
    )
    return mod.MonitorFeed


def _as_batched(stream: list[dict], per_node: int) -> tuple[list[dict], list]:
    """The records as the supervisor handles them from node agents of ``per_node`` ranks (each
    node's records of a step through the agent's own ``Batcher``, one frame, rebuilt by
    ``unbatch``), and each one's certificate (``like``: None for a node's first of the step)."""
    from ptops.ops.rank.channel import Batcher, unbatch

    out: list[dict] = []
    likes: list = []
    by_step: dict = {}
    for r in stream:
        by_step.setdefault(r["step"], []).append(r)
    for step in sorted(by_step):
        nodes: dict[int, Batcher] = {}
        for r in by_step[step]:
            b = nodes.setdefault(r["rank"] // per_node, Batcher())
            b.add(r["rank"] % per_node + 1, json.dumps({"t": "metrics", "rec": r}).encode(), 0.0)
        for node in sorted(nodes):
            got: list = []
            for _, msg in unbatch(json.loads(nodes[node].frame()), got):
                out.append(msg["rec"])
            likes.extend(got)
    return out, likes


def _cost_once(
    ranks: int, steps: int, pkg=None, runs: int = 1, feed_cls=None, per_node: int = 0
) -> dict[str, float]:
    """``runs`` runs of ``ranks // runs`` ranks each, ranks numbered on, records ordered by (step,
    rank). One run (default) is what the supervisor sees: the global values (loss, reward, ...)
    agree across its ranks; ``runs = ranks // 2`` is the stream this bench fed before 2026-11-30
    (four 2-rank runs as one 8-rank job). Every figure is the live path:
    ``MonitorFeed(monitors).feed(record)`` (``feed_cls``: another ref's), with one monitor (each
    alone) or all of them (``ALL``)."""
    classes = pkg.MONITOR_CLASSES if pkg is not None else MONITOR_CLASSES
    build = pkg.build_monitors if pkg is not None else build_monitors
    feed_cls = feed_cls or MonitorFeed
    per = ranks // runs
    recs = []
    for kind in ("pretrain", "grpo"):
        for seed in range(runs):
            gen = (
                synth.pretrain(steps, seed, ranks=per, with_busy=True, with_data=True)
                if kind == "pretrain"
                else synth.grpo(steps, seed, ranks=per)
            )
            for r in gen:
                r = dict(r)
                r["rank"] = r["rank"] + per * seed
                recs.append((r["step"], r["rank"], kind, r))
    out: dict[str, float] = {}
    for kind in ("pretrain", "grpo"):
        stream = [r for s, rk, k, r in sorted(recs, key=lambda x: (x[0], x[1])) if k == kind]
        likes = [None] * len(stream)
        if per_node:
            stream, certs = _as_batched(stream, per_node)
            if feed_cls is MonitorFeed:  # (another ref's feed takes no certificate)
                likes = certs
        pairs = list(zip(stream, likes))
        for name, cls in classes.items():
            feed = feed_cls([cls()]).feed
            t0 = time.process_time()
            for r, like in pairs:
                feed(r) if like is None else feed(r, like)
            out[f"{kind}/{name}"] = (time.process_time() - t0) / len(stream) * 1e6
        live = feed_cls(build())
        feed = live.feed
        t0 = time.process_time()
        for r, like in pairs:
            feed(r) if like is None else feed(r, like)
        out[f"{kind}/ALL"] = (time.process_time() - t0) / len(stream) * 1e6
        assert not live.errors, (
            live.errors
        )  # a monitor that raised would make the figure meaningless
        if per_node and feed_cls is MonitorFeed:  # a node's step group a call (the supervisor's)
            groups = _step_groups(pairs)
            live = feed_cls(build())
            feed_group = live.feed_group
            t0 = time.process_time()
            for recs_, likes_ in groups:
                feed_group(recs_, likes_)
            out[f"{kind}/ALL-groups"] = (time.process_time() - t0) / len(stream) * 1e6
            assert not live.errors, live.errors
    return out


def _step_groups(pairs: list) -> list[tuple[list, list]]:
    """(records, likes) as the supervisor groups a node's batch: a record whole, then those
    certified against its rank (``ops/supervisor/messages.py::_group_end``); the rest alone."""
    out: list[tuple[list, list]] = []
    for r, like in pairs:
        last = out[-1] if out else None
        if like is not None and last and last[1][0] is None and like[0] == last[0][0].get("rank"):
            last[0].append(r)
            last[1].append(like)
        else:
            out.append(([r], [like]))
    return out


def per_state(ranks: int, steps: int, reps: int = 5) -> dict[str, dict[str, float]]:
    """Each monitor alone on one run of ``ranks`` ranks vs on rank 0's records only (the full work
    of one state per step): what a further rank pays to follow the state the ranks share, best of
    ``reps``."""
    out: dict[str, dict[str, float]] = {}
    for kind in ("pretrain", "grpo"):
        recs = (
            synth.pretrain(steps, 0, ranks=ranks, with_busy=True, with_data=True)
            if kind == "pretrain"
            else synth.grpo(steps, 0, ranks=ranks)
        )
        one = [r for r in recs if r["rank"] == 0]
        for name, cls in MONITOR_CLASSES.items():

            def t(stream: list) -> float:
                best = math.inf
                for _ in range(reps):
                    m = cls()
                    t0 = time.process_time()
                    for r in stream:
                        m.feed(r)
                    best = min(best, (time.process_time() - t0) / len(stream) * 1e6)
                return best

            a, b = t(one), t(recs)
            out[f"{kind}/{name}"] = {
                "one_state": round(a, 3),
                "all_ranks": round(b, 3),
                "each_further_rank": round((b * ranks - a) / (ranks - 1), 3),
            }
    return out


def false_positives(seeds: int) -> dict[str, object]:
    synthetic = {"runs": 0, "steps": 0, "findings": 0, "runs_with_findings": 0, "by_monitor": {}}
    for seed in range(seeds):
        for recs in (
            synth.pretrain(seed=seed),
            synth.pretrain(seed=seed, with_busy=True, with_data=True),
            synth.grpo(seed=seed),
        ):
            f = replay(recs, build_monitors())
            synthetic["runs"] += 1
            synthetic["steps"] += max(r["step"] for r in recs)
            synthetic["findings"] += len(f)
            synthetic["runs_with_findings"] += bool(f)
            for x in f:
                synthetic["by_monitor"][x.monitor] = synthetic["by_monitor"].get(x.monitor, 0) + 1
    recorded = {
        "runs": 0,
        "steps": 0,
        "findings": 0,
        "runs_with_findings": 0,
        "by_monitor": {},
        "files": [],
    }
    for path in sorted(TRACES.glob("*-s*.jsonl")):
        recs = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        f = replay(recs, build_monitors())
        recorded["runs"] += 1
        recorded["files"].append(path.name)
        recorded["steps"] += max(r["step"] for r in recs)
        recorded["findings"] += len(f)
        recorded["runs_with_findings"] += bool(f)
        for x in f:
            recorded["by_monitor"][x.monitor] = recorded["by_monitor"].get(x.monitor, 0) + 1
    return {"synthetic": synthetic, "recorded": recorded}


def detection(seeds: int, at: int = 100) -> dict[str, dict[str, object]]:
    out: dict[str, dict[str, object]] = {}
    for fault in synth.PRETRAIN_FAULTS + synth.RL_FAULTS:
        mon = synth.FAULT_MONITOR[fault]
        delays: list[int] = []
        early = 0
        for seed in range(seeds):
            f = [
                x
                for x in replay(synth.generate(fault, seed=seed, at=at), build_monitors())
                if x.monitor == mon
            ]
            early += any(x.step < at for x in f)
            hit = [x.step - at for x in f if x.step >= at]
            if hit:
                delays.append(hit[0])
        out[fault] = {
            "monitor": mon,
            "detected": f"{len(delays)}/{seeds}",
            "fired_before_fault": early,
            "delay_min": min(delays, default=None),
            "delay_median": statistics.median(delays) if delays else None,
            "delay_max": max(delays, default=None),
        }
    return out


def _was(key: str) -> str:
    """The old ref's figure a new one compares with (step groups: its records one by one)."""
    return key.replace("/ALL-groups", "/ALL")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=20)
    ap.add_argument("--ranks", type=int, default=8)
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument(
        "--reps", type=int, default=3, help="passes per cost figure; the median is reported"
    )
    ap.add_argument(
        "--runs",
        type=int,
        default=1,
        help="cost: the ranks' records come from this many runs (1: one "
        "run, whose ranks report the same global values, as the supervisor sees; ranks/2: the "
        "stream "
        "measured before 2026-11-30, four 2-rank runs fed as one)",
    )
    ap.add_argument(
        "--against",
        metavar="GIT_REF",
        help="also measure the monitors as they were at this git ref, "
        "in the same run (interleaved passes), and print new/old ratios",
    )
    ap.add_argument(
        "--per-node",
        type=int,
        default=0,
        help="--against: the records as node agents of this many ranks batch them (Batcher, "
        "unbatch), each with its certificate for this ref's MonitorFeed (0: plain records)",
    )
    ap.add_argument("--cost-only", action="store_true")
    ap.add_argument(
        "--per-state",
        action="store_true",
        help="each monitor on one run vs on rank 0's records only: "
        "one state's work per step and what each further rank pays to follow it (with --out: "
        "added)",
    )
    ap.add_argument(
        "--out",
        metavar="FILE",
        help="--against: also write the figures, with the date, the load average "
        "and the command, to this JSON file (bench/results/monitors_bench.json)",
    )
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    if a.per_state:
        res_p = per_state(a.ranks, a.steps if a.steps != 2000 else 600)
        print(
            f"us per record, one run of {a.ranks} ranks: one state (rank 0 only) / all ranks / "
            "each further rank"
        )
        for k, v in res_p.items():
            print(
                f"  {k:32s} {v['one_state']:7.2f} {v['all_ranks']:7.2f} "
                f"{v['each_further_rank']:7.2f}"
            )
        if a.out:
            import os

            path = Path(a.out)
            runs_all = json.loads(path.read_text()) if path.exists() else {}
            runs_all["per_state"] = {
                "meta": {
                    "command": "bench/monitors_bench.py " + " ".join(sys.argv[1:]),
                    "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                    "load_average_1_5_15": [round(x, 2) for x in os.getloadavg()],
                },
                **res_p,
            }
            path.write_text(json.dumps(runs_all, indent=2) + "\n")
        return
    if a.against:
        old_pkg = monitors_at(a.against)
        old_feed = live_feed_at(a.against, old_pkg)
        new_runs, old_runs = [], []
        for _ in range(a.reps):  # interleaved: both see the same load
            new_runs.append(_cost_once(a.ranks, a.steps, runs=a.runs, per_node=a.per_node))
            old_runs.append(
                _cost_once(
                    a.ranks, a.steps, old_pkg, runs=a.runs, feed_cls=old_feed, per_node=a.per_node
                )
            )
        new = {k: statistics.median(r[k] for r in new_runs) for k in new_runs[0]}
        old = {k: statistics.median(r[k] for r in old_runs) for k in old_runs[0]}
        res_c = {
            "now": new,
            a.against: old,
            "ratio_now_over_old": {k: round(new[k] / old[_was(k)], 3) for k in new},
        }
        if a.out:
            import os

            meta = {
                "command": "bench/monitors_bench.py " + " ".join(sys.argv[1:]),
                "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                "load_average_1_5_15": [round(x, 2) for x in os.getloadavg()],
                "ranks": a.ranks,
                "runs": a.runs,
                "steps": a.steps,
                "reps": a.reps,
                "unit": "us per record, process CPU time, median of interleaved passes",
            }
            path = Path(a.out)
            runs_all = json.loads(path.read_text()) if path.exists() else {}
            key = (
                f"runs={a.runs}" if a.against == "f13977c" else f"runs={a.runs},against={a.against}"
            )
            runs_all[key] = {"meta": meta, **res_c}
            path.write_text(json.dumps(runs_all, indent=2) + "\n")
        if a.json:
            print(json.dumps(res_c, indent=2))
        else:
            print(
                f"cost (us per record, {a.ranks} ranks of {a.runs} run(s) x {a.steps} steps, "
                f"median of {a.reps} "
                f"interleaved passes, process CPU time): now vs {a.against}"
            )
            for k in new:
                was = old[_was(k)]
                print(f"  {k:32s} {new[k]:8.2f} {was:8.2f}  x{new[k] / was:.2f}")
        return
    res = {"cost_us_per_record": cost(a.ranks, a.steps, a.reps, runs_in_stream=a.runs)}
    if a.cost_only:
        print(json.dumps(res, indent=2))
        return
    res.update({"false_positives": false_positives(a.seeds), "detection": detection(a.seeds)})
    if a.json:
        print(json.dumps(res, indent=2))
        return
    print(
        f"cost (us per record, {a.ranks} ranks x {a.steps} steps, median of {a.reps} passes, "
        "time.process_time, CPU time of this process):"
    )
    for k, v in res["cost_us_per_record"].items():
        print(f"  {k:32s} {v:8.2f}")
    for src, d in res["false_positives"].items():
        print(
            f"false positives, {src}: {d['findings']} findings in {d['runs']} healthy runs "
            f"({d['steps']} steps), runs with any finding: {d['runs_with_findings']}  "
            f"{d['by_monitor']}"
        )
    print(f"detection (fault at step 100, {a.seeds} seeds):")
    print(f"  {'fault':18s} {'monitor':17s} detected  early  delay min/median/max")
    for k, d in res["detection"].items():
        print(
            f"  {k:18s} {d['monitor']:17s} {d['detected']:>8s}  {d['fired_before_fault']:5d}  "
            f"{d['delay_min']}/{d['delay_median']}/{d['delay_max']}"
        )


if __name__ == "__main__":
    main()
