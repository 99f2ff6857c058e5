"""The supervisor's state machine (``ops/supervisor/states.py``): the table, the one way to change
state, the names readers use, the docs' copy, and real supervised runs' transitions."""

from __future__ import annotations

import ast
import io
import json
import os
from pathlib import Path

import pytest
from conftest import REPO

from ptops.ops.runrecord.events import (
    END_KINDS,
    EXPORTED_STATES,
    LIVE_STATES,
    SPECS,
    TERMINAL_STATES,
    Reducer,
    RunState,
    next_state,
)
from ptops.ops.runrecord.lock import acquire, release
from ptops.ops.runrecord.rundir import RunDir
from ptops.ops.runrecord.status import collect, write_status
from ptops.ops.supervisor import states
from ptops.ops.supervisor.policy import Failure, RestartPolicy, RestartSpec
from ptops.recipes.schema import RestartConfig

# the files whose code changes a supervisor's state
STATE_FILES = [*sorted((REPO / "ops" / "supervisor").glob("*.py")), REPO / "ops/slurm/inside.py"]
UNKNOWN_TEXT = "unknown (unsupervised run; no status.json)"


# ------------------------------------------------------------------ the table
def test_the_enum_splits_into_supervisor_and_reader_states():
    assert states.SUPERVISOR_STATES | states.READER_STATES == set(RunState)
    assert not states.SUPERVISOR_STATES & states.READER_STATES
    assert not states.STATUS_ONLY_STATES & states.EXPORTER_ONLY_STATES
    assert LIVE_STATES | TERMINAL_STATES == states.SUPERVISOR_STATES


def test_every_row_is_between_supervisor_states_and_every_state_is_reached():
    assert len(states.BY_WHY) == len(states.TRANSITIONS)  # one row a reason
    for t in states.TRANSITIONS:
        assert t.to in states.SUPERVISOR_STATES, t
        assert set(t.sources) <= states.SUPERVISOR_STATES, t
    reached, todo = {states.INITIAL}, [states.INITIAL]
    while todo:
        for to in states.ALLOWED[todo.pop()]:
            if to not in reached:
                reached.add(to)
                todo.append(to)
    assert reached == states.SUPERVISOR_STATES
    # an ended run leaves its end only by a supervisor's own error
    for end in TERMINAL_STATES:
        assert {w for ws in states.ALLOWED[end].values() for w in ws} <= {"supervisor_error"}


def _transition_calls(path: Path):
    """(line, target attribute, why constants) of each ``self.transition(RunState.X, why)``."""
    for node in ast.walk(ast.parse(path.read_text())):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "transition"
        ):
            target = node.args[0]
            literal = (
                isinstance(target, ast.Attribute)
                and isinstance(target.value, ast.Name)
                and target.value.id == "RunState"
            )
            name = target.attr if literal else None
            whys = [
                c.value
                for c in ast.walk(node.args[1])
                if isinstance(c, ast.Constant) and isinstance(c.value, str)
            ]
            yield node.lineno, name, whys


def test_state_changes_only_through_transition_and_each_names_a_row():
    assigned = []
    used: set[str] = set()
    for path in STATE_FILES:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                for t in targets:
                    for sub in ast.walk(t):
                        if (
                            isinstance(sub, ast.Attribute)
                            and sub.attr == "state"
                            and isinstance(sub.value, ast.Name)
                            and sub.value.id == "self"
                        ):
                            assigned.append(f"{path.relative_to(REPO)}:{node.lineno}")
        for line, name, whys in _transition_calls(path):
            where = f"{path.relative_to(REPO)}:{line}"
            assert whys, f"{where}: why must be a literal name of the table"
            for why in whys:
                assert why in states.BY_WHY, f"{where}: {why!r} is not a row of the table"
                if name is not None:  # a literal target: the row's
                    assert states.BY_WHY[why].to == RunState[name], where
            used.update(whys)
    # __init__'s initial state and transition()'s own assignment; nothing else
    assert sorted(assigned) == sorted(
        ["ops/supervisor/core.py:" + str(_line_of("core.py", "self.state: RunState =")),
         "ops/supervisor/core.py:" + str(_line_of("core.py", "        self.state = to"))]
    )  # fmt: skip
    assert used == set(states.BY_WHY), f"rows no code makes: {set(states.BY_WHY) - used}"


