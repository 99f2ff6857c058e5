"""``ptops pipeline`` for real: TRL SFT -> DPO -> GRPO on the tiny model, each stage a supervised
launch.

Two shared pipelines (module fixtures, ~90 s of CPU together):

- ``main``: 4 stages (the last a rejection-sampling SFT on GRPO's samples); stage 2 (DPO) crashes at
  step 3 with restarts off, so the first ``ptops pipeline`` stops there (exit 1); the same command
  again skips stage 1 (by its recorded digest), resumes stage 2 from its checkpoint at step 2 and
  runs stages 3 and 4. SFT and GRPO run a held-out eval (``eval/heldout``); SFT is gated on it (a
  gate that passes). MLflow is real (SQLite).
- ``gated``: SFT gated on ``eval/heldout >= 0.5``, which the tiny model never reaches: the pipeline
  stops with the gate's message; stage 2 never starts; then the stage's final checkpoint is damaged
  and a rerun refuses to build on it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO

from ptops.ops.runrecord.rundir import read_jsonl


def env() -> dict[str, str]:
    """At call time: the session's standing pool and PTOPS_MLFLOW are set after collection."""
    out = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    out.pop("PTOPS_RANK_LOGS", None)
    return out


MAIN = """
name = "pipe-test"

[[stage]]
name = "sft"
recipe = "trl-sft-tiny"
set = ["train.steps=4", "checkpoint.interval=2", "eval.interval=2", "eval.size=8"]
gate = { metric = "eval/heldout", op = ">=", value = 0.0 }

[[stage]]
name = "dpo"
recipe = "trl-dpo-tiny"
input = "sft"
set = ["train.steps=4", "checkpoint.interval=2", "supervisor.restart.max_restarts=0"]
faults = ["crash:rank=1,step=3"]

[[stage]]
name = "grpo"
recipe = "trl-grpo-tiny"
input = "dpo"
set = ["train.steps=4", "checkpoint.interval=2", "eval.interval=2", "eval.size=8", "trl.verifier=true"]

[[stage]]
name = "rs"
kind = "rejection-sampling"
recipe = "trl-sft-tiny"
input = "grpo"
sampling = { n = 4, prompts = 12 }
set = ["train.steps=2", "checkpoint.interval=2", "trl.per_device_batch_size=2"]
"""  # noqa: E501

GATED = """
name = "pipe-gated"

[[stage]]
name = "sft"
recipe = "trl-sft-tiny"
set = ["train.steps=2", "checkpoint.interval=2", "eval.interval=2", "eval.size=8"]
gate = { metric = "eval/heldout", op = ">=", value = 0.5 }

[[stage]]
name = "dpo"
recipe = "trl-dpo-tiny"
input = "sft"
set = ["train.steps=2"]
"""


def pipeline(file: Path, pipe_dir: Path, *extra: str) -> subprocess.CompletedProcess:
    cmd = [
        sys.executable,
        "-m",
        "ptops",
        "pipeline",
        str(file),
        "--run-dir",
        str(pipe_dir),
        "--json",
        *extra,
    ]
    return subprocess.run(cmd, cwd=REPO, env=env(), capture_output=True, text=True, timeout=900)


def ptops(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "ptops", *args],
        cwd=REPO,
        env=env(),
        capture_output=True,
        text=True,
        timeout=300,
    )


def events(path: Path) -> list[dict]:
    return list(read_jsonl(path / "events.jsonl"))


def tree_state(d: Path) -> dict[str, tuple[int, int]]:
    """Every file under ``d`` with its mtime (ns) and size: 'untouched' means equal."""
    return {
        str(p.relative_to(d)): (p.stat().st_mtime_ns, p.stat().st_size)
        for p in sorted(d.rglob("*"))
        if p.is_file()
    }


