"""Replay equality: the monitors' findings on recorded runs and synthetic traces equal the stored ones.

Why: the monitors' hot paths are tuned for speed (issue 12: <= 10 us per record); a faster
monitor must say exactly what the old one said. ``tests/data/monitors_golden.json`` holds the
findings of the monitors as they were before that work (every field, texts included) on the
recorded runs' metrics.jsonl (tests/data/obs-*, tests/data/traces/*.jsonl), on every synthetic
fault, and on rewound (restart/rollback) and garbled copies. Regenerate it only for an intended
change of findings: ``PTOPS_WRITE_GOLDEN=1 pytest tests/test_monitors_replay.py``.
"""

from __future__ import annotations

import json
import os
import random
import sys
from pathlib import Path

import pytest

from ptops.monitors import build_monitors, replay

DATA = Path(__file__).parent / "data"
TRACES = DATA / "traces"
GOLDEN = DATA / "monitors_golden.json"
sys.path.insert(0, str(TRACES))
import synth  # noqa: E402


def _read(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def corpus() -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for p in sorted(TRACES.glob("*.jsonl")):
        out[p.name] = _read(p)
    for d in ("obs-grpo", "obs-titan"):
        out[d] = _read(DATA / d / "metrics.jsonl")
    for seed in range(3):
        for f in (None,) + synth.PRETRAIN_FAULTS + synth.RL_FAULTS:
            out[f"synth-{f}-{seed}"] = synth.generate(f, seed=seed)
        out[f"pre8-{seed}"] = synth.pretrain(300, seed, ranks=8, with_busy=True, with_data=True)
        out[f"grpo8-{seed}"] = synth.grpo(300, seed, ranks=8)
    rng = random.Random(7)
    for seed in range(3):
        for base in (synth.generate("loss_spike", seed=seed), synth.grpo(200, seed, ranks=2, inject="entropy_collapse"),
                     synth.pretrain(200, seed, ranks=3, inject="straggler_wait"),
                     synth.grpo(200, seed, ranks=2, inject="reward_hacking"),
                     synth.grpo(200, seed, ranks=2, inject="kl_drift"), synth.grpo(200, seed, ranks=2, inject="mode_collapse")):
            a, b = sorted(rng.sample(range(len(base)), 2))
            rewound = base[:b] + [dict(r, attempt=2) for r in base[a:]]  # a restart redoes steps
            out[f"rewind-{seed}-{len(out)}"] = rewound
            odd = []
            for r in rewound:
                r = dict(r)
                x = rng.random()
                if x < 0.03:
                    r["loss"] = rng.choice(["nan", "inf", None, "-inf", "junk", True])
                elif x < 0.06:
                    r["grad_norm"] = rng.choice(["nan", None, "1e5", 1e5, "x"])
                elif x < 0.08:
                    r["step"] = rng.choice([None, "3", "x"])
                elif x < 0.10:
                    r["rank"] = rng.choice([None, "1", "x", 5])
                elif x < 0.12:
                    r.pop("step_s", None)
                elif x < 0.13:
                    r["world_size"] = 4
                elif x < 0.15:
                    r["entropy"] = rng.choice(["nan", None, 0.0, -1.0])
                elif x < 0.16:
                    r["kl"] = "5.0"
                odd.append(r)
            out[f"odd-{seed}-{len(out)}"] = odd
    return out


def findings(recs: list[dict], flush: bool) -> list[dict]:
    return json.loads(json.dumps([f.to_dict() for f in replay(recs, build_monitors(), flush=flush)]))


def test_findings_equal_the_stored_ones():
    got = {}
    for name, recs in corpus().items():
        got[name] = findings(recs, True)
        got[name + "#live"] = findings(recs, False)
    if os.environ.get("PTOPS_WRITE_GOLDEN"):
        GOLDEN.write_text(json.dumps(got, sort_keys=True, indent=0) + "\n")
        pytest.fail("golden written; rerun without PTOPS_WRITE_GOLDEN")
    want = json.loads(GOLDEN.read_text())
    assert sorted(got) == sorted(want)
    assert sum(len(v) for v in want.values()) > 300  # the corpus does find things: equality is not vacuous
    for name in want:
        assert got[name] == want[name], name
