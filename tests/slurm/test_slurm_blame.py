"""The batch-step supervisor's decisions between attempts, without a cluster: node strikes, spare
replacement, and the resubmit with --exclude when no spare is left (a stand-in ``sbatch`` on
PATH)."""

from __future__ import annotations

import json
import os
from pathlib import Path

from ptops.ops.runrecord.rundir import RunDir
from ptops.ops.slurm.inside import SlurmSupervisor
from ptops.ops.slurm.sbatch import write
from ptops.ops.supervisor.launcher import prepare_run
from ptops.ops.supervisor.messages import RankInfo
from ptops.ops.supervisor.outcome import Outcome
from ptops.recipes.schema import load, resolve_path


def _sup(tmp_path: Path, allocation: list[str], *sets: str) -> SlurmSupervisor:
    rec, path = load("titan-tiny", ["launch.nproc=1", "slurm.nodes=2", *sets])
    run = prepare_run(rec, resolve_path("titan-tiny"), tmp_path / "run")
    write(rec, run.path, [])
    sup = SlurmSupervisor(rec, run, [], allocation, "41")
    sup.attempt = 1
    sup.ranks = {0: RankInfo(0, 100, allocation[0]), 1: RankInfo(1, 101, allocation[1])}
    return sup


def _kinds(run: RunDir) -> list[str]:
    return [e["kind"] for e in run.read_events()]


def test_world_is_nodes_times_ranks_per_node_and_spares_are_held_back(tmp_path):
    sup = _sup(tmp_path, ["n1", "n2", "n3"], "slurm.spare_nodes=1")
    assert sup.world == 2 and sup.active == ["n1", "n2"] and sup.spares == ["n3"]
    cmd = sup.attempt_command(1, {})
    assert (
        cmd.argv[0] == "srun"
        and "--nodelist=n1,n2" in cmd.argv
        and "--ntasks-per-node=1" in cmd.argv
    )
    assert cmd.argv[-1] == "ptops.ops.node.agent"
    assert cmd.env["PTOPS_NODE_MASTER"] == "n1" and cmd.env["PTOPS_NODE_NNODES"] == "2"
    assert sup.cfg.channel_host == "0.0.0.0"  # agents on other nodes must reach the channel


def test_strikes_then_a_spare_replaces_the_node(tmp_path):
    sup = _sup(tmp_path, ["n1", "n2", "n3"], "slurm.spare_nodes=1", "slurm.node_strikes=2")
    crash = Outcome("crash", "crash: rank 1 exited -9", {"rank": 1, "exit_code": -9})
    assert sup.after_outcome(crash) is None
    assert sup.active == ["n1", "n2"]  # one strike of two: same nodes
    hang = Outcome("hang", "hang", {"ranks": [1]})
    assert sup.after_outcome(hang) is None
    assert sup.active == ["n1", "n3"] and sup.spares == []
    ev = [e for e in sup.run.read_events() if e["kind"] in ("node_blamed", "node_replaced")]
    assert [(e["kind"], e["node"]) for e in ev] == [
        ("node_blamed", "n2"),
        ("node_blamed", "n2"),
        ("node_replaced", "n2"),
    ]
    assert ev[-1]["by"] == "n3"
    # ranks on several nodes (a job-wide hang): no node is blamed
    assert sup.after_outcome(Outcome("hang", "hang", {"ranks": [0, 1]})) is None
    assert _kinds(sup.run).count("node_blamed") == 2


def test_a_crash_that_began_with_a_links_close_strikes_that_links_host(tmp_path):
    """A relay's (or node agent's) link closed first (``Blame.link_of``: the crash's ``link``): the
    strike goes to that host, not to the node of the rank the supervisor read first."""
    sup = _sup(tmp_path, ["n1", "n2", "n3"], "slurm.spare_nodes=1", "slurm.node_strikes=1")
    crash = Outcome("crash", "crash: rank 1 exited None", {"rank": 1, "link": "n1"})
    assert sup.after_outcome(crash) is None
    (blamed,) = [e for e in sup.run.read_events() if e["kind"] == "node_blamed"]
    assert blamed["node"] == "n1" and "n1" not in sup.active and "n2" in sup.active


