"""Health checks before work (issue 26, item 3): the table, each check failing on demand, and a real
launch that a failing check ends before any rank starts, with the incident naming the check."""

from __future__ import annotations

import json
import os
import shutil
import typing
from pathlib import Path

import pytest

from ptops.ops.supervisor import health
from ptops.recipes.schema import HealthConfig


def _ctx(tmp_path: Path, **kw) -> health.Context:
    base = {
        "ckpt_dir": tmp_path / "checkpoints",
        "min_free_mb": 1.0,
        "rendezvous": [("127.0.0.1", 29500)],
    }
    return health.Context(**{**base, **kw})


def _by_name(results) -> dict:
    return {r.name: r for r in results}


def test_the_table_and_the_recipe_key_name_the_same_checks():
    skip_type = typing.get_args(HealthConfig.model_fields["skip"].annotation)[0]
    assert set(typing.get_args(skip_type)) == set(health.NAMES)
    assert len(health.NAMES) == len(set(health.NAMES)) and all(c.why for c in health.CHECKS)


def test_a_healthy_cpu_node_passes(tmp_path):
    r = _by_name(health.run_checks(_ctx(tmp_path)))
    assert r["checkpoint_space"].ok and r["checkpoint_writable"].ok and r["rendezvous"].ok
    assert (
        r["gpus"].ok is None and "CPU" in r["gpus"].detail
    )  # no NVML on this machine: not applicable
    assert r["clock_skew"].ok is None  # one node, one clock
    assert not list((tmp_path / "checkpoints").iterdir())  # the write probe cleaned up


def test_each_check_fails_on_demand(tmp_path):
    r = _by_name(health.run_checks(_ctx(tmp_path, min_free_mb=1e12)))
    assert r["checkpoint_space"].ok is False and "MB needed" in r["checkpoint_space"].detail
    # twice the newest checkpoint is needed too (a sparse file: big, costs no disk)
    ck = tmp_path / "checkpoints" / "step-4"
    ck.mkdir(parents=True)
    with open(ck / "big.distcp", "wb") as f:
        f.truncate(shutil.disk_usage(tmp_path).free)  # twice that cannot be free
    r = _by_name(health.run_checks(_ctx(tmp_path, newest_ckpt=ck)))
    assert (
        r["checkpoint_space"].ok is False
        and "twice the newest checkpoint step-4" in r["checkpoint_space"].detail
    )
    blocker = tmp_path / "file"
    blocker.write_text("x")  # a checkpoint directory that cannot exist (a file is in its place)
    r = _by_name(health.run_checks(_ctx(tmp_path, ckpt_dir=blocker / "checkpoints")))
    assert r["checkpoint_writable"].ok is False
    r = _by_name(health.run_checks(_ctx(tmp_path, rendezvous=[("no-such-node.invalid", 29500)])))
    assert r["rendezvous"].ok is False and "no-such-node.invalid" in r["rendezvous"].detail
    two = health.run_checks(_ctx(tmp_path), skip=["gpus", "gpu_xid", "rendezvous", "clock_skew"])
    assert [x.name for x in two] == ["checkpoint_space", "checkpoint_writable"]


class _Nvml:
    """An NVML stand-in (no GPU on this machine): ``count`` devices, ``ecc`` errors on GPU 1."""

    def __init__(self, count: int, ecc: int = 0, pending=0, rows=(0, 0, 0, 0), reasons=0):
        self.count, self.ecc, self.pending, self.rows, self.reasons = (
            count, ecc, pending, rows, reasons
        )  # fmt: skip

    def nvmlDeviceGetRetiredPagesPendingStatus(self, h):
        return self.pending if h == 1 else 0

    def nvmlDeviceGetRemappedRows(self, h):
        return self.rows if h == 1 else (0, 0, 0, 0)

    def nvmlDeviceGetCurrentClocksThrottleReasons(self, h):
        return self.reasons if h == 1 else 0x1  # idle: not a fault

    def nvmlInit(self):
        pass

    def nvmlShutdown(self):
        pass

    def nvmlDeviceGetCount(self):
        return self.count

    def nvmlDeviceGetHandleByIndex(self, i):
        return i

    def nvmlDeviceGetTotalEccErrors(self, h, kind, counter):
        return self.ecc if h == 1 else 0