@pytest.fixture(scope="module")
def main(tmp_path_factory):
    root = tmp_path_factory.mktemp("pipeline")
    file = root / "pipe.toml"
    file.write_text(MAIN)
    pipe = root / "pipe"
    uri = f"sqlite:///{root / 'mlflow.db'}"
    first = pipeline(file, pipe, "--mlflow", "--mlflow-uri", uri)  # the session: PTOPS_MLFLOW=0
    stage1 = pipe / "stages" / "01-sft"
    before = (
        {"tree": tree_state(stage1), "events": len(events(stage1))} if stage1.is_dir() else None
    )
    dpo_ckpts = sorted(
        p.name for p in (pipe / "stages" / "02-dpo" / "checkpoints").glob("checkpoint-*")
    )
    second = pipeline(file, pipe, "--mlflow", "--mlflow-uri", uri)
    return {
        "root": root,
        "file": file,
        "pipe": pipe,
        "uri": uri,
        "first": first,
        "second": second,
        "stage1_before": before,
        "dpo_ckpts_after_crash": dpo_ckpts,
    }


@pytest.fixture(scope="module")
def gated(tmp_path_factory):
    root = tmp_path_factory.mktemp("gated")
    file = root / "gated.toml"
    file.write_text(GATED)
    pipe = root / "pipe"
    return {"file": file, "pipe": pipe, "first": pipeline(file, pipe, "--no-mlflow")}


def _out(proc) -> str:
    return f"exit {proc.returncode}\nstdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-5000:]}"


def test_crash_in_stage_2_stops_the_pipeline_and_the_rerun_resumes_stage_2_not_stage_1(main):
    first, second, pipe = main["first"], main["second"], main["pipe"]
    assert first.returncode == 1, _out(first)
    assert "error: pipeline stopped: stage 2/4 dpo failed (exit 1" in first.stderr, _out(first)
    assert "rerun the same command to resume" in first.stderr
    assert main["dpo_ckpts_after_crash"] == ["checkpoint-2"], (
        "the crash at step 3 leaves step 2 as last good"
    )
    assert second.returncode == 0, _out(second)
    # stage 1's run directory is untouched by the rerun: same files, mtimes, sizes, events
    stage1 = pipe / "stages" / "01-sft"
    assert main["stage1_before"] is not None
    assert tree_state(stage1) == main["stage1_before"]["tree"]
    assert len(events(stage1)) == main["stage1_before"]["events"]
    ev = events(pipe)
    starts = [i for i, e in enumerate(ev) if e["kind"] == "pipeline_started"]
    assert len(starts) == 2
    rerun = ev[starts[1] :]
    assert [e["stage"] for e in rerun if e["kind"] == "stage_skipped"] == ["sft"]
    assert not [e for e in rerun if e["kind"] == "stage_started" and e["stage"] == "sft"]
    dpo_starts = [e for e in ev if e["kind"] == "stage_started" and e["stage"] == "dpo"]
    assert [e["resumed"] for e in dpo_starts] == [False, True]
    # stage 2 resumed from its own checkpoint at step 2 (attempt 2), not from scratch
    dpo = pipe / "stages" / "02-dpo"
    assert [e["attempt"] for e in events(dpo) if e["kind"] == "launch"] == [1, 2]
    log = "".join((dpo / "logs" / "attempt-2" / f"rank-{r}.log").read_text() for r in (0, 1))
    assert "resuming from" in log and "checkpoint-2" in log, log[-2000:]
    steps2 = sorted({r["step"] for r in read_jsonl(dpo / "metrics.jsonl") if r.get("attempt") == 2})
    assert steps2 == [3, 4]


