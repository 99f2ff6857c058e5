"""What a user of their own script is told (issue 47, point 3): a forgotten ``--`` gets the command
they meant; an error at import shows its traceback (file, line, source) and stops at once; the
flight recorder's settings cause no deprecation warning in the rank logs."""

from __future__ import annotations

import json

import pytest
from conftest import run_ptops

from ptops.ops.rank.probe import flight_recorder_env


@pytest.mark.parametrize(
    "args, meant",
    [
        (["--supervise", "python", "train.py"], "ptops launch --supervise -- python train.py"),
        (["train.py"], "ptops launch -- python train.py"),
        (
            ["--supervise", "train.py", "--steps", "3"],
            "ptops launch --supervise -- python train.py --steps 3",
        ),
        (
            ["--set", "launch.nproc=1", "--run-dir", "/tmp/r", "python", "-u", "t.py", "--lr", "1"],
            "ptops launch --set launch.nproc=1 --run-dir /tmp/r -- python -u t.py --lr 1",
        ),
        (
            ["--supervise", "torchrun", "--nproc-per-node", "2", "t.py"],
            "ptops launch --supervise -- torchrun --nproc-per-node 2 t.py",
        ),
    ],
)
def test_a_command_without_its_dashes_gets_the_command_line_meant(args, meant):
    p = run_ptops("launch", *args, timeout=60)
    assert p.returncode == 2, p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), p.stderr  # one line, no usage text
    assert f"did you mean: {meant}" in lines[0], lines[0]
    assert "unexpected extra argument" not in p.stderr and "No such option" not in p.stderr


def test_a_recipe_or_a_mistyped_recipe_name_gets_no_command_hint():
    p = run_ptops("launch", "nosuchrecipe", timeout=60)
    assert p.returncode == 2 and "recipe file not found" in p.stderr and "--" not in p.stderr
    # launch's own options after a mistyped name are no command (a plugin's recipe, not installed)
    p = run_ptops("launch", "nosuchrecipe", "--dry-run", "--set", "train.steps=3", timeout=60)
    assert p.returncode == 2 and "recipe file not found" in p.stderr, p.stderr
    assert "did you mean" not in p.stderr
    p = run_ptops("launch", "titan-tiny", "--dry-run", "--json", timeout=120)
    assert "did you mean" not in p.stderr, p.stderr


def test_the_flight_recorder_is_set_by_the_names_the_ranks_torch_reads():
    """torch >= 2.8 reads TORCH_FR_*; the pre-2.8 names print "Environment variable
    TORCH_NCCL_TRACE_BUFFER_SIZE is deprecated; use TORCH_FR_BUFFER_SIZE instead" in every rank log
    (what the supervisor set before issue 47). Older torch gets the old names too. A user's own
    setting, under either name, is kept."""
    new = flight_recorder_env("/d/fr_", {}, (2, 13))
    assert new == {
        "TORCH_FR_BUFFER_SIZE": "2000",
        "TORCH_FR_DUMP_TEMP_FILE": "/d/fr_",
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
    }
    assert flight_recorder_env("/d/fr_", {}, (2, 8)) == new
    old = flight_recorder_env("/d/fr_", {}, (2, 7))
    assert old["TORCH_NCCL_TRACE_BUFFER_SIZE"] == old["TORCH_FR_BUFFER_SIZE"] == "2000"
    assert old["TORCH_NCCL_DEBUG_INFO_TEMP_FILE"] == "/d/fr_"
    mine = flight_recorder_env("/d/fr_", {"TORCH_NCCL_TRACE_BUFFER_SIZE": "0"}, (2, 13))
    assert "TORCH_FR_BUFFER_SIZE" not in mine and "TORCH_NCCL_TRACE_BUFFER_SIZE" not in mine
    # the installed torch (this venv: 2.13) is read from its metadata, without importing it
    assert "TORCH_NCCL_TRACE_BUFFER_SIZE" not in flight_recorder_env("/d/fr_", {})


@pytest.mark.parametrize(
    "source, shown",
    [
        # a typo at line 3: a SyntaxError (today's message named the file's name and line, not the
        # path or the source line)
        ("import os\n\nimprot torch\n", ["line 3", "    improt torch", "SyntaxError"]),
        # a misspelt module at line 3, imported from the user's own module: both frames shown
        ("import os\nimport sys\nimport torhc\n", ["line 3, in <module>", "    import torhc"]),
    ],
    ids=["syntax-error", "import-error"],
)
def test_an_error_at_import_stops_at_once_with_the_scripts_traceback(tmp_path, source, shown):
    (tmp_path / "helpers.py").write_text(source)
    script = tmp_path / "bad.py"
    script.write_text("import helpers  # line 1\n")
    run = tmp_path / "run"
    p = run_ptops(
        "launch", "--supervise", "--no-mlflow", "--run-dir", str(run), "--",
        "python", str(script), timeout=300,
    )  # fmt: skip
    assert p.returncode == 4, p.stderr[-3000:]
    events = [json.loads(x) for x in (run / "events.jsonl").read_text().splitlines()]
    assert [e["attempt"] for e in events if e["kind"] == "launch"] == [1]  # no restart
    helpers = f'File "{tmp_path / "helpers.py"}", '
    # the giving-up output carries the traceback: the user's frames, file, line and source line
    out = p.stderr[p.stderr.index("giving up:") :]
    assert helpers in out and all(s in out for s in shown), out
    assert f'File "{script}", line 1, in <module>' in out and "import helpers" in out, out
    assert "ops/rank/entry.py" not in out and "runpy" not in out, out  # ptops' harness left out
    (failed,) = [e for e in events if e["kind"] == "failed"]
    assert helpers in failed["traceback"] and shown[-1] in failed["traceback"], failed
    assert len(failed["traceback"]) <= 2000 and len(failed["traceback"].splitlines()) <= 20


def test_a_short_traceback_keeps_the_innermost_frames_within_its_caps():
    from ptops.ops.rank.entry import user_traceback

    # 40 distinct frames f0 -> f1 -> ... -> f39, the innermost raising
    chain = "\n".join(f"def f{i}():\n    f{i + 1}()" for i in range(39))
    space: dict = {}
    exec(chain + "\ndef f39():\n    raise ValueError('the innermost')", space)
    try:
        space["f0"]()
    except ValueError as e:
        tb = user_traceback(e, max_lines=12, max_chars=800)
    lines = tb.splitlines()
    assert len(lines) <= 12 and len(tb) <= 800, tb
    assert lines[0] == "Traceback (most recent call last, outer frames left out):", tb
    assert lines[-1] == "ValueError: the innermost" and "in f39" in lines[-2], tb
    assert "in f38" in tb and "in f0" not in tb, tb