@pytest.mark.parametrize(
    "nvml, expected, ok, words",
    [
        (_Nvml(8), 8, True, "8 GPU(s)"),
        (_Nvml(7), 8, False, "7 GPU(s) visible, 8 expected"),
        (_Nvml(8, ecc=3), 8, False, "GPU 1: 3 uncorrected ECC"),
        (_Nvml(8, pending=1), 8, False, "GPU 1: retired memory pages pending"),
        (_Nvml(8, rows=(2, 1, 1, 0)), 8, False, "GPU 1: row remap pending"),
        (_Nvml(8, rows=(2, 1, 0, 1)), 8, False, "GPU 1: row remapping failed"),
        (_Nvml(8, reasons=0x40 | 0x4), 8, False, "GPU 1: clocks held down by hw_thermal"),
        (_Nvml(8, reasons=0x4), 8, True, "no hardware slowdown"),  # a power cap is policy
        (_Nvml(2), None, True, "(2 wanted)"),  # no stated count: launch.nproc
        (_Nvml(0), None, None, "a CPU run"),
    ],
)
def test_gpus_through_nvml(tmp_path, nvml, expected, ok, words):
    r = _by_name(health.run_checks(_ctx(tmp_path, nvml=nvml, expected_gpus=expected, nproc=2)))[
        "gpus"
    ]
    assert r.ok is ok and words in r.detail, r


def test_critical_xids_in_the_kernel_log_since_the_last_check(tmp_path):
    """A kernel log in /dev/kmsg's format: Xid 79 (fallen off the bus) fails the first check of
    the boot; the next check reads only what came after; a new boot reads its log whole."""
    log, boot = tmp_path / "kmsg", tmp_path / "boot_id"
    boot.write_text("boot-a\n")
    log.write_text(
        "6,10,100,-;nvidia: module loaded\n"
        "3,11,200,-;NVRM: Xid (PCI:0000:3b:00): 79, pid=7, GPU has fallen off the bus.\n"
        " SUBSYSTEM=pci\n"
    )
    ctx = _ctx(tmp_path, kmsg=str(log), boot_id_path=str(boot))
    r = _by_name(health.run_checks(ctx))["gpu_xid"]
    assert r.ok is False and "Xid 79 on PCI:0000:3b:00 since boot" in r.detail, r
    assert ctx.xid_seen == ("boot-a", 11)
    nxt = _ctx(tmp_path, kmsg=str(log), boot_id_path=str(boot), xid_mark=ctx.xid_seen)
    r = _by_name(health.run_checks(nxt))["gpu_xid"]
    assert r.ok is True and "no critical XID since the last check" in r.detail, r
    with open(log, "a") as f:
        f.write("4,12,300,-;NVRM: Xid (PCI:0000:3b:00): 13, Graphics Exception\n")
    r = _by_name(health.run_checks(nxt))["gpu_xid"]
    assert r.ok is True and "(1 other)" in r.detail, r  # Xid 13: an application fault
    boot.write_text("boot-b\n")  # rebooted: the mark of boot-a means nothing now
    r = _by_name(health.run_checks(nxt))["gpu_xid"]
    assert r.ok is False and "since boot" in r.detail, r
    cpu = tmp_path / "cpu-kmsg"
    cpu.write_text("6,1,1,-;Linux version 6.1\n")
    r = _by_name(health.run_checks(_ctx(tmp_path, kmsg=str(cpu), boot_id_path=str(boot))))
    assert r["gpu_xid"].ok is None and "a CPU node" in r["gpu_xid"].detail
    assert _by_name(health.run_checks(_ctx(tmp_path, expected_gpus=0)))["gpu_xid"].ok is None