def test_each_stage_starts_from_the_previous_stages_verified_final_checkpoint(main):
    from ptops.ckpt import digest

    assert main["second"].returncode == 0, _out(main["second"])
    pipe = main["pipe"]
    ev = events(pipe)
    completed = {e["stage"]: e for e in ev if e["kind"] == "stage_completed"}
    assert set(completed) == {"sft", "dpo", "grpo", "rs"}
    for stage, inp in (("dpo", "sft"), ("grpo", "dpo"), ("rs", "grpo")):
        started = [e for e in ev if e["kind"] == "stage_started" and e["stage"] == stage]
        assert started and all(e["input_stage"] == inp for e in started)
        assert all(e["input_digest"] == completed[inp]["digest"] for e in started)
        assert all(e["input_checkpoint"] == completed[inp]["checkpoint"] for e in started)
        assert completed[inp]["checkpoint"].endswith("checkpoint-4")
        assert completed[stage]["checkpoint"].endswith(f"checkpoint-{2 if stage == 'rs' else 4}")
        # the recorded digest is the checkpoint's real one (`ptops ckpt digest`)
        assert digest(completed[inp]["checkpoint"]) == completed[inp]["digest"]
        sdir = Path(started[0]["run_dir"])
        # the stage's own record names its input, and its ranks loaded exactly that checkpoint
        own = [e for e in events(sdir) if e["kind"] == "stage_input"]
        assert own and all(e["input_digest"] == completed[inp]["digest"] for e in own)
        log = (sdir / "logs" / "attempt-1" / "rank-0.log").read_text()
        assert (
            f"[ptops.init_from rank 0] weights from {completed[inp]['checkpoint']} (verified)"
            in log
        )
    out = json.loads(main["second"].stdout)
    assert out["state"] == "completed" and out["exit_code"] == 0
    assert [s["digest"] for s in out["stages"]] == [
        completed[n]["digest"] for n in ("sft", "dpo", "grpo", "rs")
    ]
    gate = [e for e in ev if e["kind"] == "gate"]
    assert gate and all(
        g["stage"] == "sft" and g["passed"] and g["metric"] == "eval/heldout" for g in gate
    )


def test_status_on_a_pipeline_directory_shows_every_stage(main):
    pipe = main["pipe"]
    st = ptops("status", str(pipe), "--json")
    assert st.returncode == 0, st.stderr
    s = json.loads(st.stdout)
    assert s["state"] == "completed" and s["name"] == "pipe-test"
    rows = {r["name"]: r for r in s["stages"]}
    assert [r["name"] for r in s["stages"]] == ["sft", "dpo", "grpo", "rs"]
    assert all(
        r["state"] == "completed"
        and r["step"] == r["total_steps"] == (2 if r["name"] == "rs" else 4)
        for r in rows.values()
    )
    assert (
        rows["dpo"]["input_digest"] == rows["sft"]["digest"]
        and rows["grpo"]["input_digest"] == rows["dpo"]["digest"]
    )
    assert rows["sft"]["gate"]["passed"] is True and rows["sft"]["gate"]["threshold"] == 0.0
    text = ptops("status", str(pipe))
    assert text.returncode == 0
    for r in rows.values():
        assert r["name"] in text.stdout and r["digest"][:12] in text.stdout
    assert "gate eval/heldout >= 0: passed" in text.stdout


def test_mlflow_has_a_parent_run_and_one_nested_child_per_stage_with_digests(main):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(main["uri"])
    exp = client.get_experiment_by_name("pipe-test")
    runs = client.search_runs([exp.experiment_id])
    parent_id = json.loads((main["pipe"] / "mlflow.json").read_text())["run_id"]
    parent = client.get_run(parent_id)
    assert parent.info.status == "FINISHED" and parent.data.tags["ptops.state"] == "completed"
    children = {
        r.data.tags["ptops.stage"]: r
        for r in runs
        if r.data.tags.get("mlflow.parentRunId") == parent_id
    }
    assert set(children) == {"sft", "dpo", "grpo", "rs"}
    completed = {e["stage"]: e for e in events(main["pipe"]) if e["kind"] == "stage_completed"}
    for stage, inp in (("sft", None), ("dpo", "sft"), ("grpo", "dpo"), ("rs", "grpo")):
        c = children[stage]
        assert c.data.tags["ptops.output_digest"] == completed[stage]["digest"]
        assert parent.data.tags[f"ptops.stage.{stage}.output_digest"] == completed[stage]["digest"]
        assert c.data.params["ptops.input_digest"] == (completed[inp]["digest"] if inp else "")
        assert c.info.status == "FINISHED"
        assert "loss" in c.data.metrics, "the stage's own exporter logged into the child run"
    assert "eval/heldout" in children["grpo"].data.metrics


