"""Every runbook name used anywhere has a file ``runbooks/<Name>.md``.

Names come from the alert rules (their ``runbook_url``), the monitor registry, the
event vocabulary, ``diagnose``'s mapping and its findings, and every tracked file
that links ``runbooks/<Name>.md``. A finding that points at a missing runbook is
an operator left alone at the worst moment (``StaleRollouts`` once did).
"""

from __future__ import annotations

import json
import re
import subprocess

import pytest
import synth  # tests/data/traces (pytest's pythonpath)
from conftest import REPO

from ptops.diagnostics.diagnose import RUNBOOKS as DIAGNOSE_RUNBOOKS
from ptops.diagnostics.diagnose import diagnose
from ptops.monitors import MONITORS, MonitorsSection
from ptops.ops.obs.alerts import rule_dicts
from ptops.ops.runrecord.events import SPECS

LINK = re.compile(r"runbooks/([A-Za-z][A-Za-z0-9_]*)\.md")


def _alert_runbooks() -> set[str]:
    out = set()
    for rule in rule_dicts():
        m = LINK.search(rule["annotations"]["runbook_url"])
        assert m, (
            f"alert {rule['alert']}: runbook_url {rule['annotations']['runbook_url']!r} names no "
            "runbook"
        )
        out.add(m.group(1))
    return out


def _linked_in_tracked_files() -> set[str]:
    files = subprocess.run(
        ["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True
    ).stdout.split()
    out = set()
    for name in files:
        p = REPO / name
        if (
            p.suffix not in (".py", ".md", ".yml", ".yaml", ".json", ".toml", ".sh")
            or not p.is_file()
        ):
            continue
        out |= set(LINK.findall(p.read_text(errors="replace")))
    return out


def _used_runbooks() -> dict[str, set[str]]:
    return {
        "alert rules": _alert_runbooks(),
        "monitor registry": {m.runbook for m in MONITORS.values()},
        "event vocabulary": {s.runbook for s in SPECS.values() if s.runbook},
        "diagnose": set(DIAGNOSE_RUNBOOKS.values()),
        "links in tracked files": _linked_in_tracked_files(),
    }


@pytest.mark.parametrize(
    "source",
    ["alert rules", "monitor registry", "event vocabulary", "diagnose", "links in tracked files"],
)
def test_every_runbook_used_has_a_file(source):
    names = _used_runbooks()[source]
    assert names, f"{source}: found no runbook names at all (the collector is broken)"
    missing = sorted(n for n in names if not (REPO / "runbooks" / f"{n}.md").is_file())
    assert not missing, (
        f"{source} names runbooks with no file: {', '.join(f'runbooks/{n}.md' for n in missing)}"
    )


def test_the_collectors_see_what_they_should():
    """Guards the test above: each source yields the names it is known to use."""
    used = _used_runbooks()
    assert {"TrainingHang", "GPUErrors", "CheckpointStale"} <= used["alert rules"]
    assert "StaleRollouts" in used["monitor registry"]
    assert {"TrainingHang", "CheckpointCorrupt"} <= used["event vocabulary"]
    fake = "runbooks/" + "Nope.md"  # split so that this file itself links no missing runbook
    assert LINK.findall(f"see {fake} and runbooks/<Name>.md") == ["Nope"]


def test_every_monitor_has_a_runbook_and_a_config_field():
    section_monitors = {
        k
        for k, f in MonitorsSection.model_fields.items()
        if hasattr(f.annotation, "model_fields") and "action" in f.annotation.model_fields
    }
    assert section_monitors == set(MONITORS), "monitors/registry.py and MonitorsSection disagree"
    for name, info in MONITORS.items():
        assert info.monitor.name == name
        assert isinstance(MonitorsSection().model_dump()[name], dict)
        assert (REPO / "runbooks" / f"{info.runbook}.md").is_file()


@pytest.mark.parametrize("fault", ["stale_rollout", "kl_drift", "nan"])
def test_findings_name_an_existing_runbook(tmp_path, fault):
    """The runbook a real finding carries (not only the maps) is a file."""
    run = tmp_path / "r"
    run.mkdir()
    recs = synth.generate(fault, seed=0, at=30)
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    rep = diagnose(run)
    monitor = synth.FAULT_MONITOR[fault]
    mine = [f for f in rep["findings"] if f["monitor"] == monitor]
    assert mine, f"{fault}: no {monitor} finding"
    for f in mine:
        assert f["runbook"], f"{monitor} finding without a runbook"
        assert (REPO / "runbooks" / f"{f['runbook']}.md").is_file(), (
            f"runbooks/{f['runbook']}.md is missing"
        )