def test_a_stated_gpu_count_without_nvml_fails(tmp_path):
    r = _by_name(health.run_checks(_ctx(tmp_path, expected_gpus=4)))["gpus"]
    assert r.ok is False and "4 GPU(s) expected" in r.detail


def test_a_failing_check_ends_the_launch_before_any_rank(ptops, tmp_path):
    run = tmp_path / "run"
    proc = ptops(
        "launch",
        "titan-tiny",
        "--supervise",
        "--run-dir",
        str(run),
        "--no-mlflow",
        "--set",
        "supervisor.health.min_free_mb=1e12",
        timeout=300,
    )
    assert proc.returncode == 1, proc.stderr[-3000:]
    events = [json.loads(x) for x in (run / "events.jsonl").read_text().splitlines()]
    kinds = [e["kind"] for e in events]
    assert "launch" not in kinds, kinds  # no rank started
    hc = next(e for e in events if e["kind"] == "health_check")
    assert hc["attempt"] == 1 and hc["ok"] is False and hc["failed"] == ["checkpoint_space"]
    failed = next(e for e in events if e["kind"] == "failed")
    assert "checkpoint_space" in failed["reason"] and failed["exit_code"] == 1
    diag = ptops("diagnose", str(run))
    assert diag.returncode == 0 and "checkpoint_space" in diag.stdout, diag.stdout + diag.stderr


def test_a_healthy_real_run_records_its_checks(faulted_runs):
    run = faulted_runs.get("crash").run  # two attempts: checked before each
    events = [json.loads(x) for x in (run / "events.jsonl").read_text().splitlines()]
    hcs = [e for e in events if e["kind"] == "health_check"]
    launches = [e["attempt"] for e in events if e["kind"] == "launch"]
    assert [e["attempt"] for e in hcs] == launches and len(launches) >= 2
    assert all(e["ok"] and not e["failed"] for e in hcs)
    assert {c["name"] for c in hcs[0]["checks"]} == set(health.NAMES)


# ------------------------------------------------------- clocks, and every node of a Slurm job


def test_clock_skew_against_the_supervisors_clock(tmp_path):
    with health.ClockServer("tok", host="127.0.0.1") as clock:
        addr = ("127.0.0.1", clock.port)
        r = _by_name(health.run_checks(_ctx(tmp_path, clock=addr, clock_token="tok")))
        assert r["clock_skew"].ok is True and "0.0" in r["clock_skew"].detail, r["clock_skew"]
        late = _ctx(tmp_path, clock=addr, clock_token="tok", clock_offset_s=30.0)
        r = _by_name(health.run_checks(late))["clock_skew"]
        assert r.ok is False and "30.0" in r.detail and "ahead of" in r.detail, r
        offset, half = health.clock_offset(addr, "tok", skew=-5.0)
        assert abs(offset - 5.0) < 0.05 and 0 <= half < 0.05  # this node behind by 5 s
        # a request without the token gets no answer: the check fails, it does not pass
        wrong = _ctx(tmp_path, clock=addr, clock_token="nope", timeout_s=0.2)
        r = _by_name(health.run_checks(wrong))["clock_skew"]
        assert r.ok is False and "no answer" in r.detail, r


def test_a_nodes_report_is_trusted_only_as_far_as_its_shape():
    good = health.Result.from_report({"name": "gpus", "ok": None, "detail": "x"})
    assert good == health.Result("gpus", None, "x")
    for bad in ({"name": "made_up", "ok": True}, {"name": "gpus", "ok": "yes"}, ["gpus"], None):
        r = health.Result.from_report(bad)
        assert r.name == "report" and r.ok is False, bad


