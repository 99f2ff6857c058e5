"""The launch's progress line (issue 47, point 3): no total and no ETA unless one is known (a
script's own loop is not bounded by the default train.steps=20: it showed ``step 128/20``), and in a
log file a bounded number of lines whatever the step count (it was one line per step past the
"total": 6,410 lines for 6,400 steps)."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
from conftest import run_ptops

import ptops.ops.cli.progress as progress_mod
from ptops.ops.cli.launch import progress_total
from ptops.ops.cli.progress import Progress
from ptops.recipes.schema import command_recipe_toml, load


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def clock(monkeypatch):
    c = Clock()
    monkeypatch.setattr(progress_mod.time, "monotonic", c)
    return c


def _run(prog: Progress, clock: Clock, steps: int, step_s: float) -> list[str]:
    for step in range(1, steps + 1):
        clock.t += step_s
        prog.update({"rank": 0, "step": step, "loss": 1.0})
    prog.close()
    return prog.stream.getvalue().splitlines()


@pytest.mark.parametrize("total", [None, 20, 6400])
def test_a_log_file_gets_a_bounded_number_of_lines_whatever_the_step_count(clock, total):
    """6,400 steps of 10 ms (64 s) with a line every 5 s: at most 64/5 + 3 lines (the first, the
    total's step, the last step at close); a total of 20 that the script runs past drops its total
    and ETA."""
    prog = Progress(total, stream=io.StringIO(), live=False, plain_every_s=5.0)
    lines = _run(prog, clock, 6400, 0.01)
    assert 2 <= len(lines) <= 64 / 5 + 3, len(lines)
    assert lines[-1].startswith("step 6400" + ("/6400" if total == 6400 else "  ")), lines[-1]
    if total != 6400:
        past = [x for x in lines if not x.startswith(("step 1/", "step 20/"))]
        assert past and not any("/20" in x or "eta" in x for x in past), lines


def test_a_fast_loop_of_6400_steps_in_a_log_file_writes_a_handful_of_lines():
    """The real clock: 6,400 updates as fast as the loop goes (well under 5 s)."""
    prog = Progress(None, stream=io.StringIO(), live=False)
    for step in range(1, 6401):
        prog.update({"rank": 0, "step": step, "loss": 0.5, "tokens_per_s": 1000.0})
    prog.close()
    lines = prog.stream.getvalue().splitlines()
    assert 1 <= len(lines) <= 3, lines
    assert lines[-1].startswith("step 6400  loss 0.5000"), lines


def test_a_known_total_shows_its_eta_and_its_last_step_at_once(clock):
    prog = Progress(40, stream=io.StringIO(), live=False, plain_every_s=5.0)
    lines = _run(prog, clock, 40, 0.01)
    assert lines[0].startswith("step 1/40") and "eta" in lines[0], lines
    assert lines[-1].startswith("step 40/40") and len(lines) == 2, lines  # close adds none


def test_a_terminal_is_redrawn_at_a_bounded_rate(clock):
    prog = Progress(None, stream=io.StringIO(), live=True, live_every_s=0.1)
    _run(prog, clock, 6400, 0.001)  # 6.4 s
    text = prog.stream.getvalue()
    assert text.count("\r\033[K") <= 6.4 / 0.1 + 2 and text.endswith(
        "step 6400  loss 1.0000  tok/s -  elapsed 0:06\n"
    )


def test_a_script_recipe_has_no_total_unless_the_user_set_train_steps(tmp_path):
    recipe = tmp_path / "r.toml"
    recipe.write_text(command_recipe_toml(["python", "train.py"], tmp_path))
    script, _ = load(recipe, [])
    assert progress_total(script) is None
    line = Progress(progress_total(script), stream=io.StringIO()).line(0.0)
    assert line.startswith("step 0  loss") and "eta" not in line, line
    assert progress_total(load(recipe, ["train.steps=300"])[0]) == 300
    assert progress_total(load("titan-tiny", [])[0]) == 20  # a recipe's steps bound its run


def test_a_launched_scripts_progress_shows_no_default_total(tmp_path):
    """Today's launch of a script printed ``step 1/20 ... eta ?`` (the default train.steps)."""
    run = tmp_path / "run"
    p = run_ptops(
        "launch", "--no-mlflow", "--run-dir", str(run), "--",
        "python", str(Path("examples/fsdp2/train.py")), "--steps", "3",
        timeout=300,
    )  # fmt: skip
    assert p.returncode == 0, p.stderr[-3000:]
    steps = [x for x in p.stderr.splitlines() if x.startswith("step ")]
    assert steps and steps[-1].startswith("step 3  loss"), p.stderr[-3000:]
    assert not any("/20" in x or "eta" in x for x in steps), steps
