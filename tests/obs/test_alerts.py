"""Alert rules: the shipped file is what ``ptops alerts`` renders, promtool accepts it, and
``promtool test rules`` proves every alert fires when it should and stays quiet otherwise.

The promtool unit tests live in ``ops/obs/alerts/tests/ptops-rules.test.yml``; they are
generated from CASES below (expected annotations are rendered from the rule's own
templates). Regenerate after changing a rule or a case:

    PTOPS_REGEN=1 .venv/bin/python -m pytest tests/obs/test_alerts.py
"""

from __future__ import annotations

import os
import re
import subprocess

import pytest
import yaml
from conftest import REPO

from ptops.ops.obs.alerts import ALERT_NAMES, ALERTS, RULES_FILE, render_rules, rule_dicts

UNIT_TEST_DIR = REPO / "ops" / "obs" / "alerts" / "tests"
# promtool evaluates every rule at the file's evaluation_interval: short `for:` alerts need 10s,
# the hour-long RL/goodput windows run in their own file at 1m so the suite stays fast.
UNIT_TEST_FILES = {"ptops-rules.test.yml": "10s", "ptops-rules-long.test.yml": "1m"}
REGEN = os.environ.get("PTOPS_REGEN") == "1"

L = 'run="r",recipe="t"'
ACTIVE_STATES = "running starting restarting rolling_back hung crashed".split()


def state(name: str, values: str) -> dict:
    return {"series": f'ptops_run_state{{{L},state="{name}"}}', "values": values}


def s(metric: str, values: str, extra: str = "") -> dict:
    labels = L + ("," + extra if extra else "")
    return {"series": f"{metric}{{{labels}}}", "values": values}