FAKE_SRUN = """#!/usr/bin/env python3
# A stand-in for srun: runs the command once per node of --nodelist with SLURMD_NODENAME set, as
# slurmd does; the nodes named in the file 'dead' beside it never answer.
import os, subprocess, sys
from pathlib import Path
args = sys.argv[1:]
nodes, i = [], 0
while args[i].startswith("--"):
    if args[i].startswith("--nodelist="):
        nodes = args[i].split("=", 1)[1].split(",")
    i += 1
dead_file = Path(__file__).with_name("dead")
dead = dead_file.read_text().split() if dead_file.exists() else []
Path(__file__).with_name("srun.args").write_text(" ".join(sys.argv[1:]))
for n in nodes:
    if n not in dead:
        subprocess.run(args[i:], env={**os.environ, "SLURMD_NODENAME": n}, check=True)
"""


@pytest.fixture
def fake_slurm(tmp_path, monkeypatch):
    bindir = tmp_path / "bin"
    bindir.mkdir()
    (bindir / "srun").write_text(FAKE_SRUN)
    (bindir / "sbatch").write_text(f"#!/bin/sh\necho \"$@\" > {bindir}/sbatch.args\necho '78;c'\n")
    for f in ("srun", "sbatch"):
        (bindir / f).chmod(0o755)
    monkeypatch.setenv("PATH", f"{bindir}{os.pathsep}{os.environ['PATH']}")
    return bindir


def _slurm_sup(tmp_path: Path, allocation: list[str], faults: list[str], *sets: str):
    from ptops.faultinject.spec import parse_all
    from ptops.ops.slurm.inside import SlurmSupervisor
    from ptops.ops.slurm.sbatch import write
    from ptops.ops.supervisor.launcher import prepare_run
    from ptops.recipes.schema import load, resolve_path

    rec, _ = load("titan-tiny", ["launch.nproc=1", "slurm.nodes=2", *sets])
    run = prepare_run(rec, resolve_path("titan-tiny"), tmp_path / "run")
    write(rec, run.path, [])
    sup = SlurmSupervisor(rec, run, parse_all(faults), allocation, "41")
    sup.cfg = sup.cfg.model_copy(update={"channel_advertise": "127.0.0.1"})
    sup.attempt = 1  # the run loop numbers the attempt before its health gate
    return sup


def _events(sup, kind: str) -> list[dict]:
    return [e for e in sup.run.read_events() if e["kind"] == kind]


def test_every_node_and_spare_is_checked_and_a_failing_node_is_swapped_before_the_attempt(
    tmp_path, fake_slurm
):
    """The check step runs on n1, n2 and the spare n3 (one srun); n2's clock reads 30 s ahead
    (clock-skew fault): n2 is out before attempt 1 (strike limit), n3 takes its place."""
    sup = _slurm_sup(
        tmp_path, ["n1", "n2", "n3"], ["clock-skew:node=n2"], "slurm.spare_nodes=1",
        "supervisor.health.skip=['rendezvous']",
    )  # fmt: skip
    assert sup.health_gate(1) is None
    assert sup.active == ["n1", "n3"] and sup.spares == []
    assert "--nodelist=n1,n2,n3" in (fake_slurm / "srun.args").read_text()
    hc = _events(sup, "health_check")[0]
    assert hc["ok"] is False and hc["nodes"] == ["n1", "n2", "n3"]
    assert hc["failed_nodes"] == {"n2": ["clock_skew"]} and hc["failed"] == ["clock_skew"]
    skew = next(c for c in hc["checks"] if c["node"] == "n2" and c["name"] == "clock_skew")
    assert "30.0" in skew["detail"] and "ahead of" in skew["detail"]
    assert all(c["ok"] for c in hc["checks"] if c["node"] != "n2" and c["name"] == "clock_skew")
    blamed = _events(sup, "node_blamed")[0]
    assert blamed["node"] == "n2" and blamed["strikes"] == blamed["limit"]
    assert blamed["reason"].startswith("health check: clock_skew:")
    assert _events(sup, "node_replaced")[0] | {"ts": 0} == {
        "ts": 0, "kind": "node_replaced", "attempt": 1, "node": "n2", "by": "n3", "spares_left": 0
    }  # fmt: skip
    inj = _events(sup, "fault_injected")
    assert [(e["node"], e["rank"]) for e in inj] == [("n2", None)], inj
    # the strike survives a requeue: the job's next supervisor leaves n2 out
    from ptops.ops.slurm.inside import SlurmSupervisor

    again = SlurmSupervisor(sup.recipe, sup.run, [], ["n1", "n2", "n3"], "41")
    assert again.active == ["n1", "n3"]