def test_eval_records_reach_metrics_and_the_reward_hacking_monitor_reads_them(main):
    from ptops.monitors.rl import RewardHackingMonitor

    grpo = main["pipe"] / "stages" / "03-grpo"
    recs = list(read_jsonl(grpo / "metrics.jsonl"))
    with_eval = sorted((r["rank"], r["step"]) for r in recs if "eval/heldout" in r)
    assert with_eval == [(0, 2), (0, 4), (1, 2), (1, 4)]
    for r in recs:
        if "eval/heldout" in r:
            assert 0.0 <= r["eval/heldout"] <= 1.0 and 0.0 <= r["eval/heldout_exact"] <= 1.0
    assert all("rewards_verifier_mean" in r for r in recs), (
        "the proxy is logged too (trl.verifier=true)"
    )
    mon = RewardHackingMonitor()
    for r in recs:
        mon.feed(r)
    assert mon.heldout_source(0) == ("eval", "eval/heldout")
    assert mon.heldout_source(1) == ("eval", "eval/heldout")


def test_rejection_sampling_stage_keeps_the_verifiers_best_of_n_and_fine_tunes_on_them(main):
    from ptops.recipes.trl.rejection import sha256

    assert main["second"].returncode == 0, _out(main["second"])
    ev = events(main["pipe"])
    rs = [e for e in ev if e["kind"] == "rejection_sampled"]
    assert len(rs) == 1 and rs[0]["stage"] == "rs" and rs[0]["n"] == 4 and rs[0]["prompts"] == 12
    grpo = next(e for e in ev if e["kind"] == "stage_completed" and e["stage"] == "grpo")
    assert rs[0]["source"] == grpo["checkpoint"], (
        "sampled from the input stage's verified final checkpoint"
    )
    data = Path(rs[0]["data"])
    rows = [json.loads(line) for line in data.read_text().splitlines()]
    assert len(rows) == rs[0]["kept"] >= 1 and sha256(data) == rs[0]["sha256"]
    assert all([m["role"] for m in r["messages"]] == ["user", "assistant"] for r in rows)
    # selection: the best of 4 scores at least the mean of all samples
    assert rs[0]["mean_best"] >= rs[0]["mean_sampled"]
    # the SFT stage trained on exactly that file, starting from GRPO's weights
    sdir = main["pipe"] / "stages" / "04-rs"
    assert json.loads((sdir / "recipe.json").read_text())["train"]["data_file"] == str(data)
    assert (
        json.loads((sdir / "recipe.json").read_text())["train"]["init_from"] == grpo["checkpoint"]
    )


