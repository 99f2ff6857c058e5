"""scripts/gpu_check.sh: without a GPU it says so in one line and exits 0; its recipe is valid."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from conftest import REPO


def test_gpu_check_without_gpu_exits_0_with_one_line():
    import torch

    assert not torch.cuda.is_available(), "this test is for machines without CUDA"
    p = subprocess.run(
        ["bash", "scripts/gpu_check.sh"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        env={"PATH": "/usr/bin:/bin", "PYTHON": sys.executable},
    )
    assert p.returncode == 0, p.stderr
    lines = p.stdout.strip().splitlines()
    assert len(lines) == 1 and "no CUDA GPU" in lines[0]
    assert (
        not (REPO / "bench" / "results" / "gpu_check.json").exists()
        or "gpus" in (REPO / "bench" / "results" / "gpu_check.json").read_text()
    )


def test_gpu_check_recipe_is_an_8b_shaped_float8_compiled_async_pinned_recipe():
    from ptops.recipes.schema import load

    rec, _ = load(REPO / "bench" / "gpu_check.toml")
    t = rec.titan
    assert (t.model.dim, t.model.n_heads) == (4096, 32)  # Llama-3 8B's layer width and heads
    assert t.float8.enabled and not t.float8.emulate and t.compile.enable
    assert t.async_checkpoint and t.pinned_memory_checkpoint


def test_gpu_check_recipe_passes_the_fake_backend_dry_run():
    """What can be checked here: TorchTitan builds the check's float8 + compile model and its
    parallelisation."""
    import json

    from conftest import run_ptops

    proc = run_ptops(
        "launch",
        str(REPO / "bench" / "gpu_check.toml"),
        "--dry-run",
        "--gpus-per-node",
        "8",
        "--json",
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    tt = json.loads(proc.stdout)["torchtitan"]
    assert tt["float8_modules"] == 20 and tt["mesh"]["dp_shard"] == 8 and tt["within_tolerance"]


def test_gpu_check_driver_on_cpu_smoke(tmp_path):
    """The driver's two runs and figures, on titan-tiny (CPU, float8 emulated): a crash then a hang
    found, two restarts, completed; async blocking measured against sync."""
    import json

    p = subprocess.run(
        [sys.executable, "bench/gpu_check.py", "--cpu-smoke", str(tmp_path)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert p.returncode == 0, p.stderr[-3000:] + p.stdout[-2000:]
    res = json.loads((tmp_path / "gpu_check.json").read_text())
    s = res["summary"]
    assert s["all_completed"] and s["restarts"] == 2
    assert s["crash_detect_s"] is not None and s["hang_detect_s"] is not None
    assert (
        res["faulted"]["crash"]["resumed_from_step"] == 10
        and res["faulted"]["hang"]["injected_at_step"] == 25
    )
    assert (
        s["sync_blocking_s"] > 0
        and s["async_pinned_blocking_s"] > 0
        and "async" in s["async_modes"]
    )


def test_trl_gpu_check_without_gpu_exits_0_with_one_line():
    p = subprocess.run(
        ["bash", "scripts/gpu_check_trl.sh"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        env={"PATH": "/usr/bin:/bin", "PYTHON": sys.executable},
    )
    assert p.returncode == 0, p.stderr
    lines = p.stdout.strip().splitlines()
    assert len(lines) == 1 and "no CUDA GPU" in lines[0]


def test_trl_gpu_check_driver_on_cpu_smoke(tmp_path):
    """The TRL driver's two runs on CPU (trl-sft-tiny): the crashed run restarts once and ends on
    the uninterrupted run's digest and losses. On the H200 all three tiny TRL recipes did
    (bench/results/gpu_check_trl.json)."""
    import json

    p = subprocess.run(
        [sys.executable, "bench/gpu_check_trl.py", "--cpu-smoke", str(tmp_path)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert p.returncode == 0, p.stderr[-3000:] + p.stdout[-2000:]
    res = json.loads((tmp_path / "gpu_check_trl.json").read_text())["trl-sft-tiny"]
    assert res["exact"] and res["crash"]["restarts"] == 1 and len(res["base"]["losses"]) == 8
    assert res["base"]["digest"] == res["crash"]["digest"]


# ---- the one-call GPU check: wheelhouse, stage budgets, the own-script stage (issue 22 point 6)


def _wheels(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", "scripts/gpu_wheels.sh", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_gpu_wheels_dry_run_pins_what_the_image_lacks_from_the_lock():
    """Every carried wheel is pinned by constraints.txt, and the [trl] extra's floors are met (the
    image's transformers 5.17 / tokenizers 0.23.2 are older than the extra allows, so they
    travel)."""
    p = _wheels("--dry-run")
    assert p.returncode == 0, p.stderr
    pins = dict(ln.split("==") for ln in p.stdout.splitlines() if "==" in ln)
    lines = (REPO / "constraints.txt").read_text().splitlines()
    norm = lambda n: n.lower().replace("_", "-")  # noqa: E731
    lock = {norm(ln.split("==")[0]): ln.split("==")[1].strip() for ln in lines if "==" in ln}
    assert {"trl", "datasets", "transformers", "tokenizers", "pydantic", "py-spy", "typer"} <= set(
        pins
    )
    for name, version in pins.items():
        assert lock[norm(name)] == version, name
    assert tuple(map(int, pins["transformers"].split(".")[:2])) >= (5, 24)
    assert "torch" not in pins and "ptops" in p.stdout


def test_gpu_wheels_size_check_refuses_an_oversized_wheelhouse(tmp_path):
    (tmp_path / "big.whl").write_bytes(b"")
    os.truncate(
        tmp_path / "big.whl", 41 * 1048576
    )  # sparse: its apparent size counts, as on the wire
    p = _wheels("--check", str(tmp_path))
    assert p.returncode == 1 and "over the 40 MiB cap" in p.stderr
    os.truncate(tmp_path / "big.whl", 39 * 1048576)
    p = _wheels("--check", str(tmp_path))
    assert p.returncode == 0 and "39 MiB" in p.stdout


def test_a_stage_over_its_budget_is_cut_with_its_process_group():
    """The check goes on after a stage overruns: it is recorded as cut, and what it started is
    gone."""
    from gpu_check_all import run_stage

    code = (
        "import subprocess, sys, time\n"
        "c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'])\n"
        "print('child', c.pid, flush=True); time.sleep(120)\n"
    )
    r = run_stage("slow", [sys.executable, "-c", code], budget=2)
    assert r["status"] == "cut" and r["wall_s"] < 30
    pid = int(next(ln for ln in r["tail"] if ln.startswith("child")).split()[1])
    time.sleep(0.5)
    try:  # gone, or a zombie that no one has reaped yet (killed all the same)
        state = (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        state = "gone"
    assert state in ("gone", "Z", "X"), state
    assert run_stage("quick", [sys.executable, "-c", "print('fine')"], budget=30)["status"] == "ok"


def test_titan_stage_is_skipped_with_the_import_error(tmp_path, monkeypatch):
    """Where TorchTitan does not import (the H200 image's torch 2.11), the stage records why, not a
    failure. That error cannot happen with this machine's torch, so a package of that name raises
    it."""
    from gpu_check_all import titan_why_not

    pkg = tmp_path / "torchtitan"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "train.py").write_text(
        "raise ImportError(\"cannot import name 'DataParallelMeshDims' from "
        "'torch.distributed.fsdp'\")\n"
    )
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    why = titan_why_not()
    assert why.startswith("torchtitan does not import on torch ") and "DataParallelMeshDims" in why


def test_script_stage_driver_on_cpu_smoke(tmp_path):
    """The own-script stage's two launches on CPU (gloo, one rank, a tiny MLP), side by side: a
    declared world of one runs; async saves commit; the exporter is scraped while the run is held,
    then released; a crash restarts from the warm pool, a hang leaves stacks and diagnose names it,
    an OOM is classified."""
    import json

    p = subprocess.run(
        [sys.executable, "bench/gpu_check_script.py", "--cpu-smoke", str(tmp_path)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    res = json.loads((tmp_path / "gpu_check_script.json").read_text())
    assert p.returncode == 0, (
        json.dumps(res.get("summary"), indent=1) + p.stderr[-2000:] + p.stdout[-2000:]
    )
    s = res["summary"]
    assert s["ok"] and s["world_of_one_accepted"] and s["warm_restart"] and s["hang_stacks"]
    assert s["diagnose_names_hang"] and s["oom_classified"] and s["crash_resumed_from"] == 4
    assert s["sync_blocking_s_median"] > 0 and s["async_blocking_s_median"] > 0
    assert (
        "ptops_loss" in res["async"]["exporter"]["families"]
        and res["async"]["exporter"]["released"]
    )
    assert res["sync"]["restarts"] == 3 and res["async"]["steps_recorded"][-1] == 10
    assert [la["ranks_from"] for la in res["sync"]["launches"][1:]] == ["warm"] * 3
