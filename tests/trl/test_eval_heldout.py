"""Held-out eval in the loop, without training: the ``[eval]`` schema, the held-out set, and the
reward-hacking monitor preferring ``eval/*`` records over the in-training verifier proxy."""

from __future__ import annotations

import math

import pytest

from ptops.monitors.config import RewardHackingConfig
from ptops.monitors.rl import RewardHackingMonitor
from ptops.recipes.schema import RecipeError, load


def _records(eval_trend: float | None, proxy_trend: float, steps: int = 60, every: int = 5):
    """Reward rising 0.1 -> 0.9 every step; the proxy ``rewards/verifier/mean`` on every step record
    with ``proxy_trend`` per step; ``eval/heldout`` (+ ``eval/heldout_exact``) on every ``every``-th
    step's record."""
    out = []
    for s in range(1, steps + 1):
        wobble = 0.01 * math.sin(s * 1.7)
        rec = {
            "step": s,
            "rank": 0,
            "reward": 0.1 + 0.8 * s / steps + wobble,
            "rewards/verifier/mean": 0.5 + proxy_trend * s + wobble,
        }
        if eval_trend is not None and s % every == 0:
            rec["eval/heldout"] = 0.8 + eval_trend * s + 0.5 * wobble
            rec["eval/heldout_exact"] = 0.0
        out.append(rec)
    return out


def _findings(records, cfg=None):
    mon = RewardHackingMonitor(cfg or RewardHackingConfig())
    found = [f for r in records for f in mon.feed(r)]
    return mon, found


def test_falling_heldout_eval_is_hacking_even_when_the_proxy_agrees_with_the_reward():
    mon, found = _findings(_records(eval_trend=-0.01, proxy_trend=+0.01))
    opened = [f for f in found if f.phase == "open"]
    assert opened, "a held-out eval falling while the reward rises must open an episode"
    assert any("eval/heldout" in f.detail for f in found), [f.detail for f in found]
    assert not any("rewards/verifier/mean" in f.detail for f in found)
    assert max(f.severity for f in found if f.phase != "resolved") in ("critical",)
    assert mon.heldout_source(0) == ("eval", "eval/heldout")


def test_a_rising_heldout_eval_overrides_a_falling_proxy():
    """The proxy alone says hacking; the held-out eval says the policy got better: no held-out
    finding."""
    _, proxy_only = _findings(_records(eval_trend=None, proxy_trend=-0.01))
    assert any("rewards/verifier/mean" in f.detail for f in proxy_only), (
        "the proxy rule itself must work"
    )
    mon, found = _findings(_records(eval_trend=+0.002, proxy_trend=-0.01))
    assert not [f for f in found if "held-out" in f.detail], [f.detail for f in found]
    assert mon.heldout_source(0)[0] == "eval"


def test_prefix_off_falls_back_to_the_proxy():
    cfg = RewardHackingConfig(heldout_prefix="")
    mon, found = _findings(_records(eval_trend=+0.002, proxy_trend=-0.01), cfg)
    assert mon.heldout_source(0)[0] == "proxy"
    assert any("rewards/verifier/mean" in f.detail for f in found)


def test_eval_section_schema():
    rec, _ = load("trl-grpo-tiny", ["eval.interval=5", "eval.name=math"])
    assert rec.eval.interval == 5 and rec.eval.name == "math"
    assert load("trl-sft-tiny")[0].eval.interval == 0  # off unless asked for
    with pytest.raises(
        RecipeError, match=r"key 'eval.interval': not supported by engine \"titan\""
    ):
        load("titan-tiny", ["eval.interval=5"])
    assert load("titan-tiny", ["train.init_from=/x"])[0].train.init_from == "/x"
    with pytest.raises(
        RecipeError, match=r"key 'train.init_from': not together with titan.initial_load_path"
    ):
        load("titan-tiny", ["train.init_from=/x", "titan.initial_load_path=/y"])
    with pytest.raises(RecipeError, match=r"eval.name"):
        load("trl-sft-tiny", ["eval.name=bad/name"])


def test_heldout_set_is_held_out():
    from ptops.recipes import assets
    from ptops.recipes.trl.evalloop import heldout_rows

    rec, _ = load("trl-grpo-tiny", ["eval.interval=5", "eval.size=24"])
    rows = heldout_rows(rec)
    assert len(rows) == 24
    trained = {
        q for seed in (1, 2, 3) for q, _ in assets.arithmetic_pairs(rec.trl.dataset_size, seed)
    }
    asked = [r["prompt"][0]["content"] for r in rows]
    assert not set(asked) & trained and len(set(asked)) == len(asked)


def test_eval_in_the_loop_leaves_training_and_exact_resume_unchanged(tmp_path):
    """Real SFT runs (4 steps): with a held-out eval every 2 steps, and with it plus a crash at step
    3 (supervised restart from step 2), the final checkpoint has the digest of a run without
    eval."""
    import os
    import subprocess
    import sys

    from ptops.ckpt import digest
    from ptops.ops.runrecord.rundir import read_jsonl

    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    base = ["train.steps=4", "checkpoint.interval=2"]

    def launch(name, extra, *flags):
        cmd = [
            sys.executable,
            "-m",
            "ptops",
            "launch",
            "trl-sft-tiny",
            "--run-dir",
            str(tmp_path / name),
            "--no-mlflow",
        ]
        for o in base + extra:
            cmd += ["--set", o]
        p = subprocess.run([*cmd, *flags], env=env, capture_output=True, text=True, timeout=600)
        assert p.returncode == 0, p.stderr[-3000:]
        return tmp_path / name

    plain = launch("plain", [])
    evald = launch("eval", ["eval.interval=2"])
    crashed = launch("crash", ["eval.interval=2"], "--supervise", "--fault", "crash:rank=0,step=3")
    recs = [r for r in read_jsonl(evald / "metrics.jsonl") if r["rank"] == 0]
    assert [r["step"] for r in recs if "eval/heldout" in r] == [2, 4]
    assert not any("eval/heldout" in r for r in read_jsonl(plain / "metrics.jsonl"))
    assert [e["kind"] for e in read_jsonl(crashed / "events.jsonl")].count("restart") == 1
    assert digest(evald) == digest(plain)
    assert digest(crashed) == digest(plain)


def test_eval_records_become_a_prometheus_gauge():
    from ptops.ops.obs.prometheus import PrometheusExporter

    e = PrometheusExporter("r", "t", nvml=False)
    e.observe_metric({"step": 1, "rank": 0, "loss": 1.0, "ts": 1.0})
    assert "ptops_eval_score" not in e.text()  # no eval, no family
    e.observe_metric(
        {
            "step": 2,
            "rank": 0,
            "loss": 1.0,
            "eval/heldout": 0.25,
            "eval/heldout_exact": 0.0,
            "ts": 2.0,
        }
    )
    e.observe_metric(
        {"step": 2, "rank": 1, "loss": 1.0, "eval/heldout": 0.9, "ts": 2.0}
    )  # rank 0's counts
    text = e.text()
    assert 'ptops_eval_score{name="heldout",recipe="t",run="r"} 0.25' in text, text
    assert 'ptops_eval_score{name="heldout_exact",recipe="t",run="r"} 0.0' in text
