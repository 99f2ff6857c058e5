"""Your own training script under ptops (issue 22, point 3): ``ptops launch --supervise -- python
train.py``.

Real runs, 2 gloo ranks on CPU, made once for the module, three at a time (6 runs in all):

- the README's first command (examples/fsdp2, 12 steps, uninterrupted): the FSDP2 reference digest;
- examples/fsdp2 with a crash (rank 1, step 6) and, in attempt 2, a SIGSTOP (rank 0, step 10),
  shipped hang settings: restarted twice, final digest = the reference's;
- examples/accelerate: its reference (plain torchrun, no ptops: the script runs on its own) and the
  same faulted run plus a preemption in attempt 3 (saved on request, exit 143, relaunched: resumed
  exactly);
- examples/fsdp2 with a NaN loss at step 5: rolled back to step 4, lr x 0.5, completed;
- a script with no ptops API at all: a crash in attempt 1 and a Python hang in attempt 2 (at
  optimizer steps, which ptops counts without the API); restarted, the hang diagnosed with the
  script's stack.

Nothing races the clock: every fault fires at a step boundary the ranks reach themselves, and every
checkpoint a restart needs is committed synchronously before the step that fails.
"""

from __future__ import annotations

import ast
import json
import os
import re
import shlex
import subprocess
import sys
import textwrap
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from conftest import PTOPS, REPO, run_ptops

from ptops.ops.supervisor.launcher import free_port

FAST = [
    "--no-mlflow",
    "--set",
    "supervisor.restart.backoff_s=0.2",
]  # hang settings stay the shipped ones
WARM = [
    "--set",
    "supervisor.restart.warm_spare=true",
]  # restarts fork ranks with torch imported (2-core box)
CHAOS = [
    *WARM,
    "--set",
    "checkpoint.interval=4",
    "--fault",
    "crash:rank=1,step=6",
    "--fault",
    "hang:rank=0,step=10,mode=stop,attempt=2",
]


def _events(run: Path) -> list[dict]:
    return [json.loads(x) for x in (run / "events.jsonl").read_text().splitlines() if x.strip()]


def _kinds(run: Path, kind: str) -> list[dict]:
    return [e for e in _events(run) if e["kind"] == kind]


def _launch_argv(run: Path, *args: str, command: list[str]) -> list[str]:
    return [*PTOPS, "launch", "--supervise", "--run-dir", str(run), *FAST, *args, "--", *command]


def _digest(path: Path) -> str:
    from ptops.ckpt import digest

    key = str(Path(path).resolve())
    if key not in _DIGESTS:
        _DIGESTS[key] = digest(path)
    return _DIGESTS[key]


_DIGESTS: dict[str, str] = {}


def readme_first_launch() -> list[str]:
    """The first ``ptops launch`` command of examples/README.md, as a user would type it."""
    text = (REPO / "examples" / "README.md").read_text()
    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        joined = block.replace("\\\n", " ")
        for line in joined.splitlines():
            if line.strip().startswith("ptops launch"):
                return shlex.split(line)
    raise AssertionError("examples/README.md has no `ptops launch` command")


def _readme_argv(run: Path) -> list[str]:
    """The README's first command, as written, from the repository root; only its run directory
    moves to the test's folder, and MLflow is off."""
    argv = readme_first_launch()
    assert argv[:2] == ["ptops", "launch"] and "--" in argv
    cut = argv.index("--")
    opts, command = argv[2:cut], argv[cut:]
    if "--run-dir" in opts:
        i = opts.index("--run-dir")
        del opts[i : i + 2]
    return [*PTOPS, "launch", *opts, "--run-dir", str(run), "--no-mlflow", *command]


FSDP2 = ["python", "examples/fsdp2/train.py", "--steps", "12"]
ACCEL = ["python", "examples/accelerate/train.py", "--cpu", "--steps", "12"]