def test_a_failing_gate_stops_the_pipeline_with_one_clear_message(gated):
    first, pipe = gated["first"], gated["pipe"]
    assert first.returncode == 1, _out(first)
    errors = [line for line in first.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, first.stderr
    assert errors[0] == (
        "error: pipeline stopped at stage 1/2 sft: gate failed: eval/heldout = 0 at step 2, "
        "needs >= 0.5"
    ), errors[0]
    assert not (pipe / "stages" / "02-dpo").exists(), "the stage after a failed gate never starts"
    s = json.loads(ptops("status", str(pipe), "--json").stdout)
    assert s["state"] == "failed" and [r["state"] for r in s["stages"]] == [
        "gate_failed",
        "pending",
    ]
    assert s["stages"][0]["gate"] == {
        "metric": "eval/heldout",
        "op": ">=",
        "threshold": 0.5,
        "value": 0.0,
        "step": 2,
        "passed": False,
    }
    # the same command again: stage 1 is not retrained (skipped by digest), the gate still says no
    again = pipeline(gated["file"], pipe, "--no-mlflow")
    assert again.returncode == 1 and "gate failed: eval/heldout = 0 at step 2" in again.stderr
    ev = events(pipe)
    assert [e["kind"] for e in ev].count("stage_started") == 1 and [
        e["stage"] for e in ev if e["kind"] == "stage_skipped"
    ] == ["sft"]
    # a stage's final checkpoint damaged after it completed: the pipeline refuses to build on it
    ck = Path(next(e for e in ev if e["kind"] == "stage_completed")["checkpoint"])
    weights = ck / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF
    weights.write_bytes(bytes(data))
    damaged = pipeline(gated["file"], pipe, "--no-mlflow")
    assert damaged.returncode == 1, _out(damaged)
    assert f"stage sft: its final checkpoint {ck} is no longer valid" in damaged.stderr, (
        damaged.stderr
    )


def test_bad_pipeline_files_get_one_line_and_exit_2(tmp_path):
    cases = {
        'name = "x"\n[[stage]]\nname = "a"\nrecipe = "trl-sft-tiny"\ninput = "b"\n': (
            "key 'stage.0.input': 'b' is not an earlier stage"
        ),
        'name = "x"\n[[stage]]\nname = "a"\nrecipe = "trl-sft-tiny"\ngate = { metric = '
        '"eval/heldout", value = 0.5 }\n': "key 'stage.0.gate.metric': eval/heldout needs a "
        "held-out eval",
        'name = "x"\n[[stage]]\nname = "a"\nrecipe = "titan-tiny"\nset = ["eval.interval=5"]\n': (
            "key 'eval.interval': not supported by engine \"titan\""
        ),
        'name = "x"\n[[stage]]\nname = "a"\nrecipe = "trl-sft-tiny"\nset = ["train.stepz=3"]\n': (
            "key 'train.stepz': unknown key"
        ),
        'name = "x"\n[[stage]]\nname = "a"\nrecipe = "trl-sft-tiny"\nfaults = '
        '["explode:step=1"]\n': "key 'stage.0.faults'",
        'name = "x"\n[[stage]]\nname = "a"\nkind = "rejection-sampling"\nrecipe = '
        '"trl-sft-tiny"\n': "key 'stage.0.input': a rejection-sampling stage samples from an "
        "earlier stage's "
        "checkpoint",
        'name = "x"\n[[stage]]\nname = "a"\nrecipe = "trl-sft-tiny"\n[[stage]]\nname = "b"\nkind '
        '= "rejection-sampling"\n'
        'recipe = "trl-dpo-tiny"\ninput = "a"\n': "key 'stage.1.recipe': a rejection-sampling "
        "stage fine-tunes with an SFT recipe",
    }
    for i, (text, expected) in enumerate(cases.items()):
        f = tmp_path / f"bad{i}.toml"
        f.write_text(text)
        p = ptops("pipeline", str(f), "--run-dir", str(tmp_path / f"run{i}"), "--no-mlflow")
        assert p.returncode == 2, p.stderr
        lines = p.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: ") and expected in lines[0], (
            expected,
            p.stderr,
        )
        assert not (tmp_path / f"run{i}").exists()


TITAN = """
name = "pipe-titan"

[[stage]]
name = "pretrain"
recipe = "titan-tiny"
set = ["train.steps=4", "checkpoint.interval=4"]

[[stage]]
name = "continue"
recipe = "titan-tiny"
input = "pretrain"
set = ["train.steps=2", "checkpoint.interval=2"]
"""


def test_a_titan_stage_starts_from_the_previous_stages_dcp_checkpoint(tmp_path):
    """TorchTitan's model-only initial load from the verified ``step-N``: stage 2's first loss is
    the trained model's, not a fresh init's (same seed, same first batch)."""
    file = tmp_path / "titan.toml"
    file.write_text(TITAN)
    pipe = tmp_path / "pipe"
    p = pipeline(file, pipe, "--no-mlflow")
    assert p.returncode == 0, _out(p)
    ev = events(pipe)
    done = {e["stage"]: e for e in ev if e["kind"] == "stage_completed"}
    started = next(e for e in ev if e["kind"] == "stage_started" and e["stage"] == "continue")
    assert started["input_digest"] == done["pretrain"]["digest"] and done["pretrain"][
        "checkpoint"
    ].endswith("step-4")
    s1, s2 = (pipe / "stages" / d for d in ("01-pretrain", "02-continue"))
    log = (s2 / "logs" / "attempt-1" / "rank-0.log").read_text()
    assert (
        f"[ptops.init_from rank 0] weights from {done['pretrain']['checkpoint']} (verified)" in log
    )
    first = {
        d: next(
            r["loss"] for r in read_jsonl(d / "metrics.jsonl") if r["rank"] == 0 and r["step"] == 1
        )
        for d in (s1, s2)
    }
    assert first[s2] < first[s1] - 0.1, first


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(
        f"/proc/{pid}/stat"
    ) as f:  # a zombie (exited, not reaped yet) is gone for our purpose
        return f.read().rsplit(")", 1)[1].split()[0] != "Z"