def _line_of(name: str, text: str) -> int:
    lines = (REPO / "ops" / "supervisor" / name).read_text().splitlines()
    return next(i for i, line in enumerate(lines, 1) if text in line)


# ------------------------------------------------------------------ readers name the same states
def test_reducer_and_exporter_states_are_the_tables_or_documented_reader_states():
    event_states = {s.state for s in SPECS.values() if s.state is not None}
    assert event_states <= set(RunState)
    # what an event can say beyond the supervisor's own states is exactly the exporter-only ones
    assert event_states - states.SUPERVISOR_STATES == states.EXPORTER_ONLY_STATES
    assert set(EXPORTED_STATES) <= states.SUPERVISOR_STATES | states.EXPORTER_ONLY_STATES
    assert {str(k) for k in END_KINDS} == {str(s) for s in TERMINAL_STATES}
    # the reducer's two views over every event kind, from every state it can hold
    view_states = {Reducer().view.state}
    held = {None, *event_states}
    for kind, s in SPECS.items():
        for state in held:
            nxt = next_state(state, {"kind": str(kind)})
            assert nxt is None or nxt in set(RunState), (state, kind, nxt)
        r = Reducer()
        r.add({"kind": str(kind), "ts": 1.0, "attempt": 1})
        view_states.add(r.view.state)
    assert view_states <= set(RunState)
    assert view_states - states.SUPERVISOR_STATES <= states.STATUS_ONLY_STATES
    from ptops.ops.obs.prometheus import PrometheusExporter

    # its state before any event says one
    assert PrometheusExporter("run", nvml=False)._state_note in set(RunState)


def test_ptops_status_prints_exactly_the_tables_states_and_the_status_only_ones(tmp_path):
    printed = set()
    for state in sorted(states.SUPERVISOR_STATES):
        for locked in (False, True):
            run = RunDir(tmp_path / f"{state}-{locked}").create()
            run.event("launch", attempt=1, supervised=True, nproc=1, from_step=0)
            write_status(run, {"state": str(state), "step": 0, "attempt": 1})
            fd = acquire(run.path) if locked else None
            try:
                got = collect(run.path)["state"]
            finally:
                if fd is not None:
                    release(fd)
            want = RunState.DEAD if state in LIVE_STATES and not locked else state
            assert got == want, (state, locked)
            printed.add(got)
    # without status.json: from the events alone
    fresh = RunDir(tmp_path / "fresh").create()
    fresh.recipe_json.write_text("{}")
    printed.add(collect(fresh.path)["state"])
    for end in sorted(END_KINDS):
        run = RunDir(tmp_path / f"plain-{end}").create()
        run.event("launch", attempt=1, supervised=False, nproc=1, from_step=0)
        run.event(str(end), attempt=1, step=1, reason="r", exit_code=0, signal=15)
        printed.add(collect(run.path)["state"])
    unsupervised = RunDir(tmp_path / "unsupervised").create()
    unsupervised.event("launch", attempt=1, supervised=False, nproc=1, from_step=0)
    assert collect(unsupervised.path)["state"] == UNKNOWN_TEXT  # the one text that is no state
    assert printed == states.SUPERVISOR_STATES | states.STATUS_ONLY_STATES


# ------------------------------------------------------------------ transition()
def _sup(tmp_path):
    from ptops.ops.supervisor import Supervisor
    from ptops.recipes.schema import load

    rec, _ = load("titan-tiny", ["launch.nproc=2"])
    run = RunDir(tmp_path / "run").create()
    return Supervisor(rec, run, [], out=io.StringIO(), strategy="temporary")


