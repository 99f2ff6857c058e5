"""scripts/gpu_check.sh: without a GPU it says so in one line and exits 0; its recipe is valid."""

from __future__ import annotations

import subprocess
import sys

from conftest import REPO


def test_gpu_check_without_gpu_exits_0_with_one_line():
    import torch

    assert not torch.cuda.is_available(), "this test is for machines without CUDA"
    p = subprocess.run(["bash", "scripts/gpu_check.sh"], cwd=REPO, capture_output=True, text=True, timeout=300,
                       env={"PATH": "/usr/bin:/bin", "PYTHON": sys.executable})
    assert p.returncode == 0, p.stderr
    lines = p.stdout.strip().splitlines()
    assert len(lines) == 1 and "no CUDA GPU" in lines[0]
    assert not (REPO / "bench" / "results" / "gpu_check.json").exists() or "gpus" in (
        REPO / "bench" / "results" / "gpu_check.json").read_text()


def test_gpu_check_recipe_is_an_8b_shaped_float8_compiled_async_pinned_recipe():
    from ptops.recipes.schema import load

    rec, _ = load(REPO / "bench" / "gpu_check.toml")
    t = rec.titan
    assert (t.model.dim, t.model.n_heads) == (4096, 32)  # Llama-3 8B's layer width and heads
    assert t.float8.enabled and not t.float8.emulate and t.compile.enable
    assert t.async_checkpoint and t.pinned_memory_checkpoint


def test_gpu_check_recipe_passes_the_fake_backend_dry_run():
    """What can be checked here: TorchTitan builds the check's float8 + compile model and its parallelisation."""
    import json

    from conftest import run_ptops

    proc = run_ptops("launch", str(REPO / "bench" / "gpu_check.toml"), "--dry-run", "--gpus-per-node", "8", "--json",
                     timeout=900)
    assert proc.returncode == 0, proc.stderr[-2000:]
    tt = json.loads(proc.stdout)["torchtitan"]
    assert tt["float8_modules"] == 20 and tt["mesh"]["dp_shard"] == 8 and tt["within_tolerance"]


def test_gpu_check_driver_on_cpu_smoke(tmp_path):
    """The driver's two runs and figures, on titan-tiny (CPU, float8 emulated): a crash then a hang found,
    two restarts, completed; async blocking measured against sync."""
    import json

    p = subprocess.run([sys.executable, "bench/gpu_check.py", "--cpu-smoke", str(tmp_path)], cwd=REPO,
                       capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stderr[-3000:] + p.stdout[-2000:]
    res = json.loads((tmp_path / "gpu_check.json").read_text())
    s = res["summary"]
    assert s["all_completed"] and s["restarts"] == 2
    assert s["crash_detect_s"] is not None and s["hang_detect_s"] is not None
    assert res["faulted"]["crash"]["resumed_from_step"] == 10 and res["faulted"]["hang"]["injected_at_step"] == 25
    assert s["sync_blocking_s"] > 0 and s["async_pinned_blocking_s"] > 0 and "async" in s["async_modes"]


def test_trl_gpu_check_without_gpu_exits_0_with_one_line():
    p = subprocess.run(["bash", "scripts/gpu_check_trl.sh"], cwd=REPO, capture_output=True, text=True, timeout=300,
                       env={"PATH": "/usr/bin:/bin", "PYTHON": sys.executable})
    assert p.returncode == 0, p.stderr
    lines = p.stdout.strip().splitlines()
    assert len(lines) == 1 and "no CUDA GPU" in lines[0]


def test_trl_gpu_check_driver_on_cpu_smoke(tmp_path):
    """The TRL driver's two runs on CPU (trl-sft-tiny): the crashed run restarts once and ends on the
    uninterrupted run's digest and losses. On the H200 all three tiny TRL recipes did
    (bench/results/gpu_check_trl.json)."""
    import json

    p = subprocess.run([sys.executable, "bench/gpu_check_trl.py", "--cpu-smoke", str(tmp_path)], cwd=REPO,
                       capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stderr[-3000:] + p.stdout[-2000:]
    res = json.loads((tmp_path / "gpu_check_trl.json").read_text())["trl-sft-tiny"]
    assert res["exact"] and res["crash"]["restarts"] == 1 and len(res["base"]["losses"]) == 8
    assert res["base"]["digest"] == res["crash"]["digest"]
