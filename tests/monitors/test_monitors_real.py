"""Monitors over traces recorded from real tiny runs (tests/data/traces/*-s<seed>.jsonl): healthy
runs are silent.

The traces are the real runs' metrics.jsonl trimmed to the keys the monitors read
(tests/data/traces/record.py says how they were made). A ``slow`` test records a
fresh one and diagnoses it end to end.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from conftest import TESTS

from ptops.monitors import build_monitors, replay

TRACES = TESTS / "data" / "traces"
RECORDED = sorted(TRACES.glob("*-s*.jsonl"))


def _load(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_recorded_traces_exist_with_five_seeds():
    by_recipe: dict[str, set[str]] = {}
    for p in RECORDED:
        m = re.match(r"(.+)-s(\d+)\.jsonl$", p.name)
        assert m, p.name
        by_recipe.setdefault(m.group(1), set()).add(m.group(2))
    assert by_recipe, "no recorded traces"
    assert {"trl-grpo-tiny", "trl-sft-tiny"} <= set(by_recipe)
    for recipe, seeds in by_recipe.items():
        assert len(seeds) >= 4, (recipe, seeds)


@pytest.mark.parametrize("path", RECORDED, ids=[p.stem for p in RECORDED])
def test_recorded_healthy_run_has_no_findings(path):
    recs = _load(path)
    assert {r["rank"] for r in recs} == {0, 1}
    findings = replay(recs, build_monitors())
    assert findings == [], [f.to_dict() for f in findings]


@pytest.mark.parametrize("path", RECORDED, ids=[p.stem for p in RECORDED])
def test_recorded_run_with_injected_nan_is_caught(path):
    """The same real trace with the loss poisoned on every rank at its 3/4 step: found at that
    step."""
    recs = _load(path)
    last = max(r["step"] for r in recs)
    bad = (3 * last) // 4
    poisoned = [dict(r, loss="nan") if r["step"] == bad else r for r in recs]
    f = [x for x in replay(poisoned, build_monitors()) if x.monitor == "nan"]
    assert [x.step for x in f] == [bad]


@pytest.mark.slow
def test_real_tiny_run_diagnoses_clean(tmp_path, ptops):
    run = tmp_path / "run"
    ptops(
        "launch",
        "trl-sft-tiny",
        "--run-dir",
        str(run),
        "--set",
        "train.steps=15",
        check=True,
        timeout=600,
    )
    from ptops.diagnostics.diagnose import diagnose

    rep = diagnose(run)
    assert (
        rep["last_step"] == 15
        and rep["findings"] == []
        and rep["events_summary"]["state"] == "completed"
    )