def _stage_pids_when_held(proc, stage: Path, step: int) -> list[int]:
    """Wait until the stage's hold before ``step`` fired (deterministic: the stage waits there),
    then its supervisor, torchrun and rank pids from ``status.json``."""
    import time

    deadline = time.monotonic() + 300
    while not any(
        e.get("kind") == "fault_injected" and e.get("step") == step
        for e in (events(stage) if (stage / "events.jsonl").is_file() else [])
    ):
        assert proc.poll() is None and time.monotonic() < deadline, (
            f"the stage never held at step {step}"
        )
        time.sleep(0.5)
    deadline = time.monotonic() + 60
    while True:
        status = json.loads((stage / "status.json").read_text())
        ranks = [r["pid"] for r in status.get("ranks", [])]
        if status.get("supervisor_pid") and len(ranks) == 2 or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert status.get("supervisor_pid") and len(ranks) == 2, status
    return [p for p in (status["supervisor_pid"], status.get("torchrun_pid"), *ranks) if p]


@pytest.fixture(scope="module")
def signalled(tmp_path_factory):
    """One stage (SFT, 6 steps), three runs of the same pipeline command:

    1. started with SIGINT *ignored* (inherited, as ``nohup`` or a script's background job start
       it), held before step 3, then SIGINT to the pipeline's pid only;
    2. the same command again: the stage resumes (attempt 2) and is held before step 4; then the
       pipeline is SIGKILLed (it cannot forward anything);
    3. the same command again: it finishes the stage.
    """
    import signal
    import time

    tmp = tmp_path_factory.mktemp("signals")
    file = tmp / "p.toml"
    file.write_text(
        'name = "pipe-sig"\n[[stage]]\nname = "sft"\nrecipe = "trl-sft-tiny"\n'
        'set = ["train.steps=6", "checkpoint.interval=2", "supervisor.grace_s=5"]\n'
        'faults = ["hold:step=3", "hold:step=4,attempt=2"]\n'
    )
    pipe = tmp / "pipe"
    stage = pipe / "stages" / "01-sft"
    cmd = [
        sys.executable,
        "-m",
        "ptops",
        "pipeline",
        str(file),
        "--run-dir",
        str(pipe),
        "--no-mlflow",
    ]
    out: dict = {"pipe": pipe, "stage": stage}

    def start(n: int, **kw) -> subprocess.Popen:
        # files, not pipes: after a SIGKILL nobody would drain a pipe, and the stage's prints would
        # block
        logs = [open(tmp / f"run{n}.{x}", "w") for x in ("out", "err")]
        return subprocess.Popen(
            cmd, cwd=REPO, env=env(), stdout=logs[0], stderr=logs[1], text=True, **kw
        )

    def gone(pids: list[int], within: float) -> list[int]:
        deadline = time.monotonic() + within
        while [p for p in pids if _alive(p)] and time.monotonic() < deadline:
            time.sleep(0.2)
        return [p for p in pids if _alive(p)]

    ignored = start(1, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    try:
        pids = _stage_pids_when_held(ignored, stage, 3)
        ignored.send_signal(signal.SIGINT)
        ignored.wait(timeout=180)
    finally:
        if ignored.poll() is None:
            ignored.kill()
            ignored.wait()
    out["int"] = {
        "code": ignored.returncode,
        "err": (tmp / "run1.err").read_text(),
        "left": gone(pids, 10),
        "pipe_events": events(pipe),
        "stage_events": events(stage),
    }

    killed = start(2)
    try:
        pids = _stage_pids_when_held(killed, stage, 4)
        killed.kill()
        killed.wait(timeout=30)
        left = gone(pids, 120)
    finally:
        if killed.poll() is None:
            killed.kill()
            killed.wait()
    out["kill"] = {
        "left": left,
        "pids": pids,
        "stage_events": events(stage),
        "pipe_events": events(pipe),
    }
    out["again"] = pipeline(file, pipe, "--no-mlflow")
    return out


def test_sigint_stops_a_pipeline_started_with_sigint_ignored(signalled):
    """The pipeline handles SIGINT itself even when it inherited SIGINT ignored: it forwards it to
    the running stage (which checkpoints and stops), records ``pipeline_stopped``, exits 130, and no
    process of the stage is left."""
    r = signalled["int"]
    assert r["code"] == 130, r["err"][-3000:]
    assert "error: pipeline stopped (interrupted)" in r["err"]
    assert [e["kind"] for e in r["pipe_events"]][-1] == "pipeline_stopped"
    stopped = [e for e in r["stage_events"] if e["kind"] == "stopped"]
    assert len(stopped) == 1 and stopped[0]["signal"] == signal_number("SIGINT"), stopped
    assert r["left"] == [], f"pids {r['left']} of the stage survived the pipeline's SIGINT"


def test_a_killed_pipeline_stops_its_stage_and_the_rerun_resumes_it(signalled):
    """SIGKILL of the pipeline while its stage is held: the kernel sends the stage's supervisor
    SIGTERM (``PR_SET_PDEATHSIG``), so the stage saves, records ``stopped`` and ends with its
    torchrun and ranks; the same command then resumes it from its own checkpoint and completes
    it."""
    r = signalled["kill"]
    assert r["left"] == [], f"pids {r['left']} of the stage ran on after their pipeline was killed"
    stopped = [e for e in r["stage_events"] if e["kind"] == "stopped"]
    assert [e["signal"] for e in stopped] == [signal_number("SIGINT"), signal_number("SIGTERM")], (
        stopped
    )
    assert [e["kind"] for e in r["pipe_events"]][
        -1
    ] == "stage_started"  # killed: it recorded nothing more
    again = signalled["again"]
    assert again.returncode == 0, _out(again)
    pipe, stage = signalled["pipe"], signalled["stage"]
    assert [e["resumed"] for e in events(pipe) if e["kind"] == "stage_started"] == [
        False,
        True,
        True,
    ]
    launches = [e for e in events(stage) if e["kind"] == "launch"]
    assert [e["attempt"] for e in launches] == [1, 2, 3] and launches[2]["from_step"] >= 4, launches
    assert max(r["step"] for r in read_jsonl(stage / "metrics.jsonl")) == 6


def signal_number(name: str) -> int:
    import signal

    return int(getattr(signal, name))


def test_checkpoint_references_in_set_name_earlier_stages_only(tmp_path):
    """``{checkpoint:NAME}`` in a stage's `set` (a distillation teacher, a reward model): validated
    against the earlier stages at load, expanded to the verified checkpoint path at run time."""
    from ptops.ops.pipeline.spec import PipelineError, expand, load, refs

    assert refs("trl.teacher={checkpoint:sft}") == ["sft"]
    assert (
        expand("trl.teacher={checkpoint:sft}", {"sft": "/p/stages/01-sft/checkpoints/checkpoint-6"})
        == "trl.teacher=/p/stages/01-sft/checkpoints/checkpoint-6"
    )
    ok = tmp_path / "ok.toml"
    ok.write_text(
        'name = "x"\n[[stage]]\nname = "a"\nrecipe = "trl-sft-tiny"\n[[stage]]\nname = "b"\n'
        'recipe = "trl-sft-tiny"\nset = ["train.data_file={checkpoint:a}"]\n'
    )
    pipe = load(ok)
    assert pipe.snapshot()["stages"][1]["set"] == [
        "train.data_file={checkpoint:a}"
    ]  # reruns compare the file's text
    bad = tmp_path / "bad.toml"
    bad.write_text(
        'name = "x"\n[[stage]]\nname = "a"\nrecipe = "trl-sft-tiny"\nset = '
        '["train.data_file={checkpoint:b}"]\n'
        '[[stage]]\nname = "b"\nrecipe = "trl-sft-tiny"\n'
    )
    with pytest.raises(
        PipelineError, match=r"key 'stage.0.set': \{checkpoint:b\} does not name an earlier stage"
    ):
        load(bad)


def test_the_shipped_pipeline_file_is_valid():
    from ptops.ops.pipeline.spec import load

    pipe = load(REPO / "recipes" / "pipelines" / "post-train-tiny.toml")
    assert [s.name for s in pipe.stages] == ["sft", "dpo", "grpo"]
    assert [s.input for s in pipe.stages] == [None, "sft", "dpo"]