def test_no_spare_left_resubmits_without_the_node_and_exits_resubmitted(tmp_path, monkeypatch):
    bindir = tmp_path / "bin"
    bindir.mkdir()
    log = tmp_path / "sbatch.args"
    fake = bindir / "sbatch"
    fake.write_text(f"#!/bin/sh\necho \"$@\" > {log}\necho '77;cluster'\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bindir}{os.pathsep}{os.environ['PATH']}")
    sup = _sup(tmp_path, ["n1", "n2"], "slurm.node_strikes=1")
    code = sup.after_outcome(
        Outcome("crash", "crash: rank 1 exited 1", {"rank": 1, "exit_code": 1})
    )
    assert code == 5  # resubmitted: do not requeue this job (docs/exit-codes.md)
    args = log.read_text().split()
    assert args[:2] == ["--parsable", "--exclude=n2"] and args[-1].endswith("slurm/job.sbatch")
    rq = [e for e in sup.run.read_events() if e["kind"] == "slurm_requeue"][0]
    assert rq["how"] == "resubmit" and rq["new_job_id"] == "77" and rq["exclude"] == ["n2"]
    st = json.loads((sup.run.path / "status.json").read_text())
    assert st["state"] == "restarting" and "77" in st["reason"]


def test_strikes_survive_a_requeue(tmp_path):
    sup = _sup(tmp_path, ["n1", "n2", "n3"], "slurm.node_strikes=1")
    sup.run.event("node_blamed", attempt=1, node="n1", strikes=1, reason="x")
    again = SlurmSupervisor(sup.recipe, sup.run, [], ["n1", "n2", "n3"], "41")
    assert again.active == ["n2", "n3"] and again.spares == []


def test_a_straggler_exclude_node_is_acted_on_under_slurm(tmp_path):
    """policy's exclude_node (straggler) becomes a strike; at the limit a spare takes the node's
    place from the next attempt, and the exclude_node event says it was acted on."""
    from types import SimpleNamespace

    sup = _sup(
        tmp_path,
        ["n1", "n2", "n3"],
        "slurm.spare_nodes=1",
        "slurm.node_strikes=1",
        'monitors.straggler.action="exclude_node"',
    )
    finding = SimpleNamespace(
        monitor="straggler",
        rank=1,
        step=9,
        severity="warning",
        phase=None,
        detail="rank 1 2.0x slower than the median",
    )
    d = sup.findings.policy.decide(finding)
    assert d.effect.record == "exclude_node"
    sup.findings.on_finding(finding, 1, sup.rank_host)
    ev = [e for e in sup.run.read_events() if e["kind"] == "exclude_node"][0]
    assert ev["acted"] is True and ev["host"] == "n2" and "n3" in ev["note"], ev
    assert sup.active == ["n1", "n3"]


def test_a_persistent_sdc_rank_strikes_its_node_and_rolls_back_onto_the_spare(tmp_path):
    """A bad device under Slurm (the gradient recheck caught rank 1 twice): its node n2 is struck,
    the spare n3 takes its place from the next attempt, and the attempt ends on an exact rollback
    (a local launch would stop instead: the same device)."""
    from ptops.monitors import replay
    from ptops.monitors.sdc import SdcMonitor

    sup = _sup(tmp_path, ["n1", "n2", "n3"], "slurm.spare_nodes=1", "slurm.node_strikes=1")
    records = [
        {"step": s, "rank": r, "attempt": 1, "loss": 1.0, "sdc_recheck": 0}
        for s in (5, 10)
        for r in (0, 1)
    ]
    records += [
        {"step": s, "rank": 1, "attempt": 1, "loss": 1.0, "sdc_recheck": 1,
         "sdc_recheck_kept": "recompute"}
        for s in (15, 20)
    ]  # fmt: skip
    contained, bad = replay(records, [SdcMonitor()])
    sup.findings.on_finding(contained, 1, sup.rank_host)
    assert sup.findings.pending is None and sup.active == ["n1", "n2"]  # outvoted: recorded only
    sup.findings.on_finding(bad, 1, sup.rank_host)
    ev = [e for e in sup.run.read_events() if e["kind"] == "exclude_node"][0]
    assert ev["acted"] is True and ev["host"] == "n2", ev
    assert sup.active == ["n1", "n3"]
    assert sup.findings.pending.action == "rollback" and sup.findings.pending.step == 10