def test_transition_records_checks_and_never_kills_a_run_outside_tests(tmp_path, monkeypatch):
    sup = _sup(tmp_path)
    assert sup.state == RunState.STARTING
    sup.transition(RunState.STARTING, "launch")  # the same state: not a transition
    sup.transition(RunState.RUNNING, "all_ranks_hello")
    sup.transition(RunState.CHECKPOINTING, "checkpoint_begun")
    sup.transition(RunState.RUNNING, "checkpoint_done")
    with pytest.raises(states.TransitionError, match="running -> starting"):
        sup.transition(RunState.STARTING, "launch")  # running never goes back to starting
    with pytest.raises(states.TransitionError):
        sup.transition(RunState.FAILED, "completed")  # a real edge, the wrong reason
    assert sup.state == RunState.RUNNING
    assert sup.strict_transitions  # the suite's setting (tests/conftest.py)
    monkeypatch.setattr(sup, "strict_transitions", False)
    sup.transition(RunState.STARTING, "launch")  # production: one line, and on
    assert sup.state == RunState.STARTING
    assert "running -> starting (launch): not in the table" in sup.out.getvalue()
    lines = (sup.run.path / "supervisor" / "transitions.jsonl").read_text().splitlines()
    got = [json.loads(x) for x in lines]
    assert [(r["from"], r["to"], r["why"], r["ok"]) for r in got] == [
        ("starting", "running", "all_ranks_hello", True),
        ("running", "checkpointing", "checkpoint_begun", True),
        ("checkpointing", "running", "checkpoint_done", True),
        ("running", "starting", "launch", False),
    ]
    assert list(sup.transitions) == got
    assert {r["pid"] for r in got} == {os.getpid()}


def test_a_bug_in_the_supervisor_ends_the_run_failed_from_any_state(tmp_path):
    for state in states.SUPERVISOR_STATES - {RunState.FAILED}:
        assert states.allowed(state, RunState.FAILED, "supervisor_error")


# ------------------------------------------------------------------ restart spec
def test_restart_spec_is_the_recipes_numbers_and_decides_as_before():
    cfg = RestartConfig(
        max_restarts=4, backoff_s=2, backoff_max_s=5, storm_restarts=9, storm_window_min=0.5
    )
    spec = RestartSpec.of(cfg, "permanent")
    assert spec == RestartSpec("permanent", 4, 9, 30.0, 3, 2.0, 5.0)
    assert [spec.delay_s(n) for n in range(5)] == [0.0, 2.0, 4.0, 5.0, 5.0]
    assert RestartPolicy(cfg).spec == spec
    assert RestartPolicy(cfg, strategy="temporary").spec.strategy == "temporary"
    with pytest.raises(AttributeError):
        spec.max_restarts = 5  # frozen
    # the defaults are the recipe's
    d = RestartSpec.of(RestartConfig())
    assert (d.max_restarts, d.backoff_s, d.backoff_max_s) == (10, 1.0, 60.0)
    assert (d.storm_restarts, d.storm_window_s, d.no_progress_attempts) == (5, 600.0, 3)
    pol = RestartPolicy(RestartConfig(storm_restarts=100))
    delays = [pol.decide(Failure(float(i), 0, 0, "crash")).delay_s for i in range(2)]
    assert delays == [1.0, 2.0]


def test_docs_render_the_table():
    doc = (REPO / "docs" / "architecture-details.md").read_text()
    body = doc.split("<!-- states:begin -->\n", 1)[1].split("<!-- states:end -->", 1)[0]
    assert body == states.render_markdown(), (
        "docs/architecture-details.md's state table differs from ops/supervisor/states.py: paste "
        "states.render_markdown() between the states markers"
    )


# ------------------------------------------------------------------ real runs
def _transitions(run: Path) -> list[dict]:
    path = run / "supervisor" / "transitions.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


@pytest.mark.parametrize("kind", ["crash", "hang"])
def test_real_supervised_runs_make_only_the_tables_transitions(faulted_runs, kind):
    """The shared faulted titan-tiny runs (tests/faulted.py): a crash (restart, completed) and
    two hangs (stacks, restarts, completed)."""
    f = faulted_runs.get(kind)
    got = _transitions(f.run)
    assert got, "no transitions recorded"
    for r in got:
        assert r["ok"] and states.allowed(r["from"], r["to"], r["why"]), r
    for a, b in zip(got, got[1:]):
        assert a["to"] == b["from"], (a, b)  # a chain: no change went unrecorded
    whys = [r["why"] for r in got]
    assert whys[-1] == "completed" and "restart" in whys and "launch" in whys
    if kind == "hang":
        assert whys.count("hang") == 2
    # status.json ends where the history does
    assert json.loads((f.run / "status.json").read_text())["state"] == got[-1]["to"]