# alert -> list of (case name, interval, input series, eval time, expected [(extra labels, $value
# string)])
CASES: dict[str, list[tuple]] = {
    "TrainingHang": [
        ("hung state", "10s", [state("hung", "0 0 1 1 1 1 1")], "50s", [({}, "1")]),
        (
            "recent hang event",
            "10s",
            [s("ptops_last_event_timestamp_seconds", "0x20", 'kind="hang"')],
            "60s",
            [({}, "60")],
        ),
        (
            "old hang event, running",
            "10s",
            [
                s("ptops_last_event_timestamp_seconds", "0x200", 'kind="hang"'),
                state("hung", "0x200"),
                state("running", "1x200"),
            ],
            "20m",
            [],
        ),
    ],
    "TrainingCrashLoop": [
        (
            "3 restarts in 30m",
            "10s",
            [s("ptops_attempt", "1 1 2 2 3 3 4 4 4 4 4 4 4 4")],
            "130s",
            [({}, "3")],
        ),
        (
            "one restart",
            "10s",
            [
                s("ptops_attempt", "1 1 2 2 2 2 2 2 2 2 2 2 2 2"),
                s("ptops_crashes_total", "0 0 1 1 1 1 1 1 1 1 1 1 1 1"),
            ],
            "130s",
            [],
        ),
    ],
    "TrainingStalled": [
        (
            "no step for 13 minutes",
            "10s",
            [s("ptops_last_progress_timestamp_seconds", "0x100"), state("running", "1x100")],
            "800s",
            [({}, "13m 20s")],
        ),
        (
            "finished run",
            "10s",
            [
                s("ptops_last_progress_timestamp_seconds", "0x100"),
                state("running", "0x100"),
                state("completed", "1x100"),
            ],
            "800s",
            [],
        ),
        (
            "steps keep coming",
            "10s",
            [s("ptops_last_progress_timestamp_seconds", "0+10x100"), state("running", "1x100")],
            "800s",
            [],
        ),
    ],
    "CheckpointStale": [
        (
            "old checkpoint while running",
            "10s",
            [s("ptops_checkpoint_age_seconds", "4000x100"), state("running", "1x100")],
            "400s",
            [({}, "1h 6m 40s")],
        ),
        (
            "fresh checkpoint",
            "10s",
            [s("ptops_checkpoint_age_seconds", "100x100"), state("running", "1x100")],
            "400s",
            [],
        ),
    ],
    "CheckpointSaveFailing": [
        (
            "failed save",
            "10s",
            [s("ptops_last_event_timestamp_seconds", "0x20", 'kind="checkpoint_failed"')],
            "60s",
            [({}, "60")],
        ),
        (
            "failure long ago",
            "10s",
            [s("ptops_last_event_timestamp_seconds", "0x200", 'kind="checkpoint_failed"')],
            "1900s",
            [],
        ),
    ],
    "CheckpointCorrupt": [
        (
            "invalid checkpoint",
            "10s",
            [s("ptops_last_event_timestamp_seconds", "0x20", 'kind="checkpoint_invalid"')],
            "30s",
            [({}, "30")],
        ),
        (
            "other events only",
            "10s",
            [s("ptops_last_event_timestamp_seconds", "0x20", 'kind="checkpoint"')],
            "30s",
            [],
        ),
    ],
    "StragglerRank": [
        (
            "rank 1 at 2.5x",
            "10s",
            [s("ptops_straggler_ratio", "2.5x20", 'rank="1"')],
            "90s",
            [({"rank": "1"}, "2.50")],
        ),
        ("rank 1 at 1.1x", "10s", [s("ptops_straggler_ratio", "1.1x20", 'rank="1"')], "90s", []),
    ],
    "TrainingNaN": [
        (
            "nonfinite loss",
            "10s",
            [s("ptops_last_nonfinite_timestamp_seconds", "50x20")],
            "100s",
            [({}, "50")],
        ),
        (
            "nan monitor",
            "10s",
            [s("ptops_anomaly_last_timestamp_seconds", "0x20", 'monitor="nan"')],
            "100s",
            [({}, "100")],
        ),
        (
            "long ago, other monitors",
            "10s",
            [
                s("ptops_last_nonfinite_timestamp_seconds", "0x120"),
                s("ptops_anomaly_last_timestamp_seconds", "990x120", 'monitor="kl_drift"'),
            ],
            "1000s",
            [],
        ),
    ],
    "LossSpike": [
        (
            "loss_spike monitor",
            "10s",
            [s("ptops_anomaly_last_timestamp_seconds", "0x20", 'monitor="loss_spike"')],
            "60s",
            [({}, "60")],
        ),
        ("loss 5x its median", "10s", [s("ptops_loss", "2x9 10x5")], "140s", [({}, "10")]),
        ("flat loss", "10s", [s("ptops_loss", "2x15")], "140s", []),
        ("GRPO loss near zero", "10s", [s("ptops_loss", "0.001x9 0.01x5")], "140s", []),
    ],
    "SilentDataCorruption": [
        (
            "sdc monitor",
            "10s",
            [s("ptops_anomaly_last_timestamp_seconds", "0x20", 'monitor="sdc"')],
            "60s",
            [({}, "60")],
        ),
        (
            "other monitors only",
            "10s",
            [s("ptops_anomaly_last_timestamp_seconds", "0x20", 'monitor="nan"')],
            "60s",
            [],
        ),
    ],
    "EntropyCollapse": [
        (
            "entropy to 5% of max",
            "1m",
            [s("ptops_rl_entropy", "1 1 1 0.05x10")],
            "10m",
            [({}, "0.05")],
        ),
        ("entropy slowly lower", "1m", [s("ptops_rl_entropy", "1 0.9x12")], "10m", []),
        # one finding per episode: the alert holds while the episode is open, and ends with its
        # all-clear
        (
            "episode open long after its finding",
            "1m",
            [
                s("ptops_anomaly_last_timestamp_seconds", "0x30", 'monitor="entropy_collapse"'),
                s("ptops_finding_episode_open", "1x30", 'monitor="entropy_collapse"'),
            ],
            "25m",
            [({}, "1")],
        ),
        (
            "episode closed by its all-clear",
            "1m",
            [
                s("ptops_anomaly_last_timestamp_seconds", "0x30", 'monitor="entropy_collapse"'),
                s("ptops_finding_episode_open", "1x5 0x25", 'monitor="entropy_collapse"'),
            ],
            "25m",
            [],
        ),
    ],
    "KLDrift": [
        ("kl 2", "1m", [s("ptops_rl_kl", "0.1 0.1 2x10")], "10m", [({}, "2")]),
        ("kl 0.1", "1m", [s("ptops_rl_kl", "0.1x12")], "10m", []),
        (
            "kl_drift monitor",
            "1m",
            [
                s("ptops_rl_kl", "0.1x12"),
                s("ptops_anomaly_last_timestamp_seconds", "300x12", 'monitor="kl_drift"'),
            ],
            "10m",
            [({}, "300")],
        ),
    ],
    "RewardHacking": [
        (
            "reward up, kl up, spread gone",
            "1m",
            [
                s("ptops_rl_reward", "0+0.1x30"),
                s("ptops_rl_kl", "0+0.01x30"),
                s("ptops_rl_reward_std", "0.01x30"),
            ],
            "25m",
            [({}, "0.1")],
        ),
        (
            "healthy spread",
            "1m",
            [
                s("ptops_rl_reward", "0+0.1x30"),
                s("ptops_rl_kl", "0+0.01x30"),
                s("ptops_rl_reward_std", "0.5x30"),
            ],
            "25m",
            [],
        ),
        (
            "reward_hacking episode open",
            "1m",
            [
                s("ptops_anomaly_last_timestamp_seconds", "0x60", 'monitor="reward_hacking"'),
                s("ptops_finding_episode_open", "1x60", 'monitor="reward_hacking"'),
            ],
            "50m",
            [({}, "1")],
        ),
    ],
    "SupervisorBehind": [
        (
            "behind for 3 minutes while running",
            "10s",
            [s("ptops_supervisor_behind", "0 0 1x30"), state("running", "1x32")],
            "4m",
            [({}, "1")],
        ),
        (
            "caught up after a minute",
            "10s",
            [s("ptops_supervisor_behind", "0 0 1x6 0x24"), state("running", "1x32")],
            "4m",
            [],
        ),
        (
            "the run ended while behind",
            "10s",
            [
                s("ptops_supervisor_behind", "1x32"),
                state("running", "1x6 0x26"),
                state("completed", "0x6 1x26"),
            ],
            "4m",
            [],
        ),
    ],
    "GoodputLow": [
        (
            "25% for 2h while running",
            "5m",
            [
                s("ptops_goodput_ratio", "0.25x30"),
                s("ptops_start_timestamp_seconds", "0x30"),
                state("running", "1x30"),
            ],
            "2h",
            [({}, "25%")],
        ),
        (
            "finished run",
            "5m",
            [
                s("ptops_goodput_ratio", "0.25x30"),
                s("ptops_start_timestamp_seconds", "0x30"),
                state("running", "0x30"),
                state("completed", "1x30"),
            ],
            "2h",
            [],
        ),
        (
            "90% while running",
            "5m",
            [
                s("ptops_goodput_ratio", "0.9x30"),
                s("ptops_start_timestamp_seconds", "0x30"),
                state("running", "1x30"),
            ],
            "2h",
            [],
        ),
    ],
    "GPUErrors": [
        (
            "uncorrected ECC error",
            "10s",
            [s("ptops_gpu_ecc_errors_total", "0 0 0 1x10", 'gpu="0",host="h",type="uncorrected"')],
            "110s",
            [({"gpu": "0", "host": "h", "type": "uncorrected"}, "1")],
        ),
        (
            "corrected ECC only, no throttle",
            "10s",
            [
                s("ptops_gpu_ecc_errors_total", "0 0 0 5x10", 'gpu="0",host="h",type="corrected"'),
                s("ptops_gpu_throttle", "0x12", 'gpu="0",host="h",reason="hw_slowdown"'),
                s("ptops_gpu_throttle", "1x12", 'gpu="0",host="h",reason="gpu_idle"'),
            ],
            "110s",
            [],
        ),
    ],
}


