"""Checkpoints end to end in the real engines (TorchTitan and TRL, 2 CPU ranks, gloo).

Every scenario goes through the real ``ptops launch`` CLI and ends, where it
finishes, with the same final checkpoint digest (``ptops.ckpt.digest``: model and
optimizer tensors) as an uninterrupted run:

- a finished run whose newest checkpoint is corrupted (shard truncated, bytes
  flipped without a size change, ``.metadata`` deleted; TRL: ``optimizer.pt``
  deleted): ``ptops ckpt verify`` exits 1 naming the file, and rerunning the run
  falls back to the previous checkpoint, quarantines the bad one
  (``checkpoint_invalid``) and redoes the lost steps;
- ENOSPC during a save (the ``enospc`` fault): ``checkpoint_failed``, training
  goes on, the next save commits;
- a rank SIGKILLed in the middle of a save (the ``crash:phase=save`` fault): the
  half-written checkpoint never becomes LATEST and is never resumed from;
- Ctrl-C of the supervisor: the ranks checkpoint the current step, exit 130, and
  a rerun resumes from that step.

Each launch spends most of its time importing torch/torchtitan/trl in both ranks
(~15-25 s here); runs are shared through module fixtures.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import REPO

from ptops.ops.runrecord.rundir import read_jsonl

TITAN = "recipes/titan-tiny.toml"
TRL = "recipes/trl-sft-tiny.toml"
STEPS = 8
TITAN_SETS = [f"train.steps={STEPS}", "checkpoint.interval=4"]
TRL_SETS = [f"train.steps={STEPS}", "checkpoint.interval=4"]
TIMEOUT = 300

pytestmark = pytest.mark.slow


# ----------------------------------------------------------------- helpers
def _env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = "1"
    env.pop("PTOPS_RANK_LOGS", None)
    env.update(extra or {})
    return env


def _logs(run_dir: Path) -> str:
    out = []
    for p in sorted(run_dir.glob("logs/attempt-*/rank-*.log")):
        out.append(f"--- {p.relative_to(run_dir)}\n{p.read_text(errors='replace')[-2000:]}")
    return "\n".join(out) or "(no rank logs)"


def launch(
    run_dir: Path,
    recipe: str,
    sets: list[str],
    *,
    faults: tuple[str, ...] = (),
    supervise: bool = False,
    env: dict[str, str] | None = None,
    expect: int = 0,
) -> subprocess.CompletedProcess:
    argv = [sys.executable, "-m", "ptops", "launch", recipe, "--run-dir", str(run_dir)]
    for s in sets:
        argv += ["--set", s]
    for f in faults:
        argv += ["--fault", f]
    if supervise:
        argv += ["--supervise"]
    proc = subprocess.run(
        argv, cwd=REPO, env=_env(env), capture_output=True, text=True, timeout=TIMEOUT
    )
    if proc.returncode != expect:
        raise AssertionError(
            f"ptops launch {recipe} {sets} {faults} exited {proc.returncode} (expected {expect})\n"
            f"{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}\n{_logs(run_dir)}"
        )
    return proc


def ptops(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "ptops", *args],
        cwd=REPO,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )


def events(run_dir: Path, kind: str | None = None) -> list[dict]:
    return [e for e in read_jsonl(run_dir / "events.jsonl") if kind is None or e["kind"] == kind]


def digest(path: Path) -> str:
    from ptops.ckpt import digest as _digest

    return _digest(path)


def latest(run_dir: Path) -> str:
    return (run_dir / "checkpoints" / "LATEST").read_text().strip()


def rank0_steps(run_dir: Path, attempt: int) -> list[int]:
    return [
        r["step"]
        for r in read_jsonl(run_dir / "metrics.jsonl")
        if r["rank"] == 0 and r.get("attempt") == attempt
    ]


def copy_run(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("supervisor", "status.json"))
    return dst


def flip_bytes(f: Path) -> None:
    size = f.stat().st_size
    with open(f, "r+b") as fh:
        fh.seek(size // 2)
        b = fh.read(64)
        fh.seek(size // 2)
        fh.write(bytes(x ^ 0xFF for x in b))
    assert f.stat().st_size == size


def truncate(f: Path) -> None:
    with open(f, "r+b") as fh:
        fh.truncate(f.stat().st_size // 2)


# ----------------------------------------------------------------- TorchTitan
@pytest.fixture(scope="module")
def titan_base(tmp_path_factory) -> tuple[Path, str]:
    """Uninterrupted titan run: step-4 (async save) and step-8 (final, sync); its final digest."""
    run = tmp_path_factory.mktemp("titan") / "base"
    launch(run, TITAN, TITAN_SETS)
    return run, digest(run / "checkpoints" / f"step-{STEPS}")


def test_titan_commit_protocol_and_one_event_per_save(titan_base):
    run, _ = titan_base
    ck = events(run, "checkpoint")
    assert [e["step"] for e in ck] == [4, 8], ck  # exactly one per save, from the engine (rank 0)
    for e in ck:
        assert e["rank"] == 0 and Path(e["path"]).name == f"step-{e['step']}"
        assert 0 < e["blocking_s"] <= e["total_s"], e
    assert ck[0]["mode"] == "async" and ck[1]["mode"] == "sync"  # the final save is synchronous
    assert latest(run) == "step-8"
    for step in (4, 8):
        d = run / "checkpoints" / f"step-{step}"
        assert (d / "ptops-manifest.json").is_file() and not (d / ".writing").exists()
        assert ptops("ckpt", "verify", str(d)).returncode == 0
    assert not events(run, "checkpoint_failed") and not events(run, "checkpoint_invalid")
    # each committed checkpoint was read back and verified by rank 0 in the background
    assert sorted(e["step"] for e in events(run, "checkpoint_verified")) == [4, 8]
    assert not events(run, "checkpoint_skipped")


def test_titan_save_while_the_previous_is_writing_is_skipped_and_recorded(titan_base, tmp_path):
    """The step-2 async save is held "still writing" (``slow-save:step=2,until=skipped``: its commit
    waits until a later save is skipped): the step-4 save is skipped on both ranks
    (``checkpoint_skipped``), never queued behind it; the final step 8 saves; training is the same
    (digest equal to the uninterrupted run). Step 6 is saved, or skipped too when step 2's commit
    (released by the skip) took longer than two steps on a loaded machine: both are right, and each
    save is either skipped or committed, never both."""
    _, want = titan_base
    run = tmp_path / "skip"
    launch(
        run,
        TITAN,
        [f"train.steps={STEPS}", "checkpoint.interval=2"],
        faults=("slow-save:step=2,until=skipped",),
    )
    fired = events(run, "fault_injected")
    assert sorted((e["rank"], e["step"]) for e in fired) == [(0, 2), (1, 2)], fired
    sk = [(e["step"], e["writing_step"], e["rank"]) for e in events(run, "checkpoint_skipped")]
    assert sk in ([(4, 2, 0)], [(4, 2, 0), (6, 2, 0)]), sk
    saved = [s for s in (2, 4, 6, 8) if s not in {s for s, _, _ in sk}]
    assert [e["step"] for e in events(run, "checkpoint")] == saved
    for s, _, _ in sk:
        assert not (run / "checkpoints" / f"step-{s}").exists()
    assert sorted(e["step"] for e in events(run, "checkpoint_verified")) == saved
    assert digest(run / "checkpoints" / f"step-{STEPS}") == want


def test_titan_async_checkpoint_equals_a_sync_one(titan_base, tmp_path):
    """The async save of step 4 (staged by the adapter's persistent stager, ``FlatStager`` on a CPU)
    holds the same model and optimizer tensors as a synchronous save of the same step, and so does
    the end."""
    base, want = titan_base
    # the base run's async save split the fused QKV after the staging copy, off the training thread
    assert [e.get("qkv_split") for e in events(base, "checkpoint")] == ["background", None]
    run = tmp_path / "sync"
    launch(run, TITAN, [*TITAN_SETS, "titan.async_checkpoint=false"])
    assert [e["mode"] for e in events(run, "checkpoint")] == ["sync", "sync"]
    assert digest(run / "checkpoints" / "step-4") == digest(base / "checkpoints" / "step-4")
    assert digest(run / "checkpoints" / f"step-{STEPS}") == want


def test_titan_async_qkv_split_off_the_training_thread_writes_the_same_files(titan_base, tmp_path):
    """The async save with the fused-QKV split after the staging copy
    (``recipes/titan/qkvsplit.py``) writes the files torchtitan's own hook writes
    (``PTOPS_CKPT_QKV_SPLIT=inline``): shard files byte for byte, the same ``.metadata`` entries in
    the same order; the event says where blocking went."""
    import pickle

    base, _ = titan_base
    run = tmp_path / "inline"
    launch(run, TITAN, TITAN_SETS, env={"PTOPS_CKPT_QKV_SPLIT": "inline"})
    ck = events(run, "checkpoint")
    assert [(e["mode"], e.get("qkv_split")) for e in ck] == [("async", "inline"), ("sync", None)], (
        ck
    )
    bg = events(base, "checkpoint")[0]
    for e in (ck[0], bg):
        parts = [e[k] for k in ("prep_s", "state_dict_s", "call_s", "wait_s")]
        assert all(p >= 0 for p in parts) and sum(parts) <= e["blocking_s"] + 1e-3, e
    a, b = base / "checkpoints" / "step-4", run / "checkpoints" / "step-4"
    shards = sorted(p.name for p in a.glob("*.distcp"))
    assert shards == sorted(p.name for p in b.glob("*.distcp")) and len(shards) == 2
    for name in shards:
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    ma, mb = (pickle.loads((d / ".metadata").read_bytes()) for d in (a, b))
    assert list(ma.state_dict_metadata.items()) == list(mb.state_dict_metadata.items())
    assert ma.storage_data == mb.storage_data
    assert "layers.0.attention.qkv_linear.wk.weight" in ma.state_dict_metadata
    assert digest(a) == digest(b)


@pytest.mark.parametrize("how", ["truncate", "flip", "delete_metadata"])
def test_titan_verify_names_the_corrupted_file(titan_base, tmp_path, how):
    run, _ = titan_base
    ck = tmp_path / "step-8"
    shutil.copytree(run / "checkpoints" / "step-8", ck)
    victim = {"truncate": "__1_0.distcp", "flip": "__0_0.distcp", "delete_metadata": ".metadata"}[
        how
    ]
    if how == "truncate":
        truncate(ck / victim)
    elif how == "flip":
        flip_bytes(ck / victim)
    else:
        (ck / victim).unlink()
    res = ptops("ckpt", "verify", str(ck))
    assert res.returncode == 1, (res.stdout, res.stderr)
    assert victim in res.stdout + res.stderr


def test_titan_rerun_with_bad_final_checkpoint_redoes_the_lost_steps(titan_base, tmp_path):
    """Flipped bytes keep every size: only the hashes notice. The supervisor must not call
    the run complete; the engine quarantines step-8, resumes from step-4, redoes 5-8."""
    base, want = titan_base
    run = copy_run(base, tmp_path / "flip")
    flip_bytes(run / "checkpoints" / "step-8" / "__1_0.distcp")
    launch(run, TITAN, TITAN_SETS, supervise=True)
    inv = events(run, "checkpoint_invalid")
    assert (
        len(inv) == 1
        and Path(inv[0]["path"]).name == "step-8"
        and "__1_0.distcp" in inv[0]["reason"]
    ), inv
    assert Path(inv[0]["moved_to"]).parent.name == "invalid"
    assert events(run, "launch")[-1]["from_step"] == 4
    assert rank0_steps(run, 2) == [5, 6, 7, 8]
    assert latest(run) == "step-8"
    assert digest(run / "checkpoints" / "step-8") == want
    assert digest(run) == want


def test_titan_rerun_without_metadata_unsupervised(titan_base, tmp_path):
    base, want = titan_base
    run = copy_run(base, tmp_path / "nometa")
    (run / "checkpoints" / "step-8" / ".metadata").unlink()
    launch(run, TITAN, TITAN_SETS)
    assert [Path(e["path"]).name for e in events(run, "checkpoint_invalid")] == ["step-8"]
    assert rank0_steps(run, 2) == [5, 6, 7, 8]
    assert digest(run) == want


@pytest.fixture(scope="module")
def titan_faulty(tmp_path_factory) -> Path:
    """interval 2: ENOSPC at the save of step 2, rank 1 SIGKILLed in the middle of the save of
    step 6 (first attempt: the run fails), then the rerun."""
    run = tmp_path_factory.mktemp("titan") / "faulty"
    sets = [f"train.steps={STEPS}", "checkpoint.interval=2"]
    launch(run, TITAN, sets, faults=("enospc:step=2", "crash:phase=save,rank=1,step=6"), expect=1)
    snapshot = {
        "latest": latest(run),
        "step6_verify": ptops("ckpt", "verify", str(run / "checkpoints" / "step-6")).returncode,
        "events": events(run),
    }
    (run / "attempt1.json").write_text(json.dumps(snapshot))
    launch(run, TITAN, sets, faults=("enospc:step=2",))
    return run


def test_titan_enospc_save_fails_and_training_goes_on(titan_faulty, titan_base):
    run = titan_faulty
    first = json.loads((run / "attempt1.json").read_text())["events"]
    failed = [e for e in first if e["kind"] == "checkpoint_failed" and e["step"] == 2]
    assert len(failed) == 1 and "No space left on device" in failed[0]["error"], first
    assert any(e["kind"] == "fault_injected" and e["fault"].startswith("enospc") for e in first)
    # the next interval tried again and committed
    assert [e["step"] for e in first if e["kind"] == "checkpoint"] == [4]
    assert not (run / "checkpoints" / "step-2").exists()
    assert digest(run) == titan_base[1]


def test_titan_kill_in_save_never_becomes_latest(titan_faulty, titan_base):
    run = titan_faulty
    snap = json.loads((run / "attempt1.json").read_text())
    assert snap["latest"] == "step-4"  # the half-written step-6 never got LATEST
    assert snap["step6_verify"] == 1
    assert not any(e["kind"] == "checkpoint" and e["step"] == 6 for e in snap["events"])
    killed = [
        e
        for e in snap["events"]
        if e["kind"] == "fault_injected" and e["fault"].startswith("crash")
    ]
    assert [(e["rank"], e["step"]) for e in killed] == [(1, 6)], killed
    # the rerun did not resume from it: quarantined, back to step-4, steps 5-8 redone
    inv = [e for e in events(run, "checkpoint_invalid") if Path(e["path"]).name == "step-6"]
    assert len(inv) == 1, events(run)
    assert rank0_steps(run, 2) == [5, 6, 7, 8]
    assert latest(run) == "step-8"
    assert [e["step"] for e in events(run, "checkpoint") if e["attempt"] == 2] == [6, 8]
    assert digest(run) == titan_base[1]


def _wait_held(run: Path, nranks: int, proc: subprocess.Popen, timeout: float = 120) -> None:
    """Until every rank has announced its hold (the pings go on, so nothing times out meanwhile)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(
                f"launch ended early ({proc.returncode}): {proc.stderr.read()[-2000:]}"
            )
        held = {
            e.get("rank")
            for e in events(run, "fault_injected")
            if str(e.get("fault", "")).startswith("hold")
        }
        if len(held) >= nranks:
            return
        time.sleep(0.2)
    raise AssertionError(f"{run}: the ranks did not announce their hold within {timeout}s")


def _wait_steps(run: Path, n: int, proc: subprocess.Popen, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(
                f"launch ended early ({proc.returncode}): {proc.stderr.read()[-2000:]}"
            )
        try:
            done = [r for r in read_jsonl(run / "metrics.jsonl") if r["rank"] == 0]
        except FileNotFoundError:
            done = []
        if len(done) >= n:
            return
        time.sleep(0.2)
    raise AssertionError(f"{run}: fewer than {n} steps after {timeout}s")


def test_titan_stop_request_checkpoints_current_step_and_resumes(tmp_path):
    """Ctrl-C of the supervisor: every rank agrees at a step's end, that step is saved and
    committed, exit 130; the rerun resumes from exactly that step. The ranks are held before
    step 4 (not raced against the run's end); the stop request ends the hold."""
    run = tmp_path / "stop"
    sets = ["train.steps=30", "checkpoint.interval=1000"]
    argv = [
        sys.executable,
        "-m",
        "ptops",
        "launch",
        TITAN,
        "--run-dir",
        str(run),
        "--supervise",
        "--fault",
        "hold:step=4",
    ]
    for s in sets:
        argv += ["--set", s]
    proc = subprocess.Popen(
        argv, cwd=REPO, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        _wait_steps(run, 3, proc)
        _wait_held(run, 2, proc)
        sup = json.loads((run / "status.json").read_text())["supervisor_pid"]
        os.kill(int(sup), signal.SIGINT)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, err[-2000:]
    stopped = events(run, "stopped")[-1]
    ck = events(run, "checkpoint")
    assert len(ck) == 1 and ck[0]["step"] == stopped["step"] == 4, (ck, stopped)
    assert {e["by"] for e in events(run, "hold_released")} == {"release"}
    step = ck[0]["step"]
    assert latest(run) == f"step-{step}"
    assert ptops("ckpt", "verify", str(run / "checkpoints" / f"step-{step}")).returncode == 0
    launch(run, TITAN, sets, supervise=True)
    assert events(run, "launch")[-1]["from_step"] == step
    assert rank0_steps(run, 2)[0] == step + 1
    assert latest(run) == "step-30"


# ----------------------------------------------------------------- TRL
@pytest.fixture(scope="module")
def trl_base(tmp_path_factory) -> tuple[Path, str]:
    run = tmp_path_factory.mktemp("trl") / "base"
    launch(run, TRL, TRL_SETS)
    return run, digest(run / "checkpoints" / f"checkpoint-{STEPS}")


def test_trl_missing_optimizer_verify_and_rerun(trl_base, tmp_path):
    base, want = trl_base
    assert [e["step"] for e in events(base, "checkpoint")] == [4, 8]
    run = copy_run(base, tmp_path / "noopt")
    (run / "checkpoints" / "checkpoint-8" / "optimizer.pt").unlink()
    res = ptops("ckpt", "verify", str(run / "checkpoints" / "checkpoint-8"))
    assert res.returncode == 1 and "optimizer.pt" in res.stdout + res.stderr, (
        res.stdout,
        res.stderr,
    )
    launch(run, TRL, TRL_SETS)
    inv = events(run, "checkpoint_invalid")
    assert (
        len(inv) == 1
        and Path(inv[0]["path"]).name == "checkpoint-8"
        and "optimizer.pt" in inv[0]["reason"]
    ), inv
    assert rank0_steps(run, 2) == [5, 6, 7, 8]
    assert latest(run) == "checkpoint-8"
    assert digest(run) == want


def test_trl_enospc_save_fails_and_training_goes_on(trl_base, tmp_path):
    run = tmp_path / "enospc"
    launch(run, TRL, [f"train.steps={STEPS}", "checkpoint.interval=2"], faults=("enospc:step=4",))
    failed = events(run, "checkpoint_failed")
    assert [e["step"] for e in failed] == [4] and "No space left on device" in failed[0]["error"], (
        failed
    )
    assert [e["step"] for e in events(run, "checkpoint")] == [2, 6, 8]
    assert latest(run) == "checkpoint-8"
    assert digest(run) == trl_base[1]
