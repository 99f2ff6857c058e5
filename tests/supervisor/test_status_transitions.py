"""``ptops status`` names the supervisor's last state changes (``supervisor/transitions.jsonl``),
and a copied or hand-edited history never breaks it."""

from __future__ import annotations

import json

from conftest import run_ptops

from ptops.ops.cli.status_view import render
from ptops.ops.runrecord.status import collect, last_transitions


def _run(tmp_path, lines: list[str]):
    run = tmp_path / "run"
    (run / "supervisor").mkdir(parents=True)
    (run / "events.jsonl").write_text(
        json.dumps({"ts": 1.0, "kind": "launch", "attempt": 1, "world": 2}) + "\n"
    )
    (run / "supervisor" / "transitions.jsonl").write_text("\n".join(lines) + "\n")
    return run


def _move(ts, a, b, why, ok=True):
    return json.dumps({"ts": ts, "pid": 1, "attempt": 1, "from": a, "to": b, "why": why, "ok": ok})


def test_status_shows_the_last_five_state_changes_and_flags_one_outside_the_table(tmp_path):
    moves = [
        _move(1.0, "starting", "running", "all_ranks_hello"),
        _move(2.0, "running", "checkpointing", "checkpoint_begun"),
        _move(3.0, "checkpointing", "running", "checkpoint_done"),
        _move(4.0, "running", "collecting_stacks", "hang"),
        _move(5.0, "collecting_stacks", "restarting", "restart"),
        _move(6.0, "restarting", "starting", "launch"),
        _move(7.0, "starting", "starting", "launch", ok=False),
    ]
    s = collect(_run(tmp_path, moves))
    assert [m["why"] for m in s["transitions"]] == [
        "checkpoint_done",
        "hang",
        "restart",
        "launch",
        "launch",
    ]
    text = render(s)
    assert "last state changes:" in text and "running -> collecting_stacks (hang)" in text
    assert "starting -> starting (launch, not in the table)" in text
    proc = run_ptops("status", str(tmp_path / "run"), "--json", timeout=120)
    assert json.loads(proc.stdout)["transitions"] == s["transitions"]


def test_a_hostile_history_yields_what_parses(tmp_path):
    path = _run(tmp_path, ["{not json", "[1, 2]", '{"to": 7}', _move(1.0, "a", "b", "w")])
    got = last_transitions(path / "supervisor" / "transitions.jsonl")
    assert [m["to"] for m in got] == ["b"]
    assert last_transitions(tmp_path / "missing.jsonl") == []