NO_API = '''
"""A training script that knows nothing of ptops."""
import sys
import torch
import torch.distributed as dist

dist.init_process_group("gloo")
torch.manual_seed(0)
model = torch.nn.Linear(8, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for i in range(int(sys.argv[1])):
    loss = model(torch.randn(4, 8)).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    for p in model.parameters():
        dist.all_reduce(p.grad)
    opt.step()
dist.destroy_process_group()
'''


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Every run of this file, three at a time (most of a run is start-up and waiting for a fault's
    detection; the 2-core box has room for three). Each is held only by its own faults."""
    root = tmp_path_factory.mktemp("byo")
    script = root / "plain_train.py"
    script.write_text(textwrap.dedent(NO_API))
    plan = {  # the longest first
        "fsdp2-faulted": _launch_argv(root / "fsdp2-faulted", *CHAOS, command=FSDP2),
        # ... and a preemption in attempt 3 (SIGTERM at step 9; the ranks are held before step 10
        # until the stop request reaches them): every rank saves step 9 or 10 on request, the launch
        # exits 143, the same command again resumes
        "accel-faulted": _launch_argv(
            root / "accel-faulted",
            *CHAOS,
            "--fault",
            "preempt:step=9,attempt=3",
            "--fault",
            "hold:step=10,attempt=3",
            command=ACCEL,
        ),
        "no-api": _launch_argv(
            root / "no-api",
            *WARM,
            "--fault",
            "crash:rank=1,step=3",
            "--fault",
            "hang:rank=0,step=4,attempt=2",
            command=["python", str(script), "6"],
        ),
        "fsdp2-nan": _launch_argv(
            root / "fsdp2-nan",
            *WARM,
            "--set",
            "checkpoint.interval=2",
            "--set",
            "monitors.rollback.lr_scale=0.5",
            "--fault",
            "nan:step=5",
            command=["python", "examples/fsdp2/train.py", "--steps", "6"],
        ),
        "fsdp2-ref": _readme_argv(root / "fsdp2-ref"),
        # the Accelerate reference runs without ptops at all (plain torchrun, in its own folder):
        # the script stays runnable on its own, its checkpoints land in ./checkpoints with the same
        # layout
        "accel-ref": [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node",
            "2",
            "--master-addr",
            "127.0.0.1",
            "--master-port",
            str(free_port()),
            str(REPO / "examples" / "accelerate" / "train.py"),
            *ACCEL[2:],
        ],
    }
    (root / "accel-ref").mkdir()

    def one(name: str) -> subprocess.CompletedProcess:
        cwd = root / name if name == "accel-ref" else REPO
        run = lambda: subprocess.run(  # noqa: E731
            plan[name],
            cwd=cwd,
            capture_output=True,
            text=True,
            timeout=900,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
        proc = run()
        if name == "accel-faulted":  # preempted: the same command again resumes the run
            first = proc
            assert first.returncode == 143, (
                f"accel-faulted: exit {first.returncode}\n{first.stderr[-4000:]}"
            )
            proc = run()
        return proc

    with ThreadPoolExecutor(max_workers=3) as pool:
        done = dict(zip(plan, pool.map(one, plan)))
    return {name: (root / name, proc) for name, proc in done.items()}


def _ok(runs: dict, name: str) -> Path:
    run, proc = runs[name]
    assert proc.returncode == 0, f"{name}: exit {proc.returncode}\n{proc.stderr[-4000:]}"
    return run


def _check_recovered(run: Path, ref: Path, attempts: int = 3) -> None:
    crashes, hangs = _kinds(run, "crash"), _kinds(run, "hang")
    assert [c["attempt"] for c in crashes] == [1] and crashes[0]["rank"] == 1, crashes
    assert [h["attempt"] for h in hangs] == [2] and 0 in hangs[0]["ranks"], hangs
    restarts = _kinds(run, "restart")
    assert [r["from_step"] for r in restarts] == [4, 8], restarts
    assert _kinds(run, "completed")
    st = json.loads((run / "status.json").read_text())
    assert st["state"] == "completed" and st["attempt"] == attempts, st
    # exact resume: the same model and optimizer as the uninterrupted run
    assert (run / "checkpoints" / "step-12").is_dir()
    assert _digest(run) == _digest(ref)


def test_readme_first_command_runs_and_checkpoints_digestibly(runs):
    ref = _ok(runs, "fsdp2-ref")
    st = json.loads((ref / "status.json").read_text())
    assert st["state"] == "completed" and st["attempt"] == 1, st
    recipe = json.loads((ref / "recipe.json").read_text())
    assert recipe["engine"] == "script"
    assert recipe["script"]["command"][:2] == ["python", "examples/fsdp2/train.py"]
    assert (ref / "recipe.toml").is_file()
    # the API's step records reached the monitors' stream; default interval 10 plus the last step
    recs = [json.loads(x) for x in (ref / "metrics.jsonl").read_text().splitlines()]
    assert sorted({r["step"] for r in recs}) == list(range(1, 13))
    assert all(isinstance(r["loss"], float) and isinstance(r["grad_norm"], float) for r in recs)
    assert [e["step"] for e in _kinds(ref, "checkpoint")] == [10, 12]
    d = run_ptops("ckpt", "digest", str(ref))  # the CLI reads (and verifies) the API's checkpoints
    assert d.returncode == 0 and d.stdout.split()[-1] == _digest(ref), d.stderr


def test_fsdp2_recovers_crash_and_sigstop_to_the_reference_digest(runs):
    _check_recovered(_ok(runs, "fsdp2-faulted"), _ok(runs, "fsdp2-ref"))


def test_accelerate_recovers_crash_and_sigstop_to_the_reference_digest(runs):
    plain = _ok(runs, "accel-ref")
    assert sorted(p.name for p in (plain / "checkpoints").glob("step-*")) == ["step-10", "step-12"]
    run = _ok(runs, "accel-faulted")
    # the preemption: a save on request (step 9 or 10, neither an interval step), a stop, a resume
    # from it
    stopped = [e["step"] for e in _kinds(run, "stopped")]
    assert len(stopped) == 1 and stopped[0] in (9, 10), _kinds(run, "stopped")
    assert stopped[0] in [e["step"] for e in _kinds(run, "checkpoint") if e.get("attempt") == 3]
    assert [e["from_step"] for e in _kinds(run, "launch") if e["attempt"] == 4] == stopped
    _check_recovered(run, plain / "checkpoints", attempts=4)


def test_nan_rolls_back(runs):
    run = _ok(runs, "fsdp2-nan")
    rb = _kinds(run, "rollback")
    assert len(rb) == 1 and rb[0]["from_step"] == 5 and rb[0]["to_step"] == 4, rb
    applied = {e["what"]: e for e in _kinds(run, "rollback_applied")}
    assert applied["lr"]["lr_factor"] == 0.5 and applied["skip"]["step"] == 5, applied
    recs = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert any(r["step"] == 5 and r["loss"] == "nan" for r in recs)
    last = [r for r in recs if r["step"] == 6 and r.get("attempt") == 2]
    assert last and all(isinstance(r["loss"], float) for r in last), last
    assert abs(last[0]["lr"] - 1.5e-3) < 1e-9  # the example's 3e-3 x 0.5


def test_a_script_without_the_api_is_restarted_and_its_hang_diagnosed_with_stacks(runs):
    run = _ok(runs, "no-api")
    assert [c["attempt"] for c in _kinds(run, "crash")] == [1]
    assert [h["attempt"] for h in _kinds(run, "hang")] == [2]
    assert len(_kinds(run, "restart")) == 2 and _kinds(run, "completed")
    d = run_ptops("diagnose", str(run), "--json", timeout=300)
    assert d.returncode == 0, d.stderr
    rep = json.loads(d.stdout)
    hang = [i for i in rep["incidents"] if i["kind"] == "hang"]
    assert len(hang) == 1 and hang[0]["rank"] == 0 and hang[0]["runbook"] == "TrainingHang", hang
    frames = hang[0]["details"]["stacks"]["frames"]
    # the stuck rank's stack: the script's own line (its optimizer.step, where ptops counts the
    # step), then the fault; the other rank waits in the script's all_reduce
    assert any("plain_train.py" in f for f in frames["0"]) and frames["0"][-1].startswith(
        "_hang"
    ), frames
    assert any("plain_train.py" in f for f in frames["1"]), frames
    assert frames["1"][-1].startswith("all_reduce"), frames


# Warnings in rank logs that ptops caused, as they read before issue 47 (point 3): the supervisor
# set the flight recorder's pre-2.8 name, which torch 2.13 reads with
# "[W... Utils.hpp:137] Warning: Environment variable TORCH_NCCL_TRACE_BUFFER_SIZE is deprecated;
# use TORCH_FR_BUFFER_SIZE instead (function operator())" as the first lines of every rank log.
NOISE = re.compile(r"warn|deprecat", re.I)


def test_rank_logs_hold_no_warning_caused_by_ptops(runs):
    """Every rank log of every ptops launch of this module (crashes, hangs, a rollback, a preemption
    included): no warning or deprecation line at all (the scripts here cause none themselves)."""
    seen = {}
    for name, (run, _) in runs.items():
        if name == "accel-ref":  # plain torchrun, no ptops
            continue
        logs = sorted(run.glob("logs/attempt-*/rank-*.log"))
        assert logs, f"{name}: no rank logs"
        for log in logs:
            for line in log.read_text(errors="replace").splitlines():
                if NOISE.search(line):
                    seen.setdefault(line.split("] ", 1)[-1], []).append(
                        str(log.relative_to(run.parent))
                    )
    assert not seen, "\n".join(f"{k}  ({len(v)} logs, e.g. {v[0]})" for k, v in seen.items())


def test_cli_help_and_errors():
    from typer.testing import CliRunner

    from ptops.ops.cli.app import app

    cli = CliRunner()
    h = cli.invoke(app, ["launch", "--help"])
    assert h.exit_code == 0 and "-- python examples/fsdp2/train.py" in h.output
    both = cli.invoke(app, ["launch", "titan-tiny", "--", "python", "x.py"])
    assert both.exit_code == 2 and "not both" in both.output
    none = cli.invoke(app, ["launch"])
    assert none.exit_code == 2 and "-- python train.py" in none.output
    dry = cli.invoke(
        app,
        [
            "launch",
            "--dry-run",
            "--set",
            "launch.nproc=3",
            "--",
            "python",
            "-u",
            "my_train.py",
            "--x",
        ],
    )
    assert dry.exit_code == 0, dry.output
    rec = json.loads(dry.output[: dry.output.rindex("}") + 1])
    assert rec["engine"] == "script" and rec["script"]["command"] == [
        "python",
        "-u",
        "my_train.py",
        "--x",
    ]
    assert rec["launch"]["nproc"] == 3 and rec["name"] == "my_train"
    assert rec["script"]["cwd"] == str(Path.cwd())


def test_python_target_parsing():
    from ptops.recipes.script.run import python_target

    assert python_target(["python", "-u", "train.py", "--lr", "1"]) == (
        "path",
        "train.py",
        ["--lr", "1"],
    )
    assert python_target(["python3", "-X", "dev", "-m", "pkg.train", "a"]) == (
        "module",
        "pkg.train",
        ["a"],
    )
    assert python_target(["python", "-c", "print(1)"]) == ("code", "print(1)", [])
    assert python_target(["bash", "run.sh"]) is None


def test_public_rank_api_imports_only_ckpt_and_the_rollback_contract():
    """ptops/rank.py (ARCHITECTURE.md): ptops.ckpt and ptops.recipes.rollback (stdlib only), nothing
    else."""
    tree = ast.parse((REPO / "ptops" / "rank.py").read_text())
    mods = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    mods |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    assert {m for m in mods if m.startswith("ptops")} == {"ptops.ckpt", "ptops.recipes.rollback"}


def test_one_save_path_runs_the_probe_hooks_in_order_and_aborts_a_failed_save(tmp_path):
    """``SaveTransaction.run`` (ckpt/lifecycle.py): what every engine's save does around its
    writer."""
    from ptops.ckpt import SaveTransaction, latest_good

    calls: list[str] = []

    class Faults:
        def __init__(self, fail: bool) -> None:
            self.fail = fail

        def on_checkpoint(self, step: int) -> None:
            calls.append(f"on_checkpoint:{step}")
            if self.fail:
                raise OSError(28, "No space left on device")

        def in_save(self, step: int) -> None:
            calls.append(f"in_save:{step}")

        def before_commit(self, step: int) -> None:
            calls.append(f"before_commit:{step}")

    class Probe:
        def __init__(self, fail_phase: bool = False) -> None:
            self.faults = Faults(fail_phase)

        def phase(self, name: str, step: int) -> None:
            calls.append(f"phase:{name}:{step}")

    def write(path: Path) -> None:
        import torch
        import torch.distributed.checkpoint as dcp

        calls.append("write")
        dcp.save({"w": torch.ones(4)}, checkpoint_id=str(path))

    ok = SaveTransaction(tmp_path, 2, name="step-2")
    assert ok.run(write, probe=Probe()), ok.error
    hooks = ["phase:checkpoint:2", "on_checkpoint:2", "in_save:2", "write", "before_commit:2"]
    assert calls == hooks
    assert latest_good(tmp_path, deep=True).step == 2
    calls.clear()
    full = SaveTransaction(tmp_path, 4, name="step-4")
    assert not full.run(write, probe=Probe(fail_phase=True)) and "No space left" in full.error
    assert calls == ["phase:checkpoint:4", "on_checkpoint:4"]  # nothing written or committed

    def broken(path: Path) -> None:
        raise RuntimeError("writer failed")

    bad = SaveTransaction(tmp_path, 6, name="step-6")
    assert not bad.run(broken) and "writer failed" in bad.error
    assert latest_good(tmp_path, deep=True).step == 2  # LATEST still names the last good save
