"""What a user of their own script is told (issue 47, point 3): a forgotten ``--`` gets the command
they meant; an error at import shows its traceback (file, line, source) and stops at once; the
flight recorder's settings cause no deprecation warning in the rank logs."""

from __future__ import annotations

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