def test_no_spare_that_passed_resubmits_without_the_node(tmp_path, fake_slurm):
    """n2 silent (no report) and the spare n3 skewed: none can take n2's place, so the job is
    resubmitted with --exclude of both (exit 5: do not requeue this one)."""
    (fake_slurm / "dead").write_text("n2")
    sup = _slurm_sup(
        tmp_path, ["n1", "n2", "n3"], ["clock-skew:node=n3,offset_s=-4"], "slurm.spare_nodes=1",
        "supervisor.health.skip=['rendezvous']", "supervisor.health.node_timeout_s=30",
    )  # fmt: skip
    assert sup.health_gate(1) == 5
    hc = _events(sup, "health_check")[0]
    assert hc["failed_nodes"] == {"n2": ["report"], "n3": ["clock_skew"]}
    assert "no report from n2" in next(c for c in hc["checks"] if c["node"] == "n2")["detail"]
    assert (
        "behind"
        in next(c for c in hc["checks"] if c["name"] == "clock_skew" and c["node"] == "n3")[
            "detail"
        ]
    )
    assert "--exclude=n2,n3" in (fake_slurm / "sbatch.args").read_text()
    assert _events(sup, "slurm_requeue")[0]["how"] == "resubmit" and not _events(
        sup, "node_replaced"
    )


def test_every_node_failing_is_the_jobs_fault_not_a_nodes(tmp_path, fake_slurm):
    """The shared checkpoint storage too small on all nodes: no node is blamed, the run ends
    (exit 1) as a local one does, naming the check."""
    sup = _slurm_sup(
        tmp_path, ["n1", "n2"], [], "supervisor.health.min_free_mb=1e12",
        "supervisor.health.skip=['rendezvous']",
    )  # fmt: skip
    assert sup.health_gate(1) == 1
    assert not _events(sup, "node_blamed") and not (fake_slurm / "sbatch.args").exists()
    failed = _events(sup, "failed")[0]
    assert "checkpoint_space" in failed["reason"] and failed["exit_code"] == 1


def test_the_node_check_program_writes_one_report(tmp_path):
    """``python -m ptops.ops.node.health`` as srun starts it: its node's report file, whole."""
    import subprocess
    import sys

    out = tmp_path / "reports"
    ctx = _ctx(tmp_path, rendezvous=[])
    spec = {**ctx.to_dict(), "out": str(out), "skip": ["gpus"], "clock_offsets": {"n7": 2.5}}
    env = {**os.environ, "PTOPS_HEALTH": json.dumps(spec), "SLURMD_NODENAME": "n7"}
    proc = subprocess.run(
        [sys.executable, "-m", "ptops.ops.node.health"], env=env, capture_output=True, text=True
    )
    assert proc.returncode == 0 and "n7: ok" in proc.stdout, proc.stdout + proc.stderr
    report = json.loads((out / "n7.json").read_text())
    assert report["node"] == "n7" and report["injected"] == ["clock-skew:node=n7,offset_s=2.5"]
    assert [r["name"] for r in report["results"]] == [
        "checkpoint_space", "checkpoint_writable", "rendezvous", "gpu_xid", "clock_skew"
    ]  # fmt: skip
    assert [p.name for p in out.iterdir()] == ["n7.json"]  # no temporary file left
    bad = subprocess.run(
        [sys.executable, "-m", "ptops.ops.node.health"],
        env={**env, "SLURMD_NODENAME": "../x"}, capture_output=True, text=True,
    )  # fmt: skip
    assert bad.returncode == 2 and "cannot name a report file" in bad.stderr
