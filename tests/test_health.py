"""Health checks before work (issue 26, item 3): the table, each check failing on demand, and a real
launch that a failing check ends before any rank starts, with the incident naming the check."""

from __future__ import annotations

import json
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
    assert [x.name for x in health.run_checks(_ctx(tmp_path), skip=["gpus", "rendezvous"])] == [
        "checkpoint_space",
        "checkpoint_writable",
    ]


class _Nvml:
    """An NVML stand-in (no GPU on this machine): ``count`` devices, ``ecc`` errors on GPU 1."""

    def __init__(self, count: int, ecc: int = 0):
        self.count, self.ecc = count, ecc

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
        (_Nvml(2), None, True, "(2 wanted)"),  # no stated count: launch.nproc
        (_Nvml(0), None, None, "a CPU run"),
    ],
)
def test_gpus_through_nvml(tmp_path, nvml, expected, ok, words):
    r = _by_name(health.run_checks(_ctx(tmp_path, nvml=nvml, expected_gpus=expected, nproc=2)))[
        "gpus"
    ]
    assert r.ok is ok and words in r.detail, r


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
