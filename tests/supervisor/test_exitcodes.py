"""Exit codes (issue 26, item 5): one table, documented as it is, and each code from a real trigger.

Codes whose real trigger already runs elsewhere are asserted there (3:
tests/supervisor/test_policy_live.py, 4: tests/supervisor/test_hang_budgets.py, 5:
tests/slurm/test_slurm_blame.py, 130: tests/supervisor/test_supervisor_real.py, 143:
tests/engines/test_byo_script.py); docs/exit-codes.md lists where. Here: the table, the pure mapping
from a run's outcome to its code, and the cheap real triggers of 0, 1 and 2.
"""

from __future__ import annotations

import json
import re
import signal
from pathlib import Path

from conftest import REPO

from ptops.ops.supervisor import exitcodes
from ptops.ops.supervisor.policy import Failure, RestartPolicy
from ptops.recipes.schema import RestartConfig

DOC = REPO / "docs" / "exit-codes.md"


def _doc_rows() -> list[list[str]]:
    text = DOC.read_text()
    table = text[text.index("| code | name |") :].split("\n\n", 1)[0]
    rows = [
        [c.strip().replace("`", "") for c in line.strip("|").split("|")]
        for line in table.splitlines()[2:]
    ]
    return rows


def test_the_table_has_one_row_per_code_and_every_kind_the_issue_names():
    codes = [e.code for e in exitcodes.TABLE]
    assert len(codes) == len(set(codes)) and len({e.name for e in exitcodes.TABLE}) == len(codes)
    names = {e.name for e in exitcodes.TABLE}
    assert {
        "completed",
        "stopped_sigint",
        "stopped_sigterm",
        "failed_may_requeue",
        "no_progress",
        "misconfigured",
        "resubmitted",
    } <= names
    # only the spent budget asks for a requeue
    assert [e.code for e in exitcodes.TABLE if exitcodes.requeue_may_help(e.code)] == [1]
    assert exitcodes.describe(77) is None


def test_the_doc_page_is_the_table():
    rows = _doc_rows()
    assert [int(r[0]) for r in rows] == [e.code for e in exitcodes.TABLE]
    for r, e in zip(rows, exitcodes.TABLE):
        assert (r[1], r[2], r[3], r[4]) == (e.name, e.requeue, e.means, e.nvrx), r[0]
    text = DOC.read_text()
    assert (
        "93" in text and "DEFAULT_NO_RESTART_EXIT_CODE" in text
    )  # the convention it is compared with


def test_the_readme_and_launch_help_name_the_codes():
    cli = (REPO / "docs" / "cli.md").read_text()
    assert "docs/exit-codes.md" in cli and "4 misconfigured" in cli and "5 resubmitted" in cli
    assert "docs/exit-codes.md" in (REPO / "README.md").read_text()
    assert "exit 3 (do not requeue)" not in (REPO / "docs" / "slurm.md").read_text()  # resubmit: 5


def test_outcomes_map_to_their_codes():
    """The restart policy's verdicts, pure (the clock is passed in)."""
    cfg = RestartConfig(max_restarts=1, storm_restarts=100, no_progress_attempts=100)
    budget = RestartPolicy(cfg)
    assert budget.decide(Failure(0, 0, 5, "crash")).action == "restart"
    assert budget.decide(Failure(1, 5, 10, "crash")).exit_code == exitcodes.FAILED_MAY_REQUEUE
    stuck = RestartPolicy(RestartConfig(no_progress_attempts=2, storm_restarts=100))
    stuck.decide(Failure(0, 5, 5, "crash"))
    assert stuck.decide(Failure(100, 5, 5, "crash")).exit_code == exitcodes.NO_PROGRESS
    fatal = RestartPolicy(RestartConfig()).decide(
        Failure(0, 0, 0, "crash", fatal="ImportError before ...")
    )
    assert (fatal.action, fatal.exit_code) == ("stop", exitcodes.MISCONFIGURED)
    plain = RestartPolicy(RestartConfig(), strategy="temporary").decide(Failure(0, 0, 0, "crash"))
    assert plain.exit_code == exitcodes.FAILED_MAY_REQUEUE
    assert exitcodes.stopped(signal.SIGINT) == 130 and exitcodes.stopped(signal.SIGTERM) == 143
    assert exitcodes.stopped(signal.SIGUSR1) == 143  # Slurm's warning whose requeue failed


def _summary(proc) -> dict:
    return json.loads(proc.stdout)


def test_completed_is_0(faulted_runs):
    for kind in ("reference", "crash"):
        f = faulted_runs.get(kind)
        assert f.proc.returncode == exitcodes.COMPLETED, (kind, f.proc.stderr[-2000:])
        assert _summary(f.proc)["state"] == "completed"


def test_bad_input_is_2(ptops, tmp_path):
    proc = ptops(
        "launch",
        "titan-tiny",
        "--run-dir",
        str(tmp_path / "run"),
        "--set",
        "train.steps=oops",
        "--no-mlflow",
    )
    assert proc.returncode == exitcodes.BAD_INPUT, proc.stderr
    assert proc.stderr.startswith("error: ") and "train.steps" in proc.stderr


def test_a_plain_launch_that_crashes_is_1_and_the_summary_says_requeue(ptops, tmp_path):
    run = tmp_path / "run"
    proc = ptops(
        "launch",
        "titan-tiny",
        "--run-dir",
        str(run),
        "--set",
        "train.steps=4",
        "--no-mlflow",
        "--fault",
        "crash:rank=1,step=2",
        timeout=600,
    )
    assert proc.returncode == exitcodes.FAILED_MAY_REQUEUE, proc.stderr[-3000:]
    events = [json.loads(x) for x in (run / "events.jsonl").read_text().splitlines()]
    failed = [e for e in events if e["kind"] == "failed"]
    assert failed and failed[-1]["exit_code"] == exitcodes.FAILED_MAY_REQUEUE
    assert "exit 1 (failed_may_requeue): requeue: yes" in proc.stderr


def test_misconfigured_names_itself_in_the_summary(tmp_path, capsys):
    """The summary line a person reads for a 4 (real trigger: test_hang_budgets' world of one)."""
    from ptops.ops.cli.launch import print_summary

    s = {
        "state": "failed",
        "exit_code": 4,
        "step": 0,
        "loss": None,
        "attempts": 1,
        "restarts": 0,
        "crashes": 0,
        "hangs": 0,
        "wall_s": 1.0,
        "reason": "misconfigured",
        "run_dir": str(tmp_path),
        "last_good_checkpoint": None,
        "checkpoints": [],
        "stacks": [],
    }
    print_summary(s)
    assert "exit 4 (misconfigured): requeue: no; a person must look" in capsys.readouterr().err
    assert Path(DOC).exists() and re.search(r"\| 4 \| misconfigured \|", DOC.read_text())
