"""GRPO with its rollouts from a real vLLM engine (issue 48): vLLM's CPU build in its own
environment (``.venv-vllm``, made by ``scripts/setup.sh --vllm``, which ``scripts/test.sh`` runs),
the tiny policy (2 layers, heads of 32), 2 gloo ranks, the run launched by that environment's
``ptops`` as a user of the engine would.

- colocate (the engine inside each rank): an uninterrupted run, and the same run with a sync that
  silently does not apply before step 3 (``stale-sync``: the check finds it in its step, the sync
  is redone), a hang inside the sync before step 6 (found, named ``engine_sync``) and a crash at
  step 7 of the next attempt (checkpoint every 4): it ends at the uninterrupted run's digest;
- server (vLLM's OpenAI server as the run's sidecar, weights as files it reloads): a crash at step
  7; the steps redone after the restart are the ones attempt 1 trained (the same rollouts, the same
  loss); the server outlives the ranks' restart;
- the server's engine process dies before step 3's rollouts (``engine-crash``): restarted by the
  sidecar supervision, synced again, the same rollouts generated (the run's records equal the other
  server run's);
- a sync that never applies (``mode=persistent``): the run stops, exit 4, ``engine_stale``.

Runs made once for the module, two at a time. ``-m extended``: the server run against its own
uninterrupted baseline.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from conftest import REPO

ENGINE_PTOPS = REPO / ".venv-vllm" / "bin" / "ptops"
COMMON = [
    "--no-mlflow",
    *("--set", "train.steps=8"),
    *("--set", "checkpoint.interval=4"),
    *("--set", "supervisor.restart.backoff_s=0.2"),
]
CRASH = ["--fault", "crash:rank=1,step=7"]


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(
    run: Path, mode: str, *extra: str, recipe: str = "trl-grpo-tiny"
) -> subprocess.CompletedProcess:
    if not ENGINE_PTOPS.exists():
        pytest.fail(f"{ENGINE_PTOPS} is missing: bash scripts/setup.sh --vllm makes it")
    sets = ["--set", f"trl.vllm.mode={mode}"]
    if mode == "server":
        sets += ["--set", f"trl.vllm.port={_port()}"]
    return subprocess.run(
        [str(ENGINE_PTOPS), "launch", recipe, "--supervise", "--run-dir", str(run)]
        + COMMON
        + sets
        + list(extra),
        capture_output=True,
        text=True,
        timeout=900,
        env={**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"},
    )


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm-engine")
    plan = {  # the longest first
        # a hang inside the sync before step 6 (attempt 1), a crash at step 7 of attempt 2
        "server-crash": (
            "server",
            *("--fault", "sync-hang:step=6"),
            *("--fault", "crash:rank=1,step=7,attempt=2"),
        ),
        "colocate": ("colocate",),
        # a stale sync before step 3; a hang inside the sync before step 6 (attempt 1); a crash
        # at step 7 of attempt 2: three attempts, each restart from step 4
        "colocate-faults": (
            "colocate",
            *("--fault", "stale-sync:step=3"),
            *("--fault", "sync-hang:step=6"),
            *("--fault", "crash:rank=1,step=7,attempt=2"),
        ),
        # the engine dies before step 3's rollouts, and stops answering before step 5's
        "server-engine-crash": (
            "server",
            *("--fault", "engine-crash:step=3"),
            *("--fault", "engine-hang:step=5"),
        ),
        "stale-for-good": (
            "colocate",
            *("--set", "train.steps=4"),
            *("--fault", "stale-sync:step=3,mode=persistent"),
        ),
    }
    with ThreadPoolExecutor(max_workers=2) as pool:
        done = dict(zip(plan, pool.map(lambda n: _launch(root / n, *plan[n]), plan)))
    return {name: (root / name, proc) for name, proc in done.items()}


def _events(run: Path) -> list[dict]:
    return [json.loads(x) for x in (run / "events.jsonl").read_text().splitlines() if x.strip()]


def _kinds(run: Path, kind: str) -> list[dict]:
    return [e for e in _events(run) if e["kind"] == kind]


def _records(run: Path, rank: int = 0) -> list[dict]:
    lines = (run / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, filter(None, lines)) if r.get("rank") == rank]


def _ok(runs: dict, name: str) -> Path:
    run, proc = runs[name]
    assert proc.returncode == 0, f"{name}: exit {proc.returncode}\n{proc.stderr[-4000:]}"
    return run


def _digest(run: Path) -> str:
    out = subprocess.run(
        [str(ENGINE_PTOPS), "ckpt", "digest", str(run / "checkpoints" / "checkpoint-8")],
        capture_output=True,
        text=True,
        check=True,
    )
    return out.stdout.strip()


def _redone_steps_match(run: Path, steps: set[int]) -> None:
    """``steps`` ran in more than one attempt (each restart resumed from step 4): the same rollouts
    (rewards) and the same loss every time, on every rank."""
    for rank in (0, 1):
        by: dict[int, list[dict]] = {}
        for r in _records(run, rank):
            by.setdefault(r["step"], []).append(r)
        assert {s for s, rs in by.items() if len(rs) > 1} == steps, (rank, sorted(by))
        for step in steps:
            first, *again = by[step]
            for later in again:
                for key in ("loss", "reward", "rewards_format_mean", "engine/lp_gap"):
                    assert first.get(key) == later.get(key), (rank, step, key, first, later)


def _engine_keys_hold(run: Path) -> None:
    """Every step trained on rollouts of the policy synced just before it (version = step - 1,
    staleness 0), and the engine served the trainer's weights (fp32 both: the probe's gap is
    rounding)."""
    for rank in (0, 1):
        recs = _records(run, rank)
        assert {r["step"] for r in recs} == set(range(1, 9))
        for r in recs:
            assert r["engine/version"] == r["step"] - 1 and r["staleness"] == 0.0, r
            assert r["engine/lp_gap"] < 1e-4 and r["engine/sync_s"] > 0, r
            if rank == 0:  # the rollouts' throughput (server mode: rank 0 asks the engine)
                assert r["engine/tokens"] > 0 and r["engine/tokens_per_s"] > 0, r


def test_colocate_engine_recovers_a_stale_sync_a_hung_sync_and_a_crash_exactly(runs):
    base = _ok(runs, "colocate")
    run = _ok(runs, "colocate-faults")
    assert _kinds(base, "engine_resync") == [] and _kinds(base, "crash") == []
    # the hang inside the sync is found and named by its seam
    (hang,) = _kinds(run, "hang")
    assert hang["attempt"] == 1 and hang["phase"] == "engine_sync" and hang["step"] == 6, hang
    # the sync before step 3 did not apply: found in that step by each rank's check, redone
    resync = _kinds(run, "engine_resync")
    assert sorted(e["rank"] for e in resync) == [0, 1], resync
    assert all(e["step"] == 2 and e["gap"] > 1e-3 and e["mode"] == "colocate" for e in resync)
    assert [r["engine/resyncs"] for r in _records(run) if r["step"] == 3] == [1.0]
    assert _kinds(run, "engine_stale") == []
    (crash,) = _kinds(run, "crash")
    assert crash["rank"] == 1 and crash["attempt"] == 2
    assert [r["from_step"] for r in _kinds(run, "restart")] == [4, 4]
    _redone_steps_match(run, {5, 6})
    _engine_keys_hold(run)
    _engine_keys_hold(base)
    # the rollouts after the restart are the ones an uninterrupted run draws: the same weights
    assert _digest(run) == _digest(base)


def test_server_engine_outlives_a_hang_and_a_crash_of_the_ranks_and_the_redone_steps_match(runs):
    run = _ok(runs, "server-crash")
    started = _kinds(run, "sidecar_started")
    assert [s["name"] for s in started] == ["vllm"], started  # once: the server outlived attempt 1
    assert "vllm.entrypoints.openai.api_server" in started[0]["argv"]
    assert _kinds(run, "sidecar_died") == []
    assert [r["from_step"] for r in _kinds(run, "restart")] == [4, 4]
    # the hang names its seam, the engine's model version, and both sides' stacks
    (hang,) = _kinds(run, "hang")
    assert hang["phase"] == "engine_sync" and hang["step"] == 6, hang
    last = [r for r in _records(run) if r["attempt"] == 1 and "engine/version" in r][-1]
    assert hang["engine_version"] == int(last["engine/version"]), (hang, last)
    other_side = Path(hang["stack_sources"]["sidecars"]).read_text()
    assert "#### sidecar pid" in other_side and "py-spy" in other_side, other_side[:2000]
    assert "vllm" in other_side, other_side[:2000]  # the engine's own frames
    _redone_steps_match(run, {5, 6})
    _engine_keys_hold(run)
    # the weights travel as a file the server reloads
    assert (run / "engine" / "weights" / "model.safetensors").stat().st_size > 100_000


def test_a_crashed_server_engine_is_restarted_synced_and_the_step_goes_on_unchanged(runs):
    """The engine's process exits before step 3's rollouts, and stops answering (alive) before step
    5's: each time the sidecar supervision restarts it, the seam finds it holds no synced version,
    syncs it, and generates with the same seed. Nothing is lost or counted twice: every step's
    record equals the other server run's (same seeds) before its own hang, and no rank restarted."""
    run = _ok(runs, "server-engine-crash")
    died = _kinds(run, "sidecar_died")
    assert [e["name"] for e in died] == ["vllm", "vllm"], died
    # the hang (engine-hang: every process alive, silent) is found by its health checks (the
    # crash by either: its API server may outlive the engine's core for a few checks)
    assert "failed health checks" in died[1]["reason"], died
    assert [e["name"] for e in _kinds(run, "sidecar_restarted")] == ["vllm", "vllm"]
    assert _kinds(run, "restart") == [] and _kinds(run, "crash") == [] and _kinds(run, "hang") == []
    resync = _kinds(run, "engine_resync")
    assert [e["step"] for e in resync] == [2, 4], resync
    assert all("the engine restarted: it holds version -1" in e["why"] for e in resync)
    other, _ = runs["server-crash"]
    for rank in (0, 1):
        mine = {r["step"]: r for r in _records(run, rank)}
        theirs = {r["step"]: r for r in _records(other, rank) if r["attempt"] == 1}
        for step in range(1, 6):
            for key in ("loss", "reward", "rewards_format_mean"):
                assert mine[step][key] == theirs[step][key], (rank, step, key)
    _engine_keys_hold(run)