def _render(template: str, labels: dict, value: str) -> str:
    out = re.sub(r"\{\{ \$labels\.(\w+) \}\}", lambda m: labels.get(m.group(1), ""), template)
    return re.sub(r"\{\{ \$value[^}]*\}\}", value, out)


def build_unit_tests(evaluation_interval: str = "10s") -> str:
    rules = {r["alert"]: r for r in rule_dicts()}
    tests = []
    for alert, cases in CASES.items():
        rule = rules[alert]
        for name, interval, series, at, expected in cases:
            if (interval == "10s") != (evaluation_interval == "10s"):
                continue
            exp = []
            for extra, value in expected:
                labels = {"run": "r", "recipe": "t", **extra}
                exp.append(
                    {
                        "exp_labels": {"severity": rule["labels"]["severity"], **labels},
                        "exp_annotations": {
                            k: _render(v, labels, value) for k, v in rule["annotations"].items()
                        },
                    }
                )
            tests.append(
                {
                    "name": f"{alert}: {name}",
                    "interval": interval,
                    "input_series": series,
                    "alert_rule_test": [{"eval_time": at, "alertname": alert, "exp_alerts": exp}],
                }
            )
    doc = {
        "rule_files": ["../ptops-rules.yml"],
        "evaluation_interval": evaluation_interval,
        "tests": tests,
    }
    return (
        "# promtool unit tests for ptops-rules.yml, generated by tests/obs/test_alerts.py "
        "(PTOPS_REGEN=1).\n"
        "# Run: cd ops/obs/alerts/tests && promtool test rules *.test.yml\n"
        + yaml.safe_dump(doc, sort_keys=False, width=200)
    )


