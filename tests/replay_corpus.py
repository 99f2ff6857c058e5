"""The monitors' replay corpus: recorded runs, every synthetic fault, rewound (restart/rollback)
and garbled streams. Read by the replay-equality tests (``test_monitors_replay``,
``test_monitors_fast``)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import synth  # tests/data/traces (pytest's pythonpath)

DATA = Path(__file__).parent / "data"
TRACES = DATA / "traces"


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
        for base in (
            synth.generate("loss_spike", seed=seed),
            synth.grpo(200, seed, ranks=2, inject="entropy_collapse"),
            synth.pretrain(200, seed, ranks=3, inject="straggler_wait"),
            synth.grpo(200, seed, ranks=2, inject="reward_hacking"),
            synth.grpo(200, seed, ranks=2, inject="kl_drift"),
            synth.grpo(200, seed, ranks=2, inject="mode_collapse"),
        ):
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