def test_an_engine_that_never_takes_the_weights_stops_the_run(runs):
    run, proc = runs["stale-for-good"]
    assert proc.returncode == 4, proc.stderr[-3000:]
    stale = _kinds(run, "engine_stale")
    assert sorted(e["rank"] for e in stale) == [0, 1]
    assert all(e["step"] == 2 and e["version"] == 1 for e in stale), stale
    assert len(_kinds(run, "restart")) == 0  # a restart would sync the same way
    (failed,) = _kinds(run, "failed")
    assert "EngineStaleWeights" in failed["reason"] and "stale weights" in failed["reason"]
    assert "runbooks/EngineStaleWeights.md" in proc.stderr
    diag = subprocess.run(
        [str(ENGINE_PTOPS), "diagnose", str(run)], capture_output=True, text=True, timeout=300
    )
    assert "EngineStaleWeights" in diag.stdout, diag.stdout[-3000:]


@pytest.fixture(scope="module")
def server_base(tmp_path_factory):
    run = tmp_path_factory.mktemp("vllm-server-base") / "run"
    proc = _launch(run, "server")
    assert proc.returncode == 0, proc.stderr[-4000:]
    return run


def test_server_engine_recovery_ends_at_the_uninterrupted_digest(runs, server_base):
    assert _digest(_ok(runs, "server-crash")) == _digest(server_base)


def test_rloo_with_a_colocated_engine_recovers_a_crash_exactly(tmp_path):
    """RLOO takes the same seam (TRL's VLLMGeneration): a crash at step 7 ends at the uninterrupted
    run's digest, every step's rollouts from the policy synced just before it."""
    base = _launch(tmp_path / "base", "colocate", recipe="trl-rloo-tiny")
    run = _launch(tmp_path / "crash", "colocate", *CRASH, recipe="trl-rloo-tiny")
    assert base.returncode == 0 and run.returncode == 0, (base.stderr[-3000:], run.stderr[-3000:])
    _redone_steps_match(tmp_path / "crash", {5, 6})
    assert _digest(tmp_path / "crash") == _digest(tmp_path / "base")