def test_shipped_rules_are_rendered_rules():
    if REGEN:
        RULES_FILE.write_text(render_rules())
    assert RULES_FILE.read_text() == render_rules(), (
        "ops/obs/alerts/ptops-rules.yml is stale: PTOPS_REGEN=1 pytest ..."
    )


def test_every_alert_has_for_severity_annotations_and_runbook():
    want = {
        "TrainingHang",
        "TrainingCrashLoop",
        "TrainingStalled",
        "CheckpointStale",
        "CheckpointSaveFailing",
        "CheckpointCorrupt",
        "StragglerRank",
        "TrainingNaN",
        "LossSpike",
        "EntropyCollapse",
        "KLDrift",
        "RewardHacking",
        "GoodputLow",
        "GPUErrors",
        "SilentDataCorruption",
        "SupervisorBehind",
    }
    assert set(ALERT_NAMES) == want
    doc = yaml.safe_load(RULES_FILE.read_text())
    for r in doc["groups"][0]["rules"]:
        assert r["for"] and r["labels"]["severity"] in ("critical", "warning")
        ann = r["annotations"]
        assert ann["summary"] and ann["description"]
        assert ann["runbook_url"].endswith(f"/{r['alert']}.md")
        assert (REPO / "runbooks" / f"{r['alert']}.md").is_file(), (
            f"runbooks/{r['alert']}.md is missing"
        )


def test_runbook_base_url_is_configurable(monkeypatch):
    assert "https://wiki.example.org/rb/TrainingHang.md" in render_rules(
        "https://wiki.example.org/rb/"
    )
    monkeypatch.setenv("PTOPS_RUNBOOK_BASE_URL", "https://x.example/ops")
    assert "https://x.example/ops/GPUErrors.md" in render_rules()


def test_promtool_check_rules(have):
    promtool = have("promtool")
    p = subprocess.run(
        [promtool, "check", "rules", str(RULES_FILE)], capture_output=True, text=True, timeout=60
    )
    assert p.returncode == 0, p.stdout + p.stderr
    assert f"SUCCESS: {len(ALERTS)} rules found" in p.stdout


def test_unit_tests_cover_every_alert_both_ways():
    for fname, interval in UNIT_TEST_FILES.items():
        path = UNIT_TEST_DIR / fname
        if REGEN:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(build_unit_tests(interval))
        assert path.read_text() == build_unit_tests(interval), (
            f"{path} is stale: PTOPS_REGEN=1 pytest tests/obs/test_alerts.py"
        )
    for alert in ALERT_NAMES:
        cases = CASES[alert]
        assert any(c[4] for c in cases), f"{alert}: no firing case"
        assert any(not c[4] for c in cases), f"{alert}: no quiet case"


def test_promtool_test_rules(have):
    promtool = have("promtool")
    p = subprocess.run(
        [promtool, "test", "rules", *UNIT_TEST_FILES],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=UNIT_TEST_DIR,
    )
    assert p.returncode == 0, p.stdout + p.stderr
    assert "SUCCESS" in p.stdout


@pytest.mark.parametrize(
    "cmd", [["alerts"], ["alerts", "--runbook-base-url", "https://rb.example/x"]]
)
def test_cli_alerts_prints_the_rule_file(cmd):
    from typer.testing import CliRunner

    from ptops.ops.cli.obs import make_app

    res = CliRunner().invoke(make_app(), cmd)
    assert res.exit_code == 0, res.output
    doc = yaml.safe_load(res.stdout)
    assert [r["alert"] for r in doc["groups"][0]["rules"]] == list(ALERT_NAMES)
    if len(cmd) > 1:
        assert "https://rb.example/x/TrainingHang.md" in res.stdout
