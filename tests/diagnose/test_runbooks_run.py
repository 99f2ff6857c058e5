"""Runbooks that run: every ```bash block of every runbook, executed as written against a real run.

The convention (runbooks/__init__.py): the reader sets ``RUN``; a ```bash block runs and must exit 0
under ``set -e -o pipefail``; a ```bash act block (first line ``# act: why``) acts on the run or the
cluster, or needs a live pid or the alert's host, and is not run here, by rule. Anything else is a
failure: no block is skipped silently.

Each runbook is run against the faulted run that shows its condition, or the closest one where no
faulted run does (MAPPING). The runs are the session's shared ``faulted_runs`` (made once); the RL
runbooks read a recorded real GRPO run (tests/data/obs-grpo, copied: no command may write into it).
Identical blocks (the Confirm and After blocks) run once per run directory.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO

BOOKS = REPO / "runbooks"
GRPO = REPO / "tests" / "data" / "obs-grpo"

FENCE = re.compile(r"^```([^\n`]*)\n(.*?)^```[ \t]*$", re.S | re.M)
SHELL_TAGS = {"", "bash", "sh", "shell", "console", "zsh"}
PLACEHOLDER = re.compile(r"<[A-Za-z_ -]+>|\bPID\b|attempt-N\b|rank-R\b|runs/<")

# runbook -> the run its commands run against (faulted_runs kind, or "grpo")
MAPPING = {
    "CheckpointCorrupt": "corrupt",
    # no faulted run fails a save; the corrupt run's checkpoints are closest
    "CheckpointSaveFailing": "corrupt",
    "CheckpointStale": "crash",  # no run trains an hour without a checkpoint
    "EntropyCollapse": "grpo",  # the RL runbooks: a real GRPO run (no collapse in it)
    # a real GRPO run without an engine (tests/trl/test_vllm_engine.py stops one on stale weights)
    "EngineStaleWeights": "grpo",
    "TrainInferenceMismatch": "grpo",
    # a real GRPO run whose graders all answered (tests/trl/test_grader_seam.py fails one)
    "GraderNoVerdict": "grpo",
    "KLDrift": "grpo",
    "RewardHacking": "grpo",
    "StaleRollouts": "grpo",
    "GPUErrors": "straggler",  # no GPU here; a slow rank is what a throttled GPU looks like
    "GoodputLow": "crash",  # restarts and redone steps
    "LossSpike": "nan",
    "LossPlateau": "crash",  # the monitor is off by default: no run has a plateau finding
    "MemoryForecast": "crash",  # any run: every rank records its memory each step
    "NodeUnhealthy": "crash",  # any run: its nodes are checked before every attempt
    "SilentDataCorruption": "crash",  # any run: the sdc checks run on every titan run
    "StragglerRank": "straggler",
    # no faulted run falls behind (that takes thousands of ranks); a hang's timing is what it delays
    "SupervisorBehind": "hang",
    "TrainingCrashLoop": "crash",
    "TrainingHang": "hang",
    "TrainingNaN": "nan",
    "TrainingStalled": "hang",
}

# what the output must mention, where that is what the runbook says the commands show
EXPECT = {
    "NodeUnhealthy": ["checkpoint_space: ok", "rendezvous: ok"],
    "CheckpointCorrupt": [
        "checkpoint_invalid",
        "step-8",
        "verify exit 1",
        "last good checkpoint: ",
    ],
    "CheckpointStale": ["ptops_checkpoint_age_seconds", '"interval"', "mean_step_s"],
    "EntropyCollapse": ['"entropy":', '"kl":', "no rank-0 log"],
    "KLDrift": ['"kl":', '"beta":0.1'],
    "RewardHacking": ['"rewards_format_mean":'],
    "EngineStaleWeights": ["no engine keys", "no engine sidecar log", "no server-mode weights"],
    "TrainInferenceMismatch": ["no [trl.vllm] section"],
    "GPUErrors": ["rank 1 host"],
    "GoodputLow": ["ptops_goodput_ratio", '"kind":"restart"', "startup_s"],
    "LossSpike": ['"loss":"nan"'],
    "StragglerRank": ['"monitor":"straggler"', '"mean_step_s"'],
    "SupervisorBehind": ["ptops_supervisor_behind", '"metrics_lines":"rank"', '"nproc":2'],
    "TrainingCrashLoop": [
        '"exit_code":-9',
        "last crash: attempt 1 rank 1",
        "no out-of-memory message",
        "ok: ",
        "step-10 (dcp",
    ],
    "TrainingHang": ['"why":"unresponsive"', "silent rank: attempt 1 rank 0", "File "],
    "TrainingNaN": ['"monitor":"nan"', '"loss":"nan"', '"kind":"rollback"'],
    "TrainingStalled": ["supervisor_alive", "ptops_last_progress_timestamp_seconds", "rank-0.log"],
}


def blocks(text: str) -> list[tuple[str, str]]:
    """``[(tag, body)]`` for every fenced block; tag is "run", "act" or the bad tag itself."""
    out = []
    for info, body in FENCE.findall(text):
        info = info.strip()
        if info == "bash":
            out.append(("run", body))
        elif info == "bash act":
            out.append(("act", body))
        elif info.split(" ")[0] in SHELL_TAGS:
            out.append((f"bad fence {info!r}", body))
    return out


def _books() -> list[str]:
    return sorted(p.stem for p in BOOKS.glob("*.md"))


def test_every_block_is_run_or_marked_act():
    names = _books()
    assert names and set(MAPPING) == set(names), (
        f"MAPPING and runbooks/ disagree: {set(MAPPING) ^ set(names)}"
    )
    for name in names:
        text = (BOOKS / f"{name}.md").read_text()
        found = blocks(text)
        assert text.count("```") == 2 * len(FENCE.findall(text)), (
            f"{name}: an unclosed or odd fence"
        )
        bad = [t for t, _ in found if t not in ("run", "act")]
        assert not bad, (
            f"{name}: {bad}: use ```bash (run by the test) or ```bash act (with a '# act:' line)"
        )
        run = [b for t, b in found if t == "run"]
        assert len(run) >= 2, f"{name}: expected at least the Confirm and After blocks to run"
        assert run[0].startswith(': "${RUN:?'), (
            f"{name}: the first block should stop early when RUN is unset"
        )
        for t, body in found:
            if t == "act":
                assert body.startswith("# act: "), (
                    f"{name}: an act block must start with '# act: <why>':\n{body}"
                )
            else:
                hit = PLACEHOLDER.search(body)
                assert not hit, (
                    f"{name}: placeholder {hit.group(0)!r} in a block that runs:\n{body}"
                )


def test_block_parser_sees_every_kind_of_fence():
    text = (
        "```bash\nls\n```\n\n```bash act\n# act: x\nrm "
        "y\n```\n\n```sh\nls\n```\n\n```toml\na=1\n```\n\n```\nls\n```\n"
    )
    assert [t for t, _ in blocks(text)] == ["run", "act", "bad fence 'sh'", "bad fence ''"]


@pytest.fixture(scope="module")
def block_cache():
    return {}


def _run_dir(kind: str, faulted_runs, tmp_path_factory) -> Path:
    if kind == "grpo":
        dst = tmp_path_factory.getbasetemp() / "runbooks-grpo" / "obs-grpo"
        if not dst.exists():
            shutil.copytree(GRPO, dst)
        return dst
    return faulted_runs.get(kind).run


def _env(run: Path) -> dict[str, str]:
    env = dict(os.environ)
    bindir = str(Path(sys.executable).parent)  # the venv's ptops
    env["PATH"] = bindir + os.pathsep + env.get("PATH", "")
    env["RUN"] = str(run)
    return env


@pytest.mark.parametrize("name", _books())
def test_runbook_commands_run(name, faulted_runs, tmp_path_factory, block_cache, have):
    have("jq")
    run = _run_dir(MAPPING[name], faulted_runs, tmp_path_factory)
    work = tmp_path_factory.mktemp(f"rb-{name}")
    before = sorted(p.relative_to(run) for p in run.rglob("*"))
    outputs = []
    for tag, body in blocks((BOOKS / f"{name}.md").read_text()):
        if tag == "act":
            # by rule (checked above): acts on the run/cluster, or needs a live pid or the alert's
            # host
            continue
        key = (str(run), body)
        if key not in block_cache:
            proc = subprocess.run(
                ["bash", "-e", "-o", "pipefail", "-c", body],
                cwd=work,
                env=_env(run),
                capture_output=True,
                text=True,
                timeout=300,
            )
            block_cache[key] = proc
        proc = block_cache[key]
        assert proc.returncode == 0, (
            f"{name} ({MAPPING[name]} run): block exited {proc.returncode}\n{body}\n"
            f"stdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-3000:]}"
        )
        outputs.append(proc.stdout + proc.stderr)
    text = "\n".join(outputs)
    for want in EXPECT.get(name, []):
        assert want in text, (
            f"{name} ({MAPPING[name]} run): output does not mention {want!r}:\n{text[-4000:]}"
        )
    after = sorted(p.relative_to(run) for p in run.rglob("*"))
    assert after == before, f"{name}: the commands changed the run directory"
